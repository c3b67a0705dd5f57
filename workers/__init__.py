"""Workers: the composition root. Wires the trainer to storage and the ledger, runs jobs
locally (`dlx train`) and, later, through Celery workers; hosts the `dlx` CLI."""
