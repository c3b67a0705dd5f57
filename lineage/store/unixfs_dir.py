"""UnixFS directories: import a tree with the root CID Kubo's `ipfs add -r` gives, read it back.

    from lineage.store.unixfs_dir import import_directory, import_tree, read_tree
    root = import_directory(Path("dataset"), store.put)        # == `ipfs add -r --cid-version=1 dataset`
    root = import_tree([("a/b.txt", b"hi"), ("c.bin", Path("c.bin"))])  # CIDs only, nothing stored
    read_tree(store, root, Path("restored"))

Files are imported as `lineage.store.unixfs` does (`--cid-version=1`: raw leaves; version 0:
plain `ipfs add`). A directory is a dag-pb node whose Data is UnixFS `Directory` and whose
links, sorted by name bytes, each carry the child's cumulative size (Tsize: the child's
block plus everything below it, Kubo's `node.Size()`).

Sharding, as boxo's `io.DynamicDirectory` (Kubo's MFS, hence `ipfs add`) decides it: a
directory whose estimated size, the sum over its entries of the name's UTF-8 length plus
the child CID's byte length ("links" estimation, Kubo's default
`Import.UnixFSHAMTDirectorySizeEstimation`), exceeds 256 KiB becomes a HAMT: UnixFS
`HAMTShard` nodes of fanout 256, hash type 0x22 (murmur3-x64-64, the first 64 bits of
murmur3-x64-128 with seed 0, big-endian, as go's `spaolacci/murmur3` New64 gives them).
Each name's hash is read a byte at a time (one byte per level); a slot holding one entry
links it as `%02X` + name, a slot holding several links a child shard named `%02X`. The
Data field's bitfield is big-endian with leading zero bytes dropped (go-bitfield `Bytes`).
Current boxo converts when the estimate is strictly above the threshold (`>`), as
`ipfs-unixfs-importer` does; older boxo releases compared with `>=`, which differs only
for a directory whose estimate is exactly 262,144 bytes. Subdirectories count
in their parent's estimate as files do (MFS links an empty child directory at once).

On disk (`import_directory`): hidden entries (a name starting with ".") are skipped, as
`ipfs add -r` does without `--hidden`; symlinks and special files are refused with a clear
error (Kubo would store a symlink as a UnixFS `Symlink` node, which restoring would then
have to trust); empty directories are kept. Names must be valid UTF-8.

Reading (`list_tree`, `read_tree`, `is_directory`) follows plain and sharded directories of
any writer; every block read is re-hashed by `store.get`, and a name that could escape the
output directory (`..`, `/`, empty) is an error naming the directory's CID.
"""

from __future__ import annotations

import os
import secrets
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from multiformats import CID

from lineage.errors import StorageError
from trainer.errors import DlxError

from .cid import DAG_PB, RAW, cid_from_digest, cid_of_block, parse_cid
from .dagpb import T_DIRECTORY, T_FILE, T_HAMT, T_RAW, PBLink, PBNode, UnixFSData
from .limits import max_depth, max_entries
from .unixfs import CHUNK_SIZE, BlockReader, PutFn, import_bytes, import_file, read_file

__all__ = ["HAMT_FANOUT", "HAMT_THRESHOLD", "TreeInputError", "import_directory", "import_tree",
           "is_directory", "list_tree", "murmur3_x64_64", "read_tree"]

HAMT_THRESHOLD = 262_144  # boxo io.HAMTShardingSize, Kubo's Import.UnixFSHAMTDirectorySizeThreshold
HAMT_FANOUT = 256  # boxo io.DefaultShardWidth
HAMT_HASH = 0x22  # multicodec murmur3-x64-64
_PAD = len(f"{HAMT_FANOUT - 1:X}")  # shard slot prefix width: 2 hex digits
_TMP = ".dlx-tmp"


class TreeInputError(DlxError, ValueError):
    """The tree given to import cannot be imported as is: a bad or duplicate path, a
    symlink, a special file, an unreadable file, a name that is not UTF-8."""


# -- murmur3 ---------------------------------------------------------------------------------

_M64 = (1 << 64) - 1
_C1, _C2 = 0x87C37B91114253D5, 0x4CF5AD432745937F


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _fmix(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _M64
    return k ^ (k >> 33)


def _mix_k1(k1: int) -> int:
    return (_rotl((k1 * _C1) & _M64, 31) * _C2) & _M64


def _mix_k2(k2: int) -> int:
    return (_rotl((k2 * _C2) & _M64, 33) * _C1) & _M64


def murmur3_x64_64(data: bytes) -> bytes:
    """The HAMT hash of a name: h1 of murmur3-x64-128 (seed 0) as 8 big-endian bytes.

    Pure Python (names are short and hashed once each, so no `mmh3` dependency)."""
    h1 = h2 = 0
    n = len(data)
    tail_at = n - n % 16
    for k1, k2 in struct.iter_unpack("<QQ", data[:tail_at]):
        h1 ^= _mix_k1(k1)
        h1 = (_rotl(h1, 27) + h2) & _M64
        h1 = (h1 * 5 + 0x52DCE729) & _M64
        h2 ^= _mix_k2(k2)
        h2 = (_rotl(h2, 31) + h1) & _M64
        h2 = (h2 * 5 + 0x38495AB5) & _M64
    tail = data[tail_at:]
    if len(tail) > 8:
        h2 ^= _mix_k2(int.from_bytes(tail[8:], "little"))
    if tail:
        h1 ^= _mix_k1(int.from_bytes(tail[:8], "little"))
    h1 ^= n
    h2 ^= n
    h1 = (h1 + h2) & _M64
    h2 = (h2 + h1) & _M64
    h1, h2 = _fmix(h1), _fmix(h2)
    return ((h1 + h2) & _M64).to_bytes(8, "big")


# -- the tree to import ----------------------------------------------------------------------


@dataclass
class _Dir:
    """A directory to import: each name maps to a subdirectory or a file (path or bytes)."""

    children: dict[str, _Dir | Path | bytes] = field(default_factory=dict)


def _components(path: str) -> list[str]:
    """The names of a relative posix path; refuses what no directory entry can be named."""
    if not isinstance(path, str) or not path or path.startswith("/"):
        raise TreeInputError(f"tree path {path!r} must be a non-empty relative posix path")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or "\0" in part:
            raise TreeInputError(f"tree path {path!r} has a bad component {part!r}")
        _check_utf8(part, path)
    return parts


def _check_utf8(name: str, where: object) -> None:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise TreeInputError(f"{where}: the name {name!r} is not valid UTF-8") from None


def _tree_of(entries: Iterable[tuple[str, Path | bytes]]) -> _Dir:
    root = _Dir()
    for path, content in entries:
        *dirs, name = _components(path)
        node = root
        for i, part in enumerate(dirs):
            child = node.children.setdefault(part, _Dir())
            if not isinstance(child, _Dir):
                raise TreeInputError(f"tree path {path!r}: {'/'.join(dirs[:i + 1])} is a file")
            node = child
        if name in node.children:
            raise TreeInputError(f"tree path {path!r} appears twice (or is also a directory)")
        if not isinstance(content, bytes | bytearray | Path):
            raise TreeInputError(f"tree path {path!r}: content must be bytes or a Path")
        node.children[name] = bytes(content) if isinstance(content, bytearray) else content
    return root


def _tree_on_disk(root: Path) -> _Dir:
    """The directory `root`, as `ipfs add -r` sees it without `--hidden`; refuses symlinks."""
    tree = _Dir()
    try:
        with os.scandir(root) as it:
            listing = list(it)
    except OSError as exc:
        raise TreeInputError(f"cannot read directory {root}: {exc.strerror}") from None
    for entry in listing:
        if entry.name.startswith("."):
            continue
        path = root / entry.name
        _check_utf8(entry.name, root)
        if entry.is_symlink():
            raise TreeInputError(f"{path} is a symlink; dlx stores regular files and directories only")
        if entry.is_dir(follow_symlinks=False):
            tree.children[entry.name] = _tree_on_disk(path)
        elif entry.is_file(follow_symlinks=False):
            tree.children[entry.name] = path
        else:
            raise TreeInputError(f"{path} is not a regular file or directory")
    return tree


# -- import ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Link:
    name: str
    cid: CID
    tsize: int


class _Builder:
    """Stores (or only hashes) the blocks of one tree; CIDs labelled as `cid_version` asks."""

    def __init__(self, put: PutFn | None, cid_version: int) -> None:
        if cid_version not in (0, 1):
            raise ValueError(f"cid_version must be 0 or 1, got {cid_version}")
        self.put = put
        self.cid_version = cid_version

    def node(self, data: UnixFSData, links: list[_Link]) -> tuple[CID, int]:
        """Store a dag-pb node; returns its CID and cumulative size."""
        block = PBNode(data.encode(), [PBLink(ln.cid, ln.tsize, ln.name) for ln in links]).encode()
        cid = self.put(block, DAG_PB) if self.put else cid_of_block(block, DAG_PB)
        if self.cid_version == 0:
            cid = cid_from_digest(bytes(cid.raw_digest), DAG_PB, 0)
        return cid, len(block) + sum(ln.tsize for ln in links)

    def file(self, name: str, content: Path | bytes) -> _Link:
        """Import one file, streaming it from disk when it spans more than one chunk."""
        options: dict[str, int] = {"cid_version": self.cid_version}
        if isinstance(content, bytes):
            res = import_bytes(content, self.put, **options)
            return _Link(name, res.cid, res.dag_size)
        try:
            with open(content, "rb") as fh:
                if os.fstat(fh.fileno()).st_size <= CHUNK_SIZE:  # one block: no thread pool
                    res = import_bytes(fh.read(), self.put, **options)
                else:
                    res = import_file(fh, self.put, **options)
        except DlxError:
            raise
        except OSError as exc:
            raise TreeInputError(f"cannot read {content}: {exc.strerror}") from None
        return _Link(name, res.cid, res.dag_size)

    def directory(self, name: str, tree: _Dir) -> _Link:
        """Import a directory bottom up: children first, then its node or its HAMT."""
        links = [self.directory(child, sub) if isinstance(sub, _Dir) else self.file(child, sub)
                 for child, sub in tree.children.items()]
        estimate = sum(len(ln.name.encode()) + len(bytes(ln.cid)) for ln in links)
        if estimate > HAMT_THRESHOLD:
            hashed = [(murmur3_x64_64(ln.name.encode()), ln) for ln in links]
            cid, tsize = self.shard(hashed, 0)
        else:
            links.sort(key=lambda ln: ln.name.encode())
            cid, tsize = self.node(UnixFSData(T_DIRECTORY), links)
        return _Link(name, cid, tsize)

    def shard(self, entries: list[tuple[bytes, _Link]], depth: int) -> tuple[CID, int]:
        """One HAMT node over `entries` (name hash, link), slotted by the hash's byte `depth`."""
        if depth == len(entries[0][0]):
            raise TreeInputError(f"names {sorted(ln.name for _, ln in entries)} share one 64-bit "
                                 "HAMT hash; such a directory cannot be sharded")
        slots: dict[int, list[tuple[bytes, _Link]]] = {}
        for digest, link in entries:
            slots.setdefault(digest[depth], []).append((digest, link))
        links, bitfield = [], 0
        for slot in sorted(slots):
            bitfield |= 1 << slot
            group, prefix = slots[slot], f"{slot:0{_PAD}X}"
            if len(group) == 1:
                link = group[0][1]
                links.append(_Link(prefix + link.name, link.cid, link.tsize))
            else:
                cid, tsize = self.shard(group, depth + 1)
                links.append(_Link(prefix, cid, tsize))
        bits = bitfield.to_bytes((bitfield.bit_length() + 7) // 8, "big")
        return self.node(UnixFSData(T_HAMT, bits, hash_type=HAMT_HASH, fanout=HAMT_FANOUT), links)


def import_tree(entries: Iterable[tuple[str, Path | bytes]], put: PutFn | None = None, *,
                cid_version: int = 1) -> CID:
    """The root CID `ipfs add -r` (`--cid-version=1` for 1) gives the tree of `entries`.

    Entries are (relative posix path, file path or file bytes); the directories are those
    the paths name (no entries: the empty directory). `put=None` stores nothing.
    """
    return _Builder(put, cid_version).directory("", _tree_of(entries)).cid


def import_directory(root: Path, put: PutFn | None = None, *, cid_version: int = 1) -> CID:
    """The CID `ipfs add -r` gives the directory `root` (hidden entries skipped, empty
    directories kept, symlinks refused); `put=None` stores nothing."""
    root = Path(root)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a directory"
        raise TreeInputError(f"{root} {what}")
    return _Builder(put, cid_version).directory("", _tree_on_disk(root)).cid


# -- read back -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    path: str
    cid: CID
    size: int | None  # file bytes; None: a directory


def _unixfs(store: BlockReader, cid: CID) -> tuple[UnixFSData, list[PBLink]]:
    block = store.get(cid)
    try:
        node = PBNode.decode(block)
        return UnixFSData.decode(node.data or b""), node.links
    except (ValueError, UnicodeDecodeError) as exc:
        raise StorageError(f"{cid} is not a UnixFS node: {exc}") from None


class _Walk:
    """One bounded walk: at most `max_entries()` entries, `max_depth()` directory and HAMT
    levels, and each directory node fetched and decoded once however often the DAG names it
    (a DAG of a few blocks naming 2^40 paths stops at the entry limit in well under a second)."""

    def __init__(self, store: BlockReader, root: CID) -> None:
        self.store, self.root = store, root
        self.limit, self.depth = max_entries(), max_depth()
        self.entries = 0
        self.dirs: dict[CID, tuple[UnixFSData, list[PBLink]]] = {}

    def node(self, cid: CID) -> tuple[UnixFSData, list[PBLink]]:
        got = self.dirs.get(cid)
        if got is None:
            got = _unixfs(self.store, cid)
            if got[0].type in (T_DIRECTORY, T_HAMT):
                self.dirs[cid] = got
        return got

    def deeper(self, cid: CID, depth: int) -> int:
        if depth >= self.depth:
            raise StorageError(f"{self.root}: the directory DAG is deeper than {self.depth} levels at {cid} "
                               "($DLX_MAX_DAG_DEPTH)")
        return depth + 1

    def count(self) -> None:
        self.entries += 1
        if self.entries > self.limit:
            raise StorageError(f"{self.root}: the directory names more than {self.limit} entries "
                               "($DLX_MAX_TREE_ENTRIES)")


def _dir_links(walk: _Walk, cid: CID, fs: UnixFSData, links: list[PBLink], depth: int) -> Iterator[PBLink]:
    """The entries of a directory node, a HAMT's leaves (named without their slot prefix)."""
    if fs.type == T_DIRECTORY:
        yield from links
        return
    pad = len(f"{(fs.fanout or HAMT_FANOUT) - 1:X}")
    for link in links:
        if len(link.name) < pad:
            raise StorageError(f"{cid}: HAMT link name {link.name!r} is shorter than its slot prefix")
        if len(link.name) > pad:
            yield PBLink(link.cid, link.tsize, link.name[pad:])
            continue
        if link.cid.codec.name != DAG_PB:
            raise StorageError(f"{link.cid}, a shard of {cid}, is not a HAMT shard")
        sub, sub_links = walk.node(link.cid)
        if sub.type != T_HAMT:
            raise StorageError(f"{link.cid}, a shard of {cid}, is not a HAMT shard")
        yield from _dir_links(walk, link.cid, sub, sub_links, walk.deeper(link.cid, depth))


def _walk(walk: _Walk, cid: CID, prefix: str, depth: int = 0) -> Iterator[_Entry]:
    """Every file and directory below the directory `cid`, depth first (names unsorted),
    a directory before what it holds."""
    fs, links = walk.node(cid) if cid.codec.name == DAG_PB else (None, [])
    if fs is None or fs.type not in (T_DIRECTORY, T_HAMT):
        raise StorageError(f"{cid} is not a UnixFS directory")
    seen: set[str] = set()
    for link in _dir_links(walk, cid, fs, links, depth):
        walk.count()
        name = link.name
        if name in ("", ".", "..") or "/" in name or "\0" in name or name in seen:
            raise StorageError(f"{cid}: unsafe or repeated entry name {name!r}")
        seen.add(name)
        path = prefix + name
        if link.cid.codec.name == RAW:  # a raw block's cumulative size is its length
            yield _Entry(path, link.cid, link.tsize)
            continue
        if link.cid.codec.name != DAG_PB:
            raise StorageError(f"{cid}: entry {name!r} is {link.cid.codec.name}, not UnixFS")
        child, _ = walk.node(link.cid)
        if child.type in (T_DIRECTORY, T_HAMT):
            yield _Entry(path, link.cid, None)
            yield from _walk(walk, link.cid, path + "/", walk.deeper(link.cid, depth))
        elif child.type in (T_FILE, T_RAW):
            yield _Entry(path, link.cid, child.filesize if child.filesize is not None else len(child.data or b""))
        else:
            raise StorageError(f"{link.cid} ({path}) is UnixFS type {child.type}, neither a file nor a directory")


def _entries(store: BlockReader, root: CID) -> Iterator[_Entry]:
    return _walk(_Walk(store, root), root, "")


def list_tree(store: BlockReader, root: CID | str) -> list[tuple[str, CID, int]]:
    """(relative posix path, file CID, file size) of every file below the directory
    `root`, sorted by path; plain and sharded directories alike. Directory and file root
    blocks are fetched (so re-hashed); a raw file's size is its link's Tsize, checked
    when the file is read. Bounded: lib.store.limits (entries and depth)."""
    files = [(e.path, e.cid, e.size) for e in _entries(store, parse_cid(root)) if e.size is not None]
    return sorted(files)


def is_directory(store: BlockReader, cid: CID | str) -> bool:
    """Whether `cid` is a UnixFS directory (plain or sharded); fetches one block at most."""
    cid = parse_cid(cid)
    if cid.codec.name != DAG_PB:
        return False
    return _unixfs(store, cid)[0].type in (T_DIRECTORY, T_HAMT)


def read_tree(store: BlockReader, root: CID | str, out_dir: Path) -> int:
    """Restore the directory `root` under `out_dir`; returns the number of files.

    Every directory node is read (and re-hashed, within the walk's bounds) before anything
    is written. A new `out_dir` is built in a fresh temporary directory beside it (made with
    mkdtemp: no existing name is ever reused or removed) and renamed into place when
    complete. Into an existing one, every directory is opened from `out_dir` one component
    at a time without following a symlink, and each file is written to a fresh exclusive
    temporary file in its own directory and renamed over its name: nothing is written
    outside `out_dir`, and no existing file but the entry's own name is replaced.
    """
    root = parse_cid(root)
    entries = list(_entries(store, root))
    out_dir = Path(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        return _write_tree(store, entries, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name[:64]}.", suffix=_TMP, dir=out_dir.parent))
    try:
        count = _write_tree(store, entries, stage)
        os.rename(stage, out_dir)
    except DlxError:
        raise
    except OSError as exc:
        raise StorageError(f"cannot write {out_dir}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return count


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_parent(root_fd: int, parts: list[str], out_dir: Path, entry: _Entry) -> int:
    """The directory `parts` under `root_fd`, opened one component at a time, never through
    a symlink."""
    fd = os.dup(root_fd)
    for i, part in enumerate(parts):
        try:
            nxt = os.open(part, _OPEN_DIR, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            where = out_dir / "/".join(parts[:i + 1])
            raise StorageError(f"{entry.cid}: {entry.path} is not written: {where} is not a directory "
                               f"({exc.strerror}; a symlink is never followed)") from None
        os.close(fd)
        fd = nxt
    return fd


def _write_tree(store: BlockReader, entries: list[_Entry], out_dir: Path) -> int:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        root_fd = os.open(out_dir, _OPEN_DIR & ~os.O_NOFOLLOW)  # the user named it
    except OSError as exc:
        raise StorageError(f"cannot write {out_dir}: {exc.strerror}") from None
    count = 0
    try:
        for entry in entries:
            *parents, name = entry.path.split("/")
            fd = _open_parent(root_fd, parents, out_dir, entry)
            try:
                if entry.size is None:
                    _make_dir(fd, name, out_dir, entry)
                else:
                    _write_file(store, entry, fd, name, out_dir)
                    count += 1
            finally:
                os.close(fd)
    finally:
        os.close(root_fd)
    return count


def _make_dir(fd: int, name: str, out_dir: Path, entry: _Entry) -> None:
    try:
        os.mkdir(name, 0o777, dir_fd=fd)
    except FileExistsError:
        pass  # checked as a parent, without following a symlink, when it is used
    except OSError as exc:
        raise StorageError(f"cannot create directory {out_dir / entry.path}: {exc.strerror}") from None


def _write_file(store: BlockReader, entry: _Entry, fd: int, name: str, out_dir: Path) -> None:
    """The file `entry` as `name` in the directory `fd`: a fresh exclusive temporary file
    (never opened through a symlink, never an existing name), renamed over `name`."""
    target = out_dir / entry.path
    tmp = f".dlx-{secrets.token_hex(8)}{_TMP}"
    try:
        out = os.open(tmp, _NEW_FILE, 0o666, dir_fd=fd)
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc.strerror}") from None
    try:
        with os.fdopen(out, "wb") as fh:
            written = read_file(store, entry.cid, fh)
        if written != entry.size:
            raise StorageError(f"{entry.cid} ({entry.path}) holds {written} bytes, its directory says {entry.size}")
        os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except DlxError:
        raise
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc.strerror}") from None
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
