"""The batched encoders and decoder (trainer/compress.py `_quant_batch`, `_sparse_batch`,
`_dequant_batch`) against the one-tensor-at-a-time `_encode` and `_decode_one`: the same
payload tensors bit for bit, the same residual, the same decoded values, and malformed
tensors left to `_decode_one`'s errors.

    .venv/bin/pytest tests/test_compress_batch.py
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.artifacts import tensors_to_bytes
from trainer.compress import (
    CODEC_QUANT,
    CODEC_SPARSE,
    _decode_one,
    _dequant_batch,
    _encode,
    _quant_batch,
    _sparse_batch,
    decode_contribution,
)

# Several tensors sharing a column count (they batch), one that does not, a 1-D one.
shapes_st = st.lists(
    st.tuples(st.integers(1, 9), st.sampled_from([1, 3, 8, 13])), min_size=2, max_size=6
)


def _tensors(shapes: list[tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {f"t{i}": torch.randn(m, n, generator=g) * 10 ** float(torch.randint(-4, 2, (1,), generator=g))
           for i, (m, n) in enumerate(shapes)}
    out["t0"][0].zero_()  # an all-zero row: scale 0
    return out


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shapes=shapes_st, bits=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_quant_batch_sends_what_one_tensor_at_a_time_sends(shapes, bits, seed) -> None:
    Ms = _tensors(shapes, seed)
    plans = {n: {"M": M, "codec": CODEC_QUANT, "bits": bits} for n, M in Ms.items()}
    batched = _quant_batch(plans)
    assert batched or len({M.size(1) for M in Ms.values()}) == len(Ms)
    for n, (enc, err) in batched.items():
        ref = _encode(n, Ms[n], CODEC_QUANT, bits)
        assert sorted(enc) == sorted(ref)
        for k in ref:
            assert enc[k].dtype == ref[k].dtype and torch.equal(enc[k], ref[k]), (n, k)
        decoded = _decode_one(n, ref, Ms[n].shape)
        assert torch.equal(err, Ms[n] - decoded)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shapes=shapes_st, bits=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**16))
def test_dequant_batch_decodes_what_decode_one_decodes(shapes, bits, seed) -> None:
    Ms = _tensors(shapes, seed)
    payload: dict[str, torch.Tensor] = {}
    for n, M in Ms.items():
        payload.update(_encode(n, M, CODEC_QUANT, bits))
    sizes = {n: M.shape for n, M in Ms.items()}
    batched = _dequant_batch(payload, sizes)
    for n in batched:
        assert torch.equal(batched[n], _decode_one(n, payload, sizes[n]))
    whole = decode_contribution(tensors_to_bytes(payload), sizes)
    assert all(torch.equal(whole[n], _decode_one(n, payload, sizes[n])) for n in sizes)


def test_sparse_batch_sends_what_one_tensor_at_a_time_sends() -> None:
    Ms = _tensors([(4, 64), (7, 64), (2, 64)], 3)
    plans = {n: {"M": M, "codec": CODEC_SPARSE, "bits": 4, "chunk": 64, "k": 5} for n, M in Ms.items()}
    batched = _sparse_batch(plans)
    assert sorted(batched) == sorted(Ms)
    for n, (enc, err) in batched.items():
        ref = _encode(n, Ms[n], CODEC_SPARSE, 4, sparse=(5, 64))
        assert all(torch.equal(enc[k], ref[k]) for k in ref) and sorted(enc) == sorted(ref)
        assert torch.equal(err, Ms[n] - _decode_one(n, ref, Ms[n].shape))


@pytest.mark.parametrize("bad", ["q_rows", "scale_shape", "meta_codec"])
def test_a_malformed_tensor_is_left_to_decode_one_and_fails_there(bad) -> None:
    Ms = _tensors([(3, 8), (5, 8), (2, 8)], 1)
    payload: dict[str, torch.Tensor] = {}
    for n, M in Ms.items():
        payload.update(_encode(n, M, CODEC_QUANT, 4))
    if bad == "q_rows":
        payload["q/t1"] = payload["q/t1"][:2]
    elif bad == "scale_shape":
        payload["q_scale/t1"] = payload["q_scale/t1"][:2]
    else:
        payload["meta/t1"] = torch.tensor([99, 4, 0], dtype=torch.int32)
    sizes = {n: M.shape for n, M in Ms.items()}
    assert "t1" not in _dequant_batch(payload, sizes)
    with pytest.raises(ValueError, match="contribution"):
        decode_contribution(tensors_to_bytes(payload), sizes)
