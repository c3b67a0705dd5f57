"""The gaps layout of 2-bit values (`coding = "gaps"`): lossless against the fixed layout,
bit for bit, in fewer bytes; a malformed stream is a ValueError naming what is wrong."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.compress import (
    CODEC_GAPS,
    GAPS_META,
    GAPS_STREAM,
    Compressor,
    _pack_bits_any,
    decode_contribution,
    gaps_decode,
    gaps_encode,
    pack_bits,
    unpack_bits,
)
from trainer.config import CompressionConfig, ConfigError, load_job

FIXED = CompressionConfig(kind="quantize", bits=2)
GAPS = CompressionConfig(kind="quantize", bits=2, coding="gaps")


def _ternary(n: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(n, generator=g) < density
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return torch.where(keep, sign, torch.zeros(n))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 3000), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31))
def test_the_stream_decodes_to_its_values_in_at_most_two_bits_each(n: int, density: float, seed: int) -> None:
    q = _ternary(n, density, seed)
    stream, w, T = gaps_encode(q)
    assert torch.equal(gaps_decode(stream, w, T, n), q)
    assert stream.numel() <= math.ceil(2 * n / 8) + 1  # w = 1 is 1 bit a zero, 2 a value


@settings(max_examples=80, deadline=None)
@given(width=st.integers(1, 16), count=st.integers(0, 200), seed=st.integers(0, 2**31))
def test_bit_packing_at_whole_bytes_is_the_bit_by_bit_packing(width: int, count: int, seed: int) -> None:
    values = torch.randint(0, 2**width, (count,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    packed = pack_bits(values, width)
    assert torch.equal(packed, _pack_bits_any(values, width))
    assert torch.equal(unpack_bits(packed, width, count), values.long())


def test_runs_longer_than_a_token_use_escapes_and_w_is_the_cheapest() -> None:
    q = torch.zeros(10_000)
    q[[0, 5000, 5001, 9990]] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    stream, w, T = gaps_encode(q)
    assert torch.equal(gaps_decode(stream, w, T, q.numel()), q)
    # Brute force over every width: bytes of tokens plus 1 byte of four signs.
    gaps = [0, 4999, 0, 4988]
    sizes = {v: math.ceil((sum(g // (2**v - 1) for g in gaps) + 4) * v / 8) for v in range(1, 17)}
    assert w == min(sizes, key=lambda v: (sizes[v], v)) and stream.numel() == sizes[w] + 1
    # A run of zeros far longer than the values are many: counted without a histogram.
    lone = torch.zeros(3_000_000)
    lone[-1] = -1.0
    stream, w, T = gaps_encode(lone)
    assert (w, T) == (16, 2_999_999 // (2**16 - 1) + 1) and torch.equal(gaps_decode(stream, w, T, lone.numel()), lone)
    empty, w0, T0 = gaps_encode(torch.zeros(7))
    assert (empty.numel(), T0) == (0, 0) and torch.equal(gaps_decode(empty, w0, T0, 7), torch.zeros(7))


def test_gaps_train_exactly_as_the_fixed_layout_in_fewer_bytes() -> None:
    """The same values and residuals step after step (error feedback included), with the
    rounding stacked over tensors of equal columns (two of 384) and alone (the others)."""
    shapes = {"a": torch.Size([96, 384]), "b": torch.Size([64, 384]), "c": torch.Size([384, 96]),
              "n": torch.Size([96])}
    fixed, gaps = Compressor(FIXED, shapes, 0), Compressor(GAPS, shapes, 0)
    g = torch.Generator().manual_seed(5)
    for step in range(1, 6):
        delta = {k: torch.randn(s, generator=g) * (1 + 9 * torch.rand(s, generator=g) ** 8) for k, s in shapes.items()}
        a, b = fixed.compress(delta, step), gaps.compress(delta, step)
        da, db = decode_contribution(a, shapes), decode_contribution(b, shapes)
        assert all(torch.equal(da[k], db[k]) for k in shapes)
        assert all(torch.equal(fixed.state[k].residual, gaps.state[k].residual) for k in shapes)
        assert len(b) < len(a) / 2.5, (len(a), len(b))
        payload = bytes_to_tensors(b)
        assert all(payload[f"meta/{k}"].tolist() == [CODEC_GAPS, 2, 0] for k in shapes)
        assert sorted(payload) == sorted([GAPS_META, GAPS_STREAM, *(f"{f}/{k}" for f in ("meta", "q_scale")
                                                                    for k in shapes)])
        assert payload[GAPS_META][2] == sum(s.numel() for s in shapes.values())


def _payload(q: torch.Tensor) -> dict[str, torch.Tensor]:
    stream, w, T = gaps_encode(q)
    return {"meta/w": torch.tensor([CODEC_GAPS, 2, 0], dtype=torch.int32), "q_scale/w": torch.ones(1),
            GAPS_STREAM: stream, GAPS_META: torch.tensor([w, T, q.numel()])}


def _decode(payload: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    return decode_contribution(tensors_to_bytes(payload), {"w": torch.Size([n])})["w"]


def test_malformed_streams_are_errors_naming_what_is_wrong() -> None:
    q = torch.tensor([0.0, 1, 0, 0, -1, 0, 0, 0, 0, 0, 1, 0, 0])
    good = _payload(q)
    assert torch.equal(_decode(good, q.numel()), q)
    w, T, n = good[GAPS_META].tolist()
    stream = good[GAPS_STREAM]
    cases = [
        ("fewer than", stream[:0]),
        ("want", stream[:-1]),
        ("want", torch.cat([stream, torch.zeros(1, dtype=torch.uint8)])),
        ("padding", torch.cat([stream[:-1], (stream[-1:] | 0x80)])),
        ("uint8", stream.to(torch.int32)),
    ]
    for message, bad in cases:
        with pytest.raises(ValueError, match=f"gaps/stream: .*{message}"):
            _decode({**good, GAPS_STREAM: bad}, n)
    with pytest.raises(ValueError, match="a value at index 10 of 9"):  # the stream runs past the tensor
        _decode({**good, GAPS_META: torch.tensor([w, T, 9])}, 9)
    with pytest.raises(ValueError, match="counts 13 values, the gaps-coded tensors hold 12"):
        _decode(good, 12)
    with pytest.raises(ValueError, match="has bits 4"):
        _decode({**good, "meta/w": torch.tensor([CODEC_GAPS, 4, 0], dtype=torch.int32)}, n)
    with pytest.raises(ValueError, match="q_scale/w is torch.float32 \\(2,\\)"):
        _decode({**good, "q_scale/w": torch.ones(2)}, n)
    with pytest.raises(ValueError, match="width 0"):
        _decode({**good, GAPS_META: torch.tensor([0, T, n])}, n)
    with pytest.raises(ValueError, match="need gaps/stream and gaps/meta"):
        _decode({k: v for k, v in good.items() if k != GAPS_STREAM}, n)
    # A last token that skips zeros and ends without a value: never written by the encoder.
    E = 2**2 - 1
    trailing = {**good, GAPS_STREAM: torch.cat([pack_bits(torch.tensor([0, E]), 2), pack_bits(torch.tensor([1]), 1)]),
                GAPS_META: torch.tensor([2, 2, 8])}
    with pytest.raises(ValueError, match="last token"):
        _decode(trailing, 8)


def test_gaps_need_two_bit_quantisation_and_are_not_hashed_when_off() -> None:
    for compression in ({"kind": "quantize", "bits": 4, "coding": "gaps"}, {"kind": "sparse", "bits": 2, "coding": "gaps"}):
        with pytest.raises(ConfigError) as info:
            load_job({"name": "t", "outer": {"steps": 1, "inner_steps": 1, "compression": compression}})
        assert "outer.compression: coding = 'gaps' needs kind = 'quantize' and bits = 2" in str(info.value)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="outer.compression.coding"):
        load_job({"name": "t", "outer": {"steps": 1, "inner_steps": 1, "compression": {"coding": "huffman"}}})
    assert "coding" not in FIXED.model_dump() and GAPS.model_dump()["coding"] == "gaps"
