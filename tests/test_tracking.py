"""Metrics a run leaves for its watchers, read back with the trackers' own readers: a real
tiny `dlx train` with `[tracking] tensorboard = true` and an MLflow sqlite store; and
divergence (a NaN loss), which stops the run before anything of its step is stored.

    .venv/bin/pytest -q tests/test_tracking.py
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

DLX = str(Path(sys.executable).parent / "dlx")
T, H = 2, 6  # outer steps, inner steps of the tracked run

pytestmark = pytest.mark.slow


def dlx(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout)


def strict_records(path: Path) -> list[dict]:
    """metrics.jsonl, refusing NaN and Infinity (json.dumps writes them; JSON has neither)."""
    def refuse(name: str) -> float:
        raise AssertionError(f"{path} holds {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, small_job):
    root = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    job = root / "job.toml"
    job.write_text(small_job("tracked", steps=T, inner_steps=H, extra=f"""
[tracking]
tensorboard = true
mlflow = "{uri}"
"""))
    run_dir = root / "run"
    res = dlx("train", str(job), "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    records = strict_records(run_dir / "metrics.jsonl")
    return run_dir, uri, records


def test_metrics_jsonl_holds_every_inner_and_every_committed_step(tracked):
    run_dir, _, records = tracked
    inner = [r for r in records if r["kind"] == "inner"]
    outer = [r for r in records if r["kind"] == "outer"]
    assert [r["global_step"] for r in inner] == list(range(1, T * H + 1))
    assert [(r["step"], r["inner_step"]) for r in inner] == [(t, h) for t in range(1, T + 1) for h in range(1, H + 1)]
    assert all(r["loss"] > 0 and r["lr"] > 0 and r["tokens_per_s"] > 0 and r["eta_s"] >= 0 for r in inner)
    assert inner[0]["lr"] < inner[-1]["lr"]  # warmup (2 steps) shows in the lr
    assert inner[0]["rank0_bytes_sent"] == 0 and inner[-1]["rank0_bytes_sent"] > 0  # step 1's exchange
    assert [r["step"] for r in outer] == [1, 2]
    assert outer[-1]["checkpoint"] == json.loads((run_dir / "run.json").read_text())["head"]
    for key in ("eval_loss", "train_loss", "bytes_sent", "wall_s", "tokens"):
        assert all(key in r for r in outer), key
    assert outer[1]["bytes_sent"] > outer[0]["bytes_sent"] > 0


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, records = tracked
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    inner = [r for r in records if r["kind"] == "inner"]
    outer = [r for r in records if r["kind"] == "outer"]
    loss = events.Scalars("inner/loss")
    assert [e.step for e in loss] == [r["global_step"] for r in inner]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in inner], rel=1e-6)
    assert [e.step for e in events.Scalars("inner/lr")] == list(range(1, T * H + 1))
    evals = events.Scalars("outer/eval_loss")
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in evals] == [(r["step"], r["eval_loss"]) for r in outer]
    assert [e.value for e in events.Scalars("outer/bytes_sent")] == [r["bytes_sent"] for r in outer]


def test_mlflow_holds_the_params_metrics_and_checkpoint_cids(tracked):
    from mlflow.tracking import MlflowClient

    run_dir, uri, records = tracked
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tracked")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.d_model"] == "32" and run.data.params["outer.steps"] == str(T)
    assert "tracking.mlflow" not in run.data.params  # how it is watched is not what was trained
    outer = [r for r in records if r["kind"] == "outer"]
    tags = run.data.tags
    assert [tags[f"checkpoint.{r['step']}"] for r in outer] == [r["checkpoint"] for r in outer]
    assert tags["head"] == outer[-1]["checkpoint"] and tags["dlx.run_dir"] == str(run_dir)
    history = client.get_metric_history(run.info.run_id, "inner.loss")
    assert sorted((m.step, m.value) for m in history) == [
        (r["global_step"], pytest.approx(r["loss"])) for r in records if r["kind"] == "inner"]
    evals = client.get_metric_history(run.info.run_id, "outer.eval_loss")
    assert sorted((m.step, m.value) for m in evals) == [(r["step"], pytest.approx(r["eval_loss"])) for r in outer]


def test_tracking_stays_out_of_the_recorded_config(tracked):
    run_dir, _, _ = tracked
    res = dlx("lineage", "--run-dir", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)["config"]["job"]
    assert "tracking" not in job and "storage" not in job and job["name"] == "tracked"


@pytest.mark.parametrize(("section", "says"), [
    ('mlflow = "mlruns"', "tracking.mlflow: expected a tracking URI"),
    ("tensorboard = 1", "tracking.tensorboard"),
    ("wandb = true", "tracking.wandb"),
])
def test_bad_tracking_settings_are_one_line_errors(tmp_path, small_job, section, says):
    job = tmp_path / "job.toml"
    job.write_text(small_job("bad", extra=f"\n[tracking]\n{section}\n"))
    res = dlx("train", str(job), "--run-dir", str(tmp_path / "run"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlx: error: ") and says in lines[0], res.stderr
    assert not (tmp_path / "run").exists()


def test_divergence_stops_before_its_step_is_stored_and_keeps_the_steps_before(tmp_path, small_job):
    """A poisoned contribution (1e30 x the pseudo-gradient's RMS) at step 2 makes step 2's
    eval loss NaN: exit 1 with one line, step 1 stays committed and verifies, and no block
    of step 2 was stored (nothing in the store outside what the run's pin reaches)."""
    job = tmp_path / "job.toml"
    job.write_text(small_job("diverge", steps=2, inner_steps=4, stages=1,
                             extra='\n[cheat]\nmode = "poison"\nfrom_step = 2\nscale = 1e30\n'))
    run_dir = tmp_path / "run"
    res = dlx("train", str(job), "--run-dir", str(run_dir))
    assert res.returncode == 1, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("dlx: error:")]
    assert errors == ["dlx: error: training diverged at step 2 (eval loss nan)"], res.stderr
    assert "Traceback" not in res.stderr
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["steps"], record["status"]) == (1, "failed")
    outer = [r for r in strict_records(run_dir / "metrics.jsonl") if r["kind"] == "outer"]
    assert [(r["step"], r["checkpoint"]) for r in outer] == [(1, record["head"])]
    verify = dlx("verify", "--run-dir", str(run_dir), "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert [s["step"] for s in json.loads(verify.stdout)["steps"]] == [1]
    gc = dlx("cas", "gc", "--run-dir", str(run_dir), "--dry-run", "--grace", "0")
    assert gc.returncode == 0 and "would remove 0 block(s)" in gc.stderr, gc.stdout + gc.stderr


def test_a_nan_inner_loss_stops_the_run_at_that_inner_step(tmp_path, small_job):
    job = tmp_path / "job.toml"
    job.write_text(small_job("blowup", steps=2, inner_steps=4, stages=1).replace("lr = 3e-3", "lr = 1e6"))
    run_dir = tmp_path / "run"
    res = dlx("train", str(job), "--run-dir", str(run_dir))
    assert res.returncode == 1, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("dlx: error:")]
    assert len(errors) == 1 and errors[0].startswith("dlx: error: training diverged at step 1 (inner loss nan at inner step ")
    inner = [r for r in strict_records(run_dir / "metrics.jsonl") if r["kind"] == "inner"]
    assert inner and all(math.isfinite(r["loss"]) for r in inner)  # the NaN itself is not logged
    nan_step = int(errors[0].rsplit(" ", 1)[1].rstrip(")"))
    assert [r["inner_step"] for r in inner] == list(range(1, nan_step))
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["steps"], record["status"]) == (0, "failed")
