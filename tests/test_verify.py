"""`dlx verify` on a real run: an honest run passes every level; a tampered block is
caught by the content level, naming the step and the CID."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import dag_cbor
import pytest

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import parse_cid

DLX = str(Path(sys.executable).parent / "dlx")


def verify(run_dir: Path) -> tuple[int, dict]:
    res = subprocess.run([DLX, "verify", "--run-dir", str(run_dir), "--json"],
                         capture_output=True, text=True, timeout=300)
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
