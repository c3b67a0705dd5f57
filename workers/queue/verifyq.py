"""Replay verification fanned out over the workers, through the `verify` queue.

    from workers.queue.verifyq import replay_via_queue
    results = replay_via_queue(redis_url, store_spec, [(checkpoint_cid, replica), ...],
                               tolerance=0.0, timeout=600)

Each `workers.queue.tasks.replay` task replays one chunk of (checkpoint, replica) items with
`lineage.audit.replay.replay_many` on the worker that takes it, and returns them as JSON
(`ReplicaReplay.as_json()`: no replayed bytes, no end states). The items are cut into one
chunk per worker consuming the queue: a chunk pays the replay processes' start-up once
(torch, S processes), which costs more than a small replay itself, and a node's slots
share its CPUs anyway.
A replay only reads: redelivering a task (acks_late) just replays it again.

`store_spec` names the run's store as every worker can reach it: a blockstore directory
(shared between the machines), or an IPFS daemon's RPC multiaddr (`/ip4/.../tcp/5001/http`).
"""

from __future__ import annotations

import re
from typing import Any

from .jobs import JobError, redact

_MULTIADDR = re.compile(r"^/(ip4|ip6|dns|dns4|dns6)/")


class ReplayQueueError(JobError):
    """The verify queue could not replay the items (no worker, a timeout, a worker error)."""


def open_spec(store_spec: str) -> Any:
    """The store `store_spec` names: an IPFS RPC multiaddr, else a blockstore directory."""
    from lineage.store.ipfs import open_store

    if _MULTIADDR.match(store_spec):
        return open_store(api=store_spec)
    return open_store(store_spec)


def replay_chunk(store_spec: str, items: list[tuple[str, int]], tolerance: float) -> list[dict[str, Any]]:
    """Replay `items` here (the task's body); results in item order, as JSON."""
    from lineage.audit.replay import replay_many

    store = open_spec(store_spec)
    return [r.as_json() for r in replay_many(store, [(str(c), int(r)) for c, r in items], tolerance)]


def verify_workers(app: Any, timeout_s: float = 1.0) -> list[str]:
    """The workers consuming the `verify` queue, from their own answers."""
    queues = app.control.inspect(timeout=timeout_s).active_queues() or {}
    return sorted(w for w, qs in queues.items() if any(q.get("name") == "verify" for q in qs))


def replay_via_queue(broker_url: str, store_spec: str, items: list[tuple[Any, int]], tolerance: float = 0.0,
                     timeout: float = 600.0) -> list[dict[str, Any]]:
    """Replay `items` on the workers (one task per chunk, one chunk per worker) and gather
    the results in item order. Raises ReplayQueueError when no worker consumes the `verify`
    queue, when the replays do not all finish within `timeout` seconds, or when a worker
    fails a chunk (its error is in the message)."""
    from celery import group
    from celery.exceptions import TimeoutError as CeleryTimeout

    from .app import make_app

    if not items:
        return []
    app = make_app(broker_url)
    workers = verify_workers(app)
    if not workers:
        raise ReplayQueueError(f"no worker consumes the verify queue at {redact(broker_url)}: start `dlx worker`")
    wanted = [(str(c), int(r)) for c, r in items]
    n = min(len(wanted), len(workers))
    chunks = [wanted[i::n] for i in range(n)]  # round robin: steps spread over the workers
    tasks = group(app.signature("workers.queue.tasks.replay", args=(store_spec, chunk, tolerance), queue="verify")
                  for chunk in chunks)
    pending = tasks.apply_async()
    try:
        outs = pending.get(timeout=timeout, propagate=False, disable_sync_subtasks=False)
    except CeleryTimeout:
        done = sum(len(c) for c, r in zip(chunks, pending.results, strict=True) if r.ready())
        pending.revoke()
        raise ReplayQueueError(f"verify queue: {len(wanted) - done} of {len(wanted)} replays did not finish "
                               f"within {timeout:g} s") from None
    results: list[dict[str, Any] | None] = [None] * len(wanted)
    for i, out in enumerate(outs):
        if isinstance(out, BaseException):
            raise ReplayQueueError(f"verify queue: a worker failed {len(chunks[i])} replays: "
                                   f"{type(out).__name__}: {' '.join(str(out).split())}")
        for j, res in enumerate(out):
            results[i + j * n] = res
    return [r for r in results if r is not None]
