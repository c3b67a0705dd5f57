"""Pseudo-gradient compression with error feedback: one interface, five kinds.

A replica compresses its pseudo-gradient delta once per outer step. What it sends is a
safetensors blob (the `Contribution` it publishes); every replica, and later a verifier,
decodes the R blobs with `decode_contribution` and averages them in replica order, so the
aggregate is recomputable bit for bit from the published blocks.

Kinds (`[outer.compression] kind`):
- ``none``: float32, keys ``delta/<name>`` (the pre-compression layout, unchanged);
- ``quantize``: b-bit symmetric integers with one float32 scale per row. At 2 bits the
  values are -1, 0 and +1 (scale = max |row|, so most round to 0), and ``coding = "gaps"``
  lays them out as the runs of zeros between nonzero values (`gaps_encode`): the same
  values, decoded bit for bit alike, in 1.8x fewer bytes on this project's deltas (about
  1.1 bits a value; the fixed layout's 2 bits are the ceiling);
- ``lowrank``: PowerSGD-style (Vogels et al., 2019): a warm-started power iteration gives
  M ~ P Q^T with P orthonormal (m, r) and Q (n, r); both factors are stored transposed,
  (r, m) and (r, n), quantised to b bits with one scale per row (per rank component).
  1-D tensors are quantised only;
- ``sparse``: chunked top-k (SparseLoCo, Sarfi et al., 2025, arXiv 2508.15706: top-k
  sparsification of the error-feedback pseudo-gradient, values at 2 bits, chunked top-k
  so that indices are local and short). The tensor is flattened and split into chunks of
  C = min(`chunk`, numel) consecutive values (the last chunk may be short; it is padded
  with zeros, logically only); each chunk keeps its k = max(1, ceil(`density` * C)) values
  of largest magnitude, ties going to the lower index (a threshold on the k-th largest
  magnitude, then the tied values in index order: never `torch.topk`'s unspecified tie
  order), indices stored ascending within the chunk; the kept values are quantised to
  b = `bits` bits, symmetric round-to-nearest with one float32 scale per chunk, scale =
  max |kept| / (2**(b-1) - 1) (`quantize_rows` on the (chunks, k) matrix of kept values).
  Padding is only ever kept when k exceeds the last chunk's real length, and then
  carries the value 0. 1-D tensors (norms, biases) are quantised whole at 8 bits
  (``ONE_D_BITS``), as under ``adaptive``;
- ``adaptive``: low rank, sparse or whole quantisation, with rank, k and bits, picked per
  tensor each outer step (rule below).

Payload keys per tensor ``<name>`` (viewed as (m, n) by `as_matrix_shape`; N = m * n):
- every compressed kind: ``meta/<name>`` int32 [codec, bits, rank] (quantize: rank 0),
  or [codec, bits, k, C] for sparse; codecs: 1 quantised (``CODEC_QUANT``), 2 low rank
  (``CODEC_LOWRANK``), 3 sparse (``CODEC_SPARSE``), 4 2-bit gaps (``CODEC_GAPS``);
- quantised: ``q/<name>`` uint8 (m, ceil(n b / 8)), ``q_scale/<name>`` float32 (m,);
- gaps: ``q_scale/<name>`` only; the values of all gaps tensors, in name order, are the
  payload's one ``gaps/stream`` (``gaps/meta`` int64 [w, T, values]; `gaps_encode`);
- low rank: ``u/<name>`` uint8 (r, ceil(m b / 8)), ``u_scale/<name>`` float32 (r,),
  ``v/<name>`` uint8 (r, ceil(n b / 8)), ``v_scale/<name>`` float32 (r,);
- sparse, with G = ceil(N / C) chunks and w = max(1, ceil(log2 C)) index bits:
  ``sp/<name>`` uint8 (G, ceil(k b / 8)), the kept values of each chunk in index order,
  packed as `quantize_rows` packs a row; ``sp_scale/<name>`` float32 (G,);
  ``sp_idx/<name>`` uint8 (ceil(G k w / 8),), the G * k in-chunk indices, chunk by chunk,
  packed by `pack_bits` at w bits each (little-endian bit order: bit j of index i is bit
  i * w + j of the stream, and stream bit s is bit s % 8 of byte s // 8; the last byte is
  zero-padded). A sparse tensor's data is therefore G * ceil(k b / 8) + 4 G +
  ceil(G k w / 8) + 16 bytes (`sparse_payload_bytes`); the blob adds safetensors' 8-byte
  length and its JSON header (padded to a multiple of 8).
Decoding a sparse tensor starts from zeros and writes each dequantised value at its index
(indices strictly ascending within a chunk, so unique: no write order to depend on); an
index outside its chunk, a nonzero value in the padding, or a size that disagrees with
meta is a ValueError.

Error feedback (Seide et al., 2014; Karimireddy et al., 2019): with M = e + delta,
send C(M) and keep e <- M - D(C(M)), the exact decoded value, so nothing is lost for
good, only delayed. For ``sparse``, top-k alone is a contraction: each chunk keeps at
least the fraction k / C >= density of its energy, so ||M - topk(M)||^2 <= (1 - k / C)
||M||^2, and with q = sqrt(1 - k / C) the residual stays within q / (1 - q) < 2 C / k
times the largest ||delta||. Quantising the kept values adds at most scale / 2 per kept
value (at 2 bits only a chunk's largest value is exact in the worst case), so that bound
is not a theorem for the quantised codec; tests/test_compress_sparse.py measures the
residual under error feedback over 100 steps of unit-norm random deltas and holds it to
2 C / k (worst seen 1.41 C / k, ternary values at density 1; at most 0.29 C / k
otherwise) and to 2 sqrt(C / k) (worst seen 1.41 sqrt(C / k)), times max ||delta||.

The adaptive rule (ours; the DiLoCoX paper gives none). Per 2-D tensor, each outer step t:
1. Power-iterate M at r_cap = min(max_rank, m, n) from the warm start and rotate the
   factors to M's principal directions (a small SVD of Q), so component j carries
   energy s_j^2 and the relative low-rank error of rank k is sqrt(1 - sum_{j<k} s_j^2 /
   ||M||^2): the compression error, measured per tensor before anything is sent.
2. Energy target tau_t = energy * (0.5 + 0.5 * min(1, t / warmup_steps)): aggressive
   early, when pseudo-gradients are large and quickly corrected, eased later. If the
   replica's round loss did not improve on the previous round, tau eases by 0.05 more
   (kept until the loss improves again; the loss trend asks for fidelity).
3. Three candidates, each sized in bytes: (a) low rank at the smallest rank k capturing
   tau_t of ||M||^2 (at most r_cap), at the tensor's current bits; (b) sparse (chunk C =
   min(`chunk`, N)) at the smallest k per chunk whose kept values capture tau_t of
   ||M||^2, measured exactly (the squared values sorted within each chunk, cumulative
   sums per chunk, summed over chunks: the energy E(k) of every common k at once), at the
   tensor's current bits; (c) the whole tensor quantised at 4 bits. The cheaper of (a)
   and (b) is sent (low rank on a tie), unless (c) costs no more bytes than it: then the
   tensor is quantised whole (a pseudo-gradient that is neither low-rank nor sparse is
   not worth factorising or indexing).
4. Bits: 4 to start; a tensor whose measured error after quantisation exceeds its
   low-rank (or, when sent sparse, its top-k) error by more than 10% of ||M|| goes to 8
   bits the next step (and back to 4 when it no longer does).
5. Bandwidth cap: if the payload would exceed `budget_bytes` (the bytes the link moves
   within the overlap window, computed by the engine from the round's measured compute
   time and the configured bandwidth), whole-quantised matrices go back to the cheaper
   of their factors (at r_cap) and their sparse plan, at 4 bits, and ranks (and sparse k
   per chunk) are halved, largest tensor first, until it fits or every rank and k is 1.
   The budget is a wall-clock measurement nobody can re-derive, so a payload whose cap
   bit records it (``adaptive/budget``, float64, ignored by the decoder): a replay re-runs
   the rule with the recorded budget and gets the same decisions (`payload_budget`).
1-D tensors (norms, biases) are quantised whole at 8 bits.

Reconstruction is pure elementwise float32 arithmetic in a fixed order (no matmul), and
the sparse and gaps scatters write each position at most once, so decoding gives the same bits
whatever the thread count.

A compressor's whole state (residuals, warm starts, adaptive bits and loss trend, the
generator of first warm starts) round-trips through `state_tensors` / `load_state_tensors`,
so a replay can start a round's compression exactly where training did. The sparse kind
needs nothing beyond the residual.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.compress_bits import (
    BITS,
    GAPS_META,
    GAPS_STREAM,
    MAX_CHUNK,
    as_matrix_shape,
    chunk_rows,
    dequantize_rows,
    gaps_decode,
    gaps_encode,
    lowrank_bytes,
    lowrank_reconstruct,
    pack_bits,
    quant_bytes,
    quantize_rows,
    sparse_bytes,
    sparse_decode,
    sparse_encode,
    sparse_k,
    sparse_payload_bytes,
    unpack_bits,
)
from trainer.compress_bits import (
    _pack_bits_any as _pack_bits_any,
)
from trainer.compress_codecs import (
    CODEC_GAPS,
    CODEC_LOWRANK,
    CODEC_NONE,
    CODEC_QUANT,
    CODEC_SPARSE,
    CODECS,
    GAPS,
    QUANT,
    SPARSE,
    Plan,
    decode_one,
    encode,
)
from trainer.config import CompressionConfig

__all__ = [
    "BITS",
    "CODEC_GAPS",
    "CODEC_LOWRANK",
    "CODEC_NONE",
    "CODEC_QUANT",
    "CODEC_SPARSE",
    "GAPS_META",
    "GAPS_STREAM",
    "MAX_CHUNK",
    "STREAM_ELEMENTS",
    "Compressor",
    "ContributionReader",
    "decode_contribution",
    "dequantize_rows",
    "gaps_decode",
    "gaps_encode",
    "lowrank_reconstruct",
    "pack_bits",
    "payload_budget",
    "quantize_rows",
    "sparse_decode",
    "sparse_encode",
    "sparse_k",
    "sparse_payload_bytes",
    "stream_batches",
    "unpack_bits",
]

ONE_D_BITS = 8  # norms and biases: few values, quantised whole
_EASE_STEP = 0.05
BUDGET_KEY = "adaptive/budget"  # the byte budget that capped an adaptive payload
# the one-tensor and batched paths, by the names tests/test_compress_batch.py reads
_encode, _decode_one = encode, decode_one
_quant_batch, _sparse_batch, _dequant_batch = QUANT.encode_batch, SPARSE.encode_batch, QUANT.decode_batch


def payload_budget(data: bytes) -> float | None:
    """The byte budget an adaptive payload was capped to, or None when the cap did not bite."""
    t = bytes_to_tensors(data).get(BUDGET_KEY)
    return None if t is None else float(t.double().reshape(-1)[0])


def decode_contribution(data: bytes, shapes: dict[str, torch.Size], *, exact_keys: bool = False) -> dict[str, torch.Tensor]:
    """A published contribution (any kind) back to float32 pseudo-gradients by name.
    `exact_keys`: also refuse a payload holding a tensor `shapes` does not name (a
    fragment's contribution carries its fragment and nothing else)."""
    return ContributionReader(data, shapes, exact_keys=exact_keys).decode(sorted(shapes))


class ContributionReader:
    """A published contribution parsed once (one copy of its bytes) and decoded a few
    tensors at a time (`decode`), so that an outer step holds the float32 pseudo-gradients of
    a bounded batch of tensors rather than of the whole stage (`stream_batches`). What it
    decodes is `decode_contribution`'s, bit for bit: the decoding is elementwise, and the
    batching only groups tensors. Raises as `decode_contribution` does."""

    def __init__(self, data: bytes, shapes: Mapping[str, torch.Size], *, exact_keys: bool = False) -> None:
        payload = bytes_to_tensors(data)
        if exact_keys:
            stray = sorted({k.split("/", 1)[1] for k in payload if k not in (BUDGET_KEY, GAPS_STREAM, GAPS_META)}
                           - set(shapes))
            if stray:
                raise ValueError(f"contribution: holds {stray[0]}, which is not in the round's fragment")
        self.payload, self.shapes = payload, dict(shapes)
        self.gaps = GAPS.decode_all(payload, self.shapes)  # one stream for every gaps-coded tensor

    def decode(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The pseudo-gradients of `names` (sorted), by name."""
        mine = {n: self.shapes[n] for n in names}
        batched = _dequant_batch(self.payload, mine)
        batched.update({n: self.gaps.pop(n) for n in names if n in self.gaps})
        return {n: batched[n] if n in batched else decode_one(n, self.payload, mine[n]) for n in names}


STREAM_ELEMENTS = 1 << 18  # a batch of `stream_batches`: tensors of about this many values


def stream_batches(names: list[str], shapes: Mapping[str, torch.Size],
                   limit: int | None = None) -> list[list[str]]:
    """`names` cut, in order, into consecutive batches of at most `limit` values each
    (default `STREAM_ELEMENTS`; a larger tensor alone): what compression and the outer step
    process at once, so that their working memory stays a batch's rather than a stage's."""
    limit = STREAM_ELEMENTS if limit is None else limit
    out: list[list[str]] = []
    size = 0
    for n in names:
        numel = math.prod(shapes[n])
        if not out or size + numel > limit:
            out.append([])
            size = 0
        out[-1].append(n)
        size += numel
    return out


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
        self._names = self.names  # the tensors of the latest compress() (a fragment, or all)
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

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
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
                if st.bits not in BITS:
                    raise ValueError(f"compress/bits/{n} is {st.bits}")
                warm = tensors.get(f"compress/warm/{n}")
                if warm is not None and (warm.dim() != 2 or warm.size(0) != as_matrix_shape(st.shape)[1]):
                    raise ValueError(f"compress/warm/{n} has shape {tuple(warm.shape)}")
                st.warm = None if warm is None else warm.float().clone()
        except KeyError as exc:
            raise ValueError(f"compressor state: missing {exc.args[0]}") from None
        except RuntimeError as exc:  # a generator state of the wrong size or type
            raise ValueError(f"compressor state: {exc}") from None

    # -- the interface --------------------------------------------------------------------

    def compress(
        self,
        delta: Mapping[str, torch.Tensor],
        step: int,
        loss: float | None = None,
        budget_bytes: float | None = None,
    ) -> bytes:
        """Compress this round's pseudo-gradient (with error feedback); the bytes to send.
        `delta` may compute each tensor when asked for it (`trainer.diloco.contribution`):
        where the kind's tensors are coded independently (all but ``adaptive``, whose byte
        budget weighs them together, and the gaps layout, one stream for all), they are
        read, coded and fed back a batch at a time (`stream_batches`), so the working memory
        is a batch's; the bytes are the same either way."""
        start = time.perf_counter()
        cfg = self.cfg
        names = self._names = sorted(delta)  # a fragment, or every tensor
        if cfg.kind == "none":
            data = tensors_to_bytes({f"delta/{n}": delta[n].float() for n in names})
            self.last_stats = {"compress_s": time.perf_counter() - start, "rel_error": 0.0}
            self.total_s += self.last_stats["compress_s"]
            return data
        tau = self._energy_target(step, loss)
        whole = cfg.kind == "adaptive" or (cfg.kind == "quantize" and cfg.coding == "gaps")
        batches = [names] if whole else stream_batches(names, {n: self.state[n].shape for n in names})
        payload: dict[str, torch.Tensor] = {}
        norms: list[tuple[float, float]] = []  # (||err||^2, ||M||^2) by name
        for batch in batches:
            norms += self._compress_batch(batch, delta, tau, budget_bytes, payload)
        sq_err = sq_norm = 0.0
        for e2, m2 in norms:  # summed in name order, whatever the batches
            sq_err += e2
            sq_norm += m2
        data = tensors_to_bytes(payload)
        self.last_stats = self._summary(time.perf_counter() - start, sq_err, sq_norm, tau)
        self.total_s += self.last_stats["compress_s"]
        return data

    def _compress_batch(self, names: list[str], delta: Mapping[str, torch.Tensor], tau: float,
                        budget_bytes: float | None, payload: dict[str, torch.Tensor]) -> list[tuple[float, float]]:
        """Plan, code and feed back the tensors `names` (sorted) into `payload`; returns their
        (||err||^2, ||M||^2) in order."""
        cfg = self.cfg
        plans: dict[str, Plan] = {}
        for n in names:
            st = self.state[n]
            M = delta[n].float() + st.residual if cfg.error_feedback else delta[n].float()
            plans[n] = self._plan(n, M.reshape(as_matrix_shape(st.shape)), tau)
        if budget_bytes is not None and cfg.kind == "adaptive" and self._fit_budget(plans, budget_bytes):
            payload[BUDGET_KEY] = torch.tensor([budget_bytes], dtype=torch.float64)
        gaps_payload, gaps_err = GAPS.encode_all(plans)
        payload.update(gaps_payload)
        batched = {**SPARSE.encode_batch(plans), **QUANT.encode_batch(plans),
                   **{n: ({}, e) for n, e in gaps_err.items()}}
        plans_done = set(batched)
        out = []
        for n in names:
            st, plan = self.state[n], plans.pop(n)
            M = plan.M
            if n in batched:
                enc, err = batched.pop(n)
                payload.update(enc)
            else:
                enc = CODECS[plan.codec].encode(n, plan)
            if n not in plans_done:
                payload.update(enc)
                decoded = decode_one(n, enc, st.shape).reshape(M.shape)
                err = M - decoded
            out.append(self._record(st, plan, M, err))
        return out

    def _record(self, st: _TensorState, plan: Plan, M: torch.Tensor, err: torch.Tensor) -> tuple[float, float]:
        """After one tensor's encoding: its error feedback, the adaptive rule's bits for
        next step and its `last` stats; returns (||err||^2, ||M||^2)."""
        cfg = self.cfg
        if cfg.error_feedback:
            st.residual = err.reshape(st.shape)
        e2, m2 = float(err.pow(2).sum()), float(M.pow(2).sum())
        rel = math.sqrt(e2 / m2) if m2 > 0 else 0.0
        if cfg.kind == "adaptive" and plan.codec == CODEC_LOWRANK:
            # Step 4: quantisation that adds > 10% of ||M|| over the low-rank error
            # moves the tensor to 8 bits next step.
            st.bits = 8 if rel > plan.lowrank_error + 0.10 else 4
        elif cfg.kind == "adaptive" and plan.codec == CODEC_SPARSE:
            st.bits = 8 if rel > plan.sparse_error + 0.10 else 4  # step 4, top-k error
        rank = plan.rank if plan.codec == CODEC_LOWRANK else 0
        st.last = {"codec": CODECS[plan.codec].name, "rank": rank, "bits": plan.bits,
                   "rel_error": rel}
        if plan.codec == CODEC_SPARSE:
            st.last["density"] = plan.k / plan.chunk  # kept fraction of each chunk
        return e2, m2

    def _summary(self, seconds: float, sq_err: float, sq_norm: float, tau: float) -> dict[str, float]:
        """`last_stats` of a compression that took `seconds`."""
        names = self._names
        ranks = [self.state[n].last["rank"] for n in names if self.state[n].last["rank"]]
        bits = [self.state[n].last["bits"] for n in names if len(self.state[n].shape) >= 2]
        densities = [self.state[n].last["density"] for n in names if "density" in self.state[n].last]
        return {
            "compress_s": seconds,
            "rel_error": math.sqrt(sq_err / sq_norm) if sq_norm > 0 else 0.0,
            "rank_mean": sum(ranks) / len(ranks) if ranks else 0.0,
            "rank_max": float(max(ranks)) if ranks else 0.0,
            "bits_mean": sum(bits) / len(bits) if bits else 0.0,
            "density_mean": sum(densities) / len(densities) if densities else 0.0,
            "energy_target": tau,
            # with error feedback every residual is this step's error: its norm is sq_err's
            "residual_norm": math.sqrt(sq_err) if self.cfg.error_feedback else 0.0,
        }

    def per_tensor(self) -> dict[str, dict]:
        """Codec ("quantize", "lowrank" or "sparse"), rank (0 unless low rank), bits,
        relative compression error and, for sparse tensors, density (k / chunk) of each
        tensor at the latest step."""
        return {n: dict(self.state[n].last) for n in self._names}

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

    def _plan(self, name: str, M: torch.Tensor, tau: float) -> Plan:
        cfg, st = self.cfg, self.state[name]
        m, n = M.shape
        if len(st.shape) < 2 or cfg.kind == "quantize" or M.numel() == 0:
            bits = ONE_D_BITS if (len(st.shape) < 2 and cfg.kind != "quantize") else cfg.bits
            gaps = cfg.kind == "quantize" and cfg.coding == "gaps"
            return Plan(M=M, codec=CODEC_GAPS if gaps else CODEC_QUANT, bits=bits)
        if cfg.kind == "sparse":
            chunk = min(cfg.chunk, M.numel())
            return Plan(M=M, codec=CODEC_SPARSE, bits=cfg.bits, chunk=chunk,
                        k=sparse_k(cfg.density, chunk))
        r_cap = min(cfg.rank if cfg.kind == "lowrank" else cfg.max_rank, m, n)
        P, Q = self._power_iterate(st, M, r_cap)
        if cfg.kind == "lowrank":
            return Plan(M=M, codec=CODEC_LOWRANK, bits=cfg.bits, P=P, Q=Q, rank=r_cap)
        # Adaptive, step 1: rotate to principal directions; energies s_j^2, descending.
        U, S, Vh = torch.linalg.svd(Q, full_matrices=False)  # Q (n, r) = U S Vh
        P, Q = P @ Vh.T, U * S  # (m, r), (n, r): M ~ P Q^T, component j has energy S_j^2
        total = float(M.pow(2).sum())
        captured = torch.cumsum(S.double().pow(2), 0) / max(total, 1e-30)  # (r,)
        k = int(torch.searchsorted(captured, torch.tensor([tau], dtype=captured.dtype)).item()) + 1
        k = max(1, min(k, r_cap))
        bits = st.bits
        lowrank_error = math.sqrt(max(0.0, 1.0 - float(captured[k - 1])))
        # Step 3 (b): sparse at the smallest common k per chunk capturing tau.
        chunk = min(cfg.chunk, M.numel())
        sq = chunk_rows(M, chunk).double().pow(2).sort(dim=1, descending=True).values  # (G, chunk)
        energy = torch.cumsum(sq, dim=1).sum(dim=0)  # (chunk,): E(k) at index k - 1
        sp_captured = energy / max(float(energy[-1]), 1e-30)
        ks = int(torch.searchsorted(sp_captured, torch.tensor([tau], dtype=sp_captured.dtype)).item()) + 1
        ks = max(1, min(ks, chunk))
        plan = Plan(M=M, codec=CODEC_LOWRANK, bits=bits, P=P, Q=Q, rank=k,
                    captured=captured, lowrank_error=lowrank_error,
                    k=ks, chunk=chunk, sp_captured=sp_captured,
                    sparse_error=math.sqrt(max(0.0, 1.0 - float(sp_captured[ks - 1]))))
        lr_bytes, sp_bytes = lowrank_bytes(m, n, k, bits), sparse_bytes(m * n, chunk, ks, bits)
        if sp_bytes < lr_bytes:
            plan.codec = CODEC_SPARSE
        if min(lr_bytes, sp_bytes) >= quant_bytes(m, n, 4):  # step 3 (c): neither is worth it
            plan.codec, plan.bits, plan.rank = CODEC_QUANT, 4, r_cap
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

    def _fit_budget(self, plans: dict[str, Plan], budget: float) -> bool:
        """Step 5: lower ranks, largest tensor first, until the payload fits `budget`.
        Returns whether the cap bit (the payload then records the budget)."""

        def size() -> int:
            return sum(p.nbytes() for p in plans.values())

        if size() <= budget:
            return False
        for p in plans.values():  # whole-quantised matrices go back to factors or sparse
            if p.P is not None and p.codec == CODEC_QUANT:
                m, c = p.M.shape
                sparse = sparse_bytes(m * c, p.chunk, p.k, 4) < lowrank_bytes(m, c, p.rank, 4)
                p.codec, p.bits = (CODEC_SPARSE if sparse else CODEC_LOWRANK), 4
        while size() > budget:
            lowered = False
            for n in sorted(plans, key=lambda k: -plans[k].M.numel()):
                p = plans[n]
                if p.codec == CODEC_LOWRANK and p.rank > 1 and p.captured is not None:
                    p.rank = max(1, p.rank // 2)
                    p.lowrank_error = math.sqrt(max(0.0, 1.0 - float(p.captured[p.rank - 1])))
                elif p.codec == CODEC_SPARSE and p.sp_captured is not None and p.k > 1:
                    p.k = max(1, p.k // 2)
                    p.sparse_error = math.sqrt(max(0.0, 1.0 - float(p.sp_captured[p.k - 1])))
                else:
                    continue
                lowered = True
                if size() <= budget:
                    return True
            if not lowered:
                return True
        return True
