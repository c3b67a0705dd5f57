"""EIP-712 attestations: a node's signed statement of what it contributed to a step.

Typed data (DESIGN.md section 4), domain `{name: "DiLoCoXLedger", version: "3", chainId,
verifyingContract}`, primary type

    Contribution(uint256 runId, uint64 step, uint32 replica, uint32 stage, uint256 replicaSet,
                 bytes32 parent, bytes32 contribution, bytes32 dataShard, bytes32 codeHash,
                 int64 lossMicros, bytes32 newShard)

`replicaSet` is the bitmap of the replicas that took part in the step (bit r: replica r;
`replica_bitmap`), the set whose contributions the outer step averages: a node signs over
it, so after a membership change it may sign the same step again for another set, and the
ledger accepts a step only when every attestation names the step's set. `newShard` is the
digest of the new outer shard of the slot's stage that the node computed itself after the
outer step (`shard_digest`: its UnixFS file CID's sha-256, the digest the manifest links the
shard by); the present replicas of a stage co-sign it. Ledgers of version 2 (before
replica sets: every step had every replica) signed the message without `replicaSet`, and
version 1 (before co-signed shards) also without `newShard`: a `Domain` carries the version
of the ledger it names, and claims under versions 1 and 2 keep verifying.

The ledger checks the same digest on chain (`TrainingLedger.commitStep`), so a signature
is bound to one chain, one ledger deployment, one run and one step.

Where a commit is signed: this module forms every digest and signature of it, and nothing
else does. The step sink (workers/run/sink.py `LedgerSink`) builds one `ContributionClaim` per
slot; a signer signs each with the slot's key (`workers.run.sink.local_signer` in a local run;
in a queued run rank 0 publishes the claims as `ContributionClaim.as_doc` and every rank
signs its own after checking it against its own work, workers/queue/tasks.py); the ledger client
submits them with the step's `contributions_root` (`lineage.chain.ledger.Ledger.commit_step`,
EIP-2098 `compact_signature`); the verifier recovers each signer and recomputes both roots
(lineage.audit.verify). Arbiters sign a `Verdict` here too, and `SignedClaim` is the one
JSON form of a signed claim. Both messages share `TypedMessage` (domain, digest, sign,
recover). docs/FORMATS.md gives the bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eth_account import Account
from eth_account.messages import SignableMessage, encode_typed_data
from eth_utils import is_address, keccak, to_checksum_address

# Re-exported: defined there, so that ranks unpickle it without importing eth_account.
from lineage.store.unixfs import shard_digest as shard_digest
from trainer.errors import DlxError

DOMAIN_NAME = "DiLoCoXLedger"
#: The ledger version this code deploys and signs for.
DOMAIN_VERSION = "3"
#: Every ledger version a claim or a committed step may have been signed under.
DOMAIN_VERSIONS = ("1", "2", "3")

_DOMAIN_TYPE = [
    {"name": "name", "type": "string"},
    {"name": "version", "type": "string"},
    {"name": "chainId", "type": "uint256"},
    {"name": "verifyingContract", "type": "address"},
]
_CONTRIBUTION_V1 = [
    {"name": "runId", "type": "uint256"},
    {"name": "step", "type": "uint64"},
    {"name": "replica", "type": "uint32"},
    {"name": "stage", "type": "uint32"},
    {"name": "parent", "type": "bytes32"},
    {"name": "contribution", "type": "bytes32"},
    {"name": "dataShard", "type": "bytes32"},
    {"name": "codeHash", "type": "bytes32"},
    {"name": "lossMicros", "type": "int64"},
]
_CONTRIBUTION_V2 = [*_CONTRIBUTION_V1, {"name": "newShard", "type": "bytes32"}]
_CONTRIBUTION_V3 = [*_CONTRIBUTION_V2[:4], {"name": "replicaSet", "type": "uint256"}, *_CONTRIBUTION_V2[4:]]
_VERDICT = [{"name": "challengeId", "type": "uint256"}, {"name": "upheld", "type": "bool"}]


@dataclass(frozen=True)
class Domain:
    """The EIP-712 domain of one ledger deployment; `version` is the ledger's (its
    `eip712Domain()`), which fixes the `Contribution` type signed under it."""

    chain_id: int
    verifying_contract: str
    version: str = DOMAIN_VERSION

    def as_eip712(self) -> dict[str, Any]:
        """The domain as EIP-712 typed data names it."""
        return {"name": DOMAIN_NAME, "version": self.version, "chainId": self.chain_id,
                "verifyingContract": to_checksum_address(self.verifying_contract)}


def replica_bitmap(replicas: Iterable[int]) -> int:
    """A step's `replicaSet`: bit r set for each replica id r that took part."""
    bits = 0
    for r in replicas:
        if not 0 <= r < 256:
            raise ClaimError(f"replica {r} is outside a replica set's 256 bits")
        bits |= 1 << r
    return bits


def replicas_in(replica_set: int) -> tuple[int, ...]:
    """The replica ids a `replicaSet` bitmap names, ascending."""
    return tuple(r for r in range(replica_set.bit_length()) if replica_set >> r & 1)


def contributions_root(contributions: Iterable[bytes]) -> bytes:
    """A step's `contributionsRoot`: keccak256 of its slots' contribution digests, slot order
    (replica-major over the step's present replicas, ascending id), concatenated. The
    ledger stores it with the step."""
    return keccak(b"".join(bytes(c) for c in contributions))


def shards_root(shards: Iterable[bytes]) -> bytes:
    """A step's `shardsRoot` (ledger version 2): keccak256 of the co-signed new stage shard
    digests, stage order, concatenated."""
    return keccak(b"".join(bytes(s) for s in shards))


class TypedMessage:
    """An EIP-712 message in a ledger's domain: the one place digests are formed and signed.

    A subclass names its primary type and gives, per ledger version, its struct type and
    message (`struct`); `digest`, `sign` and `recover` are the same for every message.
    """

    PRIMARY_TYPE: str = ""

    def struct(self, version: str) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """(the primary type's fields, the message) under ledger version `version`."""
        raise NotImplementedError

    def typed_data(self, domain: Domain) -> dict[str, Any]:
        """The full EIP-712 document (types, primaryType, domain, message)."""
        fields, message = self.struct(domain.version)
        return {"types": {"EIP712Domain": _DOMAIN_TYPE, self.PRIMARY_TYPE: fields},
                "primaryType": self.PRIMARY_TYPE, "domain": domain.as_eip712(), "message": message}

    def signable(self, domain: Domain) -> SignableMessage:
        return encode_typed_data(full_message=self.typed_data(domain))

    def digest(self, domain: Domain) -> bytes:
        """The 32-byte EIP-712 digest that is signed (`\\x19\\x01 || domain || struct`)."""
        msg = self.signable(domain)
        return keccak(b"\x19" + msg.version + msg.header + msg.body)

    def sign(self, domain: Domain, key: Any) -> bytes:
        """65-byte (r, s, v) signature by `key` (a LocalAccount or private key)."""
        signed = Account.sign_message(self.signable(domain), private_key=key)
        return bytes(signed.signature)

    def recover(self, domain: Domain, signature: bytes) -> str:
        """The checksummed address that produced `signature`."""
        return Account.recover_message(self.signable(domain), signature=signature)


@dataclass(frozen=True)
class ContributionClaim(TypedMessage):
    """What one (replica, stage) slot claims for one outer step (`replica_set`: the step's
    `replicaSet` bitmap, signed from ledger version 3 on)."""

    PRIMARY_TYPE = "Contribution"

    run_id: int
    step: int
    replica: int
    stage: int
    parent: bytes
    contribution: bytes
    data_shard: bytes
    code_hash: bytes
    loss_micros: int
    new_shard: bytes = bytes(32)  # the co-signed stage shard digest (not signed under version 1)
    replica_set: int = 0  # the step's replica bitmap (signed from version 3 on, where 0 is refused)

    def struct(self, version: str) -> tuple[list[dict[str, str]], dict[str, Any]]:
        message = {
            "runId": self.run_id,
            "step": self.step,
            "replica": self.replica,
            "stage": self.stage,
            "parent": self.parent,
            "contribution": self.contribution,
            "dataShard": self.data_shard,
            "codeHash": self.code_hash,
            "lossMicros": self.loss_micros,
        }
        if version == "1":
            return _CONTRIBUTION_V1, message
        if len(self.new_shard) != 32:
            raise ClaimError(f"a version {version} claim needs a 32-byte newShard")
        if version == "2":
            return _CONTRIBUTION_V2, {**message, "newShard": self.new_shard}
        if not 0 < self.replica_set < 1 << 256 or not self.replica_set >> self.replica & 1:
            raise ClaimError(f"a version {version} claim needs its step's replicaSet, naming its own replica "
                             f"{self.replica} (got {self.replica_set:#x})")
        return _CONTRIBUTION_V3, {**message, "replicaSet": self.replica_set, "newShard": self.new_shard}

    def as_doc(self, version: str = DOMAIN_VERSION) -> dict[str, Any]:
        """The claim as JSON (the `claim` of a `SignedClaim`): camelCase, bytes32 0x-hex."""
        doc: dict[str, Any] = {}
        for key, (attr, kind) in _claim_fields(version).items():
            value = getattr(self, attr)
            doc[key] = "0x" + value.hex() if kind is bytes else int(value)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any], version: str = DOMAIN_VERSION) -> ContributionClaim:
        """Parse and check `as_doc`'s form; ClaimError names the first bad field."""
        fields = _claim_fields(version)
        values = {attr: _field(doc, key, kind) for key, (attr, kind) in fields.items()}
        unknown = set(doc) - set(fields)
        if unknown:
            raise ClaimError(f"unknown claim field(s): {', '.join(sorted(unknown))}")
        return cls(**values)


@dataclass(frozen=True)
class Verdict(TypedMessage):
    """An arbiter's ruling on a challenge: `Verdict(uint256 challengeId, bool upheld)`."""

    PRIMARY_TYPE = "Verdict"

    challenge_id: int
    upheld: bool

    def struct(self, version: str) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return _VERDICT, {"challengeId": self.challenge_id, "upheld": self.upheld}


def verdict_signable_digest(chain_id: int, ledger: str, challenge_id: int, upheld: bool) -> bytes:
    """The EIP-712 digest of `Verdict(challengeId, upheld)` in the ledger's domain."""
    return Verdict(challenge_id, upheld).digest(Domain(chain_id, ledger))


def sign_verdict(chain_id: int, ledger: str, challenge_id: int, upheld: bool, key: Any) -> bytes:
    """An arbiter's 65-byte signature on `Verdict(challengeId, upheld)`."""
    return Verdict(challenge_id, upheld).sign(Domain(chain_id, ledger), key)


class ClaimError(DlxError, ValueError):
    """A signed-claim document is malformed or does not prove what it is used for."""


def compact_signature(signature: bytes) -> tuple[bytes, bytes]:
    """A 65-byte (r, s, v) signature as EIP-2098's (r, vs), as the ledger takes it: s with
    y's parity (v - 27) in its top bit."""
    if len(signature) != 65 or signature[64] not in (27, 28):
        raise ClaimError("a signature is 65 bytes (r, s, v) with v 27 or 28")
    s = int.from_bytes(signature[32:64], "big") | ((signature[64] - 27) << 255)
    return signature[:32], s.to_bytes(32, "big")


def expand_signature(r: bytes, vs: bytes) -> bytes:
    """Inverse of `compact_signature`: the 65-byte (r, s, v) form."""
    word = int.from_bytes(vs, "big")
    s = word & ((1 << 255) - 1)
    return bytes(r) + s.to_bytes(32, "big") + bytes([27 + (word >> 255)])


def loss_micros(loss: float) -> int:
    """A loss as the int64 millionths carried in attestations."""
    return int(round(loss * 1_000_000))


#: The claim's JSON keys and whether each is a bytes32 (0x-hex) or an integer.
_CLAIM_FIELDS = {
    "runId": ("run_id", int), "step": ("step", int), "replica": ("replica", int),
    "stage": ("stage", int), "parent": ("parent", bytes), "contribution": ("contribution", bytes),
    "dataShard": ("data_shard", bytes), "codeHash": ("code_hash", bytes), "lossMicros": ("loss_micros", int),
}


@dataclass(frozen=True)
class SignedClaim:
    """A node's signed `Contribution` as a portable document, so tools can exchange evidence
    (`dlx slash-equivocation A.json B.json`) without a chain at hand:

        {"domain": {"name", "version", "chainId", "verifyingContract"},
         "claim": {"runId", "step", "replica", "stage", "replicaSet", "parent", "contribution",
                   "dataShard", "codeHash", "lossMicros", "newShard"},
         "signature": "0x..."}

    bytes32 fields and the signature (65 bytes, r s v) are 0x-hex, `replicaSet` an integer;
    the domain's name must be the ledger's and its version one the ledger has had
    (`newShard` exists from version 2 on, `replicaSet` from version 3 on), since a signature
    under any other domain proves nothing to it.
    """

    domain: Domain
    claim: ContributionClaim
    signature: bytes

    @classmethod
    def sign(cls, claim: ContributionClaim, domain: Domain, key: Any) -> SignedClaim:
        return cls(domain, claim, claim.sign(domain, key))

    def recover(self) -> str:
        """The checksummed address of the key that signed the claim."""
        try:
            return self.claim.recover(self.domain, self.signature)
        except Exception:  # eth_keys raises several types for a malformed signature
            raise ClaimError("the signature is malformed: it recovers to no key") from None

    def as_dict(self) -> dict[str, Any]:
        return {"domain": self.domain.as_eip712(), "claim": self.claim.as_doc(self.domain.version),
                "signature": "0x" + self.signature.hex()}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, doc: str | bytes | dict[str, Any]) -> SignedClaim:
        """Parse and check a document (JSON text or an already decoded dict)."""
        if not isinstance(doc, dict):
            try:
                doc = json.loads(doc)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ClaimError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ClaimError("a signed claim is a JSON object with domain, claim and signature")
        domain, claim, sig = doc.get("domain"), doc.get("claim"), doc.get("signature")
        if not isinstance(domain, dict) or not isinstance(claim, dict) or not isinstance(sig, str):
            raise ClaimError("a signed claim is a JSON object with domain, claim and signature")
        version = domain.get("version")
        if domain.get("name") != DOMAIN_NAME or version not in DOMAIN_VERSIONS:
            raise ClaimError(f"domain is {domain.get('name')!r} version {version!r}, "
                             f"not {DOMAIN_NAME!r} version {' or '.join(map(repr, DOMAIN_VERSIONS))}")
        contract = domain.get("verifyingContract")
        if not isinstance(contract, str) or not is_address(contract):
            raise ClaimError(f"domain.verifyingContract is not an address: {contract!r}")
        return cls(
            Domain(_int(domain.get("chainId"), "domain.chainId"), to_checksum_address(contract), version),
            ContributionClaim.from_doc(claim, version),
            _hex(sig, "signature", 65),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> SignedClaim:
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise ClaimError(f"claim file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ClaimError(f"cannot read claim file {path}: {exc}") from None
        try:
            return cls.from_json(text)
        except ClaimError as exc:
            raise ClaimError(f"{path}: {exc}") from None


def _claim_fields(version: str) -> dict[str, tuple[str, type]]:
    """The claim's JSON fields under ledger version `version`, in typed-data order."""
    if version == "1":
        return _CLAIM_FIELDS
    fields = {**_CLAIM_FIELDS, "newShard": ("new_shard", bytes)}
    if version == "2":
        return fields
    keys = list(fields)
    keys.insert(keys.index("parent"), "replicaSet")
    return {k: ("replica_set", int) if k == "replicaSet" else fields[k] for k in keys}


def _field(claim: dict[str, Any], key: str, kind: type) -> Any:
    if key not in claim:
        raise ClaimError(f"claim.{key} is missing")
    return _hex(claim[key], f"claim.{key}", 32) if kind is bytes else _int(claim[key], f"claim.{key}")


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClaimError(f"{name} is not an integer: {value!r}")
    return value


def _hex(value: Any, name: str, size: int) -> bytes:
    if not isinstance(value, str) or not value.startswith("0x"):
        raise ClaimError(f"{name} is not 0x-hex: {value!r}")
    try:
        raw = bytes.fromhex(value[2:])
    except ValueError:
        raise ClaimError(f"{name} is not 0x-hex: {value!r}") from None
    if len(raw) != size:
        raise ClaimError(f"{name} has {len(raw)} bytes, not {size}")
    return raw
