"""Portable numerics, the matmul by exact integer slices (Ozaki-style: `_plan`, `_Operand`,
`_product`), linear, and the reductions and broadcasts whose gradients are exact sums
(sum, mean, expand, add, repeat_kv). See trainer/portable.py."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer.portable_core import (
    _CHUNK_ELEMENTS,
    F32,
    _ceil_log2,
    _check,
    _dims,
    _fixed,
    _scoped,
    _sum64,
    _sum_to,
    _tmp,
    _tmp_like,
)

# ---------------------------------------------------------------------------------------------
# Matmul by exact integer slices


# One float64 product when both operands keep at least this many bits (k <= 2048): errors
# within ~4x of a float32 matmul's. Longer inner dimensions slice one operand in two.
_ONE_PRODUCT_BITS = 21


def _plan(k: int) -> tuple[int, int, int, int]:
    """(slices of A, bits per A slice, slices of B, bits per B slice) for inner dimension k.

    A slice product has at most 2**(sa + sb) per term and k terms, so sa + sb =
    53 - ceil(log2 k) keeps every partial sum an exact float64 integer in any order.
    k <= 2048: one product, each operand ~21-26 bits. k <= 2**17: A in two slices
    (hi@B, lo@B), >= 24 bits each side. Beyond: both in two (hi@hi, hi@lo, lo@hi).
    """
    budget = 53 - _ceil_log2(k)
    if budget // 2 >= _ONE_PRODUCT_BITS:
        return 1, budget // 2, 1, budget - budget // 2
    if 2 * (budget // 3) >= 24:
        return 2, budget // 3, 1, budget - budget // 3
    if budget < 4:
        raise ValueError(f"inner dimension {k} is too long for an exact matmul")
    return 2, budget // 2, 2, budget - budget // 2


@dataclass
class _Operand:
    """One matmul operand as exact float64 integer slices: x ~ (hi * 2**s + lo) * 2**(e - bits)."""

    hi: Tensor
    lo: Tensor | None
    shift: Tensor  # 2**(e - bits), float64, broadcasting over the reduced dimension
    bad: Tensor | None  # slices (rows of A, columns of B) that held inf or nan

    @staticmethod
    def of(x: Tensor, dim: int, slices: int, bits: int) -> _Operand:
        """x (..., m, k) scaled per row (dim -1), or x (..., k, n) per column (dim -2)."""
        if not x.is_contiguous() and x.mT.is_contiguous():  # a transposed matrix: work in
            t = _Operand.of(x.mT, -3 - dim, slices, bits)  # its own layout (strided reads
            return _Operand(t.hi.mT, None if t.lo is None else t.lo.mT, t.shift.mT,  # are slow)
                            None if t.bad is None else t.bad.mT)
        q, unit, bad = _fixed(x, (dim % x.dim(),), slices * bits)
        lo = None
        if slices == 2:  # q = hi * 2**bits + lo, |hi| <= 2**bits, |lo| <= 2**(bits - 1)
            hi = torch.mul(q, 2.0**-bits, out=_tmp_like(q)).round_()
            lo = q.sub_(hi.mul_(2.0**bits))
            q = hi.mul_(2.0**-bits)
        return _Operand(q, lo, unit, bad)


def _product(a: _Operand, b: _Operand, sa: int, sb: int, out: Tensor, scale: float) -> None:
    """The exact slice products combined in a fixed order, scaled (by powers of two and
    `scale`), rounded into out (float32)."""
    shape = (*a.hi.shape[:-1], b.hi.shape[-1])
    c = torch.matmul(a.hi, b.hi, out=_tmp(shape, out))
    if a.lo is not None and b.lo is None:
        c.mul_(2.0**sa).add_(torch.matmul(a.lo, b.hi, out=_tmp(shape, out)))
    elif a.lo is not None and b.lo is not None:
        cross = torch.matmul(a.hi, b.lo, out=_tmp(shape, out)).mul_(2.0**sa)
        cross.add_(torch.matmul(a.lo, b.hi, out=_tmp(shape, out)).mul_(2.0**sb))
        c.mul_(2.0 ** (sa + sb)).add_(cross)
    row = a.shift if scale == 1.0 else a.shift * scale  # (.., m, 1): 2**e * scale
    # The second product is exact: one rounding (float64 in place, then the cast: what a
    # mixed-dtype mul into float32 out computes, in vectorised passes).
    out.copy_(c.mul_(row).mul_(b.shift))
    bads = [m for m in (a.bad, b.bad) if m is not None]
    if bads:
        out.masked_fill_(bads[0] if len(bads) == 1 else bads[0] | bads[1], math.nan)


# A weight's slices, kept between the microbatches of a step (and forward and backward):
# its float64 integers depend on its values alone, so an entry serves while the weight
# holds the values it was made from (compared in full, one pass, where slicing is six).
_WEIGHTS_MAX_BYTES = 256 << 20


class _WeightSlices(threading.local):
    def __init__(self) -> None:
        self.entries: dict[tuple[Any, ...], tuple[Tensor, _Operand]] = {}
        self.bytes = 0


_WEIGHTS = _WeightSlices()


def _weight_operand(b: Tensor, slices: int, bits: int) -> _Operand:
    """`_Operand.of(b, -2, slices, bits)` of a weight (or a view of one), from the cache
    when b holds the values its entry was made from (torch.equal: -0.0 and +0.0 count as
    equal, and a matmul's output does not depend on the sign of a zero; NaN never hits)."""
    cache = _WEIGHTS
    key = (b.data_ptr(), tuple(b.shape), b.stride(), slices, bits)
    hit = cache.entries.get(key)
    if hit is not None and torch.equal(hit[0], b):
        return hit[1]
    op = _Operand.of(b, -2, slices, bits)
    kept = _Operand(op.hi.clone(), None if op.lo is None else op.lo.clone(), op.shift.clone(),
                    None if op.bad is None else op.bad.clone())  # out of the scratch pool
    size = b.nbytes * (3 + 2 * slices)  # the copy and the float64 slices
    if hit is not None:
        cache.bytes -= hit[0].nbytes * (3 + 2 * slices)
        del cache.entries[key]
    if cache.bytes + size <= _WEIGHTS_MAX_BYTES:
        cache.entries[key] = (b.detach().clone(), kept)
        cache.bytes += size
    return kept


def clear_weight_slices() -> None:
    """Forget this thread's cached weight slices."""
    _WEIGHTS.entries.clear()
    _WEIGHTS.bytes = 0


@_scoped
def _mm(a: Tensor, b: Tensor, bias: Tensor | None = None, scale: float = 1.0,
        weight: bool = False) -> Tensor:
    """a @ b * scale (+ bias) in float32; a (m, k) or (N, m, k), b (k, n) or (N, k, n).
    Rows go in chunks that bound the float64 memory (rows are independent: same bits)."""
    k, n = a.shape[-1], b.shape[-1]
    na, sa, nb, sb = _plan(k)
    batched = b.dim() == 3
    per_row = (k * (na + 1) + n * (na * nb + 1)) * (a.shape[-2] if batched else 1)
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    bq = None if batched else _weight_operand(b, nb, sb) if weight else _Operand.of(b, -2, nb, sb)
    out = torch.empty(*a.shape[:-1], n, dtype=F32, device=a.device)
    for i in range(0, a.shape[0], step):
        whole = step >= a.shape[0]  # one chunk: no slicing
        ai, bi, oi = (a, b, out) if whole else (a[i:i + step], b[i:i + step], out[i:i + step])
        _product(_Operand.of(ai, -1, na, sa), _Operand.of(bi, -2, nb, sb) if bq is None else bq,
                 sa, sb, oi, scale)
    # A sum of -0.0 products may be -0.0 or +0.0 by kernel: + 0.0 makes every zero +0.0
    # (the bias too, so that +-0 + bias does not depend on the sign of a zero).
    return out.add_(0.0 if bias is None else bias + 0.0)


class _MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        return _mm(a, b, scale=scale)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        a, b = ctx.saved_tensors
        ga = _mm(g, b.mT, scale=ctx.scale) if ctx.needs_input_grad[0] else None
        gb = _mm(a.mT, g, scale=ctx.scale) if ctx.needs_input_grad[1] else None
        return ga, gb, None


def matmul(a: Tensor, b: Tensor, scale: float = 1.0) -> Tensor:
    """a @ b * scale (one rounding) for a (..., m, k), b (k, n) or (..., k, n) (broadcast
    batch dimensions; their gradients are exact sums)."""
    _check(a, b)
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError("portable.matmul takes matrices (use unsqueeze for vectors)")
    if b.dim() == 2:  # fold the batch into rows: one matrix product, its gradient exact
        out = _MatMul.apply(a.reshape(-1, a.shape[-1]), b, scale)
        return out.view(*a.shape[:-1], b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = expand(a, batch + a.shape[-2:]).reshape(-1, *a.shape[-2:])
    b = expand(b, batch + b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return _MatMul.apply(a, b, scale).view(*batch, a.shape[-2], b.shape[-1])


class _Linear(torch.autograd.Function):
    @staticmethod
    @_scoped
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        return _mm(x, w.t(), bias=b, weight=True)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        gx = _mm(g, w, weight=True) if ctx.needs_input_grad[0] else None
        gw = _mm(g.t(), x) if ctx.needs_input_grad[1] else None
        gb = _sum64(g, 0).to(F32) if ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, x (..., in), weight (out, in), bias (out,) (added in float32 to
    the rounded product, as F.linear; its gradient an exact sum over the tokens)."""
    _check(x, weight, bias)
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------------------------------------
# Reductions, broadcasts


class _Sum(torch.autograd.Function):
    @staticmethod
    @_scoped
    def forward(ctx: Any, x: Tensor, dims: tuple[int, ...], keepdim: bool, div: int) -> Tensor:
        ctx.shape, ctx.dims, ctx.keepdim, ctx.div = x.shape, dims, keepdim, div
        s = _sum64(x, dims, keepdim)
        return (s / div if div != 1 else s).to(F32)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        if not ctx.keepdim:
            for d in ctx.dims:
                g = g.unsqueeze(d)
        if ctx.div != 1:
            g = g / ctx.div
        return g.expand(ctx.shape).clone(), None, None, None


def sum(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """Exact-order sum of x over dim (all dims if None)."""
    _check(x)
    return _Sum.apply(x, _dims(x, dim), keepdim, 1)


def mean(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """sum / n, with n the number of elements reduced."""
    _check(x)
    dims = _dims(x, dim)
    return _Sum.apply(x, dims, keepdim, math.prod(x.shape[d] for d in dims))


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: torch.Size) -> Tensor:
        ctx.shape = x.shape
        return x.expand(shape)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return _sum_to(g, ctx.shape), None


def expand(x: Tensor, shape: Sequence[int]) -> Tensor:
    """x.expand(shape) whose gradient is an exact sum over the broadcast dimensions."""
    shape = torch.Size(shape)
    return x if x.shape == shape else _Expand.apply(x, shape)


class _Add(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        ctx.shapes = a.shape, b.shape
        return a + b

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
        sa, sb = ctx.shapes
        ga = _sum_to(g, sa) if ctx.needs_input_grad[0] else None
        gb = _sum_to(g, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b with broadcasting; the broadcast operand's gradient is an exact sum. (Same-shape
    adds need nothing: plain `a + b` is portable forward and backward.)"""
    return a + b if a.shape == b.shape else _Add.apply(a, b)


class _RepeatKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, rep: int, dim: int) -> Tensor:
        ctx.rep, ctx.dim = rep, dim
        return x.repeat_interleave(rep, dim=dim)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        d, rep = ctx.dim, ctx.rep
        g = g.unflatten(d, (g.shape[d] // rep, rep))
        return _sum64(g, d + 1).to(F32), None, None


def repeat_kv(x: Tensor, rep: int, dim: int = 1) -> Tensor:
    """x.repeat_interleave(rep, dim) (grouped-query attention's key/value heads) whose
    gradient sums each group's copies exactly."""
    return x if rep == 1 else _RepeatKV.apply(x, rep, dim % x.dim())

