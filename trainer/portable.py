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

Modules: trainer/portable_core.py (scratch pool, fixed point, exact sums),
trainer/portable_mm.py (matmul, linear, broadcasts; each weight's slices kept between
microbatches while its values hold), trainer/portable_fn.py (elementwise functions, softmax,
cross-entropy, norms), and this one (embedding, attention, initialisation, optimizers),
which re-exports the whole API:

API: matmul, linear, sum, mean, exp, log, tanh, erf, sigmoid, silu, gelu, sin, cos, rsqrt,
softmax, cross_entropy, lm_loss, layer_norm, rms_norm, embedding, add, expand, repeat_kv,
dropout, scaled_dot_product_attention, rope_tables, normal_, skip_normal, grad_sq_norm,
clip_grad_norm_, AdamW, SGD.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from trainer import portable_core, portable_mm
from trainer.portable_core import (
    F32,
    F64,
    _ceil_log2,
    _check,
    _exponent,
    _fixed,
    _pow2,
    _scoped,
    _tmp,
)
from trainer.portable_fn import (
    _EXP_TAYLOR,
    _exp_,
    _log,
    _sincos,
    cos,
    cross_entropy,
    erf,
    exp,
    gelu,
    layer_norm,
    lm_loss,
    log,
    rms_norm,
    rsqrt,
    sigmoid,
    silu,
    sin,
    softmax,
    tanh,
)
from trainer.portable_mm import add, expand, linear, matmul, mean, repeat_kv, sum

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



def clear_scratch() -> None:
    """Free this thread's pooled scratch buffers (at most 512 MB are kept) and cached weight
    slices (at most 256 MB)."""
    portable_core.clear_scratch()
    portable_mm.clear_weight_slices()


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
