"""The rendezvous of a queued job's rank tasks: which tickets form the first world, in
which order, and where rank 0's TCPStore listens.

A job of R x S ranks queues R x S tickets (`run_rank` tasks). Each task joins the job's
rendezvous record in Redis with its node address and waits:

- a job that cannot re-form its world (`_rendezvous`) waits for all R x S tickets; ticket 0
  publishes its TCPStore address at once; past `--rendezvous-timeout` the job fails saying
  how many slots were needed and how many came;
- an elastic job (`[parallel] min_replicas` below R; `elastic_rendezvous`) waits as long for
  all of them, and past the same timeout starts with the *complete* replicas that came (every
  stage's ticket present) when there are at least min_replicas of them: a stack with fewer
  live slots than the job has (`dlx up --workers 2 --slots 1` for a 3 x 1 job) starts rather
  than fails. The first task to see the world complete, or its own deadline pass, writes
  the world (`formed`: the tickets in slot order) once (SET NX) and every task reads that one
  back; the task holding slot 0 publishes the store address. A ticket left out (untaken when
  the world formed, taken later; or in a replica that lacked a stage) is a *spare*: it waits
  as a joiner (workers/queue/membership.py) and the growth path seats it, as a whole replica, at a
  later round boundary, like the tickets queued for a lost replica. The timeout is the
  settle time: every ticket is queued at submit, and a live worker with a free slot takes
  one within a second or two, so tickets still untaken after it are waiting for workers
  that are busy or not started yet, which is what joining later is for.

The replica ids of a first world formed with k < R replicas are 0..k-1; the others' slots
are free for joiners. `replica_aligned` packs each node's tickets into one replica.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .jobs import KEY_TTL_S, TERMINAL, JobError, JobStore
from .membership import EPOCH_WAIT_S, store_port
from .node import NodeIdentity

__all__ = ["World", "complete_replicas", "elastic_rendezvous", "rendezvous", "replica_aligned", "spare_ticket"]

POLL_S = 0.1


def _rooms(joined: dict[int, str], replicas: int, stages: int) -> list[list[int]]:
    """The tickets of `joined` (ticket -> node) packed into `replicas` rooms of `stages`
    (`replica_aligned`'s rule); a room may stay short when fewer tickets joined."""
    groups: dict[str, list[int]] = {}
    for ticket in sorted(joined):
        groups.setdefault(joined[ticket], []).append(ticket)
    first, *rest = sorted(groups.values(), key=lambda g: (g[0] != 0, -len(g), g[0]))
    rooms: list[list[int]] = [first[:stages], *([] for _ in range(replicas - 1))]
    spill = first[stages:]
    for group in rest:
        room = next((r for r in rooms if len(r) + len(group) <= stages), None)
        if room is None:
            spill.extend(group)
        else:
            room.extend(group)
    for ticket in spill:
        room = next((r for r in rooms if len(r) < stages), None)
        if room is not None:  # more tickets than slots: never from the queue's R x S
            room.append(ticket)
    return rooms


def replica_aligned(joined: dict[int, str], replicas: int, stages: int) -> list[int]:
    """The tickets (the rank each task was queued as) in the order of the ranks they train.

    The ledger lets a node sign slots of one replica per step only, and a worker with several
    slots takes several tickets, whichever the queue hands it; so each node's tickets are
    packed into replicas together, largest groups first (ticket 0's node first, keeping
    ticket 0 at rank 0: it hosts the rendezvous store). Every task computes the same order
    from the same complete `joined` map (ticket -> node). A node holding more tickets than
    a replica has stages, or whose group fits no replica's room, spills into the next room
    (and the ledger refuses its steps, naming it)."""
    return [t for room in _rooms(joined, replicas, stages) for t in room]


def complete_replicas(joined: dict[int, str], replicas: int, stages: int) -> list[int]:
    """Of the tickets that joined, those of the rooms with every stage (`replica_aligned`'s
    packing), in slot order: the first world an elastic job can start with."""
    return [t for room in _rooms(joined, replicas, stages) if len(room) == stages for t in room]


@dataclass(frozen=True)
class World:
    """An elastic job attempt's first world: the tickets in slot order (slot = replica id
    x S + stage, replica ids 0..k-1) and each slot's node."""

    order: list[int]
    nodes: list[str]

    def to_json(self) -> str:
        return json.dumps({"order": self.order, "nodes": self.nodes})

    @classmethod
    def from_json(cls, raw: str | bytes) -> World:
        d = json.loads(raw)
        return cls([int(t) for t in d["order"]], [str(n) for n in d["nodes"]])


def _key(store: JobStore, job_id: str, attempt: int) -> str:
    return store.key(job_id, f"a{attempt}", "formed")


def formed(store: JobStore, job_id: str, attempt: int) -> World | None:
    """The attempt's first world once it formed (an elastic job's), else None."""
    raw = store.r.get(_key(store, job_id, attempt))
    return World.from_json(raw) if raw else None


def spare_ticket(store: JobStore, job_id: str, attempt: int, ticket: int) -> bool:
    """Whether `ticket` was left out of the attempt's first world (an elastic job's ticket
    taken after it formed): it joins as a joiner, at a growth boundary."""
    world = formed(store, job_id, attempt)
    return world is not None and ticket not in world.order


def _form(store: JobStore, job_id: str, attempt: int, order: list[int], joined: dict[int, str]) -> None:
    """Write the first world, unless another task wrote it first (then that one stands)."""
    world = World(order, [joined[t] for t in order])
    store.r.set(_key(store, job_id, attempt), world.to_json(), nx=True, ex=KEY_TTL_S)


def rendezvous(store: JobStore, job_id: str, rank: int, attempt: int, rec: Mapping[str, Any], me: NodeIdentity,
               world: int) -> tuple[dict[int, str], str] | None:
    """Join the job's rendezvous and wait for all `world` rank slots and rank 0's store
    address; returns (ticket -> node address, the store's host:port), or None when the
    job ended meanwhile. Rank 0 publishes the address of the TCPStore it will host."""
    store.join(job_id, attempt, rank, me.address)
    if rank == 0:
        store.publish_store_address(job_id, attempt, f"{me.host}:{store_port(me.host)}")
    deadline = time.monotonic() + float(rec.get("rendezvous_s", 60))
    while True:
        joined = store.joined(job_id, attempt)
        address = store.store_address(job_id, attempt)
        if len(joined) >= world and address:
            return joined, address
        if store.state(job_id) in TERMINAL:
            return None
        if time.monotonic() > deadline:
            raise JobError(f"rendezvous timed out: the job needs {world} rank slots, "
                           f"{len(joined)} joined within {rec.get('rendezvous_s', 60)} s")
        time.sleep(POLL_S)


def elastic_rendezvous(store: JobStore, job_id: str, ticket: int, attempt: int, rec: Mapping[str, Any],
                       me: NodeIdentity, shape: tuple[int, int, int]) -> tuple[World, str | None] | None:
    """An elastic job's rendezvous (module docstring) for a job of `shape` (R, S,
    min_replicas): (the first world, rank 0's store address), with no address when this
    ticket is a spare; None when the job ended meanwhile."""
    R, S, least = shape
    store.join(job_id, attempt, ticket, me.address)
    timeout = float(rec.get("rendezvous_s", 60))
    deadline = time.monotonic() + timeout
    while (world := formed(store, job_id, attempt)) is None:
        joined = store.joined(job_id, attempt)
        if len(joined) >= R * S:
            _form(store, job_id, attempt, replica_aligned(joined, R, S), joined)
            continue
        if store.state(job_id) in TERMINAL:
            return None
        if time.monotonic() > deadline:
            order = complete_replicas(joined, R, S)
            if len(order) < least * S:
                raise JobError(f"rendezvous timed out: the job needs {R * S} rank slots (at least {least * S} for "
                               f"min_replicas = {least}), {len(joined)} joined within {timeout:g} s, "
                               f"{len(order) // S} complete replica(s)")
            _form(store, job_id, attempt, order, joined)
            continue
        time.sleep(POLL_S)
    if ticket not in world.order:
        return world, None
    if world.order[0] == ticket:
        store.publish_store_address(job_id, attempt, f"{me.host}:{store_port(me.host)}")
    deadline = time.monotonic() + EPOCH_WAIT_S
    while (address := store.store_address(job_id, attempt)) is None:
        if store.state(job_id) in TERMINAL:
            return None
        if time.monotonic() > deadline:
            raise JobError(f"rendezvous: rank 0 (ticket {world.order[0]}) never published its store address")
        time.sleep(POLL_S)
    return world, address
