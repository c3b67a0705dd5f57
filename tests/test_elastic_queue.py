"""Elastic replicas end to end on the local stack: real redis-server, anvil and Celery
worker processes (`dlx up`), a job with `min_replicas` below `replicas`, one worker killed
with SIGKILL mid-round. The job goes on with the remaining replicas without any command,
commits every later step once, finishes, and `dlx verify --replay 1` passes on every step;
the lineage shows the smaller set from the step after the kill. A worker started during the
run (the lost node come back) brings the job back to full size at a later step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dlx_testing.cheat import hold_before

DLX = str(Path(sys.executable).parent / "dlx")

pytestmark = pytest.mark.slow


def dlx(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout)


def _up(d: Path, workers: int, slots: int) -> Path:
    res = dlx("up", "--workers", str(workers), "--slots", str(slots), "--stack", str(d / ".dlx"))
    assert res.returncode == 0, res.stderr
    return d / ".dlx"


def _down(stack: Path) -> None:
    res = dlx("down", "--stack", str(stack))
    assert res.returncode == 0, res.stderr


def _store(stack: Path):
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    return JobStore(connect(Stack.load(stack).redis_url))


def wait_for(stack: Path, job: str, pred, timeout: float = 300) -> dict:
    store = _store(stack)
    deadline = time.monotonic() + timeout
    while True:
        st = {"job": job, **store.get(job)}
        if pred(st):
            return st
        assert time.monotonic() < deadline, {k: v for k, v in st.items() if not k.startswith("step_")}
        time.sleep(0.2)


def _job(tmp: Path, small_job, name: str, min_replicas: int, **kw) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(small_job(name, seed=5, **kw).replace("[parallel]\n", f"[parallel]\nmin_replicas = {min_replicas}\n"))
    return path


def _submit(stack: Path, path: Path) -> str:
    res = dlx("submit", str(path), "--stack", str(stack), "--collective-timeout", "20")
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _victim(stack: Path, rec: dict, replica: int) -> dict:
    """The stack worker that holds `replica` (its node is that replica's)."""
    info = json.loads((stack / "stack.json").read_text())
    (node,) = set(rec["member_nodes"][str(replica)])
    return next(w for w in info["workers"] if w["node"] == node)


def _kill_mid_round(stack: Path, job: str, replica: int) -> tuple[dict, int]:
    """SIGKILL the worker of `replica` once step 1 is committed and the next round has run a
    few inner steps; returns (the worker, the last step committed before the kill)."""
    rec = wait_for(stack, job, lambda s: (s.get("step") or 0) >= 1 and (s.get("inner_step") or 0) >= 3
                   and s.get("outer_step", 0) > s["step"])
    victim = _victim(stack, rec, replica)
    os.kill(victim["pid"], signal.SIGKILL)
    return victim, int(_store(stack).get(job)["step"])


def _dev_key(address: str):
    from lineage.chain.anvil import dev_accounts

    return next(k for k in dev_accounts(8) if k.address == address)


def _restart_worker(stack: Path, victim: dict, slots: int) -> None:
    """The lost node comes back: a new worker process with its key."""
    from workers.queue.stack import Stack, _spawn

    s = Stack.load(stack)
    pid = _spawn([sys.executable, "-m", "workers.cli", "worker", "--slots", str(slots)],
                 stack / "logs" / "worker-returned.log", s.worker_env(_dev_key(victim["node"]).key.hex(), slots))
    info = json.loads((stack / "stack.json").read_text())
    next(w for w in info["workers"] if w["node"] == victim["node"])["pid"] = pid  # `dlx down` stops it
    (stack / "stack.json").write_text(json.dumps(info))


def _audit(rec: dict, steps: int) -> tuple[list[list[int]], dict]:
    """Every step's replica set from `dlx lineage --json`, after `dlx verify --replay 1` passed."""
    res = dlx("verify", "--run-dir", rec["run_dir"], "--replay", "1", "--json", timeout=900)
    report = json.loads(res.stdout)
    assert res.returncode == 0, json.dumps(report)[-3000:]
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1))
    res = dlx("lineage", "--run-dir", rec["run_dir"], "--json")
    assert res.returncode == 0, res.stderr
    lineage = json.loads(res.stdout)
    R = int(rec["replicas"])
    by_step = {s["step"]: s.get("replicas") or list(range(R)) for s in lineage["steps"] if s["step"] > 0}
    return [by_step[t] for t in range(1, steps + 1)], report


def _commits(rec: dict) -> list[int]:
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger

    ledger = Ledger(Chain(rec["rpc"]), rec["registry"], rec["ledger"])
    return [c.record.step for c in ledger.commits(int(rec["run_id"]))]


def _joiner_waiting(stack: Path, job: str) -> None:
    """Wait until a joiner ticket of `job` is registered and beating (the growth path's
    `GrowFlag` then seats it at the next round end)."""
    from workers.queue.membership import Members

    store = _store(stack)
    members = Members(store, job, int(store.get(job)["attempt"]))
    deadline = time.monotonic() + 300
    while not members.alive(list(members.waiting())):
        assert time.monotonic() < deadline, "the returned node's ticket never waited to join"
        time.sleep(0.2)


def test_three_replicas_lose_one_go_on_and_grow_back(tmp_path, small_job):
    stack = _up(tmp_path, workers=3, slots=1)
    # The ranks wait before step 4 until the returned node waits to join: however slowly its
    # worker starts, the run does not end first.
    hold = tmp_path / "joiner-waits"
    try:
        steps = 9
        path = _job(tmp_path, small_job, "elastic-3x1", 2, steps=steps, inner_steps=20, replicas=3, stages=1)
        hold_before(path, 4, hold)
        job = _submit(stack, path)
        victim, before = _kill_mid_round(stack, job, replica=2)
        _restart_worker(stack, victim, slots=1)  # the node comes back while the others go on
        _joiner_waiting(stack, job)
        hold.touch()
        rec = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=600)
        assert rec["state"] == "completed", rec.get("error")
        assert _commits(rec) == list(range(1, steps + 1))  # every step once, none lost
        sets, _ = _audit(rec, steps)
        assert all(s == [0, 1, 2] for s in sets[:before]), sets
        assert sets.index([0, 1]) <= before + 1, sets  # from the step after the kill (index t - 1 is step t)
        shrunk = [t for t, s in enumerate(sets) if s == [0, 1]]
        grown = [t for t, s in enumerate(sets) if t > shrunk[-1]]
        assert grown and all(sets[t] == [0, 1, 2] for t in grown), sets  # full size again, on chain
    finally:
        hold.touch()
        _down(stack)


def test_two_by_two_loses_the_first_replica_and_finishes_alone(tmp_path, small_job):
    """Replica 0's worker held global rank 0 and the step sink: both move to replica 1."""
    stack = _up(tmp_path, workers=2, slots=2)
    try:
        steps = 6
        job = _submit(stack, _job(tmp_path, small_job, "elastic-2x2", 1, steps=steps, inner_steps=20, replicas=2,
                                  stages=2))
        _, before = _kill_mid_round(stack, job, replica=0)
        rec = wait_for(stack, job, lambda s: s.get("members") == [1] or s["state"] != "running", timeout=120)
        res = dlx("status", job, "--stack", str(stack))
        assert "members: 1 of 2 replicas (min 1, epoch 1): replica 1 (" in res.stdout, res.stdout
        rec = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=600)
        assert rec["state"] == "completed", rec.get("error")
        assert _commits(rec) == list(range(1, steps + 1))
        sets, _ = _audit(rec, steps)
        assert all(s == [0, 1] for s in sets[:before]), sets
        first = sets.index([1])
        assert first <= before + 1 and all(s == [1] for s in sets[first:]), sets
    finally:
        _down(stack)
