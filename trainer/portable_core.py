"""Portable numerics, the exact building blocks (trainer/portable.py's module docstring
says what portable means): the float64 scratch pool, fixed-point scaling of tensor slices
(`_fixed`), exact sums in any order (`_sum64`, `_sum_to`) and the float32 argument check."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import Tensor

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
    shape = tuple(shape)
    n = math.prod(shape)
    pool = _POOL
    if pool.held is None or n < _POOL_MIN_ELEMENTS:
        return torch.empty(shape, dtype=dtype, device=like.device)
    key = (dtype, like.device, 1 << (n - 1).bit_length())
    bufs = pool.free.get(key)
    if bufs:
        buf = bufs.pop()
        pool.bytes -= buf.nbytes
    else:
        buf = torch.empty(key[2], dtype=dtype, device=like.device)
    pool.held.append((key, buf))
    return buf.as_strided(shape, _contiguous_strides(shape))


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _tmp_like(x: Tensor, dtype: torch.dtype = F64) -> Tensor:
    return _tmp(x.shape, x, dtype)


def _release(held: list[tuple[tuple[torch.dtype, torch.device, int], Tensor]]) -> None:
    pool = _POOL
    for key, buf in held:
        if pool.bytes + buf.nbytes <= _POOL_MAX_BYTES:
            pool.free.setdefault(key, []).append(buf)
            pool.bytes += buf.nbytes


@contextmanager
def _scope() -> Iterator[None]:
    pool = _POOL
    outer, pool.held = pool.held, []
    try:
        yield
    finally:
        held, pool.held = pool.held, outer
        _release(held)


_F = TypeVar("_F", bound=Callable[..., Any])


def _scoped(fn: _F) -> _F:
    """Run fn with the scratch pool (autograd Functions' forward and backward)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        pool = _POOL  # `_scope` inlined: this wraps every op
        outer, pool.held = pool.held, []
        try:
            return fn(*args, **kwargs)
        finally:
            held, pool.held = pool.held, outer
            _release(held)

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
    fast = _fixed32(x, amax, bits) if x.dtype == F32 else _fixed64(x, amax, bits) if x.dtype == F64 else None
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


def _scalable(amax: Tensor, zero_as: float, least: float) -> Tensor | None:
    """`amax` with its zero slices' entries set to `zero_as`, when every entry then is at
    least `least` and all are finite (None otherwise, and for no slices)."""
    if amax.numel() == 0:
        return None
    lo_t, hi_t = torch.aminmax(amax)
    lo, hi = lo_t.item(), hi_t.item()
    if lo == 0.0:  # +-0: some slices are zero
        amax = amax.masked_fill(amax == 0, zero_as)
        lo = amax.amin().item()
    if not (lo >= least and hi < math.inf):  # also False for NaN
        return None
    return amax


def _fixed32(x: Tensor, amax: Tensor, bits: int) -> tuple[Tensor, Tensor, None] | None:
    """`_fixed` of float32 x with finite amax whose units 2**(e - bits) are normal float32
    (None otherwise): x / 2**(e - bits) and its rounding in float32 are exact and give the
    float64 path's integers (a value below 2**-126 rounds to a zero of its sign either way),
    in fewer, narrower passes. e is read from amax's float32 exponent field; a slice of
    zeros (whose q is 0 whatever its unit) gets the unit of amax = 1."""
    top = _scalable(amax, 1.0, _F32_SCALABLE[bits])
    if top is None:
        return None
    # amax = m 2**(E - 127), 1 <= m < 2, E its biased exponent field: frexp's e = E - 126,
    # and the unit 2**(e - bits) has the biased exponent E + 1 - bits.
    unit = torch.bitwise_and(top.view(torch.int32), 0x7F800000).sub_((bits - 1) << 23).view(F32)
    q32 = torch.div(x, unit, out=_tmp_like(x, F32)).round_()
    return _tmp_like(x).copy_(q32), unit.to(F64), None


def _fixed64(x: Tensor, amax: Tensor, bits: int) -> tuple[Tensor, Tensor, None] | None:
    """`_fixed` of float64 x whose slices' amax are finite and whose units 2**(e - bits)
    and scales 2**(bits - e) are normal float64 (None otherwise): the general path's
    integers and units with e read from amax's exponent field instead of frexp, and no
    copy (x * 2**(bits - e), one rounding, as there). A slice of zeros gets frexp's e = 0
    (amax 0.5 stands in for it)."""
    top = _scalable(amax, 0.5, _F64_SCALABLE[bits])
    if top is None:
        return None
    # amax = m 2**(E - 1023), 1 <= m < 2: frexp's e = E - 1022, and the unit 2**(e - bits)
    # has the biased exponent U = E + 1 - bits, its inverse 2046 - U.
    unit = torch.bitwise_and(top.view(torch.int64), 0x7FF0000000000000).sub_((bits - 1) << 52)
    scale = torch.sub(2046 << 52, unit).view(F64)
    return torch.mul(x, scale, out=_tmp_like(x)).round_(), unit.view(F64), None


# The least float32 amax whose unit 2**(e - bits) is a normal float32 (e - bits >= -126,
# i.e. amax >= 2**(bits - 127)).
_F32_SCALABLE = [2.0 ** (bits - 127) for bits in range(64)]
# The least float64 amax whose unit and its inverse are normal: a normal amax (E >= 1)
# with E >= bits.
_F64_SCALABLE = [2.0 ** (max(bits, 1) - 1023) for bits in range(64)]


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

