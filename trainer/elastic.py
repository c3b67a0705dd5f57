"""Elastic membership: what ties a rank to one membership epoch's world and how it goes
from one world into the next. The rules (who regroups when, what a loss costs) are in
trainer/engine.py's docstring.

`Wired` is everything bound to one world (the pipeline's process group, the stage's
pipeline, inner optimizer and compressor, the Transport, DiLoCo and the tau agreements in
flight): built as a unit when a rank enters a world (`Wired.build`) and dropped as a unit
when it leaves (`Elastic.leave`, then `leave_world`). `Elastic` is a rank's membership, the
one object `trainer.engine.RoundLoop` regroups through: the world it is in, leaving it and
entering the next, and what outlives worlds (the round-start states a rank keeps for a
regroup to restore, the Transport's counters), why a rank regroups, the growth boundary's
agreement and the checks on the next epoch the launcher hands back.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.artifacts import Blob, to_bytes
from trainer.compress import Compressor
from trainer.config import JobConfig
from trainer.control import Membership, RankControl
from trainer.data import derive_seed
from trainer.diloco import DiLoCo
from trainer.errors import TrainingError
from trainer.hooks import RankHooks
from trainer.metrics import Emit, Meter
from trainer.pipeline import Pipeline, StageRank, build_inner_optimizer
from trainer.rounds import load_round_state, round_tensors
from trainer.supervisor import error_line
from trainer.transport import Transport
from trainer.world import Topology, agree_device, check_members, init_world, world_failure

__all__ = ["KEEP_STATES", "Elastic", "Regroup", "Wired", "leave_world"]

KEEP_STATES = 3  # elastic runs: round-start states a rank keeps, for a regroup to restore


class Regroup(Exception):
    """Raised on every rank of a world at once (a growth boundary): regroup for `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Wired:
    """What trains the module in one world: the pipeline's process group, the stage
    (pipeline, inner optimizer, compressor), the Transport over the present replicas, DiLoCo
    and, under tau = auto, the agreements on tau still in flight."""

    pipe_group: Any
    rank: StageRank
    transport: Transport
    diloco: DiLoCo
    tau_votes: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def build(cls, topo: Topology, module: nn.Module, job: JobConfig, device: torch.device, corpus: Any,
              hooks: RankHooks) -> Wired:
        """`module`'s in the world of `topo`: its process groups, pipeline, a fresh inner
        optimizer and compressor (seeded by replica id), the Transport over the present
        replicas and DiLoCo (whose outer copy starts at the module's weights)."""
        pipe_group, dp_group = topo.create_groups("cpu:gloo,cuda:nccl" if device.type == "cuda" else None)
        pipeline = Pipeline(module, topo, pipe_group, job, device)
        inner = build_inner_optimizer(module, job)
        shapes = {n: p.shape for n, p in module.named_parameters()}
        seed = derive_seed("compress", job.seed, topo.replica, topo.stage)
        rank = StageRank(job, pipeline, inner, Compressor(job.outer.compression, shapes, seed), corpus)
        transport = Transport(dp_group, topo.n, topo.position, job.transport)
        return cls(pipe_group, rank, transport, DiLoCo(module, job.outer, transport, rank.compressor,
                                                       hooks.publish(topo)))

    def agree_tau(self, estimate: int) -> int:
        """tau = auto: every rank takes the largest estimate, agreed one round late so that no
        rank waits for another at a round's end: this round's `estimate` goes into an
        all-reduce (max) that completes in the background, and the agreement on the round
        before's comes back. The first round of an epoch has none earlier: it waits for its
        own."""
        vote = torch.tensor([estimate], dtype=torch.int64)
        self.tau_votes.append((dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True), vote))
        work, agreed = self.tau_votes.pop(0) if len(self.tau_votes) > 1 else self.tau_votes[0]
        work.wait()
        return int(agreed.item())

    def settle_votes(self) -> None:
        """Wait for the tau agreements still in flight (a world that ends or regroups whole)."""
        while self.tau_votes:
            self.tau_votes.pop(0)[0].wait()

    def counters(self) -> tuple[int, float, float]:
        """The Transport's counters, which the next epoch's Transport continues from."""
        return self.transport.bytes_sent, self.transport.modelled_s, self.transport.wait_s


def leave_world() -> None:
    """After the last reference to a `Wired` is gone: collect it (a live process group keeps
    its sockets open, and peers blocked on this rank would wait for the timeout rather than
    fail at once), then destroy the process groups, tolerating errors: the world is broken."""
    gc.collect()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


class Elastic:
    """A rank's membership: the world it is in (its `topo`, membership `epoch`, device and the
    `Wired` pieces that train the module there) and, elastic (`control.regroup` set), how it
    goes from one world into the next and what it carries across: round -> its start state
    of that round, for the last KEEP_STATES rounds opened (a regroup restores the inner
    optimizer and compressor from them), and the Transport's counters. Every run has one; a
    run that never regroups stays in its first world.

    A regroup: `leave` the world (the `Wired` pieces go as a unit), ask the launcher for the
    next epoch (`next_epoch`) and `enter` it; `grow` is the growth boundary's agreement and
    `reason` tells a broken world from any other error."""

    def __init__(self, topo: Topology, job: JobConfig, control: RankControl, module: nn.Module,
                 device: torch.device, corpus: Any) -> None:
        self.control, self.job, self.module, self.device, self.corpus = control, job, module, device, corpus
        self.epoch = control.epoch
        self.kept: dict[int, bytes | Blob] = {}
        self.counters = (0, 0.0, 0.0)  # the Transport's counters, carried into the next epoch
        self.wired: Wired | None = None
        self._wire(topo)

    def _wire(self, topo: Topology) -> None:
        """Be at `topo`, with what trains the module in its world (`Wired.build`)."""
        self.topo = topo
        self.wired = Wired.build(topo, self.module, self.job, self.device, self.corpus, self.control.hooks)

    @property
    def world(self) -> Wired:
        """The pieces bound to the world this rank is in."""
        assert self.wired is not None, "the rank is in no world"
        return self.wired

    def announce(self, emit: Emit) -> None:
        """`control.emit_contributions`: every rank emits the epoch it trains in, and where."""
        if self.control.emit_contributions:
            emit("epoch", {"epoch": self.epoch, "rank": self.topo.rank, "members": self.topo.members})

    def keep(self, t: int, start_state: bytes | Blob) -> None:
        """Round `t` opened with `start_state`: keep it, and the last KEEP_STATES only."""
        if self.control.regroup is not None and start_state:  # what a regroup restores
            self.kept[t] = start_state
            self.kept = {k: v for k, v in self.kept.items() if k > t - KEEP_STATES}

    def keep_live(self, nxt: int, held: Callable[[dict[str, torch.Tensor]], bytes | Blob]) -> None:
        """Between rounds (the last one opened has ended), a rank's live inner and compressor
        state is the start state of round `nxt`: keep it (`held` serialises it), as if opened.
        A rank whose world broke while it was being entered has none."""
        rank = None if self.wired is None else self.wired.rank
        if rank is not None and nxt not in self.kept:
            self.kept[nxt] = held(round_tensors(rank.module, rank.inner, rank.compressor, nxt,
                                                (nxt - 1) * self.job.outer.inner_steps))

    def leave(self, meter: Meter) -> None:
        """Tear this rank's world down: drop the exchange in flight (its daemon thread may
        stay blocked on the dead world until the collective timeout; nobody waits for it)
        and the tau agreements, then every reference to a process group, the `Wired` pieces
        as a unit (a world may break while an epoch is being entered: then there are none),
        and the process groups themselves (`leave_world`). The world's compression and
        decoding time goes to `meter.compress_before`, its Transport's counters to the next."""
        wired, self.wired = self.wired, None
        if wired is not None:
            wired.diloco.drop_pending()
            meter.compress_before += wired.diloco.decode_s
            meter.compress_before += wired.rank.compressor.total_s
            self.counters = wired.counters()
        del wired
        leave_world()

    def enter(self, m: Membership) -> None:
        """Join epoch `m`'s world and rebuild what trains the module there (the Transport
        counting on from the last world's), restoring the inner optimizer and compressor
        from this rank's kept start state of round start_step + 1 (else fresh).

        Deadlock hazard: a joiner's `run_rank` + `RoundLoop.begin` run the same collectives
        in the same order (init, agree_device, create_groups, the tokens' all-reduce)."""
        job, S = self.job, self.topo.S
        self.epoch = m.epoch
        init_world(m.init_method, m.rank, len(m.members) * S, self.control.timeout_s)
        device = agree_device(job, self.control.gpu)
        if device != self.device:
            self.module.to(device)
            self.device = device
        self._wire(Topology(m.rank, job.parallel.replicas, S, tuple(m.members)))
        transport = self.world.transport
        transport.bytes_sent, transport.modelled_s, transport.wait_s = self.counters
        self.restore(m.start_step + 1, self.world.rank)

    def restore(self, nxt: int, rank: StageRank) -> None:
        """Load this rank's kept start state of round `nxt` into `rank`, if it kept one (else
        the state stays fresh), and forget the later ones."""
        state = self.kept.get(nxt)
        if state is not None:
            try:
                load_round_state(to_bytes(state), rank.module, rank.inner, rank.compressor)
            except ValueError as exc:
                raise TrainingError(f"regroup: this rank's kept start state of round {nxt}: {exc}") from None
        self.kept = {t: v for t, v in self.kept.items() if t <= nxt}

    def grow(self) -> bool:
        """Elastic runs, at a growth boundary: rank 0 asks `control.grow_requested` and every
        rank learns the answer in one broadcast (a collective: every rank calls it). False
        without `control.regroup`, and no collective."""
        if self.control.regroup is None:
            return False
        flag = torch.zeros(1, dtype=torch.int32)
        if self.topo.rank == 0:
            grow = self.control.grow_requested
            flag[0] = int(bool(grow and grow()))
        dist.broadcast(flag, src=0)
        return bool(flag[0])

    def reason(self, exc: Exception) -> str | None:
        """Why this rank regroups after `exc` (one line), or None: it fails as without elastic
        training (no `control.regroup`, or not a broken world)."""
        if isinstance(exc, Regroup):
            return exc.reason
        if self.control.regroup is None or not world_failure(exc):
            return None
        return error_line(exc)

    def next_epoch(self, reason: str) -> Membership:
        """The launcher's next epoch after this one for this rank, regrouping for `reason`:
        TrainingError when it has fewer than min_replicas, or does not hold this rank."""
        assert self.control.regroup is not None
        failed, topo = self.epoch, self.topo
        m = self.control.regroup(failed, reason)
        members = check_members(tuple(m.members), self.job, m.epoch)
        position, stage = divmod(m.rank, topo.S)
        if m.epoch <= failed or stage != topo.stage or position >= len(members) \
                or members[position] != topo.replica:
            raise TrainingError(f"regroup: epoch {m.epoch} (after {failed}) puts rank {m.rank} at replica "
                                f"{members[position] if position < len(members) else None} stage {stage}, "
                                f"but this is replica {topo.replica} stage {topo.stage}")
        return m
