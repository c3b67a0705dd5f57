"""Walking DAGs of blocks: the links of a raw, dag-pb or dag-cbor block, and everything
reachable from a set of roots (for pins, garbage collection and CAR export)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from multiformats import CID

from lineage.errors import BlockNotFoundError, StorageError

from . import cbor
from .cid import DAG_CBOR, DAG_PB, RAW, as_v1, parse_cid
from .dagpb import PBNode
from .unixfs import BlockReader


def links_of(cid: CID, block: bytes) -> list[CID]:
    """The CIDs `block` (whose CID is `cid`) links to, in order."""
    codec = cid.codec.name
    try:
        if codec == RAW:
            return []
        if codec == DAG_PB:
            return [link.cid for link in PBNode.decode(block).links]
        if codec == DAG_CBOR:
            return list(_cbor_links(cbor.decode(block, cid)))
    except (ValueError, UnicodeDecodeError) as exc:
        raise StorageError(f"{cid}: malformed {codec} block: {exc}") from None
    raise StorageError(f"{cid}: cannot follow links of codec {codec}")


def _cbor_links(node: Any) -> Iterator[CID]:
    if isinstance(node, CID):
        yield parse_cid(node)
    elif isinstance(node, dict):
        for value in node.values():
            yield from _cbor_links(value)
    elif isinstance(node, list):
        for value in node:
            yield from _cbor_links(value)


def walk(store: BlockReader, roots: Iterable[CID]) -> Iterator[tuple[CID, bytes]]:
    """Every block reachable from `roots`, once each, depth first in link order (the CAR
    order Kubo's `dag export` uses); each read is re-hashed by `store.get`. A block the
    store records as removed by retention (`Blockstore.pruned`) is passed over if gone."""
    pruned = store.pruned() if hasattr(store, "pruned") else set()
    seen: set[str] = set()
    stack = list(reversed([parse_cid(r) for r in roots]))
    while stack:
        cid = stack.pop()
        key = str(as_v1(cid))
        if key in seen:
            continue
        seen.add(key)
        try:
            block = store.get(cid)
        except BlockNotFoundError:
            if key in pruned:
                continue
            raise
        yield cid, block
        stack.extend(reversed(links_of(cid, block)))


def reachable(store: BlockReader, roots: Iterable[CID]) -> list[CID]:
    return [cid for cid, _ in walk(store, roots)]
