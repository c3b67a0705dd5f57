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

Run it through `trainer.launch.train_local`, or from any launcher that starts R*S
processes sharing an `init_method` (the Celery workers do, under `trainer.supervisor`).

For replay verification every DiLoCo rank serialises its round-start state once per round
(`round_state`: local weights, which are theta_outer at that moment, the inner AdamW state
and the compressor state) and publishes it with its contribution; `inner_round` is the
one inner loop and `trainer.diloco.contribution` the one payload function that training
and `rerun_round` (replays, exact resumes) both run, so a replay from that state is
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
  keeps its last KEEP_STATES round-start states in memory; between rounds its live state
  is the next round's), else fresh (a joiner, a rank that never ran that round); rounds go
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

import contextlib
import functools
import gc
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from trainer.artifacts import (
    Blob,
    Contribution,
    GenesisArtifacts,
    Progress,
    Spill,
    StageShard,
    StepArtifacts,
    StoredTensors,
    tensors_to_bytes,
    to_bytes,
)
from trainer.compress import Compressor
from trainer.config import JobConfig
from trainer.control import RANK_COUNTERS, Membership, RankControl, ResumePoint
from trainer.data import derive_seed, load_corpus
from trainer.diloco import AppliedStep, DiLoCo, OuterOptimizer
from trainer.errors import Cancelled, TrainingError
from trainer.metrics import peak_rss_mb, release_free_memory
from trainer.model import build_stage
from trainer.pipeline import Pipeline, StageRank, build_inner_optimizer, warmup_lr
from trainer.rounds import inner_round, load_round_state, rerun_round, round_tensors
from trainer.supervisor import Emitter, error_line
from trainer.transport import Transport, all_gather_bytes_sent
from trainer.world import Topology, agree_device, check_members, init_world, world_failure

__all__ = [
    "Emit",
    "Round",
    "RoundLoop",
    "auto_tau",
    "run_rank",
]

Emit = Callable[[str, Any], None]


TAU_MARGIN = 1.25  # tau = auto: the exchange estimate is padded by this factor
TAU_AUTO_MAX_FRACTION = 0.25  # tau = auto overlaps at most this share of a round
PROGRESS_EVERY = 5  # S > 1: inner steps whose losses reach rank 0 in one broadcast
KEEP_STATES = 3  # elastic runs: round-start states a rank keeps, for a regroup to restore


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


class _Regroup(Exception):
    """Raised on every rank of a world at once (a growth boundary): regroup for `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RoundLoop:
    """One rank's run as named phases: `__init__` builds the stage (model, pipeline, inner
    optimizer, compressor, DiLoCo); `begin` starts from the seed (genesis) or a committed
    checkpoint; each `round` opens (`open_round`: the start state), runs its inner steps
    (`inner_steps`, through `RankHooks.inner_phase`), ends (`end_round`: exchange, outer
    step, tau) and `report`s every outer step it applied; `run` ties them together and
    flushes the last exchange. Only global rank 0 emits; every rank takes part in every
    collective, in the same order (a deadlock hazard otherwise).

    Elastic (`control.regroup` set): `run` catches a broken world (`world_failure`) or a
    growth boundary (`grow_boundary`), tears the world down (`_leave`), asks the launcher
    for the next epoch and continues in it (`_enter`); the module's docstring has the rules."""

    def __init__(self, topo: Topology, job: JobConfig, emit: Emit, control: RankControl,
                 device: torch.device) -> None:
        self.topo, self.job, self.emit, self.control, self.hooks = topo, job, emit, control, control.hooks
        self.allreduce = job.parallel.sync == "allreduce"
        self.partial = not self.allreduce and job.outer.rule == "partial"
        self.device, self.epoch = device, control.epoch
        self.corpus = load_corpus(job.data, job.model.vocab_size)
        self.eval_batches = self.corpus.eval_batches(job.data.eval_batches, job.data.batch_size,
                                                     job.model.seq_len, seed=job.seed)
        self.module = self._build_module(device)
        self._wire(topo)
        self.first_round = 1
        self.stop_flag = torch.zeros(1, dtype=torch.int32)
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
        # Elastic runs: round -> this rank's start state of it, the last KEEP_STATES rounds
        # opened (a regroup restores the inner optimizer and compressor from them), and the
        # last round opened and the last one whose end completed.
        self.kept: dict[int, bytes | Blob] = {}
        self.opened = self.completed = 0
        # Where this rank's large bytes go as they are made (None: held in memory); only
        # through a Supervisor's queue does a Blob reach the launcher as bytes.
        self.spill = Spill(control.spill_dir) if control.spill_dir and isinstance(emit, Emitter) else None
        self.counters = (0, 0.0, 0.0)  # the Transport's counters, carried into the next epoch

    def _build_module(self, device: torch.device) -> nn.Module:
        """This rank's stage, seeded (or the imported weights at genesis), on `device`."""
        job, topo = self.job, self.topo
        module = build_stage(job.model, topo.stage, topo.S, job.seed, job.parallel.numerics)
        if job.model.init is not None and self.control.start is None:  # genesis = the imported weights
            from trainer.hf import load_init_weights

            load_init_weights(module, job.model.init)
        return module.to(device)

    def _wire(self, topo: Topology) -> None:
        """What trains the module in the world of `topo`: its process groups, pipeline, a
        fresh inner optimizer and compressor (seeded by replica id), the Transport over the
        present replicas and DiLoCo (whose outer copy starts at the module's weights)."""
        job, module, device = self.job, self.module, self.device
        self.topo = topo
        self.pipe_group, dp_group = topo.create_groups("cpu:gloo,cuda:nccl" if device.type == "cuda" else None)
        pipeline = Pipeline(module, topo, self.pipe_group, job, device)
        inner = build_inner_optimizer(module, job)
        shapes = {n: p.shape for n, p in module.named_parameters()}
        seed = derive_seed("compress", job.seed, topo.replica, topo.stage)
        self.rank = StageRank(job, pipeline, inner, Compressor(job.outer.compression, shapes, seed), self.corpus)
        self.transport = Transport(dp_group, topo.n, topo.position, job.transport)
        self.tau_votes: list[tuple[Any, torch.Tensor]] = []  # tau = auto: agreements in flight
        self.diloco = DiLoCo(module, job.outer, self.transport, self.rank.compressor, self.hooks.publish(topo))

    def run(self) -> None:
        """Every round from the first this run computes to `outer.steps`, then the last
        exchange in flight; elastic: in as many membership epochs as it takes."""
        enter: Callable[[], None] = self.begin
        while True:
            try:
                enter()
                if enter == self.begin:
                    self.started = self.since = time.perf_counter()
                self._rounds()
                return
            except Exception as exc:  # a broken world regroups; anything else fails the rank
                reason = self._regroup_reason(exc)
                if reason is None:
                    raise
            # Out of the except block: the traceback's frames no longer hold the old world.
            enter = functools.partial(self._enter, self._regroup(reason))

    def _rounds(self) -> None:
        """This epoch's rounds, then the last exchange in flight."""
        T = self.job.outer.steps
        self.paced = (time.perf_counter(), self.first_round)
        for t in range(self.first_round, T + 1):
            self.round(t)
            if t < T:
                self.grow_boundary()
        self._settle_votes()
        applied = self.diloco.flush()
        if applied is not None:
            self.report(applied)

    def begin(self) -> None:
        """Start from `control.start` (resume: the committed outer state, re-running its
        round where that is exact; a joiner: the committed outer state, fresh inner state)
        or from the seed (rank 0 emits the genesis shards)."""
        start = self.control.start
        self._announce()
        step = 0 if start is None else start.step
        self.tokens = self._tokens_through(step) if self.epoch else self._full_tokens(step)
        self.opened = self.completed = step
        if start is None:
            shards = self._gather(StageShard(self.topo.stage, cast(bytes, self._held(self.diloco.outer.tensors())))
                                  if self.topo.lead else None)
            if self.topo.rank == 0:
                assert shards is not None
                self.emit("genesis", GenesisArtifacts(stages=[shards[s] for s in range(self.topo.S)]))
            return
        if start.state and self.job.outer.delay == 0 and not self.allreduce:
            self._catch_up(start)
        self.diloco.outer = OuterOptimizer.from_bytes(start.shard, self.job.outer)
        with torch.no_grad():
            self.diloco.reset_local()
        self.first_round = start.step + 1
        self._carry(start.counters)

    def _carry(self, counters: dict[str, float]) -> None:
        """A resumed rank counts on from the head's cumulative counters (`ResumePoint.counters`)."""
        t = self.transport
        t.bytes_sent = int(counters.get("bytes_sent", t.bytes_sent))
        t.modelled_s = float(counters.get("modelled_comm_s", t.modelled_s))
        self.tokens = int(counters.get("tokens", self.tokens))

    # -- elastic training: membership epochs ----------------------------------------------

    def grow_boundary(self) -> None:
        """Elastic runs, after each round's reports: rank 0 asks `control.grow_requested` and
        every rank learns the answer in one broadcast; yes: apply and report the exchange in
        flight (nothing is lost) and regroup (reason "grow") so that joiners come in."""
        if self.control.regroup is None:
            return
        flag = torch.zeros(1, dtype=torch.int32)
        if self.topo.rank == 0:
            grow = self.control.grow_requested
            flag[0] = int(bool(grow and grow()))
        dist.broadcast(flag, src=0)
        if flag[0]:
            self._settle_votes()
            applied = self.diloco.flush()
            if applied is not None:
                self.report(applied)
            raise _Regroup("grow")

    def _regroup_reason(self, exc: Exception) -> str | None:
        """Why this rank regroups after `exc` (one line), or None: it fails as without elastic
        training (no `control.regroup`, or not a broken world)."""
        if isinstance(exc, _Regroup):
            return exc.reason
        if self.control.regroup is None or not world_failure(exc):
            return None
        return error_line(exc)

    def _regroup(self, reason: str) -> Membership:
        """Leave the broken (or growing) world and get the next epoch from the launcher:
        TrainingError when it has fewer than min_replicas, or does not hold this rank."""
        assert self.control.regroup is not None
        failed = self.epoch
        self._keep_live_state()
        self._leave()
        m = self.control.regroup(failed, reason)
        members = check_members(tuple(m.members), self.job, m.epoch)
        position, stage = divmod(m.rank, self.topo.S)
        if m.epoch <= failed or stage != self.topo.stage or position >= len(members) \
                or members[position] != self.topo.replica:
            raise TrainingError(f"regroup: epoch {m.epoch} (after {failed}) puts rank {m.rank} at replica "
                                f"{members[position] if position < len(members) else None} stage {stage}, "
                                f"but this is replica {self.topo.replica} stage {self.topo.stage}")
        return m

    def _keep_live_state(self) -> None:
        """Between rounds (the last one opened has ended), this rank's live inner and
        compressor state is the start state of the next round: keep it, as if opened."""
        nxt = self.completed + 1
        rank = vars(self).get("rank")  # None: a regroup broke off before the world was wired
        if rank is not None and self.opened == self.completed and nxt not in self.kept and not self.allreduce:
            self.kept[nxt] = self._held(round_tensors(rank.module, rank.inner, rank.compressor, nxt,
                                                      (nxt - 1) * self.job.outer.inner_steps))

    def _leave(self) -> None:
        """Tear this rank's world down: drop the exchange in flight (its daemon thread may
        stay blocked on the dead world until the collective timeout; nobody waits for it),
        every reference to a process group (a live one keeps its sockets open, and peers
        blocked on this rank would wait for the timeout rather than fail at once), then the
        process groups themselves, tolerating errors: the world is broken. Whatever `_wire`
        built goes, all or part (a world may break while an epoch is being entered)."""
        held = vars(self)
        diloco, rank, transport = held.pop("diloco", None), held.pop("rank", None), held.pop("transport", None)
        held.pop("pipe_group", None)
        held.pop("tau_votes", None)  # agreements of the broken world: nobody waits for them
        if diloco is not None:
            diloco.drop_pending()
            self.compress_before += diloco.decode_s
        if rank is not None:
            self.compress_before += rank.compressor.total_s
        if transport is not None:
            self.counters = (transport.bytes_sent, transport.modelled_s, transport.wait_s)
        del diloco, rank, transport
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _enter(self, m: Membership) -> None:
        """Continue in epoch `m`: join its world, rebuild what trains the module there, load
        the committed outer state after `m.start_step` (local weights := outer, nothing in
        flight), restore the inner optimizer and compressor from this rank's kept start
        state of round start_step + 1 (else fresh), and go on from that round.

        Deadlock hazard: a joiner's `run_rank` + `begin` run the same collectives in the same
        order (init, agree_device, create_groups, the tokens' all-reduce)."""
        job, S = self.job, self.topo.S
        self.epoch = m.epoch
        init_world(m.init_method, m.rank, len(m.members) * S, self.control.timeout_s)
        device = agree_device(job, self.control.gpu)
        if device != self.device:
            self.module.to(device)
            self.device = device
        self._wire(Topology(m.rank, job.parallel.replicas, S, tuple(m.members)))
        self.transport.bytes_sent, self.transport.modelled_s, self.transport.wait_s = self.counters
        nxt = m.start_step + 1
        state = self.kept.get(nxt)
        if state is not None:
            rank = self.rank
            try:
                load_round_state(to_bytes(state), rank.module, rank.inner, rank.compressor)
            except ValueError as exc:
                raise TrainingError(f"regroup: this rank's kept start state of round {nxt}: {exc}") from None
        self.kept = {t: v for t, v in self.kept.items() if t <= nxt}
        self.diloco.outer = OuterOptimizer.from_bytes(m.shard, job.outer)
        with torch.no_grad():
            self.diloco.reset_local()
        self.first_round = nxt
        self.opened = self.completed = m.start_step
        self.unreported.clear()
        self._announce()
        self.tokens = self._tokens_through(m.start_step)

    def _announce(self) -> None:
        if self.control.emit_contributions:  # every rank: the epoch it trains in, and where
            self.emit("epoch", {"epoch": self.epoch, "rank": self.topo.rank, "members": self.topo.members})

    def _round_tokens(self) -> int:
        """Tokens one replica trains in a round."""
        job = self.job
        return job.outer.inner_steps * job.data.batch_size * job.model.seq_len

    def _full_tokens(self, step: int) -> int:
        """Tokens through outer step `step` had every replica trained every round."""
        return step * self.job.parallel.replicas * self._round_tokens()

    def _tokens_through(self, step: int) -> int:
        """A new epoch's start: the tokens through `step` that any rank of the world counted
        (a joiner knows none), else `_full_tokens` (a collective: every rank calls it)."""
        known = torch.tensor([self.tokens_at.get(step, -1)], dtype=torch.int64)
        dist.all_reduce(known, op=dist.ReduceOp.MAX)
        return int(known.item()) if known.item() >= 0 else self._full_tokens(step)

    def _catch_up(self, start: ResumePoint) -> None:
        """Re-run round `start.step` from its published start state (as `trainer.replay`
        does) so the inner optimizer and compressor hold what that round left; `begin` then
        loads the committed outer state. The round's pseudo-gradient is compressed only for
        the state compression keeps (error feedback, warm starts, the adaptive rule's
        history), with the byte budget the published payload recorded."""
        from trainer.compress import payload_budget

        rank = self.rank
        try:
            round_t, first_step = load_round_state(start.state, rank.module, rank.inner, rank.compressor)
        except ValueError as exc:
            raise TrainingError(f"resume: this rank's start state of round {start.step}: {exc}") from None
        if round_t != start.step:
            raise TrainingError(f"resume: the start state is for round {round_t}, not {start.step}")
        rerun_round(rank, self.topo.replica, round_t, first_step,
                    payload_budget(start.claimed) if start.claimed else None)

    def round(self, t: int) -> None:
        """Round `t`: start state, inner steps, round end, and the report of any outer
        step it applied."""
        H = self.job.outer.inner_steps
        began = time.perf_counter()
        rnd = self.open_round(t)
        round_start = time.perf_counter()
        wait_before, report_before = self.transport.wait_s, self.clock["report_s"]
        merge_before = self.clock["merge_s"]
        rnd.data = self.rank.corpus.shard(self.job.seed, self.topo.replica, t, H, self.job.data.batch_size,
                                          self.job.model.seq_len)
        round_loss = self.hooks.inner_phase(self, rnd)
        self.lr = warmup_lr(self.job.inner.lr, self.job.inner.warmup, rnd.first_step + H - 1)
        reported = self.clock["report_s"] - report_before
        merged = self.clock["merge_s"] - merge_before
        compute = (time.perf_counter() - round_start - (self.transport.wait_s - wait_before) - reported
                   - merged)
        self.clock["compute_s"] += compute
        release_free_memory()  # the inner steps' activations and gradients
        applied = self.end_round(rnd, round_loss, compute)
        release_free_memory()  # compression's working memory
        self.completed = t
        self.clock["rounds_wall_s"] += time.perf_counter() - began - (self.clock["report_s"] - report_before)
        self.clock["compress_s"] = self.compress_before + self.rank.compressor.total_s + self.diloco.decode_s
        if applied is not None:
            self.report(applied)

    def open_round(self, t: int) -> Round:
        """Round `t`'s bookkeeping and its start state, serialised once before any inner
        step (what a replay starts from; the AllReduce baseline publishes none)."""
        first_step = (t - 1) * self.job.outer.inner_steps  # warmup is not repeated on resume
        merge_at = self.diloco.merge_step if self.diloco.pending else None
        rank = self.rank
        start_state = b"" if self.allreduce else self._held(round_tensors(
            rank.module, rank.inner, rank.compressor, t, first_step,
            merge_step=(-1 if merge_at is None else merge_at) if self.partial else None))
        self.opened = t
        if self.control.regroup is not None and start_state:  # what a regroup restores
            self.kept[t] = start_state
            self.kept = {k: v for k, v in self.kept.items() if k > t - KEEP_STATES}
        anchor = None if merge_at is None else StoredTensors(start_state, "param/")
        return Round(t, first_step, merge_at, start_state, data=None, anchor=anchor)

    def _held(self, tensors: dict[str, torch.Tensor]) -> bytes | Blob:
        """`tensors_to_bytes(tensors)`, or where this rank spills the same bytes in a file."""
        return tensors_to_bytes(tensors) if self.spill is None else self.spill.tensors(tensors)

    def inner_steps(self, rnd: Round) -> float:
        """The round's honest inner steps (with stops, the partial rule's merge and
        progress reports between them); returns the round's loss."""
        hooked = self.control.cancellable or rnd.merge_at is not None
        loss = inner_round(
            self.rank, self.topo.replica, rnd.t, rnd.data.tokens, rnd.first_step,
            before_step=functools.partial(self._before_step, rnd) if hooked else None,
            sync_grads=self.transport.all_reduce_mean_ if self.allreduce else None,
            after_step=functools.partial(self._progress, rnd),
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
        self.clock["merge_s"] += published - began - (self.transport.wait_s - wait_before)
        self.report(applied)
        self.clock["report_s"] += time.perf_counter() - published

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
            self.taus.append(self.diloco.merge_step)
        return applied

    def _next_tau(self, compute: float, payload_len: int) -> int:
        """The tau of the next round. Under `auto` every rank takes the largest estimate,
        agreed one round late so that no rank waits for another at a round's end: this
        round's estimates go into an all-reduce (max) that completes in the background, and
        round t + 1 merges at the agreement on round t - 1's. The first round of an epoch has
        none earlier: it waits for its own (round 2 and round 3 merge at round 1's)."""
        H = self.job.outer.inner_steps
        if self.job.outer.tau != "auto":
            return int(self.job.outer.tau)
        vote = torch.tensor([auto_tau(self.transport, payload_len, self.diloco.exchange_s, compute / H, H,
                                      self.job.outer.fragments)],
                            dtype=torch.int64)
        self.tau_votes.append((dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True), vote))
        work, agreed = self.tau_votes.pop(0) if len(self.tau_votes) > 1 else self.tau_votes[0]
        work.wait()
        return int(agreed.item())

    def _settle_votes(self) -> None:
        """Wait for the tau agreements still in flight (a world that ends or regroups whole)."""
        while self.tau_votes:
            self.tau_votes.pop(0)[0].wait()

    def _gather(self, payload: Any) -> list[Any] | None:
        out = [None] * (self.topo.n * self.topo.S) if self.topo.rank == 0 else None
        dist.gather_object(payload, out, dst=0)
        return out

    def _progress(self, rnd: Round, h: int, loss: float | None) -> None:
        """The first member reports every inner step's loss. With S > 1 the loss lives on the
        last stage; it sends the losses of the last PROGRESS_EVERY steps to rank 0 in one
        broadcast (the one sync progress costs), so rank 0 reports them in a batch."""
        topo, H = self.topo, self.job.outer.inner_steps
        if not topo.lead:
            return
        self.unreported.append(0.0 if loss is None else loss)
        if topo.S > 1 and not (h % PROGRESS_EVERY == PROGRESS_EVERY - 1 or h == H - 1):
            return
        values = torch.tensor(self.unreported, dtype=torch.float64)
        if topo.S > 1:
            dist.broadcast(values, src=topo.global_rank(0, topo.S - 1), group=self.pipe_group)
        self.unreported.clear()
        if topo.rank == 0:
            self._emit_progress(rnd, h, values.tolist())

    def _emit_progress(self, rnd: Round, h: int, values: list[float]) -> None:
        """Rank 0: one `Progress` per inner step in `values` (the last of them is step h)."""
        job, t = self.job, rnd.t
        H, T, B, L = job.outer.inner_steps, job.outer.steps, job.data.batch_size, job.model.seq_len
        now = time.perf_counter()
        rate = len(values) * self.topo.n * B * L / max(now - self.since, 1e-9)
        self.since = now
        began, first_round = self.paced
        done = (t - first_round) * H + h + 1  # inner steps this epoch has run
        eta = (now - began) / done * ((T - t) * H + H - h - 1)
        first = h + 1 - len(values)
        for k, value in enumerate(values):
            lr = warmup_lr(job.inner.lr, job.inner.warmup, (t - 1) * H + first + k)
            self.emit("progress", Progress(t, first + k + 1, value, T, H, lr=lr, tokens_per_s=rate,
                                           rank0_bytes_sent=float(self.transport.bytes_sent), eta_s=eta))

    def shard_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's new stage shard's tensors: the outer state (views), or the baseline's
        weights with zero momentum (it has no outer optimizer)."""
        if self.allreduce:
            named = dict(self.rank.module.named_parameters())
            tensors = {f"param/{n}": p.detach().float().cpu() for n, p in named.items()}
            tensors.update({f"momentum/{n}": torch.zeros_like(p) for n, p in named.items()})
            return tensors
        return self.diloco.outer.tensors()

    def report(self, applied: AppliedStep) -> None:
        """Publish outer step `applied.round` (every rank takes part: gathers and eval)."""
        topo = self.topo
        # Every replica serialises its own new outer shard: the replicas of a stage are
        # independent witnesses of the aggregate, and each co-signs the digest of its own.
        # Its bytes are made only where they are needed (the digest; the first member's
        # StageShard, which a spilling rank writes straight to its file) and freed at once.
        release_free_memory()  # the outer step's decoded tensors, before the shard's bytes
        tensors = self.shard_tensors()
        signs = self.control.shard_digest is not None
        own = tensors_to_bytes(tensors) if signs or (topo.lead and self.spill is None) else None
        contribution = self._contribution(applied, own)
        shard = None
        if topo.lead:
            data = own if self.spill is None else self.spill.tensors(tensors) if own is None else self.spill.bytes(own)
            shard = StageShard(topo.stage, cast(bytes, data))
        del own, tensors
        if self.control.emit_contributions:  # so this rank's node can check what it attests
            self.emit("contribution", (applied.round, contribution))
        eval_loss = None
        if topo.lead:  # the committed weights, whatever the local ones are now
            with contextlib.nullcontext() if self.allreduce else self.diloco.outer_weights():
                eval_loss = self.rank.pipeline.eval_loss(self.eval_batches)
        self.tokens += topo.n * self._round_tokens()  # what the present replicas trained
        self.tokens_at[applied.round] = self.tokens
        gathered = self._gather((contribution, shard, eval_loss, self._rank_stats()))
        if topo.rank == 0:
            assert gathered is not None
            if self.control.step_slots is not None:  # the sink's backlog is full: wait for it
                self.control.step_slots.acquire()
            self.emit("step", self._step_artifacts(applied.round, gathered))
        del gathered, contribution, shard
        release_free_memory()

    def _contribution(self, applied: AppliedStep, own_shard: bytes | None) -> Contribution:
        """This rank's contribution to `applied`; its start state may be a spilled `Blob`,
        which reaches the launcher as the bytes (`trainer.artifacts.Blob`)."""
        digest, round_loss, start_state = applied.tag
        sign = self.control.shard_digest
        new_shard = b""
        if sign is not None:
            assert own_shard is not None
            new_shard = self.hooks.cosigned_shard(self.topo, applied.round, own_shard, sign)
        return Contribution(
            replica=self.topo.replica,
            stage=self.topo.stage,
            data=applied.payload,
            data_shard=digest,
            loss=round_loss,
            start_state=cast(bytes, start_state),
            new_shard=new_shard,
        )

    def _rank_stats(self) -> dict[str, float]:
        """This rank's counters for the step's metrics (rank 0 combines every rank's)."""
        compressor = self.rank.compressor
        return {
            **self.clock,
            "bytes_sent": float(self.transport.bytes_sent),
            "modelled_comm_s": self.transport.modelled_s,
            "comm_wait_s": self.transport.wait_s,
            "peak_rss_mb": peak_rss_mb(),
            "extra_memory_bytes": float(0 if self.allreduce else self.diloco.extra_memory_bytes()),
            "param_bytes": float(4 * sum(p.numel() for p in self.rank.params)),
            **{k: v for k, v in compressor.last_stats.items() if k != "compress_s"},
        }

    def _step_artifacts(self, t: int, gathered: list[Any]) -> StepArtifacts:
        """Rank 0: outer step `t` from every rank's (contribution, shard, eval, stats)."""
        S = self.topo.S
        contributions = [c for c, _, _, _ in gathered]
        stages = [gathered[s][1] for s in range(S)]
        (eval_value,) = [e for _, _, e, _ in gathered if e is not None]
        metrics = self._metrics(t, contributions, eval_value, [st for _, _, _, st in gathered])
        return StepArtifacts(step=t, stages=stages, contributions=contributions, metrics=metrics,
                             replicas=() if self.topo.full else self.topo.members, epoch=self.epoch)

    def _metrics(self, t: int, contributions: list[Contribution], eval_value: float,
                 rank_stats: list[dict[str, float]]) -> dict[str, float]:
        """Outer step `t`'s metrics: losses (over the present replicas), tokens, the learning
        rate, bytes and times."""
        n, S, H = self.topo.n, self.topo.S, self.job.outer.inner_steps
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
