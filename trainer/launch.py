"""Run a job on this machine: R*S spawned processes, the sink in the parent.

    from trainer import load_job, train_local
    train_local(load_job(tomllib.load(f)), sink)

The ranks run under `trainer.supervisor.Supervisor`: rank 0's `emit` puts events on its
queue; the parent takes them off and calls the sink, so the sink (a chain client, a blockstore) need not be picklable. A rank
that raises sends its exception text through the same queue; the parent then stops the
others and raises one `TrainingError` naming the rank and the cause.

Stops are cooperative, as the job queue's cancel: setting the `stop` event makes rank 0
(`RankControl.stop_requested`) stop every rank at the next inner-step boundary, after the
steps already reported; `train_local` then returns "stopped". `start` resumes each rank
from a committed checkpoint (`RankControl.start`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import multiprocessing as mp
import socket
import time
from typing import Any, Literal

from trainer.artifacts import StepSink, spill_directory
from trainer.config import JobConfig
from trainer.errors import ConfigError, TrainingError
from trainer.supervisor import SILENT, ChildOptions, Supervisor, exit_note, peer_loss

__all__ = ["StopFlag", "check_local", "free_port", "local_bytes", "stop_event", "train_local", "train_rank"]

MAX_LOCAL_RANKS = 64  # one process each on this machine; the job queue has no such limit
# A rank's peak = RANK_OVERHEAD_BYTES + BYTES_PER_PARAM x the parameters of its stage: the
# floor of 28 bytes (float32 weights, grads, AdamW's two moments, the outer copy and its
# momentum, the error-feedback residual) plus the outer step's working memory, over the
# forked interpreter with torch (~300 MB) and the inner steps' activations. Measured by
# scripts/bench_scale.py (docs/benchmarks.md, "Scale"): llamas of 11M, 43M and 132M parameters, 2 x 1,
# peaked at 744, 1749 and 4510 MB: 32.2 bytes per parameter over ~440 MB.
RANK_OVERHEAD_BYTES = 512 << 20
BYTES_PER_PARAM = 32
# The launcher holds one outer step's bytes on their way to the sink: every replica's
# round-start state (weights, AdamW moments, residual: up to 16 bytes per parameter) and
# each stage's shard (weights and momentum: 8). Measured: 783, 1784 and 5382 MB for the
# same runs.
LAUNCHER_OVERHEAD_BYTES = 400 << 20
STATE_BYTES_PER_PARAM, SHARD_BYTES_PER_PARAM = 16, 8
NETNS_PORT = 29500  # the store's port inside replica 0's fresh namespace
GRACE_S = 2.0  # after the first failure, how long to wait for the root cause to arrive


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _torch_has_gpu_build() -> bool:
    """Whether the installed torch may have been built for a GPU, read from its package
    version without importing torch (2 s a launcher would otherwise pay): False for a
    `+cpu` wheel, True otherwise, so that torch itself is asked."""
    try:
        return not importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return True


def gpu_count() -> int:
    """The GPUs torch can use on this machine (0 for a CPU-only torch, without importing it)."""
    if not _torch_has_gpu_build():
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_bytes(job: JobConfig) -> int:
    """About the most memory a local run of `job` holds at once: its ranks' peaks and the
    launcher's copy of an outer step (the constants above)."""
    n, R = job.model.n_params(), job.parallel.replicas
    ranks = R * n * BYTES_PER_PARAM + job.world_size * RANK_OVERHEAD_BYTES
    return ranks + LAUNCHER_OVERHEAD_BYTES + n * (STATE_BYTES_PER_PARAM * R + SHARD_BYTES_PER_PARAM)


def check_local(job: JobConfig) -> str:
    """Refuse a local run that would overwhelm this machine, or ask for GPUs it lacks
    (ConfigError, before anything starts); return the device the ranks will use, with why.

    Every rank of a local run is a process here, so the rank count and the memory the
    ranks need are capped by this machine; runs through the job queue spread over workers
    and have no such limit."""
    world, R = job.world_size, job.parallel.replicas
    if world > MAX_LOCAL_RANKS:
        raise ConfigError(
            f"parallel.replicas x parallel.stages ({world} ranks) exceeds {MAX_LOCAL_RANKS}, the "
            "most a local run starts on one machine (one process per rank): submit it to the "
            "job queue (dlx submit), whose workers share the ranks"
        )
    need = local_bytes(job)
    have = _available_bytes()
    if have is not None and need > 0.9 * have:
        raise ConfigError(
            f"this local run needs about {need / 2**30:.1f} GiB of memory ({world} ranks, "
            f"{R} model copies of {job.model.n_params() / 1e6:.1f}M parameters with their "
            f"optimizer and outer state, and the launcher's copy of a step); this machine has "
            f"{have / 2**30:.1f} GiB available: use fewer replicas, or the job queue (dlx submit)"
        )
    want = job.parallel.device
    if want == "cpu":
        return "cpu"
    gpus = gpu_count()
    if gpus >= world:
        return f"cuda ({world} of {gpus} GPUs)"
    if want == "cuda":
        raise ConfigError(
            f"parallel.device = 'cuda' but this machine has {gpus} GPU{'s' if gpus != 1 else ''} "
            f"for {world} ranks (each rank needs its own)"
        )
    return f"cpu (auto: {gpus} GPU{'s' if gpus != 1 else ''} for {world} ranks)"


def train_rank(emit: Any, rank: int, world_size: int, init_method: str, job: JobConfig,
               control: Any = None) -> None:
    """A supervised child's work (`trainer.supervisor.child_main`): global rank `rank` of
    `job` (`trainer.engine.run_rank`). Imported here so the parent needs no
    torch.distributed."""
    from trainer.engine import run_rank

    run_rank(rank, world_size, init_method, job, emit, control)


class StopFlag:
    """Picklable: rank 0 polls it at inner-step boundaries; true once the launcher set `event`."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def __call__(self) -> bool:
        return bool(self.event.is_set())


def _pick_cause(errors: dict[int, str]) -> tuple[int, str]:
    """The most likely root cause: a rank's own exception first, then a rank that died
    without a word (killed, crashed), and only then a peer's echo of the failure."""

    def rank_of(item: tuple[int, str]) -> int:
        text = item[1]
        if text.startswith(SILENT):
            return 1
        return 2 if peer_loss(text) else 0  # usually the echo of another rank's death

    return min(errors.items(), key=rank_of)  # min is stable: earliest report wins ties


Outcome = Literal["completed", "stopped"]


def stop_event() -> Any:
    """An event `train_local(stop=...)` can pass to its ranks (they are spawned)."""
    return mp.get_context("spawn").Event()


def train_local(job: JobConfig, sink: StepSink, *, timeout_s: float | None = None,
                stop: Any = None, start: list[Any] | None = None, hooks: Any = None) -> Outcome:
    """Train `job` in R*S local processes (gloo over 127.0.0.1), reporting to `sink`.

    `stop` (from `stop_event()`): once set, every rank stops at the next inner-step boundary
    and this returns "stopped". `start`: one `trainer.control.ResumePoint` per rank, to
    continue a run from a committed checkpoint. `hooks`: a `trainer.hooks.RankHooks` for
    every rank (a test's cheating ranks, tests/dlx_testing/cheat.py); None: honest ranks.
    Raises TrainingError if a rank fails or the run exceeds `timeout_s`; an exception
    raised by the sink stops the ranks and propagates unchanged. With
    `transport.link = "netns"` (root only) each replica's ranks run in their own network
    namespace behind a tc-shaped veth link (trainer/netns.py), removed afterwards.
    The data are prepared here, once, before any rank starts (a bad dataset is a
    ConfigError); the ranks memory-map that one token file. The ranks write their
    round-start states and shards into a spill directory made here (`RankControl.spill_dir`,
    removed at the end) rather than hold them; the sink gets them as bytes all the same.
    """
    if job.data.prepared is None:  # else nothing to do, and the import (torch) stays out of this process
        from trainer.data import with_prepared_data

        job = with_prepared_data(job)
    with contextlib.ExitStack() as stack:
        if job.transport.link == "netns":
            from trainer.netns import ReplicaLinks

            links = stack.enter_context(
                ReplicaLinks(job.parallel.replicas, job.transport.bandwidth_mbps,
                             job.transport.latency_ms)
            )
            init_method = links.init_method(NETNS_PORT)
            netns: list[str | None] = [links.names[rank // job.parallel.stages] for rank in range(job.world_size)]
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
            netns = [None] * job.world_size
        spill = stack.enter_context(spill_directory("spill"))
        controls = _controls(job, sink, stop, start, hooks, spill)
        return _train_local(job, sink, timeout_s, init_method, netns, controls)


def _train_local(job: JobConfig, sink: StepSink, timeout_s: float | None, init_method: str,
                 netns: list[str | None], controls: list[Any]) -> Outcome:
    with Supervisor(warm=True) as sup:
        for rank, control in enumerate(controls):
            sup.start(rank, train_rank, (rank, job.world_size, init_method, job, control),
                      name=f"dlx-rank-{rank}", options=ChildOptions(netns=netns[rank], ignore_sigint=True))
        return _supervise(sup, job.world_size, sink, timeout_s, controls[0].step_slots)


def _controls(job: JobConfig, sink: StepSink, stop: Any, start: list[Any] | None, hooks: Any,
              spill_dir: str | None = None) -> list[Any]:
    """Every rank's `RankControl` (a GPU each where this machine has one per rank); every
    rank gets the same `cancellable` (its deadlock hazard) and spill directory."""
    from trainer.control import RankControl

    cuda = check_local(job).startswith("cuda")
    pending = getattr(sink, "max_pending", None)  # a chain's sink: steps that may wait to be committed
    slots = mp.get_context("spawn").Semaphore(pending) if pending else None
    return [
        RankControl(stop_requested=StopFlag(stop) if stop is not None and rank == 0 else None,
                    step_slots=slots if rank == 0 else None,
                    cancellable=stop is not None, start=start[rank] if start else None,
                    shard_digest=getattr(sink, "shard_digest", None),  # a ledger's sink co-signs shards
                    gpu=rank if cuda else None, spill_dir=spill_dir, **({} if hooks is None else {"hooks": hooks}))
        for rank in range(job.world_size)
    ]


def _supervise(sup: Supervisor, world: int, sink: StepSink, timeout_s: float | None,
               step_slots: Any = None) -> Outcome:
    """Pass rank 0's events to `sink` until every rank is done or stopped, giving back one
    of `step_slots` (`RankControl.step_slots`) for each step the sink took; on a failure
    wait GRACE_S for the root cause and raise one TrainingError naming it."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done: set[int] = set()
    stopped: set[int] = set()
    errors: dict[int, str] = {}
    failed_at: float | None = None
    while len(done | stopped) < world:
        now = time.monotonic()
        if failed_at is not None and (now - failed_at > GRACE_S or len(errors) + len(done) == world):
            break
        if deadline is not None and now > deadline and failed_at is None:
            raise TrainingError(f"training timed out after {timeout_s:g} s")
        event = sup.next_event()
        if event is not None:
            kind, rank, payload = event
            if kind == "error":
                errors[rank] = payload  # replaces a silent-exit note for the same rank
                failed_at = failed_at or time.monotonic()
            elif kind == "done":
                done.add(rank)
            elif kind == "cancelled":
                stopped.add(rank)
            elif failed_at is None:
                _dispatch(sink, kind, payload)
                if kind == "step" and step_slots is not None:
                    step_slots.release()
        for rank, code in sup.dead():
            if rank not in errors:
                # Died, maybe without a word (killed, segfault). A rank that raised
                # flushed its message before exiting; it replaces this note.
                errors[rank] = exit_note(code)
                failed_at = failed_at or time.monotonic()
    if errors:
        errors.update({rank: text for kind, rank, text in sup.drain() if kind == "error"})
        rank, cause = _pick_cause(errors)
        raise TrainingError(f"rank {rank} failed: {cause}")
    sup.join()
    return "stopped" if stopped else "completed"


def _dispatch(sink: StepSink, kind: str, payload: Any) -> None:
    if kind == "genesis":
        sink.on_genesis(payload)
    elif kind == "step":
        sink.on_step(payload)
    elif kind == "progress":
        sink.on_progress(payload)
    elif kind in ("contribution", "epoch"):
        pass  # only launchers that ask for them (RankControl.emit_contributions) act on these
    else:
        raise TrainingError(f"unknown event kind from rank 0: {kind!r}")
