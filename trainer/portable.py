"""Portable numerics: training kernels whose results are the same bits on every CPU.

torch's float32 kernels are not reproducible across machines: a matmul, a softmax or a sum
adds its terms in an order (and with fused multiply-adds) chosen by the instruction set,
the BLAS, the thread count; exp, tanh, erf are vectorised polynomials that differ per
`ATEN_CPU_CAPABILITY`. Everything here is built from operations that are the same
everywhere, measured on x86 (every ATen capability, MKL and oneDNN instruction set, glibc
hwcaps setting and thread count) and on aarch64 (tests/test_portable_ops.py's probe gives
the same hashes on an AMD EPYC and under qemu-aarch64):

- elementwise add, sub, mul, div, sqrt of float32/float64 tensors, one torch op each: IEEE
  correctly rounded, no fused multiply-add (never `add(alpha=)`, addcmul, lerp, addmm);
- exact operations: amax/amin, abs, neg, where, round, comparisons, indexing, views,
  casts float32 -> float64, frexp, integer arithmetic, float64 -> float32 rounding;
- sums of float64 integers whose every partial sum stays below 2**53: exact in any order,
  so a float64 `sum`, `index_add_` or matmul (any blocking, any FMA) of such integers is.

Reductions are made exact by fixed point: each reduced slice shares a power-of-two scale
from its largest magnitude (frexp of amax), its values are rounded to integers of as many
bits as the slice length allows (`53 - ceil(log2 n)`), summed exactly, scaled back.
The matmul is Ozaki-style: rows of A and columns of B scaled the same way, rounded to
integers, split into slices so every slice product sums exactly, the float64 products
combined in a fixed order (see `_plan`; on random inputs its error is within 1-4x of a
float32 matmul's). Transcendentals (exp, log, erf, sin, cos, ...) are our own range
reductions and fixed polynomials over float64 add/mul/div, relative errors below 1e-10
before the single rounding to float32 (results within 0.501 ulp of the true value,
measured). Float64 temporaries round to float32 once, at the end of each op. Every op is
an autograd Function (or a composition of them and of exact ops) whose backward obeys the
same rules, on float32 tensors (CPU; nothing here is CPU-specific).

Cost: a float64 matmul is ~2.5x a float32 one on AVX2 (one product per matmul for inner
dimensions up to 2048, two beyond), plus ~6 elementwise passes to slice each operand;
elementwise functions are 20-70 float64 passes. A training step of the small GPT or Llama
runs at about a quarter of native speed on an AMD EPYC (AVX2).

Non-finite values: a matmul row of A (column of B) holding an inf or nan makes that output
row (column) NaN; exact sums propagate inf/nan as IEEE does (any order gives the same);
elementwise functions follow IEEE (exp(-inf) = 0, log(0) = -inf, ...).

API: matmul, linear, sum, mean, exp, log, tanh, erf, sigmoid, silu, gelu, sin, cos, rsqrt,
softmax, cross_entropy, lm_loss, layer_norm, rms_norm, embedding, add, expand, repeat_kv,
dropout, scaled_dot_product_attention, rope_tables, normal_, skip_normal, grad_sq_norm,
clip_grad_norm_, AdamW, SGD.
"""

from __future__ import annotations

import builtins
import functools
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = [
    "SGD",
    "AdamW",
    "add",
    "clear_scratch",
    "clip_grad_norm_",
    "cos",
    "cross_entropy",
    "dropout",
    "embedding",
    "erf",
    "exp",
    "expand",
    "gelu",
    "grad_sq_norm",
    "layer_norm",
    "linear",
    "lm_loss",
    "log",
    "matmul",
    "mean",
    "normal_",
    "repeat_kv",
    "rms_norm",
    "rope_tables",
    "rsqrt",
    "scaled_dot_product_attention",
    "sigmoid",
    "silu",
    "sin",
    "skip_normal",
    "softmax",
    "sum",
    "tanh",
]

F64 = torch.float64
F32 = torch.float32
# Float64 temporaries of one matmul or loss chunk stay near this many elements (32 MB).
_CHUNK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------------------------
# Scratch buffers. A fresh large tensor costs a page fault per 4 KiB on first touch (about
# 2 ms per 4 MB in a VM, 20 elementwise passes), so the float64 temporaries of an op come
# from a per-thread pool, handed back when the op returns. Nothing from the pool is ever
# returned or saved for backward: ops return fresh float32 tensors.

_POOL_MAX_BYTES = 512 << 20
_POOL_MIN_ELEMENTS = 1 << 14


class _Pool(threading.local):
    def __init__(self) -> None:
        self.free: dict[tuple[torch.dtype, torch.device, int], list[Tensor]] = {}
        self.held: list[tuple[tuple[torch.dtype, torch.device, int], Tensor]] | None = None
        self.bytes = 0


_POOL = _Pool()


def _tmp(shape: Sequence[int], like: Tensor, dtype: torch.dtype = F64) -> Tensor:
    """An uninitialised work tensor of `shape` on like's device: from the pool inside a
    `_scoped` op (power-of-two buckets), else a plain allocation."""
    n = math.prod(shape)
    pool = _POOL
    if pool.held is None or n < _POOL_MIN_ELEMENTS:
        return torch.empty(tuple(shape), dtype=dtype, device=like.device)
    key = (dtype, like.device, 1 << (n - 1).bit_length())
    bufs = pool.free.get(key)
    if bufs:
        buf = bufs.pop()
        pool.bytes -= buf.nbytes
    else:
        buf = torch.empty(key[2], dtype=dtype, device=like.device)
    pool.held.append((key, buf))
    return buf.as_strided(shape, _contiguous_strides(shape))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _tmp_like(x: Tensor, dtype: torch.dtype = F64) -> Tensor:
    return _tmp(x.shape, x, dtype)


@contextmanager
def _scope() -> Iterator[None]:
    pool = _POOL
    outer, pool.held = pool.held, []
    try:
        yield
    finally:
        for key, buf in pool.held:
            if pool.bytes + buf.nbytes <= _POOL_MAX_BYTES:
                pool.free.setdefault(key, []).append(buf)
                pool.bytes += buf.nbytes
        pool.held = outer


_F = TypeVar("_F", bound=Callable[..., Any])


def _scoped(fn: _F) -> _F:
    """Run fn with the scratch pool (autograd Functions' forward and backward)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _scope():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def clear_scratch() -> None:
    """Free this thread's pooled scratch buffers (at most 512 MB are kept)."""
    _POOL.free.clear()
    _POOL.bytes = 0


# ---------------------------------------------------------------------------------------------
# Exact building blocks (float64)


def _ceil_log2(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _pow2(n: Tensor) -> Tensor:
    """2**n as float64, built from its bits (exact), for integer-valued n in [-1022, 1023]."""
    return ((n.to(torch.int64) + 1023) << 52).view(F64)


def _exponent(amax: Tensor) -> Tensor:
    """e with amax = m * 2**e, 0.5 <= m < 1 (frexp, exact), as int64; 0 for zero and non-finite."""
    _, e = torch.frexp(amax)
    return e.to(torch.int64).masked_fill_(~torch.isfinite(amax), 0)


def _absmax(x: Tensor, dims: tuple[int, ...], nonneg: bool = False) -> Tensor:
    """max |x| over dims (keepdim); NaN if a slice holds one (torch.aminmax is ~10x slower,
    amax and amin each as slow as abs and amax over a short last dimension)."""
    if nonneg:
        return x.amax(dims, keepdim=True)
    return torch.abs(x, out=_tmp_like(x, x.dtype)).amax(dims, keepdim=True)


def _fixed(x: Tensor, dims: tuple[int, ...], bits: int,
           nonneg: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """x as float64 integers q (scratch), |q| <= 2**bits, with x ~ q * unit and one
    unit = 2**(e - bits) (float64, keepdim) per slice over `dims`, e from the slice's largest
    magnitude (frexp). Non-finite values become 0 in q; `bad` (or None) marks the slices
    that held any."""
    amax = _absmax(x, dims, nonneg)
    if x.dtype == F32:
        fast = _fixed32(x, amax, bits)
        if fast is not None:
            return fast
    bad = None
    if not bool(torch.isfinite(amax).all()):
        bad = ~torch.isfinite(amax)
        x = torch.where(torch.isfinite(x), x, 0.0)
        amax = _absmax(x, dims)
    e = _exponent(amax)
    # float32 or float64 times a power of two, in float64: exact (a copy, then one dtype:
    # mixed-dtype kernels are slower).
    q = _tmp_like(x).copy_(x).mul_(_pow2(bits - e)).round_()
    return q, _pow2(e - bits), bad


def _fixed32(x: Tensor, amax: Tensor, bits: int) -> tuple[Tensor, Tensor, None] | None:
    """`_fixed` of float32 x with finite amax whose units 2**(e - bits) are normal float32
    (None otherwise): x / 2**(e - bits) and its rounding in float32 are exact and give the
    float64 path's integers (a value below 2**-126 rounds to a zero of its sign either way),
    in fewer, narrower passes. e is read from amax's float32 exponent field; a slice of
    zeros (whose q is 0 whatever its unit) gets the unit of amax = 1."""
    if amax.numel() == 0:
        return None
    lo_t, hi_t = torch.aminmax(amax)
    lo, hi = lo_t.item(), hi_t.item()
    if lo == 0.0:  # +-0: some slices are zero
        amax = amax.masked_fill(amax == 0, 1.0)
        lo = amax.amin().item()
    if not (lo >= _F32_SCALABLE[bits] and hi < math.inf):  # also False for NaN
        return None
    # amax = m 2**(E - 127), 1 <= m < 2, E its biased exponent field: frexp's e = E - 126,
    # and the unit 2**(e - bits) has the biased exponent E + 1 - bits.
    unit = torch.bitwise_and(amax.view(torch.int32), 0x7F800000).sub_((bits - 1) << 23).view(F32)
    q32 = torch.div(x, unit, out=_tmp_like(x, F32)).round_()
    return _tmp_like(x).copy_(q32), unit.to(F64), None


# The least float32 amax whose unit 2**(e - bits) is a normal float32 (e - bits >= -126,
# i.e. amax >= 2**(bits - 127)).
_F32_SCALABLE = [2.0 ** (bits - 127) for bits in range(64)]


def _nonfinite_sum(x: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    """The sum of x's inf and nan values alone: IEEE gives the same in every order."""
    return torch.where(torch.isfinite(x), 0.0, x.to(F64)).sum(dims, keepdim=keepdim)


def _dims(x: Tensor, dim: int | Sequence[int] | None) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(x.dim()))
    if isinstance(dim, int):
        return (dim % max(x.dim(), 1),)
    return tuple(sorted({d % max(x.dim(), 1) for d in dim}))


def _sum64(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False,
           nonneg: bool = False) -> Tensor:
    """The sum of x (float32 or float64) over dim as float64 (a fresh tensor), the same in
    every order: fixed point with `53 - ceil(log2 n)` bits relative to each slice's largest
    magnitude. nonneg: x >= 0 (saves a pass)."""
    dims = _dims(x, dim)
    if x.dim() == 0:
        return x.to(F64).clone()
    n = math.prod(x.shape[d] for d in dims)
    if n == 0:
        return x.to(F64).sum(dims, keepdim=keepdim)
    bits = 53 - _ceil_log2(n)
    q, unit, bad = _fixed(x, dims, bits, nonneg)
    s = q.sum(dims, keepdim=True).add_(0.0).mul_(unit)  # + 0.0: no -0.0 from -0.0 terms
    if bad is not None:
        s = torch.where(bad, _nonfinite_sum(x, dims, keepdim=True), s)
    return s if keepdim else s.squeeze(dims)


def _sum_to(g: Tensor, shape: torch.Size) -> Tensor:
    """Reduce a broadcast gradient g to `shape` by exact sums (float32 out)."""
    if g.shape == shape:
        return g
    lead = g.dim() - len(shape)
    dims = list(range(lead))
    dims += [lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1]
    return _sum64(g, dims, keepdim=True).view(shape).to(g.dtype)


def _check(*tensors: Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.dtype != F32:
            raise TypeError(f"portable ops take float32 tensors, not {t.dtype}")


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
    torch.mul(c.mul_(row), b.shift, out=out)  # the second product is exact: one rounding
    bads = [m for m in (a.bad, b.bad) if m is not None]
    if bads:
        out.masked_fill_(bads[0] if len(bads) == 1 else bads[0] | bads[1], math.nan)


@_scoped
def _mm(a: Tensor, b: Tensor, bias: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """a @ b * scale (+ bias) in float32; a (m, k) or (N, m, k), b (k, n) or (N, k, n).
    Rows go in chunks that bound the float64 memory (rows are independent: same bits)."""
    k, n = a.shape[-1], b.shape[-1]
    na, sa, nb, sb = _plan(k)
    batched = b.dim() == 3
    per_row = (k * (na + 1) + n * (na * nb + 1)) * (a.shape[-2] if batched else 1)
    step = max(1, _CHUNK_ELEMENTS // max(per_row, 1))
    bq = None if batched else _Operand.of(b, -2, nb, sb)
    out = torch.empty(*a.shape[:-1], n, dtype=F32, device=a.device)
    for i in range(0, a.shape[0], step):
        j = i + step
        bi = _Operand.of(b[i:j], -2, nb, sb) if bq is None else bq
        _product(_Operand.of(a[i:j], -1, na, sa), bi, sa, sb, out[i:j], scale)
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
        return _mm(x, w.t(), bias=b)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        gx = _mm(g, w) if ctx.needs_input_grad[0] else None
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


# ---------------------------------------------------------------------------------------------
# Elementwise functions: range reduction + fixed polynomials over float64 add/mul/div

# Polynomials: least squares on Chebyshev nodes against mpmath, relative errors as noted
# (a float32 ulp is 6e-8: 1e-10 moves a result by at most 0.002 ulp before its rounding).
_LN2_HI = 6.93147180369123816490e-01  # fdlibm: n * _LN2_HI is exact for |n| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_LN2 = 0.6931471805599453
_INV_LN2 = 1.44269504088896338700e00
# exp(r) = 1 + r P(r) on |r| <= ln2/2 (relative error 8e-11; exp(0) = 1 exactly), and
# P's Taylor series to r**12 for the few values that need float64 accuracy (RoPE's
# frequencies, whose error the position multiplies).
_EXP = (1.000000000031929, 0.500000004746336, 0.16666666242246436, 0.041666350836452856,
        0.008333403729066435, 0.0013941305961603472, 0.00019841237565617828)
_EXP_TAYLOR = tuple(1.0 / math.factorial(k + 1) for k in range(13))
# expm1(r) = r + r**2 Q(r) on |r| <= ln2/2 (relative error 9e-13).
_EXPM1_Q = (0.49999999999954214, 0.16666666666740224, 0.04166666678792255,
            0.00833333329284119, 0.0013888838627914794, 0.0001984130948710683,
            2.4868201415298224e-05, 2.7577492684559556e-06)
# erfc(z) = exp(-z**2) R(t), t = 3 / (3 + z), z in [0, 11]: R in u = t - 0.6071...
# (relative error 3.4e-11).
_ERFC_CENTER = 0.6071428571428571
_ERFC_R = (0.26182568066333617, 0.9105207722954834, 1.4575135117512237, 1.788136319329106,
           1.6065289530703208, 0.9236969525239134, 0.15569646037344054, -0.22067202135276143,
           -0.1382750389171878, 0.0529373962504922, 0.067883243521673, -0.015685485232664657,
           -0.02771398511409223)
# erf(z) = z P(z**2) for |z| <= 0.5 (relative error 1.2e-15).
_ERF_P = (1.1283791670955117, -0.3761263890315582, 0.11283791668264907, -0.02686616971787286,
          0.005223962531190169, -0.0008547017029036305, 0.00011992750992964791,
          -1.3361748480379085e-05)
# log(m) = 2 s (1 + w/3 + w**2/5 + ...), s = (m - 1)/(m + 1), w = s**2 <= 0.0295 (Taylor).
_LOG_P = tuple(1.0 / (2 * j + 1) for j in range(10))
# sin, cos on |r| <= pi/4 (Taylor to r**15 and r**16).
_SIN_P = tuple((-1) ** j / math.factorial(2 * j + 1) for j in range(8))
_COS_P = tuple((-1) ** j / math.factorial(2 * j) for j in range(9))
# pi/2 in three pieces (fdlibm): n * _PIO2_1 and n * _PIO2_2 are exact for |n| < 2**20.
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_2T = 2.02226624879595063154e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_TWO_OVER_SQRT_PI = 1.1283791670955126


# x / ln2 + _ROUND is an integer N + 1023 + 1.5 * 2**52: adding rounds x / ln2 to the nearest
# integer N (ties to even, as torch.round), and the low bits of the sum, shifted up by 52,
# are the bits of 2**N.
_ROUND = 1.5 * 2.0**52 + 1023.0


def _reduce_ln2(x: Tensor) -> tuple[Tensor, Tensor]:
    """x <- r (in place) with x = N ln2 + r, |r| <= ln2/2 + 1e-14 (|x| <= 110: N ln2 is off
    by at most 7e-15, and x - N ln2 is exact). Returns 2**N (float64) and a scratch tensor."""
    k = torch.mul(x, _INV_LN2, out=_tmp_like(x)).add_(_ROUND)
    x.sub_(t := torch.sub(k, _ROUND, out=_tmp_like(x)).mul_(_LN2))
    return k.view(torch.int64).bitwise_left_shift_(52).view(F64), t


def _horner_into(out: Tensor, u: Tensor, coeffs: Sequence[float]) -> Tensor:
    """sum(coeffs[i] * u**i) into out by Horner's rule, one rounding per multiply and add."""
    torch.mul(u, coeffs[-1], out=out).add_(coeffs[-2])
    for c in reversed(coeffs[:-2]):
        out.mul_(u).add_(c)
    return out


def _horner(u: Tensor, coeffs: Sequence[float]) -> Tensor:
    return _horner_into(_tmp_like(u), u, coeffs)


def _exp_(x: Tensor, coeffs: Sequence[float] = _EXP) -> Tensor:
    """exp of a float64 tensor (a new tensor; x is overwritten). Arguments are
    clamped to [-110, 110], which float32 results cannot tell apart from beyond."""
    two_n, t = _reduce_ln2(x.clamp_(-110.0, 110.0))
    return _horner_into(t, x, coeffs).mul_(x).add_(1.0).mul_(two_n)


def _expm1_(x: Tensor) -> Tensor:
    """exp(x) - 1 of a float64 tensor (new; x is overwritten), accurate relative near 0."""
    two_n, t = _reduce_ln2(x.clamp_(-60.0, 110.0))
    p = _horner_into(t, x, _EXPM1_Q).mul_(x).mul_(x).add_(x)  # expm1(r) = r + r**2 Q(r)
    return p.mul_(two_n).add_(two_n.sub_(1.0))  # 2**n expm1(r) + (2**n - 1)


def _log(x: Tensor) -> Tensor:
    """log of a float64 tensor (new tensor): x = m 2**e, m in [sqrt(1/2), sqrt(2))."""
    m, e = torch.frexp(x)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = e.to(F64).sub_(small.to(F64))
    f = m - 1.0  # exact (Sterbenz)
    s = f / (f + 2.0)
    w = s * s
    y = _horner(w, _LOG_P).mul_(s).mul_(2.0)
    y.add_(e * _LN2_LO).add_(e.mul_(_LN2_HI))
    y = torch.where(x == 0, -math.inf, y)
    y = torch.where(x < 0, math.nan, y)
    return torch.where(torch.isinf(x) & (x > 0), math.inf, y)


def _sincos(x: Tensor) -> tuple[Tensor, Tensor]:
    """sin and cos of a float64 tensor: x = n pi/2 + r, |r| <= pi/4 (accurate for |x| < 1e6;
    beyond, still the same bits everywhere, less accurate)."""
    n = torch.mul(x, _TWO_OVER_PI).round_()
    r = x - n * _PIO2_1
    r.sub_(n * _PIO2_2).sub_(n * _PIO2_2T)
    r2 = r * r
    s = _horner(r2, _SIN_P).mul_(r)
    c = _horner(r2, _COS_P)
    q = torch.where(torch.isfinite(n), n, 0.0).to(torch.int64).bitwise_and_(3)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def _erfc_pos_(a: Tensor) -> tuple[Tensor, Tensor]:
    """erfc(a) and exp(-a**2) for float64 a >= 0 (new tensors, accurate relative to the
    result; a is overwritten)."""
    a.clamp_(max=11.0)
    w = torch.mul(a, a, out=_tmp_like(a)).neg_()
    e = _exp_(w)
    u = a.add_(3.0).reciprocal_().mul_(3.0).sub_(_ERFC_CENTER)
    return _horner_into(w, u, _ERFC_R).mul_(e), e


def _erf(x: Tensor) -> Tensor:
    """erf of a float64 tensor: z P(z**2) near 0, 1 - erfc(|z|) beyond."""
    a = x.abs()
    small = _horner(x * x, _ERF_P).mul_(x)
    big = _erfc_pos_(a.clone())[0].neg_().add_(1.0)
    big = torch.where(x < 0, -big, big)
    return torch.where(a <= 0.5, small, torch.where(torch.isnan(x), x, big))


def _tanh(x: Tensor) -> Tensor:
    """tanh of a float64 tensor: -expm1(-2|x|) / (2 + expm1(-2|x|)), sign restored."""
    em = _expm1_(x.abs().mul_(-2.0))
    t = em.neg().div_(em.add_(2.0))
    return torch.copysign(t, x, out=t)


def _sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)) of a float64 tensor (new tensor)."""
    return _exp_(torch.neg(x, out=_tmp_like(x))).add_(1.0).reciprocal_()


class _Unary(torch.autograd.Function):
    """y = f(x) elementwise; the backward multiplies by f'(x), computed in forward in float64
    and kept in float32 (it replaces x among the saved tensors)."""

    @staticmethod
    @_scoped
    def forward(ctx: Any, x: Tensor, name: str) -> Tensor:
        y, dy = _UNARY[name](_tmp_like(x).copy_(x))
        ctx.save_for_backward(dy.to(F32))
        return y.to(F32)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        (dy,) = ctx.saved_tensors
        return g * dy, None


def _f_exp(x: Tensor) -> tuple[Tensor, Tensor]:
    y = _exp_(x)
    return y, y  # exp' = exp


def _f_log(x: Tensor) -> tuple[Tensor, Tensor]:
    return _log(x), torch.reciprocal(x)


def _f_tanh(x: Tensor) -> tuple[Tensor, Tensor]:
    y = _tanh(x)
    return y, (y * y).neg_().add_(1.0)


def _f_erf(x: Tensor) -> tuple[Tensor, Tensor]:
    return _erf(x), _exp_((x * x).neg_()).mul_(_TWO_OVER_SQRT_PI)


def _f_sigmoid(x: Tensor) -> tuple[Tensor, Tensor]:
    s = _sigmoid(x)
    return s, s.neg().add_(1.0).mul_(s)


def _f_silu(x: Tensor) -> tuple[Tensor, Tensor]:
    s = _sigmoid(x)
    y = x.mul_(s)
    dy = torch.neg(s, out=_tmp_like(s)).add_(1.0).mul_(y).add_(s)  # silu' = s + x s (1 - s)
    return y, dy


def _f_gelu(x: Tensor) -> tuple[Tensor, Tensor]:
    """x Phi(x) with Phi(x) = h for x < 0 and 1 - h for x > 0, h = erfc(|x|/sqrt 2)/2
    (relative accuracy in both tails); gelu' = Phi + x phi(x). No torch.where (slow)."""
    a = torch.abs(x, out=_tmp_like(x)).mul_(_SQRT_HALF)
    h, e = _erfc_pos_(a)  # e = exp(-x**2/2) = sqrt(2 pi) phi(x)
    h.mul_(0.5)
    step = torch.mul(x, 2.0**1000, out=a).clamp_(0.0, 1.0)  # 1 for x > 0, 0 for x < 0
    cdf = torch.mul(h, -2.0, out=_tmp_like(h)).add_(1.0).mul_(step).add_(h)  # x = 0: 1/2
    dy = e.mul_(_INV_SQRT_2PI).mul_(x).add_(cdf)
    return x.mul_(cdf), dy


def _f_sin(x: Tensor) -> tuple[Tensor, Tensor]:
    return _sincos(x)


def _f_cos(x: Tensor) -> tuple[Tensor, Tensor]:
    s, c = _sincos(x)
    return c, s.neg_()


def _f_rsqrt(x: Tensor) -> tuple[Tensor, Tensor]:
    r = torch.sqrt(x).reciprocal_()
    return r, (r * r).mul_(r).mul_(-0.5)


_UNARY = {
    "exp": _f_exp, "log": _f_log, "tanh": _f_tanh, "erf": _f_erf, "sigmoid": _f_sigmoid,
    "silu": _f_silu, "gelu": _f_gelu, "sin": _f_sin, "cos": _f_cos, "rsqrt": _f_rsqrt,
}


def _unary(name: str, x: Tensor) -> Tensor:
    _check(x)
    return _Unary.apply(x, name)


def exp(x: Tensor) -> Tensor:
    return _unary("exp", x)


def log(x: Tensor) -> Tensor:
    return _unary("log", x)


def tanh(x: Tensor) -> Tensor:
    return _unary("tanh", x)


def erf(x: Tensor) -> Tensor:
    return _unary("erf", x)


def sigmoid(x: Tensor) -> Tensor:
    return _unary("sigmoid", x)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) (llama's SwiGLU gate)."""
    return _unary("silu", x)


def gelu(x: Tensor) -> Tensor:
    """x * Phi(x), the exact (erf) GELU of nn.GELU()."""
    return _unary("gelu", x)


def sin(x: Tensor) -> Tensor:
    return _unary("sin", x)


def cos(x: Tensor) -> Tensor:
    return _unary("cos", x)


def rsqrt(x: Tensor) -> Tensor:
    return _unary("rsqrt", x)


# ---------------------------------------------------------------------------------------------
# Softmax, cross-entropy


def _softmax64(x: Tensor, dim: int, mask: Tensor | None) -> Tensor:
    """softmax of float32 x (+ additive mask) along dim, float64 scratch (a row masked
    entirely comes out uniform)."""
    d = _tmp_like(x).copy_(x)
    if mask is not None:
        d.add_(mask)
    m = d.amax(dim, keepdim=True)
    m.masked_fill_(~torch.isfinite(m), 0.0)
    e = _exp_(d.sub_(m))
    return e.div_(_sum64(e, dim, keepdim=True, nonneg=True))


class _Softmax(torch.autograd.Function):
    @staticmethod
    @_scoped
    def forward(ctx: Any, x: Tensor, dim: int, mask: Tensor | None) -> Tensor:
        p = _softmax64(x, dim, mask).to(F32)
        ctx.save_for_backward(p)
        ctx.dim = dim
        return p

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        (p,) = ctx.saved_tensors
        p64 = _tmp_like(p).copy_(p)
        gp = torch.mul(g, p64, out=_tmp_like(p))  # float32 * float32 in float64: exact
        dot = _sum64(gp, ctx.dim, keepdim=True)
        return gp.sub_(p64.mul_(dot)).to(F32), None, None  # p (g - sum(g p))


def softmax(x: Tensor, dim: int = -1, mask: Tensor | None = None) -> Tensor:
    """softmax(x + mask) along dim; mask (broadcast to x, no gradient): float, added (0 or
    -inf), or bool, True where x is kept."""
    _check(x)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, device=x.device).masked_fill_(~mask, -math.inf)
    return _Softmax.apply(x, dim % x.dim(), mask)


class _CrossEntropy(torch.autograd.Function):
    """Mean of -log softmax(logits)[target] over N rows, in row chunks (bounded memory)."""

    @staticmethod
    @_scoped
    def forward(ctx: Any, logits: Tensor, target: Tensor) -> Tensor:
        N, V = logits.shape
        step = max(1, _CHUNK_ELEMENTS // max(V, 1))
        probs = torch.empty_like(logits)
        losses = torch.empty(N, dtype=F64, device=logits.device)
        for i in range(0, N, step):
            x, t = logits[i:i + step], target[i:i + step, None]
            d = _tmp_like(x).copy_(x)
            m = d.amax(1, keepdim=True)
            m.masked_fill_(~torch.isfinite(m), 0.0)
            picked = d.sub_(m).gather(1, t)  # logit - max at the target
            e = _exp_(d)
            z = _sum64(e, 1, keepdim=True, nonneg=True)
            probs[i:i + step] = e.div_(z)
            losses[i:i + step] = _log(z).sub_(picked).squeeze(1)
        ctx.save_for_backward(probs, target)
        return (_sum64(losses, 0) / N).to(F32)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        probs, target = ctx.saved_tensors
        N = probs.shape[0]
        scale = g.to(F64) / N
        grad = torch.empty_like(probs)
        step = max(1, _CHUNK_ELEMENTS // max(probs.shape[1], 1))
        for i in range(0, N, step):
            p = _tmp_like(probs[i:i + step]).copy_(probs[i:i + step])
            p.scatter_add_(1, target[i:i + step, None], torch.full_like(p[:, :1], -1.0))
            grad[i:i + step] = p.mul_(scale)  # (softmax - onehot) * g / N
        return grad, None


def cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """F.cross_entropy(logits (N, V), target (N,)) with mean reduction (no ignore_index,
    no label smoothing)."""
    _check(logits)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError("cross_entropy takes logits (N, V) and target (N,)")
    return _CrossEntropy.apply(logits, target)


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """The portable trainer.engine.lm_loss: cross-entropy over (B, T, V) logits and (B, T)
    targets, the mean over all B*T tokens."""
    return cross_entropy(logits.flatten(0, 1), target.flatten())


# ---------------------------------------------------------------------------------------------
# Normalisation


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    @_scoped
    def forward(ctx: Any, x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> Tensor:
        C = x.shape[-1]
        xc = _tmp_like(x).copy_(x)
        mu = _sum64(xc, -1, keepdim=True).div_(C)
        xc.sub_(mu)
        sq = torch.mul(xc, xc, out=_tmp_like(x))
        rstd = _sum64(sq, -1, keepdim=True, nonneg=True).div_(C).add_(eps).sqrt_().reciprocal_()
        y = xc.mul_(rstd)
        ctx.save_for_backward(x, w, mu, rstd)
        if w is not None:
            y.mul_(w)
        if b is not None:
            y.add_(b)
        return y.to(F32)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, w, mu, rstd = ctx.saved_tensors
        xhat = _tmp_like(x).copy_(x).sub_(mu).mul_(rstd)
        batch = tuple(range(x.dim() - 1))
        t = torch.mul(g, xhat, out=_tmp_like(x))
        gw = _sum64(t, batch).to(F32) if ctx.needs_input_grad[1] else None
        gb = _sum64(g, batch).to(F32) if ctx.needs_input_grad[2] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gxh = _tmp_like(g).copy_(g)
            if w is not None:
                gxh.mul_(w)
            a = _sum64(gxh, -1, keepdim=True).div_(x.shape[-1])
            c = _sum64(torch.mul(gxh, xhat, out=t), -1, keepdim=True).div_(x.shape[-1])
            gx = gxh.sub_(a).sub_(xhat.mul_(c)).mul_(rstd).to(F32)
        return gx, gw, gb, None


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """nn.LayerNorm over the last dimension: (x - mean) / sqrt(var + eps) * weight + bias."""
    _check(x, weight, bias)
    return _LayerNorm.apply(x, weight, bias, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    @_scoped
    def forward(ctx: Any, x: Tensor, w: Tensor | None, eps: float) -> Tensor:
        x64 = _tmp_like(x).copy_(x)
        sq = torch.mul(x64, x64, out=_tmp_like(x))
        r = _sum64(sq, -1, keepdim=True, nonneg=True).div_(x.shape[-1]).add_(eps).sqrt_().reciprocal_()
        ctx.save_for_backward(x, w, r)
        y = x64.mul_(r)
        return (y if w is None else y.mul_(w)).to(F32)

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, r = ctx.saved_tensors
        xhat = _tmp_like(x).copy_(x).mul_(r)
        batch = tuple(range(x.dim() - 1))
        t = torch.mul(g, xhat, out=_tmp_like(x))
        gw = _sum64(t, batch).to(F32) if ctx.needs_input_grad[1] else None
        gx = None
        if ctx.needs_input_grad[0]:
            gxh = _tmp_like(g).copy_(g)
            if w is not None:
                gxh.mul_(w)
            c = _sum64(torch.mul(gxh, xhat, out=t), -1, keepdim=True).div_(x.shape[-1])
            gx = gxh.sub_(xhat.mul_(c)).mul_(r).to(F32)
        return gx, gw, None


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x * rsqrt(mean(x**2) + eps) * weight over the last dimension (llama's RMSNorm)."""
    _check(x, weight)
    return _RMSNorm.apply(x, weight, eps)


# ---------------------------------------------------------------------------------------------
# Embedding, dropout, attention


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        return weight[ids]

    @staticmethod
    @_scoped
    def backward(ctx: Any, g: Tensor) -> tuple[None, Tensor]:
        (ids,) = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])  # (N, C)
        idx = ids.reshape(-1)
        bits = 53 - _ceil_log2(max(g2.shape[0], 1))
        # One scale per column over all N rows: any sum of them is exact in any order.
        q, unit, bad = _fixed(g2, (0,), bits)
        acc = _tmp((ctx.rows, g2.shape[1]), g).zero_()
        acc.index_add_(0, idx, q).add_(0.0).mul_(unit)
        if bad is not None:
            nf = torch.where(torch.isfinite(g2), 0.0, g2.to(F64))
            nf_acc = torch.zeros_like(acc).index_add_(0, idx, nf)
            acc = torch.where(torch.isfinite(nf_acc) & (nf_acc == 0), acc, nf_acc)
        return None, acc.to(F32)


def embedding(ids: Tensor, weight: Tensor) -> Tensor:
    """weight[ids]; the gradient accumulates repeated ids exactly (fixed point, index_add)."""
    _check(weight)
    return _Embedding.apply(ids, weight)


def dropout(x: Tensor, p: float, training: bool = True, generator: torch.Generator | None = None) -> Tensor:
    """Inverted dropout from torch.rand (portable draws): x * keep / (1 - p)."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    keep = torch.rand(x.shape, generator=generator, device=x.device) >= p
    return x * (keep.to(F32) * (1.0 / (1.0 - p)))


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, mask: Tensor | None = None,
    dropout_p: float = 0.0, scale: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """softmax(q k^T * scale, masked) v for q (B, nh, T, hs), k and v (B, nh, S, hs) (repeat
    grouped key/value heads first with `repeat_kv`). `causal`: query i sees keys <= i (as
    F.scaled_dot_product_attention's is_causal); `mask`: bool, True where attention is
    allowed, or float, added to the scores."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = matmul(q, k.transpose(-2, -1), scale=scale)  # (B, nh, T, S)
    T, S = s.shape[-2], s.shape[-1]
    add = None
    if causal:
        add = torch.full((T, S), -math.inf, device=q.device).triu_(1)  # 0 on and below the diagonal
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, device=q.device).masked_fill_(~mask, -math.inf)
        add = mask if add is None else add + mask
    p = dropout(softmax(s, -1, mask=add), dropout_p, generator=generator)
    return matmul(p, v)  # (B, nh, T, hs)


def rope_tables(head_dim: int, theta: float, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary cos and sin tables, (T, hs) float32 each, for positions (T,): angles
    pos * theta**(-2j/hs) in float64 (theta**x as exp(x log theta))."""
    j = torch.arange(0, head_dim, 2, dtype=F64, device=positions.device)
    log_theta = _log(torch.tensor([float(theta)], dtype=F64, device=positions.device))
    inv_freq = _exp_(j.div_(head_dim).mul_(log_theta).neg_(), _EXP_TAYLOR)  # (hs/2,)
    angles = positions.to(F64)[:, None] * inv_freq[None, :]  # (T, hs/2)
    sin, cos = _sincos(torch.cat((angles, angles), dim=-1))
    return cos.to(F32), sin.to(F32)


# ---------------------------------------------------------------------------------------------
# Initialisation


_NORMAL_PAIRS = 1 << 18  # Box-Muller pairs per chunk of draws (part of the definition)


def _normal_chunks(n: int) -> Iterator[tuple[int, int]]:
    """(offset, Box-Muller pairs) of each chunk of `normal_`'s draws for n values."""
    for i in range(0, n, 2 * _NORMAL_PAIRS):
        yield i, (min(n - i, 2 * _NORMAL_PAIRS) + 1) // 2


def skip_normal(n: int, generator: torch.Generator | None = None) -> None:
    """Move `generator` on exactly as `normal_` on n values would (the same `torch.rand`
    calls), without the transform: building one pipeline stage alone passes over the
    draws of the tensors before it this way (trainer/stage_init.py)."""
    for _, c in _normal_chunks(n):
        torch.rand(2 * c, dtype=F64, generator=generator)


@torch.no_grad()
def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0,
            generator: torch.Generator | None = None) -> Tensor:
    """Fill tensor with N(mean, std**2) draws from torch.rand (portable) by Box-Muller with
    our log, sqrt and sin/cos. Per chunk of up to 2**18 pairs: u = rand(2c) (float64),
    r = sqrt(-2 log(1 - u[:c])), t = 2 pi u[c:], values r cos t then r sin t. Without a
    generator, torch's default one (so torch.manual_seed applies)."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.new_empty(tensor.numel())
    n = flat.numel()
    for i, c in _normal_chunks(n):
        u = torch.rand(2 * c, dtype=F64, generator=generator, device=tensor.device)
        r = _log(u[:c].neg().add_(1.0)).mul_(-2.0).sqrt_()
        sin, cos = _sincos(u[c:].mul(2.0 * math.pi))
        z = torch.cat((r * cos, r * sin))[: min(n - i, 2 * c)]
        flat[i:i + z.numel()] = z.mul_(std).add_(mean)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# ---------------------------------------------------------------------------------------------
# Gradient norm, optimizers


def grad_sq_norm(tensors: Iterable[Tensor]) -> Tensor:
    """sum of squares of all elements (float64 scalar), the same in every order: fixed point
    on one scale shared by all tensors. inf/nan give inf/nan."""
    ts = [t.detach().reshape(-1) for t in tensors]
    if not ts:
        return torch.zeros((), dtype=F64)
    squares = [t.to(F64) * t.to(F64) for t in ts]  # exact: a float32 square fits a float64
    amax = torch.stack([s.max() if s.numel() else s.new_zeros(()) for s in squares]).max()
    if not bool(torch.isfinite(amax)):
        return torch.stack([s.sum() for s in squares]).sum()  # IEEE: inf, or nan
    bits = 53 - _ceil_log2(max(1, builtins.sum(s.numel() for s in squares)))
    e = _exponent(amax)
    up = _pow2(bits - e)
    total = torch.stack([(s * up).round_().sum() for s in squares]).sum()
    return total.add_(0.0).mul_(_pow2(e - bits))


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, eps: float = 1e-6) -> Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) with the exact grad_sq_norm: scale every
    gradient by min(1, max_norm / (norm + eps)) (a float32 multiply). Returns the norm
    (float64 scalar)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = grad_sq_norm(grads).sqrt()
    coef = torch.clamp(max_norm / (norm + eps), max=1.0).to(F32)
    for g in grads:
        g.mul_(coef)
    return norm


def _power(base: float, n: int) -> float:
    """base**n by binary powering (IEEE multiplies: the same everywhere, unlike libm pow)."""
    result, b = 1.0, base
    while n:
        if n & 1:
            result *= b
        b *= b
        n >>= 1
    return result


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same param groups, state layout and update formula) whose update is
    float64 elementwise ops rounded to float32 state: p *= 1 - lr wd; m = b1 m + (1-b1) g;
    v = b2 v + (1-b2) g**2; p -= lr/(1-b1**t) * m / (sqrt(v)/sqrt(1-b2**t) + eps)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["amsgrad"] or group["fused"] or group["capturable"] or group["differentiable"]:
                raise NotImplementedError("portable AdamW: no amsgrad, fused, capturable, differentiable")
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        _check(p, p.grad)
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=F32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        b1, b2 = (float(b) for b in group["betas"])
        state["step"] += 1
        t = int(state["step"].item())
        assert p.grad is not None
        g = p.grad.to(F64)
        if group["maximize"]:
            g.neg_()
        m = state["exp_avg"].to(F64).mul_(b1).add_(g * (1.0 - b1))
        v = state["exp_avg_sq"].to(F64).mul_(b2).add_(g.mul_(g).mul_(1.0 - b2))
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        # The update reads the float32 state, as a resumed run would.
        step_size = lr / (1.0 - _power(b1, t))
        denom = state["exp_avg_sq"].to(F64).sqrt_().div_(math.sqrt(1.0 - _power(b2, t)))
        upd = state["exp_avg"].to(F64).div_(denom.add_(eps)).mul_(step_size)
        p64 = p.to(F64)
        if wd != 0.0:
            p64.mul_(1.0 - lr * wd)
        p.copy_(p64.sub_(upd))


class SGD(torch.optim.SGD):
    """torch.optim.SGD (momentum, dampening, nesterov, weight decay; same state layout) with
    float64 elementwise updates rounded to float32."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        _check(p, p.grad)
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        momentum, dampening = float(group["momentum"]), float(group["dampening"])
        assert p.grad is not None
        g = p.grad.to(F64)
        if group["maximize"]:
            g.neg_()
        if wd != 0.0:
            g.add_(p.to(F64).mul_(wd))
        if momentum != 0.0:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.to(F32)
            else:
                buf.copy_(buf.to(F64).mul_(momentum).add_(g * (1.0 - dampening)))
            g = g.add_(buf.to(F64).mul_(momentum)) if group["nesterov"] else buf.to(F64)
        p.copy_(p.to(F64).sub_(g.mul_(lr)))
