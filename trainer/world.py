"""The world a rank trains in: who is who (`Topology`: the present replicas x S stages and
the process groups every rank creates), joining it (`init_world`), checking a membership
epoch's replicas (`check_members`), agreeing on one device kind (`agree_device`) and
telling a broken world from a rank's own failure (`world_failure`). The rules of elastic
worlds are in trainer/engine.py's docstring.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import JobConfig
from trainer.control import RENDEZVOUS_S
from trainer.errors import Cancelled, DlxError, TrainingError
from trainer.supervisor import peer_loss

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "Topology",
    "agree_device",
    "check_members",
    "gpu_usable",
    "init_world",
    "rendezvous",
    "world_failure",
]

COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class Topology:
    """Who is who in a world of the present replicas `members` (replica ids, ascending; all
    R by default) x S stages, and the process groups every rank must create. Global rank =
    position * S + stage, where position = members.index(replica): a replica's id fixes its
    data, seeds and ledger slot; its position only where it sits in this world."""

    def __init__(self, rank: int, replicas: int, stages: int, members: tuple[int, ...] | None = None):
        self.rank, self.R, self.S = rank, replicas, stages
        self.members = tuple(range(replicas)) if members is None else tuple(members)
        self.n = len(self.members)  # replicas present
        self.position, self.stage = divmod(rank, stages)
        self.replica = self.members[self.position]
        self.is_first = self.stage == 0
        self.is_last = self.stage == stages - 1
        self.lead = self.position == 0  # the first member: progress, eval and the shards

    @property
    def full(self) -> bool:
        """Whether every one of the R replicas is present."""
        return self.members == tuple(range(self.R))

    def global_rank(self, position: int, stage: int) -> int:
        return position * self.S + stage

    def create_groups(self, pipe_backend: str | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(pipeline group of my replica, data-parallel group of my stage). The pipeline
        group may take another backend (CUDA ranks: NCCL for activations, gloo for CPU
        scalars); the data-parallel group is always gloo: the Transport's slow link.

        Deadlock hazard: new_group is collective over the whole world, so every rank
        creates every group, in the same order, even the ones it is not in.
        """
        pipe = dp = None
        for p in range(self.n):
            g = dist.new_group([self.global_rank(p, s) for s in range(self.S)], backend=pipe_backend)
            if p == self.position:
                pipe = g
        for s in range(self.S):
            g = dist.new_group([self.global_rank(p, s) for p in range(self.n)])
            if s == self.stage:
                dp = g
        assert pipe is not None and dp is not None
        return pipe, dp


def init_world(init_method: str, rank: int, world_size: int, timeout_s: float | None) -> None:
    """Join a world over gloo (every membership epoch's, too) with the collective timeout:
    how soon a lost peer fails a collective. A tcp:// world's ranks first meet on its
    TCPStore within the longer rendezvous timeout (`rendezvous`), so a slow starter is
    waited for; a lost peer then fails the first collective after the collective timeout."""
    timeout = timedelta(seconds=timeout_s) if timeout_s else COLLECTIVE_TIMEOUT
    if not init_method.startswith("tcp://"):
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        return
    store = rendezvous(init_method, rank, world_size, max(timeout, timedelta(seconds=RENDEZVOUS_S)), timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def rendezvous(init_method: str, rank: int, world_size: int, wait: timedelta,
               timeout: timedelta | None = None) -> dist.TCPStore:
    """The world's TCPStore (rank 0 serves it at `init_method`'s tcp://host:port, as
    torch's own tcp:// rendezvous does), once all `world_size` ranks have arrived or `wait`
    has passed (DistStoreError, which `world_failure` counts as a broken world).

    The store itself is made with the short `timeout` (default `wait`): it is every later
    store operation's timeout and also how long a client keeps reconnecting to a server
    that went away, so a world whose rank 0 died fails within the collective timeout, not
    the rendezvous one. Only the meeting is allowed `wait`: a client retries connecting
    until then, and every rank waits for the arrival count."""
    import time

    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    host, deadline, timeout = host.strip("[]"), time.monotonic() + wait.total_seconds(), timeout or wait
    while True:
        try:
            store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout, wait_for_workers=False)
            break
        except dist.DistError:
            if rank == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    store.add("dlx/arrived", 1)
    while store.add("dlx/arrived", 0) < world_size:
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"rendezvous at {init_method}: {store.add('dlx/arrived', 0)} of "
                                      f"{world_size} ranks arrived within {wait.total_seconds():.0f} s")
        time.sleep(0.05)
    return store


def check_members(members: tuple[int, ...], job: JobConfig, epoch: int) -> tuple[int, ...]:
    """`members` if they are distinct replica ids of the job, ascending, at least
    `parallel.min_replicas` of them; TrainingError otherwise."""
    R, least = job.parallel.replicas, job.parallel.min_present
    if list(members) != sorted(set(members)) or not all(0 <= r < R for r in members):
        raise TrainingError(f"membership epoch {epoch}: replicas {list(members)} are not distinct ids "
                            f"in 0..{R - 1}, ascending")
    if len(members) < least:
        raise TrainingError(f"membership epoch {epoch}: {len(members)} replica(s) {list(members)} remain, "
                            f"fewer than parallel.min_replicas ({least}): the job stops (dlx resume "
                            "continues it from the last committed step)")
    return members


def world_failure(exc: BaseException) -> bool:
    """Whether `exc` says this rank's world broke (a peer died or stopped answering: a
    torch.distributed error, or gloo's RuntimeError naming a lost peer or a timeout) rather
    than a failure of its own (a bug, a divergence, a bad input, a stop)."""
    if isinstance(exc, Cancelled | DlxError):
        return False
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and peer_loss(str(exc))


def gpu_usable(gpu: int | None) -> bool:
    return gpu is not None and torch.cuda.is_available() and 0 <= gpu < torch.cuda.device_count()


def agree_device(job: JobConfig, gpu: int | None, *, strict: bool = True) -> torch.device:
    """Every rank's device, agreed over the world (a collective: every rank calls it):
    CUDA when the job allows it and every rank has a GPU of its own, else the CPU (one
    device kind per world: stages exchange activations of one kind). A job that asks for
    cuda where some rank has none fails on every rank, naming that rank (unless not
    `strict`: a replay elsewhere falls back to the CPU and its tolerance)."""
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, gpu_usable(gpu))
    want = job.parallel.device
    if want == "cuda" and strict and not all(seen):
        raise TrainingError(f"parallel.device = 'cuda' but rank {seen.index(False)} has no GPU of its own")
    if want != "cpu" and all(seen):
        assert gpu is not None
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu)
    return torch.device("cpu")
