"""The local blockstore: CIDs, atomic writes, re-hashing on read, several writers."""

from __future__ import annotations

import hashlib
import multiprocessing as mp

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lineage.errors import BlockNotFoundError, CorruptBlockError
from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_CBOR, RAW, cid_for, cid_from_digest, digest_of, parse_cid


def test_cid_of_known_bytes_matches_the_ipfs_raw_block_cid():
    # `ipfs block put --cid-codec raw` / `ipfs add --raw-leaves --cid-version 1` of "hello"
    assert str(cid_for(b"hello")) == "bafkreibm6jg3ux5qumhcn2b3flc3tyu6dmlb4xa7u5bf44yegnrjhc4yeq"


def test_digest_round_trips_through_a_cid_for_each_codec():
    digest = hashlib.sha256(b"x").digest()
    for codec in (RAW, DAG_CBOR):
        cid = cid_from_digest(digest, codec)
        assert digest_of(cid) == digest
        assert parse_cid(str(cid)) == cid
        assert str(cid).startswith("bafy" if codec == DAG_CBOR else "bafk")


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=4096))
def test_put_then_get_returns_the_same_bytes(tmp_path_factory, data):
    store = Blockstore(tmp_path_factory.mktemp("bs"))
    cid = store.put(data)
    assert store.get(cid) == data
    assert store.get(str(cid)) == data
    assert store.put(data) == cid  # idempotent


def test_a_flipped_bit_is_reported_with_the_cid(tmp_path):
    store = Blockstore(tmp_path)
    cid = store.put(b"checkpoint bytes")
    path = next(p for p in tmp_path.rglob("*") if p.is_file())
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlockError, match=str(cid)):
        store.get(cid)
    assert store.verify() == [cid]


def test_a_missing_block_names_the_cid(tmp_path):
    cid = cid_for(b"never stored")
    with pytest.raises(BlockNotFoundError, match=str(cid)):
        Blockstore(tmp_path).get(cid)


def test_no_temporary_files_are_left_behind(tmp_path):
    store = Blockstore(tmp_path)
    for i in range(20):
        store.put(bytes([i]) * 100)
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    assert len(list(store)) == 20


def _writer(root: str, seed: int) -> None:
    store = Blockstore(root)
    for i in range(200):
        store.put(f"block {i % 50}".encode() * 50)
        store.put(f"own {seed} {i}".encode())


def test_several_writer_processes_share_one_store(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s)) for s in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = Blockstore(tmp_path)
    assert len(list(store)) == 50 + 3 * 200
    assert store.verify() == []


def test_a_cidv0_and_its_cidv1_name_the_same_stored_block(tmp_path):
    from lineage.store.cid import DAG_PB, as_v1, cid_from_digest

    store = Blockstore(tmp_path)
    block = bytes.fromhex("0a0408021800")  # the empty UnixFS file, QmbFMke1...
    v1 = store.put(block, DAG_PB)
    v0 = cid_from_digest(bytes(v1.raw_digest), DAG_PB, 0)
    assert str(v0) == "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH"
    assert as_v1(v0) == v1 and store.has(v0) and store.get(str(v0)) == block


def test_gc_keeps_everything_a_pin_reaches_and_nothing_else(tmp_path):
    import dag_cbor

    store = Blockstore(tmp_path)
    leaf = store.put(b"leaf")
    root = store.put(dag_cbor.encode({"x": leaf}), DAG_CBOR)
    stray = store.put(b"stray")
    store.pin("run-1", [root])
    assert store.pins() == {"run-1": [root]}
    assert store.gc(grace_s=3600) == []  # everything is young
    assert store.gc(grace_s=0) == [stray]
    assert set(store) == {leaf, root}
    store.unpin("run-1")
    assert sorted(map(str, store.gc(grace_s=0))) == sorted([str(leaf), str(root)])


def test_a_failed_batch_leaves_the_store_unchanged(tmp_path):
    store = Blockstore(tmp_path)
    with pytest.raises(RuntimeError):
        with store.batch() as staged:
            staged.put(b"staged only")
            raise RuntimeError("boom")
    assert list(store) == []
    with store.batch() as staged:
        cid = staged.put(b"committed")
    assert list(store) == [cid] and store.get(cid) == b"committed"
    assert [p.name for p in tmp_path.iterdir()] == [store._path(cid).parent.name]


def test_a_batch_syncs_twice_whatever_its_size_and_fsyncs_no_block(tmp_path, monkeypatch):
    """Bytes durable (one sync) before the renames, names durable (a second) after: a block is
    never under its CID before its bytes are on disk, and no block pays an fsync of its own."""
    import lineage.store.blockstore as blockstore

    events: list[str] = []
    real_sync = blockstore._sync_filesystem

    def sync(fd: int) -> None:  # notes which blocks are under their names when it runs
        events.append(f"sync {sorted(tmp_path.glob('??/b*'))!r}")
        real_sync(fd)

    monkeypatch.setattr(blockstore, "_sync_filesystem", sync)
    monkeypatch.setattr(blockstore.os, "fsync", lambda fd: events.append("fsync"))
    store = Blockstore(tmp_path)
    kept = store.put(b"stored before")  # a durable put: its own fsync
    with store.batch() as staged:
        cids = [staged.put(bytes([i]) * 1000) for i in range(50)]
        assert staged.put(b"stored before") == kept and staged.put(bytes([0]) * 1000) == cids[0]
        assert not any(store.has(c) for c in cids)  # staged: not in the store yet
    assert events == ["fsync", f"sync {[store._path(kept)]!r}", f"sync {sorted(tmp_path.glob('??/b*'))!r}"]
    assert all(store.get(c) == bytes([i]) * 1000 for i, c in enumerate(cids))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # staging removed


def test_blocks_are_never_written_through_a_symlinked_shard(tmp_path):
    from lineage.errors import StorageError

    outside, store = tmp_path / "outside", Blockstore(tmp_path / "store")
    outside.mkdir()
    cid = cid_for(b"escape")
    shard = store._path(cid).parent
    shard.parent.mkdir()
    shard.symlink_to(outside, target_is_directory=True)
    with pytest.raises(StorageError, match="cannot write block"):
        store.put(b"escape")
    with pytest.raises(StorageError, match="cannot move staged blocks"):
        with store.batch() as staged:
            staged.put(b"escape")
    assert list(outside.iterdir()) == []
    assert [p.name for p in store.root.iterdir()] == [shard.name]  # the batch's staging is gone
