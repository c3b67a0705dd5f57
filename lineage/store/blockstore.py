"""A local content-addressed blockstore: one file per block, keyed by CID.

Layout follows go-ipfs' flatfs `next-to-last/2` sharding: block `bafk...xyz` lives at
`<root>/<2 chars before the last>/<cid>` (a CIDv0 is stored under its CIDv1 name). Several
writer processes can share one store. Every read re-hashes the bytes against the CID.

Writes: a block's bytes are written under a temporary name and are on disk before the
block is renamed to its CID, so a crash never leaves a half-written block under a valid
name. `put` does that for one block (an fsync of its own). `batch()` does it for many at
once, which is how files are imported (`dlx cas add`, a run's checkpoints): the blocks are
staged in a private directory with no fsync each (the kernel starts writing each to disk
as soon as it is written), then one sync of the filesystem makes all their bytes durable,
they are renamed into place, and a second sync makes the names durable. A per-block fsync
cost more than hashing the block. A batch is all or nothing: a broken CAR or a failed
import leaves the store unchanged. Blocks are written relative to the store's directory
and its shard directories, opened without following symlinks: a symlinked shard is an
error, never a way out of the store.

Pins: `<root>/.pins/<name>` lists root CIDs, one a line; a run pins its head under its
own name. `gc` deletes every block not reachable from a pin, except blocks younger than
`grace_s` (so a writer that stored blocks but has not pinned them yet keeps them).
Retention (lineage/store/retention.py) removes files a pinned run no longer keeps with `prune`,
which first records each removed root under `<root>/.pruned/`; walks from a pin pass over
a recorded root that is gone.

Speed: multiformats validates every argument of every CID it builds or prints (about a
millisecond a call), which dwarfs hashing a 256 KiB block. The CIDs of our own blocks
(v1, sha2-256, raw/dag-pb/dag-cbor) are therefore built and named from their bytes
(`lineage.store.cid.cid_of_block`, `block_name`); any other CID takes multiformats' way.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import functools
import hashlib
import itertools
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from multiformats import CID

from lineage.errors import BlockNotFoundError, CorruptBlockError, StorageError
from trainer.bounded import read_fd

from .cid import RAW, binary_cid_of_block, block_name, cid_from_binary, parse_cid
from .dag import reachable
from .limits import MAX_BLOCK

PIN_DIR = ".pins"
PRUNED_DIR = ".pruned"
_PIN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the range, do not wait for it


@functools.cache
def _libc() -> tuple[Any, Any]:
    """Linux's syncfs and sync_file_range (os has neither), or None where libc lacks them."""
    libc = ctypes.CDLL(None, use_errno=True)
    syncfs, sync_file_range = getattr(libc, "syncfs", None), getattr(libc, "sync_file_range", None)
    if syncfs is not None:
        syncfs.argtypes = [ctypes.c_int]
    if sync_file_range is not None:
        sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return syncfs, sync_file_range


def _sync_filesystem(fd: int) -> None:
    """Make everything written to the filesystem holding `fd` durable: every file's bytes
    and metadata, and the disk's write cache (Linux syncfs: one call for a whole batch,
    where an fsync per block cost more than hashing it); sync() where there is no syncfs."""
    syncfs = _libc()[0]
    if syncfs is None:
        os.sync()
    elif syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _start_writeback(fd: int) -> None:
    """Have the kernel start writing `fd`'s pages to disk now, without waiting (a hint:
    the batch's sync then finds them written instead of starting all the I/O at its end)."""
    sync_file_range = _libc()[1]
    if sync_file_range is not None:
        sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _shard(name: str) -> str:
    return name[-3:-1]


def _cid_from_name(name: str, where: Path | None = None) -> CID:
    """The CID a block file is named by (its CIDv1 in base32); StorageError naming the
    file for a name that is none."""
    if len(name) == 59 and name[0] == "b":
        try:
            return cid_from_binary(base64.b32decode(name[1:].upper() + "======"))
        except ValueError:
            pass
    try:
        return parse_cid(name)
    except ValueError:
        raise StorageError(f"{where / name if where else name}: a file in the blockstore whose name is no CID") from None


class Blockstore:
    """Blocks on the local filesystem under `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"Blockstore({str(self.root)!r})"

    def _path(self, cid: CID | str | bytes) -> Path:
        name, _ = block_name(cid)
        return self.root / name[-3:-1] / name

    def put(self, data: bytes | memoryview, codec: str = RAW) -> CID:
        """Store `data` as a block with `codec`, durably (one fsync); returns its CIDv1.
        Idempotent. Many blocks at once: `batch()`."""
        return cid_from_binary(self.put_binary(data, codec))

    def put_binary(self, data: bytes | memoryview, codec: str = RAW) -> bytes:
        """`put`, returning the binary CIDv1 (what a dag-pb link holds) instead of a CID
        object: what the file importer calls for each block."""
        raw = binary_cid_of_block(data, codec)
        name, _ = block_name(raw)
        if not self._refresh(name):
            try:
                self._write(name, data)
            except OSError as exc:
                raise StorageError(f"cannot write block {cid_from_binary(raw)} under {self.root}: {exc}") from exc
        return raw

    def _refresh(self, name: str) -> bool:
        """Whether the block file `name` is there; if so its age is reset, so that `gc`'s
        grace period covers a writer that stores it again."""
        try:
            os.utime(os.path.join(self.root, _shard(name), name), follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _write(self, name: str, data: bytes | memoryview) -> None:
        root_fd = self._open_root()
        try:
            shard_fd = _open_shard(root_fd, _shard(name))
        finally:
            os.close(root_fd)
        try:
            tmp = f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(tmp, _NEW_FILE, 0o666, dir_fd=shard_fd)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=shard_fd, dst_dir_fd=shard_fd)
        finally:
            os.close(shard_fd)

    def _open_root(self) -> int:
        """The store's directory, opened (and made if missing)."""
        try:
            return os.open(self.root, _DIR & ~os.O_NOFOLLOW)
        except FileNotFoundError:
            self.root.mkdir(parents=True, exist_ok=True)
            return os.open(self.root, _DIR & ~os.O_NOFOLLOW)

    def get(self, cid: CID | str | bytes) -> bytes:
        """The block's bytes, re-hashed against `cid`; raises if missing or corrupt. Only
        a regular file is read (never through a symlink, and a FIFO or device is not even
        waited on), and at most `MAX_BLOCK` bytes of it."""
        name, digest = block_name(cid)
        path = os.path.join(self.root, name[-3:-1], name)
        try:
            data = _read_block_file(path)
        except FileNotFoundError:
            raise BlockNotFoundError(parse_cid(cid), f"the blockstore {self.root}") from None
        except _NotABlock as exc:
            raise CorruptBlockError(parse_cid(cid), str(exc)) from None
        except OSError as exc:
            raise StorageError(f"cannot read block {parse_cid(cid)}: {exc.strerror or exc}") from None
        if hashlib.sha256(data).digest() != digest:
            raise CorruptBlockError(parse_cid(cid))
        return data

    def has(self, cid: CID | str | bytes) -> bool:
        return self._path(cid).exists()

    def size(self, cid: CID | str | bytes) -> int:
        """The block's size in bytes (0 if it is not there)."""
        try:
            return self._path(cid).stat().st_size
        except FileNotFoundError:
            return 0

    def mtime(self, cid: CID | str | bytes) -> float:
        """When the block was last stored (`put` of a block already there refreshes it); 0 if absent."""
        try:
            return self._path(cid).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def delete(self, cid: CID | str) -> bool:
        """Remove a block; False if it was not there."""
        try:
            self._path(cid).unlink()
            return True
        except FileNotFoundError:
            return False

    def __iter__(self) -> Iterator[CID]:
        if not self.root.exists():
            return
        for shard in sorted(self.root.iterdir()):
            if shard.name.startswith(".") or shard.is_symlink() or not shard.is_dir():
                continue
            for entry in sorted(shard.iterdir()):
                if not entry.name.startswith("."):
                    yield _cid_from_name(entry.name, shard)

    def verify(self) -> list[CID]:
        """Re-hash every block; returns the CIDs whose bytes do not match."""
        return corrupt_blocks(self)

    # -- batches: all or nothing -----------------------------------------------------------

    @contextmanager
    def batch(self) -> Iterator[Blockstore]:
        """The store, but its `put`s join it only when the `with` body finishes without
        error, all at once: staged, synced once, renamed, synced once (the module
        docstring). Reads in the body see the store as it was, without the staged blocks."""
        root_fd = self._open_root()
        try:
            stage = f".batch-{os.getpid()}-{secrets.token_hex(6)}"
            os.mkdir(stage, 0o700, dir_fd=root_fd)
            stage_fd = os.open(stage, _DIR, dir_fd=root_fd)
            try:
                yield _Staged(self.root, stage_fd)
                try:
                    _commit(root_fd, stage_fd)
                except OSError as exc:
                    raise StorageError(f"cannot move staged blocks into {self.root}: {exc}") from exc
            finally:
                with suppress(OSError):  # what a failed batch staged
                    for name in os.listdir(stage_fd):
                        os.unlink(name, dir_fd=stage_fd)
                os.close(stage_fd)
                with suppress(OSError):
                    os.rmdir(stage, dir_fd=root_fd)
        finally:
            os.close(root_fd)

    # -- pins and garbage collection -------------------------------------------------------

    def _pin_path(self, name: str) -> Path:
        if not _PIN_NAME.match(name):
            raise StorageError(f"bad pin set name {name!r} (letters, digits, '_', '.', '-')")
        return self.root / PIN_DIR / name

    def pin(self, name: str, roots: list[CID]) -> None:
        """Make `roots` (and everything reachable from them) the pin set `name`."""
        path = self._pin_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
        tmp.write_text("".join(f"{parse_cid(c)}\n" for c in roots))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def unpin(self, name: str) -> None:
        self._pin_path(name).unlink(missing_ok=True)

    def pins(self) -> dict[str, list[CID]]:
        pin_dir = self.root / PIN_DIR
        if not pin_dir.is_dir():
            return {}
        return {p.name: [parse_cid(line) for line in p.read_text().split()]
                for p in sorted(pin_dir.iterdir()) if not p.name.startswith(".")}

    def gc(self, grace_s: float = 600.0, *, dry_run: bool = False, sizes: dict[str, int] | None = None) -> list[CID]:
        """Delete blocks not reachable from any pin and older than `grace_s`; returns them
        (`dry_run`: only lists them). `sizes`, if given, gets each one's bytes by CID.

        A pinned DAG with a missing (and not pruned) or corrupt block is an error: nothing
        is deleted.
        """
        keep: set[str] = set()
        for roots in self.pins().values():
            keep.update(block_name(c)[0] for c in reachable(self, roots))
        cutoff = time.time() - grace_s
        removed = []
        for cid in list(self):
            if block_name(cid)[0] in keep:
                continue
            path = self._path(cid)
            try:
                st = path.stat()
                if st.st_mtime > cutoff:
                    continue
                if not dry_run:
                    path.unlink()
            except FileNotFoundError:
                continue
            removed.append(cid)
            if sizes is not None:
                sizes[str(cid)] = st.st_size
        return removed

    # -- retention -------------------------------------------------------------------------

    def pruned(self) -> set[str]:
        """The names of the roots retention removed (recorded by `prune`)."""
        try:
            return {n for n in os.listdir(self.root / PRUNED_DIR) if not n.startswith(".")}
        except FileNotFoundError:
            return set()

    def prune(self, roots: list[CID], blocks: list[CID], touched_before: float | None = None) -> int:
        """Record `roots` as removed by retention, then delete `blocks` (lineage.store.retention
        lists each root before the blocks under it), except those stored or re-stored after
        `touched_before` (a run still writing may be re-using them, as for `gc`'s grace);
        returns the bytes freed.

        The records are on disk (fsynced) before the first unlink, and each unlink is atomic:
        a crash leaves whole blocks only, some of them unreferenced (the pin gc's to take)."""
        if not blocks:
            return 0
        record_dir = self.root / PRUNED_DIR
        record_dir.mkdir(parents=True, exist_ok=True)
        for root in roots:
            (record_dir / block_name(root)[0]).touch()
        fd = os.open(record_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        freed = 0
        for cid in blocks:
            path = self._path(cid)
            try:
                st = path.stat()
                if touched_before is not None and st.st_mtime > touched_before:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            freed += st.st_size
        return freed


class _Staged(Blockstore):
    """What `Blockstore.batch` yields: `put` writes to the batch's staging directory,
    with no fsync, and starts the block's writeback."""

    def __init__(self, root: Path, stage_fd: int) -> None:
        super().__init__(root)
        self._stage_fd = stage_fd

    def put_binary(self, data: bytes | memoryview, codec: str = RAW) -> bytes:
        raw = binary_cid_of_block(data, codec)
        name, _ = block_name(raw)
        if self._refresh(name):
            return raw
        try:
            fd = os.open(name, _NEW_FILE, 0o666, dir_fd=self._stage_fd)
        except FileExistsError:  # staged already by this batch
            return raw
        except OSError as exc:
            raise StorageError(f"cannot stage block {cid_from_binary(raw)} under {self.root}: {exc}") from exc
        try:
            _write_all(fd, data)
            _start_writeback(fd)
        except OSError as exc:
            raise StorageError(f"cannot stage block {cid_from_binary(raw)} under {self.root}: {exc}") from exc
        finally:
            os.close(fd)
        return raw


class _NotABlock(OSError):
    """A block file that is no regular file of at most MAX_BLOCK bytes."""


_READ_BLOCK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _read_block_file(path: str) -> bytes:
    """A block file's bytes: a regular file (opened without following a symlink and without
    blocking on a FIFO) of at most MAX_BLOCK bytes, read with a bound whatever it claims."""
    try:
        fd = os.open(path, _READ_BLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _NotABlock("the block file is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotABlock("the block file is not a regular file")
        if st.st_size > MAX_BLOCK:
            raise _NotABlock(f"the block file has {st.st_size} bytes, above the {MAX_BLOCK}-byte block limit")
        data = read_fd(fd, MAX_BLOCK)
        if data is None:
            raise _NotABlock(f"the block file grew past the {MAX_BLOCK}-byte block limit")
        return data
    finally:
        os.close(fd)


def _open_shard(root_fd: int, shard: str) -> int:
    """The shard directory (made if missing), opened without following a symlink."""
    try:
        return os.open(shard, _DIR, dir_fd=root_fd)
    except FileNotFoundError:
        with suppress(FileExistsError):  # another writer made it meanwhile
            os.mkdir(shard, dir_fd=root_fd)
        return os.open(shard, _DIR, dir_fd=root_fd)


def _commit(root_fd: int, stage_fd: int) -> None:
    """Move a batch's staged blocks into their shards: their bytes durable before any name
    points at them, then the names (a block another writer stored meanwhile is replaced by
    the same bytes)."""
    _sync_filesystem(stage_fd)
    for shard, names in itertools.groupby(sorted(os.listdir(stage_fd), key=_shard), key=_shard):
        shard_fd = _open_shard(root_fd, shard)
        try:
            for name in names:
                os.rename(name, name, src_dir_fd=stage_fd, dst_dir_fd=shard_fd)
        finally:
            os.close(shard_fd)
    _sync_filesystem(root_fd)


def corrupt_blocks(store: Any) -> list[CID]:
    """The CIDs of `store`'s blocks that do not hash to their CID (`get` re-hashes)."""
    bad = []
    for cid in store:
        try:
            store.get(cid)
        except CorruptBlockError:
            bad.append(cid)
    return bad
