"""The Celery application: Redis as broker and result backend, three queues.

    jobs    job-level work (coordination, bookkeeping)
    train   one task per rank of a training job (R x S per job)
    verify  verification replays fanned out to workers

Tasks live in `workers.queue.tasks`. They are idempotent (keyed by job, attempt and rank, and
commits by run and step), so `acks_late` with redelivery cannot double-commit a step.
The broker URL comes from `DLX_REDIS_URL` (default redis://127.0.0.1:6379/0).

A Redis restart under running tasks: the workers reconnect and the tasks run on (their
own Redis client retries; see workers.queue.jobs). kombu's Redis transport then requeues the
running tasks' messages (a redelivery the tasks' leases turn away) and acks them when the
tasks end; `RedisTransport` only keeps that from crashing the worker (below).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu import Queue
from kombu.transport import redis as kombu_redis


class _Channel(kombu_redis.Channel):
    """kombu 5.7 tears a lost connection down before closing its channel; the channel then
    restores (requeues) or acks the messages it delivered, reaching Redis through
    `connection.client`, already None: an AttributeError that stops the whole worker (an
    "Unrecoverable error") once its running tasks end. The channel keeps the connection
    parameters it was opened with, so those restores and acks reach the restarted Redis."""

    def _connparams(self, asynchronous: bool = False) -> Any:
        saved = self.__dict__.setdefault("_dlx_connparams", {})
        if self.connection.client is None and asynchronous in saved:
            return dict(saved[asynchronous])
        params = super()._connparams(asynchronous)
        saved[asynchronous] = dict(params)
        return params


class RedisTransport(kombu_redis.Transport):
    """kombu's Redis transport with the channel above (`broker_transport` for redis:// URLs)."""

    Channel = _Channel

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    return os.environ.get("DLX_REDIS_URL", DEFAULT_REDIS)


def make_app(url: str | None = None) -> Celery:
    url = url or redis_url()
    app = Celery("dlx", broker=url, backend=url, include=["workers.queue.tasks"])
    if url.startswith("redis://"):
        app.conf.broker_transport = f"{__name__}:RedisTransport"
    app.conf.update(
        task_queues=[Queue("jobs"), Queue("train"), Queue("verify")],
        task_default_queue="jobs",
        task_routes={
            "workers.queue.tasks.run_rank": {"queue": "train"},
            "workers.queue.tasks.replay": {"queue": "verify"},
        },
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        result_extended=True,
        result_expires=7 * 24 * 3600,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a worker outlives a Redis restart, however long
        # Rank tasks keep running while the broker is away (their own Redis client retries);
        # a message the broker hands out again meanwhile finds its rank's lease taken.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_transport_options={"visibility_timeout": 6 * 3600},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app


app = make_app()
