"""Workers: the composition root. Wires the trainer to storage and the ledger, runs jobs
locally (`dlx train`) and through Celery workers; hosts the `dlx` CLI.

    run/     a job: its file, its local run, the step sink, metrics tracking, its cost plan
    queue/   the job queue: Celery app and tasks, job records, rendezvous, membership, stack
    cli/     the `dlx` commands, one module per group, and how they print

`cli` imports `queue` and `run`, `queue` imports `run`, `run` imports neither."""
