"""`dlx verify` on an AllReduce-DDP baseline run: there is no outer step, so level 3
(aggregate) is not applicable and says why; every other level is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from dlx_testing.here import dlx_here

DLX = str(Path(sys.executable).parent / "dlx")


@pytest.mark.slow
def test_a_baseline_run_verifies_with_the_aggregate_level_not_applicable(tmp_path, small_job):
    job = tmp_path / "job.toml"
    job.write_text(small_job("baseline", steps=2, inner_steps=3, stages=1).replace(
        "[parallel]\n", '[parallel]\nsync = "allreduce"\n'))
    run_dir = tmp_path / "run"
    res = subprocess.run([DLX, "train", str(job), "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    res = dlx_here("verify", "--run-dir", run_dir, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    for step in report["steps"]:
        assert step["passed"] == ["chain", "content", "data"], step
        assert "no outer step" in step["unavailable"]["aggregate"]
