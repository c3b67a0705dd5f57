"""A local content-addressed blockstore: one file per block, keyed by CID.

Layout follows go-ipfs' flatfs `next-to-last/2` sharding: block `bafk...xyz` lives at
`<root>/<2 chars before the last>/<cid>` (a CIDv0 is stored under its CIDv1 name). Writes
are atomic (temporary file, fsync, rename), so several writer processes can share one
store and a crash never leaves a half-written block under a valid name. Every read
re-hashes the bytes against the CID.

Pins: `<root>/.pins/<name>` lists root CIDs, one a line; a run pins its head under its
own name. `gc` deletes every block not reachable from a pin, except blocks younger than
`grace_s` (so a writer that stored blocks but has not pinned them yet keeps them).
`batch()` stages blocks in a private directory and moves them in only when the whole
batch succeeded (CAR import uses it: a broken CAR leaves the store unchanged).
"""

from __future__ import annotations

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

from .cid import RAW, as_v1, cid_for, parse_cid
from .errors import BlockNotFoundError, CorruptBlockError, StorageError

PIN_DIR = ".pins"
_PIN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class Blockstore:
    """Blocks on the local filesystem under `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"Blockstore({str(self.root)!r})"

    def _path(self, cid: CID) -> Path:
        name = str(as_v1(cid))
        return self.root / name[-3:-1] / name

    def put(self, data: bytes, codec: str = RAW) -> CID:
        """Store `data` as a block with `codec`; returns its CIDv1. Idempotent."""
        cid = cid_for(data, codec)
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

    def get(self, cid: CID | str) -> bytes:
        """The block's bytes, re-hashed against `cid`; raises if missing or corrupt."""
        cid = parse_cid(cid)
        path = self._path(cid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlockNotFoundError(cid) from None
        except OSError as exc:
            raise StorageError(f"cannot read block {cid}: {exc}") from exc
        if hashlib.sha256(data).digest() != bytes(cid.raw_digest):
            raise CorruptBlockError(cid)
        return data

    def has(self, cid: CID | str) -> bool:
        return self._path(parse_cid(cid)).exists()

    def delete(self, cid: CID | str) -> bool:
        """Remove a block; False if it was not there."""
        try:
            self._path(parse_cid(cid)).unlink()
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
                    yield parse_cid(entry.name)

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
                final = self._path(parse_cid(path.name))
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

    def gc(self, grace_s: float = 600.0) -> list[CID]:
        """Delete blocks not reachable from any pin and older than `grace_s`; returns them.

        A pinned DAG with a missing or corrupt block is an error: nothing is deleted.
        """
        from .dag import reachable

        keep: set[str] = set()
        for roots in self.pins().values():
            keep.update(str(as_v1(c)) for c in reachable(self, roots))
        cutoff = time.time() - grace_s
        removed = []
        for cid in list(self):
            if str(cid) in keep:
                continue
            path = self._path(cid)
            try:
                if path.stat().st_mtime > cutoff:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append(cid)
        return removed


def corrupt_blocks(store: Any) -> list[CID]:
    """The CIDs of `store`'s blocks that do not hash to their CID (`get` re-hashes)."""
    bad = []
    for cid in store:
        try:
            store.get(cid)
        except CorruptBlockError:
            bad.append(cid)
    return bad
