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

Payload keys per tensor ``<name>`` (viewed as (m, n) by `_as_matrix_shape`; N = m * n):
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

import numpy as np
import torch

from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.config import CHUNK_MAX, CompressionConfig

__all__ = [
    "CODEC_GAPS",
    "CODEC_LOWRANK",
    "CODEC_NONE",
    "CODEC_QUANT",
    "CODEC_SPARSE",
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

CODEC_NONE, CODEC_QUANT, CODEC_LOWRANK, CODEC_SPARSE, CODEC_GAPS = 0, 1, 2, 3, 4
_CODEC_NAMES = {CODEC_QUANT: "quantize", CODEC_LOWRANK: "lowrank", CODEC_SPARSE: "sparse",
                CODEC_GAPS: "quantize"}
MAX_CHUNK = CHUNK_MAX  # the largest sparse chunk (65536): 16-bit indices
ONE_D_BITS = 8  # norms and biases: few values, quantised whole
_EASE_STEP = 0.05
BUDGET_KEY = "adaptive/budget"  # the byte budget that capped an adaptive payload


BITS = (1, 2, 4, 8)


def _levels(bits: int) -> int:
    """Largest magnitude of a symmetric b-bit integer: 127, 7 or 1 (1 bit: the sign)."""
    assert bits in BITS, f"bits ({bits}) must be 1, 2, 4 or 8"
    return max(1, 2 ** (bits - 1) - 1)


def _pack(u: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols) uint8 values < 2**bits -> (rows, ceil(cols * bits / 8)) uint8."""
    if bits == 8:
        return u.contiguous()
    per = 8 // bits
    rows, cols = u.shape
    pad = (-cols) % per
    if pad:
        u = torch.cat([u, torch.zeros(rows, pad, dtype=torch.uint8)], dim=1)
    u = u.reshape(rows, -1, per)  # (rows, nbytes, per)
    out = u[:, :, 0].clone()
    for j in range(1, per):  # disjoint bit fields: OR is the sum of the shifted values
        out |= u[:, :, j] << (j * bits)
    return out  # (rows, nbytes)


def _unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    wide = packed if packed.dtype == torch.uint8 else packed.to(torch.int32)
    shifts = torch.arange(per, dtype=wide.dtype) * bits  # (per,)
    u = (wide[:, :, None] >> shifts) & (2**bits - 1)  # (rows, nbytes, per)
    return u.reshape(packed.size(0), -1)[:, :cols].to(torch.uint8)


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float -> (packed uint8, float32 scale per row).

    Symmetric round-to-nearest: |x - dequantize(quantize(x))| <= scale / 2 per element,
    with scale = max|row| / (2**(bits-1) - 1). One bit is the sign (Seide et al. 2014's
    1-bit quantisation): x -> +scale if x >= 0 else -scale, scale = mean |row|, the
    L1-optimal magnitude; error feedback carries the rest.
    """
    x = x.float()
    if bits == 1:
        scale = x.abs().mean(dim=1)  # (rows,)
        return _pack((x >= 0).to(torch.uint8), 1), scale
    q, scale = _round_rows(x, bits)
    u = (q + _levels(bits)).to(torch.uint8)
    return _pack(u, bits), scale


def _round_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float32, bits >= 2 -> (q: float32 integers in [-levels, levels], scale
    per row): the rounding `quantize_rows` packs, and the gaps layout codes at 2 bits."""
    levels = _levels(bits)
    scale = x.abs().amax(dim=1) / levels  # (rows,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(x / safe[:, None]).clamp_(-levels, levels), scale  # (rows, cols)


GAPS_MAX_WIDTH = 16  # the widest token the gaps layout tries (pack_bits' limit)
GAPS_STREAM, GAPS_META = "gaps/stream", "gaps/meta"  # a payload's one gaps stream


def gaps_encode(q: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Values in {-1, 0, +1} (any shape, read flat) -> (uint8 stream, w, T): the gaps layout.

    Nonzero j at flat index p_j follows g_j = p_j - p_{j-1} - 1 zeros (p_{-1} = -1). With
    E = 2**w - 1, g_j is floor(g_j / E) tokens E ("E zeros, no value") then the token
    g_j mod E ("that many zeros, then a value"); zeros after the last value are implied. The
    stream is the T tokens by `pack_bits` at w bits, then one bit per nonzero (1: +1, 0: -1)
    by `pack_bits` at 1 bit, each zero-padded to whole bytes. w (1 to 16) is the one with
    the fewest bytes, the smallest on a tie; never more than 2 bits per value (w = 1 codes
    a zero as 1 bit, a value as 2)."""
    flat = q.reshape(-1)
    # ascending; numpy's nonzero of a mask is several times faster than torch's on the CPU
    pos = torch.from_numpy(np.flatnonzero((flat != 0).numpy()))
    n = pos.numel()
    gaps = torch.diff(pos, prepend=torch.tensor([-1], dtype=pos.dtype)) - 1
    # Past the longest gap's bit length a wider token only costs more: the widths tried stop
    # there. Tokens are counted from the histogram of gap lengths when it is short (the
    # usual case), else from the gaps themselves (a long run of zeros: no huge histogram).
    longest = int(gaps.max()) if n else 0
    top = min(GAPS_MAX_WIDTH, longest.bit_length() + 1)
    if longest < 4 * n + 1024:
        counts = torch.bincount(gaps)  # (longest + 1,): how many gaps of each length
        lengths = torch.arange(counts.numel())

        def escapes(E: int) -> int:
            return int((counts * (lengths // E)).sum())
    else:
        def escapes(E: int) -> int:
            return int((gaps // E).sum())
    tokens_at = {w: n + escapes((1 << w) - 1) for w in range(1, top + 1)}
    w = min(tokens_at, key=lambda v: (math.ceil(tokens_at[v] * v / 8), v))  # fewest bytes, then smallest w
    T = tokens_at[w]
    E = (1 << w) - 1
    tokens = torch.full((T,), E, dtype=torch.int32)
    tokens[torch.cumsum(gaps // E + 1, 0) - 1] = (gaps % E).to(torch.int32)
    signs = (flat[pos] > 0).to(torch.int32)
    return torch.cat([pack_bits(tokens, w), pack_bits(signs, 1)]), w, T


def gaps_decode(stream: torch.Tensor, w: int, T: int, numel: int) -> torch.Tensor:
    """Inverse of `gaps_encode`: float32 (numel,) of -1, 0 and +1. ValueError unless the
    stream is exactly T tokens of w bits and one sign bit per value, padding bits zero, the
    last token a value (as the encoder writes it) and every value inside `numel`."""
    if not 1 <= w <= GAPS_MAX_WIDTH or T < 0:
        raise ValueError(f"token width {w} or count {T} out of range")
    if stream.dtype != torch.uint8 or stream.dim() != 1:
        raise ValueError(f"stream is {stream.dtype} {tuple(stream.shape)}, want uint8 1-D")
    nt = math.ceil(T * w / 8)
    if stream.numel() < nt:
        raise ValueError(f"stream has {stream.numel()} bytes, fewer than {T} tokens of {w} bits")
    E = (1 << w) - 1
    tokens = unpack_bits(stream[:nt], w, T)
    value = tokens != E
    n = int(value.sum())
    if stream.numel() != nt + math.ceil(n / 8):
        raise ValueError(f"stream has {stream.numel()} bytes, want {nt + math.ceil(n / 8)} "
                         f"for {T} tokens and {n} signs")
    if T and not bool(value[-1]):
        raise ValueError("the last token skips zeros without a value")
    for used, last in ((T * w % 8, nt - 1), (n % 8, stream.numel() - 1)):
        if used and int(stream[last]) >> used:
            raise ValueError("nonzero padding bits")
    pos = (torch.cumsum(torch.where(value, tokens + 1, E), 0) - 1)[value]
    if n and int(pos[-1]) >= numel:
        raise ValueError(f"a value at index {int(pos[-1])} of {numel}")
    out = torch.zeros(numel)
    out[pos] = unpack_bits(stream[nt:], 1, n).float() * 2 - 1
    return out


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    levels = _levels(bits)
    u = _unpack(packed, bits, cols).float()  # (rows, cols)
    if bits == 1:
        return (u * 2 - 1) * scale[:, None]
    return (u - levels) * scale[:, None]


def lowrank_reconstruct(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_k outer(u[k], v[k]) for u (r, m), v (r, n), in order k = 0..r-1: (m, n).

    Elementwise only, so the bits do not depend on BLAS or the thread count.
    """
    out = torch.zeros(u.size(1), v.size(1))
    for k in range(u.size(0)):
        out.add_(u[k][:, None] * v[k][None, :])
    return out


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Integers in [0, 2**width), any shape (read flat), -> uint8 (ceil(count * width / 8),).

    Little-endian bit order: bit j of value i is bit i * width + j of the stream, stream
    bit s is bit s % 8 of byte s // 8, and the last byte's unused high bits are zero.
    `width` is 1 to 16.
    """
    if not 1 <= width <= 16:
        raise ValueError(f"pack_bits: width {width} is not 1 to 16")
    v = values.reshape(-1).to(torch.int32)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << width):
        raise ValueError(f"pack_bits: values outside [0, 2**{width})")
    if 8 % width == 0 and v.numel():  # whole values per byte: the row packer's bytes, no bit matrix
        return _pack(v.to(torch.uint8).view(1, -1), width).reshape(-1)
    if width < 8 and v.numel():  # 8 values fill `width` whole bytes: one int64 per 8 values
        groups = torch.cat([v, v.new_zeros((-v.numel()) % 8)]).view(-1, 8).to(torch.int64)
        word = (groups << (torch.arange(8) * width)).sum(dim=1)  # (G,): bits 0 .. 8 * width - 1
        out = (word[:, None] >> (torch.arange(width) * 8)) & 0xFF  # (G, width) bytes
        return out.to(torch.uint8).reshape(-1)[: math.ceil(v.numel() * width / 8)]
    return _pack_bits_any(v, width)


def _pack_bits_any(v: torch.Tensor, width: int) -> torch.Tensor:
    """`pack_bits` of int32 values (count,) at any width, one bit at a time."""
    bits = ((v[:, None] >> torch.arange(width, dtype=torch.int32)) & 1).to(torch.uint8).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, torch.zeros(pad, dtype=torch.uint8)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.int32)
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `count` values, int64 (count,). ValueError unless
    `packed` is a 1-D uint8 of exactly ceil(count * width / 8) bytes."""
    if not 1 <= width <= 16:
        raise ValueError(f"unpack_bits: width {width} is not 1 to 16")
    want = math.ceil(count * width / 8)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != want:
        raise ValueError(f"unpack_bits: want {want} uint8 bytes for {count} values of {width} bits, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    if 8 % width == 0 and count:
        return _unpack(packed.view(1, -1), width, count).reshape(-1).to(torch.int64)
    if width < 8 and count:  # the inverse of pack_bits' int64 words
        data = torch.cat([packed, packed.new_zeros((-packed.numel()) % width)]).view(-1, width).to(torch.int64)
        word = (data << (torch.arange(width) * 8)).sum(dim=1)  # (G,)
        return ((word[:, None] >> (torch.arange(8) * width)) & ((1 << width) - 1)).reshape(-1)[:count]
    bits = (packed.to(torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32)) & 1  # (bytes, 8)
    bits = bits.reshape(-1)[: count * width].view(count, width)
    return (bits << torch.arange(width, dtype=torch.int32)).sum(dim=1, dtype=torch.int64)


def _index_bits(chunk: int) -> int:
    """Bits per in-chunk index: ceil(log2(chunk)), at least 1."""
    return max(1, (chunk - 1).bit_length())


def sparse_k(density: float, chunk: int) -> int:
    """Values kept per chunk: max(1, ceil(density * chunk)) (a product within 1e-9 of an
    integer counts as that integer, so 0.1 * 640 keeps 64, not 65), at most `chunk`."""
    return min(chunk, max(1, math.ceil(density * chunk - 1e-9)))


def sparse_payload_bytes(numel: int, chunk: int, k: int, bits: int) -> int:
    """Data bytes of one sparse tensor: values, scales, indices and its meta (16 bytes)."""
    return _sparse_bytes(numel, chunk, k, bits) + 16


def _sparse_bytes(numel: int, chunk: int, k: int, bits: int) -> int:
    groups = math.ceil(numel / chunk)
    return groups * math.ceil(k * bits / 8) + 4 * groups + math.ceil(groups * k * _index_bits(chunk) / 8)


def _chunks(M: torch.Tensor, chunk: int) -> torch.Tensor:
    """M flattened, zero-padded to whole chunks: (groups, chunk) float32."""
    flat = M.reshape(-1).float()
    pad = (-flat.numel()) % chunk
    if pad:
        flat = torch.cat([flat, torch.zeros(pad)])
    return flat.view(-1, chunk)


def _topk_sorted(X: torch.Tensor, k: int) -> torch.Tensor:
    """(groups, chunk) -> (groups, k) int64: per row the k largest |x|, ties to the lower
    index, ascending. The k-th largest magnitude t is a value (whatever order topk finds it
    in); all |x| > t are kept, then the |x| == t in index order until k."""
    a = X.abs().nan_to_num_(nan=math.inf, posinf=math.inf)  # NaN: kept like inf
    top = a.topk(k, dim=1, sorted=False)
    t = top.values.amin(dim=1, keepdim=True)  # (groups, 1)
    at_least = (a >= t).sum(dim=1)
    if bool((at_least == k).all()):  # no row has a tie it must break: topk's set is the set
        return top.indices.sort(dim=1).values
    above = a > t
    tied = a == t
    need = k - above.sum(dim=1, keepdim=True)  # >= 1
    keep = above | (tied & (torch.cumsum(tied, dim=1) <= need))
    return keep.nonzero()[:, 1].view(X.size(0), k)  # row-major: ascending per row


def sparse_encode(M: torch.Tensor, chunk: int, k: int, bits: int):
    """M (any shape, read flat) -> (packed values (G, ceil(k b / 8)), scales (G,), packed
    indices (ceil(G k w / 8),)); see the module docstring."""
    X = _chunks(M, chunk)
    idx = _topk_sorted(X, k)  # (G, k)
    values, scale = quantize_rows(X.gather(1, idx), bits)
    return values, scale, pack_bits(idx, _index_bits(chunk))


def sparse_decode(values: torch.Tensor, scale: torch.Tensor, packed_idx: torch.Tensor, bits: int,
                  k: int, chunk: int, numel: int) -> torch.Tensor:
    """Inverse of `sparse_encode` (up to quantisation): float32 (numel,). ValueError on a
    payload that does not fit (sizes, indices out of their chunk or not ascending, values
    in the padding)."""
    if not 1 <= chunk <= MAX_CHUNK or not 1 <= k <= chunk:
        raise ValueError(f"k {k} and chunk {chunk} must satisfy 1 <= k <= chunk <= {MAX_CHUNK}")
    groups = math.ceil(numel / chunk)
    per = math.ceil(k * bits / 8)
    if values.dtype != torch.uint8 or tuple(values.shape) != (groups, per):
        raise ValueError(f"values are {values.dtype} {tuple(values.shape)}, want uint8 {(groups, per)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (groups,):
        raise ValueError(f"scales are {scale.dtype} {tuple(scale.shape)}, want float32 {(groups,)}")
    idx = unpack_bits(packed_idx, _index_bits(chunk), groups * k).view(groups, k)
    if int(idx.max()) >= chunk:
        raise ValueError(f"index {int(idx.max())} out of range for chunk {chunk}")
    if k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
        raise ValueError("indices not strictly ascending within a chunk")
    out = torch.zeros(groups, chunk)
    out.scatter_(1, idx, dequantize_rows(values, scale, bits, k))
    flat = out.view(-1)
    if bool(flat[numel:].ne(0).any()):
        raise ValueError(f"index out of range: a nonzero value past the tensor's {numel} values")
    return flat[:numel]


def _row_slices(counts: list[int]) -> list[slice]:
    """The consecutive row ranges of tensors stacked with these row counts."""
    out, row = [], 0
    for n in counts:
        out.append(slice(row, row + n))
        row += n
    return out


def _sparse_batch(plans: dict[str, dict]) -> dict[str, tuple[dict, torch.Tensor]]:
    """Encode the sparse plans that share (chunk, k, bits) in one pass each (one top-k and
    one quantisation over their stacked chunks): name -> (payload tensors, M - decoded).
    Row-wise operations only, so the bytes and the residual are those of `_encode` and
    `_decode_one` one tensor at a time (tested); it only saves the per-tensor overhead."""
    groups: dict[tuple[int, int, int], list[str]] = {}
    for n in sorted(plans):
        p = plans[n]
        if p["codec"] == CODEC_SPARSE:
            groups.setdefault((p["chunk"], p["k"], p["bits"]), []).append(n)
    out: dict[str, tuple[dict, torch.Tensor]] = {}
    for (chunk, k, bits), names in groups.items():
        if len(names) < 2:
            continue
        blocks = [_chunks(plans[n]["M"], chunk) for n in names]
        X = torch.cat(blocks)  # (G, chunk)
        idx = _topk_sorted(X, k)  # (G, k)
        kept = X.gather(1, idx)
        q, scale = quantize_rows(kept, bits)
        err = X.scatter(1, idx, kept - dequantize_rows(q, scale, bits, k))
        width = _index_bits(chunk)
        for n, rows in zip(names, _row_slices([b.size(0) for b in blocks]), strict=True):
            M = plans[n]["M"]
            enc = {f"meta/{n}": torch.tensor([CODEC_SPARSE, bits, k, chunk], dtype=torch.int32),
                   f"sp/{n}": q[rows], f"sp_scale/{n}": scale[rows],
                   f"sp_idx/{n}": pack_bits(idx[rows], width)}
            out[n] = (enc, err[rows].reshape(-1)[: M.numel()].reshape(M.shape))
    return out


def _quant_batch(plans: dict[str, dict]) -> dict[str, tuple[dict, torch.Tensor]]:
    """Encode the whole-quantised plans that share (bits, columns) in one pass each (one
    quantisation over their stacked rows): name -> (payload tensors, M - decoded). Row-wise
    operations only, so the bytes and the residual are those of `_encode` and `_decode_one`
    one tensor at a time (tested); it only saves the per-tensor overhead."""
    groups: dict[tuple[int, int], list[str]] = {}
    for n in sorted(plans):
        p = plans[n]
        if p["codec"] == CODEC_QUANT:
            groups.setdefault((p["bits"], p["M"].size(1)), []).append(n)
    out: dict[str, tuple[dict, torch.Tensor]] = {}
    for (bits, cols), names in groups.items():
        if len(names) < 2:
            continue
        X = torch.cat([plans[n]["M"].float() for n in names])  # (rows, cols)
        q, scale = quantize_rows(X, bits)
        err = X - dequantize_rows(q, scale, bits, cols)
        for n, rows in zip(names, _row_slices([plans[n]["M"].size(0) for n in names]), strict=True):
            enc = {f"meta/{n}": torch.tensor([CODEC_QUANT, bits, 0], dtype=torch.int32),
                   f"q/{n}": q[rows], f"q_scale/{n}": scale[rows]}
            out[n] = (enc, err[rows])
    return out


def _gaps_batch(plans: dict[str, dict]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Encode every gaps plan: (payload tensors, name -> M - decoded). The values of all of
    them, in name order, flattened and concatenated, are one `gaps_encode` stream
    (``gaps/stream``, with ``gaps/meta`` int64 [w, T, values]); each tensor has its
    ``meta/<name>`` [CODEC_GAPS, 2, 0] and its ``q_scale/<name>``. The rounding is batched
    over tensors of equal columns (row-wise, so the values are those of one tensor alone)."""
    names = sorted(n for n, p in plans.items() if p["codec"] == CODEC_GAPS)
    if not names:
        return {}, {}
    by_cols: dict[int, list[str]] = {}
    for n in names:
        by_cols.setdefault(plans[n]["M"].size(1), []).append(n)
    q_of, payload, errs = {}, {}, {}
    for group in by_cols.values():
        X = torch.cat([plans[n]["M"].float() for n in group])  # (rows, cols)
        q, scale = _round_rows(X, 2)
        err = X - q * scale[:, None]
        for n, rows in zip(group, _row_slices([plans[n]["M"].size(0) for n in group]), strict=True):
            q_of[n], errs[n] = q[rows], err[rows]
            payload[f"meta/{n}"] = torch.tensor([CODEC_GAPS, 2, 0], dtype=torch.int32)
            payload[f"q_scale/{n}"] = scale[rows]
    values = torch.cat([q_of[n].reshape(-1) for n in names])
    stream, w, T = gaps_encode(values)
    payload[GAPS_STREAM] = stream
    payload[GAPS_META] = torch.tensor([w, T, values.numel()], dtype=torch.int64)
    return payload, errs


def _gaps_decode_all(payload: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The gaps-coded tensors of `payload` (meta codec 4), decoded from its one stream."""
    names = [n for n in sorted(shapes) if f"delta/{n}" not in payload and f"meta/{n}" in payload
             and _read_meta(n, payload)[0] == CODEC_GAPS]
    if not names and GAPS_STREAM not in payload and GAPS_META not in payload:
        return {}
    meta = payload.get(GAPS_META)
    if GAPS_STREAM not in payload or meta is None or meta.dtype != torch.int64 or tuple(meta.shape) != (3,):
        raise ValueError(f"contribution: gaps-coded tensors need {GAPS_STREAM} and {GAPS_META} int64 (3,)")
    w, T, count = (int(v) for v in meta.tolist())
    dims = [_as_matrix_shape(shapes[n]) for n in names]
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


def _dequant_batch(payload: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Decode the whole-quantised tensors of `payload` whose tensors are well formed, those
    sharing (bits, columns) in one pass each (elementwise, so the values are those of
    `_decode_one`, tested); anything else is left to `_decode_one` and its errors."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name in sorted(shapes):
        meta, q, scale = (payload.get(f"{k}/{name}") for k in ("meta", "q", "q_scale"))
        if meta is None or q is None or scale is None or f"delta/{name}" in payload:
            continue
        if meta.dtype != torch.int32 or tuple(meta.shape) != (3,):
            continue
        codec, bits, _ = (int(v) for v in meta.tolist())
        rows, cols = _as_matrix_shape(shapes[name])
        if codec != CODEC_QUANT or bits not in BITS or q.dtype != torch.uint8 or scale.dtype != torch.float32:
            continue
        if tuple(q.shape) != (rows, math.ceil(cols * bits / 8)) or tuple(scale.shape) != (rows,):
            continue
        groups.setdefault((bits, cols), []).append(name)
    out: dict[str, torch.Tensor] = {}
    for (bits, cols), names in groups.items():
        if len(names) < 2:
            continue
        M = dequantize_rows(torch.cat([payload[f"q/{n}"] for n in names]),
                            torch.cat([payload[f"q_scale/{n}"] for n in names]), bits, cols)
        for name, part in zip(names, _row_slices([payload[f"q/{n}"].size(0) for n in names]), strict=True):
            out[name] = M[part].reshape(shapes[name])
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


def _encode(name: str, M: torch.Tensor, codec: int, bits: int, factors=None, sparse=None) -> dict:
    """Payload tensors for one tensor viewed as (m, n); `factors` = (P (m, r), Q (n, r)),
    `sparse` = (k, chunk)."""
    out = {f"meta/{name}": torch.tensor([codec, bits, 0], dtype=torch.int32)}
    if codec == CODEC_QUANT:
        out[f"q/{name}"], out[f"q_scale/{name}"] = quantize_rows(M, bits)
    elif codec == CODEC_SPARSE:
        k, chunk = sparse
        out[f"meta/{name}"] = torch.tensor([codec, bits, k, chunk], dtype=torch.int32)
        out[f"sp/{name}"], out[f"sp_scale/{name}"], out[f"sp_idx/{name}"] = sparse_encode(M, chunk, k, bits)
    else:
        P, Q = factors
        out[f"meta/{name}"][2] = P.size(1)
        out[f"u/{name}"], out[f"u_scale/{name}"] = quantize_rows(P.T, bits)  # (r, m)
        out[f"v/{name}"], out[f"v_scale/{name}"] = quantize_rows(Q.T, bits)  # (r, n)
    return out


def _read_meta(name: str, payload: dict[str, torch.Tensor]) -> list[int]:
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


def _decode_one(name: str, payload: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    if f"delta/{name}" in payload:
        t = payload[f"delta/{name}"]
        if t.shape != shape:
            raise ValueError(f"contribution: delta/{name} has shape {tuple(t.shape)}, want {tuple(shape)}")
        return t.float()
    values = _read_meta(name, payload)
    codec, bits, rank = values[:3]
    m, n = _as_matrix_shape(shape)
    try:
        if codec == CODEC_SPARSE:
            try:
                M = sparse_decode(payload[f"sp/{name}"], payload[f"sp_scale/{name}"],
                                  payload[f"sp_idx/{name}"], bits, rank, values[3], m * n).view(m, n)
            except ValueError as exc:
                raise ValueError(f"contribution: sparse {name}: {exc}") from None
        elif codec == CODEC_QUANT:
            M = dequantize_rows(payload[f"q/{name}"], payload[f"q_scale/{name}"], bits, n)
        elif codec == CODEC_GAPS:
            raise ValueError(f"contribution: {name} is gaps-coded: decode the whole payload")
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
        self.gaps = _gaps_decode_all(payload, self.shapes)  # one stream for every gaps-coded tensor

    def decode(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The pseudo-gradients of `names` (sorted), by name."""
        mine = {n: self.shapes[n] for n in names}
        batched = _dequant_batch(self.payload, mine)
        batched.update({n: self.gaps.pop(n) for n in names if n in self.gaps})
        return {n: batched[n] if n in batched else _decode_one(n, self.payload, mine[n]) for n in names}


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
        plans = {}
        for n in names:
            st = self.state[n]
            M = delta[n].float() + st.residual if cfg.error_feedback else delta[n].float()
            plans[n] = self._plan(n, M.reshape(_as_matrix_shape(st.shape)), tau)
        if budget_bytes is not None and cfg.kind == "adaptive" and self._fit_budget(plans, budget_bytes):
            payload[BUDGET_KEY] = torch.tensor([budget_bytes], dtype=torch.float64)
        gaps_payload, gaps_err = _gaps_batch(plans)
        payload.update(gaps_payload)
        batched = {**_sparse_batch(plans), **_quant_batch(plans),
                   **{n: ({}, e) for n, e in gaps_err.items()}}
        plans_done = set(batched)
        out = []
        for n in names:
            st, plan = self.state[n], plans.pop(n)
            M = plan["M"]
            if n in batched:
                enc, err = batched.pop(n)
                payload.update(enc)
            elif plan["codec"] == CODEC_LOWRANK:
                k = plan["rank"]
                enc = _encode(n, M, CODEC_LOWRANK, plan["bits"], (plan["P"][:, :k], plan["Q"][:, :k]))
            elif plan["codec"] == CODEC_SPARSE:
                enc = _encode(n, M, CODEC_SPARSE, plan["bits"], sparse=(plan["k"], plan["chunk"]))
            else:
                enc = _encode(n, M, CODEC_QUANT, plan["bits"])
            if n not in plans_done:
                payload.update(enc)
                decoded = _decode_one(n, enc, st.shape).reshape(M.shape)
                err = M - decoded
            out.append(self._record(st, plan, M, err))
        return out

    def _record(self, st: _TensorState, plan: dict, M: torch.Tensor, err: torch.Tensor) -> tuple[float, float]:
        """After one tensor's encoding: its error feedback, the adaptive rule's bits for
        next step and its `last` stats; returns (||err||^2, ||M||^2)."""
        cfg = self.cfg
        if cfg.error_feedback:
            st.residual = err.reshape(st.shape)
        e2, m2 = float(err.pow(2).sum()), float(M.pow(2).sum())
        rel = math.sqrt(e2 / m2) if m2 > 0 else 0.0
        if cfg.kind == "adaptive" and plan["codec"] == CODEC_LOWRANK:
            # Step 4: quantisation that adds > 10% of ||M|| over the low-rank error
            # moves the tensor to 8 bits next step.
            st.bits = 8 if rel > plan["lowrank_error"] + 0.10 else 4
        elif cfg.kind == "adaptive" and plan["codec"] == CODEC_SPARSE:
            st.bits = 8 if rel > plan["sparse_error"] + 0.10 else 4  # step 4, top-k error
        rank = plan["rank"] if plan["codec"] == CODEC_LOWRANK else 0
        st.last = {"codec": _CODEC_NAMES[plan["codec"]], "rank": rank, "bits": plan["bits"],
                   "rel_error": rel}
        if plan["codec"] == CODEC_SPARSE:
            st.last["density"] = plan["k"] / plan["chunk"]  # kept fraction of each chunk
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

    def _plan(self, name: str, M: torch.Tensor, tau: float) -> dict:
        cfg, st = self.cfg, self.state[name]
        m, n = M.shape
        if len(st.shape) < 2 or cfg.kind == "quantize" or M.numel() == 0:
            bits = ONE_D_BITS if (len(st.shape) < 2 and cfg.kind != "quantize") else cfg.bits
            gaps = cfg.kind == "quantize" and cfg.coding == "gaps"
            return {"M": M, "codec": CODEC_GAPS if gaps else CODEC_QUANT, "bits": bits}
        if cfg.kind == "sparse":
            chunk = min(cfg.chunk, M.numel())
            return {"M": M, "codec": CODEC_SPARSE, "bits": cfg.bits, "chunk": chunk,
                    "k": sparse_k(cfg.density, chunk)}
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
        # Step 3 (b): sparse at the smallest common k per chunk capturing tau.
        chunk = min(cfg.chunk, M.numel())
        sq = _chunks(M, chunk).double().pow(2).sort(dim=1, descending=True).values  # (G, chunk)
        energy = torch.cumsum(sq, dim=1).sum(dim=0)  # (chunk,): E(k) at index k - 1
        sp_captured = energy / max(float(energy[-1]), 1e-30)
        ks = int(torch.searchsorted(sp_captured, torch.tensor([tau], dtype=sp_captured.dtype)).item()) + 1
        ks = max(1, min(ks, chunk))
        plan = {"M": M, "codec": CODEC_LOWRANK, "bits": bits, "P": P, "Q": Q, "rank": k,
                "captured": captured, "lowrank_error": lowrank_error,
                "k": ks, "chunk": chunk, "sp_captured": sp_captured,
                "sparse_error": math.sqrt(max(0.0, 1.0 - float(sp_captured[ks - 1])))}
        lr_bytes, sp_bytes = _lowrank_bytes(m, n, k, bits), _sparse_bytes(m * n, chunk, ks, bits)
        if sp_bytes < lr_bytes:
            plan["codec"] = CODEC_SPARSE
        if min(lr_bytes, sp_bytes) >= _quant_bytes(m, n, 4):  # step 3 (c): neither is worth it
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
                elif p["codec"] == CODEC_SPARSE:
                    total += _sparse_bytes(m * c, p["chunk"], p["k"], p["bits"])
                else:
                    total += _quant_bytes(m, c, p["bits"])
            return total

        if size() <= budget:
            return False
        for p in plans.values():  # whole-quantised matrices go back to factors or sparse
            if "P" in p and p["codec"] == CODEC_QUANT:
                m, c = p["M"].shape
                sparse = _sparse_bytes(m * c, p["chunk"], p["k"], 4) < _lowrank_bytes(m, c, p["rank"], 4)
                p.update(codec=CODEC_SPARSE if sparse else CODEC_LOWRANK, bits=4)
        while size() > budget:
            lowered = False
            for n in sorted(plans, key=lambda k: -plans[k]["M"].numel()):
                p = plans[n]
                if p["codec"] == CODEC_LOWRANK and p["rank"] > 1:
                    p["rank"] = max(1, p["rank"] // 2)
                    p["lowrank_error"] = math.sqrt(
                        max(0.0, 1.0 - float(p["captured"][p["rank"] - 1]))
                    )
                elif p["codec"] == CODEC_SPARSE and "sp_captured" in p and p["k"] > 1:
                    p["k"] = max(1, p["k"] // 2)
                    p["sparse_error"] = math.sqrt(max(0.0, 1.0 - float(p["sp_captured"][p["k"] - 1])))
                else:
                    continue
                lowered = True
                if size() <= budget:
                    return True
            if not lowered:
                return True
        return True
