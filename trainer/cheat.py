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
  aggregate of the published contributions, while the replicas co-sign the true one: the
  manifest links a shard nobody co-signed (`dlx verify`, chain level);
- collude_shard: every replica of stage `stage` co-signs the shard the coordinator stores
  slightly off the aggregate (as bad_aggregate), so levels 1-2 pass and only the aggregate
  level catches it; an aggregate challenge slashes every co-signer;
- wrong_shard: slot (replica, stage) co-signs another digest than its peers of the stage,
  so the ledger reverts with LedgerShardMismatch;
- shared_key: slot (replica, stage) is signed with the key of slot (0, stage), one node in
  two replicas, so the ledger reverts with LedgerNotIndependent (signer side: workers/sink.py);
- equivocate_result: as equivocate, but the second claim differs in its co-signed shard
  digest (`reportResultEquivocation`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from trainer.artifacts import StageShard, bytes_to_tensors, tensors_to_bytes
from trainer.config import CheatConfig, CheatMode, JobConfig
from trainer.data import derive_seed

__all__ = [
    "SIGNER_MODES",
    "active",
    "coordinator_shard",
    "cosigned_shard",
    "equivocating_slots",
    "second_claim",
    "signing_slot",
    "poison_hook",
    "skips_work",
    "stale_parent",
]

Deltas = dict[str, torch.Tensor]
ClaimT = TypeVar("ClaimT")

#: Modes acted out by the signer holding every slot's key: only `dlx train` has one.
SIGNER_MODES = ("equivocate", "equivocate_result", "shared_key")


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
    modes = [*active(job, "equivocate", step), *active(job, "equivocate_result", step)]
    return sorted({(c.replica, c.stage) for c in modes})


def second_claim(job: JobConfig, step: int, claim: ClaimT) -> ClaimT:
    """The other claim an equivocating slot signs for `step`: `claim` (a dataclass with
    `replica`, `stage`, `contribution` and `new_shard`) with another contribution digest
    (equivocate) or another co-signed shard digest (equivocate_result)."""
    c: Any = claim
    result = any((x.replica, x.stage) == (c.replica, c.stage) for x in active(job, "equivocate_result", step))
    if result:
        return dataclasses.replace(c, new_shard=hashlib.sha256(c.new_shard).digest())
    return dataclasses.replace(c, contribution=hashlib.sha256(c.contribution).digest())


def signing_slot(job: JobConfig, step: int, replica: int, stage: int) -> int:
    """The slot whose key signs slot (`replica`, `stage`) at `step`: its own, or (shared_key)
    that of replica 0's slot of the same stage."""
    shared = any((c.replica, c.stage) == (replica, stage) for c in active(job, "shared_key", step))
    return stage if shared else replica * job.parallel.stages + stage


def _nudged(data: bytes) -> bytes:
    """The same shard with every outer parameter nudged by 1e-3 (not the aggregate)."""
    tensors = bytes_to_tensors(data)
    return tensors_to_bytes({k: t + 1e-3 if k.startswith("param/") else t for k, t in tensors.items()})


def _off_aggregate(job: JobConfig, step: int, stage: int) -> bool:
    modes = [*active(job, "bad_aggregate", step), *active(job, "collude_shard", step)]
    return any(c.stage == stage for c in modes)


def coordinator_shard(job: JobConfig, step: int, shard: StageShard) -> bytes:
    """The stage shard bytes the coordinator stores for `step`: the true aggregate, or
    (bad_aggregate, collude_shard) the same tensors with every outer parameter nudged by 1e-3."""
    return _nudged(shard.data) if _off_aggregate(job, step, shard.stage) else shard.data


def cosigned_shard(job: JobConfig, step: int, replica: int, stage: int, data: bytes,
                   digest: Callable[[bytes], bytes]) -> bytes:
    """The shard digest slot (`replica`, `stage`) co-signs for `step`, given its own new
    shard bytes `data`: `digest(data)`; under collude_shard the digest of the coordinator's
    nudged shard; under wrong_shard (that slot) another digest."""
    if any(c.stage == stage for c in active(job, "collude_shard", step)):
        data = _nudged(data)
    out = digest(data)
    if any((c.replica, c.stage) == (replica, stage) for c in active(job, "wrong_shard", step)):
        out = hashlib.sha256(b"wrong shard" + out).digest()
    return out
