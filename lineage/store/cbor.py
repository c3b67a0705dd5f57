"""Fast DAG-CBOR decoding for the blocks this project writes (manifests, configs).

`dag_cbor.decode` builds every CID link through multiformats, which validates each
argument of each call: about half a millisecond a link, eight milliseconds a manifest,
most of what a verifier spends on a step's manifest. `decode` here reads the canonical
DAG-CBOR subset directly (unsigned and negative integers, byte and text strings, arrays,
maps, tag 42 CID links, false/true/null, 64-bit floats, all with definite, minimal
lengths and map keys in canonical order) and builds our own CIDs the fast way
(`cid.cid_from_binary`). Anything outside that subset (a non-minimal length, an
unsorted or repeated key, a half-precision float, another tag, trailing bytes) is handed
to `dag_cbor.decode`, so the result, and every error, is exactly the library's: the fast
path only ever accepts bytes the library decodes to the same value.

Both paths are bounded first: `check_nesting` walks the block's heads without recursion
and refuses (CborError, a one-line error of the project's) a value nested deeper than
`limits.MAX_CBOR_DEPTH`, an indefinite length (which DAG-CBOR forbids) or a block above
`limits.MAX_BLOCK`, before either decoder recurses. Every decoding error is a CborError
naming `what` (the CID, or the file, the caller passes).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import dag_cbor

from lineage.errors import StorageError

from .cid import cid_from_binary
from .limits import MAX_BLOCK, MAX_CBOR_DEPTH

__all__ = ["CborError", "check_nesting", "decode"]


class CborError(StorageError, ValueError):
    """Bytes that are not a DAG-CBOR block dlx reads."""


class _Slow(Exception):
    """Not the canonical subset: let dag_cbor decide."""


_FLOAT = struct.Struct(">d")


def decode(block: bytes, what: object = "a block") -> Any:
    """`dag_cbor.decode(block)`, faster for canonical blocks; CIDs come back in base32.
    CborError naming `what` for anything that is not a DAG-CBOR value within the bounds."""
    check_nesting(block, what)
    try:
        value, pos = _item(block, 0)
        if pos != len(block):
            raise _Slow
        return value
    except (_Slow, IndexError, ValueError, UnicodeDecodeError, struct.error):
        pass
    try:
        return dag_cbor.decode(block)
    except Exception as exc:  # the library raises its own types, and ValueError, KeyError...
        why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise CborError(f"{what}: not a DAG-CBOR block ({why})") from None


def check_nesting(block: bytes, what: object = "a block", limit: int = MAX_CBOR_DEPTH) -> None:
    """Refuse a block above MAX_BLOCK, an indefinite length, a reserved head, or a value
    nested deeper than `limit`, reading heads in one pass with an explicit stack (each head
    takes at least one byte, so the pass is linear in the block). A truncated block passes
    here and is refused by the decoder."""
    if len(block) > MAX_BLOCK:
        raise CborError(f"{what}: a {len(block)}-byte block, above the {MAX_BLOCK}-byte limit")
    pos, todo = 0, [1]  # items still to read at each open level
    while todo and pos < len(block):
        if todo[-1] == 0:
            todo.pop()
            continue
        todo[-1] -= 1
        major, info = block[pos] >> 5, block[pos] & 0x1F
        pos += 1
        if info > 27:
            raise CborError(f"{what}: not DAG-CBOR (an indefinite length or a reserved head at byte {pos - 1})")
        size = 0 if info < 24 else 1 << (info - 24)
        n = info if info < 24 else int.from_bytes(block[pos:pos + size], "big")
        pos += size
        if major in (2, 3):
            pos += n
        elif major in (4, 5, 6):
            todo.append(n * 2 if major == 5 else 1 if major == 6 else n)
            if len(todo) > limit + 1:
                raise CborError(f"{what}: a DAG-CBOR value nested deeper than {limit} levels")


def _length(data: bytes, pos: int, info: int) -> tuple[int, int]:
    """The argument of a head with additional info `info`, which must be minimal."""
    if info < 24:
        return info, pos
    if info == 24:
        n = data[pos]
        if n < 24:
            raise _Slow
        return n, pos + 1
    if info in (25, 26, 27):
        size = 1 << (info - 24)
        if pos + size > len(data):
            raise _Slow
        n = int.from_bytes(data[pos:pos + size], "big")
        if n < (1 << (8 * size // 2)):  # would have fitted the next smaller head
            raise _Slow
        return n, pos + size
    raise _Slow  # indefinite lengths and reserved values


def _key_order(key: str) -> tuple[int, bytes]:
    raw = key.encode()
    return len(raw), raw


def _item(data: bytes, pos: int) -> tuple[Any, int]:
    head = data[pos]
    major, info = head >> 5, head & 0x1F
    pos += 1
    if major == 7:
        if info == 20:
            return False, pos
        if info == 21:
            return True, pos
        if info == 22:
            return None, pos
        if info == 27:
            (value,) = _FLOAT.unpack_from(data, pos)
            if not math.isfinite(value):
                raise _Slow
            return value, pos + 8
        raise _Slow
    n, pos = _length(data, pos, info)
    if major == 0:
        return n, pos
    if major == 1:
        return -1 - n, pos
    if major == 2:
        end = pos + n
        if end > len(data):
            raise _Slow
        return data[pos:end], end
    if major == 3:
        end = pos + n
        if end > len(data):
            raise _Slow
        return data[pos:end].decode("utf-8"), end
    if major == 4:
        out = []
        for _ in range(n):
            value, pos = _item(data, pos)
            out.append(value)
        return out, pos
    if major == 5:
        obj: dict[str, Any] = {}
        last: tuple[int, bytes] | None = None
        for _ in range(n):
            if data[pos] >> 5 != 3:
                raise _Slow  # DAG-CBOR keys are strings
            key, pos = _item(data, pos)
            order = _key_order(key)
            if last is not None and order <= last:
                raise _Slow  # unsorted or repeated
            last = order
            obj[key], pos = _item(data, pos)
        return obj, pos
    if major == 6 and n == 42:
        if data[pos] >> 5 != 2:
            raise _Slow
        raw, pos = _item(data, pos)
        if not raw or raw[0] != 0:
            raise _Slow
        return cid_from_binary(raw[1:]), pos
    raise _Slow
