"""The importer's fast paths write exactly the bytes of the general encoders.

A file import works on binary CIDs (no CID object per block), frames a CIDv0 leaf around
its chunk with one copy, and encodes its file nodes from binary CIDs
(lineage/store/dagpb.py `file_leaf`, `file_node`). A CID is the hash of those bytes, so
each fast path is held here to `PBNode`/`UnixFSData`, and a store's `put_binary` to its `put`.
"""

from __future__ import annotations

import io

from hypothesis import given, settings
from hypothesis import strategies as st

from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_PB, RAW, binary_cid_of_block, cid_of_block, relabel_v0
from lineage.store.dagpb import T_FILE, PBLink, PBNode, UnixFSData, file_leaf, file_node
from lineage.store.unixfs import import_bytes, import_file


@settings(max_examples=60, deadline=None)
@given(chunk=st.binary(max_size=300) | st.sampled_from([b"", b"\0" * 262_144]))
def test_file_leaf_equals_the_general_encoding(chunk):
    general = PBNode(UnixFSData(T_FILE, chunk, len(chunk)).encode()).encode()
    assert file_leaf(chunk) == file_leaf(memoryview(chunk)) == general


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)), min_size=1, max_size=174),
       codec=st.sampled_from([RAW, DAG_PB]))
def test_file_node_equals_the_general_encoding(sizes, codec):
    cids = [cid_of_block(i.to_bytes(4, "big"), codec) for i in range(len(sizes))]
    links = [(bytes(cid), tsize, size) for cid, (tsize, size) in zip(cids, sizes, strict=True)]
    filesizes = [size for _, size in sizes]
    general = PBNode(UnixFSData(T_FILE, None, sum(filesizes), filesizes).encode(),
                     [PBLink(cid, tsize) for cid, (tsize, _) in zip(cids, sizes, strict=True)]).encode()
    assert file_node(links) == general


def test_binary_cids_and_v0_relabelling():
    block = b"a dag-pb block"
    cid = cid_of_block(block, DAG_PB)
    assert binary_cid_of_block(block, DAG_PB) == bytes(cid)
    assert binary_cid_of_block(memoryview(block), RAW) == bytes(cid_of_block(block, RAW))
    v0 = relabel_v0(bytes(cid))
    assert v0 == b"\x12\x20" + bytes(cid.raw_digest) and relabel_v0(v0) == v0


def test_put_binary_is_put(tmp_path):
    store = Blockstore(tmp_path / "blocks")
    raw = store.put_binary(b"leaf")
    assert raw == bytes(store.put(b"leaf")) and store.get(raw) == b"leaf"
    with store.batch() as staged:
        raw = staged.put_binary(b"staged", DAG_PB)
        assert not store.has(cid_of_block(b"staged", DAG_PB))
    assert store.get(raw) == b"staged"


class _Recording:
    """A put that is no Blockstore's: the importer takes its CIDs as they come."""

    def __init__(self, store: Blockstore) -> None:
        self.store, self.calls = store, 0

    def put(self, data, codec=RAW):
        self.calls += 1
        return self.store.put(bytes(data), codec)


def test_any_put_and_a_blockstores_put_give_one_dag(tmp_path):
    data = bytes(range(256)) * 4_000  # 4 chunks of 256 KiB
    for options in ({"cid_version": 1}, {"cid_version": 0}, {"cid_version": 1, "raw_leaves": False}):
        direct = Blockstore(tmp_path / f"a{len(options)}{options['cid_version']}")
        other = _Recording(Blockstore(tmp_path / f"b{len(options)}{options['cid_version']}"))
        with direct.batch() as staged:
            fast = import_file(io.BytesIO(data), staged.put, chunk_size=65_536, max_links=3, **options)
        slow = import_bytes(data, other.put, chunk_size=65_536, max_links=3, **options)
        assert (fast.cid, fast.size, fast.blocks, fast.dag_size) == (slow.cid, slow.size, slow.blocks, slow.dag_size)
        assert other.calls == slow.blocks
        assert sorted(map(str, direct)) == sorted(map(str, other.store))
