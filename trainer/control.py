"""How a launcher steers a rank beyond the job itself: `RankControl`, with where a rank
resumes (`ResumePoint`) and an elastic world's epoch (`Membership`). trainer.engine runs
ranks with them.

Torch-free on purpose: a launcher builds these and pickles them to its ranks, and needs no
torch of its own for that (importing it costs a process about 2 s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.hooks import RankHooks

#: How long the ranks of a world wait for each other to arrive (at least; `trainer.world.
#: init_world`): a rank that joins a running world (an elastic joiner) starts its process,
#: imports torch and builds its stage first, which on a loaded machine takes longer than a
#: short collective timeout. A launcher that judges whether the others moved on without a
#: failed rank waits at least this long.
RENDEZVOUS_S = 120.0

__all__ = ["RENDEZVOUS_S", "Membership", "RankControl", "ResumePoint"]


@dataclass(frozen=True)
class ResumePoint:
    """Start from a committed checkpoint instead of the seed: this rank's stage shard
    (outer params + momentum) after outer step `step`. Rounds continue at `step + 1` with
    the same data shards an uninterrupted run would read.

    With `state` (this rank's published start state of round `step`) and `claimed` (its
    published contribution of that round), a synchronous run (`outer.delay = 0`) resumes
    exactly: the rank re-runs round `step` from that state, as a replay does, to get back
    the inner optimizer and compressor state the round left, so the resumed run continues
    bit for bit as the uninterrupted one would have. Without them, or with `outer.delay =
    1` (whose exchange in flight when the job stopped is lost), both restart fresh."""

    step: int
    shard: bytes
    state: bytes = b""
    claimed: bytes = b""
    #: The run's cumulative counters through `step`, from the head's metrics (`carried`):
    #: this rank's `bytes_sent` and `modelled_comm_s`, and the run's `tokens`; the resumed
    #: run counts on from them, so its manifests read as an uninterrupted run's. Empty: from
    #: zero (a head recorded before per-rank counters), tokens as an uninterrupted run's.
    counters: dict[str, float] = field(default_factory=dict)


#: The per-rank cumulative counters a step's metrics record (as `<name>.r<rank>`), which a
#: resumed rank continues from.
RANK_COUNTERS = ("bytes_sent", "modelled_comm_s")


def carried(metrics: dict[str, float], rank: int) -> dict[str, float]:
    """What rank `rank` of a resumed run continues from, out of the head's metrics."""
    out = {name: metrics[f"{name}.r{rank}"] for name in RANK_COUNTERS if f"{name}.r{rank}" in metrics}
    if "tokens" in metrics:
        out["tokens"] = metrics["tokens"]
    return out


@dataclass(frozen=True)
class Membership:
    """One membership epoch's world, as a launcher's `RankControl.regroup` returns it: the
    present replicas `members` (ids, ascending) x S stages, global rank = position * S +
    stage where position = members.index(replica id)."""

    epoch: int  # increasing per run (0 = the first world)
    rank: int  # this process's global rank in the epoch's world
    members: tuple[int, ...]  # replica ids present, ascending; world = len(members) * S
    init_method: str  # torch.distributed init for this epoch (tcp://host:port)
    start_step: int  # the committed outer step to continue from (0 = genesis)
    shard: bytes  # this rank's stage shard (outer params + momentum) after start_step


@dataclass
class RankControl:
    """How a launcher steers a rank beyond the job itself (the job queue uses it).

    Deadlock hazard: `cancellable` adds a broadcast from rank 0 at every inner-step
    boundary, so every rank of a world must get the same `cancellable` value; likewise
    `regroup` (set: a broadcast from rank 0 at every round end, for `grow_requested`).

    Elastic training (`members`, `epoch`, `regroup`, `grow_requested`; the rules are in
    trainer.engine's docstring): `regroup(failed epoch, reason)` is called by a rank whose
    world broke (a collective raised or timed out: a peer died) or, with reason "grow", at
    a growth boundary; it blocks until the next epoch's `Membership`, or raises
    (TrainingError: fewer than min_replicas remain, or the job ended; Cancelled).
    """

    stop_requested: Callable[[], bool] | None = None  # polled on rank 0 only
    cancellable: bool = False
    start: ResumePoint | None = None
    timeout_s: float | None = None  # collective timeout: how soon a lost peer fails a round
    emit_contributions: bool = False  # every rank emits ("contribution", (step, Contribution))
    gpu: int | None = None  # the CUDA device this rank may use (None: none is free for it)
    # The digest a rank co-signs for its stage's new shard bytes (the UnixFS file CID's
    # sha-256 the manifest links it by, `lineage.attest.shard_digest`): passed in, since the
    # trainer knows no CIDs. None: contributions carry no shard digest (no ledger).
    shard_digest: Callable[[bytes], bytes] | None = None
    # Test-only misbehaviour (tests/dlx_testing/cheat.py), injected: the honest defaults otherwise.
    hooks: RankHooks = field(default_factory=RankHooks)
    members: tuple[int, ...] | None = None  # the first world's replica ids (None: all R)
    epoch: int = 0  # the first world's membership epoch (a joiner's is a later one)
    # None: a broken world fails the rank (no elastic training).
    regroup: Callable[[int, str], Membership] | None = None
    # Polled on global rank 0 after each round's reports: True makes every rank regroup
    # (reason "grow") at that boundary, so that waiting replicas can join.
    grow_requested: Callable[[], bool] | None = None
    # A directory of this host, the launcher's (it removes it at the end), where the rank
    # writes its round-start states and stage shards as it makes them instead of holding
    # them (`trainer.artifacts.Spill`); they reach the launcher's sink as the same bytes.
    # Only for a rank whose events go through a `trainer.supervisor` queue to a launcher on
    # this host; every rank of a world gets the same directory (their object collectives
    # pass file names). None: the rank holds them in memory.
    spill_dir: str | None = None
    # A semaphore global rank 0 takes before each ("step", ...) event and the launcher gives
    # back once its sink has taken the step (committed it on a chain): at most its initial
    # value of steps wait, and then rank 0, and with it every rank at the next collective,
    # pauses (a sink's `max_pending`: a chain outage). None: steps never wait.
    step_slots: Any = None
