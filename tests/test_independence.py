"""Queued ranks placed so that each node's slots lie in one replica: the ledger's
independence rule (`[chain] independence`) with multi-slot workers (workers.queue.tasks)."""

from __future__ import annotations

import itertools

from workers.queue.tasks import replica_aligned


def _replicas_of(order: list[int], joined: dict[int, str], stages: int) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for rank, ticket in enumerate(order):
        out.setdefault(joined[ticket], set()).add(rank // stages)
    return out


def test_two_workers_of_two_slots_each_get_one_replica_each_whatever_tickets_they_took():
    for tickets_a in itertools.combinations(range(4), 2):
        joined = {t: ("A" if t in tickets_a else "B") for t in range(4)}
        order = replica_aligned(joined, 2, 2)
        assert sorted(order) == [0, 1, 2, 3] and order[0] == 0  # ticket 0 keeps rank 0
        assert all(len(r) == 1 for r in _replicas_of(order, joined, 2).values()), (joined, order)


def test_one_slot_workers_keep_their_queue_order_and_mixed_sizes_pack_largest_first():
    joined = {t: f"n{t}" for t in range(6)}
    assert replica_aligned(joined, 3, 2) == list(range(6))
    joined = {0: "x", 1: "big", 2: "big", 3: "big", 4: "y", 5: "z"}  # 2 x 3: big fills replica 1
    order = replica_aligned(joined, 2, 3)
    assert order[0] == 0 and order[3:] == [1, 2, 3]
    assert all(len(r) == 1 for r in _replicas_of(order, joined, 3).values())


def test_a_node_with_more_slots_than_a_replica_has_stages_spills_over():
    joined = {0: "a", 1: "a", 2: "a", 3: "b"}
    order = replica_aligned(joined, 2, 2)
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 0
    assert _replicas_of(order, joined, 2)["a"] == {0, 1}  # the ledger will refuse it, naming a
