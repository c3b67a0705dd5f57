"""Where a run's metrics go besides the chain: `<run dir>/metrics.jsonl` always, TensorBoard
and MLflow when the job's `[tracking]` section asks.

    [tracking]
    tensorboard = true                  # event files under <run dir>/tensorboard
    mlflow = "sqlite:///mlflow.db"      # params, metrics and checkpoint CIDs

`metrics.jsonl` holds one JSON object per line, appended as training goes:
- ``{"kind": "inner", "step", "inner_step", "global_step", "loss", "lr", "tokens_per_s",
  "rank0_bytes_sent", "eta_s"}`` per inner step of replica 0 (`trainer.artifacts.Progress`);
- ``{"kind": "outer", "step", "checkpoint", ...}`` per committed outer step, with every
  metric the engine reported for it (`trainer.artifacts.StepArtifacts.metrics`: eval_loss,
  train_loss, bytes_sent, rel_error, wall_s, ...);
- ``{"kind": "resume", "step", "time"}`` where a resumed attempt starts from committed step
  `step` (`mark_resume`): the inner lines an earlier attempt wrote for rounds past it stay,
  with ``"abandoned": true``, and charts leave them out (`lineage.audit.report.committed_inner`).

TensorBoard and MLflow are imported only when a job asks for them (the `tracking` extra).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from lineage.audit.report import flatten

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
MLFLOW_SCHEMES = ("file", "sqlite", "http", "https")
_EXTRA = "pip install 'dilocox-ledger[tracking]'"


def check_tensorboard() -> None:
    """ValueError (the job file's validation names the field) if TensorBoard is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"needs the tensorboard package ({_EXTRA})")


def check_mlflow(uri: str) -> None:
    """ValueError if `uri` is no MLflow tracking URI, or its packages are missing here."""
    scheme = urlparse(uri).scheme
    if scheme not in MLFLOW_SCHEMES:
        raise ValueError(f"expected a tracking URI ({', '.join(s + ':' for s in MLFLOW_SCHEMES)}), got {uri!r}")
    needs = ["mlflow"] + (["sqlalchemy", "alembic"] if scheme == "sqlite" else [])
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"{uri!r} needs the {', '.join(missing)} package(s) ({_EXTRA})")


class Tracker(Protocol):
    """One destination of metrics; every call happens in the process that owns the sink."""

    def inner(self, record: dict[str, Any]) -> None: ...
    def outer(self, step: int, checkpoint: str, metrics: dict[str, float]) -> None: ...
    def finish(self, ok: bool) -> None: ...


class MetricsLog:
    """`<run dir>/metrics.jsonl`: one JSON object per line (keys in the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def inner(self, record: dict[str, Any]) -> None:
        self._append(record)

    def outer(self, step: int, checkpoint: str, metrics: dict[str, float]) -> None:
        self._append({"kind": "outer", "step": step, "checkpoint": checkpoint, **metrics})

    def finish(self, ok: bool) -> None:
        pass


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl ([] if it has none), in the order written."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mark_resume(run_dir: Path, step: int) -> int:
    """A resume from committed step `step`: mark the inner lines of rounds past it (a stopped
    or failed attempt's work, which no commit kept) `"abandoned": true`, and note the
    resume; the file is replaced atomically. Returns how many lines were marked."""
    path = Path(run_dir) / METRICS_FILE
    records = read_metrics(run_dir)
    marked = 0
    for r in records:
        if r.get("kind") == "inner" and int(r.get("step", 0)) > step and not r.get("abandoned"):
            r["abandoned"] = True
            marked += 1
    records.append({"kind": "resume", "step": step, "time": time.time()})
    tmp = path.with_name(f".{METRICS_FILE}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)
    return marked


class TensorBoard:
    """Event files under `<run dir>/tensorboard`: inner scalars at the run's inner step,
    outer ones (``outer/<metric>``) at the outer step."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def inner(self, record: dict[str, Any]) -> None:
        step = int(record["global_step"])
        for key in ("loss", "lr", "tokens_per_s", "eta_s"):
            self.writer.add_scalar(f"inner/{key}", record[key], step)

    def outer(self, step: int, checkpoint: str, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(f"outer/{key}", value, step)
        self.writer.add_text("checkpoint", checkpoint, step)
        self.writer.flush()

    def finish(self, ok: bool) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run per `dlx` run: the job's settings as params, inner metrics (logged in
    one batch per outer step) at the run's inner step, outer metrics (``outer.<metric>``)
    at the outer step, each checkpoint's CID as the tag ``checkpoint.<step>``."""

    BATCH = 1000  # MLflow's limit on metrics per log_batch call

    def __init__(self, uri: str, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str]) -> None:
        if urlparse(uri).scheme == "file":
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the user asked for this store
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their notes on creating tables are not the user's business
            logging.getLogger(name).setLevel(logging.WARNING)

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        flat = [Param(k, str(v)[:6000]) for k, v in sorted(flatten(params).items())]
        for i in range(0, len(flat), 100):  # MLflow's limit on params per call
            self.client.log_batch(self.run_id, params=flat[i:i + 100])
        self._pending: list[Any] = []
        self._done = False
        atexit.register(self.finish, False)  # a run that died without a word ends FAILED

    def inner(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["global_step"])
        self._pending += [Metric(f"inner.{k}", float(record[k]), now, step)
                          for k in ("loss", "lr", "tokens_per_s", "eta_s")]

    def outer(self, step: int, checkpoint: str, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        self._pending += [Metric(f"outer.{k}", float(v), now, step) for k, v in metrics.items()]
        self._flush()
        self.client.log_batch(self.run_id, tags=[RunTag(f"checkpoint.{step}", checkpoint),
                                                 RunTag("head", checkpoint)])

    def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:self.BATCH], self._pending[self.BATCH:]
            self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, ok: bool) -> None:
        if self._done:
            return
        self._done = True
        atexit.unregister(self.finish)  # a worker runs many jobs: hold on to none of them
        self._flush()
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def open_trackers(run_dir: Path, tracking: Any, name: str, params: dict[str, Any],
                  tags: dict[str, str]) -> list[Tracker]:
    """The metrics log, plus the trackers the job's `[tracking]` section (a
    `workers.run.jobfile.TrackingConfig`, or None) asks for."""
    trackers: list[Tracker] = [MetricsLog(run_dir)]
    if tracking is not None and tracking.tensorboard:
        trackers.append(TensorBoard(run_dir))
    if tracking is not None and tracking.mlflow:
        trackers.append(MLflow(tracking.mlflow, tracking.experiment or name, name, params, tags))
    return trackers
