"""Round-start states stored by reference to the committed shard whose weights they hold
(lineage/store/roundstate.py): the original bytes come back exactly, anything that cannot
is stored as a plain file, and a hostile node is a one-line StorageError, never a traceback."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import dag_cbor
import pytest
import torch

from lineage.errors import StorageError
from lineage.store import roundstate as rs
from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_CBOR, DAG_PB, RAW
from lineage.store.manifest import Manifest, put_config, put_manifest
from lineage.store.unixfs import import_bytes, read_bytes
from trainer.artifacts import KERNELS_KEY, bytes_to_tensors, tensors_to_bytes

DLX = str(Path(sys.executable).parent / "dlx")


def _params(seed: int, n: int = 3000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"param/blocks.0.w": torch.randn(n, 40, generator=g), "param/blocks.0.b": torch.randn(40, generator=g),
            "param/wte.weight": torch.randn(256, 40, generator=g)}


def _shard(params: dict[str, torch.Tensor]) -> bytes:
    return tensors_to_bytes({**params, **{k.replace("param/", "momentum/"): v * 0.5 for k, v in params.items()}})


def _state(params: dict[str, torch.Tensor], **extra: torch.Tensor) -> bytes:
    inner = {k.replace("param/", "inner/exp_avg/"): v * 0.1 for k, v in params.items()}
    return tensors_to_bytes({**params, **inner, "round/outer_step": torch.tensor([3]),
                             "round/inner_step": torch.tensor([60]),
                             KERNELS_KEY: torch.frombuffer(bytearray(b"AVX2 probe 1234"), dtype=torch.uint8),
                             "compress/residual/blocks.0.b": torch.ones(40), **extra})


@pytest.fixture()
def store(tmp_path) -> Blockstore:
    return Blockstore(tmp_path / "blocks")


def _stored(store: Blockstore, data: bytes) -> tuple[object, bytes | None]:
    cid = import_bytes(data, store.put).cid
    return cid, rs.param_digest(data)


def test_a_state_on_a_committed_shard_is_a_reference_and_reads_back_byte_for_byte(store):
    params = _params(0)
    shard, other = _stored(store, _shard(params)), _stored(store, _shard(_params(1)))
    state = _state(params)
    before = sum(store.size(c) for c in store)
    cid = rs.put_round_state(store, state, [other, shard])
    assert cid.codec.name == DAG_CBOR and rs.is_reference(cid)
    ref = rs.round_state_ref(store, cid)
    assert ref.weights == shard[0] and ref.size == len(state) and ref.sha256 == hashlib.sha256(state).digest()
    rest = bytes_to_tensors(read_bytes(store, ref.rest))  # the rest is plain safetensors, no weights
    assert not any(k.startswith("param/") for k in rest) and "round/outer_step" in rest
    added = sum(store.size(c) for c in store) - before
    assert added < len(state) - sum(v.numel() * 4 for v in params.values()) + 4096
    assert rs.read_round_state(store, cid) == state
    assert rs.read_round_state(store, cid, shards=[shard[0]]) == state
    assert bytes_to_tensors(rs.read_round_state(store, cid, workers=0)).keys() == bytes_to_tensors(state).keys()


def test_other_weights_or_no_candidate_give_a_plain_file_read_as_before(store):
    state = _state(_params(0))
    shard = _stored(store, _shard(_params(1)))  # other weights
    for candidates in ([shard], [], [(shard[0], None)]):
        cid = rs.put_round_state(store, state, candidates)
        assert cid.codec.name in (RAW, DAG_PB) and not rs.is_reference(cid)
        assert rs.read_round_state(store, cid, shards=[]) == state  # a plain file needs no shard
    # a state whose weights are stored in another dtype than the shard's is not the shard's
    params = _params(2)
    half = _state({k: v.to(torch.bfloat16) for k, v in params.items()})
    assert not rs.is_reference(rs.put_round_state(store, half, [_stored(store, _shard(params))]))
    # bytes that are not safetensors at all
    assert not rs.is_reference(rs.put_round_state(store, b"not a state", [shard]))


def test_mixed_dtypes_scalars_and_empty_tensors_rebuild_exactly(store):
    params = {**_params(3, 10), "param/scale": torch.tensor(2.5), "param/half": torch.ones(3, dtype=torch.bfloat16),
              "param/empty": torch.zeros(0, 4)}
    state = _state(params, **{"compress/flags": torch.tensor([True, False]), "zz/after": torch.ones(2)})
    cid = rs.put_round_state(store, state, [_stored(store, _shard(params))])
    assert rs.is_reference(cid) and rs.read_round_state(store, cid) == state


def _node(store, **fields) -> object:
    return store.put(dag_cbor.encode(fields), DAG_CBOR)


def test_hostile_nodes_are_one_line_storage_errors(store):
    params = _params(0)
    shard_cid, digest = _stored(store, _shard(params))
    state = _state(params)
    good = rs.round_state_ref(store, rs.put_round_state(store, state, [(shard_cid, digest)]))
    contribution = import_bytes(tensors_to_bytes({"delta/w": torch.ones(4)}), store.put).cid
    not_st = import_bytes(b"\x00" * 64, store.put).cid
    with_params = import_bytes(tensors_to_bytes({"param/x": torch.ones(2)}), store.put).cid
    base = {"version": 1, "kind": "round-state", "weights": good.weights, "rest": good.rest, "size": good.size,
            "sha256": good.sha256}
    cases = {
        "its weights .* are not a shard": {**base, "weights": contribution},
        "are not a shard \\(": {**base, "weights": not_st},
        "its rest .* holds param/ tensors": {**base, "rest": with_params},
        "its rest .* is not safetensors": {**base, "rest": not_st},
        "do not have the node's sha256": {**base, "sha256": bytes(32)},
        "rebuilt .* bytes, the node says": {**base, "size": good.size - 8},
        "more than its two files hold": {**base, "size": 10**15},
        "not a link to a UnixFS file": {**base, "weights": _node(store, a=1)},
        "not a version-1 round-state node": {**base, "kind": "replay-mismatch"},
        "malformed size or sha256": {**base, "size": True},
    }
    for message, fields in cases.items():
        with pytest.raises(StorageError, match=message) as info:
            rs.read_round_state(store, _node(store, **fields))
        assert "\n" not in str(info.value)
    with pytest.raises(StorageError, match="not a version-1"):
        rs.read_round_state(store, _node(store, **{**base, "extra": 1}))
    big = store.put(dag_cbor.encode({**base, "pad": b"x" * 2000}), DAG_CBOR)
    with pytest.raises(StorageError, match="more than a reference"):
        rs.read_round_state(store, big)
    with pytest.raises(StorageError, match="not DAG-CBOR"):
        rs.read_round_state(store, store.put(b"\xff\x00", DAG_CBOR))
    # a real shard, but not one the step may start from
    other, _ = _stored(store, _shard(_params(5)))
    node = _node(store, **base)
    with pytest.raises(StorageError, match="not a committed shard it may start from"):
        rs.read_round_state(store, node, shards=[other])
    assert rs.read_round_state(store, node, shards=[other, shard_cid]) == state


def test_reference_shards_are_the_parents_then_the_grandparents(store):
    config = put_config(store, {"job": "x"})
    g = [import_bytes(_shard(_params(i)), store.put).cid for i in (0, 1)]
    one = [import_bytes(_shard(_params(i)), store.put).cid for i in (2, 3)]
    genesis = put_manifest(store, Manifest(step=0, parent=None, config=config, stages=g, code=bytes(32)))
    step1 = put_manifest(store, Manifest(step=1, parent=genesis, config=config, stages=one, code=bytes(32), run=1))
    assert rs.reference_shards(store, genesis, 1) == [g[1]]
    assert rs.reference_shards(store, step1, 0) == [one[0], g[0]]
    assert rs.reference_shards(store, None, 0) == []
    # a start state of step 2 on step 0's shard (the restart rule's round of delay 1)
    state = _state(_params(0))
    cid = rs.put_round_state(store, state, [(c, rs.param_digest(read_bytes(store, c)))
                                            for c in rs.reference_shards(store, step1, 0)])
    m2 = Manifest(step=2, parent=step1, config=config, stages=one, code=bytes(32), run=1, replay=[[cid, cid]])
    assert rs.read_start_state(store, m2, 0, 0) == state
    with pytest.raises(StorageError, match="not a committed shard it may start from"):
        rs.read_start_state(store, m2, 0, 1)  # stage 1 may not start from stage 0's shard


def test_dlx_cas_get_rebuilds_a_reference_and_refuses_a_hostile_one_with_exit_2(store, tmp_path):
    params = _params(0)
    shard = _stored(store, _shard(params))
    state = _state(params)
    cid = rs.put_round_state(store, state, [shard])
    out = tmp_path / "state.safetensors"
    res = subprocess.run([DLX, "cas", "get", str(cid), "-o", str(out), "--store", str(store.root)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() == state
    ref = rs.round_state_ref(store, cid)
    bad = _node(store, version=1, kind="round-state", weights=ref.rest, rest=ref.rest, size=ref.size,
                sha256=ref.sha256)
    res = subprocess.run([DLX, "cas", "get", str(bad), "--store", str(store.root)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1 and "are not a shard" in res.stderr
