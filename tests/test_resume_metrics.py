"""A resumed run's cumulative metrics count on from its head (issue 37, item 5): the same
small job trained without a stop, and stopped with SIGTERM after step 2 then resumed
(`dlx train --resume`), commit the same manifests' bytes sent, modelled comm time, tokens
(and, the training being bit-identical, losses) at every step; each rank's counters are
recorded; the resume says where it starts; the stopped attempt's inner-step metrics stay
in metrics.jsonl, marked, and the report's charts draw only the committed path."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import DLX, small_job_toml
from test_stops import train, wait_steps

pytestmark = pytest.mark.slow

STEPS, INNER = 4, 30
SAME = ("bytes_sent", "modelled_comm_s", "tokens", "inner_steps", "eval_loss", "train_loss", "payload_bytes")


def _steps(run_dir: Path) -> list[dict]:
    res = subprocess.run([DLX, "lineage", "--run-dir", str(run_dir), "--json"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["steps"]


def test_a_resumed_runs_metrics_match_an_uninterrupted_runs(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(small_job_toml("resume-metrics", steps=STEPS, inner_steps=INNER, replicas=2, stages=1))
    whole = tmp_path / "whole"
    res = subprocess.run([DLX, "train", str(job), "--run-dir", str(whole)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]

    run_dir = tmp_path / "stopped"
    proc = train(str(job), "--run-dir", str(run_dir), log=tmp_path / "train.log")
    wait_steps(run_dir, proc, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    head = json.loads((run_dir / "run.json").read_text())["steps"]
    assert 2 <= head < STEPS
    res = subprocess.run([DLX, "train", "--resume", str(run_dir)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resuming from step {head}/{STEPS}" in res.stderr

    a, b = _steps(whole), _steps(run_dir)
    assert [s["step"] for s in b] == list(range(1, STEPS + 1))
    for sa, sb in zip(a, b, strict=True):
        assert {k: sb["metrics"][k] for k in SAME} == {k: sa["metrics"][k] for k in SAME}, sb["step"]
        per_rank = [sb["metrics"][f"bytes_sent.r{r}"] for r in range(2)]
        assert sum(per_rank) == sb["metrics"]["bytes_sent"] and all(per_rank)
    assert b[-1]["metrics"]["bytes_sent"] > b[head - 1]["metrics"]["bytes_sent"] > 0  # no restart from zero

    _the_stopped_attempts_inner_steps_are_marked(run_dir, head)


def _the_stopped_attempts_inner_steps_are_marked(run_dir: Path, head: int) -> None:
    from lineage.audit.report import committed_inner

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    inner = [x for x in lines if x.get("kind") == "inner"]
    dropped = [x for x in inner if x.get("abandoned")]
    assert dropped and all(x["step"] > head for x in dropped), "the stopped attempt's rounds past the head, marked"
    assert any(x.get("kind") == "resume" and x["step"] == head for x in lines)
    kept = committed_inner(lines)
    steps = [x["global_step"] for x in kept]
    assert steps == sorted(set(steps)) == list(range(1, STEPS * INNER + 1))  # one line per inner step, in order
