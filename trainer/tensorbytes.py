"""safetensors bytes for tensor dicts, written and read here for the common case.

Every shard, contribution and round-start state travels as safetensors bytes with sorted
keys and no metadata (`trainer.artifacts.tensors_to_bytes`). The library's `save` and
`load` copy each tensor two or three times and validate in Python per tensor, which
costs more than the outer step itself at our shard sizes; a verifier recomputing a
hundred steps pays it four hundred times. This module does the same job in one pass:

- `encode`: the library's exact bytes (8-byte little-endian header length; a compact
  JSON header whose entries run in data order, by the library's dtype order, then by name; the
  header padded with spaces to a multiple of 8; the raw little-endian data). Names must
  be printable ASCII without quote or backslash, tensors of a known dtype; anything else
  goes to `safetensors.torch.save`.
- `write`: the same bytes to a file descriptor, tensor by tensor (nothing but the header
  is copied: a rank spills its round-start states this way, trainer/artifacts.py `Spill`);
- `decode`: one copy of the data into a writable buffer the returned tensors view (so an
  optimizer may update them in place), after the checks the library makes (the header
  is a JSON object of known dtypes whose offsets tile the data exactly, shapes match
  sizes). Anything else goes to `safetensors.torch.load`, so errors are the library's.

tests/test_trainer.py holds both to the library, byte for byte and tensor for tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from trainer.errors import DlxError

__all__ = ["decode", "encode", "index", "write", "write_all"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
# The library lays tensors out by its Dtype enum, last variant first, then by name.
_LAYOUT = {code: i for i, code in enumerate(["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"])}
_NAME = re.compile(r"^[ !#-\[\]-~]*$")  # printable ASCII but '"' and '\'
MAX_HEADER = 100_000_000  # the library's limit


class _Slow(Exception):
    pass


def _layout(tensors: dict[str, torch.Tensor], *, cpu_only: bool) -> tuple[bytes, list[torch.Tensor]] | None:
    """(the 8-byte length and the padded header, the tensors in data order) of `encode`'s
    bytes, or None where the library must write them (`cpu_only`: a tensor off the CPU
    counts as such)."""
    if sys.byteorder != "little":
        return None
    items = []
    for name, t in tensors.items():
        code = _DTYPES.get(t.dtype)
        if code is None or not _NAME.match(name) or (cpu_only and t.device.type != "cpu") or t.is_sparse:
            return None
        items.append((_LAYOUT[code], name, code, t))
    items.sort(key=lambda item: (item[0], item[1]))
    entries, order, offset = [], [], 0
    for _, name, code, t in items:
        nbytes = t.numel() * t.element_size()
        shape = ",".join(str(d) for d in t.shape)
        entries.append(f'"{name}":{{"dtype":"{code}","shape":[{shape}],"data_offsets":[{offset},{offset + nbytes}]}}')
        order.append(t)
        offset += nbytes
    header = ("{" + ",".join(entries) + "}").encode("ascii")
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header, order


def _data(t: torch.Tensor) -> memoryview:
    """A tensor's bytes: a view of its memory (a CPU copy first for a tensor elsewhere, or
    one that is not contiguous)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def encode(tensors: dict[str, torch.Tensor]) -> bytes:
    """`safetensors.torch.save(tensors)` (no metadata), as bytes."""
    layout = _layout(tensors, cpu_only=True)
    if layout is None:
        return bytes(_st_save(tensors))
    head, order = layout
    # Views of the tensors' memory: the join is the data's only copy.
    return b"".join([head, *(_data(t) for t in order)])


def write(tensors: dict[str, torch.Tensor], fd: int) -> int:
    """Write `encode(tensors)` to the file descriptor `fd`, one tensor at a time from its own
    memory (a tensor off the CPU is copied to it alone): the whole is never in memory.
    Returns the number of bytes written."""
    layout = _layout(tensors, cpu_only=False)
    if layout is None:
        data = encode({k: v.detach().cpu() for k, v in tensors.items()})
        write_all(fd, memoryview(data))
        return len(data)
    head, order = layout
    write_all(fd, memoryview(head))
    total = len(head)
    for t in order:
        view = _data(t)
        write_all(fd, view)
        total += view.nbytes
    return total


def write_all(fd: int, view: memoryview) -> None:
    """Write all of `view` to the file descriptor `fd` (os.write may write less at a time)."""
    view = view.cast("B")
    while view.nbytes:
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]


def index(head: bytes | bytearray | memoryview, total: int) -> tuple[int, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """The layout of `encode`-style bytes of length `total` from their first bytes `head` (at
    least the 8-byte length and the header): (where the data starts, name -> (dtype, shape,
    begin, end), offsets from there, in header order), after the checks `decode` makes.
    ValueError for anything `decode` would leave to the library (so its views are the
    tensors `decode` gives, and other bytes get the library's verdict)."""
    try:
        start, header, spans = _layout_of(head, total)
    except (_Slow, ValueError, UnicodeDecodeError, TypeError, KeyError, OverflowError) as exc:
        raise ValueError(f"not the safetensors layout read here: {type(exc).__name__}") from None
    by_name = {name: (dtype, shape, begin, end) for begin, end, name, dtype, shape, _ in spans}
    return start, {name: by_name[name] for name in header}


class TensorBytesError(DlxError, ValueError):
    """Bytes that are not safetensors (the library's own error, as the project's one line)."""


def decode(data: bytes) -> dict[str, torch.Tensor]:
    """`safetensors.torch.load(data)`, its tensors writable, keys in header order; bytes
    that are not safetensors raise TensorBytesError."""
    try:
        return _decode(data)
    except (_Slow, ValueError, UnicodeDecodeError, TypeError, KeyError, OverflowError, RecursionError):
        pass
    try:
        return _st_load(data)
    except Exception as exc:  # SafetensorError, and whatever torch says of a bad dtype or size
        why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise TensorBytesError(f"not safetensors: {why}") from None


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Slow  # a repeated name
    return out


def _layout_of(data: bytes | bytearray | memoryview, total: int) -> tuple[int, dict, list[tuple]]:
    """(data start, the header, spans (begin, end, name, dtype, shape, numel) in data order)
    of bytes of length `total` whose first bytes are `data`; _Slow (or the parser's
    error) for anything but the layout `encode` writes, tiling the data exactly."""
    if sys.byteorder != "little" or total < 8 or len(data) < 8:
        raise _Slow
    n = int.from_bytes(data[:8], "little")
    if n > MAX_HEADER or 8 + n > total or 8 + n > len(data):
        raise _Slow
    if data[8:9] != b"{":
        raise _Slow
    header = json.loads(bytes(data[8:8 + n]).decode("utf-8"), object_pairs_hook=_unique)
    if "__metadata__" in header:
        raise _Slow
    size = total - 8 - n
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _Slow
        dtype = _BY_NAME[info["dtype"]]
        shape, (begin, end) = info["shape"], info["data_offsets"]
        if not all(type(d) is int and d >= 0 for d in [*shape, begin, end]):
            raise _Slow
        numel = math.prod(shape)
        itemsize = dtype.itemsize
        if end - begin != numel * itemsize:
            raise _Slow
        spans.append((begin, end, name, dtype, shape, numel))
    spans.sort(key=lambda s: (s[0], s[1]))
    at = 0
    for begin, end, *_ in spans:
        if begin != at:
            raise _Slow  # gaps or overlaps: the library's verdict
        at = end
    if at != size:
        raise _Slow
    return 8 + n, header, spans


def _decode(data: bytes) -> dict[str, torch.Tensor]:
    start, header, spans = _layout_of(data, len(data))
    buf = bytearray(memoryview(data)[start:])
    out = {}
    for begin, _, name, dtype, shape, numel in spans:
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=begin).reshape(shape)
    return {name: out[name] for name in header}
