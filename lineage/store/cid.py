"""CIDs for the blocks this project stores: sha2-256, CIDv1 in base32 by default.

Codecs: `raw` (file chunks, small files), `dag-pb` (UnixFS file nodes above one chunk,
and every block of a CIDv0 import) and `dag-cbor` (manifests, job configuration). CIDv0
(`Qm...`) is always dag-pb; `as_v1` gives the CIDv1 with the same codec and digest, which
is the name a block is stored under, so a v0 and a v1 CID of one block share one file.

Rebuilding a CID from the 32-byte digest kept on chain
------------------------------------------------------
On chain a CID is kept as its bare sha2-256 digest. For a manifest (`checkpoint`,
`parent`, `genesis`, `config`) the codec is fixed by the field: dag-cbor. A contribution
or stage shard is a UnixFS file imported as `ipfs add --cid-version=1` does, and there
the codec depends on the file's size: a file of at most one chunk (256 KiB, including the
empty file) is a single `raw` block, a larger file has a `dag-pb` root. The digest alone
cannot tell which, so the full CID is rebuilt from the checkpoint instead: the chain's
checkpoint digest names the manifest (dag-cbor), and the manifest links every stage and
contribution by its full CID; `lineage.audit.query` checks that each on-chain contribution
digest equals `digest_of` the manifest's CID for that slot. Where only a digest is at
hand, `file_cid_candidates` lists the two possible CIDs (raw first, then dag-pb) and a
store is asked which it holds (`lineage.store.unixfs.resolve_file_digest`). Both can never be
stored for different content: one digest means one byte string.
"""

from __future__ import annotations

import base64
import hashlib

from multiformats import CID, multibase, multicodec, multihash

from lineage.errors import StorageError

RAW = "raw"
DAG_PB = "dag-pb"
DAG_CBOR = "dag-cbor"

# Fast CIDs for our own blocks: multiformats validates every argument of every CID it
# builds or takes apart (about a millisecond a call), which dwarfs hashing a 256 KiB
# block. A CIDv1 with sha2-256 and one of our three codecs is built here from its bytes.
_CODECS = {c.code: c for c in map(multicodec.get, (RAW, DAG_PB, DAG_CBOR))}
_SHA2_256, _BASE32 = multihash.get("sha2-256"), multibase.get("base32")
_MH_PREFIX = b"\x12\x20"  # multihash sha2-256, 32 bytes
# multiformats' unvalidated constructor (0.3.x); without it every CID takes the slow way.
_new_cid = getattr(CID, "_new_instance", None)


_CODE_OF = {c.name: code for code, c in _CODECS.items()}


class CidError(StorageError, ValueError):
    """Text or bytes that are no CID, or a CID whose multihash dlx does not verify."""


def _fast(raw: bytes) -> bool:
    return len(raw) == 36 and raw[0] == 1 and raw[1] in _CODECS and raw[2:4] == _MH_PREFIX


def cid_from_binary(raw: bytes) -> CID:
    """`parse_cid(raw)` (the same CID object, base32) for a binary CIDv1 with sha2-256
    and a raw, dag-pb or dag-cbor codec, without multiformats' per-call validation."""
    if _new_cid is not None and _fast(raw):
        return _new_cid(CID, _BASE32, 1, _CODECS[raw[1]], _SHA2_256, raw[2:])
    return parse_cid(raw)


def cid_for(data: bytes | memoryview, codec: str = RAW, version: int = 1) -> CID:
    """The CID (sha2-256) of `data` under `codec`; version 0 only for dag-pb."""
    return cid_from_digest(hashlib.sha256(data).digest(), codec, version)


def cid_from_digest(digest: bytes, codec: str, version: int = 1) -> CID:
    if len(digest) != 32:
        raise ValueError(f"a sha2-256 digest has 32 bytes, got {len(digest)}")
    code = _CODE_OF.get(codec)
    if version == 1 and code is not None:
        return cid_from_binary(bytes((1, code)) + _MH_PREFIX + bytes(digest))
    mh = multihash.wrap(digest, "sha2-256")
    if version == 0:
        if codec != DAG_PB:
            raise ValueError(f"a CIDv0 is always dag-pb, not {codec}")
        return CID("base58btc", 0, DAG_PB, mh)
    return CID("base32", 1, codec, mh)


def file_cid_candidates(digest: bytes) -> list[CID]:
    """The CIDv1s a UnixFS file root with this digest can have: raw (one chunk), dag-pb."""
    return [cid_from_digest(digest, RAW), cid_from_digest(digest, DAG_PB)]


def digest_of(cid: CID) -> bytes:
    """The raw 32-byte sha2-256 digest inside `cid` (what the ledger stores)."""
    mh = cid.digest
    if len(mh) == 34 and mh[:2] == _MH_PREFIX:
        return bytes(mh[2:])
    code = multihash.from_digest(bytes(cid.digest)).name
    if code != "sha2-256":
        raise ValueError(f"{cid} uses {code}, only sha2-256 is supported")
    return bytes(cid.raw_digest)


def as_v1(cid: CID) -> CID:
    """`cid` as CIDv1 in base32 (a CIDv0 becomes the dag-pb CIDv1 of the same block)."""
    if cid.version == 0:
        return CID("base32", 1, DAG_PB, cid.digest)
    return cid.set(base="base32")


def parse_cid(text: str | bytes | CID) -> CID:
    """A CID from text (any multibase, or `Qm...`) or binary form; v1 comes back in base32.

    Only a sha2-256 multihash of 32 bytes is accepted (CidError otherwise, naming the
    hash): every block read is re-hashed with it, and a CID naming another hash (blake2b,
    identity, ...) cannot be checked here."""
    if isinstance(text, CID):
        cid = text
    else:
        try:
            cid = CID.decode(text)
        except Exception as exc:  # multiformats raises several unrelated types
            shown = repr(text) if len(text) <= 120 else f"{text[:120]!r}..."
            raise CidError(f"not a CID: {shown} ({_first_line(exc)})") from None
    if bytes(cid.digest[:2]) != _MH_PREFIX or len(cid.digest) != 34:
        raise CidError(f"{cid}: its multihash is {_hash_name(bytes(cid.digest))}; dlx verifies sha2-256 only")
    return cid if cid.version == 0 else cid.set(base="base32")


def _first_line(exc: Exception) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _hash_name(mh: bytes) -> str:
    try:
        return str(multihash.from_digest(mh).name)
    except Exception:  # an unknown code or a malformed multihash
        return f"an unknown multihash (prefix {mh[:4].hex()})"


def cid_of_block(data: bytes | memoryview, codec: str = RAW) -> CID:
    """`cid_for(data, codec)`, fast for our three codecs."""
    code = _CODE_OF.get(codec)
    if code is None:
        return cid_for(data, codec)
    return cid_from_binary(bytes((1, code)) + _MH_PREFIX + hashlib.sha256(data).digest())


def binary_cid_of_block(data: bytes | memoryview, codec: str = RAW) -> bytes:
    """`bytes(cid_of_block(data, codec))`, the binary CIDv1 a dag-pb link holds, without
    building a CID object (the importer's way: one per 256 KiB block cost a twentieth of
    hashing it). `data` is hashed where it lies (hashlib takes any buffer, no copy)."""
    code = _CODE_OF.get(codec)
    if code is None:
        return bytes(cid_for(data, codec))
    return bytes((1, code)) + _MH_PREFIX + hashlib.sha256(data).digest()


def relabel_v0(raw: bytes) -> bytes:
    """The binary CIDv0 (the bare multihash) of the block a binary dag-pb CIDv1 names."""
    return raw[2:] if raw[:1] == b"\x01" else raw


def block_name(cid: CID | str | bytes) -> tuple[str, bytes]:
    """(the CIDv1's base32 text, the sha2-256 digest) under which `cid`'s block is kept
    (a CIDv0 is named as its CIDv1); raises ValueError for something that is no CID."""
    raw = None
    if isinstance(cid, bytes):
        raw = cid if _fast(cid) else None
    elif isinstance(cid, CID):
        mh, code = cid.digest, cid.codec.code
        if len(mh) == 34 and mh[:2] == _MH_PREFIX and code in _CODECS:
            raw = bytes((1, code)) + mh
    elif isinstance(cid, str) and len(cid) == 59 and cid[0] == "b":
        try:
            decoded = base64.b32decode(cid[1:].upper() + "======")
        except ValueError:
            decoded = b""
        if _fast(decoded) and cid == "b" + base64.b32encode(decoded).decode("ascii").rstrip("=").lower():
            raw = decoded
    if raw is None:  # any other CID: multiformats' way
        parsed = parse_cid(cid)
        return str(as_v1(parsed)), bytes(parsed.raw_digest)
    return "b" + base64.b32encode(raw).decode("ascii").rstrip("=").lower(), raw[4:]
