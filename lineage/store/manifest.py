"""Checkpoint manifests: DAG-CBOR nodes that link a checkpoint to its parent, its stage
shards, the node contributions that produced it and the job configuration.

A manifest's CID is the checkpoint's identity. Because `parent` is a CID link,
`ipfs dag get CID/parent/parent` walks history on any IPFS node holding the blocks.

    genesis: {version, step: 0, parent: null, config, stages, code}
    step t:  {version, run, step, parent, config, stages, contributions, data, metrics, code,
              [replicas], [replay]}

The rows of `contributions`, `data` and `replay` are the step's present replicas in
ascending id order: all R (`replicas` absent) or, for a partial step of an elastic run, the
replica ids `replicas` lists (present only when it is not every replica, so a full run's
manifests and CIDs are what they were before elastic training). `row(r)` maps replica id r
to its row. `contributions[row][s]` links that replica's stage-s contribution; `data[row]`
is the sha-256 of the tokens it trained on in this round. `replay[row][s]` (present when the
ranks published them; absent for the AllReduce baseline and older runs) links the start
state of the round that produced `contributions[row][s]` (`trainer.rounds.round_state`),
the input of replay verification (lineage/audit/replay.py).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import dag_cbor
from dag_cbor.encoding.err import CBORError
from multiformats import CID

from lineage.errors import StorageError

from . import cbor
from .blockstore import Blockstore
from .cid import DAG_CBOR, parse_cid

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    step: int
    parent: CID | None
    config: CID
    stages: list[CID]
    code: bytes
    run: int | None = None
    contributions: list[list[CID]] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    replay: list[list[CID]] = field(default_factory=list)
    # the present replica ids, ascending, when the step did not have all R (else empty)
    replicas: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.replicas and (list(self.replicas) != sorted(set(self.replicas)) or self.replicas[0] < 0):
            raise ValueError(f"a manifest's replicas are distinct ids in ascending order, not {self.replicas}")

    def replica_ids(self, replicas: int | None = None) -> tuple[int, ...]:
        """The replica ids of the rows, ascending: `replicas` when listed, else every
        replica (0..`replicas`-1; without a count, one per contributions row)."""
        if self.replicas:
            return tuple(self.replicas)
        return tuple(range(len(self.contributions) if replicas is None else replicas))

    def row(self, replica: int) -> int:
        """The row of replica id `replica` in contributions, data and replay; KeyError if
        the step did not have it."""
        ids = self.replica_ids()
        if replica not in ids:
            raise KeyError(f"replica {replica} is not in step {self.step} (its replicas: "
                           f"{', '.join(map(str, ids)) or 'none'})")
        return ids.index(replica)

    def to_node(self) -> dict[str, Any]:
        node: dict[str, Any] = {
            "version": MANIFEST_VERSION,
            "step": self.step,
            "parent": self.parent,
            "config": self.config,
            "stages": list(self.stages),
            "code": self.code,
        }
        if self.step > 0:
            node["run"] = self.run
            node["contributions"] = [list(row) for row in self.contributions]
            node["data"] = list(self.data)
            node["metrics"] = {k: _finite(k, v) for k, v in sorted(self.metrics.items())}
            if self.replay:  # absent rather than empty: older manifests keep their bytes
                node["replay"] = [list(row) for row in self.replay]
            if self.replicas:  # absent for a full step: its bytes are as before elastic runs
                node["replicas"] = list(self.replicas)
        return node

    def encode(self) -> bytes:
        return dag_cbor.encode(self.to_node())

    def metrics_digest(self) -> bytes:
        """The step's `metricsDigest` on the ledger: sha256 of the DAG-CBOR encoding of the
        manifest's metrics map, as the manifest stores it (sorted keys, finite values)."""
        return hashlib.sha256(dag_cbor.encode(self.to_node()["metrics"])).digest()

    @classmethod
    def decode(cls, block: bytes) -> Manifest:
        try:
            node = cbor.decode(block)
            if not isinstance(node, dict) or node.get("version") != MANIFEST_VERSION:
                raise ValueError("not a version-1 checkpoint manifest")
            return cls(
                step=int(node["step"]),
                parent=None if node["parent"] is None else parse_cid(node["parent"]),
                config=parse_cid(node["config"]),
                stages=[parse_cid(c) for c in node["stages"]],
                code=bytes(node["code"]),
                run=node.get("run"),
                contributions=[[parse_cid(c) for c in row] for row in node.get("contributions", [])],
                data=[bytes(d) for d in node.get("data", [])],
                metrics=dict(node.get("metrics", {})),
                replay=[[parse_cid(c) for c in row] for row in node.get("replay", [])],
                replicas=[_replica_id(r) for r in node.get("replicas", [])],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StorageError(f"malformed checkpoint manifest: {exc}") from None


def _replica_id(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"replica id {value!r} is not an integer")
    return value


def _finite(key: str, value: float) -> float | int:
    if isinstance(value, int):
        return value
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"metric {key} is {value}; DAG-CBOR forbids non-finite floats")
    return value


def put_manifest(store: Blockstore, manifest: Manifest) -> CID:
    return store.put(manifest.encode(), DAG_CBOR)


def get_manifest(store: Blockstore, cid: CID | str) -> Manifest:
    """The checkpoint manifest `cid`; a block that is not one is an error naming the CID."""
    block = store.get(cid)
    try:
        return Manifest.decode(block)
    except CBORError as exc:  # the decoder's further lines draw the bytes
        raise StorageError(f"{cid} is not a checkpoint manifest: not DAG-CBOR "
                           f"({str(exc).splitlines()[0]})") from None
    except StorageError as exc:
        raise StorageError(f"{cid}: {exc}") from None


def put_config(store: Blockstore, config: dict[str, Any]) -> CID:
    """Store the job configuration (a JSON-compatible dict) as a DAG-CBOR block."""
    return store.put(dag_cbor.encode(config), DAG_CBOR)
