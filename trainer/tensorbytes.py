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
- `decode`: one copy of the data into a writable buffer the returned tensors view (so an
  optimizer may update them in place), after the checks the library makes (the header
  is a JSON object of known dtypes whose offsets tile the data exactly, shapes match
  sizes). Anything else goes to `safetensors.torch.load`, so errors are the library's.

tests/test_trainer.py holds both to the library, byte for byte and tensor for tensor.
"""

from __future__ import annotations

import json
import math
import re
import sys

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

__all__ = ["decode", "encode"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}
# The library lays tensors out by its Dtype enum, last variant first, then by name.
_LAYOUT = {code: i for i, code in enumerate(["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"])}
_NAME = re.compile(r"^[ !#-\[\]-~]*$")  # printable ASCII but '"' and '\'
_MAX_HEADER = 100_000_000  # the library's limit


class _Slow(Exception):
    pass


def encode(tensors: dict[str, torch.Tensor]) -> bytes:
    """`safetensors.torch.save(tensors)` (no metadata), as bytes."""
    if sys.byteorder != "little":
        return bytes(_st_save(tensors))
    items = []
    for name, t in tensors.items():
        code = _DTYPES.get(t.dtype)
        if code is None or not _NAME.match(name) or t.device.type != "cpu" or t.is_sparse:
            return bytes(_st_save(tensors))
        items.append((_LAYOUT[code], name, code, t))
    items.sort(key=lambda item: (item[0], item[1]))
    entries, blobs, offset = [], [], 0
    for _, name, code, t in items:
        t = t.detach().contiguous()
        # A view of the tensor's memory: the join below is the data's only copy.
        blob = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        shape = ",".join(str(d) for d in t.shape)
        entries.append(f'"{name}":{{"dtype":"{code}","shape":[{shape}],"data_offsets":[{offset},{offset + blob.nbytes}]}}')
        blobs.append(blob)
        offset += blob.nbytes
    header = ("{" + ",".join(entries) + "}").encode("ascii")
    header += b" " * (-len(header) % 8)
    return b"".join([len(header).to_bytes(8, "little"), header, *blobs])


def decode(data: bytes) -> dict[str, torch.Tensor]:
    """`safetensors.torch.load(data)`, its tensors writable, keys in header order."""
    try:
        return _decode(data)
    except (_Slow, ValueError, UnicodeDecodeError, TypeError, KeyError, OverflowError):
        return _st_load(data)


def _unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Slow  # a repeated name
    return out


def _decode(data: bytes) -> dict[str, torch.Tensor]:
    if sys.byteorder != "little" or len(data) < 8:
        raise _Slow
    n = int.from_bytes(data[:8], "little")
    if n > _MAX_HEADER or 8 + n > len(data):
        raise _Slow
    if data[8:9] != b"{":
        raise _Slow
    header = json.loads(bytes(data[8:8 + n]).decode("utf-8"), object_pairs_hook=_unique)
    if "__metadata__" in header:
        raise _Slow
    size = len(data) - 8 - n
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
    buf = bytearray(memoryview(data)[8 + n:])
    out = {}
    for begin, _, name, dtype, shape, numel in spans:
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=begin).reshape(shape)
    return {name: out[name] for name in header}
