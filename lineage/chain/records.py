"""The ledger's records: what `lineage.chain.ledger.Ledger` takes (`RunSpec`, `Attestation`)
and what it reads back from the chain (`StepRecord`, `Commit`, `CommitCall`, `RunInfo`,
challenges and their resolutions). Plain frozen dataclasses, importable without web3;
`lineage.chain.ledger` re-exports them, the import path the rest of the code uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .attest import compact_signature, expand_signature, replicas_in

#: Independence modes of a run (`ITrainingLedger.Independence`): what may not sign slots of
#: two replicas of one step, a node key or an operator's nodes.
INDEPENDENCE = {"keys": 0, "operators": 1}


@dataclass(frozen=True)
class Attestation:
    """One slot's signed claim, as `commitStep` takes it (`signature`: 65 bytes, r s v)."""

    replica: int
    stage: int
    contribution: bytes
    data_shard: bytes
    code_hash: bytes
    loss_micros: int
    signature: bytes
    new_shard: bytes = bytes(32)  # the co-signed stage shard digest (ledger version 2 on)
    replica_set: int = 0  # the step's replica bitmap the slot signed over (ledger version 3)

    def as_tuple(self) -> tuple:
        """The ledger's `Attestation` struct (version 3: with the replica set, and the
        signature as EIP-2098 r, vs)."""
        r, vs = compact_signature(self.signature)
        return (self.replica, self.stage, self.replica_set, self.contribution, self.data_shard,
                self.code_hash, self.loss_micros, self.new_shard, r, vs)


#: `createRun`'s admission rules (issue 35), by the name job files and the CLI use.
ADMISSION = {"closed": 0, "open": 1, "approved": 2}


@dataclass(frozen=True)
class RunSpec:
    """What `createRun` takes (`Ledger.create_run`): the run's shape, its members and its
    challenge terms. `independence` ("keys" or "operators", `INDEPENDENCE`) is what may not
    sign slots of two replicas of one step; `min_replicas` (None: `replicas`, every step
    has every replica) the fewest replicas a step may have. `admission` ("closed", "open"
    or "approved", `ADMISSION`) says who may join later, `reward_per_step` what the pool
    pays a final step, `fund_wei` what the creator puts in the pool at creation (issue 35)."""

    config_digest: bytes
    genesis_digest: bytes
    nodes: list[str]
    replicas: int
    stages: int
    challenge_window: int
    min_stake: int
    arbiters: list[str] | None = None
    quorum: int = 0
    independence: str = "keys"
    min_replicas: int | None = None
    admission: str = "closed"
    reward_per_step: int = 0
    fund_wei: int = 0


@dataclass(frozen=True)
class RunInfo:
    """A run's `RunCreated` event (`Ledger.run_created`). Before version 3 every step had
    every replica (`min_replicas` reads as `replicas`); version 1 knew only independent
    keys (`independence` 0)."""

    run_id: int
    creator: str
    config_digest: bytes
    genesis_digest: bytes
    replicas: int
    stages: int
    min_replicas: int
    nodes: tuple[str, ...]
    independence: int = 0

    @classmethod
    def from_event(cls, args: Any) -> RunInfo:
        return cls(run_id=int(args["runId"]), creator=str(args["creator"]),
                   config_digest=bytes(args["configDigest"]), genesis_digest=bytes(args["genesisDigest"]),
                   replicas=int(args["replicas"]), stages=int(args["stages"]),
                   min_replicas=int(args.get("minReplicas", args["replicas"])),
                   nodes=tuple(str(n) for n in args["nodes"]), independence=int(args.get("independence", 0)))


@dataclass(frozen=True)
class RunParams:
    """The challenge terms `createRun` was called with (`Ledger.run_params`); `min_stake`
    is None for a run created through another contract (the ledger keeps it private)."""

    arbiters: list[str]
    quorum: int
    min_stake: int | None
    challenge_window: int


@dataclass(frozen=True)
class CommitCall:
    """The decoded arguments of one `commitStep` transaction (`Ledger.commit_calls`): the
    attestations with their signatures, which no event carries. `replica_set` is None
    before version 3 (every replica); each attestation's `signature` is the 65-byte form
    (version 2 on sends EIP-2098's r, vs) and `new_shard` zero in version 1."""

    run_id: int
    step: int
    parent: bytes
    checkpoint: bytes
    contributions_root: bytes
    metrics_digest: bytes
    attestations: tuple[Attestation, ...]
    replica_set: int | None = None

    @classmethod
    def decode(cls, args: Any) -> CommitCall:
        """From `commitStep`'s arguments as web3 decodes them, of any ledger version."""
        return cls(run_id=int(args["runId"]), step=int(args["step"]), parent=bytes(args["parent"]),
                   checkpoint=bytes(args["checkpoint"]), contributions_root=bytes(args["contributionsRoot"]),
                   metrics_digest=bytes(args["metricsDigest"]),
                   attestations=tuple(_attestation(a) for a in args["attestations"]),
                   replica_set=int(args["replicaSet"]) if "replicaSet" in args else None)


def _attestation(a: Any) -> Attestation:
    signature = bytes(a["signature"]) if "signature" in a else expand_signature(a["r"], a["vs"])
    return Attestation(int(a["replica"]), int(a["stage"]), bytes(a["contribution"]), bytes(a["dataShard"]),
                       bytes(a["codeHash"]), int(a["lossMicros"]), signature,
                       bytes(a.get("newShard", bytes(32))), int(a.get("replicaSet", 0)))


@dataclass(frozen=True)
class StepInfo:
    """The ledger's stored record of a step (`Ledger.step_info`); `witness_hash` is version
    1's `signersHash`."""

    checkpoint: bytes
    witness_hash: bytes
    committed_at: int
    epoch: int
    open_challenges: int
    rejected: bool


@dataclass(frozen=True)
class ChallengeRecord:
    """A challenge as the ledger stores it (`Ledger.challenge`), with the evidence digest
    of its opening event (zero when none); `aggregate` is False before version 2."""

    challenge_id: int
    run_id: int
    step: int
    epoch: int
    replica: int
    stage: int
    resolved: bool
    aggregate: bool
    opened_at: int
    node: str
    challenger: str
    bond: int
    evidence: bytes


@dataclass(frozen=True)
class OpenedChallenge:
    """One `ChallengeOpened` event and what became of it (`Ledger.challenges`): `resolved`
    (ruled on or expired), `expired` (dismissed without a verdict), `upheld` (None until
    ruled on, and for an expired one), `tx` the opening transaction."""

    challenge_id: int
    run_id: int
    step: int
    node: str
    epoch: int
    replica: int
    stage: int
    challenger: str
    bond: int
    evidence: bytes
    resolved: bool
    expired: bool
    upheld: bool | None
    tx: str


@dataclass(frozen=True)
class Rejection:
    """One `StepRejected` event: `checkpoint` at `step` rejected by challenge `challenge_id`."""

    run_id: int
    step: int
    checkpoint: bytes
    challenge_id: int


@dataclass(frozen=True)
class StepRecord:
    """One `StepCommitted` event and its `ContributionAttested` companions."""

    step: int
    checkpoint: bytes
    parent: bytes
    contributions_root: bytes
    metrics_digest: bytes
    submitter: str
    tx: str
    block: int
    attestations: list[dict[str, Any]]
    shards_root: bytes | None = None  # keccak256 of the co-signed shard digests (version 2 on)
    replica_set: int | None = None  # the replicas present, a bitmap (version 3; before: all)

    def replicas(self, replicas: int) -> tuple[int, ...]:
        """The replica ids that took part in the step, ascending: its `replicaSet`, or all
        `replicas` of the run for a version 1 or 2 ledger (whose steps had every replica)."""
        return tuple(range(replicas)) if self.replica_set is None else replicas_in(self.replica_set)

    def shards(self, stages: int) -> list[bytes]:
        """The stage shard digests the step's first present replica co-signed, in stage
        order (version 2 and 3 events)."""
        first = min(int(a["replica"]) for a in self.attestations)
        by_slot = {(int(a["replica"]), int(a["stage"])): a for a in self.attestations}
        return [bytes(by_slot[(first, s)]["newShard"]) for s in range(stages)]


@dataclass(frozen=True)
class Commit:
    """One commit of a step and what became of it (`Ledger.commits`)."""

    record: StepRecord
    status: str  # finalized | pending | rejected
    rejected_by: int | None = None  # the upheld challenge that rejected it


@dataclass(frozen=True)
class Resolution:
    """What `resolveChallenge` did, read from its receipt's events."""

    challenge_id: int
    run_id: int
    step: int
    node: str
    upheld: bool
    slashed: int  # wei taken from the node (0: dismissed, or already slashed for this offence)
    reward: int  # wei of the slash credited to the challenger
    bond: int
    bond_to: str
    rejected_steps: list[int] = field(default_factory=list)
    slashed_nodes: list[str] = field(default_factory=list)  # every node slashed (an aggregate: its co-signers)
    head_step: int | None = None  # the new head after a rollback
    head: bytes | None = None
    tx: str = ""
