"""The IPFS daemon backend: blocks kept by a node that speaks the Kubo RPC API.

    store = open_store(api="/ip4/127.0.0.1/tcp/5001/http")   # or open_store(path="blocks")
    root = import_file(fh, store.put).cid                      # the same CIDs as the local store

`IpfsStore` has the local `Blockstore`'s interface (`put`, `get`, `has`, iteration,
`verify`, `batch`, `pin`, `gc`). Files are cut and hashed by our own importer and sent
block by block (`block/put`), so a CID never depends on the daemon's settings; every CID
the daemon answers is compared with ours, and every block read back is re-hashed here.
The client is `ipfshttpclient.Client`, not `connect()`, whose version check refuses every
daemon newer than 0.8.0. Reads ask for `offline` and a `timeout`, so a missing block is an
error at once (Kubo) or after `miss_timeout` (js-ipfs), never a wait on the network.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from multiformats import CID

from lineage.errors import BlockNotFoundError, CorruptBlockError, StorageError

from .blockstore import Blockstore, corrupt_blocks
from .cid import RAW, as_v1, cid_for, parse_cid
from .limits import MAX_BLOCK

DEFAULT_API = "/ip4/127.0.0.1/tcp/5001/http"


def open_store(path: str | os.PathLike[str] | None = None, api: str | None = None) -> Any:
    """The configured store: the IPFS daemon at `api` if given, else the local store at `path`."""
    if api:
        return IpfsStore(api)
    if path is None:
        raise StorageError("no blockstore configured: give a directory or an IPFS API address")
    return Blockstore(path)


class IpfsStore:
    """Blocks in an IPFS daemon, through its RPC API."""

    def __init__(self, api: str = DEFAULT_API, *, miss_timeout: str = "2s", timeout: float = 120) -> None:
        with warnings.catch_warnings():  # urllib3 2 warns about a parameter ipfshttpclient passes
            warnings.simplefilter("ignore", FutureWarning)
            import ipfshttpclient
        self.api = api
        self.miss_timeout = miss_timeout
        self._errors = ipfshttpclient.exceptions
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                self.client = ipfshttpclient.Client(api, timeout=timeout)
                version = self.client.version()
        except self._errors.AddressError:
            raise StorageError(f"not an IPFS API multiaddr: {api!r} (e.g. {DEFAULT_API})") from None
        except self._errors.Error as exc:
            raise StorageError(f"no IPFS daemon answers at {api}: {self._why(exc)}") from None
        self.version = version["Version"]
        # block/put names the codec `cid-codec` in Kubo >= 0.13 (which refuses it together
        # with the deprecated `format`); js-ipfs knows only `format` (and `version`).
        self._js = "ipfs-core" in version

    def __repr__(self) -> str:
        return f"IpfsStore({self.api!r})"

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            try:
                return fn(*args, **kwargs)
            except self._errors.ErrorResponse:
                raise
            except self._errors.Error as exc:
                raise StorageError(f"IPFS daemon at {self.api}: {what} failed: {self._why(exc)}") from None

    def _why(self, exc: Exception) -> str:
        """The client's error in the user's terms, not urllib3's retry chain."""
        if isinstance(exc, self._errors.TimeoutError):
            return "no answer in time"
        if isinstance(exc, self._errors.ConnectionError):
            return "connection refused" if "refused" in str(exc).lower() else "connection lost"
        text = str(exc).strip()
        return text.splitlines()[0] if text else exc.__class__.__name__

    def put(self, data: bytes | memoryview, codec: str = RAW) -> CID:
        cid = cid_for(data, codec)
        opts: dict[str, Any] = {"mhtype": "sha2-256"}
        if self._js:
            opts.update({"format": codec, "version": 1})
        else:
            opts["cid-codec"] = codec
        try:
            reply = self._call("block/put", self.client.block.put, io.BytesIO(data), opts=opts)
        except self._errors.ErrorResponse as exc:
            raise StorageError(f"IPFS daemon at {self.api} refused block {cid}: {exc}") from None
        got = as_v1(parse_cid(reply["Key"]))
        if got != cid:
            raise StorageError(f"IPFS daemon stored block {cid} as {got}")
        return cid

    def get(self, cid: CID | str) -> bytes:
        cid = parse_cid(cid)
        opts = {"offline": "true", "timeout": self.miss_timeout}
        try:
            data = self._call("block/get", self.client.block.get, str(cid), opts=opts)
        except self._errors.ErrorResponse as exc:
            if _is_missing(exc):
                raise BlockNotFoundError(cid, f"the IPFS daemon at {self.api}") from None
            raise StorageError(f"IPFS daemon at {self.api}: cannot read {cid}: {exc}") from None
        if len(data) > MAX_BLOCK:
            raise CorruptBlockError(cid, f"the daemon returned {len(data)} bytes, above the {MAX_BLOCK}-byte block limit")
        if hashlib.sha256(data).digest() != bytes(cid.raw_digest):
            raise CorruptBlockError(cid, "the daemon returned bytes that do not match the CID")
        return data

    def has(self, cid: CID | str) -> bool:
        opts = {"offline": "true", "timeout": self.miss_timeout}
        try:
            self._call("block/stat", self.client.block.stat, str(parse_cid(cid)), opts=opts)
            return True
        except self._errors.ErrorResponse as exc:
            if _is_missing(exc):
                return False
            raise StorageError(f"IPFS daemon at {self.api}: block/stat failed: {exc}") from None

    def delete(self, cid: CID | str) -> bool:
        try:
            self._call("block/rm", self.client.block.rm, str(parse_cid(cid)))
            return True
        except self._errors.ErrorResponse:
            return False

    def __iter__(self) -> Iterator[CID]:
        """Every local block; the daemon keys blocks by multihash, so these are raw CIDv1s."""
        refs = self._call("refs/local", self.client._client.request, "/refs/local", decoder="json")
        for ref in refs:
            if ref.get("Err"):
                raise StorageError(f"IPFS daemon at {self.api}: refs/local: {ref['Err']}")
            yield parse_cid(ref["Ref"])

    def verify(self) -> list[CID]:
        return corrupt_blocks(self)

    @contextmanager
    def batch(self) -> Iterator[Blockstore]:
        """Stage blocks in a local temporary store; they reach the daemon only if all went well."""
        with tempfile.TemporaryDirectory(prefix="dlx-ipfs-batch-") as tmp:
            local = Blockstore(tmp)
            with local.batch() as staged:  # no fsync per block: a temporary copy
                yield staged
            for cid in local:
                self.put(local.get(cid), cid.codec.name)

    def pin(self, name: str, roots: list[CID]) -> None:
        """Pin `roots` recursively (the daemon's pins have no names; `name` is for the local store)."""
        del name
        for root in roots:
            try:
                self._call("pin/add", self.client.pin.add, str(parse_cid(root)),
                           opts={"offline": "true", "timeout": self.miss_timeout})
            except self._errors.ErrorResponse as exc:
                raise StorageError(f"IPFS daemon at {self.api}: cannot pin {root}: {exc}") from None

    def gc(self, grace_s: float = 0.0) -> list[CID]:
        """The daemon's own `repo gc` (it has no grace period)."""
        del grace_s
        removed = self._call("repo/gc", self.client.repo.gc) or []
        out = []
        for entry in removed:
            if entry.get("Error"):
                raise StorageError(f"IPFS daemon at {self.api}: repo/gc: {entry['Error']}")
            key = entry.get("Key")
            if key is not None and not isinstance(key, str):  # Kubo and js-ipfs: {"/": cid}
                key = key["/"]
            if key:
                out.append(parse_cid(key))
        return out


def _is_missing(exc: Exception) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("not found", "timed out", "timeout", "could not resolve"))
