"""The rank function: one process = one pipeline stage of one DiLoCo replica.

World = R replicas x S stages, rank = r*S + s (an elastic run's world holds the replicas
present, placed by position: below). Each replica's S ranks run a
torch.distributed.pipelining schedule (1F1B or GPipe) over M microbatches; stage s of
every replica forms the data-parallel group that exchanges stage s's (compressed)
pseudo-gradients at each outer step through a `Transport`, synchronously or overlapped
with computation (`outer.delay`, `outer.overlap`: trainer/diloco.py).
`parallel.sync = "allreduce"` runs the AllReduce-DDP baseline instead: the same model,
pipeline, data order and inner optimizer, with gradients all-reduced through the same
Transport every inner step. Only global rank 0 reports, through `emit(kind, payload)`:
("genesis", GenesisArtifacts), then per outer step one ("progress", Progress) per inner
step and one ("step", StepArtifacts); with `RankControl.emit_contributions` every rank
also emits its own ("contribution", (step, Contribution)) and, at each membership
epoch's start, ("epoch", {"epoch", "rank", "members"}).

A rank's run is a `RoundLoop` whose methods are its phases (begin, open_round,
inner_steps, end_round, report). Test-only misbehaviour is injected through
`RankControl.hooks` (`trainer.hooks.RankHooks`, honest by default; tests/dlx_testing/cheat.py).
Its rooms: trainer/world.py (topology, process groups, device agreement, failure
detection), trainer/pipeline.py (the stage, its schedule, losses, clipping),
trainer/rounds.py (the inner loop, the round-start state and rerunning a round),
trainer/elastic.py (the membership: what is bound to one world, built and dropped as a
unit, leaving it, entering the next and what a rank carries across membership epochs), trainer/metrics.py (clocks, tokens, progress,
step metrics, memory) and trainer/publish.py (genesis and step reports).

Run it through `trainer.launch.train_local`, or from any launcher that starts R*S
processes sharing an `init_method` (the Celery workers do, under `trainer.supervisor`).

For replay verification every DiLoCo rank serialises its round-start state once per round
(`trainer.rounds.round_state`: local weights, which are theta_outer at that moment, the
inner AdamW state and the compressor state) and publishes it with its contribution;
`trainer.rounds.inner_round` is the one inner loop and `trainer.diloco.contribution` the
one payload function that training and `trainer.rounds.rerun_round` (replays, exact
resumes) both run, so a replay from that state is
bit-identical on the same machine.

Elastic training (`[parallel] min_replicas`, a launcher's `RankControl.regroup`). A run
has R replica slots; a membership epoch is a world of the replicas present, `members`
(ids, ascending, at least min_replicas), x S stages, global rank = position * S + stage
(`Topology`). A replica's id, never its position, fixes its data shards, its seeds
(dropout, compressor), its `Contribution.replica` and its ledger slot; the position only
places it in the world (process groups, the Transport, progress and eval on the first
member). An outer step averages the present replicas' contributions in replica order
(`StepArtifacts.replicas`); with all R present every byte is as without elastic training.
- A loss: when a collective raises or times out because a peer died (`world_failure`:
  gloo's closed connection or timeout, a torch.distributed error), the rank drops the
  exchange in flight (its daemon thread may stay blocked on the dead world; nothing waits
  for it), releases and destroys its process groups and calls `control.regroup(epoch,
  reason)`, which blocks until the next epoch's `Membership` or raises (fewer than
  min_replicas remain, the job ended, Cancelled). Any other error (a bug, a divergence,
  a bad input, Cancelled) fails the rank as before; so does every error without `regroup`.
- Growth: with `regroup` set, after each round's reports rank 0 asks
  `control.grow_requested` and every rank learns the answer in one broadcast; on yes they
  apply and report the exchange in flight and regroup with reason "grow", a boundary
  where nothing is lost. A joiner's launcher starts it with the new epoch's
  `control.members` and `epoch` and `control.start` = the committed shard.
- Continuing in epoch m: join m's world, rebuild the process groups, pipeline, Transport
  and DiLoCo over the present replicas; outer state := m.shard (the committed shard after
  m.start_step), local weights := the outer ones, nothing in flight; inner optimizer and
  compressor restored from this rank's own start state of round start_step + 1 (a rank
  keeps its last `trainer.elastic.KEEP_STATES` round-start states in memory; between
  rounds its live state is the next round's), else fresh (a joiner, a rank that never ran that round); rounds go
  on from start_step + 1. That round's published start state therefore holds the
  committed shard's weights (under the partial rule merge_step -1), as any run's first
  round does, and a joiner's the fresh state core (`trainer.replay.fresh_state_core`).
- What a loss costs: the round in flight, never a committed step; under delay 1 also the
  exchange of the previous round that overlapped it when its step was not yet committed
  (restart and eager apply step t at the end of round t + 1, partial before inner step
  tau of round t + 1), whose round is then computed again. A departed replica's
  error-feedback state leaves with it.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.artifacts import Blob, StoredTensors, tensors_to_bytes
from trainer.config import JobConfig
from trainer.control import Membership, RankControl
from trainer.data import load_corpus
from trainer.diloco import AppliedStep, DiLoCo, OuterOptimizer
from trainer.elastic import Elastic, Regroup, Wired
from trainer.errors import Cancelled
from trainer.metrics import Emit, Meter, release_free_memory
from trainer.model import build_stage
from trainer.pipeline import StageRank, warmup_lr
from trainer.publish import Publisher
from trainer.rounds import catch_up, inner_round, round_tensors
from trainer.transport import Transport, all_gather_bytes_sent
from trainer.world import Topology, agree_device, check_members, init_world

__all__ = [
    "Emit",
    "Round",
    "RoundLoop",
    "auto_tau",
    "run_rank",
]

TAU_MARGIN = 1.25  # tau = auto: the exchange estimate is padded by this factor
TAU_AUTO_MAX_FRACTION = 0.25  # tau = auto overlaps at most this share of a round


def run_rank(
    rank: int,
    world_size: int,
    init_method: str,
    job: JobConfig,
    emit: Emit,
    control: RankControl | None = None,
) -> None:
    """Train `job` as global rank `rank` of the world of `control.members` (all R replicas
    by default) x S stages; `emit` is called on rank 0 only (and on every rank for its own
    contributions and epochs when `control.emit_contributions`). Raises `Cancelled` on
    every rank when rank 0's `control.stop_requested()` says so."""
    control = control or RankControl()
    R, S = job.parallel.replicas, job.parallel.stages
    members = check_members(tuple(range(R)) if control.members is None else tuple(control.members), job,
                            control.epoch)
    if world_size != len(members) * S:
        raise ValueError(f"world_size ({world_size}) != replicas present x stages ({len(members)} x {S})")
    torch.set_num_threads(1)
    # cuBLAS needs a fixed workspace to be deterministic; it reads this before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    topo = Topology(rank, R, S, members)
    init_world(init_method, rank, world_size, control.timeout_s)
    try:
        RoundLoop(topo, job, emit, control, agree_device(job, control.gpu)).run()
    finally:
        if dist.is_initialized():  # a failed regroup leaves none
            dist.destroy_process_group()


def auto_tau(transport: Transport, payload_len: int, measured_s: float, step_s: float, H: int,
             fragments: int = 1) -> int:
    """tau = auto: enough inner steps to hide the exchange just started, from the link model
    of its ring all-gather and the latest measured exchange (padded by `TAU_MARGIN`), but
    at most a quarter of the period between two syncs of the same weights
    (`TAU_AUTO_MAX_FRACTION`: longer overlaps cost quality, docs/benchmarks.md, "DiLoCoX benchmark"; past
    that the round waits): a quarter of the round, or with F fragments (each synced every
    F rounds) a quarter of F rounds, at most the whole next round."""
    R = transport.R
    modelled = transport.link.seconds(all_gather_bytes_sent([payload_len] * R, 0), R - 1)
    estimate = max(modelled, measured_s) * TAU_MARGIN
    cap = max(1, min(H, int(fragments * H * TAU_AUTO_MAX_FRACTION)))
    return min(cap, max(1, math.ceil(estimate / max(step_s, 1e-9))))


@dataclass
class Round:
    """One round's bookkeeping: its number `t`, its first inner step of the run, the inner
    step before which it merges the previous round's exchange (the partial rule; None when
    nothing is in flight), its serialised start state (what a replay starts from: bytes,
    or a `Blob` where the rank spills), its data shard and, when it merges, its start
    weights (the merge's anchor: the ``param/`` tensors of the start state, read back from
    it one at a time rather than held as a copy)."""

    t: int
    first_step: int
    merge_at: int | None
    start_state: bytes | Blob
    data: Any
    anchor: StoredTensors | None = None


def _stage_module(job: JobConfig, topo: Topology, control: RankControl, device: torch.device) -> nn.Module:
    """This rank's stage, seeded (or the imported weights at genesis), on `device`."""
    module = build_stage(job.model, topo.stage, topo.S, job.seed, job.parallel.numerics)
    if job.model.init is not None and control.start is None:  # genesis = the imported weights
        from trainer.hf import load_init_weights

        load_init_weights(module, job.model.init)
    return module.to(device)


class RoundLoop:
    """One rank's run as named phases: `__init__` builds the stage (model, pipeline, inner
    optimizer, compressor, DiLoCo); `begin` starts from the seed (genesis) or a committed
    checkpoint; each `round` opens (`open_round`: the start state), runs its inner steps
    (`inner_steps`, through `RankHooks.inner_phase`), ends (`end_round`: exchange, outer
    step, tau) and `report`s every outer step it applied; `run` ties them together and
    flushes the last exchange. Only global rank 0 emits; every rank takes part in every
    collective, in the same order (a deadlock hazard otherwise). Its clocks, tokens and
    progress are a `trainer.metrics.Meter`'s.

    The world it trains in is its `trainer.elastic.Elastic`'s (the membership). Elastic
    (`control.regroup` set): `run` catches a broken world (`world_failure`) or a growth
    boundary (after a round: `Elastic.grow`), regroups (`_regroup`: `Elastic.leave`, then
    the launcher's next epoch) and continues in it (`_enter`); the module's docstring has
    the rules."""

    def __init__(self, topo: Topology, job: JobConfig, emit: Emit, control: RankControl,
                 device: torch.device) -> None:
        self.job, self.emit, self.control, self.hooks = job, emit, control, control.hooks
        self.allreduce = job.parallel.sync == "allreduce"
        self.partial = not self.allreduce and job.outer.rule == "partial"
        corpus = load_corpus(job.data, job.model.vocab_size)
        self.eval_batches = corpus.eval_batches(job.data.eval_batches, job.data.batch_size, job.model.seq_len,
                                                seed=job.seed)
        self.elastic = Elastic(topo, job, control, _stage_module(job, topo, control, device), device, corpus)
        self.first_round = 1
        self.stop_flag = torch.zeros(1, dtype=torch.int32)
        self.meter = Meter(job, emit)
        self.opened = self.completed = 0  # the last round opened, the last one whose end completed
        self.publisher = Publisher(job, control, emit, self.meter, self.eval_batches)

    @property
    def topo(self) -> Topology:
        return self.elastic.topo

    @property
    def world(self) -> Wired:
        return self.elastic.world

    @property
    def rank(self) -> StageRank:
        return self.world.rank

    @property
    def transport(self) -> Transport:
        return self.world.transport

    @property
    def diloco(self) -> DiLoCo:
        return self.world.diloco

    def run(self) -> None:
        """Every round from the first this run computes to `outer.steps`, then the last
        exchange in flight; elastic: in as many membership epochs as it takes."""
        enter: Callable[[], None] = self.begin
        while True:
            try:
                enter()
                if enter == self.begin:
                    self.meter.started = self.meter.since = time.perf_counter()
                self._rounds()
                return
            except Exception as exc:  # a broken world regroups; anything else fails the rank
                reason = self.elastic.reason(exc)
                if reason is None:
                    raise
            # Out of the except block: the traceback's frames no longer hold the old world.
            enter = functools.partial(self._enter, self._regroup(reason))

    def _rounds(self) -> None:
        """This epoch's rounds, then the last exchange in flight."""
        T = self.job.outer.steps
        self.meter.paced = (time.perf_counter(), self.first_round)
        for t in range(self.first_round, T + 1):
            self.round(t)
            if t < T and self.elastic.grow():  # a growth boundary: nothing is lost, joiners come in
                self._flush()
                raise Regroup("grow")
        self._flush()

    def _flush(self) -> None:
        """Apply and report the exchange in flight, if any."""
        self.world.settle_votes()
        applied = self.diloco.flush()
        if applied is not None:
            self.report(applied)

    def begin(self) -> None:
        """Start from `control.start` (resume: the committed outer state, re-running its
        round where that is exact; a joiner: the committed outer state, fresh inner state)
        or from the seed (rank 0 emits the genesis shards)."""
        start, meter = self.control.start, self.meter
        self.elastic.announce(self.emit)
        step = 0 if start is None else start.step
        meter.tokens = meter.tokens_through(step) if self.elastic.epoch else meter.full_tokens(step)
        self.opened = self.completed = step
        if start is None:
            self.publisher.genesis(self.topo, self.world)
            return
        if start.state and self.job.outer.delay == 0 and not self.allreduce:
            catch_up(self.rank, self.topo.replica, start)
        self._start_at(start.step, start.shard)
        meter.count_on(start.counters, self.transport)

    def _start_at(self, step: int, shard: bytes) -> None:
        """Continue after committed outer step `step`: outer state := its `shard`, local
        weights := the outer ones, rounds from step + 1."""
        self.diloco.outer = OuterOptimizer.from_bytes(shard, self.job.outer)
        with torch.no_grad():
            self.diloco.reset_local()
        self.first_round = step + 1

    # -- elastic training: membership epochs ----------------------------------------------

    def _regroup(self, reason: str) -> Membership:
        """Leave the broken (or growing) world, between rounds keeping the live state as the
        next round's start state, and get the next epoch (`Elastic.next_epoch`)."""
        if self.opened == self.completed and not self.allreduce:
            self.elastic.keep_live(self.completed + 1, self.publisher.held)
        self._leave()
        return self.elastic.next_epoch(reason)

    def _leave(self) -> None:
        """Tear this rank's world down (`Elastic.leave`)."""
        self.elastic.leave(self.meter)

    def _enter(self, m: Membership) -> None:
        """Continue in epoch `m` (`Elastic.enter`) after its committed outer step
        `m.start_step`: local weights := the outer ones, nothing in flight."""
        self.elastic.enter(m)
        self._start_at(m.start_step, m.shard)
        self.opened = self.completed = m.start_step
        self.meter.unreported.clear()
        self.elastic.announce(self.emit)
        self.meter.tokens = self.meter.tokens_through(m.start_step)

    # -- a round ----------------------------------------------------------------------------

    def round(self, t: int) -> None:
        """Round `t`: start state, inner steps, round end, and the report of any outer
        step it applied."""
        H, meter = self.job.outer.inner_steps, self.meter
        began = time.perf_counter()
        rnd = self.open_round(t)
        meter.start_round(began, self.transport)
        rnd.data = self.rank.corpus.shard(self.job.seed, self.topo.replica, t, H, self.job.data.batch_size,
                                          self.job.model.seq_len)
        round_loss = self.hooks.inner_phase(self, rnd)
        meter.lr = warmup_lr(self.job.inner.lr, self.job.inner.warmup, rnd.first_step + H - 1)
        compute = meter.round_compute(self.transport)
        release_free_memory()  # the inner steps' activations and gradients
        applied = self.end_round(rnd, round_loss, compute)
        release_free_memory()  # compression's working memory
        self.completed = t
        meter.end_round(self.rank.compressor, self.diloco.decode_s)
        if applied is not None:
            self.report(applied)

    def open_round(self, t: int) -> Round:
        """Round `t`'s bookkeeping and its start state, serialised once before any inner
        step (what a replay starts from; the AllReduce baseline publishes none)."""
        first_step = (t - 1) * self.job.outer.inner_steps  # warmup is not repeated on resume
        merge_at = self.diloco.merge_step if self.diloco.pending else None
        rank = self.rank
        start_state = b"" if self.allreduce else self.publisher.held(round_tensors(
            rank.module, rank.inner, rank.compressor, t, first_step,
            merge_step=(-1 if merge_at is None else merge_at) if self.partial else None))
        self.opened = t
        self.elastic.keep(t, start_state)
        anchor = None if merge_at is None else StoredTensors(start_state, "param/")
        return Round(t, first_step, merge_at, start_state, data=None, anchor=anchor)

    def inner_steps(self, rnd: Round) -> float:
        """The round's honest inner steps (with stops, the partial rule's merge and
        progress reports between them); returns the round's loss."""
        hooked = self.control.cancellable or rnd.merge_at is not None
        loss = inner_round(
            self.rank, self.topo.replica, rnd.t, rnd.data.tokens, rnd.first_step,
            before_step=functools.partial(self._before_step, rnd) if hooked else None,
            sync_grads=self.transport.all_reduce_mean_ if self.allreduce else None,
            after_step=functools.partial(self.meter.progress, self.topo, self.world.pipe_group, self.transport,
                                         rnd.t),
        )
        if rnd.merge_at == self.job.outer.inner_steps:
            self.merge(rnd)
        return loss

    def _before_step(self, rnd: Round, h: int) -> None:
        if self.control.cancellable:
            self.check_stop(rnd, h)
        if h == rnd.merge_at:
            self.merge(rnd)

    def check_stop(self, rnd: Round, h: int) -> None:
        """Raise `Cancelled` on every rank at once when rank 0 was asked to stop: rank 0
        decides, every rank learns it in the same collective (an inner-step boundary)."""
        if self.topo.rank == 0:
            stop = self.control.stop_requested
            self.stop_flag[0] = int(bool(stop and stop()))
        dist.broadcast(self.stop_flag, src=0)
        if self.stop_flag[0]:
            raise Cancelled(f"stopped at outer step {rnd.t}, inner step {h + 1}")

    def merge(self, rnd: Round) -> None:
        """partial: apply the previous round's exchange mid-round, then publish its step.
        The wait for the exchange stays in the round's wall time (`transport.wait_s`), the
        outer step and merge go to `merge_s`, the publishing to `report_s`; the round's
        compute counts none of them."""
        began = time.perf_counter()
        release_free_memory()  # the inner steps' activations, before the outer step's buffers
        wait_before = self.transport.wait_s
        assert rnd.anchor is not None, "merge: the round has no anchor"
        applied = self.diloco.merge(rnd.anchor)
        rnd.anchor = None
        published = time.perf_counter()
        self.meter.clock["merge_s"] += published - began - (self.transport.wait_s - wait_before)
        self.report(applied)
        self.meter.clock["report_s"] += time.perf_counter() - published

    def end_round(self, rnd: Round, round_loss: float, compute: float) -> AppliedStep | None:
        """The exchange and outer step (`DiLoCo.end_round`), or the baseline's empty step;
        under the partial rule also the next round's tau. The outer step applied, if any."""
        tag = (rnd.data.digest, round_loss, rnd.start_state)
        if self.allreduce:
            return AppliedStep(rnd.t, tensors_to_bytes({}), tag)
        # The exchange must fit the overlap window: the link moves this many bytes in
        # the round's compute time, and ring all-gather sends payloads per rank.
        budget = self.transport.link.bandwidth * compute / max(1, self.topo.n - 1)
        applied = self.diloco.end_round(rnd.t, tag, round_loss, budget)
        if self.partial and rnd.t < self.job.outer.steps:
            self.diloco.merge_step = self._next_tau(compute, len(self.diloco.pending_payload))
            self.meter.taus.append(self.diloco.merge_step)
        return applied

    def _next_tau(self, compute: float, payload_len: int) -> int:
        """The tau of the next round. Under `auto` every rank takes the largest estimate,
        agreed one round late (`Wired.agree_tau`): round t + 1 merges at the agreement on
        round t - 1's, and round 2 and round 3 of an epoch at round 1's."""
        H = self.job.outer.inner_steps
        if self.job.outer.tau != "auto":
            return int(self.job.outer.tau)
        return self.world.agree_tau(auto_tau(self.transport, payload_len, self.diloco.exchange_s, compute / H, H,
                                             self.job.outer.fragments))

    def report(self, applied: AppliedStep) -> None:
        """Publish outer step `applied.round` (every rank takes part: gathers and eval)."""
        self.publisher.step(self.topo, self.world, self.elastic.epoch, applied)
