"""The sink stores shards and contributions as Kubo-identical UnixFS files, commits their
digests (the co-signed shard digest is the digest of the shard file the manifest links),
and pins the run's head. The ledger is a stand-in: this pins storage only (the
chain side is covered by test_train_e2e and test_verify)."""

from __future__ import annotations

import io
import random
from types import SimpleNamespace

from eth_account import Account

from lineage.chain.attest import Domain, shard_digest
from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_CBOR, DAG_PB, RAW, cid_from_digest, digest_of
from lineage.store.manifest import get_manifest
from lineage.store.unixfs import file_cid, read_file, resolve_file_digest
from trainer.artifacts import Contribution, GenesisArtifacts, StageShard, StepArtifacts
from trainer.config import JobConfig
from workers.sink import LedgerSink


class StubLedger:
    def __init__(self) -> None:
        self.chain = SimpleNamespace(chain_id=31337)
        self.ledger = SimpleNamespace(address="0x" + "11" * 20)
        self.domain = Domain(31337, self.ledger.address)
        self.created = None
        self.commits: list[dict] = []

    def create_run(self, submitter, run):
        self.created = run
        return 5

    def commit_step(self, submitter, **kwargs):
        self.commits.append(kwargs)

    def head(self, run_id):
        return (self.commits[-1]["checkpoint"] if self.commits else b"", len(self.commits))


def test_step_blocks_are_unixfs_files_whose_digests_rebuild_their_cids(tmp_path):
    job = JobConfig.model_validate({"name": "sink", "parallel": {"replicas": 2, "stages": 1},
                                    "outer": {"steps": 1, "inner_steps": 1}})
    store, ledger = Blockstore(tmp_path / "blocks"), StubLedger()
    record = RunRecord(name="sink", chain_id=31337, rpc=None, chain_state=None, registry="0x",
                       ledger="0x", blocks="blocks")
    sink = LedgerSink(job=job, config={"job": "sink"}, store=store, ledger=ledger,
                      submitter=Account.create(), slot_keys=[Account.create(), Account.create()],
                      record=record, run_dir=tmp_path, challenge_window=10, min_stake=1)
    rng = random.Random(0)
    big = rng.randbytes(300_000)  # over one chunk: a dag-pb root
    sink.on_genesis(GenesisArtifacts(stages=[StageShard(0, rng.randbytes(1000))]))
    # Each replica reports the digest of the new shard it computed itself (the same bytes).
    contribs = [Contribution(replica=r, stage=0, data=d, data_shard=bytes(32), loss=1.5,
                             new_shard=shard_digest(big[::-1]))
                for r, d in enumerate([big, b"small"])]
    sink.on_step(StepArtifacts(step=1, stages=[StageShard(0, big[::-1])], contributions=contribs,
                               metrics={"eval_loss": 1.0}))

    commit = ledger.commits[0]
    head = cid_from_digest(commit["checkpoint"], DAG_CBOR)
    manifest = get_manifest(store, head)
    assert [row[0] for row in manifest.contributions] == [file_cid(big), file_cid(b"small")]
    assert [c.codec.name for row in manifest.contributions for c in row] == [DAG_PB, RAW]
    assert manifest.stages == [file_cid(big[::-1])]
    assert all(att.new_shard == digest_of(manifest.stages[0]) for att in commit["attestations"])  # a dag-pb root
    for att, (row, data) in zip(commit["attestations"], zip(manifest.contributions, [big, b"small"],
                                                            strict=True), strict=True):
        assert att.contribution == digest_of(row[0])
        assert resolve_file_digest(store, att.contribution) == row[0]  # digest -> full CID
        out = io.BytesIO()
        read_file(store, row[0], out)
        assert out.getvalue() == data
    assert store.pins() == {"sink-5": [head]}
    assert store.gc(grace_s=0) == []  # the whole run is reachable from its pinned head
