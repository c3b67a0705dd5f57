"""Lineage queries: a run's checkpoint chain, read from the ledger and checked against
the content-addressed store.

The chain is the source of truth for order and signatures; every checkpoint it names is
fetched from the blockstore (which re-hashes it against its CID) for its metrics.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dag_cbor
from multiformats import CID

from .anvil import Anvil
from .chain import Chain, Ledger
from .cid import DAG_CBOR, cid_from_digest
from .errors import ChainError
from .manifest import get_manifest
from .runrecord import RunRecord


@contextmanager
def open_ledger(run_dir: Path, record: RunRecord, rpc: str | None = None) -> Iterator[Ledger]:
    """Connect to the run's chain; for an embedded chain, start anvil on a copy of its state."""
    if rpc or record.rpc:
        yield Ledger(Chain(rpc or record.rpc, record.chain_id), record.registry, record.ledger)
        return
    state = run_dir / (record.chain_state or "")
    if not record.chain_state or not state.exists():
        raise ChainError(f"the run's chain state file is missing: {state}")
    with tempfile.TemporaryDirectory(prefix="dlx-chain-") as tmp:
        copy = Path(tmp) / "state.json"
        shutil.copyfile(state, copy)  # read from a copy: anvil rewrites its state at exit
        with Anvil(state_path=copy) as anvil:
            yield Ledger(Chain(anvil.url, record.chain_id), record.registry, record.ledger)


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

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "parent": self.parent,
                "loss": self.loss, "nodes": self.nodes, "tx": self.tx, "block": self.block,
                "metrics": self.metrics, "contributions": self.contributions}


@dataclass(frozen=True)
class Lineage:
    """A run's history: where it lives, what it was configured with, and its steps."""

    record: RunRecord
    config: dict[str, Any]
    stakes: dict[str, int]
    steps: list[LineageStep]

    def as_json(self) -> dict[str, Any]:
        r = self.record
        return {"run": r.run_id, "name": r.name, "chain_id": r.chain_id, "ledger": r.ledger,
                "registry": r.registry, "genesis": r.genesis, "config_cid": r.config,
                "config": self.config, "stakes": {k: str(v) for k, v in self.stakes.items()},
                "steps": [s.as_json() for s in self.steps]}


def _plain(value: Any) -> Any:
    """DAG-CBOR values as JSON-friendly ones (bytes as 0x-hex, CIDs as strings)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    if isinstance(value, CID):
        return str(value)
    return value


def run_lineage(run_dir: Path, rpc: str | None = None) -> Lineage:
    """The committed step chain of the run in `run_dir`, oldest first."""
    record = RunRecord.load(run_dir)
    store = record.open_store(run_dir)
    with open_ledger(run_dir, record, rpc) as ledger:
        records = ledger.steps(record.run_id)
        created = ledger.run_created(record.run_id)
        stakes = {node: ledger.stake_of(node) for node in created["nodes"]}
    config_cid = cid_from_digest(bytes(created["configDigest"]), DAG_CBOR)
    config = _plain(dag_cbor.decode(store.get(config_cid)))
    steps = []
    for rec in records:
        checkpoint = cid_from_digest(rec.checkpoint, DAG_CBOR)
        manifest = get_manifest(store, checkpoint)  # re-hashes against the on-chain digest
        ordered = sorted(rec.attestations, key=lambda a: (a["replica"], a["stage"]))
        contributions = [
            {"replica": a["replica"], "stage": a["stage"], "node": a["node"],
             "cid": str(manifest.contributions[a["replica"]][a["stage"]]),
             "loss": a["lossMicros"] / 1e6, "data_shard": "0x" + bytes(a["dataShard"]).hex()}
            for a in ordered
        ]
        steps.append(LineageStep(
            step=rec.step,
            checkpoint=str(checkpoint),
            parent=str(cid_from_digest(rec.parent, DAG_CBOR)),
            loss=manifest.metrics.get("eval_loss"),
            nodes=[a["node"] for a in ordered],
            tx=rec.tx,
            block=rec.block,
            metrics=dict(manifest.metrics),
            contributions=contributions,
        ))
    return Lineage(record, config, stakes, steps)
