"""CAR v1 files: export everything reachable from some roots, import a CAR, streaming.

    with open("run.car", "wb") as fh:
        export_car(store, [head], fh)        # == `ipfs dag export HEAD`
    with open("run.car", "rb") as fh:
        roots = import_car(store, fh)        # all blocks re-hashed; all or nothing

Format (https://ipld.io/specs/transport/car/carv1/): a varint-prefixed DAG-CBOR header
`{roots: [CID], version: 1}`, then sections `varint(len(cid) + len(block)) cid block`.
Import hashes every block against its CID, requires every block reachable from the
roots to be in the file or already in the store (so a CAR cut at a section boundary is
caught too), and stages blocks with `Blockstore.batch`, so a truncated or corrupt CAR raises `CarError`
and leaves the store unchanged. Neither direction holds more than one block in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import dag_cbor
from multiformats import CID

from lineage.errors import StorageError

from . import cbor
from .cbor import CborError
from .cid import as_v1, parse_cid
from .dag import BlockReader, links_of, walk
from .dagpb import read_varint, write_varint
from .limits import MAX_BLOCK

MAX_SECTION = MAX_BLOCK + 128  # a block of at most MAX_BLOCK (what a store reads back) and its CID


class CarError(StorageError, ValueError):
    """A CAR file is malformed, truncated, or holds a block that does not match its CID."""


def encode_header(roots: list[CID]) -> bytes:
    header = dag_cbor.encode({"roots": [as_v1(r) if r.version else r for r in roots], "version": 1})
    return write_varint(len(header)) + header


def export_car(store: BlockReader, roots: Iterable[CID | str], out: BinaryIO) -> int:
    """Write a CAR v1 of every block reachable from `roots` to `out`; returns the block count."""
    cids = [parse_cid(r) for r in roots]
    out.write(encode_header(cids))
    count = 0
    for cid, block in walk(store, cids):
        cid_bytes = bytes(cid)
        out.write(write_varint(len(cid_bytes) + len(block)))
        out.write(cid_bytes)
        out.write(block)
        count += 1
    return count


def _read_varint(fh: BinaryIO, what: str) -> int | None:
    """A varint from the stream; None at a clean end of file (before its first byte)."""
    n = shift = 0
    first = True
    while True:
        b = fh.read(1)
        if not b:
            if first:
                return None
            raise CarError(f"truncated CAR: the file ends inside a {what} length")
        first = False
        n |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return n
        shift += 7
        if shift > 63:
            raise CarError(f"malformed CAR: oversized {what} length")


def _read_exact(fh: BinaryIO, n: int, what: str) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise CarError(f"truncated CAR: {what} needs {n} bytes, the file has {len(data)} left")
    return data


def _split_cid(section: bytes) -> tuple[CID, bytes]:
    """The CID at the start of a section, and the block after it."""
    try:
        if section[:2] == b"\x12\x20":  # CIDv0: a bare sha2-256 multihash
            end = 34
        else:
            pos = 0
            for _ in range(2):  # version, codec
                pos = _skip_varint(section, pos)
            code_end = _skip_varint(section, pos)  # multihash code
            size, digest_at = read_varint(section, code_end)
            end = digest_at + size
        if end > len(section):
            raise ValueError("CID runs past its section")
        return parse_cid(section[:end]), section[end:]
    except Exception as exc:  # multiformats raises several unrelated types
        raise CarError(f"malformed CAR: bad CID in a section ({exc})") from None


def _skip_varint(buf: bytes, pos: int) -> int:
    return read_varint(buf, pos)[1]


def _root_cid(value: object) -> CID:
    """A root listed in a CAR header as a CID; a value no CID can be read from (a number,
    a map) fails with ValueError, as `parse_cid` fails on text that is no CID."""
    try:
        if isinstance(value, str | bytes | CID):
            return parse_cid(value)
    except ValueError as exc:
        raise CarError(f"malformed CAR header: a root that is no CID ({exc})") from None
    raise CarError(f"malformed CAR header: a root that is no CID: {value!r:.100}")


def read_car(fh: BinaryIO) -> tuple[list[CID], Iterator[tuple[CID, bytes]]]:
    """The roots of a CAR and an iterator over its (CID, block) sections, each re-hashed."""
    size = _read_varint(fh, "header")
    if size is None:
        raise CarError("empty file: not a CAR")
    if size > MAX_SECTION:
        raise CarError(f"malformed CAR: header of {size} bytes")
    try:
        header = cbor.decode(_read_exact(fh, size, "the header"), "the CAR header")
    except CborError as exc:
        raise CarError(f"malformed CAR header: {exc}") from None
    listed = header.get("roots") if isinstance(header, dict) else None
    if not isinstance(header, dict) or header.get("version") != 1 or not isinstance(listed, list):
        raise CarError(f"not a CAR v1 header: {header!r:.200}")
    roots = [_root_cid(r) for r in listed]

    def sections() -> Iterator[tuple[CID, bytes]]:
        while (length := _read_varint(fh, "section")) is not None:
            if length == 0 or length > MAX_SECTION:
                raise CarError(f"malformed CAR: section of {length} bytes")
            cid, block = _split_cid(_read_exact(fh, length, "a section"))
            if cid.hashfun.name != "sha2-256":
                raise CarError(f"{cid}: only sha2-256 CIDs are supported")
            if hashlib.sha256(block).digest() != bytes(cid.raw_digest):
                raise CarError(f"corrupt block {cid} in CAR: content does not match its CID")
            yield cid, block

    return roots, sections()


def import_car(store: object, fh: BinaryIO) -> list[CID]:
    """Import every block of a CAR into `store` (all or nothing); returns the CAR's roots."""
    roots, sections = read_car(fh)
    seen: set[str] = set()
    needed: dict[str, CID] = {str(as_v1(r)): r for r in roots}
    with store.batch() as staged:  # type: ignore[attr-defined]
        for cid, block in sections:
            staged.put(block, cid.codec.name)
            seen.add(str(as_v1(cid)))
            for link in links_of(cid, block):
                needed.setdefault(str(as_v1(link)), link)
        # A CAR cut at a section boundary still parses: only completeness tells it from a
        # whole one. Every block reachable from the roots is in the CAR or already stored.
        for key, cid in needed.items():
            if key not in seen and not store.has(cid):  # type: ignore[attr-defined]
                what = "its root" if key in {str(as_v1(r)) for r in roots} else "block"
                raise CarError(f"incomplete or truncated CAR: {what} {cid} is missing")
    return roots
