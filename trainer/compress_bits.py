"""The bit-level layouts of pseudo-gradient compression (`trainer.compress` describes the
kinds and the payload): symmetric b-bit row quantisation and its packing, `pack_bits` /
`unpack_bits` at any width, the 2-bit gaps layout of runs of zeros, chunked top-k sparse
coding and the byte sizes of each. Pure functions of tensors; the codecs
(`trainer.compress_codecs`) put them into payload keys."""

from __future__ import annotations

import math

import numpy as np
import torch

from trainer.config import CHUNK_MAX

MAX_CHUNK = CHUNK_MAX  # the largest sparse chunk (65536): 16-bit indices

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
    q, scale = round_rows(x, bits)
    u = (q + _levels(bits)).to(torch.uint8)
    return _pack(u, bits), scale


def round_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def index_bits(chunk: int) -> int:
    """Bits per in-chunk index: ceil(log2(chunk)), at least 1."""
    return max(1, (chunk - 1).bit_length())


def sparse_k(density: float, chunk: int) -> int:
    """Values kept per chunk: max(1, ceil(density * chunk)) (a product within 1e-9 of an
    integer counts as that integer, so 0.1 * 640 keeps 64, not 65), at most `chunk`."""
    return min(chunk, max(1, math.ceil(density * chunk - 1e-9)))


def sparse_payload_bytes(numel: int, chunk: int, k: int, bits: int) -> int:
    """Data bytes of one sparse tensor: values, scales, indices and its meta (16 bytes)."""
    return sparse_bytes(numel, chunk, k, bits) + 16


def sparse_bytes(numel: int, chunk: int, k: int, bits: int) -> int:
    groups = math.ceil(numel / chunk)
    return groups * math.ceil(k * bits / 8) + 4 * groups + math.ceil(groups * k * index_bits(chunk) / 8)


def chunk_rows(M: torch.Tensor, chunk: int) -> torch.Tensor:
    """M flattened, zero-padded to whole chunks: (groups, chunk) float32."""
    flat = M.reshape(-1).float()
    pad = (-flat.numel()) % chunk
    if pad:
        flat = torch.cat([flat, torch.zeros(pad)])
    return flat.view(-1, chunk)


def topk_sorted(X: torch.Tensor, k: int) -> torch.Tensor:
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
    X = chunk_rows(M, chunk)
    idx = topk_sorted(X, k)  # (G, k)
    values, scale = quantize_rows(X.gather(1, idx), bits)
    return values, scale, pack_bits(idx, index_bits(chunk))


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
    idx = unpack_bits(packed_idx, index_bits(chunk), groups * k).view(groups, k)
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


def as_matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """How a tensor is viewed for compression: (shape[0], rest) for >= 2-D, (1, n) for 1-D."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def quant_bytes(rows: int, cols: int, bits: int) -> int:
    return rows * math.ceil(cols * bits / 8) + 4 * rows


def lowrank_bytes(m: int, n: int, rank: int, bits: int) -> int:
    return quant_bytes(rank, m, bits) + quant_bytes(rank, n, bits)
