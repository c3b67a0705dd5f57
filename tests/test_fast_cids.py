"""The blockstore's fast CID paths give exactly what multiformats gives.

multiformats validates every argument of every CID it builds or prints (about a
millisecond a call); `lineage.store.blockstore` builds and names the CIDs of our own blocks from
their bytes instead. These tests hold the fast paths to multiformats' answers.
"""

from __future__ import annotations

import hashlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multiformats import CID, multihash

from lineage.store.blockstore import Blockstore
from lineage.store.cid import (
    DAG_CBOR,
    DAG_PB,
    RAW,
    as_v1,
    block_name,
    cid_for,
    cid_from_binary,
    cid_from_digest,
    cid_of_block,
    digest_of,
    parse_cid,
)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=64), codec=st.sampled_from([RAW, DAG_PB, DAG_CBOR]))
def test_fast_cids_equal_multiformats_cids(data, codec):
    slow = CID("base32", 1, codec, multihash.wrap(hashlib.sha256(data).digest(), "sha2-256"))
    for fast in (cid_of_block(data, codec), cid_for(data, codec)):
        assert fast == slow and str(fast) == str(slow) and fast.codec.name == codec
    assert digest_of(slow) == bytes(slow.raw_digest) == hashlib.sha256(data).digest()
    assert cid_from_binary(bytes(slow)) == parse_cid(bytes(slow))
    assert str(cid_from_binary(bytes(slow))) == str(slow)
    name, digest = block_name(slow)
    assert (name, digest) == (str(slow), hashlib.sha256(data).digest())
    assert block_name(str(slow)) == (name, digest)


def test_other_cid_forms_take_the_multiformats_way():
    digest = hashlib.sha256(b"x").digest()
    v0 = cid_from_digest(digest, DAG_PB, 0)  # Qm...: kept under its CIDv1 name
    assert block_name(v0) == (str(as_v1(v0)), digest)
    assert block_name(str(v0)) == (str(as_v1(v0)), digest)
    v1 = cid_from_digest(digest, RAW)
    for text in (v1.encode("base58btc"), str(v1).upper()):  # other bases
        assert block_name(text) == (str(v1), digest)
    for bad in ("b" + "a" * 58, "not a cid", ""):
        with pytest.raises(ValueError):
            block_name(bad)


def test_a_store_reads_blocks_by_any_form_of_their_cid(tmp_path):
    store = Blockstore(tmp_path)
    cid = store.put(b"block")
    for form in (cid, str(cid), cid.encode("base58btc"), bytes(cid)):
        assert store.get(form) == b"block"
        assert store.has(form)
    assert list(store) == [cid]


def test_the_fast_paths_are_much_faster_than_multiformats():
    """Relative, so a busy machine does not fail it: reading a 256 KiB block once cost a
    few milliseconds of CID handling, more than hashing it."""
    cids = [cid_for(i.to_bytes(4, "big")) for i in range(50)]
    raws = [bytes(c) for c in cids]

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    slow = best(lambda: [(str(as_v1(parse_cid(r))), parse_cid(r).raw_digest) for r in raws])
    fast = best(lambda: [(block_name(cid_from_binary(r))) for r in raws])
    assert fast * 5 < slow, (fast, slow)
