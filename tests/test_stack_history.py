"""A local stack keeps its history across `dlx down` and `dlx up` (real redis-server, anvil,
state keeper and Celery workers).

Covers: a job submitted to the stack completes; `dlx runs --stack` lists it (id, steps, head,
state, loss) and `dlx logs JOB` shows each rank's output and the workers' lines on the job;
the stack's anvil killed with SIGKILL (no exit dump) loses nothing: after `dlx down` (every
process `up` started is stopped) `up` restarts the same chain from the keeper's state file,
on the same port, with the same ledger (not redeployed), and docs/queue.md's
`dlx lineage --run-dir` and `dlx verify JOB --stack` audit the first run; after a clean `down`
with the old port taken, `up` moves the chain to another port and the run's run.json still
finds it (it names its stack); with the stack down, `dlx verify JOB` names `dlx up`. (The
later `up`s start no workers: the audits need none, and each worker start costs seconds.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DLX, small_job_toml

pytestmark = pytest.mark.slow


def dlx(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"dlx {' '.join(args)}: {res.stderr[-2000:]}"
    return res


def up(stack: Path, workers: int = 2) -> dict:
    dlx("up", "--workers", str(workers), "--slots", "1", "--stack", str(stack))
    return json.loads((stack / "stack.json").read_text())


def wait_done(stack: Path, job: str, timeout: float = 300) -> dict:
    """The job's record once it completes, read from the stack's Redis (what `dlx status
    --json` prints), polled without a `dlx` process per look."""
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack).redis_url))
    deadline = time.monotonic() + timeout
    while (state := store.get(job))["state"] != "completed":
        assert state["state"] in ("queued", "running") and time.monotonic() < deadline, state
        time.sleep(0.2)
    return state


def down(stack: Path) -> None:
    pids = json.loads((stack / "stack.json").read_text())
    dlx("down", "--stack", str(stack))
    every = [pids["redis_pid"], pids["anvil_pid"], pids["keeper_pid"], *[w["pid"] for w in pids["workers"]]]
    assert not [p for p in every if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]


def audit(stack: Path, job: str) -> list[int]:
    """docs/queue.md's commands for a stack run (the job named as a run, and the older
    --run-dir form); returns the steps on chain."""
    lineage = json.loads(dlx("lineage", "--run-dir", str(stack / "runs" / job), "--json").stdout)
    dlx("verify", job, "--stack", str(stack))
    return [s["step"] for s in lineage["steps"]]


def test_a_stack_keeps_its_chain_and_ledger_across_down_and_up(tmp_path: Path) -> None:
    stack = tmp_path / ".dlx"
    first = up(stack)
    job_file = tmp_path / "job.toml"
    job_file.write_text(small_job_toml("history", steps=2, inner_steps=3, replicas=2, stages=1))
    job = dlx("submit", str(job_file), "--stack", str(stack)).stdout.strip()
    wait_done(stack, job)
    state = json.loads(dlx("status", job, "--stack", str(stack), "--json").stdout)
    assert state["state"] == "completed", state

    (row,) = json.loads(dlx("runs", "--stack", str(stack), "--json").stdout)
    assert (row["steps"], row["state"], row["head"]) == (2, "completed", state["head"])
    assert row["loss"] > 0
    logs = dlx("logs", job, "--stack", str(stack)).stdout
    assert "== rank 0, attempt 1" in logs and "== rank 1, attempt 1" in logs
    assert f"run_rank[{job}-a1-r0]" in logs  # the workers' own lines on the job's tasks

    os.kill(first["anvil_pid"], signal.SIGKILL)  # no exit dump: only the keeper's saves remain
    down(stack)
    second = up(stack, workers=0)  # the chain's history is the point here: no worker need start
    assert (second["rpc"], second["ledger"], second["registry"]) == (first["rpc"], first["ledger"], first["registry"])
    assert audit(stack, job) == [1, 2]

    down(stack)
    with socket.socket() as squatter:  # the chain's old port is taken now
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # it may be in TIME_WAIT
        squatter.bind(("127.0.0.1", int(first["rpc"].rsplit(":", 1)[1])))
        squatter.listen()
        third = up(stack, workers=0)
        assert third["rpc"] != first["rpc"] and third["ledger"] == first["ledger"]
        assert audit(stack, job) == [1, 2]  # run.json finds the chain where it listens now
        down(stack)
    # The stack down: its run's chain is gone with it, and the error says what brings it back.
    res = subprocess.run([DLX, "verify", job, "--stack", str(stack)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and f"`dlx up --stack {stack.resolve()}` brings both back" in res.stderr, res.stderr
