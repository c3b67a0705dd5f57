"""Pseudo-gradient compression with error feedback: one interface, four kinds.

A replica compresses its pseudo-gradient delta once per outer step. What it sends is a
safetensors blob (the `Contribution` it publishes); every replica, and later a verifier,
decodes the R blobs with `decode_contribution` and averages them in replica order, so the
aggregate is recomputable bit for bit from the published blocks.

Kinds (`[outer.compression] kind`):
- ``none``: float32, keys ``delta/<name>`` (the pre-compression layout, unchanged);
- ``quantize``: b-bit symmetric integers with one float32 scale per row;
- ``lowrank``: PowerSGD-style (Vogels et al., 2019): a warm-started power iteration gives
  M ~ P Q^T with P orthonormal (m, r) and Q (n, r); both factors are stored transposed,
  (r, m) and (r, n), quantised to b bits with one scale per row (per rank component).
  1-D tensors are quantised only;
- ``adaptive``: rank and bits picked per tensor each outer step (rule below).

Error feedback (Seide et al., 2014; Karimireddy et al., 2019): with M = e + delta,
send C(M) and keep e <- M - D(C(M)), the exact decoded value, so nothing is lost for
good, only delayed.

The adaptive rule (ours; the DiLoCoX paper gives none). Per 2-D tensor, each outer step t:
1. Power-iterate M at r_cap = min(max_rank, m, n) from the warm start and rotate the
   factors to M's principal directions (a small SVD of Q), so component j carries
   energy s_j^2 and the relative low-rank error of rank k is sqrt(1 - sum_{j<k} s_j^2 /
   ||M||^2): the compression error, measured per tensor before anything is sent.
2. Energy target tau_t = energy * (0.5 + 0.5 * min(1, t / warmup_steps)): aggressive
   early, when pseudo-gradients are large and quickly corrected, eased later. If the
   replica's round loss did not improve on the previous round, tau eases by 0.05 more
   (kept until the loss improves again; the loss trend asks for fidelity).
3. Rank k = the smallest rank capturing tau_t of ||M||^2 (at most r_cap). If k factors cost
   at least as many bytes as quantising the whole tensor, the tensor is quantised whole
   instead (a high-rank pseudo-gradient is not worth factorising).
4. Bits: 4 to start; a tensor whose measured error after quantisation exceeds its
   low-rank error by more than 10% of ||M|| goes to 8 bits the next step (and back to 4
   when it no longer does).
5. Bandwidth cap: if the payload would exceed `budget_bytes` (the bytes the link moves
   within the overlap window, computed by the engine from the round's measured compute
   time and the configured bandwidth), whole-quantised matrices go back to their factors
   and ranks are halved, largest tensor first, until it fits or every rank is 1. The
   budget is a wall-clock measurement nobody can re-derive, so a payload whose cap bit
   records it (``adaptive/budget``, float64, ignored by the decoder): a replay re-runs the
   rule with the recorded budget and gets the same decisions (`payload_budget`).
1-D tensors (norms, biases) are quantised whole at 8 bits.

Reconstruction is pure elementwise float32 arithmetic in a fixed order (no matmul), so
decoding gives the same bits whatever the thread count.

A compressor's whole state (residuals, warm starts, adaptive bits and loss trend, the
generator of first warm starts) round-trips through `state_tensors` / `load_state_tensors`,
so a replay can start a round's compression exactly where training did.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.config import CompressionConfig

__all__ = [
    "CODEC_LOWRANK",
    "CODEC_NONE",
    "CODEC_QUANT",
    "Compressor",
    "decode_contribution",
    "dequantize_rows",
    "lowrank_reconstruct",
    "payload_budget",
    "quantize_rows",
]

CODEC_NONE, CODEC_QUANT, CODEC_LOWRANK = 0, 1, 2
ONE_D_BITS = 8  # norms and biases: few values, quantised whole
_EASE_STEP = 0.05
BUDGET_KEY = "adaptive/budget"  # the byte budget that capped an adaptive payload


def _levels(bits: int) -> int:
    """Largest magnitude of a symmetric b-bit integer: 127, 7 or 1."""
    assert bits in (2, 4, 8), f"bits ({bits}) must be 2, 4 or 8"
    return 2 ** (bits - 1) - 1


def _pack(u: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols) uint8 values < 2**bits -> (rows, ceil(cols * bits / 8)) uint8."""
    if bits == 8:
        return u.contiguous()
    per = 8 // bits
    rows, cols = u.shape
    pad = (-cols) % per
    if pad:
        u = torch.cat([u, torch.zeros(rows, pad, dtype=torch.uint8)], dim=1)
    u = u.view(rows, -1, per).to(torch.int32)  # (rows, nbytes, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits  # (per,)
    return (u << shifts).sum(dim=2).to(torch.uint8)  # (rows, nbytes)


def _unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits  # (per,)
    u = (packed.to(torch.int32)[:, :, None] >> shifts) & (2**bits - 1)  # (rows, nbytes, per)
    return u.reshape(packed.size(0), -1)[:, :cols].to(torch.uint8)


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float -> (packed uint8, float32 scale per row).

    Symmetric round-to-nearest: |x - dequantize(quantize(x))| <= scale / 2 per element,
    with scale = max|row| / (2**(bits-1) - 1).
    """
    levels = _levels(bits)
    x = x.float()
    scale = x.abs().amax(dim=1) / levels  # (rows,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe[:, None]).clamp_(-levels, levels)  # (rows, cols)
    u = (q + levels).to(torch.uint8)
    return _pack(u, bits), scale


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    levels = _levels(bits)
    u = _unpack(packed, bits, cols).float()  # (rows, cols)
    return (u - levels) * scale[:, None]


def lowrank_reconstruct(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_k outer(u[k], v[k]) for u (r, m), v (r, n), in order k = 0..r-1: (m, n).

    Elementwise only, so the bits do not depend on BLAS or the thread count.
    """
    out = torch.zeros(u.size(1), v.size(1))
    for k in range(u.size(0)):
        out.add_(u[k][:, None] * v[k][None, :])
    return out


def _as_matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """How a tensor is viewed for compression: (shape[0], rest) for >= 2-D, (1, n) for 1-D."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def _quant_bytes(rows: int, cols: int, bits: int) -> int:
    return rows * math.ceil(cols * bits / 8) + 4 * rows


def _lowrank_bytes(m: int, n: int, rank: int, bits: int) -> int:
    return _quant_bytes(rank, m, bits) + _quant_bytes(rank, n, bits)


def _encode(name: str, M: torch.Tensor, codec: int, bits: int, factors=None) -> dict:
    """Payload tensors for one tensor viewed as (m, n); `factors` = (P (m, r), Q (n, r))."""
    out = {f"meta/{name}": torch.tensor([codec, bits, 0], dtype=torch.int32)}
    if codec == CODEC_QUANT:
        out[f"q/{name}"], out[f"q_scale/{name}"] = quantize_rows(M, bits)
    else:
        P, Q = factors
        out[f"meta/{name}"][2] = P.size(1)
        out[f"u/{name}"], out[f"u_scale/{name}"] = quantize_rows(P.T, bits)  # (r, m)
        out[f"v/{name}"], out[f"v_scale/{name}"] = quantize_rows(Q.T, bits)  # (r, n)
    return out


def _decode_one(name: str, payload: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    if f"delta/{name}" in payload:
        t = payload[f"delta/{name}"]
        if t.shape != shape:
            raise ValueError(f"contribution: delta/{name} has shape {tuple(t.shape)}, want {tuple(shape)}")
        return t.float()
    if f"meta/{name}" not in payload:
        raise ValueError(f"contribution: no delta/{name} or meta/{name}")
    codec, bits, rank = (int(v) for v in payload[f"meta/{name}"].tolist())
    if bits not in (2, 4, 8):
        raise ValueError(f"contribution: meta/{name} has bits {bits}")
    m, n = _as_matrix_shape(shape)
    try:
        if codec == CODEC_QUANT:
            M = dequantize_rows(payload[f"q/{name}"], payload[f"q_scale/{name}"], bits, n)
        elif codec == CODEC_LOWRANK:
            u = dequantize_rows(payload[f"u/{name}"], payload[f"u_scale/{name}"], bits, m)
            v = dequantize_rows(payload[f"v/{name}"], payload[f"v_scale/{name}"], bits, n)
            if u.size(0) != rank or v.size(0) != rank:
                raise ValueError(f"contribution: {name} factors disagree with rank {rank}")
            M = lowrank_reconstruct(u, v)
        else:
            raise ValueError(f"contribution: meta/{name} has unknown codec {codec}")
    except KeyError as exc:
        raise ValueError(f"contribution: missing {exc.args[0]}") from None
    except RuntimeError as exc:
        raise ValueError(f"contribution: {name} does not decode to {tuple(shape)}: {exc}") from None
    if M.shape != (m, n):
        raise ValueError(f"contribution: {name} decodes to {tuple(M.shape)}, want {(m, n)}")
    return M.reshape(shape)


def payload_budget(data: bytes) -> float | None:
    """The byte budget an adaptive payload was capped to, or None when the cap did not bite."""
    t = bytes_to_tensors(data).get(BUDGET_KEY)
    return None if t is None else float(t.double().reshape(-1)[0])


def decode_contribution(data: bytes, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """A published contribution (any kind) back to float32 pseudo-gradients by name."""
    payload = bytes_to_tensors(data)
    return {name: _decode_one(name, payload, shapes[name]) for name in sorted(shapes)}


def _orthonormalize(P: torch.Tensor) -> torch.Tensor:
    Qr, _ = torch.linalg.qr(P)  # (m, r) orthonormal columns
    return Qr


@dataclass
class _TensorState:
    shape: torch.Size
    residual: torch.Tensor  # error feedback e, (shape)
    warm: torch.Tensor | None = None  # (n, r_cap) warm start of the power iteration
    bits: int = 4  # adaptive: current bits of this tensor
    last: dict = field(default_factory=dict)  # rank, bits, errors of the latest step


class Compressor:
    """One replica-stage's compression state: error feedback, warm starts, adaptive rule.

    Args:
        cfg: `[outer.compression]`.
        shapes: parameter name -> shape, the stage's parameters.
        seed: seeds the power iteration's first warm start (derive it from run seed,
            replica and stage so every replica differs and every rerun agrees).
    """

    def __init__(self, cfg: CompressionConfig, shapes: dict[str, torch.Size], seed: int):
        self.cfg = cfg
        self.names = sorted(shapes)
        keep = cfg.kind != "none" and cfg.error_feedback
        self.state = {
            n: _TensorState(shapes[n], torch.zeros(shapes[n] if keep else (0,))) for n in self.names
        }
        self._gen = torch.Generator().manual_seed(seed)
        self._prev_loss: float | None = None
        self._ease = 0.0
        self.last_stats: dict[str, float] = {}
        self.total_s = 0.0  # time spent in compress(), cumulative

    def state_bytes(self) -> int:
        """Bytes of error-feedback residuals and warm starts."""
        total = 0
        for st in self.state.values():
            total += 4 * st.residual.numel()
            if st.warm is not None:
                total += 4 * st.warm.numel()
        return total

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything `compress` reads besides its arguments, as named tensors (keys
        ``compress/...``): what a replay needs to start a round's compression exactly."""
        out: dict[str, torch.Tensor] = {
            "compress/rng": self._gen.get_state(),
            "compress/ease": torch.tensor([self._ease], dtype=torch.float64),
        }
        if self._prev_loss is not None:
            out["compress/prev_loss"] = torch.tensor([self._prev_loss], dtype=torch.float64)
        for n, st in self.state.items():
            out[f"compress/residual/{n}"] = st.residual
            out[f"compress/bits/{n}"] = torch.tensor([st.bits], dtype=torch.int32)
            if st.warm is not None:
                out[f"compress/warm/{n}"] = st.warm
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore `state_tensors()` output (other keys are ignored). ValueError if it does
        not fit this compressor's tensors."""
        try:
            self._gen.set_state(tensors["compress/rng"].clone())
            self._ease = float(tensors["compress/ease"].reshape(-1)[0])
            prev = tensors.get("compress/prev_loss")
            self._prev_loss = None if prev is None else float(prev.reshape(-1)[0])
            for n, st in self.state.items():
                residual = tensors[f"compress/residual/{n}"]
                if residual.shape != st.residual.shape or residual.dtype != torch.float32:
                    raise ValueError(f"compress/residual/{n} has shape {tuple(residual.shape)}, "
                                     f"want {tuple(st.residual.shape)} float32")
                st.residual = residual.clone()
                st.bits = int(tensors[f"compress/bits/{n}"].reshape(-1)[0])
                if st.bits not in (2, 4, 8):
                    raise ValueError(f"compress/bits/{n} is {st.bits}")
                warm = tensors.get(f"compress/warm/{n}")
                if warm is not None and (warm.dim() != 2 or warm.size(0) != _as_matrix_shape(st.shape)[1]):
                    raise ValueError(f"compress/warm/{n} has shape {tuple(warm.shape)}")
                st.warm = None if warm is None else warm.float().clone()
        except KeyError as exc:
            raise ValueError(f"compressor state: missing {exc.args[0]}") from None
        except RuntimeError as exc:  # a generator state of the wrong size or type
            raise ValueError(f"compressor state: {exc}") from None

    # -- the interface --------------------------------------------------------------------

    def compress(
        self,
        delta: dict[str, torch.Tensor],
        step: int,
        loss: float | None = None,
        budget_bytes: float | None = None,
    ) -> bytes:
        """Compress this round's pseudo-gradient (with error feedback); the bytes to send."""
        start = time.perf_counter()
        cfg = self.cfg
        if cfg.kind == "none":
            data = tensors_to_bytes({f"delta/{n}": delta[n].float() for n in self.names})
            self.last_stats = {"compress_s": time.perf_counter() - start, "rel_error": 0.0}
            self.total_s += self.last_stats["compress_s"]
            return data
        tau = self._energy_target(step, loss)
        plans = {}
        for n in self.names:
            st = self.state[n]
            M = delta[n].float() + st.residual if cfg.error_feedback else delta[n].float()
            plans[n] = self._plan(n, M.reshape(_as_matrix_shape(st.shape)), tau)
        payload: dict[str, torch.Tensor] = {}
        if budget_bytes is not None and cfg.kind == "adaptive" and self._fit_budget(plans, budget_bytes):
            payload[BUDGET_KEY] = torch.tensor([budget_bytes], dtype=torch.float64)
        sq_err = sq_norm = 0.0
        for n in self.names:
            st, plan = self.state[n], plans[n]
            M = plan["M"]
            if plan["codec"] == CODEC_LOWRANK:
                k = plan["rank"]
                enc = _encode(n, M, CODEC_LOWRANK, plan["bits"], (plan["P"][:, :k], plan["Q"][:, :k]))
            else:
                enc = _encode(n, M, CODEC_QUANT, plan["bits"])
            payload.update(enc)
            decoded = _decode_one(n, enc, st.shape).reshape(M.shape)
            err = M - decoded
            if cfg.error_feedback:
                st.residual = err.reshape(st.shape)
            e2, m2 = float(err.pow(2).sum()), float(M.pow(2).sum())
            sq_err += e2
            sq_norm += m2
            rel = math.sqrt(e2 / m2) if m2 > 0 else 0.0
            if cfg.kind == "adaptive" and plan["codec"] == CODEC_LOWRANK:
                # Step 4: quantisation that adds > 10% of ||M|| over the low-rank error
                # moves the tensor to 8 bits next step.
                st.bits = 8 if rel > plan["lowrank_error"] + 0.10 else 4
            rank = plan["rank"] if plan["codec"] == CODEC_LOWRANK else 0
            st.last = {"rank": rank, "bits": plan["bits"], "rel_error": rel}
        data = tensors_to_bytes(payload)
        ranks = [self.state[n].last["rank"] for n in self.names if self.state[n].last["rank"]]
        bits = [self.state[n].last["bits"] for n in self.names if len(self.state[n].shape) >= 2]
        self.last_stats = {
            "compress_s": time.perf_counter() - start,
            "rel_error": math.sqrt(sq_err / sq_norm) if sq_norm > 0 else 0.0,
            "rank_mean": sum(ranks) / len(ranks) if ranks else 0.0,
            "rank_max": float(max(ranks)) if ranks else 0.0,
            "bits_mean": sum(bits) / len(bits) if bits else 0.0,
            "energy_target": tau,
            "residual_norm": math.sqrt(sum(float(s.residual.pow(2).sum()) for s in self.state.values())),
        }
        self.total_s += self.last_stats["compress_s"]
        return data

    def per_tensor(self) -> dict[str, dict]:
        """Rank, bits and relative compression error of each tensor at the latest step."""
        return {n: dict(self.state[n].last) for n in self.names}

    # -- the rule ------------------------------------------------------------------------

    def _energy_target(self, step: int, loss: float | None) -> float:
        cfg = self.cfg
        if cfg.kind != "adaptive":
            return 1.0
        if loss is not None and self._prev_loss is not None:
            self._ease = self._ease + _EASE_STEP if loss >= self._prev_loss else 0.0
        if loss is not None:
            self._prev_loss = loss
        ramp = 1.0 if cfg.warmup_steps == 0 else min(1.0, step / cfg.warmup_steps)
        return min(1.0, cfg.energy * (0.5 + 0.5 * ramp) + self._ease)

    def _plan(self, name: str, M: torch.Tensor, tau: float) -> dict:
        cfg, st = self.cfg, self.state[name]
        m, n = M.shape
        if len(st.shape) < 2 or cfg.kind == "quantize":
            bits = ONE_D_BITS if (len(st.shape) < 2 and cfg.kind != "quantize") else cfg.bits
            return {"M": M, "codec": CODEC_QUANT, "bits": bits}
        r_cap = min(cfg.rank if cfg.kind == "lowrank" else cfg.max_rank, m, n)
        P, Q = self._power_iterate(st, M, r_cap)
        if cfg.kind == "lowrank":
            return {"M": M, "codec": CODEC_LOWRANK, "bits": cfg.bits, "P": P, "Q": Q, "rank": r_cap,
                    "lowrank_error": 0.0}
        # Adaptive, step 1: rotate to principal directions; energies s_j^2, descending.
        U, S, Vh = torch.linalg.svd(Q, full_matrices=False)  # Q (n, r) = U S Vh
        P, Q = P @ Vh.T, U * S  # (m, r), (n, r): M ~ P Q^T, component j has energy S_j^2
        total = float(M.pow(2).sum())
        captured = torch.cumsum(S.double().pow(2), 0) / max(total, 1e-30)  # (r,)
        k = int(torch.searchsorted(captured, torch.tensor([tau], dtype=captured.dtype)).item()) + 1
        k = max(1, min(k, r_cap))
        bits = st.bits
        lowrank_error = math.sqrt(max(0.0, 1.0 - float(captured[k - 1])))
        plan = {"M": M, "codec": CODEC_LOWRANK, "bits": bits, "P": P, "Q": Q, "rank": k,
                "captured": captured, "lowrank_error": lowrank_error}
        if _lowrank_bytes(m, n, k, bits) >= _quant_bytes(m, n, 4):  # step 3: not worth it
            plan.update(codec=CODEC_QUANT, bits=4, rank=r_cap)
        return plan

    def _power_iterate(self, st: _TensorState, M: torch.Tensor, r: int):
        m, n = M.shape
        if st.warm is None or st.warm.size(1) != r:
            st.warm = torch.randn(n, r, generator=self._gen)
        Q = st.warm
        for _ in range(self.cfg.power_iters):
            P = _orthonormalize(M @ Q)  # (m, r)
            Q = M.T @ P  # (n, r)
        st.warm = Q.clone()
        return P, Q

    def _fit_budget(self, plans: dict[str, dict], budget: float) -> bool:
        """Step 5: lower ranks, largest tensor first, until the payload fits `budget`.
        Returns whether the cap bit (the payload then records the budget)."""

        def size() -> int:
            total = 0
            for p in plans.values():
                m, c = p["M"].shape
                if p["codec"] == CODEC_LOWRANK:
                    total += _lowrank_bytes(m, c, p["rank"], p["bits"])
                else:
                    total += _quant_bytes(m, c, p["bits"])
            return total

        if size() <= budget:
            return False
        for p in plans.values():  # whole-quantised matrices go back to their factors
            if "P" in p and p["codec"] != CODEC_LOWRANK:
                p.update(codec=CODEC_LOWRANK, bits=4)
        while size() > budget:
            lowered = False
            for n in sorted(plans, key=lambda k: -plans[k]["M"].numel()):
                p = plans[n]
                if p["codec"] == CODEC_LOWRANK and p["rank"] > 1:
                    p["rank"] = max(1, p["rank"] // 2)
                    p["lowrank_error"] = math.sqrt(
                        max(0.0, 1.0 - float(p["captured"][p["rank"] - 1]))
                    )
                    lowered = True
                    if size() <= budget:
                        return True
            if not lowered:
                return True
        return True
