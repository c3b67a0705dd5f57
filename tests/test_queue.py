"""The job queue end to end: a real redis-server, a real anvil and real Celery worker
processes (`dlx up`), jobs submitted with `dlx submit` and followed with `dlx status`.

Covers: a job runs to completion with its lineage on chain and verifies; cancel stops a
job with its committed steps intact; a job needing more slots than exist fails saying so;
a worker killed with SIGKILL fails the round naming the lost rank, and `dlx resume` on a
replacement worker completes the run, which then verifies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DLX = str(Path(sys.executable).parent / "dlx")

pytestmark = pytest.mark.slow


def dlx(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stack")
    res = dlx("up", "--workers", "2", "--slots", "2", "--stack", str(d / ".dlx"))
    assert res.returncode == 0, res.stderr
    yield d / ".dlx"
    res = dlx("down", "--stack", str(d / ".dlx"))
    assert res.returncode == 0, res.stderr


def status(stack: Path, job: str) -> dict:
    res = dlx("status", job, "--stack", str(stack), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def wait_for(stack: Path, job: str, pred, timeout: float = 300) -> dict:
    """Poll the job record in Redis directly (the CLI's `status --json` reads the same)."""
    from workers.jobs import JobStore, connect
    from workers.stack import Stack

    store = JobStore(connect(Stack.load(stack).redis_url))
    deadline = time.monotonic() + timeout
    while True:
        st = {"job": job, **store.get(job)}
        st.setdefault("step", None)
        if pred(st):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.2)


def _job(tmp: Path, small_job, name: str, **kw) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(small_job(name, seed=3, **kw))
    return path


def submit(stack: Path, path: Path, *extra: str) -> str:
    res = dlx("submit", str(path), "--stack", str(stack), *extra)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip()
    assert len(job) == 12
    return job


def test_a_submitted_job_completes_with_its_lineage_on_chain(stack, tmp_path, small_job):
    job = submit(stack, _job(tmp_path, small_job, "q-ok", steps=2))
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"))
    assert st["state"] == "completed", st
    assert st["step"] == 2 and st["run_id"] >= 1 and st["loss"] is not None
    res = dlx("lineage", "--run-dir", st["run_dir"], "--json")
    assert res.returncode == 0, res.stderr
    lineage = json.loads(res.stdout)
    assert [s["step"] for s in lineage["steps"]] == [1, 2]
    assert len(set(lineage["steps"][0]["nodes"])) == 2  # two workers, two node keys
    res = dlx("verify", "--run-dir", st["run_dir"], "--json")
    assert res.returncode == 0, res.stdout
    res = dlx("status", job, "--stack", str(stack))
    assert res.returncode == 0 and "completed" in res.stdout


def test_cancel_stops_the_job_and_keeps_committed_steps(stack, tmp_path, small_job):
    job = submit(stack, _job(tmp_path, small_job, "q-cancel", steps=40, inner_steps=5))
    st = wait_for(stack, job, lambda s: (s["step"] or 0) >= 1 or s["state"] in ("failed", "completed"))
    assert st["state"] == "running", st
    res = dlx("cancel", job, "--stack", str(stack))
    assert res.returncode == 0
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=120)
    assert st["state"] == "cancelled", st
    res = dlx("lineage", "--run-dir", st["run_dir"], "--json")
    steps = json.loads(res.stdout)["steps"]
    assert 1 <= len(steps) < 40 and steps[-1]["checkpoint"] == st["head"]


def test_a_job_needing_more_slots_than_exist_fails_clearly(stack, tmp_path, small_job):
    job = submit(stack, _job(tmp_path, small_job, "q-big", steps=1, replicas=3), "--rendezvous-timeout", "8")
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=120)
    assert st["state"] == "failed"
    assert "needs 6 rank slots" in st["error"] and "4 joined" in st["error"], st["error"]


def test_a_killed_worker_fails_the_round_and_resume_completes_the_run(stack, tmp_path, small_job):
    info = json.loads((stack / "stack.json").read_text())
    job = submit(stack, _job(tmp_path, small_job, "q-kill", steps=8, inner_steps=40), "--collective-timeout", "20")
    wait_for(stack, job, lambda s: (s["step"] or 0) >= 1)
    victim = info["workers"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=120)
    assert st["state"] == "failed", st
    assert "lost rank" in st["error"] and victim["node"] in st["error"], st["error"]
    committed = st["step"]
    # a replacement worker with the same node key
    from workers.stack import Stack, _spawn

    s = Stack.load(stack)
    key = next(k for k in _dev_keys(4) if k.address == victim["node"])
    pid = _spawn([sys.executable, "-m", "workers.cli", "worker", "--slots", "2"],
                 stack / "logs" / "worker-replacement.log", s.worker_env(key.key.hex(), 2))
    info["workers"][1]["pid"] = pid  # so `dlx down` stops the replacement too
    (stack / "stack.json").write_text(json.dumps(info))
    res = dlx("resume", job, "--stack", str(stack))
    assert res.returncode == 0, res.stderr
    assert f"from step {committed}" in res.stdout
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=300)
    assert st["state"] == "completed", st
    res = dlx("verify", "--run-dir", st["run_dir"], "--json")
    report = json.loads(res.stdout)
    assert res.returncode == 0, report
    assert [s["step"] for s in report["steps"]] == list(range(1, 9))


def _dev_keys(n):
    from lineage.anvil import dev_accounts

    return dev_accounts(n)
