"""Tests for the sparse compression kind (chunked top-k, SparseLoCo-style) and for the
adaptive rule's sparse candidate: the bit packer, round trips within half a quantisation
step, deterministic ties, error feedback and its residual bound, the payload size formula,
thread-count independence of decoding, malformed payloads, state round trips, the adaptive
choice among low rank, sparse and whole quantisation, and config validation.

    .venv/bin/pytest tests/test_compress_sparse.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer import ConfigError, bytes_to_tensors, load_job
from trainer.artifacts import tensors_to_bytes
from trainer.compress import (
    CODEC_LOWRANK,
    CODEC_QUANT,
    CODEC_SPARSE,
    ONE_D_BITS,
    Compressor,
    decode_contribution,
    pack_bits,
    payload_budget,
    sparse_k,
    sparse_payload_bytes,
    unpack_bits,
)
from trainer.config import CompressionConfig

# --- the bit packer ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(width=st.integers(1, 16), count=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_pack_bits_round_trips_at_every_width(width, count, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << width, (count,), generator=g)
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.shape == (math.ceil(count * width / 8),)
    assert torch.equal(unpack_bits(packed, width, count), values)
    if count * width % 8:  # the last byte's unused high bits are zero
        assert int(packed[-1]) >> (count * width % 8) == 0


def test_pack_bits_layout_is_little_endian() -> None:
    # 3-bit values 1, 2: stream bits 0..2 = 1,0,0 and 3..5 = 0,1,0 -> byte 0b00010001.
    assert pack_bits(torch.tensor([1, 2]), 3).tolist() == [0b00010001]
    assert pack_bits(torch.tensor([0x1234]), 16).tolist() == [0x34, 0x12]
    assert pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1).tolist() == [0b1101, 1]
    with pytest.raises(ValueError, match="outside"):
        pack_bits(torch.tensor([8]), 3)
    with pytest.raises(ValueError, match="want 1 uint8 bytes"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), 3, 2)


# --- round trips ---------------------------------------------------------------------------


def _sparse_cfg(density: float, bits: int, chunk: int, **kw) -> CompressionConfig:
    return CompressionConfig(kind="sparse", density=density, bits=bits, chunk=chunk, **kw)


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    flat = x.reshape(-1)
    return torch.cat([flat, torch.zeros((-flat.numel()) % chunk)]).view(-1, chunk)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    m=st.integers(1, 40),
    n=st.integers(2, 70),
    chunk=st.sampled_from([64, 128, 256]),
    density=st.sampled_from([0.01, 0.02, 0.05, 0.3, 1.0]),
    bits=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_sparse_round_trip_keeps_the_top_k_of_each_chunk_within_half_a_step(
    m, n, chunk, density, bits, seed, ties
) -> None:
    g = torch.Generator().manual_seed(seed)
    M = torch.randn(m, n, generator=g)
    if ties:  # few distinct magnitudes, so top-k must break many ties
        M = torch.randint(-2, 3, (m, n), generator=g).float()
    comp = Compressor(_sparse_cfg(density, bits, chunk, error_feedback=False), {"w": M.shape}, seed=0)
    data = comp.compress({"w": M}, 1)
    payload = bytes_to_tensors(data)
    C = min(chunk, m * n)
    k = sparse_k(density, C)
    assert payload["meta/w"].tolist() == [CODEC_SPARSE, bits, k, C]
    G = math.ceil(m * n / C)
    idx = unpack_bits(payload["sp_idx/w"], max(1, (C - 1).bit_length()), G * k).view(G, k)
    X, D = _chunked(M, C), _chunked(decode_contribution(data, {"w": M.shape})["w"], C)
    scale = payload["sp_scale/w"]
    for c in range(G):
        row = X[c].tolist()
        want = sorted(sorted(range(C), key=lambda i: (-abs(row[i]), i))[:k])  # ties: lower index
        assert idx[c].tolist() == want
        kept = torch.zeros(C, dtype=torch.bool)
        kept[idx[c]] = True
        assert bool((D[c][~kept] == 0).all())  # dropped entries decode to 0
        assert int(D[c].ne(0).sum()) <= k
        bound = float(scale[c]) / 2 * (1 + 1e-5) + 1e-30
        assert bool(((D[c][kept] - X[c][kept]).abs() <= bound).all())
        assert float(scale[c]) == pytest.approx(float(X[c][kept].abs().max()) / (2 ** (bits - 1) - 1))


def test_one_d_tensors_are_quantised_whole_at_eight_bits() -> None:
    shapes = {"w": torch.Size([16, 16]), "b": torch.Size([16])}
    comp = Compressor(_sparse_cfg(0.05, 2, 64), shapes, seed=0)
    payload = bytes_to_tensors(comp.compress({n: torch.randn(s) for n, s in shapes.items()}, 1))
    assert payload["meta/b"].tolist() == [CODEC_QUANT, ONE_D_BITS, 0]
    assert payload["meta/w"].tolist()[:2] == [CODEC_SPARSE, 2]
    assert sorted(payload) == ["meta/b", "meta/w", "q/b", "q_scale/b", "sp/w", "sp_idx/w", "sp_scale/w"]


# --- error feedback --------------------------------------------------------------------------


@pytest.mark.slow  # not in --quick: Hypothesis over error feedback
@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    m=st.integers(2, 40),
    n=st.integers(2, 70),
    chunk=st.sampled_from([64, 256]),
    density=st.sampled_from([0.02, 0.05, 0.2, 1.0]),
    bits=st.sampled_from([2, 4, 8]),
)
def test_error_feedback_loses_nothing_and_the_residual_stays_within_the_contraction_bound(
    seed, m, n, chunk, density, bits
) -> None:
    """sum_t decoded_t + e_T == sum_t delta_t, and over 100 steps of unit-norm random deltas
    ||e_t|| <= 2 C / k * max ||delta||: top-k keeps at least k / C of a chunk's energy, so with
    q = sqrt(1 - k / C), ||e|| <= q / (1 - q) max ||delta|| < 2 C / k max ||delta||. Measured
    over 3 seeds x 4 shapes x these densities, bits and chunks, the worst ||e|| / (C / k) is
    1.41 (2 bits at density 1, ternary values), at most 0.29 otherwise; random deltas also
    stay within 2 sqrt(C / k) (worst measured 1.41 sqrt(C / k)), asserted too."""
    shapes = {"w": torch.Size([m, n]), "b": torch.Size([n])}
    comp = Compressor(_sparse_cfg(density, bits, chunk), shapes, seed=seed)
    C = min(chunk, m * n)
    k = sparse_k(density, C)
    g = torch.Generator().manual_seed(seed)
    sent = {s: torch.zeros(v, dtype=torch.float64) for s, v in shapes.items()}
    total = {s: torch.zeros(v, dtype=torch.float64) for s, v in shapes.items()}
    worst = 0.0
    for step in range(1, 101):
        delta = {s: torch.randn(v, generator=g) for s, v in shapes.items()}
        delta["w"] /= delta["w"].norm()
        decoded = decode_contribution(comp.compress(delta, step), shapes)
        for s in shapes:
            sent[s] += decoded[s].double()
            total[s] += delta[s].double()
        worst = max(worst, float(comp.state["w"].residual.norm()))
    for s in shapes:
        assert torch.allclose(sent[s] + comp.state[s].residual.double(), total[s], atol=1e-4)
    assert worst <= 2 * C / k, (worst, C, k)
    assert worst <= 2 * math.sqrt(C / k), (worst, C, k)


# --- payload size ----------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "chunk"), [((384, 96), 4096), ((96, 384), 1024), ((10, 10), 64),
                                              ((7, 11), 4096)])
def test_payload_size_is_the_documented_formula_and_shrinks_with_density(shape, chunk) -> None:
    M = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    N = M.numel()
    sizes = []
    for density in (0.5, 0.2, 0.05, 0.02, 0.005):
        for bits in (2, 4, 8):
            data = Compressor(_sparse_cfg(density, bits, chunk), {"w": M.shape}, seed=0).compress({"w": M}, 1)
            C = min(chunk, N)
            k, G, w = sparse_k(density, C), math.ceil(N / C), max(1, (C - 1).bit_length())
            header = int.from_bytes(data[:8], "little")
            body = G * math.ceil(k * bits / 8) + 4 * G + math.ceil(G * k * w / 8) + 16
            assert sparse_payload_bytes(N, C, k, bits) == body
            assert len(data) == 8 + header + body and header % 8 == 0
            entries = json.loads(data[8:8 + header])
            assert {key: (e["dtype"], e["shape"]) for key, e in entries.items()} == {
                "meta/w": ("I32", [4]),
                "sp/w": ("U8", [G, math.ceil(k * bits / 8)]),
                "sp_scale/w": ("F32", [G]),
                "sp_idx/w": ("U8", [math.ceil(G * k * w / 8)]),
            }
            if bits == 2:
                sizes.append(len(data))
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert len(data) < 4 * N


# --- determinism -------------------------------------------------------------------------------


def test_decoding_is_bit_identical_whatever_the_thread_count() -> None:
    shapes = {"w": torch.Size([512, 640]), "v": torch.Size([3000, 7]), "b": torch.Size([640])}
    g = torch.Generator().manual_seed(5)
    delta = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    before = torch.get_num_threads()
    try:
        out = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            comp = Compressor(_sparse_cfg(0.05, 4, 4096), shapes, seed=0)
            data = comp.compress(delta, 1)
            out[threads] = (data, {n: t.clone() for n, t in decode_contribution(data, shapes).items()})
            torch.set_num_threads(3 - threads)
            again = decode_contribution(data, shapes)
            assert all(torch.equal(again[n].view(torch.int32), out[threads][1][n].view(torch.int32))
                       for n in shapes)
    finally:
        torch.set_num_threads(before)
    assert out[1][0] == out[2][0]  # and the encoder agrees with itself
    assert all(torch.equal(out[1][1][n].view(torch.int32), out[2][1][n].view(torch.int32)) for n in shapes)


# --- malformed payloads -------------------------------------------------------------------------


def _good(shape, chunk=64, density=0.1, bits=4) -> dict[str, torch.Tensor]:
    M = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    return bytes_to_tensors(Compressor(_sparse_cfg(density, bits, chunk), {"w": M.shape}, seed=0)
                            .compress({"w": M}, 1))


def _decode(payload: dict, shape) -> dict:
    return decode_contribution(tensors_to_bytes(payload), {"w": torch.Size(shape)})


def test_decode_rejects_malformed_sparse_payloads() -> None:
    """Index out of its chunk, indices not ascending, missing keys, wrong sizes and dtypes,
    k > chunk, a meta of the wrong length: each a ValueError naming the problem."""
    good = _good((10, 10), chunk=128)  # one chunk of 100 values: 7-bit indices, so 100..127 are encodable
    _decode(good, (10, 10))
    k = int(good["meta/w"][2])
    idx = unpack_bits(good["sp_idx/w"], 7, k)
    bad = idx.clone()
    bad[-1] = 120
    with pytest.raises(ValueError, match="index 120 out of range"):
        _decode({**good, "sp_idx/w": pack_bits(bad, 7)}, (10, 10))
    flipped = idx.clone()
    flipped[0], flipped[1] = idx[1], idx[0]
    with pytest.raises(ValueError, match="ascending"):
        _decode({**good, "sp_idx/w": pack_bits(flipped, 7)}, (10, 10))
    for key in ("sp/w", "sp_scale/w", "sp_idx/w"):
        with pytest.raises(ValueError, match=f"missing {key}"):
            _decode({n: t for n, t in good.items() if n != key}, (10, 10))
    with pytest.raises(ValueError, match="values are"):
        _decode({**good, "sp/w": good["sp/w"][:, :-1].contiguous()}, (10, 10))
    with pytest.raises(ValueError, match="scales are"):
        _decode({**good, "sp_scale/w": good["sp_scale/w"].double()}, (10, 10))
    with pytest.raises(ValueError, match="uint8 bytes"):
        _decode({**good, "sp_idx/w": good["sp_idx/w"][:-1].contiguous()}, (10, 10))
    with pytest.raises(ValueError, match="k 101 and chunk 100"):
        _decode({**good, "meta/w": torch.tensor([CODEC_SPARSE, 4, 101, 100], dtype=torch.int32)}, (10, 10))
    with pytest.raises(ValueError, match="entries for codec"):
        _decode({**good, "meta/w": torch.tensor([CODEC_SPARSE, 4, k], dtype=torch.int32)}, (10, 10))
    with pytest.raises(ValueError, match="values are"):  # another shape, another chunk count
        _decode(good, (20, 10))


def test_padding_is_kept_only_as_zeros_and_values_there_are_rejected() -> None:
    from trainer.compress import sparse_encode

    M = torch.randn(2, 37, generator=torch.Generator().manual_seed(1))  # 74 values, 2 chunks of 64
    comp = Compressor(_sparse_cfg(0.25, 8, 64, error_feedback=False), {"w": M.shape}, seed=0)
    good = bytes_to_tensors(comp.compress({"w": M}, 1))  # k = 16 > the 10 real values of chunk 2
    idx = unpack_bits(good["sp_idx/w"], 6, 32).view(2, 16)
    assert idx[1].tolist() == list(range(16))  # all 10 real values, then padding in index order
    out = _decode(good, (2, 37))["w"].reshape(-1)
    assert torch.allclose(out[64:], M.reshape(-1)[64:], atol=float(good["sp_scale/w"][1]) / 2 * 1.00001)
    values, scale, packed = sparse_encode(M, 64, 4, 8)
    payload = {"meta/w": torch.tensor([CODEC_SPARSE, 8, 4, 64], dtype=torch.int32), "sp/w": values,
               "sp_scale/w": scale, "sp_idx/w": packed}
    _decode(payload, (2, 37))
    idx = unpack_bits(packed, 6, 8).view(2, 4)
    idx[1] = torch.tensor([7, 8, 9, 30])  # index 30 of the last chunk is padding
    with pytest.raises(ValueError, match="past the tensor's 74 values"):
        _decode({**payload, "sp_idx/w": pack_bits(idx, 6)}, (2, 37))


# --- state round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [_sparse_cfg(0.05, 2, 64), CompressionConfig(kind="adaptive", max_rank=4, chunk=64)],
                         ids=["sparse", "adaptive"])
def test_a_compressor_restored_mid_run_sends_the_same_bytes(cfg) -> None:
    shapes = {"w": torch.Size([24, 20]), "v": torch.Size([8, 200]), "b": torch.Size([20])}
    g = torch.Generator().manual_seed(0)
    sparse = torch.zeros(24, 20)
    sparse.view(-1)[torch.randperm(480, generator=g)[:10]] = 5.0

    def delta(t: int) -> dict[str, torch.Tensor]:
        d = {n: 0.1 * torch.randn(s, generator=g) for n, s in shapes.items()}
        d["w"] += sparse
        return d

    a = Compressor(cfg, shapes, seed=1)
    for t in range(1, 4):
        a.compress(delta(t), t, loss=3.0 - 0.1 * t)
    b = Compressor(cfg, shapes, seed=2)  # another seed: everything must come from the state
    b.load_state_tensors(a.state_tensors())
    assert b.state_bytes() == a.state_bytes()
    for t in range(4, 8):
        d = delta(t)
        assert a.compress(d, t, loss=2.0, budget_bytes=2000) == b.compress(d, t, loss=2.0, budget_bytes=2000)
    assert tensors_to_bytes(a.state_tensors()) == tensors_to_bytes(b.state_tensors())


# --- adaptive ----------------------------------------------------------------------------------------


def test_adaptive_sends_sparse_deltas_sparse_low_rank_ones_low_rank_and_noise_whole() -> None:
    g = torch.Generator().manual_seed(0)
    shapes = {"sparse": torch.Size([64, 64]), "low": torch.Size([64, 64]), "noise": torch.Size([64, 64])}
    comp = Compressor(CompressionConfig(kind="adaptive", max_rank=32, energy=0.9, warmup_steps=0),
                      shapes, seed=0)
    low = torch.randn(64, 2, generator=g) @ torch.randn(2, 64, generator=g)
    spikes = torch.zeros(64 * 64)
    where = torch.randperm(64 * 64, generator=g)[:40]
    for step in range(1, 4):
        spikes.zero_()
        spikes[where] = torch.randn(40, generator=g) * 10
        delta = {"sparse": spikes.view(64, 64).clone(),
                 "low": low + 0.01 * torch.randn(64, 64, generator=g),
                 "noise": torch.randn(64, 64, generator=g)}
        data = comp.compress(delta, step)
        out = decode_contribution(data, shapes)
        assert all(out[n].shape == shapes[n] for n in shapes)
    payload = bytes_to_tensors(data)
    chosen = comp.per_tensor()
    assert payload["meta/sparse"][0] == CODEC_SPARSE and chosen["sparse"]["codec"] == "sparse"
    assert chosen["sparse"]["rank"] == 0 and 0 < chosen["sparse"]["density"] < 0.02
    assert chosen["sparse"]["rel_error"] < math.sqrt(1 - 0.9) + 0.05  # tau = 0.9 of the energy, kept
    assert payload["meta/low"][0] == CODEC_LOWRANK and 1 <= chosen["low"]["rank"] <= 3
    assert payload["meta/noise"][0] == CODEC_QUANT and chosen["noise"]["codec"] == "quantize"
    assert chosen["noise"]["rank"] == 0 and chosen["noise"]["bits"] == 4 and "density" not in chosen["noise"]
    assert comp.last_stats["density_mean"] == chosen["sparse"]["density"]


def test_adaptive_budget_halves_k_per_chunk_of_sparse_plans() -> None:
    g = torch.Generator().manual_seed(2)
    shapes = {"w": torch.Size([256, 256])}
    cfg = CompressionConfig(kind="adaptive", max_rank=16, energy=0.95, warmup_steps=0, error_feedback=False)
    spikes = torch.zeros(256 * 256)
    spikes[torch.randperm(256 * 256, generator=g)[:1500]] = torch.randn(1500, generator=g)
    delta = {"w": spikes.view(256, 256)}
    free = Compressor(cfg, shapes, seed=0)
    unlimited = free.compress(delta, 1)
    assert free.per_tensor()["w"]["codec"] == "sparse"
    capped_comp = Compressor(cfg, shapes, seed=0)
    capped = capped_comp.compress(delta, 1, budget_bytes=len(unlimited) / 3)
    assert payload_budget(capped) == len(unlimited) / 3
    header = int.from_bytes(capped[:8], "little")
    assert len(capped) - 8 - header <= len(unlimited) / 3 + 16 + 8  # data fits, but meta and budget
    assert capped_comp.per_tensor()["w"]["codec"] == "sparse"
    assert capped_comp.per_tensor()["w"]["density"] <= free.per_tensor()["w"]["density"] / 3
    out = decode_contribution(capped, shapes)["w"]
    assert float((out - delta["w"]).norm()) < float(delta["w"].norm())


# --- config --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"density": 0}, "outer.compression.density: must be in (0, 1] (got 0.0)"),
        ({"density": 1.5}, "outer.compression.density: must be in (0, 1] (got 1.5)"),
        ({"density": -0.1}, "outer.compression.density: must be in (0, 1]"),
        ({"chunk": 100}, "outer.compression.chunk: must be a power of two between 64 and 65536 (got 100)"),
        ({"chunk": 32}, "outer.compression.chunk: must be a power of two between 64 and 65536 (got 32)"),
        ({"chunk": 131072}, "outer.compression.chunk: must be a power of two between 64 and 65536"),
    ],
)
def test_bad_sparse_settings_name_the_field(values: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job({"name": "t", "outer": {"steps": 1, "inner_steps": 1,
                                         "compression": {"kind": "sparse", **values}}})
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_sparse_settings_load() -> None:
    job = load_job({"name": "t", "outer": {"steps": 1, "inner_steps": 1,
                                           "compression": {"kind": "sparse", "density": 1, "chunk": 65536,
                                                           "bits": 2}}})
    c = job.outer.compression
    assert (c.kind, c.density, c.chunk, c.bits) == ("sparse", 1.0, 65536, 2)
    assert CompressionConfig().density == 0.02 and CompressionConfig().chunk == 4096
