#!/usr/bin/env python
"""The job queue's scheduling overhead: one job run by `dlx train` and through the queue.

    .venv/bin/python scripts/bench_queue.py [--job examples/tiny.toml] [--steps 3] [--repeat 1] [--json]
    .venv/bin/python scripts/bench_queue.py --concurrent 8 [--shape 1x1] [--workers 2 --slots 2] [--steps 2]

In one invocation it starts its own queue stack (redis-server, anvil, one staked worker
node per replica with one slot per stage; stopped by PID at the end), then runs the same
job (the job file with `[outer] steps` overridden) `--repeat` times each way, alternating:

- train: what `dlx train` runs (`workers.run.local.run_job`): its own anvil, contracts,
  stakes, R x S local processes;
- queue: what `dlx submit` runs (`workers.cli.jobs.submit_job`), then the job record in
  Redis is polled (every 20 ms) for the first inner step and the end.

For each it reports the time from submit (the call) to the first inner step that a rank
reports, and the total wall time to the last committed step; then the queue/train ratio of
the medians. Target: queue total <= 1.1x train total.

`--concurrent N` measures a loaded stack instead: N copies of the job submitted at once to
one stack of `--workers` x `--slots` (a step is committed by the key of the worker running the
job's rank 0, so each key commits for several jobs at once), then jobs per minute (N over the
time from the first submit to the last completion) and the commit latency of every step of
every job, p50 and p95: from the step's report to rank 0 to its commit confirmed on chain
(the job record's `commit_s`, which includes storing the step's blocks).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_train(job_path: Path, run_dir: Path) -> dict[str, float]:
    from workers.run.jobfile import load_job_file
    from workers.run.local import Callbacks, run_job

    job = load_job_file(job_path)
    first: list[float] = []
    t0 = time.perf_counter()

    def progress(p: object) -> None:
        if not first:
            first.append(time.perf_counter())

    run_job(job, job_path, run_dir, None, Callbacks(progress=progress))
    return {"first_inner_s": first[0] - t0, "total_s": time.perf_counter() - t0}


def run_queue(stack_dir: Path, job_path: Path) -> dict[str, float]:
    from workers.cli.jobs import submit_job
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack_dir).redis_url))
    t0 = time.perf_counter()
    job = submit_job(stack_dir, job_path)
    key = store.key(job)
    first = None
    while True:
        inner, state = store.r.hmget(key, "inner_step", "state")
        now = time.perf_counter()
        if first is None and inner is not None and json.loads(inner):
            first = now
        if json.loads(state) in ("completed", "failed", "cancelled"):
            break
        time.sleep(0.02)
    rec = store.get(job)
    if rec["state"] != "completed":
        raise SystemExit(f"queued job {job} ended {rec['state']}: {rec.get('error')}")
    return {"first_inner_s": (first or now) - t0, "total_s": now - t0}


def run_concurrent(stack_dir: Path, job_path: Path, n: int) -> dict[str, object]:
    """Submit `n` copies of the job at once; wait for all; the throughput and commit latencies."""
    from workers.cli.jobs import submit_job
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack_dir).redis_url))
    t0 = time.perf_counter()
    jobs = [submit_job(stack_dir, job_path) for _ in range(n)]
    ended: dict[str, float] = {}
    while len(ended) < n:
        for job in jobs:
            if job not in ended and store.get(job)["state"] in ("completed", "failed", "cancelled"):
                ended[job] = time.perf_counter() - t0
        time.sleep(0.1)
    records = [store.get(job) for job in jobs]
    bad = [f"{j}: {r['state']} {r.get('error') or ''}" for j, r in zip(jobs, records, strict=True)
           if r["state"] != "completed"]
    if bad:
        raise SystemExit("concurrent jobs did not complete: " + "; ".join(bad))
    commits = sorted(v["commit_s"] for r in records for k, v in r.items()
                     if k.startswith("step_") and isinstance(v, dict) and "commit_s" in v)
    wall = max(ended.values())
    return {"jobs": n, "wall_s": wall, "jobs_per_min": 60 * n / wall, "steps": len(commits),
            "commit_p50_s": statistics.median(commits),
            "commit_p95_s": commits[min(len(commits) - 1, round(0.95 * (len(commits) - 1)))]}


def concurrent_main(args: argparse.Namespace, job_path: Path, tmp: str) -> None:
    from workers.queue.stack import down, up
    from workers.run.jobfile import load_job_file

    job = load_job_file(job_path)
    stack_dir = Path(tmp) / "stack"
    up(stack_dir, workers=args.workers, slots=args.slots)
    try:
        _warm_workers(stack_dir, args.workers)
        res = run_concurrent(stack_dir, job_path, args.concurrent)
    finally:
        down(stack_dir)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{job.name} ({args.job.name}): {job.parallel.replicas} replicas x {job.parallel.stages} stages, "
          f"{args.steps} outer x {job.outer.inner_steps} inner steps; {args.concurrent} jobs submitted at once "
          f"to one stack of {args.workers} workers x {args.slots} slots\n")
    print("| jobs | wall s | jobs / min | steps committed | commit p50 s | commit p95 s |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {res['jobs']} | {res['wall_s']:.1f} | {res['jobs_per_min']:.2f} | {res['steps']} | "
          f"{res['commit_p50_s']:.2f} | {res['commit_p95_s']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=ROOT / "examples" / "tiny.toml")
    ap.add_argument("--steps", type=int, default=3, help="outer steps (overrides the job file)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each way, alternating")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--concurrent", type=int, default=0, metavar="N",
                    help="submit N copies at once to one stack instead (jobs per minute, commit latency)")
    ap.add_argument("--workers", type=int, default=2, help="--concurrent: the stack's workers")
    ap.add_argument("--slots", type=int, default=2, help="--concurrent: rank slots per worker")
    ap.add_argument("--shape", default=None, metavar="RxS",
                    help="replicas x stages (overrides the job file's [parallel] replicas and stages)")
    args = ap.parse_args()

    from workers.queue.stack import down, up
    from workers.run.jobfile import load_job_file

    with tempfile.TemporaryDirectory(prefix="bench-queue-") as tmp:
        job_path = Path(tmp) / "job.toml"
        text, n = re.subn(r"(?m)^steps\s*=\s*\d+", f"steps = {args.steps}", args.job.read_text(), count=1)
        if n != 1:
            raise SystemExit(f"{args.job}: no `steps = N` line in [outer] to override")
        if args.shape:
            replicas, stages = args.shape.lower().split("x")
            text = re.sub(r"(?m)^replicas\s*=\s*\d+", f"replicas = {int(replicas)}", text, count=1)
            text = re.sub(r"(?m)^stages\s*=\s*\d+", f"stages = {int(stages)}", text, count=1)
        job_path.write_text(text)
        if args.concurrent:
            concurrent_main(args, job_path, tmp)
            return
        job = load_job_file(job_path)
        stack_dir = Path(tmp) / "stack"
        t0 = time.perf_counter()
        up(stack_dir, workers=job.parallel.replicas, slots=job.parallel.stages)
        up_s = time.perf_counter() - t0
        rows: dict[str, list[dict[str, float]]] = {"train": [], "queue": []}
        try:
            _warm_workers(stack_dir, job.parallel.replicas)
            for i in range(args.repeat):
                rows["train"].append(run_train(job_path, Path(tmp) / f"train-{i}"))
                rows["queue"].append(run_queue(stack_dir, job_path))
        finally:
            down(stack_dir)

    med = {k: {m: statistics.median(r[m] for r in v) for m in ("first_inner_s", "total_s")} for k, v in rows.items()}
    ratio = {m: med["queue"][m] / med["train"][m] for m in ("first_inner_s", "total_s")}
    shape = (f"{job.name} ({args.job.name}): {job.parallel.replicas} replicas x {job.parallel.stages} stages, "
             f"{args.steps} outer x {job.outer.inner_steps} inner steps, {args.repeat} run(s) each")
    if args.json:
        print(json.dumps({"job": shape, "stack_up_s": up_s, "runs": rows, "median": med, "ratio": ratio}, indent=2))
        return
    print(shape + " (medians, range in brackets)" * (args.repeat > 1))
    print(f"queue stack up (redis, anvil, {job.parallel.replicas} workers; once, not in the rows): {up_s:.1f} s\n")
    def cell(way: str, metric: str) -> str:
        values = [r[metric] for r in rows[way]]
        spread = f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
        return f"{med[way][metric]:.1f}{spread}"

    print("| way | submit -> first inner step s | total s |")
    print("|---|---:|---:|")
    for way in ("train", "queue"):
        print(f"| {way} | {cell(way, 'first_inner_s')} | {cell(way, 'total_s')} |")
    print(f"| queue / train | {ratio['first_inner_s']:.2f}x | {ratio['total_s']:.2f}x |")
    print(f"\ntarget: queue total <= 1.1x train total: {'met' if ratio['total_s'] <= 1.1 else 'missed'}")


def _warm_workers(stack_dir: Path, count: int, timeout_s: float = 120.0) -> None:
    """Wait until every worker answers (they import torch at start), as a running stack would."""
    from workers.queue.app import make_app
    from workers.queue.stack import Stack

    app = make_app(Stack.load(stack_dir).redis_url)
    deadline = time.monotonic() + timeout_s
    while len(app.control.ping(timeout=1.0) or []) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"the stack's {count} workers did not answer within {timeout_s:.0f} s")


if __name__ == "__main__":
    main()
