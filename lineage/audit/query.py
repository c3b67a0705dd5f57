"""Lineage queries: a run's checkpoint chain, read from the ledger and checked against
the content-addressed store.

    run_lineage(run_dir)                    # the run `dlx train` left in a directory
    ledger_lineage(ledger, store, run_id)   # any run on any ledger, blocks from any store
    checkpoint_lineage(ledger, store, cid)  # the ancestors of one checkpoint

The chain is the source of truth for order, signatures and status (pending, finalized,
rejected); every checkpoint it names is fetched from the blockstore (which re-hashes it
against its CID) for its metrics. A checkpoint's ancestry is walked through the manifests'
parent links in the store and each ancestor matched to its on-chain commit. Each step names
the replicas that took part (`replicas`: the chain's replica set, every replica on ledgers
before version 3; an uncommitted checkpoint's own list).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from multiformats import CID

from lineage.chain.ledger import DOMAIN_VERSION, Commit, Ledger
from lineage.chain.runrecord import RunRecord
from lineage.errors import BlockNotFoundError, ChainError, StorageError
from lineage.store import cbor
from lineage.store.cid import DAG_CBOR, cid_from_digest, digest_of, parse_cid
from lineage.store.manifest import Manifest, get_manifest

#: A step's status: on the current chain and final, on it and still challengeable,
#: rejected by an upheld challenge, or (a checkpoint in the store) never committed.
STATUSES = ("finalized", "pending", "rejected", "uncommitted")


@dataclass(frozen=True)
class LineageStep:
    step: int
    checkpoint: str
    parent: str
    loss: float | None
    nodes: list[str]
    tx: str
    block: int
    metrics: dict[str, float] = field(default_factory=dict)
    contributions: list[dict[str, Any]] = field(default_factory=list)
    status: str = "pending"
    rejected_by: int | None = None  # the upheld challenge that rejected the step
    replicas: list[int] = field(default_factory=list)  # the replica ids that took part, ascending

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "parent": self.parent,
                "status": self.status, "rejected_by": self.rejected_by, "replicas": self.replicas,
                "loss": self.loss, "nodes": self.nodes, "tx": self.tx, "block": self.block,
                "metrics": self.metrics, "contributions": self.contributions}


@dataclass(frozen=True)
class Lineage:
    """A run's history: where it lives, what it was configured with, and its steps (every
    commit in chain order, rejected ones included; or one checkpoint's ancestors)."""

    run_id: int
    name: str
    chain_id: int
    ledger: str
    registry: str
    genesis: str
    config_cid: str
    config: dict[str, Any]
    stakes: dict[str, int]
    steps: list[LineageStep]
    head: str = ""
    finalized_step: int = 0
    target: str | None = None  # set: the lineage of this one checkpoint
    # what each final step paid (issue 35), by step: {"share_wei": str, "paid": [node or "" per slot]}
    rewards: dict[int, dict[str, Any]] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "name": self.name, "chain_id": self.chain_id, "ledger": self.ledger,
                "registry": self.registry, "genesis": self.genesis, "config_cid": self.config_cid,
                "config": self.config, "head": self.head, "finalized_step": self.finalized_step,
                "target": self.target, "stakes": {k: str(v) for k, v in self.stakes.items()},
                "steps": [s.as_json() for s in self.steps],
                "rewards": {str(k): v for k, v in sorted(self.rewards.items())}}


def _plain(value: Any) -> Any:
    """DAG-CBOR values as JSON-friendly ones (bytes as 0x-hex, CIDs as strings: CIDv1 in
    base32, as `ipfs add` prints them)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    if isinstance(value, CID):  # a decoded link prints in its own base: show the canonical one
        return str(value) if value.version == 0 else value.encode("base32")
    return value


def run_lineage(run_dir: Path, rpc: str | None = None) -> Lineage:
    """The commits of the run in `run_dir`, oldest first."""
    record = RunRecord.load(run_dir)
    store = record.open_store(run_dir)
    with record.open_ledger(run_dir, rpc) as ledger:
        return ledger_lineage(ledger, store, record.run_id, name=record.name)


def ledger_lineage(ledger: Ledger, store: Any, run_id: int, *, name: str | None = None) -> Lineage:
    """Every commit of run `run_id` on `ledger`, in chain order, with its status; blocks
    come from `store`."""
    commits = ledger.commits(run_id)
    base, R = _run_base(ledger, store, run_id, name)
    steps = []
    for c in commits:
        checkpoint = cid_from_digest(c.record.checkpoint, DAG_CBOR)
        try:
            steps.append(_step(store, c.record.step, checkpoint, c, R))
        except BlockNotFoundError:
            if c.status != "rejected":
                raise
            # A rejected commit's blocks may be gone (never published, or collected):
            # the chain still says what was signed.
            steps.append(_step(store, c.record.step, checkpoint, c, R, manifest=False))
    return Lineage(**base, steps=steps)


def checkpoint_lineage(ledger: Ledger, store: Any, checkpoint: str | CID) -> Lineage:
    """The ancestors of `checkpoint` (genesis excluded, the checkpoint included), oldest
    first: walked through the manifests' parent links in `store`, each matched to its
    commit on `ledger` for its status, signers and transaction."""
    target = parse_cid(checkpoint) if not isinstance(checkpoint, CID) else checkpoint
    chain: list[tuple[CID, Manifest]] = []
    cid: CID | None = target
    while cid is not None:
        manifest = get_manifest(store, cid)
        chain.append((cid, manifest))
        if len(chain) > 1 and manifest.step != chain[-2][1].step - 1:
            raise StorageError(f"manifest {chain[-2][0]} (step {chain[-2][1].step}) links parent {cid} "
                               f"at step {manifest.step}")
        cid = manifest.parent
    chain.reverse()
    genesis_cid = chain[0][0]
    run_id = next((m.run for _, m in reversed(chain) if m.run is not None), None)
    if run_id is None:
        run_id = _run_of_genesis(ledger, genesis_cid)
    by_key = {(c.record.step, c.record.checkpoint): c for c in ledger.commits(run_id)}
    base, R = _run_base(ledger, store, run_id, None)
    if base["genesis"] != str(genesis_cid):
        raise ChainError(f"checkpoint {target} descends from genesis {genesis_cid}, not run {run_id}'s "
                         f"{base['genesis']}")
    steps = [_step(store, m.step, c, by_key.get((m.step, digest_of(c))), R, manifest=m) for c, m in chain[1:]]
    return Lineage(**base, steps=steps, target=str(target))


def _run_of_genesis(ledger: Ledger, genesis: CID) -> int:
    logs = ledger.logs(ledger.ledger.events.RunCreated(), {})
    runs = [int(log["args"]["runId"]) for log in logs if bytes(log["args"]["genesisDigest"]) == digest_of(genesis)]
    if len(runs) != 1:
        where = f"runs {', '.join(map(str, runs))}" if runs else "no run"
        raise ChainError(f"genesis {genesis} starts {where} on ledger {ledger.ledger.address}: give the run id")
    return runs[0]


def _run_base(ledger: Ledger, store: Any, run_id: int, name: str | None) -> tuple[dict[str, Any], int]:
    """The run-level fields of a `Lineage`, from the chain and the configuration block, and
    the run's replica count R."""
    created = ledger.run_created(run_id)
    stakes = {node: ledger.registry.stake_of(node) for node in created.nodes}
    head, _ = ledger.head(run_id)
    config_cid = cid_from_digest(created.config_digest, DAG_CBOR)
    config = _plain(cbor.decode(store.get(config_cid), f"config {config_cid}"))
    if name is None:
        job = config.get("job") if isinstance(config, dict) else None
        name = str(job.get("name", "")) if isinstance(job, dict) else ""
    return {"run_id": run_id, "name": name, "chain_id": ledger.chain.chain_id,
            "ledger": ledger.ledger.address, "registry": ledger.registry.address,
            "genesis": str(cid_from_digest(created.genesis_digest, DAG_CBOR)),
            "config_cid": str(config_cid), "config": config, "stakes": stakes,
            "head": str(cid_from_digest(head, DAG_CBOR)),
            "finalized_step": ledger.finalized_step(run_id), "rewards": _rewards(ledger, run_id)}, created.replicas


def _rewards(ledger: Ledger, run_id: int) -> dict[int, dict[str, Any]]:
    """What each final step of `run_id` paid, and to whom (a version 3 ledger's registry
    `StepRewarded` events; none before issue 35)."""
    from lineage.chain.rewards import step_rewards

    if ledger.version != DOMAIN_VERSION:
        return {}
    return {r.step: {"share_wei": str(r.share), "paid": list(r.paid)} for r in step_rewards(ledger, run_id)}


def _step(store: Any, step: int, checkpoint: CID, commit: Commit | None, R: int,
          manifest: Manifest | Literal[False] | None = None) -> LineageStep:
    """One step: its manifest (re-hashed against the checkpoint CID; `False`: not in the
    store, so no metrics or contribution CIDs) and, if it was committed, the chain's record
    (a run of `R` replicas)."""
    if manifest is None:
        manifest = get_manifest(store, checkpoint)
    if commit is None:
        assert isinstance(manifest, Manifest), "an uncommitted step is a checkpoint in the store"
        ids = manifest.replica_ids(R)
        contributions = [{"replica": ids[p] if p < len(ids) else p, "stage": s, "node": None, "cid": str(cid),
                          "loss": None, "data_shard": "0x" + manifest.data[p].hex() if p < len(manifest.data) else None}
                         for p, row in enumerate(manifest.contributions) for s, cid in enumerate(row)]
        return LineageStep(step=step, checkpoint=str(checkpoint),
                           parent=str(manifest.parent) if manifest.parent else "",
                           loss=manifest.metrics.get("eval_loss"), nodes=[], tx="", block=0,
                           metrics=dict(manifest.metrics), contributions=contributions, status="uncommitted",
                           replicas=list(ids))
    rec = commit.record
    ordered = sorted(rec.attestations, key=lambda a: (a["replica"], a["stage"]))
    metrics = dict(manifest.metrics) if manifest else {}
    contributions = [
        {"replica": a["replica"], "stage": a["stage"], "node": a["node"],
         "cid": _contribution_cid(manifest, R, a["replica"], a["stage"]) if manifest else None,
         "loss": a["lossMicros"] / 1e6, "data_shard": "0x" + bytes(a["dataShard"]).hex()}
        for a in ordered
    ]
    return LineageStep(
        step=rec.step,
        checkpoint=str(checkpoint),
        parent=str(cid_from_digest(rec.parent, DAG_CBOR)),
        loss=metrics.get("eval_loss"),
        nodes=[a["node"] for a in ordered],
        tx=rec.tx,
        block=rec.block,
        metrics=metrics,
        contributions=contributions,
        status=commit.status,
        rejected_by=commit.rejected_by,
        replicas=list(rec.replicas(R)),
    )


def _contribution_cid(manifest: Manifest, R: int, replica: int, stage: int) -> str | None:
    """The CID the manifest links for slot (replica, stage), by the replica's row; None
    when the manifest has no such slot (`dlx verify` says how it disagrees with the chain)."""
    ids = manifest.replica_ids(R)
    if replica not in ids or ids.index(replica) >= len(manifest.contributions):
        return None
    row = manifest.contributions[ids.index(replica)]
    return str(row[stage]) if stage < len(row) else None
