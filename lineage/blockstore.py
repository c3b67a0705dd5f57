"""A local content-addressed blockstore: one file per block, keyed by CID.

Layout follows go-ipfs' flatfs `next-to-last/2` sharding: block `bafk...xyz` lives at
`<root>/<2 chars before the last>/<cid>`. Writes are atomic (temporary file, fsync,
rename), so several writer processes can share one store and a crash never leaves a
half-written block under a valid name. Every read re-hashes the bytes against the CID.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from multiformats import CID

from .cid import RAW, cid_for, parse_cid
from .errors import BlockNotFoundError, CorruptBlockError, StorageError


class Blockstore:
    """Blocks on the local filesystem under `root`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, cid: CID) -> Path:
        name = str(cid.set(base="base32"))
        return self.root / name[-3:-1] / name

    def put(self, data: bytes, codec: str = RAW) -> CID:
        """Store `data` as a block with `codec`; returns its CID. Idempotent."""
        cid = cid_for(data, codec)
        path = self._path(cid)
        if path.exists():
            return cid
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
        return cid

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

    def __iter__(self) -> Iterator[CID]:
        if not self.root.exists():
            return
        for shard in sorted(self.root.iterdir()):
            if not shard.is_dir():
                continue
            for entry in sorted(shard.iterdir()):
                if not entry.name.startswith("."):
                    yield parse_cid(entry.name)

    def verify(self) -> list[CID]:
        """Re-hash every block; returns the CIDs whose bytes do not match."""
        bad = []
        for cid in self:
            try:
                self.get(cid)
            except CorruptBlockError:
                bad.append(cid)
        return bad
