"""The job queue end to end: a real redis-server, a real anvil and real Celery worker
processes (`dlx up`), jobs submitted with `dlx submit` and followed with `dlx status`.

Covers: a job runs to completion with its lineage on chain and verifies; cancel stops a
job with its committed steps intact; a job needing more slots than exist fails saying so;
a worker killed with SIGKILL fails the round naming the lost rank, and `dlx resume` on a
replacement worker completes the run, which then verifies; rank leases turn duplicate
deliveries away (a live owner) and let a redelivery take over a dead owner's rank; sent
twice, a job's rank tasks still commit each step once; a Redis restart mid-job is
survived (durable Redis, retrying clients) with every step committed once; a job whose
ranks all vanished is failed by `dlx status`; the `verify` queue replays the first job's
steps on the workers (`dlx verify --replay 1 --queue`)."""

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
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

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
    nodes = lineage["steps"][0]["nodes"]  # slot order; each worker's two slots in one replica
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    res = dlx("status", job, "--stack", str(stack))
    assert res.returncode == 0 and "completed" in res.stdout
    _the_verify_queue_replays_the_run_on_the_workers(stack, st["run_dir"], lineage)


def _the_verify_queue_replays_the_run_on_the_workers(stack: Path, run_dir: str, lineage: dict) -> None:
    """`dlx verify --replay 1 --queue`, and the queue's API, on the run above (one job for both)."""
    from workers.queue.stack import Stack
    from workers.queue.verifyq import ReplayQueueError, replay_via_queue

    items = [(s["checkpoint"], r) for s in lineage["steps"] for r in (0, 1)]
    s = Stack.load(stack)
    results = replay_via_queue(s.redis_url, s.blocks, items, tolerance=0.0, timeout=300)
    assert [(r["step"], r["replica"]) for r in results] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["ok"] and all(x["exact"] for x in r["stages"]) for r in results), results
    res = dlx("verify", "--run-dir", run_dir, "--replay", "1", "--queue", "--stack", str(stack), "--json",
              timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr
    report = json.loads(res.stdout)
    assert sorted((r["step"], r["replica"]) for r in report["replay"]) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(s["passed"] == ["chain", "content", "aggregate", "data", "replay"] for s in report["steps"]), report
    bad = replay_via_queue(s.redis_url, s.blocks, [(lineage["steps"][0]["checkpoint"], 5)], timeout=120)
    assert not bad[0]["ok"] and "no replica 5" in bad[0]["error"]
    with pytest.raises(ReplayQueueError, match="no worker consumes the verify queue"):
        replay_via_queue(s.redis_url.rsplit("/", 1)[0] + "/9", s.blocks, items, timeout=5)


def test_cancel_stops_the_job_and_keeps_committed_steps(stack, tmp_path, small_job):
    job = submit(stack, _job(tmp_path, small_job, "q-cancel", steps=40, inner_steps=5, stages=1))
    st = wait_for(stack, job, lambda s: (s["step"] or 0) >= 1 or s["state"] in ("failed", "completed"))
    assert st["state"] == "running", st
    res = dlx("cancel", job, "--stack", str(stack))
    assert res.returncode == 0
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=120)
    assert st["state"] == "cancelled", st
    res = dlx("lineage", "--run-dir", st["run_dir"], "--json")
    steps = json.loads(res.stdout)["steps"]
    assert 1 <= len(steps) < 40 and steps[-1]["checkpoint"] == st["head"]


def test_a_killed_worker_fails_the_round_and_resume_completes_the_run(stack, tmp_path, small_job):
    info = json.loads((stack / "stack.json").read_text())
    job = submit(stack, _job(tmp_path, small_job, "q-kill", steps=4, inner_steps=20), "--collective-timeout", "20")
    wait_for(stack, job, lambda s: (s["step"] or 0) >= 1)
    victim = info["workers"][1]
    os.kill(victim["pid"], signal.SIGKILL)
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=120)
    assert st["state"] == "failed", st
    assert "lost rank" in st["error"] and victim["node"] in st["error"], st["error"]
    committed = st["step"]
    # a replacement worker with the same node key
    from workers.queue.stack import Stack, _spawn

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
    assert [s["step"] for s in report["steps"]] == list(range(1, 5))
    # Exact resume: the ranks re-ran round `committed` from its start states, so the inner
    # optimizer and compressor state they carried into the next round is the one that round
    # leaves (a replay of it says what that is), not a fresh one.
    from lineage.audit.replay import job_of, replay_many
    from lineage.chain.runrecord import RunRecord
    from lineage.store.manifest import get_manifest
    from lineage.store.roundstate import read_start_state
    from trainer.replay import fresh_state_core, state_core

    run_dir = Path(st["run_dir"])
    store = RunRecord.load(run_dir).open_store(run_dir)
    checkpoint = {s["step"]: s["checkpoint"] for s in report["steps"]}
    (seam,) = replay_many(store, [(checkpoint[committed], 1)], 0.0)
    assert seam.ok, seam.as_json()
    after = get_manifest(store, checkpoint[committed + 1])
    for s, left in enumerate(seam.end_states):
        carried = state_core(read_start_state(store, after, 1, s))
        assert carried == left, f"stage {s}: the resumed round did not start from the state round {committed} left"
        assert carried != fresh_state_core(job_of(store, after.config), 1, s, committed + 1)


def _commits(rec: dict) -> list[int]:
    """The step number of every commit of the job's run on chain (duplicates would show)."""
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger

    ledger = Ledger(Chain(rec["rpc"]), rec["registry"], rec["ledger"])
    return [c.record.step for c in ledger.commits(int(rec["run_id"]))]


def test_a_rank_lease_turns_a_duplicate_away_and_passes_on_when_its_owner_dies(stack):
    import threading

    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack).redis_url))
    ttl, beat = 2.0, 0.2
    assert store.take_rank("lease", 1, 0, "owner", ttl, beat)
    stop = threading.Event()

    def renew() -> None:  # the owner's heartbeat
        while not stop.wait(beat):
            store.heartbeat("lease", 1, 0, "owner", ttl)

    t = threading.Thread(target=renew)
    t.start()
    try:
        t0 = time.monotonic()
        assert not store.take_rank("lease", 1, 0, "duplicate", ttl, beat)  # the owner lives
        assert time.monotonic() - t0 < ttl
    finally:
        stop.set()
        t.join()
    t0 = time.monotonic()  # the owner died: its lease lapses and a redelivery takes the rank
    assert store.take_rank("lease", 1, 0, "redelivered", ttl, beat)
    assert time.monotonic() - t0 <= ttl + 2 * beat
    assert not store.heartbeat("lease", 1, 0, "owner", ttl)  # the old owner would stop


def test_rank_tasks_delivered_twice_commit_each_step_once(stack, tmp_path, small_job):
    from workers.cli.jobs import rank_task_id
    from workers.queue.app import make_app
    from workers.queue.stack import Stack

    app = make_app(Stack.load(stack).redis_url)
    job = submit(stack, _job(tmp_path, small_job, "q-dup", steps=3, inner_steps=10, stages=1))
    dups = {}
    # Rank 1 again at once (it races the original for the lease), then both ranks again
    # once the world has formed: every copy carries the original's arguments.
    dups["early-1"] = app.send_task("workers.queue.tasks.run_rank", args=(job, 1, 1), queue="train")
    wait_for(stack, job, lambda s: s["state"] != "queued")
    for rank in (0, 1):
        dups[f"late-{rank}"] = app.send_task("workers.queue.tasks.run_rank", args=(job, rank, 1), queue="train")
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"))
    assert st["state"] == "completed", st
    late = [dups[f"late-{r}"].get(timeout=60) for r in (0, 1)]
    assert all(r["skipped"] and r.get("duplicate") for r in late), late
    pair = [dups["early-1"].get(timeout=60), app.AsyncResult(rank_task_id(job, 1, 1)).get(timeout=60)]
    assert sorted(r.get("state", "skipped") for r in pair) == ["completed", "skipped"], pair
    assert _commits(st) == [1, 2, 3]


def test_a_redis_restart_mid_job_is_survived_and_no_step_is_lost_or_repeated(stack, tmp_path, small_job):
    from workers.queue.stack import Stack, restart_redis

    workers = [w["pid"] for w in Stack.load(stack).workers]
    job = submit(stack, _job(tmp_path, small_job, "q-redis", steps=6, inner_steps=20, stages=1))
    wait_for(stack, job, lambda s: (s["step"] or 0) >= 1)
    restart_redis(stack, down_s=2.0)  # SIGTERM (the append-only file is flushed), then the same port and dir
    st = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=300)
    assert st["state"] == "completed", st
    assert _commits(st) == [1, 2, 3, 4, 5, 6]
    assert status(stack, job)["state"] == "completed"
    from workers.queue.stack import alive

    assert all(alive(p) for p in workers)  # the worker nodes outlived the broker restart


def test_status_fails_a_running_job_whose_ranks_all_vanished(stack):
    from workers.queue.jobs import STALL_S, JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack).redis_url))
    job = store.create({"world": 2, "outer_steps": 3, "inner_steps": 2})
    store.r.hset(store.key(job), mapping={"state": json.dumps("running"),
                                          "updated": json.dumps(time.time() - STALL_S - 1)})
    st = status(stack, job)
    assert st["state"] == "failed", st
    assert "none of its 2 ranks has answered" in st["error"] and "dlx resume" in st["error"], st["error"]


def test_bad_worker_and_stack_options_are_one_line_errors(tmp_path):
    for args in (["worker", "--store-ports", "9-3"], ["up", "--host", "nope", "--stack", str(tmp_path / "s")]):
        res = dlx(*args, timeout=60)
        assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "s").exists()


def _dev_keys(n):
    from lineage.chain.anvil import dev_accounts

    return dev_accounts(n)


def test_eight_jobs_at_once_complete_each_step_once_and_verify(stack, tmp_path, small_job):
    """Load (issue 33 item 8): eight tiny jobs submitted at once to one stack (2 workers x 2
    slots) all complete, every step of every run is committed once, and every run verifies.
    A step is committed by the key of the worker that runs the job's rank 0, so each of the
    two workers' keys commits for several jobs at once (two slots each): one nonce manager
    per key across concurrent jobs."""
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger

    paths = [_job(tmp_path, small_job, f"load-{i}", steps=2, inner_steps=2, replicas=1, stages=1) for i in range(8)]
    from workers.cli.jobs import submit_job

    jobs = [submit_job(stack, p) for p in paths]  # `dlx submit`'s own function: no interpreter a job
    done = [wait_for(stack, j, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=600)
            for j in jobs]
    assert [st["state"] for st in done] == ["completed"] * 8, [(st["state"], st.get("error")) for st in done]
    assert len({st["run_id"] for st in done}) == 8
    jobs_of: dict[str, int] = {}
    for st in done:
        ledger = Ledger(Chain(st["rpc"]), st["registry"], st["ledger"])
        commits = ledger.commits(int(st["run_id"]))
        assert [c.record.step for c in commits] == [1, 2], st
        (key,) = {c.record.submitter.lower() for c in commits}  # one key a job
        jobs_of[key] = jobs_of.get(key, 0) + 1
        assert all(isinstance(st[f"step_{n}"]["commit_s"], float) for n in (1, 2))
    assert len(jobs_of) <= 2 and max(jobs_of.values()) >= 4, jobs_of
    # Every run verifies: `dlx verify --json`'s audit (verify_run), here in this process, not
    # eight interpreters importing torch and web3 each (the CLI's verify is tested above).
    from lineage.audit.verify import verify_run

    for st in done:
        report = verify_run(Path(st["run_dir"])).as_json()
        assert report["ok"], report
        assert all(s["ok"] and "chain" in s["passed"] for s in report["steps"]), report
