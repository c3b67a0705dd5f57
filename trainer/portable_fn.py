"""Portable numerics, the elementwise functions (our own range reductions and fixed
polynomials over float64 add/mul/div: exp, log, tanh, erf, sigmoid, silu, gelu, sin, cos,
rsqrt), softmax, cross-entropy and the norms, each an autograd Function. See
trainer/portable.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.portable_core import _CHUNK_ELEMENTS, F32, F64, _check, _scoped, _sum64, _tmp_like

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
    """The portable trainer.pipeline.lm_loss: cross-entropy over (B, T, V) logits and (B, T)
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


