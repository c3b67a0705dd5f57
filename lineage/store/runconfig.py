"""The run-config document: the one owner of how a run's configuration block is built and read.

Every manifest's `config` link and `createRun`'s `configDigest` name this DAG-CBOR block
(docs/FORMATS.md, "config block"):

    {"job": <the job file as JSON, less the sections a run does not record>,
     "data": <the data record: three CIDs, see lineage.store.datasets.DataRecord>,
     "code": <32-byte codeHash of the trainer sources>}

`data` is absent from runs that predate recorded data. The local runner and the rank-0 task
build it here (`RunConfig.of_job`), the verifier and the replays read it here
(`RunConfig.load`), so its bytes (and so every checkpoint CID) have one definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dag_cbor
from multiformats import CID

from lineage.errors import StorageError

from .cid import DAG_CBOR
from .datasets import DataRecord

#: Job-file sections a run's record leaves out: where blocks are kept and where metrics go
#: are this machine's business, and a test-only `[cheat]` must not announce itself.
UNRECORDED = frozenset({"storage", "tracking", "cheat"})
#: Sections of the recorded job the trainer does not read back (the chain is the ledger's).
NOT_TRAINING = ("chain", "storage")


@dataclass(frozen=True)
class RunConfig:
    """A run's configuration block, decoded: the recorded job, its data and its code hash."""

    job: dict[str, Any]
    code: bytes
    data: DataRecord | None = None

    @classmethod
    def of_job(cls, job: Any, code: bytes, data: DataRecord | None) -> RunConfig:
        """The record of a validated job file (a pydantic `JobFile`) about to run."""
        return cls(job=job.model_dump(mode="json", exclude=set(UNRECORDED)), code=code, data=data)

    def to_doc(self) -> dict[str, Any]:
        """The block's document, as DAG-CBOR encodes it."""
        doc: dict[str, Any] = {"job": self.job}
        if self.data is not None:
            doc["data"] = self.data.to_doc()
        doc["code"] = self.code
        return doc

    @classmethod
    def from_doc(cls, doc: Any) -> RunConfig:
        """Read a decoded block; KeyError or TypeError when it is not a config document."""
        data = doc.get("data")
        return cls(job=dict(doc["job"]), code=bytes(doc.get("code") or b""),
                   data=DataRecord.from_doc(data) if isinstance(data, dict) else None)

    @classmethod
    def load(cls, store: Any, cid: CID | str) -> RunConfig:
        """The config block `cid` from `store`."""
        from .cbor import decode

        doc = decode(store.get(cid), cid)
        try:
            return cls.from_doc(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StorageError(f"config {cid}: not a run config block ({type(exc).__name__}: {exc})"[:300]) from None

    def put(self, store: Any) -> CID:
        """Store the block; returns its CID (the manifests' `config`)."""
        return store.put(dag_cbor.encode(self.to_doc()), DAG_CBOR)

    def training_job(self) -> Any:
        """The trainer's `JobConfig` of the recorded job (chain and storage sections dropped)."""
        from trainer.config import JobConfig

        job = {k: v for k, v in self.job.items() if k not in NOT_TRAINING}
        outer = job.get("outer")
        if isinstance(outer, dict) and "arithmetic" not in outer:
            # recorded before the outer arithmetic was: it ran the float32 one
            job["outer"] = {**outer, "arithmetic": "float32"}
        return JobConfig.model_validate(job)

    @property
    def sync(self) -> str:
        """The run's synchronisation (`diloco`, or `allreduce` for the baseline)."""
        parallel = self.job.get("parallel")
        return str(parallel.get("sync", "diloco")) if isinstance(parallel, dict) else "diloco"
