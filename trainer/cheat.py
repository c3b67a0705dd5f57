"""Cheating nodes, for tests only: make one slot of a run misbehave, so that a test can
show which layer of the verifier (or the ledger) catches it (tests/test_attacks.py,
README "Attack catalogue").

Off unless a job file has a `[cheat]` table (or several `[[cheat]]` tables, see
`trainer.config.CheatConfig`); the runners refuse it on any chain but a local one
(`workers.local.refuse_cheat_off_local_chain`). A cheat never enters the run's recorded
configuration: a cheating node does not announce itself, so a replay re-runs honest code.

Modes, each active at every outer step >= `from_step`:
- poison: slot (replica, stage) publishes its honest pseudo-gradient plus Gaussian noise
  (std = `scale` x the delta's RMS), and sends that same payload through the transport,
  so the aggregate matches the published contributions and only replay catches it;
- skip_work: every stage of `replica` skips its inner steps (a pipeline's stages must
  agree, or it deadlocks) and still claims the round: a zero pseudo-gradient, loss 0;
- stale_parent: the coordinator builds and commits the step on its head's parent, so the
  ledger reverts with LedgerStaleParent;
- equivocate: the slot's node also signs a second claim with a different contribution
  for the same (run, step, replica, stage) (the signing side lives with the signer, in
  workers/local.py; this module only says when);
- bad_aggregate: the coordinator stores stage `stage`'s new shard slightly off the
  aggregate of the published contributions (the nodes' signatures still hold).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.artifacts import StageShard, bytes_to_tensors, tensors_to_bytes
from trainer.config import CheatConfig, CheatMode, JobConfig
from trainer.data import derive_seed

__all__ = [
    "active",
    "coordinator_shard",
    "equivocating_slots",
    "poison_hook",
    "skips_work",
    "stale_parent",
]

Deltas = dict[str, torch.Tensor]


def active(job: JobConfig, mode: CheatMode, step: int) -> list[CheatConfig]:
    """The cheats of `mode` that act at outer step `step` (none for an honest job)."""
    return [c for c in job.cheat if c.mode == mode and c.active(step)]


def poison_hook(job: JobConfig, replica: int, stage: int) -> Callable[[int, Deltas], Deltas] | None:
    """For the poisoning slot: (round, honest delta) -> the delta it publishes and sends."""
    mine = [c for c in job.cheat if c.mode == "poison" and (c.replica, c.stage) == (replica, stage)]
    if not mine:
        return None

    def poison(round_t: int, delta: Deltas) -> Deltas:
        live = [c for c in mine if c.active(round_t)]
        if not live:
            return delta
        # Seeded, so a poisoned run is as reproducible as an honest one.
        gen = torch.Generator().manual_seed(derive_seed("cheat", job.seed, replica, stage, round_t))
        out = {}
        for name in sorted(delta):
            d = delta[name]
            rms = d.float().pow(2).mean().sqrt().clamp_min(1e-8)
            noise = torch.randn(d.shape, generator=gen, dtype=torch.float32)
            out[name] = d + (live[0].scale * rms * noise).to(d.dtype)
        return out

    return poison


def skips_work(job: JobConfig, replica: int) -> Callable[[int], bool]:
    """round -> whether `replica` (all of its stages) skips the round's inner steps."""
    mine = [c for c in job.cheat if c.mode == "skip_work" and c.replica == replica]
    return lambda round_t: any(c.active(round_t) for c in mine)


def stale_parent(job: JobConfig, step: int) -> bool:
    """Whether the coordinator commits `step` on an older parent than its head."""
    return bool(active(job, "stale_parent", step))


def equivocating_slots(job: JobConfig, step: int) -> list[tuple[int, int]]:
    """The (replica, stage) slots whose node signs two different claims for `step`."""
    return sorted({(c.replica, c.stage) for c in active(job, "equivocate", step)})


def coordinator_shard(job: JobConfig, step: int, shard: StageShard) -> bytes:
    """The stage shard bytes the coordinator stores for `step`: the true aggregate, or
    (bad_aggregate) the same tensors with every outer parameter nudged by 1e-3."""
    if not any(c.stage == shard.stage for c in active(job, "bad_aggregate", step)):
        return shard.data
    tensors = bytes_to_tensors(shard.data)
    return tensors_to_bytes(
        {k: t + 1e-3 if k.startswith("param/") else t for k, t in tensors.items()}
    )
