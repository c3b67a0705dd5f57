"""UnixFS files: import bytes into a DAG with the same CIDs as Kubo, and read them back.

    from lineage.store.unixfs import import_file, cat
    root = import_file(open("ckpt.safetensors", "rb"), store.put).cid   # == `ipfs add --cid-version=1`
    data = b"".join(cat(store, root))

The layout is Kubo's default (go-unixfs `importer/balanced`): the file is cut into fixed
256 KiB chunks; leaves are `raw` blocks for CIDv1 (`--raw-leaves`, implied by
`--cid-version=1`) or dag-pb UnixFS `File` nodes for CIDv0 (plain `ipfs add`); interior
nodes are dag-pb UnixFS `File` nodes with `filesize` and one `blocksizes` entry per link,
at most 174 links each, and the tree is filled left to right, each subtree full before the
next starts. A file of one chunk (or none: the empty file) is its single leaf.

Import streams: it keeps one chunk and at most 174 pending links per tree level, so its
extra memory does not grow with the file. dag-pb and UnixFS protobufs are encoded by hand
(lineage/store/dagpb.py), byte for byte as Go's `go-merkledag` and JS's `@ipld/dag-pb` do,
because the CID is the hash of exactly those bytes.
A chunk is hashed and written from the buffer it was read into (a memoryview of the caller's
bytes for `import_bytes`), never copied on the way.

Reading back re-hashes every block. Into a regular file (`read_file`, so `dlx cas get -o`)
the dag-pb nodes are walked first (one per 174 leaves) to place every raw leaf at its
offset, then a few threads each fetch, hash and write their share of the leaves: handing
each block from a reading thread to a writing one cost more than hashing it. Into a
stream (`cat`, a pipe) the leaves are read ahead in order.
"""

from __future__ import annotations

import fcntl
import io
import itertools
import os
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

from multiformats import CID

from lineage.errors import BlockNotFoundError, StorageError

from .cid import (
    DAG_PB,
    RAW,
    binary_cid_of_block,
    cid_from_binary,
    cid_from_digest,
    digest_of,
    file_cid_candidates,
    parse_cid,
    relabel_v0,
)
from .dagpb import (
    T_DIRECTORY,
    T_FILE,
    T_HAMT,
    T_RAW,
    T_SYMLINK,
    UnixFSData,
    file_leaf,
    file_node,
    pb_fields,
)
from .limits import max_depth, max_in_memory

CHUNK_SIZE = 262_144  # Kubo's default chunker: size-262144
MAX_LINKS = 174  # go-unixfs helpers.DefaultLinksPerBlock

#: Stores a block (`bytes`, or a `memoryview` of immutable bytes) under a codec; returns its CIDv1.
PutFn = Callable[[bytes | memoryview, str], CID]


class BlockReader(Protocol):
    """What reading needs from a store (`Blockstore`, `IpfsStore`): re-hashed blocks, by CID,
    CID text or binary CID (what a dag-pb link holds)."""

    def get(self, cid: CID | str | bytes) -> bytes: ...

    def has(self, cid: CID | str) -> bool: ...


# -- import ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportResult:
    cid: CID
    size: int  # file bytes
    blocks: int  # blocks written (with repeats)
    dag_size: int = 0  # every block of the DAG: a directory link's Tsize (Kubo's node.Size())


#: A link below the root: (binary CID, Tsize: the block and everything below it, file bytes below it).
_Link = tuple[bytes, int, int]


def _binary_put(put: PutFn | None) -> Callable[[bytes | memoryview, str], bytes]:
    """`put` as a function returning binary CIDs: a store's own `put_binary` where `put` is
    a `Blockstore`'s `put` (no CID object per block), `put`'s CID as bytes otherwise."""
    if put is None:
        return binary_cid_of_block
    owner = getattr(put, "__self__", None)
    if getattr(put, "__name__", None) == "put" and callable(fast := getattr(owner, "put_binary", None)):
        return fast
    return lambda data, codec: bytes(put(data, codec))


class FileImporter:
    """Feed bytes with `write`, get the root with `finish`; blocks go to `put(data, codec)`.

    `put` returns the block's CIDv1 (it hashes the block, so nothing is hashed twice);
    with `cid_version=0` the importer re-labels it as the CIDv0 of the same digest.
    Leaves are hashed and stored in a small thread pool (hashlib and file writes release
    the GIL); at most `2 * workers` chunks are in flight.
    """

    def __init__(
        self,
        put: PutFn | None = None,
        *,
        cid_version: int = 1,
        raw_leaves: bool | None = None,
        chunk_size: int = CHUNK_SIZE,
        max_links: int = MAX_LINKS,
        workers: int = 4,
    ) -> None:
        if cid_version not in (0, 1):
            raise ValueError(f"cid_version must be 0 or 1, got {cid_version}")
        if chunk_size < 1 or max_links < 2:
            raise ValueError(f"need chunk_size >= 1 and max_links >= 2, got {chunk_size}, {max_links}")
        self._put = _binary_put(put)
        self.cid_version = cid_version
        self.raw_leaves = cid_version == 1 if raw_leaves is None else raw_leaves
        if self.raw_leaves and cid_version == 0:
            raise ValueError("raw leaves need CIDv1")
        self.chunk_size = chunk_size
        self.max_links = max_links
        self._buf = bytearray()
        self._levels: list[list[_Link]] = [[]]
        self._leaves = 0
        self._size = 0
        self._blocks = 0
        self._pool = ThreadPoolExecutor(max_workers=workers) if workers > 0 else None
        self._inflight: deque[Future[_Link]] = deque()
        self._max_inflight = 2 * max(workers, 1)
        self._done = False

    def _store(self, block: bytes | memoryview, codec: str) -> bytes:
        raw = self._put(block, codec)
        self._blocks += 1
        return relabel_v0(raw) if self.cid_version == 0 else raw

    def _leaf(self, chunk: bytes | memoryview) -> _Link:
        if self.raw_leaves:
            return self._store(chunk, RAW), len(chunk), len(chunk)
        block = file_leaf(chunk)
        return self._store(block, DAG_PB), len(block), len(chunk)

    def _parent(self, links: list[_Link]) -> _Link:
        block = file_node(links)
        return (self._store(block, DAG_PB), len(block) + sum(tsize for _, tsize, _ in links),
                sum(size for _, _, size in links))

    def _add(self, level: int, link: _Link) -> None:
        # A full group becomes a parent at once: exactly the batches of the balanced layout.
        while True:
            if level == len(self._levels):
                self._levels.append([])
            self._levels[level].append(link)
            if len(self._levels[level]) < self.max_links:
                return
            link = self._parent(self._levels[level])
            self._levels[level] = []
            level += 1

    def _drain(self, keep: int) -> None:
        while len(self._inflight) > keep:
            self._add(0, self._inflight.popleft().result())

    def _emit(self, chunk: bytes | memoryview) -> Future[_Link] | None:
        """Make `chunk` a leaf; returns the leaf's future while the pool may still be at it."""
        self._leaves += 1
        if self._pool is None:
            self._add(0, self._leaf(chunk))
            return None
        fut = self._pool.submit(self._leaf, chunk)
        self._inflight.append(fut)
        self._drain(self._max_inflight)
        return fut

    def write(self, data: bytes | memoryview) -> None:
        """Feed the file's next bytes (any length). A whole chunk given as `bytes` is
        stored as it is; one in any other buffer is copied (the caller may reuse it)."""
        self._feed(data, borrowed=not isinstance(data, bytes))

    def _feed(self, data: bytes | memoryview, borrowed: bool) -> Future[_Link] | None:
        """`write`; `borrowed=False` promises that `data` does not change until its leaf is
        stored, so a whole chunk of it is stored without a copy: then the leaf's future is
        returned if the pool may still be at it (`import_file` waits on it before it reads
        into the same buffer again)."""
        if self._done:
            raise ValueError("write after finish")
        self._size += len(data)
        if not self._buf and len(data) == self.chunk_size:
            return self._emit(bytes(data) if borrowed else data)
        self._buf += data
        while len(self._buf) >= self.chunk_size:
            self._emit(bytes(self._buf[:self.chunk_size]))
            del self._buf[:self.chunk_size]
        return None

    def finish(self) -> ImportResult:
        try:
            if self._buf or self._leaves == 0:  # the empty file is one empty leaf
                self._emit(bytes(self._buf))
                self._buf = bytearray()
            self._drain(0)
        finally:
            self.close()
        # Close the partial group of each level, bottom up; the last lone node is the root.
        level = 0
        while True:
            pending = self._levels[level]
            top = all(not rest for rest in self._levels[level + 1:])
            if top and len(pending) == 1:
                root = pending[0]
                break
            if pending:
                parent = self._parent(pending)
                self._levels[level] = []
                if level + 1 == len(self._levels):
                    self._levels.append([])
                self._levels[level + 1].append(parent)
            level += 1
        self._done = True
        cid = cid_from_binary(root[0]) if self.cid_version == 1 else cid_from_digest(root[0][2:], DAG_PB, 0)
        return ImportResult(cid, self._size, self._blocks, root[1])

    def close(self) -> None:
        if self._pool is not None:
            for fut in self._inflight:
                fut.cancel()
            self._pool.shutdown(wait=True)
            self._pool = None


def import_file(fh: BinaryIO, put: PutFn | None = None, **options: int | bool | None) -> ImportResult:
    """Import a binary stream; see `FileImporter`. It is read a chunk at a time into a ring
    of buffers, one per leaf in flight and one more, rather than into a new bytes object per
    chunk (each of those a fresh allocation the kernel zero-fills page by page); a buffer is
    read into again once the leaf made of it is stored."""
    imp = FileImporter(put, **options)  # type: ignore[arg-type]
    ring: list[tuple[bytearray, Future[_Link] | None]] = [
        (bytearray(imp.chunk_size), None) for _ in range(imp._max_inflight + 1)]
    try:
        for i in itertools.count():
            buf, leaf = ring[i % len(ring)]
            if leaf is not None:
                leaf.result()
            n = fh.readinto(buf)  # type: ignore[attr-defined]
            if not n:
                break
            ring[i % len(ring)] = (buf, imp._feed(memoryview(buf)[:n], borrowed=False))
    except BaseException:
        imp.close()
        raise
    return imp.finish()


def import_bytes(data: bytes, put: PutFn | None = None, **options: int | bool | None) -> ImportResult:
    """Import bytes held in memory; see `FileImporter`."""
    if len(data) <= int(options.get("chunk_size") or CHUNK_SIZE):
        options.setdefault("workers", 0)  # one block: no thread pool
    imp = FileImporter(put, **options)  # type: ignore[arg-type]
    view, borrowed = memoryview(data), not isinstance(data, bytes)
    try:
        for pos in range(0, len(data), imp.chunk_size):  # chunks of `bytes` are not copied
            imp._feed(view[pos:pos + imp.chunk_size], borrowed)
    except BaseException:
        imp.close()
        raise
    return imp.finish()


def file_cid(data: bytes, cid_version: int = 1) -> CID:
    """The CID `ipfs add` (`--cid-version=1` for version 1) gives `data`; stores nothing."""
    return import_bytes(data, cid_version=cid_version, workers=0).cid


def shard_digest(data: bytes) -> bytes:
    """The digest a node co-signs for a stage shard's bytes: its UnixFS file CID's sha-256,
    as the manifest links the shard (nothing is stored). Re-exported by
    lineage.chain.attest; it lives here because ranks call it (`RankControl.shard_digest`)
    and unpickling it from here costs them no eth_account import (0.8 s a process)."""
    return digest_of(file_cid(data))


# -- read back -------------------------------------------------------------------------------

_READ_POOL: ThreadPoolExecutor | None = None
_READ_POOL_LOCK = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    """One read-ahead pool for every `cat`: starting threads per file cost more than
    hashing a small file."""
    global _READ_POOL
    with _READ_POOL_LOCK:
        if _READ_POOL is None:
            _READ_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="unixfs-read")
        return _READ_POOL


def cat(store: BlockReader, root: CID | str, *, workers: int = 4) -> Iterator[bytes]:
    """The bytes of the UnixFS file `root`, in order; every block is re-hashed by `store.get`.

    Reads any UnixFS file DAG (any chunking, width, raw or dag-pb leaves), not only ours.
    Raw leaves are read ahead on a shared thread pool, at most `2 * workers` blocks at a time
    (`workers=0`: none, every block read in this thread).
    """
    return _cat(store, parse_cid(root), workers, [])


_CODEC_NAMES = {0x55: RAW, 0x70: DAG_PB}


def _codec_name(ref: CID | bytes) -> str:
    """The codec of a CID or of a link's binary CID (ours without building a CID object)."""
    if isinstance(ref, bytes):
        if len(ref) > 2 and ref[0] == 1 and ref[1] in _CODEC_NAMES:
            return _CODEC_NAMES[ref[1]]
        ref = parse_cid(ref)
    return ref.codec.name


def _node_links(block: bytes) -> tuple[bytes | None, list[bytes]]:
    """A dag-pb node's Data and its links' binary CIDs, in order (the read path: names and
    sizes are not needed, and building a CID object per link cost more than the hashing)."""
    data, links = None, []
    for num, value in pb_fields(block):
        if num == 1 and isinstance(value, bytes):
            data = value
        elif num == 2 and isinstance(value, bytes):
            cid = None
            for lnum, lval in pb_fields(value):
                if lnum == 1 and isinstance(lval, bytes):
                    cid = lval
            if cid is None:
                raise ValueError("dag-pb link without a Hash")
            links.append(cid)
        else:
            raise ValueError(f"unexpected dag-pb field {num}")
    return data, links


def _file_node(ref: CID | bytes, block: bytes) -> tuple[UnixFSData, list[bytes]]:
    """A dag-pb UnixFS file node's data and its links' binary CIDs; anything else is an error
    naming the block."""
    codec = _codec_name(ref)
    cid = parse_cid(ref)  # only dag-pb nodes (one per 174 leaves) and errors name it
    if codec != DAG_PB:
        raise StorageError(f"{cid} is {codec}, not a UnixFS file")
    try:
        data, links = _node_links(block)
        fs = UnixFSData.decode(data or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise StorageError(f"{cid} is not a UnixFS node: {exc}") from None
    if fs.type not in (T_FILE, T_RAW):
        kind = {T_DIRECTORY: "a directory", T_HAMT: "a sharded directory", T_SYMLINK: "a symlink"}
        raise StorageError(f"{cid} is {kind.get(fs.type, f'UnixFS type {fs.type}')}, not a file")
    return fs, links


def _sized_children(ref: CID | bytes, fs: UnixFSData, links: list[bytes], expected: int | None,
                    depth: int) -> list[tuple[bytes, int]]:
    """The links of a file node with the bytes each must hold, checked against what the node
    and its parent declare before any child is read: its `filesize` (what the parent's
    `blocksizes` entry says, for a child), one non-zero `blocksizes` entry per link, its
    data and children adding up to its filesize, and the walk no deeper than the limit. So a
    file never yields more than its root declares, and a hostile DAG is refused at its
    first lie, not after reading it all."""
    if fs.filesize is None:
        raise StorageError(f"{parse_cid(ref)}: a UnixFS file node without a filesize")
    if expected is not None and fs.filesize != expected:
        raise StorageError(f"{parse_cid(ref)} declares {fs.filesize} bytes, its parent says {expected}")
    if links and depth >= max_depth():
        raise StorageError(f"{parse_cid(ref)}: the file's DAG is deeper than {max_depth()} levels "
                           "($DLX_MAX_DAG_DEPTH)")
    if len(fs.blocksizes) != len(links) or 0 in fs.blocksizes:
        raise StorageError(f"{parse_cid(ref)}: {len(links)} links but blocksizes {fs.blocksizes[:8]}"
                           f"{'...' if len(fs.blocksizes) > 8 else ''}")
    held = len(fs.data or b"") + sum(fs.blocksizes)
    if held != fs.filesize:
        raise StorageError(f"{parse_cid(ref)}: its data and blocksizes add up to {held} bytes, "
                           f"its filesize says {fs.filesize}")
    return list(zip(links, fs.blocksizes, strict=True))


def _leaf(store: BlockReader, link: bytes, size: int) -> bytes:
    """A raw leaf, which must hold the `size` bytes its parent declares."""
    block = store.get(link)
    if len(block) != size:
        raise StorageError(f"{parse_cid(link)} holds {len(block)} bytes, its parent says {size}")
    return block


def _cat(store: BlockReader, root: CID, workers: int, sizes: list[int]) -> Iterator[bytes]:
    """`cat`; appends the root's UnixFS filesize to `sizes`."""
    stack: list[Iterator[tuple[bytes, int]]] = []

    def visit(ref: CID | bytes, expected: int | None) -> Iterable[bytes]:
        fs, links = _file_node(ref, store.get(ref))
        if not stack and fs.filesize is not None:
            sizes.append(fs.filesize)
        stack.append(iter(_sized_children(ref, fs, links, expected, len(stack))))
        return [fs.data] if fs.data else []

    if root.codec.name == RAW:  # a file of one chunk
        yield store.get(root)
        return
    pool = _read_pool() if workers > 0 else None
    ahead: deque[Future[bytes]] = deque()
    try:
        yield from visit(root, None)
        while stack:
            link, size = next(stack[-1], (b"", 0))
            if not link:
                stack.pop()
                continue
            if _codec_name(link) == RAW:
                if pool is None:
                    yield _leaf(store, link, size)
                    continue
                ahead.append(pool.submit(_leaf, store, link, size))
                while len(ahead) > 2 * workers:
                    yield ahead.popleft().result()
                continue
            while ahead:
                yield ahead.popleft().result()
            yield from visit(link, size)
        while ahead:
            yield ahead.popleft().result()
    finally:
        for fut in ahead:  # stopped early: what has not started yet never will
            fut.cancel()


def _read(store: BlockReader, root: CID | str, write: Callable[[bytes], Any], workers: int = 4) -> int:
    root = parse_cid(root)
    written = 0
    sizes: list[int] = []  # _cat fills in the root's declared size
    for piece in _cat(store, root, workers, sizes):
        write(piece)
        written += len(piece)
    if sizes and sizes[0] != written:
        raise StorageError(f"{root}: the DAG holds {written} bytes, its root says {sizes[0]}")
    return written


@dataclass
class _Layout:
    """Where the pieces of a file go: `inline` data (read while walking, with its offset),
    raw `leaves` still to fetch (offset, binary CID, size), the total `size` and the size
    the root declares (`filesize`, None if it has none)."""

    inline: list[tuple[int, bytes]] = field(default_factory=list)
    leaves: list[tuple[int, bytes, int]] = field(default_factory=list)
    size: int = 0
    filesize: int | None = None

    def add(self, data: bytes) -> None:
        if data:
            self.inline.append((self.size, data))
            self.size += len(data)


def _layout(store: BlockReader, root: CID) -> _Layout:
    """Walk the file `root`'s dag-pb nodes (one per 174 leaves), in file order, and lay out
    its pieces. A raw leaf's size is its parent's `blocksizes` entry (checked when it is
    fetched); every node is checked by `_sized_children` before its children are."""
    out = _Layout()
    if root.codec.name == RAW:  # a file of one chunk
        out.add(store.get(root))
        return out
    stack: list[Iterator[tuple[bytes, int]]] = []

    def enter(ref: CID | bytes, expected: int | None) -> None:
        fs, links = _file_node(ref, store.get(ref))
        if not stack:
            out.filesize = fs.filesize
        children = _sized_children(ref, fs, links, expected, len(stack))
        out.add(fs.data or b"")
        stack.append(iter(children))

    enter(root, None)
    while stack:
        link, size = next(stack[-1], (b"", 0))
        if not link:
            stack.pop()
        elif _codec_name(link) != RAW:
            enter(link, size)
        else:
            out.leaves.append((out.size, link, size))
            out.size += size
    return out


def _read_at(store: BlockReader, root: CID | str, place: Callable[[int, bytes], Any], workers: int) -> int:
    """Read the file `root`, handing every piece to `place(offset, piece)` (from several
    threads, in no set order); returns its size, checked against the root's filesize.
    Raw leaves are fetched (so re-hashed) by `workers` threads of the shared read pool, each
    taking every `workers`-th leaf, so each one hashes and places its own (0: all fetched
    in this thread). No thread hands blocks to another: that cost more than the hashing."""
    root = parse_cid(root)
    layout = _layout(store, root)
    if layout.filesize is not None and layout.filesize != layout.size:
        raise StorageError(f"{root}: the DAG holds {layout.size} bytes, its root says {layout.filesize}")
    for offset, data in layout.inline:
        place(offset, data)
    stop = threading.Event()

    def fetch(leaves: list[tuple[int, bytes, int]]) -> None:
        try:
            for offset, link, size in leaves:
                if stop.is_set():
                    return
                place(offset, _leaf(store, link, size))
        except BaseException:
            stop.set()  # the other threads stop at their next leaf
            raise

    n = min(workers, len(layout.leaves))
    if n <= 1:
        fetch(layout.leaves)
    else:
        futures = [_read_pool().submit(fetch, layout.leaves[i::n]) for i in range(n)]
        wait(futures)  # every thread done before an error is raised: none places after it
        for fut in futures:
            fut.result()
    return layout.size


def _positional_fd(out: BinaryIO) -> int | None:
    """`out`'s descriptor if pieces can be written at offsets: a regular file, not opened to
    append (Linux's pwrite appends there whatever the offset)."""
    try:
        fd = out.fileno()
        if not out.seekable() or not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return None if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND else fd
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None


def read_file(store: BlockReader, root: CID | str, out: BinaryIO) -> int:
    """Write the file `root` to `out` at its current position; returns its size, checked
    against the root's filesize. Into a regular file, threads fetch, re-hash and write the
    leaves at their offsets (`_read_at`); into a pipe or a buffer, in order (`cat`)."""
    fd = _positional_fd(out)
    if fd is None:
        return _read(store, root, out.write)
    out.flush()
    base = out.tell()

    def place(offset: int, piece: bytes) -> None:
        view, pos = memoryview(piece), base + offset
        while view:
            written = os.pwrite(fd, view, pos)
            view, pos = view[written:], pos + written

    size = _read_at(store, root, place, 4)
    out.seek(base + size)
    return size


def check_file(store: BlockReader, root: CID | str, *, workers: int = 4) -> int:
    """Fetch (so re-hash) every block of the file `root` without keeping its bytes; returns
    its size, checked against the root's filesize. `workers`: threads fetching leaves (0:
    all in this thread, for a caller that runs many files in a pool of its own)."""
    return _read_at(store, root, lambda offset, piece: None, workers)


def resolve_file_digest(store: BlockReader, digest: bytes) -> CID:
    """The CID of the UnixFS file whose root has this sha2-256 digest, as held by `store`.

    Tries raw (a file of at most one chunk) then dag-pb; see `lineage.store.cid` for why both.
    """
    for cid in file_cid_candidates(digest):
        if store.has(cid):
            return cid
    raise BlockNotFoundError(f"raw or dag-pb block with sha2-256 {digest.hex()}")



def read_bytes(store: BlockReader, root: CID | str, *, workers: int = 4) -> bytes:
    """The whole file `root` in memory (shards and contributions), checked as `read_file`
    does; `workers` as for `check_file`. A root declaring more than `limits.max_in_memory()`
    bytes is refused before any leaf is read."""
    root = parse_cid(root)
    if root.codec.name == DAG_PB:
        fs, _ = _file_node(root, store.get(root))
        if fs.filesize is not None and fs.filesize > max_in_memory():
            raise StorageError(f"{root} declares {fs.filesize} bytes, more than the {max_in_memory()} read into "
                               "memory ($DLX_MAX_FILE_IN_MEMORY)")
    pieces: list[bytes] = []
    _read(store, root, pieces.append, workers)
    return b"".join(pieces)  # one copy of the file, not two as through a BytesIO
