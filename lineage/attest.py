"""EIP-712 attestations: a node's signed statement of what it contributed to a step.

Typed data (DESIGN.md section 4), domain `{name: "DiLoCoXLedger", version: "1", chainId,
verifyingContract}`, primary type

    Contribution(uint256 runId, uint64 step, uint32 replica, uint32 stage, bytes32 parent,
                 bytes32 contribution, bytes32 dataShard, bytes32 codeHash, int64 lossMicros)

The ledger checks the same digest on chain (`TrainingLedger.commitStep`), so a signature
is bound to one chain, one ledger deployment, one run and one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eth_account import Account
from eth_account.messages import SignableMessage, encode_typed_data
from eth_utils import keccak

DOMAIN_NAME = "DiLoCoXLedger"
DOMAIN_VERSION = "1"

_TYPES = {
    "EIP712Domain": [
        {"name": "name", "type": "string"},
        {"name": "version", "type": "string"},
        {"name": "chainId", "type": "uint256"},
        {"name": "verifyingContract", "type": "address"},
    ],
    "Contribution": [
        {"name": "runId", "type": "uint256"},
        {"name": "step", "type": "uint64"},
        {"name": "replica", "type": "uint32"},
        {"name": "stage", "type": "uint32"},
        {"name": "parent", "type": "bytes32"},
        {"name": "contribution", "type": "bytes32"},
        {"name": "dataShard", "type": "bytes32"},
        {"name": "codeHash", "type": "bytes32"},
        {"name": "lossMicros", "type": "int64"},
    ],
}


@dataclass(frozen=True)
class Domain:
    chain_id: int
    verifying_contract: str


@dataclass(frozen=True)
class ContributionClaim:
    """What one (replica, stage) slot claims for one outer step."""

    run_id: int
    step: int
    replica: int
    stage: int
    parent: bytes
    contribution: bytes
    data_shard: bytes
    code_hash: bytes
    loss_micros: int

    def typed_data(self, domain: Domain) -> dict[str, Any]:
        return {
            "types": _TYPES,
            "primaryType": "Contribution",
            "domain": {
                "name": DOMAIN_NAME,
                "version": DOMAIN_VERSION,
                "chainId": domain.chain_id,
                "verifyingContract": domain.verifying_contract,
            },
            "message": {
                "runId": self.run_id,
                "step": self.step,
                "replica": self.replica,
                "stage": self.stage,
                "parent": self.parent,
                "contribution": self.contribution,
                "dataShard": self.data_shard,
                "codeHash": self.code_hash,
                "lossMicros": self.loss_micros,
            },
        }

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


def loss_micros(loss: float) -> int:
    """A loss as the int64 millionths carried in attestations."""
    return int(round(loss * 1_000_000))
