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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .anvil import Anvil
from .blockstore import Blockstore
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

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "parent": self.parent,
                "loss": self.loss, "nodes": self.nodes, "tx": self.tx, "block": self.block}


def run_lineage(run_dir: Path, rpc: str | None = None) -> tuple[RunRecord, list[LineageStep]]:
    """The committed step chain of the run in `run_dir`, oldest first."""
    record = RunRecord.load(run_dir)
    store = Blockstore(record.blocks_dir(run_dir))
    with open_ledger(run_dir, record, rpc) as ledger:
        records = ledger.steps(record.run_id)
    steps = []
    for rec in records:
        checkpoint = cid_from_digest(rec.checkpoint, DAG_CBOR)
        manifest = get_manifest(store, checkpoint)  # re-hashes against the on-chain digest
        ordered = sorted(rec.attestations, key=lambda a: (a["replica"], a["stage"]))
        steps.append(LineageStep(
            step=rec.step,
            checkpoint=str(checkpoint),
            parent=str(cid_from_digest(rec.parent, DAG_CBOR)),
            loss=manifest.metrics.get("eval_loss"),
            nodes=[a["node"] for a in ordered],
            tx=rec.tx,
            block=rec.block,
        ))
    return record, steps
