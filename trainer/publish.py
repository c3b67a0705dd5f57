"""How a rank publishes what it computed (`Publisher`): the genesis shards, and each outer
step it applied, with every rank's contribution and counters gathered to global rank 0,
which emits it. Large bytes (start states, stage shards) are held in memory or, where the
rank spills, written to files as they are made (`trainer.artifacts.Spill`).
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
import torch.distributed as dist

from trainer.artifacts import (
    Blob,
    Contribution,
    GenesisArtifacts,
    Spill,
    StageShard,
    tensors_to_bytes,
)
from trainer.config import JobConfig
from trainer.control import RankControl
from trainer.diloco import AppliedStep
from trainer.elastic import Wired
from trainer.metrics import Emit, Meter, release_free_memory
from trainer.supervisor import Emitter
from trainer.world import Topology

__all__ = ["Publisher"]


class Publisher:
    """One rank's side of publishing: every rank takes part in each gather, in the same
    order; only global rank 0 emits ("genesis", "step"), every rank its own
    ("contribution") where `control.emit_contributions`."""

    def __init__(self, job: JobConfig, control: RankControl, emit: Emit, meter: Meter, eval_batches: Any) -> None:
        self.job, self.control, self.emit, self.meter = job, control, emit, meter
        self.hooks, self.eval_batches = control.hooks, eval_batches
        self.allreduce = job.parallel.sync == "allreduce"
        # Where this rank's large bytes go as they are made (None: held in memory); only
        # through a Supervisor's queue does a Blob reach the launcher as bytes.
        self.spill = Spill(control.spill_dir) if control.spill_dir and isinstance(emit, Emitter) else None

    def held(self, tensors: dict[str, torch.Tensor]) -> bytes | Blob:
        """`tensors_to_bytes(tensors)`, or where this rank spills the same bytes in a file."""
        return tensors_to_bytes(tensors) if self.spill is None else self.spill.tensors(tensors)

    def gather(self, topo: Topology, payload: Any) -> list[Any] | None:
        out = [None] * (topo.n * topo.S) if topo.rank == 0 else None
        dist.gather_object(payload, out, dst=0)
        return out

    def genesis(self, topo: Topology, world: Wired) -> None:
        """Rank 0 emits the genesis shards, the first member's of each stage."""
        shards = self.gather(topo, StageShard(topo.stage, cast(bytes, self.held(world.diloco.outer.tensors())))
                             if topo.lead else None)
        if topo.rank == 0:
            assert shards is not None
            self.emit("genesis", GenesisArtifacts(stages=[shards[s] for s in range(topo.S)]))

    def shard_tensors(self, world: Wired) -> dict[str, torch.Tensor]:
        """This rank's new stage shard's tensors: the outer state (views), or the baseline's
        weights with zero momentum (it has no outer optimizer)."""
        if self.allreduce:
            named = dict(world.rank.module.named_parameters())
            tensors = {f"param/{n}": p.detach().float().cpu() for n, p in named.items()}
            tensors.update({f"momentum/{n}": torch.zeros_like(p) for n, p in named.items()})
            return tensors
        return world.diloco.outer.tensors()

    def step(self, topo: Topology, world: Wired, epoch: int, applied: AppliedStep) -> None:
        """Publish outer step `applied.round` (every rank takes part: gathers and eval)."""
        # Every replica serialises its own new outer shard: the replicas of a stage are
        # independent witnesses of the aggregate, and each co-signs the digest of its own.
        # Its bytes are made only where they are needed (the digest; the first member's
        # StageShard, which a spilling rank writes straight to its file) and freed at once.
        release_free_memory()  # the outer step's decoded tensors, before the shard's bytes
        tensors = self.shard_tensors(world)
        signs = self.control.shard_digest is not None
        own = tensors_to_bytes(tensors) if signs or (topo.lead and self.spill is None) else None
        contribution = self._contribution(topo, applied, own)
        shard = None
        if topo.lead:
            data = own if self.spill is None else self.spill.tensors(tensors) if own is None else self.spill.bytes(own)
            shard = StageShard(topo.stage, cast(bytes, data))
        del own, tensors
        if self.control.emit_contributions:  # so this rank's node can check what it attests
            self.emit("contribution", (applied.round, contribution))
        eval_loss = None
        if topo.lead:  # the committed weights, whatever the local ones are now
            with contextlib.nullcontext() if self.allreduce else world.diloco.outer_weights():
                eval_loss = world.rank.pipeline.eval_loss(self.eval_batches)
        self.meter.count_round(applied.round, topo.n)  # what the present replicas trained
        gathered = self.gather(topo, (contribution, shard, eval_loss, self._rank_stats(world)))
        if topo.rank == 0:
            assert gathered is not None
            if self.control.step_slots is not None:  # the sink's backlog is full: wait for it
                self.control.step_slots.acquire()
            self.emit("step", self.meter.step_artifacts(topo, epoch, applied.round, gathered))
        del gathered, contribution, shard
        release_free_memory()

    def _contribution(self, topo: Topology, applied: AppliedStep, own_shard: bytes | None) -> Contribution:
        """This rank's contribution to `applied`; its start state may be a spilled `Blob`,
        which reaches the launcher as the bytes (`trainer.artifacts.Blob`)."""
        digest, round_loss, start_state = applied.tag
        sign = self.control.shard_digest
        new_shard = b""
        if sign is not None:
            assert own_shard is not None
            new_shard = self.hooks.cosigned_shard(topo, applied.round, own_shard, sign)
        return Contribution(
            replica=topo.replica,
            stage=topo.stage,
            data=applied.payload,
            data_shard=digest,
            loss=round_loss,
            start_state=cast(bytes, start_state),
            new_shard=new_shard,
        )

    def _rank_stats(self, world: Wired) -> dict[str, float]:
        """This rank's counters for the step's metrics (rank 0 combines every rank's)."""
        rank = world.rank
        return self.meter.rank_stats(
            world.transport, rank.compressor,
            float(0 if self.allreduce else world.diloco.extra_memory_bytes()),
            float(4 * sum(p.numel() for p in rank.params)))
