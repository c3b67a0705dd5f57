"""Partial steps (issue 18) end to end, on a real anvil with real training: a 3 x 1 job with
`min_replicas = 2` trains for real; its second step is committed through `LedgerSink` over
replicas {0, 2} only, the new shard recomputed with `trainer.diloco.apply_outer_step` over
those two replicas' real contributions, as an elastic run's outer step averages whoever
finished the round. Then `dlx verify` (levels 1-3, the data level and `--replay 1`) passes,
`dlx lineage` shows the set, a manifest that names another set than the chain fails level 1,
and a commit below the run's `minReplicas` is refused by the ledger with its named error,
one line and exit code 2 through the CLI's error path.

The training is done once (a `Recorder` sink keeps what the ranks report); each run below
feeds those real artifacts to its own `LedgerSink` on the same ledger.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import typer
from conftest import small_job_toml
from dlx_testing.here import dlx_here

from lineage.audit.replay import check_continuity, replay_many
from lineage.audit.verify import verify_run
from lineage.chain.client import Chain
from lineage.chain.ledger import Ledger
from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import digest_of
from lineage.store.datasets import prepare_dataset
from lineage.store.manifest import get_manifest, put_manifest
from lineage.store.runconfig import RunConfig
from trainer.artifacts import StageShard, StepArtifacts, code_hash
from trainer.diloco import apply_outer_step
from trainer.launch import train_local
from workers.cli.common import user_errors
from workers.run.jobfile import load_job_file
from workers.run.sink import LedgerSink, _put_file

pytestmark = pytest.mark.slow

R, S = 3, 1
PARTIAL_STEP, PRESENT = 2, (0, 2)


class Recorder:
    """A StepSink that keeps what the ranks report (each rank co-signs with the ledger's digest)."""

    shard_digest = staticmethod(LedgerSink.shard_digest)

    def __init__(self) -> None:
        self.genesis = None
        self.steps: list[StepArtifacts] = []

    def on_genesis(self, genesis) -> None:
        self.genesis = genesis

    def on_step(self, step: StepArtifacts) -> None:
        self.steps.append(step)

    def on_progress(self, progress) -> None:
        pass


def partial(step: StepArtifacts, parent_shards: list[bytes], present: tuple[int, ...], outer) -> StepArtifacts:
    """`step` as an elastic run reports it when only `present` finished the round: their
    real contributions, and the outer step over exactly those (ascending id), which each
    present rank co-signs."""
    contributions = [c for c in step.contributions if c.replica in present]
    stages = [StageShard(s, apply_outer_step(parent_shards[s], [c.data for c in contributions if c.stage == s], outer))
              for s in range(S)]
    contributions = [dataclasses.replace(c, new_shard=LedgerSink.shard_digest(stages[c.stage].data))
                     for c in contributions]
    losses = [c.loss for c in contributions if c.stage == S - 1]
    metrics = {**step.metrics, "train_loss": sum(losses) / len(losses)}
    return dataclasses.replace(step, stages=stages, contributions=contributions, metrics=metrics,
                               replicas=present)


def feed(sink: LedgerSink, recorder: Recorder, outer, until: int | None = None) -> StepArtifacts | None:
    """Report the recorded run to `sink`, step PARTIAL_STEP over PRESENT only; stops before
    step `until` and returns it (as reported), else None."""
    sink.on_genesis(recorder.genesis)
    shards = [s.data for s in recorder.genesis.stages]
    for step in recorder.steps:
        if step.step == PARTIAL_STEP:
            step = partial(step, shards, PRESENT, outer)
        if step.step == until:
            return step
        sink.on_step(step)
        shards = [s.data for s in step.stages]
    return None


@pytest.fixture(scope="module")
def trained(tmp_path_factory, anvil, accounts):
    """The job trained once, its artifacts recorded, and what each run needs to commit them."""
    root = tmp_path_factory.mktemp("partial")
    text = small_job_toml("partial", replicas=R, stages=S, steps=2).replace(
        "microbatches = 2", "microbatches = 2\nmin_replicas = 2")
    (root / "job.toml").write_text(text)
    job = load_job_file(root / "job.toml")
    scratch = Blockstore(root / "scratch")
    data, prepared = prepare_dataset(job.data, job.model.vocab_size, scratch.put)
    training = job.training_config().with_prepared(prepared)
    recorder = Recorder()
    assert train_local(training, recorder) == "completed"
    assert [s.step for s in recorder.steps] == [1, 2] and len(recorder.steps[1].contributions) == R * S
    ledger = Ledger.deploy(Chain(anvil.url), accounts[0])
    keys = accounts[1:1 + R * S]
    for k in keys:
        ledger.registry.ensure_staked(k, 10**18)
    return {"root": root, "job": job, "training": training, "data": data, "recorder": recorder,
            "ledger": ledger, "keys": keys, "submitter": accounts[0], "rpc": anvil.url}


def new_sink(t, name: str, job=None) -> tuple[LedgerSink, RunRecord]:
    """A LedgerSink for a fresh run directory `name`, its chain the shared anvil."""
    run_dir = t["root"] / name
    run_dir.mkdir()
    ledger = t["ledger"]
    record = RunRecord(name=name, chain_id=ledger.chain.chain_id, rpc=t["rpc"], chain_state=None,
                       registry=ledger.addresses["registry"], ledger=ledger.addresses["ledger"], blocks="blocks")
    store = record.open_store(run_dir)
    prepare_dataset(t["job"].data, t["job"].model.vocab_size, store.put)  # the run's data blocks
    sink = LedgerSink(job=job or t["training"], config=RunConfig.of_job(t["job"], code_hash(), t["data"]).to_doc(),
                      store=store, ledger=ledger, submitter=t["submitter"], record=record, run_dir=run_dir,
                      challenge_window=3600, min_stake=10**18, slot_keys=t["keys"])
    return sink, record


@pytest.fixture(scope="module")
def honest(trained):
    sink, record = new_sink(trained, "honest")
    feed(sink, trained["recorder"], trained["training"].outer)
    record.status = "completed"
    record.save(trained["root"] / "honest")
    return trained["root"] / "honest", sink


def test_the_partial_step_is_on_chain_over_its_set(honest):
    run_dir, sink = honest
    steps = sink.ledger.steps(sink.record.run_id)
    assert [s.replica_set for s in steps] == [0b111, 0b101]
    assert [(a["replica"], a["stage"]) for a in steps[1].attestations] == [(0, 0), (2, 0)]
    # replica 2's slot is signed by replica 2's own key, not by the second key
    assert steps[1].attestations[1]["node"] == sink.slot_nodes[2]
    assert sink.ledger.run_created(sink.record.run_id).min_replicas == 2
    m = get_manifest(sink.store, sink.record.head)
    assert m.replicas == [0, 2] and m.replica_ids(R) == (0, 2) and m.row(2) == 1
    assert get_manifest(sink.store, m.parent).replicas == []  # a full step: no list, bytes as before


def test_dlx_verify_passes_every_level_and_replays_only_the_present_replicas(honest):
    run_dir, _ = honest
    res = dlx_here("verify", "--run-dir", run_dir, "--replay", "1", "--json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(res.stdout)
    assert report["ok"]
    assert [sorted(s["passed"]) for s in report["steps"]] == [sorted(["chain", "content", "aggregate", "data",
                                                                       "replay"])] * 2
    assert sorted((r["step"], r["replica"]) for r in report["replay"]) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 2)]


def test_replay_refuses_an_absent_replica_and_continuity_skips_one_that_left(honest):
    run_dir, sink = honest
    head = sink.record.head
    step1 = str(get_manifest(sink.store, head).parent)
    (absent,) = replay_many(sink.store, [(head, 1)])
    assert absent.error == "replica 1 was not in step 2 (its replicas: 0, 2)"
    (left,) = replay_many(sink.store, [(step1, 1)])  # replica 1 trained step 1, then left
    assert left.ok, left.failure()
    check_continuity(sink.store, left, head)
    assert left.ok, left.failure()


def test_dlx_lineage_shows_each_steps_replica_set(honest):
    run_dir, _ = honest
    res = dlx_here("lineage", "show", "--run-dir", run_dir, "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    assert [s["replicas"] for s in json.loads(res.stdout)["steps"]] == [[0, 1, 2], [0, 2]]
    page = run_dir / "lineage.html"
    res = dlx_here("lineage", "show", "--run-dir", run_dir, "--html", page, env={"COLUMNS": "250"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "0,2" in res.stdout and "0,1,2" in res.stdout
    html = page.read_text()
    assert "replicas 0,2" in html and "<td class=replicas>0,2</td>" in html


def test_a_manifest_naming_another_set_than_the_chain_fails_level_1(trained):
    """A coordinator commits the right attestations over {0, 2} and a manifest that says
    {0, 1}: the signatures hold, the chain accepts it, the audit does not."""
    sink, record = new_sink(trained, "misnamed")
    step = feed(sink, trained["recorder"], trained["training"].outer, until=PARTIAL_STEP)
    assert step is not None
    present = sink._present(step)
    parent = sink._head
    with sink.store.batch() as staged:
        contribs = [_put_file(staged, c.data) for c in step.contributions]
        stages = [_put_file(staged, s.data) for s in step.stages]
        _, honest_manifest = sink._put_manifest(staged, step, present, stages, parent, contribs)
    misnamed = put_manifest(sink.store, dataclasses.replace(honest_manifest, replicas=[0, 1]))
    claims = sink._claims(step, present, digest_of(parent), contribs)
    sink.ledger.commit_step(
        sink.submitter, run_id=record.run_id, step=PARTIAL_STEP, parent=digest_of(parent),
        checkpoint=digest_of(misnamed), metrics_digest=honest_manifest.metrics_digest(),
        attestations=[_attestation(c, sig) for c, sig in zip(claims, sink.signer(PARTIAL_STEP, claims), strict=True)],
        replica_set=0b101)
    record.head, record.steps = str(misnamed), PARTIAL_STEP
    record.save(trained["root"] / "misnamed")
    report = verify_run(trained["root"] / "misnamed", levels=("chain", "content", "aggregate"))
    assert report.steps[0].ok
    failures = report.steps[1].failures
    assert failures["chain"] == "the manifest's replicas {0, 1} are not the chain's replica set {0, 2}"
    assert failures["content"] == failures["aggregate"] == failures["chain"]


def _attestation(claim, signature):
    from lineage.chain.ledger import Attestation

    return Attestation(claim.replica, claim.stage, claim.contribution, claim.data_shard, claim.code_hash,
                       claim.loss_micros, signature, claim.new_shard, claim.replica_set)


def test_a_step_below_the_runs_min_replicas_is_refused_by_name_in_one_line(trained, capsys):
    """The run was created needing all three replicas; resumed with a job file that says
    two, its sink commits a step of two: the ledger refuses it by name, and the CLI's error
    path prints one line and exits 2."""
    strict = trained["training"].model_copy(update={"parallel": trained["training"].parallel.model_copy(
        update={"min_replicas": None})})
    sink, record = new_sink(trained, "strict", job=strict)
    step = feed(sink, trained["recorder"], trained["training"].outer, until=PARTIAL_STEP)
    assert trained["ledger"].run_created(record.run_id).min_replicas == R
    resumed = LedgerSink(job=trained["training"], config=sink.config, store=sink.store, ledger=sink.ledger,
                         submitter=sink.submitter, record=record, run_dir=sink.run_dir, challenge_window=3600,
                         min_stake=10**18, slot_keys=trained["keys"])
    resumed.resume_from(record.head)
    with pytest.raises(typer.Exit) as exc:
        user_errors(lambda: resumed.on_step(step))()
    assert exc.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.strip() == (f"dlx: error: commitStep(run {record.run_id}, step {PARTIAL_STEP}): reverted with "
                           "LedgerTooFewReplicas(present=2, minReplicas=3)")
