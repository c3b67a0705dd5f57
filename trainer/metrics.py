"""What a rank measures and rank 0 reports beside the weights: the clocks of a round's
phases, tokens, the learning rate, inner-step progress with its ETA and each outer step's
metrics (`Meter`); the rank's peak resident memory (`peak_rss_mb`); and giving the C heap's
free pages back between a round's phases (`release_free_memory`).
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainer.artifacts import Contribution, Progress, StepArtifacts
from trainer.compress import Compressor
from trainer.config import JobConfig
from trainer.control import RANK_COUNTERS
from trainer.pipeline import warmup_lr
from trainer.transport import Transport
from trainer.world import Topology

__all__ = ["PROGRESS_EVERY", "Emit", "Meter", "peak_rss_mb", "release_free_memory"]

#: How rank 0 reports: `emit(kind, payload)` (trainer/engine.py's docstring lists the kinds).
Emit = Callable[[str, Any], None]

PROGRESS_EVERY = 5  # S > 1: inner steps whose losses reach rank 0 in one broadcast

_LIBC: Any = None  # glibc, once loaded (False: not there, or it has no malloc_trim)


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`, every arena):
    called between a round's phases, so that what a phase freed (activations, gradients,
    serialised bytes, decoded tensors) stops counting in the rank's resident memory rather
    than lingering in the heap, where the next phase's differently sized buffers would not
    fit and would take fresh pages. A no-op where the C library has no such call."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def peak_rss_mb() -> float:
    """This rank's own peak resident memory. Not `ru_maxrss`: Linux carries the launching
    process's peak into a spawned child's (exec records the old address space's high-water
    mark), so a rank started by a 2 GB parent reported 2 GB. `VmHWM` is the peak of the
    rank's own address space."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Meter:
    """A rank's clocks and counters through a run (every rank keeps its own; rank 0 combines
    every rank's into each outer step's metrics and is the one that emits): the time of a
    round's phases (`clock`), the tokens the present replicas trained, the inner learning
    rate, the partial rule's taus, and the inner steps' losses on their way to a
    `Progress` report."""

    def __init__(self, job: JobConfig, emit: Emit) -> None:
        self.job, self.emit = job, emit
        # compute_s: inner steps (comm waits excluded); rounds_wall_s: inner steps + round end;
        # compress_s: compression + decoding of every contribution.
        # report_s: publishing steps mid-round (partial rule), kept out of the other two;
        # merge_s: the partial rule's mid-round outer step and merge (wall, not compute).
        self.clock = {"compute_s": 0.0, "rounds_wall_s": 0.0, "compress_s": 0.0, "report_s": 0.0,
                      "merge_s": 0.0}
        self.compress_before = 0.0  # compress_s of the epochs before this one
        self.taus: list[int] = []  # the partial rule: the tau each round merged at
        self.lr = job.inner.lr  # the inner learning rate of the latest inner step
        self.unreported: list[float] = []  # replica 0: inner losses not yet reported
        self.started = self.since = time.perf_counter()  # rank 0: run start, last progress report
        self.paced = (self.started, 1)  # rank 0: (when, round) this epoch's rounds began, for the ETA
        self.tokens = 0  # cumulative tokens the present replicas trained, through the last step reported
        self.tokens_at: dict[int, int] = {}  # outer step -> tokens through it (elastic runs)
        # The round under way: when it began, when its inner steps began, and the exchange
        # wait, report_s and merge_s then (`start_round`).
        self.round_marks = (0.0, 0.0, 0.0, 0.0, 0.0)

    # -- a round's clocks -------------------------------------------------------------------

    def start_round(self, began: float, transport: Transport) -> None:
        """A round began at `began` (before its start state was serialised); its inner steps
        begin now."""
        self.round_marks = (began, time.perf_counter(), transport.wait_s, self.clock["report_s"],
                            self.clock["merge_s"])

    def round_compute(self, transport: Transport) -> float:
        """After the round's inner steps: their compute, which is their wall time less the
        waits for the exchange, the mid-round reports and merges; counted in compute_s."""
        _, start, wait_before, report_before, merge_before = self.round_marks
        reported = self.clock["report_s"] - report_before
        merged = self.clock["merge_s"] - merge_before
        compute = time.perf_counter() - start - (transport.wait_s - wait_before) - reported - merged
        self.clock["compute_s"] += compute
        return compute

    def end_round(self, compressor: Compressor, decode_s: float) -> None:
        """After the round's end: its wall time less the mid-round reports to rounds_wall_s;
        compress_s := this epoch's compression and decoding on top of the epochs' before."""
        began, _, _, report_before, _ = self.round_marks
        self.clock["rounds_wall_s"] += time.perf_counter() - began - (self.clock["report_s"] - report_before)
        self.clock["compress_s"] = self.compress_before + compressor.total_s + decode_s

    # -- tokens -----------------------------------------------------------------------------

    def round_tokens(self) -> int:
        """Tokens one replica trains in a round."""
        job = self.job
        return job.outer.inner_steps * job.data.batch_size * job.model.seq_len

    def full_tokens(self, step: int) -> int:
        """Tokens through outer step `step` had every replica trained every round."""
        return step * self.job.parallel.replicas * self.round_tokens()

    def tokens_through(self, step: int) -> int:
        """A new epoch's start: the tokens through `step` that any rank of the world counted
        (a joiner knows none), else `full_tokens` (a collective: every rank calls it)."""
        known = torch.tensor([self.tokens_at.get(step, -1)], dtype=torch.int64)
        dist.all_reduce(known, op=dist.ReduceOp.MAX)
        return int(known.item()) if known.item() >= 0 else self.full_tokens(step)

    def count_on(self, counters: dict[str, Any], transport: Transport) -> None:
        """A resumed rank counts on from the head's cumulative `counters` (those it has)."""
        transport.bytes_sent = int(counters.get("bytes_sent", transport.bytes_sent))
        transport.modelled_s = float(counters.get("modelled_comm_s", transport.modelled_s))
        self.tokens = int(counters.get("tokens", self.tokens))

    def count_round(self, step: int, present: int) -> None:
        """Outer step `step` reported: what its `present` replicas trained."""
        self.tokens += present * self.round_tokens()
        self.tokens_at[step] = self.tokens

    # -- progress ---------------------------------------------------------------------------

    def progress(self, topo: Topology, group: Any, transport: Transport, t: int, h: int,
                 loss: float | None) -> None:
        """The first member reports every inner step's loss. With S > 1 the loss lives on the
        last stage; it sends the losses of the last PROGRESS_EVERY steps to rank 0 in one
        broadcast over the pipeline `group` (the one sync progress costs), so rank 0 reports
        them in a batch."""
        H = self.job.outer.inner_steps
        if not topo.lead:
            return
        self.unreported.append(0.0 if loss is None else loss)
        if topo.S > 1 and not (h % PROGRESS_EVERY == PROGRESS_EVERY - 1 or h == H - 1):
            return
        values = torch.tensor(self.unreported, dtype=torch.float64)
        if topo.S > 1:
            dist.broadcast(values, src=topo.global_rank(0, topo.S - 1), group=group)
        self.unreported.clear()
        if topo.rank == 0:
            self._emit_progress(topo.n, transport, t, h, values.tolist())

    def _emit_progress(self, present: int, transport: Transport, t: int, h: int, values: list[float]) -> None:
        """Rank 0: one `Progress` per inner step in `values` (the last of them is step h of
        round t), with the tokens per second of the `present` replicas and the ETA."""
        job = self.job
        H, T, B, L = job.outer.inner_steps, job.outer.steps, job.data.batch_size, job.model.seq_len
        now = time.perf_counter()
        rate = len(values) * present * B * L / max(now - self.since, 1e-9)
        self.since = now
        began, first_round = self.paced
        done = (t - first_round) * H + h + 1  # inner steps this epoch has run
        eta = (now - began) / done * ((T - t) * H + H - h - 1)
        first = h + 1 - len(values)
        for k, value in enumerate(values):
            lr = warmup_lr(job.inner.lr, job.inner.warmup, (t - 1) * H + first + k)
            self.emit("progress", Progress(t, first + k + 1, value, T, H, lr=lr, tokens_per_s=rate,
                                           rank0_bytes_sent=float(transport.bytes_sent), eta_s=eta))

    # -- an outer step's metrics ------------------------------------------------------------

    def rank_stats(self, transport: Transport, compressor: Compressor, extra_memory_bytes: float,
                   param_bytes: float) -> dict[str, float]:
        """This rank's counters for the step's metrics (rank 0 combines every rank's)."""
        return {
            **self.clock,
            "bytes_sent": float(transport.bytes_sent),
            "modelled_comm_s": transport.modelled_s,
            "comm_wait_s": transport.wait_s,
            "peak_rss_mb": peak_rss_mb(),
            "extra_memory_bytes": extra_memory_bytes,
            "param_bytes": param_bytes,
            **{k: v for k, v in compressor.last_stats.items() if k != "compress_s"},
        }

    def step_artifacts(self, topo: Topology, epoch: int, t: int, gathered: list[Any]) -> StepArtifacts:
        """Rank 0: outer step `t` from every rank's (contribution, shard, eval, stats)."""
        S = topo.S
        contributions = [c for c, _, _, _ in gathered]
        stages = [gathered[s][1] for s in range(S)]
        (eval_value,) = [e for _, _, e, _ in gathered if e is not None]
        metrics = self.metrics(topo, t, contributions, eval_value, [st for _, _, _, st in gathered])
        return StepArtifacts(step=t, stages=stages, contributions=contributions, metrics=metrics,
                             replicas=() if topo.full else topo.members, epoch=epoch)

    def metrics(self, topo: Topology, t: int, contributions: list[Contribution], eval_value: float,
                rank_stats: list[dict[str, float]]) -> dict[str, float]:
        """Outer step `t`'s metrics: losses (over the present replicas), tokens, the learning
        rate, bytes and times."""
        n, S, H = topo.n, topo.S, self.job.outer.inner_steps
        metrics = {
            "eval_loss": eval_value,
            "train_loss": sum(contributions[p * S].loss for p in range(n)) / n,
            "tokens": float(self.tokens),
            "inner_steps": float(t * H),
            "wall_s": time.perf_counter() - self.started,
            "lr": self.lr,
            # Summed over the world's ranks, cumulative: bytes that crossed replicas.
            "bytes_sent": sum(st["bytes_sent"] for st in rank_stats),
            "payload_bytes": float(sum(len(c.data) for c in contributions)),
        }
        for key in ("compute_s", "rounds_wall_s", "compress_s", "modelled_comm_s",
                    "comm_wait_s", "peak_rss_mb"):
            metrics[key] = max(st[key] for st in rank_stats)  # the slowest rank
        for key in ("extra_memory_bytes", "param_bytes"):  # one replica's stages
            metrics[key] = sum(st[key] for st in rank_stats[:S])
        for key in RANK_COUNTERS:  # each rank's own, which a resumed rank continues from
            metrics.update({f"{key}.r{r}": st[key] for r, st in enumerate(rank_stats)})
        if self.taus:  # the partial rule: the tau each round merged at, mean so far
            metrics["tau_mean"] = sum(self.taus) / len(self.taus)
        for key in ("rel_error", "rank_mean", "bits_mean", "residual_norm"):
            if key in rank_stats[0]:
                metrics[key] = sum(st[key] for st in rank_stats) / len(rank_stats)
        return metrics
