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

from tests.test_doc_samples import check_sample
from tests.test_queue import DLX, _job, dlx, submit, wait_for

pytestmark = pytest.mark.slow

FINAL = ("completed", "failed", "cancelled")


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


def test_run_files_end_in_the_jobs_state_and_logs_show_each_ranks_training(stack, tmp_path, small_job):
    done = submit(stack, _job(tmp_path, small_job, "ux-done", steps=2))
    long = submit(stack, _job(tmp_path, small_job, "ux-cancel", steps=40, inner_steps=5))
    st = wait_for(stack, done, lambda s: s["state"] in FINAL)
    assert st["state"] == "completed", st
    assert _run_file(st)["status"] == "completed"

    res = dlx("logs", done, "--stack", str(stack))
    assert res.returncode == 0, res.stderr
    for r in range(4):
        assert f"== rank {r}, attempt 1" in res.stdout
        assert f"rank {r}: started" in res.stdout and f"rank {r}: done" in res.stdout
        assert f"rank {r}: outer step 2: contribution ready" in res.stdout
    assert "rank 0: outer step 2/2 inner 4/4 loss" in res.stdout
    assert "rank 0: outer step 2 done, eval loss" in res.stdout
    zero = dlx("logs", done, "--rank", "0", "--stack", str(stack))
    check_sample("dlx logs --rank 0", zero.stdout)
    one = dlx("logs", done, "--rank", "1", "--stack", str(stack))
    assert one.returncode == 0, one.stderr
    assert "== rank 1, attempt 1" in one.stdout and "rank 0" not in one.stdout and "worker-" not in one.stdout
    bad = dlx("logs", done, "--rank", "9", "--stack", str(stack))
    assert bad.returncode != 0 and "no logs of rank 9" in bad.stderr

    # --follow prints lines as they are written and returns when the job ends.
    wait_for(stack, long, lambda s: s["state"] == "running")
    follow = subprocess.Popen([DLX, "logs", long, "--rank", "0", "--follow", "--stack", str(stack)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    st = wait_for(stack, long, lambda s: (s["step"] or 0) >= 1 or s["state"] in FINAL)
    assert st["state"] == "running", st
    assert dlx("cancel", long, "--stack", str(stack)).returncode == 0
    st = wait_for(stack, long, lambda s: s["state"] in FINAL, timeout=120)
    assert st["state"] == "cancelled", st
    out, err = follow.communicate(timeout=60)
    assert follow.returncode == 0, err
    assert "rank 0: outer step 1 done" in out and out.rstrip().endswith(f"== job {long} cancelled"), out[-2000:]
    assert "rank 0: cancelled" in out
    check_sample("dlx logs --follow, cancelled", out)
    time.sleep(1)  # the sink's task settles run.json once its relay ends
    assert _run_file(st)["status"] == "cancelled"

    assert dlx("down", "--stack", str(stack)).returncode == 0
    res = dlx("runs", "--stack", str(stack), "--json")
    assert res.returncode == 0, res.stderr
    states = {Path(r["run_dir"]).name: r["state"] for r in json.loads(res.stdout)}
    assert states == {done: "completed", long: "cancelled"}, states
    check_sample("dlx runs after down", dlx("runs", "--stack", str(stack)).stdout)
