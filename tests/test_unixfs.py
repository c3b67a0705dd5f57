"""UnixFS import: our CIDs equal those of independent IPFS implementations.

Oracles (not our code): npm `ipfs-unixfs-importer` with Kubo's settings
(tests/oracles/unixfs_cid.mjs, one node process for the whole module) and Debian's
`ipfs_cid` (its `CIDv0` is plain `ipfs add`). Both are installed by scripts/setup; a
missing oracle fails the test rather than skipping it. Hypothesis picks the sizes, with
every chunk and link-count boundary among its choices; small chunk sizes and widths let
the three-level boundaries be crossed with files of a few KiB.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lineage.errors import CorruptBlockError, StorageError
from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_PB, RAW, parse_cid
from lineage.store.dagpb import T_FILE, PBLink, PBNode, UnixFSData
from lineage.store.unixfs import (
    CHUNK_SIZE,
    MAX_LINKS,
    cat,
    file_cid,
    import_bytes,
    import_file,
    read_file,
)

ROOT = Path(__file__).resolve().parents[1]
ORACLE = ROOT / "tests" / "oracles" / "unixfs_cid.mjs"
IPFS_CID = "/usr/bin/ipfs_cid"
HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


class JsImporter:
    """One long-lived `node unixfs_cid.mjs --serve`: a request per line, a CID per line."""

    def __init__(self) -> None:
        node = shutil.which("node")
        assert node, "node is not installed (scripts/setup installs the oracles)"
        assert (ROOT / "node_modules" / "ipfs-unixfs-importer").is_dir(), \
            "npm ipfs-unixfs-importer is missing: run scripts/setup"
        self.proc = subprocess.Popen([node, str(ORACLE), "--serve"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.calls = 0

    def cid(self, path: Path, cid_version: int = 1, chunk_size: int = CHUNK_SIZE,
            max_links: int = MAX_LINKS) -> str:
        assert self.proc.stdin and self.proc.stdout
        req = {"path": str(path), "cidVersion": cid_version, "chunkSize": chunk_size, "maxLinks": max_links}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        assert "cid" in reply, reply
        self.calls += 1
        return reply["cid"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def js():
    oracle = JsImporter()
    yield oracle
    oracle.close()
    print(f"\ncross-checked {oracle.calls} CIDs with ipfs-unixfs-importer, {IPFS_CID_CALLS[0]} with ipfs_cid")


IPFS_CID_CALLS = [0]


def ipfs_cid_v0(path: Path) -> str:
    IPFS_CID_CALLS[0] += 1
    assert Path(IPFS_CID).exists(), f"{IPFS_CID} is missing: scripts/setup installs Debian's ipfs-cid"
    res = subprocess.run([IPFS_CID, str(path)], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(res.stdout)["CIDv0"]


def _bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _boundaries(chunk: int, links: int, depth: int) -> list[int]:
    """File sizes on both sides of every chunk and link-count boundary up to `depth` levels."""
    sizes = {0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk}
    for d in range(1, depth + 1):
        n = links ** d * chunk
        sizes |= {n - 1, n, n + 1, n + chunk, n + chunk + 1}
    return sorted(s for s in sizes if s >= 0)


KUBO_SIZES = _boundaries(CHUNK_SIZE, MAX_LINKS, 0) + [3 * CHUNK_SIZE + 12345]


@settings(max_examples=20, deadline=None, suppress_health_check=HEALTH)
@given(size=st.one_of(st.sampled_from(KUBO_SIZES), st.integers(0, 4 * CHUNK_SIZE)),
       seed=st.integers(0, 2**32))
def test_kubo_defaults_match_the_js_importer_and_ipfs_cid(js, tmp_path, size, seed):
    path = tmp_path / f"f-{size}-{seed}"
    data = _bytes(size, seed)
    path.write_bytes(data)
    v1, v0 = file_cid(data, 1), file_cid(data, 0)
    assert str(v1) == js.cid(path, 1), size
    assert str(v0) == js.cid(path, 0), size
    assert str(v0) == ipfs_cid_v0(path), size
    assert v1.codec.name == (RAW if size <= CHUNK_SIZE else DAG_PB)


@st.composite
def _shapes(draw):
    chunk = draw(st.integers(1, 64))
    links = draw(st.integers(2, 6))
    size = draw(st.one_of(st.sampled_from(_boundaries(chunk, links, 3)),
                          st.integers(0, links ** 3 * chunk + 3 * chunk)))
    return chunk, links, size


@settings(max_examples=60, deadline=None, suppress_health_check=HEALTH)
@given(shape=_shapes(), version=st.sampled_from([0, 1]), seed=st.integers(0, 2**32))
def test_tree_shape_matches_the_js_importer_at_every_depth(js, tmp_path, shape, version, seed):
    chunk, links, size = shape
    data = _bytes(size, seed)
    path = tmp_path / f"s-{chunk}-{links}-{size}"
    path.write_bytes(data)
    ours = import_bytes(data, cid_version=version, chunk_size=chunk, max_links=links, workers=0).cid
    assert str(ours) == js.cid(path, version, chunk, links), (chunk, links, size)


@pytest.mark.parametrize("leaves", [MAX_LINKS, MAX_LINKS + 1])
def test_a_full_first_level_and_one_more_chunk_match_at_kubo_size(js, tmp_path, leaves):
    """174 chunks (43.5 MiB) is one full interior node; one more chunk adds a level."""
    path = tmp_path / "big"
    data = _bytes(leaves * CHUNK_SIZE - 7, leaves)
    path.write_bytes(data)
    with open(path, "rb") as fh:
        v1 = import_file(fh).cid
    with open(path, "rb") as fh:
        v0 = import_file(fh, cid_version=0).cid
    assert str(v1) == js.cid(path, 1)
    assert str(v0) == js.cid(path, 0) == ipfs_cid_v0(path)


def test_known_cids_of_kubo():
    assert str(file_cid(b"")) == "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"
    assert str(file_cid(b"", 0)) == "QmbFMke1KXqnYyBBWxB74N4c5SBnJMVAiMNRcGu6x1AwQH"
    assert str(file_cid(b"hello", 0)) == "QmWfVY9y3xjsixTgbd9AorQxH7VtMpzfx2HaWtsoUYecaX"


@settings(max_examples=25, deadline=None, suppress_health_check=HEALTH)
@given(size=st.integers(0, 3 * 1024), version=st.sampled_from([0, 1]), seed=st.integers(0, 2**32))
def test_import_then_read_gives_the_same_bytes(tmp_path_factory, size, version, seed):
    store = Blockstore(tmp_path_factory.mktemp("bs"))
    data = _bytes(size, seed)
    res = import_bytes(data, store.put, cid_version=version, chunk_size=100, max_links=3)
    assert res.size == size
    out = io.BytesIO()
    assert read_file(store, res.cid, out) == size
    assert out.getvalue() == data
    assert str(res.cid) == str(import_bytes(data, cid_version=version, chunk_size=100, max_links=3).cid)


def test_a_flipped_bit_in_a_leaf_fails_the_read_naming_the_leaf(tmp_path):
    store = Blockstore(tmp_path)
    data = _bytes(1000, 1)
    root = import_bytes(data, store.put, chunk_size=100, max_links=4).cid
    leaf = PBNode.decode(store.get(root)).links[0].cid
    while leaf.codec.name != RAW:
        leaf = PBNode.decode(store.get(leaf)).links[0].cid
    path = store._path(leaf)
    raw = bytearray(path.read_bytes())
    raw[5] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptBlockError, match=str(leaf)):
        read_file(store, root, io.BytesIO())
    with open(tmp_path / "out", "wb") as fh, pytest.raises(CorruptBlockError, match=str(leaf)):
        read_file(store, root, fh)  # the threads writing at offsets
    assert store.verify() == [leaf]


def test_interior_nodes_carry_filesize_and_blocksizes():
    blocks: dict[str, bytes] = {}

    def put(block, codec):
        from lineage.store.cid import cid_for
        cid = cid_for(block, codec)
        blocks[str(cid)] = block
        return cid

    root = import_bytes(b"x" * 250, put, chunk_size=100).cid
    node = PBNode.decode(blocks[str(root)])
    fs = UnixFSData.decode(node.data or b"")
    assert (fs.filesize, fs.blocksizes, [link.tsize for link in node.links]) == (250, [100, 100, 50], [100, 100, 50])


def test_import_bytes_hands_its_whole_chunks_to_put_without_copying_them():
    from lineage.store.cid import cid_for

    data, leaves = random.Random(4).randbytes(3 * 100 + 7), []

    def put(block, codec):
        if codec == RAW:
            leaves.append(block)
        return cid_for(block, codec)

    import_bytes(data, put, chunk_size=100, workers=0)
    whole = [leaf for leaf in leaves if len(leaf) == 100]
    assert len(whole) == 3 and all(isinstance(leaf, memoryview) and leaf.obj is data for leaf in whole)
    assert b"".join(leaves) == data


@settings(max_examples=15, deadline=None, suppress_health_check=HEALTH)
@given(size=st.integers(0, 3 * 1024), version=st.sampled_from([0, 1]), seed=st.integers(0, 2**32))
def test_read_file_into_a_file_writes_each_leaf_at_its_offset(tmp_path_factory, size, version, seed):
    """Into a regular file, threads write the leaves at their offsets, after what the file
    already holds; `check_file` re-hashes the same blocks without writing them."""
    from lineage.store.unixfs import check_file

    tmp = tmp_path_factory.mktemp("rf")
    store, data = Blockstore(tmp / "bs"), _bytes(size, seed)
    root = import_bytes(data, store.put, cid_version=version, chunk_size=100, max_links=3).cid
    with open(tmp / "out", "wb") as fh:
        fh.write(b"head")
        assert read_file(store, root, fh) == size
        fh.write(b"tail")
    assert (tmp / "out").read_bytes() == b"head" + data + b"tail"
    assert check_file(store, root) == check_file(store, root, workers=0) == size


class _Trickle(io.RawIOBase):
    """A stream that answers each read with at most the next of `sizes` bytes (then with
    1 to 300), as a pipe may."""

    def __init__(self, data: bytes, seed: int, sizes: tuple[int, ...] = ()) -> None:
        self._data, self._pos, self._rng, self._sizes = data, 0, random.Random(seed), list(sizes)

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        want = self._sizes.pop(0) if self._sizes else self._rng.randint(1, 300)
        n = min(len(buf), want, len(self._data) - self._pos)
        buf[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


@settings(max_examples=15, deadline=None)
@given(size=st.integers(0, 5_000), seed=st.integers(0, 2**32))
def test_import_file_reads_whole_and_short_chunks_into_its_ring_of_buffers(size, seed):
    """Full reads are stored from the ring's buffers, short ones copied; a buffer is reused
    only once its leaf is stored, whatever mix of reads the stream gives."""
    data = _bytes(size, seed)
    expected = import_bytes(data, chunk_size=100, max_links=3, workers=0).cid
    assert import_file(_Trickle(data, seed), chunk_size=100, max_links=3).cid == expected
    assert import_file(io.BytesIO(data), chunk_size=100, max_links=3).cid == expected


def test_a_ring_buffer_is_read_into_again_only_once_its_leaf_is_stored():
    """A whole chunk, then reads too short to make a leaf: the ring comes round to the
    chunk's buffer while a slow store still holds its leaf."""
    import time

    from lineage.store.cid import cid_for

    data = _bytes(100 + 60, 7)

    def slow_put(block, codec):
        if bytes(block[:100]) == data[:100]:
            time.sleep(0.2)
        return cid_for(block, codec)

    stream = _Trickle(data, 0, (100, *[1] * 60))
    assert import_file(stream, slow_put, chunk_size=100, workers=2).cid == import_bytes(data, chunk_size=100).cid


def _two_leaf_file(store, first: bytes, second: bytes, blocksizes: list[int]):
    links = [PBLink(store.put(leaf), len(leaf)) for leaf in (first, second)]
    node = UnixFSData(T_FILE, None, sum(blocksizes) if blocksizes else len(first + second), blocksizes)
    return store.put(PBNode(node.encode(), links).encode(), DAG_PB)


def test_a_leaf_longer_than_its_parent_says_fails_the_read_naming_it(tmp_path):
    store = Blockstore(tmp_path / "bs")
    root = _two_leaf_file(store, b"12345", b"678901", [5, 5])
    with open(tmp_path / "out", "wb") as fh, pytest.raises(StorageError, match="holds 6 bytes, its parent says 5"):
        read_file(store, root, fh)


def test_a_node_without_blocksizes_is_refused_before_its_leaves_are_read(tmp_path):
    """Issue 34: without one `blocksizes` entry per link (as every UnixFS writer records
    them) a reader could not bound what the children hold."""
    store = Blockstore(tmp_path / "bs")
    root = _two_leaf_file(store, b"12345", b"678901", [])
    for read in (lambda: read_file(store, root, open(tmp_path / "out", "wb")), lambda: b"".join(cat(store, root))):
        with pytest.raises(StorageError, match=f"{root}: 2 links but blocksizes"):
            read()


def test_a_directory_is_not_read_as_a_file(tmp_path):
    store = Blockstore(tmp_path)
    cid = store.put(PBNode(UnixFSData(1).encode()).encode(), DAG_PB)
    with pytest.raises(StorageError, match="directory"):
        read_file(store, parse_cid(str(cid)), io.BytesIO())


@pytest.mark.slow
def test_importing_1_gib_streams_in_under_64_mib(tmp_path):
    """Compute-only import of a 1 GiB stream, in a fresh process; peak RSS is measured."""
    script = textwrap.dedent("""
        import resource, sys
        from lineage.store.unixfs import CHUNK_SIZE, FileImporter
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        imp = FileImporter()
        piece = bytearray(CHUNK_SIZE)
        for i in range(4096):  # 4096 x 256 KiB = 1 GiB, every chunk distinct
            piece[:8] = i.to_bytes(8, "little")
            imp.write(bytes(piece))
        res = imp.finish()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(res.cid, res.size, (peak - base) * 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=600, check=True).stdout.split()
    assert int(out[1]) == 1 << 30
    extra = int(out[2])
    assert extra < 64 << 20, f"importing 1 GiB took {extra / 2**20:.1f} MiB extra"
