"""A local content-addressed blockstore: one file per block, keyed by CID.

Layout follows go-ipfs' flatfs `next-to-last/2` sharding: block `bafk...xyz` lives at
`<root>/<2 chars before the last>/<cid>` (a CIDv0 is stored under its CIDv1 name). Writes
are atomic (temporary file, fsync, rename), so several writer processes can share one
store and a crash never leaves a half-written block under a valid name. Every read
re-hashes the bytes against the CID.

Pins: `<root>/.pins/<name>` lists root CIDs, one a line; a run pins its head under its
own name. `gc` deletes every block not reachable from a pin, except blocks younger than
`grace_s` (so a writer that stored blocks but has not pinned them yet keeps them).
Retention (lineage/retention.py) removes files a pinned run no longer keeps with `prune`,
which first records each removed root under `<root>/.pruned/`; walks from a pin pass over
a recorded root that is gone.
`batch()` stages blocks in a private directory and moves them in only when the whole
batch succeeded (CAR import uses it: a broken CAR leaves the store unchanged).

Speed: multiformats validates every argument of every CID it builds or prints (about a
millisecond a call), which dwarfs hashing a 256 KiB block. The CIDs of our own blocks
(v1, sha2-256, raw/dag-pb/dag-cbor) are therefore built and named from their bytes
(`lineage.store.cid.cid_of_block`, `block_name`); any other CID takes multiformats' way.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from multiformats import CID

from lineage.errors import BlockNotFoundError, CorruptBlockError, StorageError

from .cid import RAW, block_name, cid_from_binary, cid_of_block, parse_cid
from .dag import reachable

PIN_DIR = ".pins"
PRUNED_DIR = ".pruned"
_PIN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")

def _cid_from_name(name: str) -> CID:
    """The CID a block file is named by (its CIDv1 in base32)."""
    if len(name) == 59 and name[0] == "b":
        try:
            return cid_from_binary(base64.b32decode(name[1:].upper() + "======"))
        except ValueError:
            pass
    return parse_cid(name)


class Blockstore:
    """Blocks on the local filesystem under `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"Blockstore({str(self.root)!r})"

    def _path(self, cid: CID | str | bytes) -> Path:
        name, _ = block_name(cid)
        return self.root / name[-3:-1] / name

    def put(self, data: bytes, codec: str = RAW) -> CID:
        """Store `data` as a block with `codec`; returns its CIDv1. Idempotent."""
        cid = cid_of_block(data, codec)
        path = self._path(cid)
        try:
            os.utime(path)  # already stored: refresh its age, so `gc`'s grace period covers it
        except FileNotFoundError:
            self._write(path, data, cid)
        return cid

    def _write(self, path: Path, data: bytes, cid: CID) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise StorageError(f"cannot write block {cid} under {self.root}: {exc}") from exc

    def get(self, cid: CID | str | bytes) -> bytes:
        """The block's bytes, re-hashed against `cid`; raises if missing or corrupt."""
        name, digest = block_name(cid)
        path = os.path.join(self.root, name[-3:-1], name)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            raise BlockNotFoundError(parse_cid(cid), f"the blockstore {self.root}") from None
        except OSError as exc:
            raise StorageError(f"cannot read block {parse_cid(cid)}: {exc}") from exc
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
            if shard.name.startswith(".") or not shard.is_dir():
                continue
            for entry in sorted(shard.iterdir()):
                if not entry.name.startswith("."):
                    yield _cid_from_name(entry.name)

    def verify(self) -> list[CID]:
        """Re-hash every block; returns the CIDs whose bytes do not match."""
        return corrupt_blocks(self)

    # -- batches: all or nothing -----------------------------------------------------------

    @contextmanager
    def batch(self) -> Iterator[Blockstore]:
        """A store whose blocks join this one only if the `with` body finishes without error."""
        self.root.mkdir(parents=True, exist_ok=True)
        stage_dir = self.root / f".batch-{os.getpid()}-{secrets.token_hex(6)}"
        staged = Blockstore(stage_dir)
        try:
            yield staged
            for path in sorted(stage_dir.glob("*/*")):
                if path.name.startswith("."):
                    continue
                final = self._path(path.name)
                if final.exists():
                    continue
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, final)  # same filesystem; each block was fsynced in staging
        finally:
            shutil.rmtree(stage_dir, ignore_errors=True)

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


def corrupt_blocks(store: Any) -> list[CID]:
    """The CIDs of `store`'s blocks that do not hash to their CID (`get` re-hashes)."""
    bad = []
    for cid in store:
        try:
            store.get(cid)
        except CorruptBlockError:
            bad.append(cid)
    return bad
