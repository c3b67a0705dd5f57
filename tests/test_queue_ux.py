"""What a queue user sees of finished jobs, through the real CLI on a real stack (`dlx up`):
a job's run.json ends in the job's final state (`completed`, `cancelled`), which `dlx runs`
shows after `dlx down`; each rank's training output reaches its log file, line by line,
and `dlx logs JOB [--rank R] [--follow]` prints it (issue 37, items 3 and 4)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from dlx_testing.cheat import hold_before

from tests.test_doc_samples import check_sample
from tests.test_queue import DLX, _job, dlx, submit, wait_for

pytestmark = pytest.mark.slow

FINAL = ("completed", "failed", "cancelled")
STEPS, INNER = 5, 20


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("stack") / ".dlx"
    res = dlx("up", "--workers", "2", "--slots", "2", "--stack", str(d))
    assert res.returncode == 0, res.stderr
    yield d
    if (d / "stack.json").is_file():  # the test takes it down itself
        dlx("down", "--stack", str(d))


def _run_file(st: dict) -> dict:
    return json.loads((Path(st["run_dir"]) / "run.json").read_text())


def _settled(st: dict, status: str, timeout: float = 30) -> dict:
    """run.json once it says `status` (the sink's task settles it once its relay ends, a
    moment after the job record), or as it stands at the deadline."""
    deadline = time.monotonic() + timeout
    while (doc := _run_file(st))["status"] != status and time.monotonic() < deadline:
        time.sleep(0.1)
    return doc


def test_run_files_end_in_the_jobs_state_and_logs_show_each_ranks_training(stack, tmp_path, small_job):
    done = submit(stack, _job(tmp_path, small_job, "ux-done", steps=STEPS, inner_steps=INNER))
    st = wait_for(stack, done, lambda s: s["state"] in FINAL)
    assert st["state"] == "completed", st
    assert _run_file(st)["status"] == "completed"

    res = dlx("logs", done, "--stack", str(stack))
    assert res.returncode == 0, res.stderr
    for r in range(4):
        assert f"== rank {r}, attempt 1" in res.stdout
        assert f"rank {r}: started" in res.stdout and f"rank {r}: done" in res.stdout
        assert f"rank {r}: outer step {STEPS}: contribution ready" in res.stdout
    assert f"rank 0: outer step {STEPS}/{STEPS} inner {INNER}/{INNER} loss" in res.stdout
    assert f"rank 0: outer step {STEPS} done, eval loss" in res.stdout
    zero = dlx("logs", done, "--rank", "0", "--stack", str(stack))
    check_sample("dlx logs --rank 0", zero.stdout)
    one = dlx("logs", done, "--rank", "1", "--stack", str(stack))
    assert one.returncode == 0, one.stderr
    assert "== rank 1, attempt 1" in one.stdout and "rank 0" not in one.stdout and "worker-" not in one.stdout
    bad = dlx("logs", done, "--rank", "9", "--stack", str(stack))
    assert bad.returncode != 0 and "no logs of rank 9" in bad.stderr

    # --follow prints lines as they are written and returns when the job ends. Its ranks hold
    # before step 3 until the cancel is sent (the dlx_testing hold), so the cancel lands
    # mid-run however fast or loaded the machine is.
    sent = tmp_path / "cancel-sent"
    path = _job(tmp_path, small_job, "ux-resumed", steps=STEPS, inner_steps=INNER)
    hold_before(path, 3, sent)
    long = submit(stack, path)
    wait_for(stack, long, lambda s: s["state"] == "running")
    follow = subprocess.Popen([DLX, "logs", long, "--rank", "0", "--follow", "--stack", str(stack)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    st = wait_for(stack, long, lambda s: ((s["step"] or 0) >= 1 and (s.get("outer_step") or 0) >= 2)
                  or s["state"] in FINAL)
    assert st["state"] == "running", st
    assert dlx("cancel", long, "--stack", str(stack)).returncode == 0
    sent.touch()
    st = wait_for(stack, long, lambda s: s["state"] in FINAL, timeout=120)
    assert st["state"] == "cancelled", st
    out, err = follow.communicate(timeout=60)
    assert follow.returncode == 0, err
    assert "rank 0: outer step 1 done" in out and out.rstrip().endswith(f"== job {long} cancelled"), out[-2000:]
    assert "rank 0: cancelled" in out
    check_sample("dlx logs --follow, cancelled", out)
    assert _settled(st, "cancelled")["status"] == "cancelled"
    _resume_counts_on(stack, done, long, st)

    assert dlx("down", "--stack", str(stack)).returncode == 0
    res = dlx("runs", "--stack", str(stack), "--json")
    assert res.returncode == 0, res.stderr
    states = {Path(r["run_dir"]).name: r["state"] for r in json.loads(res.stdout)}
    assert states == {done: "completed", long: "completed"}, states
    check_sample("dlx runs after down", dlx("runs", "--stack", str(stack)).stdout)


def _lineage(run_dir: str) -> list[dict]:
    res = dlx("lineage", "--run-dir", run_dir, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["steps"]


def _resume_counts_on(stack: Path, done: str, job: str, st: dict) -> None:
    """`dlx resume` of the cancelled job: it says where it starts, its run.json says
    `queued` then `completed`, and its manifests' cumulative metrics match the job that
    was never stopped (the same training, bit for bit)."""
    head = int(st["step"])
    res = dlx("resume", job, "--stack", str(stack))
    assert res.returncode == 0, res.stderr
    assert f"resumes from step {head} (attempt 2)" in res.stdout
    end = wait_for(stack, job, lambda s: s["state"] in FINAL and s["attempt"] == 2, timeout=300)
    assert end["state"] == "completed", end
    assert _settled(end, "completed")["status"] == "completed"
    a, b = _lineage(wait_for(stack, done, lambda s: True)["run_dir"]), _lineage(end["run_dir"])
    keys = ("bytes_sent", "modelled_comm_s", "tokens", "eval_loss")
    assert [{k: s["metrics"][k] for k in keys} for s in b] == [{k: s["metrics"][k] for k in keys} for s in a]
    lines = [json.loads(x) for x in (Path(end["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert {"kind": "resume", "step": head} in [{k: x.get(k) for k in ("kind", "step")} for x in lines]
    assert all(x["step"] > head for x in lines if x.get("abandoned"))
    logs = dlx("logs", job, "--rank", "0", "--stack", str(stack)).stdout
    assert "== rank 0, attempt 2" in logs and f"attempt 2 resumes from step {head}" in logs
