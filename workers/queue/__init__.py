"""The job queue: the Celery app and its rank and replay tasks, job records in Redis, the
rendezvous and elastic membership of a job's ranks, a worker node's identity, replay
verification over the `verify` queue, and the local stack (`dlx up`/`dlx down`)."""
