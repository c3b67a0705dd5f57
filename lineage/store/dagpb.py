"""dag-pb and UnixFS protobufs, encoded by hand: the few wire types (varint and bytes
fields) they use, `PBNode`/`PBLink` (dag-pb) and `UnixFSData` (UnixFS `Data`).

    block = PBNode(UnixFSData(T_FILE, None, size, sizes).encode(), links).encode()
    node = PBNode.decode(block); fs = UnixFSData.decode(node.data or b"")

Byte for byte as Go's `go-merkledag` and JS's `@ipld/dag-pb` write them (links before data,
an empty `Name` always written), because a CID is the hash of exactly those bytes
(lineage/store/unixfs.py imports files with them, lineage/store/unixfs_dir.py directories).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

from multiformats import CID

from .cid import cid_from_binary

__all__ = ["T_DIRECTORY", "T_FILE", "T_HAMT", "T_METADATA", "T_RAW", "T_SYMLINK", "PBLink", "PBNode",
           "UnixFSData", "file_leaf", "file_node", "pb_fields", "read_varint", "write_varint"]

# UnixFS Data.DataType
T_RAW, T_DIRECTORY, T_FILE, T_METADATA, T_SYMLINK, T_HAMT = range(6)


def write_varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or oversized varint")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7


def pb_fields(buf: bytes | memoryview) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs of a protobuf message with varint and bytes fields."""
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = read_varint(buf, pos)
            yield num, value
        elif wire == 2:
            size, pos = read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("truncated length-delimited field")
            yield num, bytes(buf[pos:pos + size])
            pos += size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _bytes_field(num: int, value: bytes) -> bytes:
    return write_varint(num << 3 | 2) + write_varint(len(value)) + value


def _uint_field(num: int, value: int) -> bytes:
    return write_varint(num << 3) + write_varint(value)


@functools.lru_cache(maxsize=8)
def _leaf_framing(size: int) -> tuple[bytes, bytes]:
    """What goes before and after `size` bytes of file data in a dag-pb UnixFS leaf."""
    head = _uint_field(1, T_FILE) + (write_varint(2 << 3 | 2) + write_varint(size) if size else b"")
    tail = _uint_field(3, size)
    return write_varint(1 << 3 | 2) + write_varint(len(head) + size + len(tail)) + head, tail


def file_leaf(chunk: bytes | memoryview) -> bytes:
    """`PBNode(UnixFSData(T_FILE, chunk, len(chunk)).encode()).encode()` (a CIDv0 import's
    leaf), built with one copy of `chunk`: the framing of a chunk size is computed once."""
    head, tail = _leaf_framing(len(chunk))
    return b"".join((head, chunk, tail))


def file_node(links: list[tuple[bytes, int, int]]) -> bytes:
    """A UnixFS file node over `links` (binary CID, Tsize, file bytes below it): what
    `PBNode(UnixFSData(T_FILE, None, sum(sizes), sizes).encode(), links).encode()` writes,
    from binary CIDs (no CID object per link)."""
    out = bytearray()
    for cid, tsize, _ in links:
        body = _bytes_field(1, cid) + b"\x12\x00" + _uint_field(3, tsize)  # Hash, empty Name, Tsize
        out += _bytes_field(2, body)
    unixfs = _uint_field(1, T_FILE) + _uint_field(3, sum(size for _, _, size in links))
    unixfs += b"".join(_uint_field(4, size) for _, _, size in links)
    out += _bytes_field(1, unixfs)
    return bytes(out)


@dataclass(frozen=True)
class PBLink:
    cid: CID
    tsize: int
    name: str = ""


@dataclass(frozen=True)
class PBNode:
    data: bytes | None
    links: list[PBLink] = field(default_factory=list)

    def encode(self) -> bytes:
        """Canonical dag-pb: every link (Hash, Name, Tsize), then Data."""
        out = bytearray()
        for link in self.links:
            body = (_bytes_field(1, bytes(link.cid)) + _bytes_field(2, link.name.encode())
                    + _uint_field(3, link.tsize))
            out += _bytes_field(2, body)
        if self.data is not None:
            out += _bytes_field(1, self.data)
        return bytes(out)

    @classmethod
    def decode(cls, block: bytes) -> PBNode:
        data, links = None, []
        for num, value in pb_fields(block):
            if num == 1 and isinstance(value, bytes):
                data = value
            elif num == 2 and isinstance(value, bytes):
                cid, name, tsize = None, "", 0
                for lnum, lval in pb_fields(value):
                    if lnum == 1 and isinstance(lval, bytes):
                        cid = cid_from_binary(lval)
                    elif lnum == 2 and isinstance(lval, bytes):
                        name = lval.decode("utf-8")
                    elif lnum == 3 and isinstance(lval, int):
                        tsize = lval
                if cid is None:
                    raise ValueError("dag-pb link without a Hash")
                links.append(PBLink(cid, tsize, name))
            else:
                raise ValueError(f"unexpected dag-pb field {num}")
        return cls(data, links)


@dataclass(frozen=True)
class UnixFSData:
    type: int
    data: bytes | None = None
    filesize: int | None = None
    blocksizes: list[int] = field(default_factory=list)
    hash_type: int | None = None  # HAMTShard only: the multihash code of the name hash
    fanout: int | None = None  # HAMTShard only: slots per shard node

    def encode(self) -> bytes:
        out = _uint_field(1, self.type)
        if self.data:
            out += _bytes_field(2, self.data)
        if self.filesize is not None:
            out += _uint_field(3, self.filesize)
        for size in self.blocksizes:  # proto2 `repeated uint64`, not packed
            out += _uint_field(4, size)
        if self.hash_type is not None:
            out += _uint_field(5, self.hash_type)
        if self.fanout is not None:
            out += _uint_field(6, self.fanout)
        return out

    @classmethod
    def decode(cls, buf: bytes) -> UnixFSData:
        kind, data, filesize, sizes = None, None, None, []
        hamt: dict[int, int] = {}
        for num, value in pb_fields(buf):
            if num == 1 and isinstance(value, int):
                kind = value
            elif num in (5, 6) and isinstance(value, int):
                hamt[num] = value
            elif num == 2 and isinstance(value, bytes):
                data = value
            elif num == 3 and isinstance(value, int):
                filesize = value
            elif num == 4:
                if isinstance(value, int):
                    sizes.append(value)
                else:  # tolerate a packed encoding from other writers
                    pos = 0
                    while pos < len(value):
                        n, pos = read_varint(value, pos)
                        sizes.append(n)
        if kind is None:
            raise ValueError("UnixFS data without a Type")
        return cls(kind, data, filesize, sizes, hamt.get(5), hamt.get(6))
