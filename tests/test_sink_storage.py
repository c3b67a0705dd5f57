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
from lineage.store.unixfs import check_file, file_cid, read_file, resolve_file_digest
from trainer.artifacts import Contribution, GenesisArtifacts, StageShard, StepArtifacts
from trainer.config import JobConfig
from workers.run.sink import LedgerSink


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

    def block_number(self):
        return 0

    def created_block(self, run_id, since):
        return 0


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


def _sink(tmp_path, store, ledger, keys, job):
    record = RunRecord(name="refs", chain_id=31337, rpc=None, chain_state=None, registry="0x",
                       ledger="0x", blocks="blocks")
    return LedgerSink(job=job, config={"job": "refs"}, store=store, ledger=ledger, submitter=keys[0],
                      slot_keys=keys[1:], record=record, run_dir=tmp_path, challenge_window=10, min_stake=1)


def test_start_states_on_committed_shards_are_stored_by_reference_and_others_as_files(tmp_path):
    """Replica 0 starts each round from a committed shard (the parent's, then the one
    before: the restart rule), replica 1 from weights of its own; a resumed sink reads the
    digests of the shards it may refer to back from the store."""
    import torch

    from lineage.store.roundstate import is_reference, read_start_state, round_state_ref
    from trainer.artifacts import tensors_to_bytes

    job = JobConfig.model_validate({"name": "refs", "parallel": {"replicas": 2, "stages": 1},
                                    "outer": {"steps": 3, "inner_steps": 1}})
    store, ledger = Blockstore(tmp_path / "blocks"), StubLedger()
    keys = [Account.create() for _ in range(3)]

    def weights(seed):
        return {"param/w": torch.randn(300, 300, generator=torch.Generator().manual_seed(seed))}

    def shard(seed):
        w = weights(seed)
        return tensors_to_bytes({**w, "momentum/w": w["param/w"] * 0})

    def state(seed, step):
        return tensors_to_bytes({**weights(seed), "inner/exp_avg/w": weights(seed)["param/w"] * 0.1,
                                 "round/outer_step": torch.tensor([step])})

    def step(t, seeds, sink):
        contribs = [Contribution(replica=r, stage=0, data=b"c%d%d" % (t, r), data_shard=bytes(32), loss=1.0,
                                 new_shard=shard_digest(shard(10 + t)), start_state=state(s, t))
                    for r, s in enumerate(seeds)]
        sink.on_step(StepArtifacts(step=t, stages=[StageShard(0, shard(10 + t))], contributions=contribs,
                                   metrics={"eval_loss": 1.0}))
        return get_manifest(store, cid_from_digest(ledger.commits[-1]["checkpoint"], DAG_CBOR))

    sink = _sink(tmp_path, store, ledger, keys, job)
    sink.on_genesis(GenesisArtifacts(stages=[StageShard(0, shard(10))]))
    m1 = step(1, [10, 99], sink)  # replica 0 on the genesis shard; replica 1 on weights of its own
    m2 = step(2, [10, 11], sink)  # replica 0 on step 0's shard (two back), replica 1 on step 1's
    resumed = _sink(tmp_path, store, ledger, keys, job)
    resumed.record.run_id = sink.record.run_id
    resumed.resume_from(cid_from_digest(ledger.commits[-1]["checkpoint"], DAG_CBOR))
    m3 = step(3, [12, 98], resumed)
    genesis = get_manifest(store, m1.parent)
    refs = {(m.step, r): round_state_ref(store, m.replay[r][0]).weights
            for m in (m1, m2, m3) for r in (0, 1) if is_reference(m.replay[r][0])}
    assert refs == {(1, 0): genesis.stages[0], (2, 0): genesis.stages[0], (2, 1): m1.stages[0],
                    (3, 0): m2.stages[0]}
    for m, seeds in ((m1, [10, 99]), (m2, [10, 11]), (m3, [12, 98])):
        assert [read_start_state(store, m, r, 0) for r in (0, 1)] == [state(s, m.step) for s in seeds]
    # a reference costs the rest of the state and a small node, not the weights again
    plain, ref = check_file(store, m1.replay[1][0]), round_state_ref(store, m1.replay[0][0])
    assert plain > 700_000 and store.size(ref.cid) < 300 and check_file(store, ref.rest) < plain // 2 + 1000
    assert store.gc(grace_s=0) == []  # everything a reference names is reachable from the head
