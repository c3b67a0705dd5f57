"""The codecs of pseudo-gradient compression: a typed `Plan` per tensor and one class per
codec (`QuantCodec`, `GapsCodec`, `LowRankCodec`, `SparseCodec`), each with `encode` (a
tensor's payload keys under its plan), `decode` (the (m, n) float32 matrix back) and
`nbytes` (its data bytes, meta excluded), plus the batched paths that code many tensors in
one pass with the same bytes. `trainer.compress` documents the kinds and the payload keys;
`CODECS` maps the int codec of ``meta/<name>`` to its class, the one dispatch."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainer.compress_bits import (
    BITS,
    GAPS_META,
    GAPS_STREAM,
    as_matrix_shape,
    chunk_rows,
    dequantize_rows,
    gaps_decode,
    gaps_encode,
    index_bits,
    lowrank_bytes,
    lowrank_reconstruct,
    pack_bits,
    quant_bytes,
    quantize_rows,
    round_rows,
    sparse_bytes,
    sparse_decode,
    sparse_encode,
    topk_sorted,
)

CODEC_NONE, CODEC_QUANT, CODEC_LOWRANK, CODEC_SPARSE, CODEC_GAPS = 0, 1, 2, 3, 4

Payload = dict[str, torch.Tensor]
Coded = dict[str, tuple[Payload, torch.Tensor]]  # name -> (payload tensors, M - decoded)


@dataclass
class Plan:
    """How one tensor, viewed as the (m, n) matrix `M`, is coded this step: `codec` at
    `bits`; low rank: factors `P` (m, r) and `Q` (n, r), of which the first `rank` are
    sent; sparse: `k` values per `chunk`. Under ``adaptive`` a matrix also carries what
    the budget step needs to lower rank or k: the cumulative energies `captured` (low
    rank) and `sp_captured` (sparse) and the errors they give."""

    M: torch.Tensor
    codec: int
    bits: int
    rank: int = 0
    P: torch.Tensor | None = None
    Q: torch.Tensor | None = None
    k: int = 0
    chunk: int = 0
    captured: torch.Tensor | None = None
    sp_captured: torch.Tensor | None = None
    lowrank_error: float = 0.0
    sparse_error: float = 0.0

    def nbytes(self) -> int:
        """The data bytes of this plan's codec (`Codec.nbytes`)."""
        return CODECS[self.codec].nbytes(self)


def as_plan(plan: Plan | Mapping[str, Any]) -> Plan:
    """A `Plan`, also from a mapping of its fields (``{"M": ..., "codec": ..., "bits": ...}``)."""
    return plan if isinstance(plan, Plan) else Plan(**plan)


def _meta(codec: int, *rest: int) -> torch.Tensor:
    return torch.tensor([codec, *rest], dtype=torch.int32)


def _row_slices(counts: list[int]) -> list[slice]:
    """The consecutive row ranges of tensors stacked with these row counts."""
    out, row = [], 0
    for n in counts:
        out.append(slice(row, row + n))
        row += n
    return out


class Codec(ABC):
    """One codec: ``meta/<name>`` [codec, bits, ...] and its own keys."""

    codec = CODEC_NONE
    name = "none"

    @abstractmethod
    def encode(self, name: str, plan: Plan) -> Payload:
        """Payload tensors of one tensor coded under `plan`."""

    @abstractmethod
    def decode(self, name: str, payload: Payload, meta: list[int], m: int, n: int) -> torch.Tensor:
        """The (m, n) float32 matrix `encode` sent (KeyError for a missing key)."""

    @abstractmethod
    def nbytes(self, plan: Plan) -> int:
        """Data bytes of one tensor under `plan` (meta and safetensors' header excluded)."""


class QuantCodec(Codec):
    """Whole quantisation: ``q/<name>`` uint8 (m, ceil(n b / 8)), ``q_scale/<name>`` (m,)."""

    codec, name = CODEC_QUANT, "quantize"

    def encode(self, name: str, plan: Plan) -> Payload:
        out = {f"meta/{name}": _meta(CODEC_QUANT, plan.bits, 0)}
        out[f"q/{name}"], out[f"q_scale/{name}"] = quantize_rows(plan.M, plan.bits)
        return out

    def decode(self, name: str, payload: Payload, meta: list[int], m: int, n: int) -> torch.Tensor:
        return dequantize_rows(payload[f"q/{name}"], payload[f"q_scale/{name}"], meta[1], n)

    def nbytes(self, plan: Plan) -> int:
        m, c = plan.M.shape
        return quant_bytes(m, c, plan.bits)

    def encode_batch(self, plans: Mapping[str, Plan | Mapping[str, Any]]) -> Coded:
        """Encode the quantised plans that share (bits, columns) in one pass each (one
        quantisation over their stacked rows): name -> (payload tensors, M - decoded).
        Row-wise operations only, so the bytes and the residual are those of `encode` and
        `decode` one tensor at a time (tested); it only saves the per-tensor overhead."""
        typed = {n: as_plan(p) for n, p in plans.items()}
        groups: dict[tuple[int, int], list[str]] = {}
        for n in sorted(typed):
            p = typed[n]
            if p.codec == CODEC_QUANT:
                groups.setdefault((p.bits, p.M.size(1)), []).append(n)
        out: Coded = {}
        for (bits, cols), names in groups.items():
            if len(names) < 2:
                continue
            X = torch.cat([typed[n].M.float() for n in names])  # (rows, cols)
            q, scale = quantize_rows(X, bits)
            err = X - dequantize_rows(q, scale, bits, cols)
            for n, rows in zip(names, _row_slices([typed[n].M.size(0) for n in names]), strict=True):
                enc = {f"meta/{n}": _meta(CODEC_QUANT, bits, 0), f"q/{n}": q[rows], f"q_scale/{n}": scale[rows]}
                out[n] = (enc, err[rows])
        return out

    def decode_batch(self, payload: Payload, shapes: Mapping[str, torch.Size]) -> Payload:
        """Decode the quantised tensors of `payload` whose tensors are well formed, those
        sharing (bits, columns) in one pass each (elementwise, so the values are those of
        `decode_one`, tested); anything else is left to `decode_one` and its errors."""
        groups: dict[tuple[int, int], list[str]] = {}
        for name in sorted(shapes):
            meta, q, scale = (payload.get(f"{k}/{name}") for k in ("meta", "q", "q_scale"))
            if meta is None or q is None or scale is None or f"delta/{name}" in payload:
                continue
            if meta.dtype != torch.int32 or tuple(meta.shape) != (3,):
                continue
            codec, bits, _ = (int(v) for v in meta.tolist())
            rows, cols = as_matrix_shape(shapes[name])
            if codec != CODEC_QUANT or bits not in BITS or q.dtype != torch.uint8 or scale.dtype != torch.float32:
                continue
            if tuple(q.shape) != (rows, math.ceil(cols * bits / 8)) or tuple(scale.shape) != (rows,):
                continue
            groups.setdefault((bits, cols), []).append(name)
        out: Payload = {}
        for (bits, cols), names in groups.items():
            if len(names) < 2:
                continue
            M = dequantize_rows(torch.cat([payload[f"q/{n}"] for n in names]),
                                torch.cat([payload[f"q_scale/{n}"] for n in names]), bits, cols)
            for name, part in zip(names, _row_slices([payload[f"q/{n}"].size(0) for n in names]), strict=True):
                out[name] = M[part].reshape(shapes[name])
        return out


class LowRankCodec(Codec):
    """Low rank: ``u/<name>`` (r, ceil(m b / 8)) and ``v/<name>`` (r, ceil(n b / 8)), the
    transposed factors quantised with one scale per rank component."""

    codec, name = CODEC_LOWRANK, "lowrank"

    def encode(self, name: str, plan: Plan) -> Payload:
        assert plan.P is not None and plan.Q is not None, "a low-rank plan has factors"
        P, Q = plan.P[:, : plan.rank], plan.Q[:, : plan.rank]
        out = {f"meta/{name}": _meta(CODEC_LOWRANK, plan.bits, 0)}
        out[f"meta/{name}"][2] = P.size(1)
        out[f"u/{name}"], out[f"u_scale/{name}"] = quantize_rows(P.T, plan.bits)  # (r, m)
        out[f"v/{name}"], out[f"v_scale/{name}"] = quantize_rows(Q.T, plan.bits)  # (r, n)
        return out

    def decode(self, name: str, payload: Payload, meta: list[int], m: int, n: int) -> torch.Tensor:
        bits, rank = meta[1], meta[2]
        u = dequantize_rows(payload[f"u/{name}"], payload[f"u_scale/{name}"], bits, m)
        v = dequantize_rows(payload[f"v/{name}"], payload[f"v_scale/{name}"], bits, n)
        if u.size(0) != rank or v.size(0) != rank:
            raise ValueError(f"contribution: {name} factors disagree with rank {rank}")
        return lowrank_reconstruct(u, v)

    def nbytes(self, plan: Plan) -> int:
        m, c = plan.M.shape
        return lowrank_bytes(m, c, plan.rank, plan.bits)


class SparseCodec(Codec):
    """Chunked top-k: ``sp/<name>``, ``sp_scale/<name>``, ``sp_idx/<name>``; meta
    [codec, bits, k, chunk]."""

    codec, name = CODEC_SPARSE, "sparse"

    def encode(self, name: str, plan: Plan) -> Payload:
        out = {f"meta/{name}": _meta(CODEC_SPARSE, plan.bits, plan.k, plan.chunk)}
        out[f"sp/{name}"], out[f"sp_scale/{name}"], out[f"sp_idx/{name}"] = sparse_encode(
            plan.M, plan.chunk, plan.k, plan.bits)
        return out

    def decode(self, name: str, payload: Payload, meta: list[int], m: int, n: int) -> torch.Tensor:
        bits, k, chunk = meta[1], meta[2], meta[3]
        try:
            return sparse_decode(payload[f"sp/{name}"], payload[f"sp_scale/{name}"],
                                 payload[f"sp_idx/{name}"], bits, k, chunk, m * n).view(m, n)
        except ValueError as exc:
            raise ValueError(f"contribution: sparse {name}: {exc}") from None

    def nbytes(self, plan: Plan) -> int:
        m, c = plan.M.shape
        return sparse_bytes(m * c, plan.chunk, plan.k, plan.bits)

    def encode_batch(self, plans: Mapping[str, Plan | Mapping[str, Any]]) -> Coded:
        """Encode the sparse plans that share (chunk, k, bits) in one pass each (one top-k
        and one quantisation over their stacked chunks): name -> (payload tensors, M -
        decoded). Row-wise operations only, so the bytes and the residual are those of
        `encode` and `decode` one tensor at a time (tested); it only saves the per-tensor
        overhead."""
        typed = {n: as_plan(p) for n, p in plans.items()}
        groups: dict[tuple[int, int, int], list[str]] = {}
        for n in sorted(typed):
            p = typed[n]
            if p.codec == CODEC_SPARSE:
                groups.setdefault((p.chunk, p.k, p.bits), []).append(n)
        out: Coded = {}
        for (chunk, k, bits), names in groups.items():
            if len(names) < 2:
                continue
            blocks = [chunk_rows(typed[n].M, chunk) for n in names]
            X = torch.cat(blocks)  # (G, chunk)
            idx = topk_sorted(X, k)  # (G, k)
            kept = X.gather(1, idx)
            q, scale = quantize_rows(kept, bits)
            err = X.scatter(1, idx, kept - dequantize_rows(q, scale, bits, k))
            width = index_bits(chunk)
            for n, rows in zip(names, _row_slices([b.size(0) for b in blocks]), strict=True):
                M = typed[n].M
                enc = {f"meta/{n}": _meta(CODEC_SPARSE, bits, k, chunk),
                       f"sp/{n}": q[rows], f"sp_scale/{n}": scale[rows],
                       f"sp_idx/{n}": pack_bits(idx[rows], width)}
                out[n] = (enc, err[rows].reshape(-1)[: M.numel()].reshape(M.shape))
        return out


class GapsCodec(Codec):
    """2-bit values as runs of zeros: ``q_scale/<name>`` per tensor, the values of every
    gaps tensor in the payload's one ``gaps/stream`` (``gaps/meta`` int64 [w, T, values]).
    One stream for all, so it codes a payload's tensors together (`encode_all`,
    `decode_all`), never one alone."""

    codec, name = CODEC_GAPS, "quantize"

    def encode(self, name: str, plan: Plan) -> Payload:
        raise ValueError(f"{name} is gaps-coded: encode the whole payload")

    def decode(self, name: str, payload: Payload, meta: list[int], m: int, n: int) -> torch.Tensor:
        raise ValueError(f"contribution: {name} is gaps-coded: decode the whole payload")

    def nbytes(self, plan: Plan) -> int:
        """The fixed 2-bit layout's bytes: the ceiling of the gaps layout's."""
        m, c = plan.M.shape
        return quant_bytes(m, c, 2)

    def encode_all(self, plans: Mapping[str, Plan]) -> tuple[Payload, Payload]:
        """Encode every gaps plan: (payload tensors, name -> M - decoded). The values of
        all of them, in name order, flattened and concatenated, are one `gaps_encode`
        stream; each tensor has its ``meta/<name>`` [CODEC_GAPS, 2, 0] and its
        ``q_scale/<name>``. The rounding is batched over tensors of equal columns
        (row-wise, so the values are those of one tensor alone)."""
        names = sorted(n for n, p in plans.items() if p.codec == CODEC_GAPS)
        if not names:
            return {}, {}
        by_cols: dict[int, list[str]] = {}
        for n in names:
            by_cols.setdefault(plans[n].M.size(1), []).append(n)
        q_of, payload, errs = {}, {}, {}
        for group in by_cols.values():
            X = torch.cat([plans[n].M.float() for n in group])  # (rows, cols)
            q, scale = round_rows(X, 2)
            err = X - q * scale[:, None]
            for n, rows in zip(group, _row_slices([plans[n].M.size(0) for n in group]), strict=True):
                q_of[n], errs[n] = q[rows], err[rows]
                payload[f"meta/{n}"] = _meta(CODEC_GAPS, 2, 0)
                payload[f"q_scale/{n}"] = scale[rows]
        values = torch.cat([q_of[n].reshape(-1) for n in names])
        stream, w, T = gaps_encode(values)
        payload[GAPS_STREAM] = stream
        payload[GAPS_META] = torch.tensor([w, T, values.numel()], dtype=torch.int64)
        return payload, errs

    def decode_all(self, payload: Payload, shapes: Mapping[str, torch.Size]) -> Payload:
        """The gaps-coded tensors of `payload` (meta codec 4), decoded from its one stream."""
        names = [n for n in sorted(shapes) if f"delta/{n}" not in payload and f"meta/{n}" in payload
                 and read_meta(n, payload)[0] == CODEC_GAPS]
        if not names and GAPS_STREAM not in payload and GAPS_META not in payload:
            return {}
        meta = payload.get(GAPS_META)
        if GAPS_STREAM not in payload or meta is None or meta.dtype != torch.int64 or tuple(meta.shape) != (3,):
            raise ValueError(f"contribution: gaps-coded tensors need {GAPS_STREAM} and {GAPS_META} int64 (3,)")
        w, T, count = (int(v) for v in meta.tolist())
        dims = [as_matrix_shape(shapes[n]) for n in names]
        if count != sum(m * c for m, c in dims):
            raise ValueError(f"contribution: {GAPS_META} counts {count} values, the gaps-coded tensors "
                             f"hold {sum(m * c for m, c in dims)}")
        try:
            values = gaps_decode(payload[GAPS_STREAM], w, T, count)
        except ValueError as exc:
            raise ValueError(f"contribution: {GAPS_STREAM}: {exc}") from None
        out, at = {}, 0
        for n, (m, c) in zip(names, dims, strict=True):
            scale = payload.get(f"q_scale/{n}")
            if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (m,):
                got = "missing" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
                raise ValueError(f"contribution: q_scale/{n} is {got}, want float32 {(m,)}")
            # the product `dequantize_rows` computes at 2 bits: the same float32 bits
            out[n] = (values[at: at + m * c].view(m, c) * scale[:, None]).reshape(shapes[n])
            at += m * c
        return out


QUANT, LOWRANK, SPARSE, GAPS = QuantCodec(), LowRankCodec(), SparseCodec(), GapsCodec()
CODECS: dict[int, Codec] = {c.codec: c for c in (QUANT, LOWRANK, SPARSE, GAPS)}


def encode(name: str, M: torch.Tensor, codec: int, bits: int,
           factors: tuple[torch.Tensor, torch.Tensor] | None = None,
           sparse: tuple[int, int] | None = None) -> Payload:
    """Payload tensors for one tensor viewed as (m, n) under `codec`; `factors` = (P (m, r),
    Q (n, r)), `sparse` = (k, chunk)."""
    plan = Plan(M=M, codec=codec, bits=bits)
    if factors is not None:
        plan.P, plan.Q, plan.rank = factors[0], factors[1], factors[0].size(1)
    if sparse is not None:
        plan.k, plan.chunk = sparse
    return CODECS[codec].encode(name, plan)


def read_meta(name: str, payload: Payload) -> list[int]:
    """``meta/<name>`` checked: [codec, bits, rank], or [codec, bits, k, C] (sparse)."""
    if f"meta/{name}" not in payload:
        raise ValueError(f"contribution: no delta/{name} or meta/{name}")
    meta = payload[f"meta/{name}"]
    if meta.dtype != torch.int32 or meta.dim() != 1 or meta.numel() not in (3, 4):
        raise ValueError(f"contribution: meta/{name} is {meta.dtype} {tuple(meta.shape)}, want int32 (3,) or (4,)")
    values = [int(v) for v in meta.tolist()]
    codec, bits = values[:2]
    if (meta.numel() == 4) != (codec == CODEC_SPARSE):
        raise ValueError(f"contribution: meta/{name} has {meta.numel()} entries for codec {codec}")
    if bits not in BITS or (codec == CODEC_GAPS and bits != 2):
        raise ValueError(f"contribution: meta/{name} has bits {bits}")
    return values


def decode_one(name: str, payload: Payload, shape: torch.Size) -> torch.Tensor:
    """One tensor of a payload (``delta/<name>`` or its codec's keys), float32 `shape`."""
    if f"delta/{name}" in payload:
        t = payload[f"delta/{name}"]
        if t.shape != shape:
            raise ValueError(f"contribution: delta/{name} has shape {tuple(t.shape)}, want {tuple(shape)}")
        return t.float()
    meta = read_meta(name, payload)
    codec = CODECS.get(meta[0])
    if codec is None:
        raise ValueError(f"contribution: meta/{name} has unknown codec {meta[0]}")
    m, n = as_matrix_shape(shape)
    try:
        M = codec.decode(name, payload, meta, m, n)
    except KeyError as exc:
        raise ValueError(f"contribution: missing {exc.args[0]}") from None
    except RuntimeError as exc:
        raise ValueError(f"contribution: {name} does not decode to {tuple(shape)}: {exc}") from None
    if M.shape != (m, n):
        raise ValueError(f"contribution: {name} decodes to {tuple(M.shape)}, want {(m, n)}")
    return M.reshape(shape)
