"""The flip-aware comparison of a replayed contribution with the claimed one (a native
run's replay on another kernel set than the trainer's; lineage/audit/replay.py's docstring
says when it judges): `compare_payloads` gives the figures, `flip_failure` judges them.

    cmp = compare_payloads(replayed, claimed, shapes)   # codes, flips, swaps, scale_rel, ...
    flip_failure(cmp, tolerance)                        # "" when an honest kernel difference
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["FLIP_FRACTION", "FLIP_SLACK", "compare_payloads", "flip_allowance", "flip_failure"]

#: At most this fraction of a stage's codes may differ (each by one level), plus FLIP_SLACK;
#: the same bound holds for sparse indices swapped at a tie (honest rounds: at most 2 of
#: about 21,000 codes, 1e-4, times 10).
FLIP_FRACTION = 1e-3
FLIP_SLACK = 2


def finite_or_none(x: float | None) -> float | None:
    """`x`, or None where it is not finite (JSON has no inf or nan)."""
    return x if x is not None and math.isfinite(x) else None


_SCALES = ("q_scale", "u_scale", "v_scale", "sp_scale")


def _split(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A payload's tensors by the parameter they encode: name -> {prefix: tensor}."""
    out: dict[str, dict[str, Any]] = {}
    for key, t in payload.items():
        prefix, _, name = key.partition("/")
        out.setdefault(name, {})[prefix] = t
    return out


def compare_payloads(replayed: bytes, claimed: bytes, shapes: dict[str, Any]) -> dict[str, Any]:
    """The flip-aware comparison of a replayed contribution with the claimed one over the
    tensors `shapes` names (name -> shape), as JSON-ready figures: `codes` compared,
    `flips` (codes that differ) and `max_flip` (the largest difference, in levels), sparse
    `swaps` among `kept` indices, `scale_rel` (the largest difference of a scale relative to
    its tensor's largest scale, `scale_tensor` that tensor), `rest_rel_l2` (the claimed codes at the replayed scales
    against the claim, or for kind "none" the plain difference: relative L2 over the stage,
    `rest_tensor` the tensor contributing most), `tensors` (those with flips, swaps or a
    problem, with their figures and `out`/`jump`: how many decoded values the flips and
    swaps moved, and by at most how much, which `check_continuity` allows the compressor
    residual), and `problem` (a layout that differs, or a sparse swap at no tie; "" if none).
    `flip_failure` judges them."""
    from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
    from trainer.compress import decode_contribution

    try:
        a, b = bytes_to_tensors(replayed), bytes_to_tensors(claimed)
        da, db = decode_contribution(replayed, shapes), decode_contribution(claimed, shapes)
    except Exception as exc:  # safetensors raises its own error type for bad bytes
        return _summary([], 0.0, 0.0, f"a payload does not decode: {' '.join(str(exc).split())}")
    pa, pb = _split(a), _split(b)
    tensors = [_compare_tensor(name, pa.get(name, {}), pb.get(name, {}), da[name], db[name])
               for name in sorted(shapes)]
    bad = next((t for t in tensors if t["problem"]), None)
    if bad is not None:
        return _summary(tensors, 0.0, 0.0, f"tensor {bad['name']}: {bad['problem']}")
    try:  # the claimed codes at the replayed scales: what the claim is but for its flips
        sub = decode_contribution(tensors_to_bytes({**b, **{k: a[k] for k in b if k.split("/")[0] in _SCALES}}),
                                  shapes)
    except Exception as exc:  # safetensors raises its own error type for bad bytes
        return _summary(tensors, 0.0, 0.0, f"the scales do not fit the claimed codes: {' '.join(str(exc).split())}")
    rest_sq = norm = 0.0
    for t in tensors:
        x, y, z = da[t["name"]].double(), db[t["name"]].double(), sub[t["name"]].double()
        t["rest_sq"] = float((x - y if t["codec"] == "none" else z - y).pow(2).sum())
        moved = (x - z).abs().reshape(-1)
        t["out"] = int((moved > 0).sum()) if t["codec"] != "none" else 0
        t["jump"] = float(moved.max()) if t["out"] else 0.0
        rest_sq += t["rest_sq"]
        norm += float(y.pow(2).sum())
    return _summary(tensors, rest_sq, norm, "")


def _summary(tensors: list[dict[str, Any]], rest_sq: float, norm: float, problem: str) -> dict[str, Any]:
    """The stage's figures from its tensors' (`compare_payloads`)."""
    scale = max(tensors, key=lambda t: t["scale_rel"], default=None)
    rest = max(tensors, key=lambda t: t.get("rest_sq", 0.0), default=None)
    for t in tensors:
        t.pop("rest_sq", None)
    rel = math.sqrt(rest_sq / norm) if norm > 0 else (0.0 if rest_sq == 0 else math.inf)
    return {
        "codes": sum(t["codes"] for t in tensors), "flips": sum(t["flipped"] for t in tensors),
        "max_flip": max((t["max_flip"] for t in tensors), default=0),
        "swaps": sum(t["swaps"] for t in tensors), "kept": sum(t["kept"] for t in tensors),
        "scale_rel": finite_or_none(scale["scale_rel"]) if scale else 0.0, "scale_tensor": scale["name"] if scale else "",
        "rest_rel_l2": finite_or_none(rel), "rest_tensor": rest["name"] if rest else "",
        "tensors": [{**t, "scale_rel": finite_or_none(t["scale_rel"])} for t in tensors
                    if t["flipped"] or t["swaps"] or t["problem"]],
        "problem": problem,
    }


def flip_allowance(count: int) -> int:
    """How many of `count` codes (or kept sparse indices) may differ in an honest replay on
    other kernels: FLIP_FRACTION of them, plus FLIP_SLACK."""
    return math.floor(FLIP_FRACTION * count) + FLIP_SLACK


def flip_failure(cmp: dict[str, Any], tolerance: float) -> str:
    """Why `compare_payloads`' figures are not an honest kernel difference within
    `tolerance` ("" when they are): a code moved by more than one level, more flips or
    swaps than `flip_allowance`, a scale off by more than the tolerance (relative), or the
    rest off by more than it (relative L2)."""
    if cmp.get("problem"):
        return str(cmp["problem"])
    tensors = cmp.get("tensors", [])
    for t in tensors:
        if t["max_flip"] > 1:
            return (f"tensor {t['name']}: a code moved by {t['max_flip']} levels ({t['flipped']} of {t['codes']} "
                    "codes differ; other kernels move a code by one level at most)")
    for what, n, per, of in (("codes", "flips", "flipped", "codes"), ("sparse indices", "swaps", "swaps", "kept")):
        allowed = flip_allowance(cmp.get(of, 0))
        if cmp.get(n, 0) > allowed:
            worst = max(tensors, key=lambda t: int(t[per]))  # noqa: B023 (used at once)
            return (f"{cmp[n]} of {cmp[of]} {what} differ (at most {allowed} may); the most in tensor "
                    f"{worst['name']} ({worst[per]} of {worst['codes'] if per == 'flipped' else worst['kept']})")
    scale = cmp.get("scale_rel")
    if scale is None or scale > tolerance:
        return (f"tensor {cmp.get('scale_tensor')}: a scale differs by {_g(scale)} of its largest scale "
                f"(tolerance {tolerance:g})")
    rest = cmp.get("rest_rel_l2")
    if rest is None or rest > tolerance:
        return (f"the values the flips leave differ by relative L2 {_g(rest)} (tolerance {tolerance:g}; the most "
                f"in tensor {cmp.get('rest_tensor')})")
    return ""


def _g(x: float | None) -> str:
    return "inf" if x is None else f"{x:.3g}"


_CODECS = {1: "quantize", 2: "lowrank", 3: "sparse", 4: "gaps"}


def _compare_tensor(name: str, a: dict[str, Any], b: dict[str, Any], da: Any, db: Any) -> dict[str, Any]:
    """One tensor's codes and scales: `a` the replayed payload's parts of it (prefix ->
    tensor), `b` the claim's, `da`/`db` their decoded values."""
    t: dict[str, Any] = {"name": name, "codec": "none", "codes": 0, "flipped": 0, "max_flip": 0, "swaps": 0,
                         "kept": 0, "scale_rel": 0.0, "problem": ""}
    if sorted(a) != sorted(b) or any(a[k].shape != b[k].shape or a[k].dtype != b[k].dtype
                                     for k in b if k not in ("sp_idx",)):
        t["problem"] = f"the payloads encode it differently ({', '.join(sorted(a))} vs {', '.join(sorted(b))})"
        return t
    if "delta" in b:
        return t
    meta_a, meta_b = a["meta"].tolist(), b["meta"].tolist()
    if meta_a != meta_b:
        t["problem"] = f"the payloads encode it differently (meta {meta_a} vs {meta_b})"
        return t
    codec, bits = meta_b[0], meta_b[1]
    t["codec"] = _CODECS.get(codec, str(codec))
    t["scale_rel"] = max((_scale_rel(a[p], b[p]) for p in _SCALES if p in b), default=0.0)
    m = db.shape[0] if db.dim() >= 2 else 1
    n = db.numel() // max(m, 1)
    if codec == 3:
        diffs, t["swaps"], t["kept"], t["problem"] = _sparse_diffs(a, b, meta_b)
    elif codec == 2:
        diffs = [_codes(a[p], bits, c) - _codes(b[p], bits, c) for p, c in (("u", m), ("v", n))]
    elif codec == 4:
        diffs = [_gaps_codes(da, a["q_scale"], m, n) - _gaps_codes(db, b["q_scale"], m, n)]
    else:
        diffs = [_codes(a["q"], bits, n) - _codes(b["q"], bits, n)]
    step = 2 if bits == 1 else 1  # one bit: -1 or +1, one level apart
    t["codes"] = sum(d.numel() for d in diffs) if codec != 3 else t["kept"]
    t["flipped"] = sum(int((d != 0).sum()) for d in diffs)
    t["max_flip"] = max((round(float(d.abs().max()) / step) for d in diffs if d.numel()), default=0)
    return t


def _codes(packed: Any, bits: int, cols: int) -> Any:
    """The signed integer codes of a `quantize_rows` matrix (float)."""
    import torch

    from trainer.compress import dequantize_rows

    return dequantize_rows(packed, torch.ones(packed.size(0)), bits, cols)


def _gaps_codes(decoded: Any, scale: Any, m: int, n: int) -> Any:
    """The -1/0/+1 codes of a gaps-coded tensor, from its decoded values and row scales."""
    import torch

    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(decoded.reshape(m, n) / safe[:, None])


def _scale_rel(a: Any, b: Any) -> float:
    """The largest |a - b| over two scale vectors, relative to the claim's largest scale
    (a row of small values moves as much as a tensor's other rows do, not in proportion)."""
    x, y = a.double(), b.double()
    d = float((x - y).abs().max()) if x.numel() else 0.0
    if d == 0.0:
        return 0.0
    top = float(y.abs().max())
    return d / top if top > 0 else math.inf


def _sparse_diffs(a: dict[str, Any], b: dict[str, Any], meta: list[int]) -> tuple[list[Any], int, int, str]:
    """A sparse tensor's code differences where both payloads kept the same index, how
    many kept indices differ (swaps), how many are kept, and a problem ("" if none): an
    index swapped at a value that is no tie, above the chunk's smallest kept magnitudes."""
    import torch

    from trainer.compress import unpack_bits

    bits, k, chunk = meta[1], meta[2], meta[3]
    G = b["sp_scale"].numel()
    width = max(1, (chunk - 1).bit_length())
    try:
        ia = unpack_bits(a["sp_idx"], width, G * k).view(G, k)
        ib = unpack_bits(b["sp_idx"], width, G * k).view(G, k)
    except ValueError as exc:
        return [], 0, G * k, f"sparse indices do not unpack: {exc}"
    ca, cb = _codes(a["sp"], bits, k), _codes(b["sp"], bits, k)
    same = (ia == ib).all(dim=1)
    diffs, swaps = [ca[same] - cb[same]], 0
    for g in (~same).nonzero().reshape(-1).tolist():
        va = dict(zip(ia[g].tolist(), ca[g].tolist(), strict=True))
        vb = dict(zip(ib[g].tolist(), cb[g].tolist(), strict=True))
        common = sorted(va.keys() & vb.keys())
        diffs.append(torch.tensor([va[i] - vb[i] for i in common]))
        gone, new = va.keys() - vb.keys(), vb.keys() - va.keys()
        swaps += len(new)
        floor = min((min(abs(va[i]), abs(vb[i])) for i in common), default=math.inf)
        top = max([abs(va[i]) for i in gone] + [abs(vb[i]) for i in new])
        if top > floor + (2 if bits == 1 else 1):
            return diffs, swaps, G * k, (f"chunk {g}: a kept index differs at a value of {top:g} levels, above the "
                                         f"chunk's smallest kept ({floor:g}): no tie of magnitudes")
    return diffs, swaps, G * k, ""
