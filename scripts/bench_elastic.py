#!/usr/bin/env python
"""What losing a replica costs an elastic job: the same job undisturbed and with one
worker killed (SIGKILL) mid-round, side by side, on one local queue stack.

    .venv/bin/python scripts/bench_elastic.py [--job examples/elastic.toml] [--seeds 0 1 2] [--kill-step 2] [--json]

The script starts its own stack (redis-server, anvil, one staked worker node per replica
with one slot per stage; stopped by PID at the end) and, for each seed, runs the job twice
through the queue (`workers.cli.jobs.submit_job`): undisturbed, then with the worker of the
last replica killed once step `--kill-step` is committed and the next round has run a
quarter of its inner steps (a new worker with the lost node's key is started right after,
so the job can grow back). The job record in Redis is polled every 20 ms.

Per seed it reports, for the disturbed run: the time from the kill to the next committed
step, against the round's compute time (the run's `compute_s` over its steps) and against
the undisturbed run's step interval (commit to commit), the steps lost (steps the job did
not commit: target 0), the steps trained by fewer replicas, the step it grew back at; and
both runs' final held-out eval loss. Then the means with their standard deviations over
seeds, and the targets: recovery <= 1.5 rounds, 0 steps lost.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TERMINAL = ("completed", "failed", "cancelled")


def _with_seed(text: str, seed: int, name: str) -> str:
    text = re.sub(r"(?m)^seed\s*=\s*\d+", f"seed = {seed}", text, count=1)
    return re.sub(r'(?m)^name\s*=\s*"[^"]*"', f'name = "{name}"', text, count=1)


class Poller:
    """A job's record, polled; the wall time at which each step was first seen committed."""

    def __init__(self, store, job: str) -> None:
        self.store, self.job = store, job
        self.seen: dict[int, float] = {}

    def poll(self) -> dict:
        rec = self.store.get(self.job)
        now = time.perf_counter()
        step = int(rec.get("step") or 0)
        for t in range(1, step + 1):
            self.seen.setdefault(t, now)
        return rec

    def until(self, pred, timeout: float = 1800.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            rec = self.poll()
            if pred(rec):
                return rec
            if rec["state"] in TERMINAL or time.monotonic() > deadline:
                raise SystemExit(f"job {self.job} ended {rec['state']} before the benchmark's point: {rec.get('error')}")
            time.sleep(0.02)


def run_once(stack_dir: Path, job_path: Path, kill_step: int | None) -> dict:
    from workers.cli.jobs import submit_job
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack_dir).redis_url))
    job = submit_job(stack_dir, job_path, collective_timeout_s=20.0)
    poller = Poller(store, job)
    out: dict = {"job": job}
    if kill_step is not None:
        rec = poller.until(lambda r: int(r.get("step") or 0) >= kill_step and int(r.get("outer_step") or 0) > kill_step
                           and int(r.get("inner_step") or 0) >= max(1, int(r["inner_steps"]) // 4))
        victim = _worker_of(stack_dir, rec, max(int(r) for r in rec["member_nodes"]))
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.perf_counter()
        before = int(store.get(job).get("step") or 0)
        _restart(stack_dir, victim)
        poller.until(lambda r: int(r.get("step") or 0) > before)
        out.update(kill_step=before, recovery_s=poller.seen[before + 1] - killed_at)
    rec = poller.until(lambda r: r["state"] in TERMINAL)
    if rec["state"] != "completed":
        raise SystemExit(f"job {job} ended {rec['state']}: {rec.get('error')}")
    T = int(rec["outer_steps"])
    final = rec.get(f"step_{T}") or rec
    out.update(eval_loss=float(final["eval_loss"]), steps=T, run_dir=rec["run_dir"],
               intervals=[poller.seen[t + 1] - poller.seen[t] for t in range(1, T) if t + 1 in poller.seen])
    out.update(_from_lineage(rec))
    return out


def _from_lineage(rec: dict) -> dict:
    """Steps committed on chain, each step's replica set, and the mean compute time of a round."""
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from lineage.chain.runrecord import RunRecord
    from lineage.store.manifest import get_manifest

    ledger = Ledger(Chain(rec["rpc"]), rec["registry"], rec["ledger"])
    committed = [c.record.step for c in ledger.commits(int(rec["run_id"]))]
    run_dir = Path(rec["run_dir"])
    record = RunRecord.load(run_dir)
    store = record.open_store(run_dir)
    m = get_manifest(store, record.head)
    sets = []
    while m.parent is not None:
        sets.append(list(getattr(m, "replicas", None) or range(int(rec["replicas"]))))
        m = get_manifest(store, m.parent)
    sets.reverse()
    timings = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    compute = max(t.get("compute_s", 0.0) for t in timings) / max(1, len(sets))
    return {"committed": committed, "sets": sets, "round_compute_s": compute}


def _worker_of(stack_dir: Path, rec: dict, replica: int) -> dict:
    info = json.loads((stack_dir / "stack.json").read_text())
    (node,) = set(rec["member_nodes"][str(replica)])
    return next(w for w in info["workers"] if w["node"] == node)


def _restart(stack_dir: Path, victim: dict) -> None:
    from lineage.chain.anvil import dev_accounts
    from workers.queue.stack import Stack, _spawn

    s = Stack.load(stack_dir)
    key = next(k for k in dev_accounts(16) if k.address == victim["node"])
    pid = _spawn([sys.executable, "-m", "workers.cli", "worker", "--slots", str(victim["slots"])],
                 stack_dir / "logs" / f"worker-returned-{int(time.time())}.log", s.worker_env(key.key.hex(), victim["slots"]))
    info = json.loads((stack_dir / "stack.json").read_text())
    next(w for w in info["workers"] if w["node"] == victim["node"])["pid"] = pid
    (stack_dir / "stack.json").write_text(json.dumps(info))


def _mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ({sd:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", type=Path, default=ROOT / "examples" / "elastic.toml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--kill-step", type=int, default=2, help="kill once this step is committed")
    ap.add_argument("--work", type=Path, help="keep the stack and runs here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from workers.queue.stack import down, up
    from workers.run.jobfile import load_job_file

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-elastic-") as scratch:
        tmp = str(args.work or scratch)
        Path(tmp).mkdir(parents=True, exist_ok=True)
        job = load_job_file(args.job)
        stack_dir = Path(tmp) / "stack"
        up(stack_dir, workers=job.parallel.replicas, slots=job.parallel.stages)
        try:
            for seed in args.seeds:
                paths = {}
                for way in ("undisturbed", "killed"):
                    paths[way] = Path(tmp) / f"{way}-{seed}.toml"
                    paths[way].write_text(_with_seed(args.job.read_text(), seed, f"{job.name}-{way}-{seed}"))
                calm = run_once(stack_dir, paths["undisturbed"], None)
                hit = run_once(stack_dir, paths["killed"], args.kill_step)
                rows.append({"seed": seed, "undisturbed": calm, "killed": hit})
        finally:
            down(stack_dir)
    _print(args, job, rows)


def _print(args, job, rows: list[dict]) -> None:
    R, S, H = job.parallel.replicas, job.parallel.stages, job.outer.inner_steps
    table = []
    for row in rows:
        calm, hit = row["undisturbed"], row["killed"]
        interval = statistics.median(calm["intervals"]) if calm["intervals"] else float("nan")
        small = [t + 1 for t, s in enumerate(hit["sets"]) if len(s) < R]
        grown = next((t + 1 for t, s in enumerate(hit["sets"]) if small and t + 1 > small[-1]), None)
        table.append({
            "seed": row["seed"], "kill_step": hit["kill_step"], "recovery_s": hit["recovery_s"],
            "round_compute_s": hit["round_compute_s"], "step_interval_s": interval,
            "recovery_rounds": hit["recovery_s"] / hit["round_compute_s"],
            "overhead_s": hit["recovery_s"] - hit["round_compute_s"],
            "recovery_intervals": hit["recovery_s"] / interval,
            "steps_lost": hit["steps"] - len(set(hit["committed"])), "smaller_steps": small, "grown_at": grown,
            "eval_undisturbed": calm["eval_loss"], "eval_killed": hit["eval_loss"],
            "eval_ratio": hit["eval_loss"] / calm["eval_loss"],
        })
    if args.json:
        print(json.dumps({"job": str(args.job), "rows": table}, indent=2))
        return
    print(f"{job.name} ({args.job.name}): {R} replicas x {S} stages, min_replicas {job.parallel.min_replicas}, "
          f"{job.outer.steps} outer x {H} inner steps; the last replica's worker killed after step {args.kill_step}")
    print("\n| seed | kill after step | kill -> next commit s | round compute s | x round | beyond a round s "
          "| undisturbed step interval s | x interval | steps lost | steps with fewer replicas | full again at "
          "| eval undisturbed | eval killed | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in table:
        print(f"| {r['seed']} | {r['kill_step']} | {r['recovery_s']:.1f} | {r['round_compute_s']:.1f} | "
              f"{r['recovery_rounds']:.2f} | {r['overhead_s']:.1f} | {r['step_interval_s']:.1f} | {r['recovery_intervals']:.2f} | "
              f"{r['steps_lost']} | {','.join(map(str, r['smaller_steps'])) or '-'} | {r['grown_at'] or '-'} | "
              f"{r['eval_undisturbed']:.4f} | {r['eval_killed']:.4f} | {r['eval_ratio']:.4f} |")
    col = {k: [r[k] for r in table] for k in ("recovery_rounds", "overhead_s", "recovery_intervals", "eval_undisturbed",
                                               "eval_killed", "eval_ratio")}
    print(f"\nmean (sd) over {len(table)} seed(s): recovery {_mean_sd(col['recovery_rounds'])} rounds of compute "
          f"({_mean_sd(col['overhead_s'])} s beyond the round redone), "
          f"{_mean_sd(col['recovery_intervals'])} undisturbed step intervals; eval undisturbed "
          f"{_mean_sd(col['eval_undisturbed'])}, killed {_mean_sd(col['eval_killed'])}, ratio {_mean_sd(col['eval_ratio'])}")
    lost = sum(r["steps_lost"] for r in table)
    worst = max(col["recovery_rounds"])
    print(f"targets: recovery <= 1.5 rounds (worst seed {worst:.2f} rounds): {'met' if worst <= 1.5 else 'missed'}; "
          f"steps lost 0 (total {lost}): {'met' if lost == 0 else 'missed'}")


if __name__ == "__main__":
    main()
