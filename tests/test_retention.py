"""Retention (`[storage] keep`, `dlx cas gc --keep`): a real `dlx train` thins its own
history as it commits, and gc thins a kept run; the store stays whole (`dlx cas verify`)
and `dlx verify` reports per step which levels the kept blocks still allow."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dlx_testing.here import dlx_here

from lineage.audit import verify as V
from lineage.chain.anvil import rpc_call
from lineage.chain.attest import ContributionClaim, Domain
from lineage.chain.ledger import Attestation, RunSpec
from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import parse_cid
from lineage.store.retention import KeepPolicy, Reach, history, kept_steps, open_steps, plan
from lineage.store.unixfs import check_file

DLX = str(Path(sys.executable).parent / "dlx")


def _dlx(*args: object, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([DLX, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def _starts(m):
    return [c for row in m.replay for c in row]


def _file_blocks(store, cids) -> set[str]:
    return set(Reach(store).blocks(cids))


def _everything_else_present(store, hist) -> None:
    """Manifests, config, genesis and every contribution are whole."""
    store.get(hist[0].config)
    for m in hist:
        for cid in [*(c for row in m.contributions for c in row), *(hist[0].stages if m.step == 0 else [])]:
            check_file(store, cid, workers=0)


def test_keep_policies_parse_and_choose_steps():
    assert str(KeepPolicy.parse("last:3")) == "last:3" and KeepPolicy.parse("all") == KeepPolicy()
    for bad in ("last:0", "every:", "some", "last:-1", " all", 3):
        with pytest.raises(ValueError, match="must be"):
            KeepPolicy.parse(bad)
    kept = kept_steps(KeepPolicy.parse("last:1"), 5)
    assert kept.starts == {5} and kept.shards == {0, 4, 5}
    kept = kept_steps(KeepPolicy.parse("every:3"), 7)
    assert kept.starts == {3, 6, 7} and kept.shards == {0, 2, 3, 5, 6, 7}
    # an open challenge window keeps a step's start states and its parent's shards and start states
    kept = kept_steps(KeepPolicy.parse("last:1"), 7, open_steps=[6])
    assert kept.starts == {5, 6, 7} and kept.shards == {0, 5, 6, 7}


def test_open_challenge_windows_come_from_the_chain(ledger, accounts):
    """A step stays open while the chain can still mine a challenge inside its window
    (chain time, here moved on by anvil); a run without arbiters has no open step."""
    node, arbiter = accounts[1], accounts[2]
    ledger.registry.ensure_staked(node, 10**18)
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)

    def h(label: str) -> bytes:
        return hashlib.sha256(label.encode()).digest()

    def advance(seconds: int) -> None:
        rpc_call(ledger.chain.rpc_url, "evm_increaseTime", [seconds])
        rpc_call(ledger.chain.rpc_url, "evm_mine")

    def run(arbiters: list[str]) -> int:
        run_id = ledger.create_run(accounts[0], RunSpec(
            config_digest=h("c"), genesis_digest=h("g"), nodes=[node.address],
            replicas=1, stages=1, challenge_window=600, min_stake=10**18,
            arbiters=arbiters, quorum=len(arbiters)))
        parent = h("g")
        for step in (1, 2, 3):
            claim = ContributionClaim(run_id, step, 0, 0, parent, h(f"c{step}"), h("d"), h("code"), 0, replica_set=1)
            att = Attestation(0, 0, claim.contribution, claim.data_shard, claim.code_hash, claim.loss_micros,
                              claim.sign(domain, node.key), claim.new_shard, claim.replica_set)
            ledger.commit_step(accounts[0], run_id=run_id, step=step, parent=parent, checkpoint=h(f"{run_id}/{step}"),
                               metrics_digest=h("m"), attestations=[att])
            parent = h(f"{run_id}/{step}")
            advance(250)
        return run_id

    assert open_steps(ledger, run([]), 3) == set()
    run_id, cache = run([arbiter.address]), {}
    # steps committed 750, 500 and 250 s ago: step 1's 600 s window has closed
    assert open_steps(ledger, run_id, 3, cache) == {2, 3} and sorted(cache) == [1, 2, 3]
    advance(200)
    assert open_steps(ledger, run_id, 3, cache) == {3}
    advance(200)
    assert open_steps(ledger, run_id, 3, cache) == set()


def test_bad_keep_is_one_line_exit_2(tmp_path, small_job):
    job = tmp_path / "job.toml"
    job.write_text(small_job("bad-keep", extra='\n[storage]\nkeep = "last:zero"\n'))
    res = _dlx("train", job, "--run-dir", tmp_path / "run", timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("dlx: error: storage.keep: must be") and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()
    res = _dlx("cas", "gc", "--store", tmp_path / "s", "--keep", "every:0", timeout=60)
    assert res.returncode == 2 and res.stderr.startswith("dlx: error: --keep: must be"), res.stderr
    assert res.stderr.count("\n") == 1


@pytest.mark.slow
def test_train_with_keep_last_1_prunes_as_it_goes_and_verifies(tmp_path, small_job, monkeypatch):
    job = tmp_path / "job.toml"
    job.write_text(small_job("keep-last", steps=3, inner_steps=2,
                             extra='\n[chain]\nchallenge_window_s = 0\n\n[storage]\nkeep = "last:1"\n'))
    run_dir = tmp_path / "run"
    res = _dlx("train", job, "--run-dir", run_dir, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    record = RunRecord.load(run_dir)
    store = Blockstore(run_dir / "blocks")
    hist = history(store, parse_cid(record.head))
    assert [m.step for m in hist] == [0, 1, 2, 3]
    for m in hist[1:]:  # start states only for the last step; shards for it and its parent
        assert all(store.has(c) for c in _starts(m)) == (m.step == 3)
        assert not any(store.has(c) for c in _starts(m)) == (m.step != 3)
        assert all(store.has(c) for c in m.stages) == (m.step >= 2)
    _everything_else_present(store, hist)

    res = dlx_here("cas", "verify", "--run-dir", run_dir)
    assert res.returncode == 0, res.stderr
    res = dlx_here("verify", "--run-dir", run_dir, "--replay", "0.5", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    by_step = {s["step"]: s for s in report["steps"]}
    for t in (1, 2, 3):
        assert set(by_step[t]["passed"]) >= {"chain", "content", "aggregate"} and not by_step[t]["failures"]
    for t in (1, 2):
        assert by_step[t]["unavailable"] == {"replay": "not possible: start state pruned"}
    assert by_step[3]["unavailable"] == {} and "replay" in by_step[3]["passed"]  # the one step it can replay
    assert [r["step"] for r in report["replay"]] == [3]
    # the table says so too
    res = dlx_here("verify", "--run-dir", run_dir)
    assert res.returncode == 0 and "replay: not possible: start state pruned" in " ".join(res.stdout.split())
    # forked workers, one step each: steps 2 and 3 start from parents whose shards are gone
    monkeypatch.setattr(V, "MIN_STEPS_PER_WORKER", 1)
    monkeypatch.setattr(V.os, "cpu_count", lambda: 3)
    forked = V.verify_run(run_dir).as_json()
    assert forked["ok"] and [s["passed"] for s in forked["steps"]] == [["chain", "content", "aggregate", "data"]] * 3

    # a kept block the policy needs is still a failure when gone
    gone = hist[3].stages[0]
    for path in (run_dir / "blocks").glob(f"*/{gone}"):
        path.unlink()
    res = dlx_here("verify", "--run-dir", run_dir, "--json")
    assert res.returncode == 1
    assert json.loads(res.stdout)["steps"][2]["failures"].get("content", "").startswith("block not found")


@pytest.mark.slow
def test_gc_keep_every_2_removes_exactly_the_pruned_files(trained_run, tmp_path):
    src, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir, copy_function=shutil.copy)  # fresh mtimes: blocks written just now
    store = Blockstore(run_dir / "blocks")
    hist = history(store, parse_cid(RunRecord.load(run_dir).head))
    assert hist[-1].step == 3
    before = {str(c) for c in store}
    # every:2 of steps 1..3: step 1's start states go (2 and the head stay; every shard is
    # a kept step's own or its parent's)
    expected = _file_blocks(store, _starts(hist[1])) - _file_blocks(
        store, [c for m in hist for c in [*m.stages, *_starts(m), *(c for row in m.contributions for c in row)]
                if c not in _starts(hist[1])])
    assert expected
    expected_bytes = sum(store.size(c) for c in expected)

    res = dlx_here("cas", "gc", "--run-dir", run_dir, "--keep", "every:2")  # all of it younger than the grace period
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr
    res = dlx_here("cas", "gc", "--run-dir", run_dir, "--keep", "every:2", "--grace", "0", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert {line.split()[-1] for line in res.stdout.splitlines()} == expected
    assert {str(c) for c in store} == before
    res = dlx_here("cas", "gc", "--run-dir", run_dir, "--keep", "every:2", "--grace", "0")
    assert res.returncode == 0, res.stderr
    assert {line.split()[-1] for line in res.stdout.splitlines()} == expected
    assert f"removed {len(expected)} block(s), {expected_bytes} bytes (" in res.stderr
    assert {str(c) for c in store} == before - expected
    _everything_else_present(store, hist)

    assert dlx_here("cas", "verify", "--run-dir", run_dir).returncode == 0
    res = dlx_here("cas", "gc", "--run-dir", run_dir, "--grace", "0")  # the pin walk passes over the pruned files
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr
    res = dlx_here("cas", "export", "--run-dir", run_dir, "-o", tmp_path / "run.car")
    assert res.returncode == 0, res.stderr
    res = dlx_here("verify", "--run-dir", run_dir, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    steps = json.loads(res.stdout)["steps"]
    assert [s["unavailable"] for s in steps] == [{"replay": "not possible: start state pruned"}, {}, {}]


@pytest.mark.slow
def test_a_prune_cut_short_leaves_whole_blocks_and_the_next_gc_finishes_it(trained_run, tmp_path):
    src, _ = trained_run
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    store = Blockstore(run_dir / "blocks")
    head = parse_cid(RunRecord.load(run_dir).head)
    before = {str(c) for c in store}
    p = plan(store, head, history(store, head), kept_steps(KeepPolicy.parse("last:1"), 3))
    assert len(p.blocks) >= 2 and {str(c) for c in p.roots} <= {str(c) for c in p.blocks}
    store.prune(p.roots, p.blocks[: len(p.blocks) // 2])  # the process dies here
    assert store.verify() == []
    res = dlx_here("cas", "gc", "--run-dir", run_dir, "--keep", "last:1", "--grace", "0")
    assert res.returncode == 0, res.stderr
    assert {str(c) for c in store} == before - {str(c) for c in p.blocks}
    assert dlx_here("cas", "verify", "--run-dir", run_dir).returncode == 0
    res = dlx_here("verify", "--run-dir", run_dir, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert [s["unavailable"] for s in json.loads(res.stdout)["steps"]] == [
        {"replay": "not possible: start state pruned"}] * 2 + [{}]


@pytest.mark.slow
def test_a_kept_start_state_keeps_the_shard_it_refers_to_and_a_car_carries_it(tmp_path, small_job):
    """Under the restart rule (delay 1) round t starts from step t-2's shard: the start
    states refer to it (lineage/store/roundstate.py). A CAR of the run carries what they
    refer to, and the run verifies and replays from it in a store of its own; `dlx cas gc
    --keep last:1`, which keeps no shard of step 1 for step 1, keeps the ones step 3's
    states refer to, and `dlx verify` rebuilds those states from them. (Replaying an
    overlapped rule's step needs the step before's start states too: `last:2`.)"""
    from lineage.store.roundstate import read_start_state, round_state_ref

    job = tmp_path / "job.toml"
    job.write_text(small_job("keep-ref", steps=3, inner_steps=2, extra='delay = 1\noverlap = "restart"\n'))
    run_dir = tmp_path / "run"
    res = _dlx("train", job, "--run-dir", run_dir, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    store = Blockstore(run_dir / "blocks")
    hist = history(store, parse_cid(RunRecord.load(run_dir).head))
    assert [round_state_ref(store, c).weights for c in _starts(hist[3])] == hist[1].stages * 2
    assert [round_state_ref(store, c).weights for c in _starts(hist[2])] == hist[0].stages * 2

    res = dlx_here("cas", "export", "--run-dir", run_dir, "-o", tmp_path / "run.car")
    assert res.returncode == 0, res.stderr
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("blocks"))
    res = dlx_here("cas", "import", tmp_path / "run.car", "--run-dir", copy)
    assert res.returncode == 0, res.stderr
    imported = Blockstore(copy / "blocks")
    assert [read_start_state(imported, m, r, s) for m in hist[1:] for r in (0, 1) for s in (0, 1)] == \
        [read_start_state(store, m, r, s) for m in hist[1:] for r in (0, 1) for s in (0, 1)]
    res = dlx_here("verify", "--run-dir", copy, "--replay", "1.0", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(json.loads(res.stdout)["replay"]) == 6

    assert 1 not in kept_steps(KeepPolicy.parse("last:1"), 3).shards
    res = dlx_here("cas", "gc", "--run-dir", run_dir, "--keep", "last:1", "--grace", "0")
    assert res.returncode == 0, res.stderr
    assert not any(store.has(c) for m in hist[1:3] for c in _starts(m))  # pruned as before
    for cid in hist[1].stages:  # step 1's shards: not kept for step 1, kept for step 3's states
        check_file(store, cid, workers=0)
    res = dlx_here("verify", "--run-dir", run_dir, "--json")  # level 2 rebuilds the head's states
    assert res.returncode == 0, res.stdout + res.stderr
    assert all({"chain", "content", "aggregate"} <= set(s["passed"]) for s in json.loads(res.stdout)["steps"])
