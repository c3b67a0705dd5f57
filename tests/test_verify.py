"""`dlx verify` on a real run: an honest run passes every level; a tampered block is
caught by the content level, naming the step and the CID. The verifications run in this
process (`dlx_here`: the real command without an interpreter's start-up); the hostile run
is trained by a patched `dlx`, and `dlx cas get`'s one line is what a shell sees."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import dag_cbor
import pytest
from dlx_testing.here import dlx_here

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import parse_cid

DLX = str(Path(sys.executable).parent / "dlx")


def verify(run_dir: Path) -> tuple[int, dict]:
    res = dlx_here("verify", "--run-dir", run_dir, "--json")
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


def _copy(trained_run, tmp_path: Path) -> tuple[Path, RunRecord, Blockstore]:
    """A copy of the shared trained run to tamper with: (run dir, record, its store)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run[0], run_dir)
    record = RunRecord.load(run_dir)
    return run_dir, record, Blockstore(record.blocks_dir(run_dir))


def _flip(store: Blockstore, cid, where: Callable[[bytearray], int], mask: int) -> None:
    """XOR `mask` into the byte at `where(block)` of the stored block `cid`."""
    path = store._path(parse_cid(cid))
    raw = bytearray(path.read_bytes())
    raw[where(raw)] ^= mask
    path.write_bytes(bytes(raw))


@pytest.mark.slow
def test_an_honest_run_passes_chain_content_and_aggregate(trained_run):
    run_dir, _ = trained_run
    code, report = verify(run_dir)
    assert code == 0, report
    assert report["ok"] and len(report["steps"]) == 3
    for step in report["steps"]:
        assert step["passed"] == ["chain", "content", "aggregate", "data"]


@pytest.mark.slow
def test_a_tampered_contribution_block_fails_content_with_its_cid(trained_run, tmp_path):
    run_dir, record, store = _copy(trained_run, tmp_path)
    head = dag_cbor.decode(store.get(record.head))
    victim = parse_cid(head["contributions"][1][0])
    _flip(store, victim, lambda raw: len(raw) // 2, 0x40)
    code, report = verify(run_dir)
    assert code == 1 and not report["ok"]
    last = report["steps"][-1]
    assert "content" in last["failures"] and str(victim) in last["failures"]["content"]
    assert all(s["ok"] for s in report["steps"][:-1])


@pytest.mark.slow
def test_a_tampered_start_state_block_fails_content_with_its_cid(trained_run, tmp_path):
    run_dir, record, store = _copy(trained_run, tmp_path)
    step2 = dag_cbor.decode(store.get(dag_cbor.decode(store.get(record.head))["parent"]))
    victim = parse_cid(step2["replay"][0][1])  # replica 0, stage 1: its round's start state
    _flip(store, victim, lambda raw: -1, 0x01)
    code, report = verify(run_dir)
    assert code == 1 and [s["ok"] for s in report["steps"]] == [True, False, True]
    assert str(victim) in report["steps"][1]["failures"]["content"]


@pytest.mark.slow
def test_worker_processes_report_exactly_what_one_process_reports(trained_run, tmp_path, monkeypatch):
    """Levels 2 and 3 run in forked workers over ranges of steps; whatever is tampered
    with, and wherever a range starts, the report is the one a single process gives."""
    from lineage.audit import verify as V

    run_dir, record, store = _copy(trained_run, tmp_path)
    step3 = dag_cbor.decode(store.get(record.head))
    step2 = dag_cbor.decode(store.get(step3["parent"]))
    step1 = dag_cbor.decode(store.get(step2["parent"]))
    for victim in (parse_cid(step2["contributions"][0][1]), parse_cid(step1["stages"][0])):
        _flip(store, victim, lambda raw: 7, 0x10)

    forks = []
    real_pool = V.multiprocessing.get_context("fork").Pool
    monkeypatch.setattr(V.multiprocessing.get_context("fork"), "Pool",
                        lambda n: forks.append(n) or real_pool(n))
    monkeypatch.setattr(V, "MIN_STEPS_PER_WORKER", 10**6)
    alone = V.verify_run(run_dir).as_json()
    monkeypatch.setattr(V, "MIN_STEPS_PER_WORKER", 1)
    monkeypatch.setattr(V.os, "cpu_count", lambda: 3)
    forked = V.verify_run(run_dir).as_json()
    assert forks == [3]  # one step a worker: every step's parent shards come from the store
    assert forked == alone
    assert [s["ok"] for s in alone["steps"]] == [False, False, True]
    assert set(alone["steps"][0]["failures"]) == {"content", "aggregate"}  # its own shard is corrupt
    assert set(alone["steps"][1]["failures"]) == {"content", "aggregate"}  # a corrupt contribution (and parent)


#: `dlx train` whose sink links hostile round-state nodes for step 2's replica 0 (calls 5
#: and 6 of 2 replicas x 2 stages a step): stage 0's says another digest than its bytes
#: have, stage 1's names its rest file as the weights.
HOSTILE_DLX = """
import sys, dag_cbor
from workers.run.sink import LedgerSink
from lineage.store.cid import DAG_CBOR
from lineage.store.roundstate import round_state_ref
calls, real = [], LedgerSink._put_start
class Seen:  # the sink's batch, remembering what was put (a batch does not read its own blocks)
    def __init__(self, store): self.store, self.blocks = store, {}
    def put(self, data, codec="raw"):
        cid = self.store.put(data, codec); self.blocks[str(cid)] = bytes(data); return cid
    def get(self, cid): return self.blocks[str(cid)]
def put(self, store, data, shards):
    seen = Seen(store)
    cid = real(self, seen, data, shards)
    calls.append(cid)
    if len(calls) in (5, 6):
        ref = round_state_ref(seen, cid)
        node = {"version": 1, "kind": "round-state", "weights": ref.weights, "rest": ref.rest,
                "size": ref.size, "sha256": ref.sha256}
        node.update({"sha256": bytes(32)} if len(calls) == 5 else {"weights": ref.rest})
        cid = store.put(dag_cbor.encode(node), DAG_CBOR)
    return cid
LedgerSink._put_start = put
from workers.cli import main
sys.argv[0] = "dlx"
main()
"""


@pytest.mark.slow
def test_hostile_round_state_nodes_fail_content_and_replay_with_their_reason(tmp_path, small_job):
    job = tmp_path / "job.toml"
    job.write_text(small_job("hostile", steps=3, inner_steps=2))
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", HOSTILE_DLX, "train", str(job), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    res = dlx_here("verify", "--run-dir", run_dir, "--replay", "1.0", "--json")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    steps = {s["step"]: s for s in json.loads(res.stdout)["steps"]}
    assert "content" in steps[1]["passed"] and "content" in steps[3]["passed"]
    assert "the rebuilt bytes do not have the node's sha256" in steps[2]["failures"]["content"]
    assert "round state" in steps[2]["failures"]["replay"]
    step2 = dag_cbor.decode(Blockstore(run_dir / "blocks").get(
        dag_cbor.decode(Blockstore(run_dir / "blocks").get(RunRecord.load(run_dir).head))["parent"]))
    res = subprocess.run([DLX, "cas", "get", str(parse_cid(step2["replay"][0][1])), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "are not a shard" in res.stderr, res.stderr
