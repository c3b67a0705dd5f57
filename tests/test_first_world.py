"""The first world of a queued job (workers/queue/rendezvous.py) against a real redis-server:
an elastic job whose tickets are not all taken within the rendezvous timeout starts with
the complete replicas that came (at least min_replicas), in replica ids 0..k-1, with the
slot-0 ticket publishing the store address; a ticket taken later is a spare (a joiner);
too few complete replicas fail the job as before; a world that completes forms at once."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from pathlib import Path

import pytest
from eth_account import Account

from lineage.chain.anvil import free_port
from workers.queue.jobs import JobError, JobStore, connect
from workers.queue.node import NodeIdentity
from workers.queue.rendezvous import (
    complete_replicas,
    elastic_rendezvous,
    formed,
    replica_aligned,
    spare_ticket,
)
from workers.queue.stack import _wait_redis, start_redis


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d: Path = tmp_path_factory.mktemp("rdzv")
    port, password = free_port("127.0.0.1"), secrets.token_hex(8)
    pid = start_redis(d, "127.0.0.1", port, password)
    try:
        url = f"redis://:{password}@127.0.0.1:{port}/0"
        _wait_redis(url)
        yield JobStore(connect(url))
    finally:
        os.kill(pid, signal.SIGTERM)


NODES = [Account.create() for _ in range(4)]


def _job(store: JobStore, rendezvous_s: float) -> tuple[str, dict]:
    job_id = store.create({"rendezvous_s": rendezvous_s, "world": 3})
    return job_id, store.get(job_id)


def _meet(store: JobStore, job_id: str, rec: dict, tickets: dict[int, int], shape=(3, 1, 2)) -> dict[int, object]:
    """Tickets (ticket -> node index) rendezvous at once, each in a thread: ticket -> its
    result (or the exception it raised)."""
    out: dict[int, object] = {}

    def one(ticket: int, node: int) -> None:
        try:
            out[ticket] = elastic_rendezvous(store, job_id, ticket, 1, rec, NodeIdentity(NODES[node], "127.0.0.1"),
                                             shape)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[ticket] = exc

    threads = [threading.Thread(target=one, args=(t, n)) for t, n in tickets.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out


def test_complete_replicas_keeps_only_replicas_with_every_stage():
    a, b, c = (n.address for n in NODES[:3])
    assert complete_replicas({0: a, 1: a, 2: b}, 3, 2) == [0, 1]  # b's one ticket makes no replica
    assert complete_replicas({1: b, 2: c}, 3, 1) == [1, 2]
    assert complete_replicas({0: a, 1: b, 2: c, 3: a}, 2, 2) == replica_aligned({0: a, 1: b, 2: c, 3: a}, 2, 2)


def test_two_of_three_tickets_start_after_the_timeout_and_the_third_is_a_spare(store):
    job_id, rec = _job(store, rendezvous_s=1.5)
    t0 = time.monotonic()
    out = _meet(store, job_id, rec, {0: 0, 1: 1})
    assert time.monotonic() - t0 >= 1.5  # it waited for the third ticket first
    world0, address0 = out[0]
    world1, address1 = out[1]
    assert world0 == world1 and world0.order == [0, 1]
    assert world0.nodes == [NODES[0].address, NODES[1].address]
    assert address0 == address1 == store.store_address(job_id, 1)
    late = _meet(store, job_id, rec, {2: 2})[2]
    assert late == (world0, None)  # left out: it joins at a growth boundary
    assert spare_ticket(store, job_id, 1, 2) and not spare_ticket(store, job_id, 1, 0)


def test_without_ticket_zero_the_first_complete_replica_hosts_the_store(store):
    job_id, rec = _job(store, rendezvous_s=1.0)
    out = _meet(store, job_id, rec, {1: 1, 2: 2})
    world, address = out[1]
    assert world.order == [1, 2] and out[2] == (world, address)
    assert address == store.store_address(job_id, 1)


def test_fewer_than_min_replicas_fail_the_rendezvous_naming_the_numbers(store):
    job_id, rec = _job(store, rendezvous_s=1.0)
    out = _meet(store, job_id, rec, {0: 0})
    assert isinstance(out[0], JobError)
    assert str(out[0]).startswith("rendezvous timed out: the job needs 3 rank slots (at least 2 for "
                                  "min_replicas = 2), 1 joined within 1 s"), out[0]
    assert formed(store, job_id, 1) is None


def test_a_stage_short_replica_is_left_out_and_its_ticket_is_a_spare(store):
    job_id, rec = _job(store, rendezvous_s=1.0)  # 3 x 2, min 1: node 0 holds two tickets, node 1 one
    out = _meet(store, job_id, rec, {0: 0, 3: 0, 4: 1}, shape=(3, 2, 1))
    world, address = out[0]
    assert world.order == [0, 3] and out[3] == (world, address) and out[4] == (world, None)


def test_a_complete_world_forms_at_once(store):
    job_id, rec = _job(store, rendezvous_s=60.0)
    t0 = time.monotonic()
    out = _meet(store, job_id, rec, {0: 0, 1: 1, 2: 2})
    assert time.monotonic() - t0 < 30
    assert {t: r[0].order for t, r in out.items()} == {t: [0, 1, 2] for t in range(3)}  # type: ignore[index]
    assert not any(spare_ticket(store, job_id, 1, t) for t in range(3))
