"""CIDs for the blocks this project stores: CIDv1, sha2-256, base32.

On chain a CID is kept as its bare 32-byte sha2-256 digest; the codec is fixed by the
field it sits in (a checkpoint manifest is dag-cbor, a shard or contribution is raw), so
`cid_from_digest` rebuilds the full CID.
"""

from __future__ import annotations

import hashlib

from multiformats import CID, multihash

RAW = "raw"
DAG_CBOR = "dag-cbor"


def cid_for(data: bytes, codec: str = RAW) -> CID:
    """The CIDv1 (sha2-256) of `data` under `codec`."""
    return cid_from_digest(hashlib.sha256(data).digest(), codec)


def cid_from_digest(digest: bytes, codec: str) -> CID:
    if len(digest) != 32:
        raise ValueError(f"a sha2-256 digest has 32 bytes, got {len(digest)}")
    return CID("base32", 1, codec, multihash.wrap(digest, "sha2-256"))


def digest_of(cid: CID) -> bytes:
    """The raw 32-byte sha2-256 digest inside `cid` (what the ledger stores)."""
    code = multihash.from_digest(bytes(cid.digest)).name
    if code != "sha2-256":
        raise ValueError(f"{cid} uses {code}, only sha2-256 is supported")
    return bytes(cid.raw_digest)


def parse_cid(text: str | CID) -> CID:
    if isinstance(text, CID):
        return text.set(base="base32")
    try:
        return CID.decode(text).set(base="base32")
    except Exception as exc:  # multiformats raises several unrelated types
        raise ValueError(f"not a CID: {text!r} ({exc})") from None
