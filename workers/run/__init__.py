"""One job and one run of it, wherever it runs: the job file, the local runner (`dlx
train`), the StepSink that stores and commits each outer step, metrics tracking, and the
cost model behind `dlx plan`. The job queue's rank tasks run through the same pieces."""
