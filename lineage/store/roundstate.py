"""Round-start states stored by reference to the committed shard whose weights they hold.

A round-start state (`trainer.rounds.round_state`: safetensors with `param/<name>` the
rank's weights at round start, `inner/...`, `compress/...`, `round/...`) usually starts
from a committed stage shard (`param/<name>`, `momentum/<name>`): under the synchronous
rule always the parent checkpoint's, under `restart` that or the one of step t-2. Storing
its weights again costs a copy of the model a step (the replicas' copies share their
256 KiB blocks, laid out alike). So where the state's `param/*` tensors are byte for byte
a committed shard's, the sink stores

- the rest of the state (every tensor but `param/*`) as a UnixFS file, safetensors laid
  out as `trainer.artifacts.tensors_to_bytes` lays it out, and
- a DAG-CBOR node, the link the manifest's `replay[row][s]` holds:

      {version: 1, kind: "round-state", weights: CID (the shard file), rest: CID (that
       file), size: bytes of the state, sha256: sha-256 of the state}

and a reader rebuilds the original bytes exactly: the rest's tensors and the shard's
`param/*` tensors, laid out again (data by dtype in safetensors' order, then by name; a
compact JSON header in data order, padded with spaces to a multiple of 8), then checked
against `size` and `sha256`. Anything else (weights derived by the eager or partial rule,
a state of another layout) is stored as before: the state as a plain UnixFS file, which
readers take as it is. The writer only chooses the reference form after rebuilding the
header from the parts and finding the original's, byte for byte.

Readers bound what they read: the node is a few hundred bytes, `weights` and `rest` must
be UnixFS files (a raw or dag-pb root, never another node), `weights` a shard (only
`param/*` and `momentum/*` tensors, and one of the committed shards the reader allows,
`reference_shards`), `rest` free of `param/*`, `size` no larger than the two files
together and a header's worth (checked on their roots before they are read), and the
rebuilt bytes must have `size` and `sha256`. Any failure is a `StorageError` naming the
node.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dag_cbor
from multiformats import CID

from lineage.errors import StorageError

from . import cbor
from .cid import DAG_CBOR, DAG_PB, RAW, as_v1, block_name, parse_cid
from .dagpb import PBNode, UnixFSData
from .manifest import Manifest, get_manifest
from .unixfs import check_file, import_bytes, read_bytes

__all__ = [
    "KIND",
    "RoundStateRef",
    "check_round_state",
    "is_reference",
    "param_digest",
    "put_round_state",
    "read_round_state",
    "read_start_state",
    "reference_shards",
    "round_state_ref",
]

KIND = "round-state"
VERSION = 1
PARAM = "param/"
MOMENTUM = "momentum/"
#: The largest node a reader decodes: an honest one is about 160 bytes.
MAX_NODE = 1024
#: safetensors' own limit on a header.
MAX_HEADER = 100_000_000
#: How much larger the rebuilt state's header may be than the two files' headers together
#: (offsets of the tensors laid out after the weights have more digits): the bound a node's
#: `size` is held to before its files are read.
HEADER_SLACK = 1 << 20

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# safetensors lays tensors out by its Dtype enum, last variant first, then by name
# (trainer/tensorbytes.py, held to the library byte for byte by tests/test_trainer.py).
_LAYOUT = {code: i for i, code in enumerate(["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"])}
_NAME = re.compile(r"^[ !#-\[\]-~]*$")  # printable ASCII but '"' and '\': written verbatim in JSON


# -- safetensors, read and laid out without torch ------------------------------------------


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a tensor name is repeated")
    return out


def _tensors(data: bytes | memoryview) -> dict[str, _Tensor]:
    """The tensors of safetensors bytes, each viewing its data; ValueError for anything
    but a metadata-free file of known dtypes whose data the offsets tile exactly."""
    view = memoryview(data)
    if len(view) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(view[:8], "little")
    if n > MAX_HEADER or 8 + n > len(view):
        raise ValueError(f"header length {n} does not fit the {len(view)} bytes")
    header = json.loads(bytes(view[8:8 + n]).decode("utf-8"), object_pairs_hook=_unique)
    if not isinstance(header, dict) or "__metadata__" in header:
        raise ValueError("the header is not a metadata-free map of tensors")
    body, spans = view[8 + n:], []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{name}: malformed header entry")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _ITEMSIZE or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
            raise ValueError(f"{name}: malformed header entry")
        if not all(type(d) is int and d >= 0 for d in [*shape, *offsets]):
            raise ValueError(f"{name}: malformed shape or offsets")
        begin, end = offsets
        if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
            raise ValueError(f"{name}: offsets do not match its shape")
        spans.append((begin, end, name, dtype, tuple(shape)))
    spans.sort()
    at = 0
    for begin, end, *_ in spans:
        if begin != at:
            raise ValueError("the offsets do not tile the data")
        at = end
    if at != len(body):
        raise ValueError("the offsets do not tile the data")
    return {name: _Tensor(name, dtype, shape, body[begin:end]) for begin, end, name, dtype, shape in spans}


def _layout(tensors: Iterable[_Tensor]) -> list[bytes | memoryview]:
    """The pieces of the safetensors file `trainer.artifacts.tensors_to_bytes` writes for
    `tensors`: 8-byte header length, header, then each tensor's data."""
    items = sorted(tensors, key=lambda t: (_LAYOUT[t.dtype], t.name))
    entries, offset = [], 0
    for t in items:
        if not _NAME.match(t.name):
            raise ValueError(f"tensor name {t.name!r} is not written verbatim")
        shape = ",".join(str(d) for d in t.shape)
        entries.append(f'"{t.name}":{{"dtype":"{t.dtype}","shape":[{shape}],'
                       f'"data_offsets":[{offset},{offset + t.data.nbytes}]}}')
        offset += t.data.nbytes
    header = ("{" + ",".join(entries) + "}").encode("ascii")
    header += b" " * (-len(header) % 8)
    return [len(header).to_bytes(8, "little"), header, *(t.data for t in items)]


def _params(tensors: dict[str, _Tensor]) -> list[_Tensor]:
    return [t for name, t in tensors.items() if name.startswith(PARAM)]


def _digest(pieces: Iterable[bytes | memoryview]) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def param_digest(data: bytes) -> bytes | None:
    """The sha-256 of the `param/*` tensors of a stage shard or round state (of the
    safetensors file they alone would make: names, dtypes, shapes and bits); None when
    `data` is not such a file or holds no `param/*` tensor."""
    try:
        params = _params(_tensors(data))
        return _digest(_layout(params)) if params else None
    except (ValueError, UnicodeDecodeError):
        return None


# -- writing ----------------------------------------------------------------------------------


def put_round_state(store: Any, data: bytes, shards: Sequence[tuple[CID, bytes | None]]) -> CID:
    """Store a round-start state; returns the link for the manifest's `replay` table.
    `shards`: the committed shards it may refer to, with their `param_digest`, first
    preferred (`reference_shards`). A state whose `param/*` tensors are one of theirs, and
    whose bytes the reader's layout gives back exactly, is stored as a reference node;
    any other as a plain UnixFS file, as before."""
    ref = _reference(data, shards)
    if ref is None:
        return import_bytes(data, store.put).cid
    weights, rest = ref
    node: dict[str, Any] = {"version": VERSION, "kind": KIND, "weights": weights,
                            "rest": import_bytes(rest, store.put).cid, "size": len(data),
                            "sha256": hashlib.sha256(data).digest()}
    return store.put(dag_cbor.encode(node), DAG_CBOR)


def _reference(data: bytes, shards: Sequence[tuple[CID, bytes | None]]) -> tuple[CID, bytes] | None:
    """(the shard, the rest file) when `data` can refer to one of `shards`, else None."""
    if not any(digest for _, digest in shards):
        return None
    try:
        tensors = _tensors(data)
        params = _params(tensors)
        digest = _digest(_layout(params)) if params else None
        weights = next((cid for cid, d in shards if d is not None and d == digest), None)
        if weights is None:
            return None
        rest = [t for name, t in tensors.items() if not name.startswith(PARAM)]
        # The rebuilt file's data is the original's own tensors, each placed at the offset
        # its header entry names: the same header, byte for byte, is the same file.
        whole = _layout([*rest, *params])
        if bytes(whole[0]) + bytes(whole[1]) != bytes(memoryview(data)[:8 + len(whole[1])]):
            return None
        return weights, b"".join(_layout(rest))
    except (ValueError, UnicodeDecodeError):
        return None


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundStateRef:
    """A decoded reference node."""

    cid: CID
    weights: CID
    rest: CID
    size: int
    sha256: bytes


def is_reference(cid: CID | str) -> bool:
    """Whether a `replay` link is a reference node (DAG-CBOR) rather than a plain file."""
    return parse_cid(cid).codec.name == DAG_CBOR


def round_state_ref(store: Any, cid: CID | str) -> RoundStateRef:
    """The reference node `cid`, checked for shape; StorageError naming it otherwise."""
    cid = parse_cid(cid)
    block = store.get(cid)
    if len(block) > MAX_NODE:
        raise StorageError(f"round state {cid}: a {len(block)}-byte node, more than a reference ({MAX_NODE})")
    try:
        node = cbor.decode(block)
    except Exception as exc:  # the DAG-CBOR library's own error types
        raise StorageError(f"round state {cid}: not DAG-CBOR ({str(exc).splitlines()[0] if str(exc) else exc})") from None
    keys = {"version", "kind", "weights", "rest", "size", "sha256"}
    if not isinstance(node, dict) or node.get("kind") != KIND or node.get("version") != VERSION or set(node) != keys:
        raise StorageError(f"round state {cid}: not a version-{VERSION} {KIND} node")
    weights, rest, size, sha = node["weights"], node["rest"], node["size"], node["sha256"]
    for what, link in (("weights", weights), ("rest", rest)):
        if not isinstance(link, CID) or link.codec.name not in (RAW, DAG_PB):
            raise StorageError(f"round state {cid}: its {what} is not a link to a UnixFS file")
    if isinstance(size, bool) or not isinstance(size, int) or size < 8 or not isinstance(sha, bytes) or len(sha) != 32:
        raise StorageError(f"round state {cid}: malformed size or sha256")
    return RoundStateRef(cid, parse_cid(weights), parse_cid(rest), size, sha)


def _file_size(store: Any, cid: CID) -> int:
    """The size a UnixFS file's root declares (a raw leaf: its own), before reading it."""
    block = store.get(cid)
    if cid.codec.name == RAW:
        return len(block)
    try:
        fs = UnixFSData.decode(PBNode.decode(block).data or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise StorageError(f"{cid} is not a UnixFS node: {exc}") from None
    if fs.filesize is None:
        raise StorageError(f"{cid} is not a UnixFS file")
    return fs.filesize


def read_round_state(store: Any, cid: CID | str, *, shards: Collection[CID] | None = None,
                     workers: int = 4) -> bytes:
    """The bytes of the round-start state the manifest links as `cid`: a plain UnixFS
    file as it is, a reference node rebuilt and checked (module docstring). `shards`: the
    committed shards its weights may be (None: any shard, for a reader without the run's
    history). Every block read is re-hashed; any failure is a StorageError."""
    cid = parse_cid(cid)
    if not is_reference(cid):
        return read_bytes(store, cid, workers=workers)
    ref, pieces = _pieces(store, cid, shards, None, workers)
    data = b"".join(pieces)
    if hashlib.sha256(data).digest() != ref.sha256:
        raise StorageError(f"round state {cid}: the rebuilt bytes do not have the node's sha256")
    return data


def check_round_state(store: Any, cid: CID | str, *, shards: Collection[CID] | None = None,
                      known: Mapping[str, bytes] | None = None, workers: int = 4) -> int:
    """`read_round_state`'s checks without keeping the bytes; returns the state's size.
    `known`: bytes of shards the caller has read and checked already, by block name
    (`lineage.store.cid.block_name`), not read again."""
    cid = parse_cid(cid)
    if not is_reference(cid):
        return check_file(store, cid, workers=workers)
    ref, pieces = _pieces(store, cid, shards, known, workers)
    if _digest(pieces) != ref.sha256:
        raise StorageError(f"round state {cid}: the rebuilt bytes do not have the node's sha256")
    return ref.size


def _pieces(store: Any, cid: CID, shards: Collection[CID] | None, known: Mapping[str, bytes] | None,
            workers: int) -> tuple[RoundStateRef, list[bytes | memoryview]]:
    """The node `cid` and the pieces of the state it rebuilds to, of its `size` (its
    sha256 is the caller's to check)."""
    ref = round_state_ref(store, cid)
    if shards is not None and str(as_v1(ref.weights)) not in {str(as_v1(parse_cid(c))) for c in shards}:
        allowed = ", ".join(str(c) for c in shards) or "none"
        raise StorageError(f"round state {cid}: its weights {ref.weights} are not a committed shard it may "
                           f"start from ({allowed})")
    weights = (known or {}).get(block_name(ref.weights)[0])
    declared = _file_size(store, ref.rest) + (len(weights) if weights is not None else _file_size(store, ref.weights))
    if ref.size > declared + HEADER_SLACK:
        raise StorageError(f"round state {cid}: says {ref.size} bytes, more than its two files hold ({declared})")
    rest = read_bytes(store, ref.rest, workers=workers)
    if weights is None:
        weights = read_bytes(store, ref.weights, workers=workers)
    pieces = _rebuild(ref, rest, weights)
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
    if size != ref.size:
        raise StorageError(f"round state {cid}: rebuilt {size} bytes, the node says {ref.size}")
    return ref, pieces


def _rebuild(ref: RoundStateRef, rest_bytes: bytes, weights_bytes: bytes) -> list[bytes | memoryview]:
    """The pieces of the state: the rest's tensors and the shard's weights, laid out."""
    cid = ref.cid
    try:
        rest = _tensors(rest_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StorageError(f"round state {cid}: its rest {ref.rest} is not safetensors ({exc})") from None
    try:
        shard = _tensors(weights_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StorageError(f"round state {cid}: its weights {ref.weights} are not a shard ({exc})") from None
    if any(name.startswith(PARAM) for name in rest):
        raise StorageError(f"round state {cid}: its rest {ref.rest} holds param/ tensors")
    params = _params(shard)
    if not params or any(not name.startswith((PARAM, MOMENTUM)) for name in shard):
        raise StorageError(f"round state {cid}: its weights {ref.weights} are not a shard "
                           "(param/ and momentum/ tensors)")
    try:
        return _layout([*rest.values(), *params])
    except ValueError as exc:
        raise StorageError(f"round state {cid}: cannot be laid out ({exc})") from None


# -- which shards a state may refer to --------------------------------------------------------


def reference_shards(store: Any, parent: CID | str | None, stage: int,
                     manifests: dict[str, Manifest] | None = None) -> list[CID]:
    """The committed shards a round-start state of stage `stage` may refer to, in the step
    whose parent checkpoint is `parent`: that checkpoint's stage shard (every rule may
    start a round from it), then its parent's (the restart rule's round of delay 1).
    `manifests`: a cache by CID text."""
    out: list[CID] = []
    cache = {} if manifests is None else manifests
    for _ in range(2):
        if parent is None:
            break
        key = str(parent)
        if key not in cache:
            cache[key] = get_manifest(store, parent)
        m = cache[key]
        if stage < len(m.stages):
            out.append(m.stages[stage])
        parent = m.parent
    return out


def read_start_state(store: Any, manifest: Manifest, row: int, stage: int, *,
                     manifests: dict[str, Manifest] | None = None, workers: int = 4) -> bytes:
    """Start state `replay[row][stage]` of `manifest`, whichever way it is stored, its
    weights (if a reference) one of the shards `reference_shards` allows."""
    cid = manifest.replay[row][stage]
    shards = reference_shards(store, manifest.parent, stage, manifests) if is_reference(cid) else None
    return read_round_state(store, cid, shards=shards, workers=workers)
