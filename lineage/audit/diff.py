"""What changed between two checkpoints (`dlx lineage diff A B`), of one run or of two.

Per tensor of every stage shard (outer parameters and outer momentum): the L2 norm of
B - A, that norm relative to A's norm, and the largest absolute change; per metric the
two values and B - A; and a summary of the parameters: the relative change of the whole
model and of each stage, and the tensors that changed most relative to their size. Each
checkpoint's manifest and shards are read from its own store (two runs keep two),
re-hashed against their CIDs. Norms are computed in float64, so small changes are not lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from multiformats import CID
from safetensors.numpy import load as st_load

from lineage.errors import StorageError
from lineage.store.cid import parse_cid
from lineage.store.manifest import Manifest, get_manifest
from lineage.store.unixfs import read_bytes


@dataclass(frozen=True)
class TensorChange:
    stage: int
    name: str  # the shard key, e.g. "param/blocks.0.attn.qkv.weight" or "momentum/..."
    shape: list[int]
    l2: float  # ||B - A||
    rel: float  # ||B - A|| / ||A|| (inf when A is zero and B is not)
    max_abs: float  # max |B - A|
    status: str = "changed"  # changed | same | added | removed | reshaped
    norm_a: float = 0.0  # ||A|| (0 when A has no such tensor)

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "name": self.name, "shape": self.shape, "l2": self.l2,
                "rel": _finite(self.rel), "max_abs": self.max_abs, "status": self.status}


@dataclass(frozen=True)
class StageChange:
    """||B - A|| and ||A|| over one stage's outer parameters (momentum left out)."""

    stage: int
    l2: float
    norm_a: float

    @property
    def rel(self) -> float:
        return self.l2 / self.norm_a if self.norm_a > 0 else (0.0 if self.l2 == 0 else math.inf)

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "l2": self.l2, "norm_a": self.norm_a, "rel": _finite(self.rel)}


@dataclass(frozen=True)
class MetricDelta:
    name: str
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        return None if self.a is None or self.b is None else self.b - self.a

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "a": self.a, "b": self.b, "delta": self.delta}


@dataclass(frozen=True)
class CheckpointDiff:
    a: str
    b: str
    step_a: int
    step_b: int
    relation: str  # e.g. "B descends from A, 2 steps later", "same", "neither descends from the other"
    tensors: list[TensorChange] = field(default_factory=list)
    metrics: list[MetricDelta] = field(default_factory=list)

    @property
    def params(self) -> list[TensorChange]:
        """The outer parameters' changes (momentum left out; a reshaped tensor has no norm)."""
        return [t for t in self.tensors if t.name.startswith("param/") and not math.isnan(t.l2)]

    @property
    def total_l2(self) -> float:
        """||B - A|| over all outer parameters (momentum left out)."""
        return math.sqrt(sum(t.l2 ** 2 for t in self.params))

    @property
    def total_rel(self) -> float:
        """||B - A|| / ||A|| over all outer parameters."""
        return StageChange(-1, self.total_l2, math.sqrt(sum(t.norm_a ** 2 for t in self.params))).rel

    def stages(self) -> list[StageChange]:
        """Per stage, ||B - A|| and ||A|| over its outer parameters."""
        return [StageChange(s, math.sqrt(sum(t.l2 ** 2 for t in self.params if t.stage == s)),
                            math.sqrt(sum(t.norm_a ** 2 for t in self.params if t.stage == s)))
                for s in sorted({t.stage for t in self.tensors})]

    def top(self, n: int) -> list[TensorChange]:
        """The `n` outer parameters that changed most relative to their norm in A."""
        return sorted(self.params, key=lambda t: -t.rel)[:n]

    def as_json(self, top: int = 10) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "step_a": self.step_a, "step_b": self.step_b,
                "relation": self.relation, "param_l2": self.total_l2,
                "summary": {"param_l2": self.total_l2, "param_rel": _finite(self.total_rel),
                            "stages": [s.as_json() for s in self.stages()],
                            "top": [t.as_json() for t in self.top(top)]},
                "tensors": [t.as_json() for t in self.tensors],
                "metrics": [m.as_json() for m in self.metrics]}


def _finite(value: float) -> float | None:
    """JSON has no infinity: None (a tensor B has and A has not, or A all zeros)."""
    return None if math.isinf(value) else value


def diff_checkpoints(store: Any, a: str | CID, b: str | CID, store_b: Any = None) -> CheckpointDiff:
    """Compare checkpoint `a` with checkpoint `b` (B - A), stage by stage; `b` is read
    from `store_b` where given (another run's store), else from `store`."""
    store_b = store if store_b is None else store_b
    cid_a, cid_b = parse_cid(a), parse_cid(b)
    ma, mb = get_manifest(store, cid_a), get_manifest(store_b, cid_b)
    tensors: list[TensorChange] = []
    for stage in range(max(len(ma.stages), len(mb.stages))):
        ta = _shard(store, ma, stage)
        tb = _shard(store_b, mb, stage)
        # outer parameters first, then the outer momentum
        for name in sorted(set(ta) | set(tb), key=lambda n: (not n.startswith("param/"), n)):
            tensors.append(_change(stage, name, ta.get(name), tb.get(name)))
    names = sorted(set(ma.metrics) | set(mb.metrics))
    metrics = [MetricDelta(n, _num(ma.metrics.get(n)), _num(mb.metrics.get(n))) for n in names]
    return CheckpointDiff(str(cid_a), str(cid_b), ma.step, mb.step,
                          _relation((store, store_b), cid_a, ma, cid_b, mb), tensors, metrics)


def _shard(store: Any, manifest: Manifest, stage: int) -> dict[str, np.ndarray]:
    if stage >= len(manifest.stages):
        return {}
    data = read_bytes(store, manifest.stages[stage])
    try:
        return dict(st_load(data))
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise StorageError(f"stage shard {manifest.stages[stage]} is not safetensors: {exc}") from None


def _change(stage: int, name: str, a: np.ndarray | None, b: np.ndarray | None) -> TensorChange:
    if a is None or b is None:
        t = b if a is None else a
        assert t is not None, "a tensor diffed is in at least one of the shards"
        norm = float(np.linalg.norm(t.astype(np.float64).ravel()))
        return TensorChange(stage, name, list(t.shape), norm, math.inf if a is None else 1.0,
                            float(np.abs(t).max()) if t.size else 0.0, "added" if a is None else "removed",
                            0.0 if a is None else norm)
    if a.shape != b.shape:
        return TensorChange(stage, name, list(b.shape), math.nan, math.nan, math.nan, "reshaped")
    d = b.astype(np.float64) - a.astype(np.float64)
    l2 = float(np.linalg.norm(d.ravel()))
    base = float(np.linalg.norm(a.astype(np.float64).ravel()))
    rel = l2 / base if base > 0 else (0.0 if l2 == 0 else math.inf)
    max_abs = float(np.abs(d).max()) if d.size else 0.0
    return TensorChange(stage, name, list(a.shape), l2, rel, max_abs, "same" if l2 == 0 else "changed", base)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _relation(stores: tuple[Any, Any], cid_a: CID, ma: Manifest, cid_b: CID, mb: Manifest) -> str:
    """Whether one checkpoint descends from the other, following parent links (each
    checkpoint's in its own store)."""
    if cid_a == cid_b:
        return "same"
    if mb.step > ma.step and _descends(stores[1], mb, cid_a, ma.step):
        return f"B descends from A, {mb.step - ma.step} step{'s' if mb.step - ma.step != 1 else ''} later"
    if ma.step > mb.step and _descends(stores[0], ma, cid_b, mb.step):
        return f"A descends from B, {ma.step - mb.step} step{'s' if ma.step - mb.step != 1 else ''} later"
    return "neither descends from the other"


def _descends(store: Any, child: Manifest, ancestor: CID, ancestor_step: int) -> bool:
    m = child
    while m.parent is not None and m.step > ancestor_step:
        if m.parent == ancestor:
            return True
        m = get_manifest(store, m.parent)
    return False
