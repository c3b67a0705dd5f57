"""The Celery application: Redis as broker and result backend, three queues.

    jobs    job-level work (coordination, bookkeeping)
    train   one task per rank of a training job (R x S per job)
    verify  verification replays fanned out to workers

Tasks live in `workers.tasks`. They are idempotent (keyed by job, attempt and rank, and
commits by run and step), so `acks_late` with redelivery cannot double-commit a step.
The broker URL comes from `DLX_REDIS_URL` (default redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import os

from celery import Celery
from kombu import Queue

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def redis_url() -> str:
    return os.environ.get("DLX_REDIS_URL", DEFAULT_REDIS)


def make_app(url: str | None = None) -> Celery:
    url = url or redis_url()
    app = Celery("dlx", broker=url, backend=url, include=["workers.tasks"])
    app.conf.update(
        task_queues=[Queue("jobs"), Queue("train"), Queue("verify")],
        task_default_queue="jobs",
        task_routes={
            "workers.tasks.run_rank": {"queue": "train"},
            "workers.tasks.replay": {"queue": "verify"},
        },
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        result_extended=True,
        result_expires=7 * 24 * 3600,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 6 * 3600},
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app


app = make_app()
