"""Benchmark the verifier: how long `dlx verify` (levels 1-3: chain, content, aggregate)
takes per 100 outer steps of examples/tiny.toml, and how long a replay (level 4) of one
replica's round takes against the time that round took in training.

    .venv/bin/python scripts/bench_verify.py                 # 100 outer steps, then the replay part
    .venv/bin/python scripts/bench_verify.py --quick --json  # 20 steps, 2 replayed rounds
    .venv/bin/python scripts/bench_verify.py --work runs/bench-verify   # keep (and reuse) the runs

Part 1 trains tiny.toml's model (2 replicas x 2 stages, d=128, 4 layers) for --steps outer
steps with `inner_steps` lowered to --inner-steps (default 1): what levels 1-3 check per
step (a commit transaction, its signatures and stakes; the manifest, shards and
contributions; the outer step recomputed) does not depend on H, so the shorter rounds
only shorten the training. It then times the `dlx verify` command (process start-up
included) and `lineage.audit.verify.verify_run` in process, once with no level (start the
chain from its state file, read the run's events: the fixed cost) and once per level, so
each level's own cost is the difference (levels 2 and 3 run in one forked worker a core,
level 1 in the calling process meanwhile; CPU seconds include the workers'). Target:
levels 1-3 under 10 s per 100 steps.

Part 2 trains tiny.toml with its real inner_steps (20) for a few steps and replays
replica 0's rounds with `lineage.audit.replay.replay_many` (one launch). Each round's replay
time (slowest stage, launch excluded) is compared with the same round's compute time in
training (`compute_s` in the run's timings.jsonl: the slowest rank's inner steps, the
difference of the cumulative clock). Target: replay <= 1.2x. Training ran R x S = 4
processes on the machine's cores, a replay S = 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DLX = str(Path(sys.executable).parent / "dlx")
TINY = ROOT / "examples" / "tiny.toml"
TARGET_PER_100 = 10.0
TARGET_REPLAY_X = 1.2


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def job_toml(name: str, steps: int, inner_steps: int | None) -> str:
    """examples/tiny.toml with another name, T and (optionally) H."""
    text = TINY.read_text()
    subs = [(r'(?m)^name = ".*"$', f'name = "{name}"'), (r"(?m)^steps = \d+$", f"steps = {steps}")]
    if inner_steps is not None:
        subs.append((r"(?m)^inner_steps = \d+$", f"inner_steps = {inner_steps}"))
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text)
        if n != 1:
            raise SystemExit(f"examples/tiny.toml changed shape: {pattern!r} matched {n} times")
    return text


def train(work: Path, name: str, steps: int, inner_steps: int | None) -> tuple[Path, float | None]:
    """Train (or reuse, when `work` already holds the same finished job) a run; returns the
    run directory and the training wall time (None when reused)."""
    job = job_toml(name, steps, inner_steps)
    run_dir = work / name
    record = run_dir / "run.json"
    ran = run_dir / "job.toml"
    if record.exists() and ran.exists() and tomllib.loads(ran.read_text()) == tomllib.loads(job) \
            and json.loads(record.read_text()).get("status") == "completed":
        _say(f"reusing {run_dir}")
        return run_dir, None
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists and is not a finished run of this job: remove it")
    work.mkdir(parents=True, exist_ok=True)
    job_file = work / f"{name}.toml"
    job_file.write_text(job)
    _say(f"training {name}: {steps} outer steps x {inner_steps or 'tiny.toml'} inner steps ...")
    t = time.perf_counter()
    res = subprocess.run([DLX, "train", str(job_file), "--run-dir", str(run_dir)], capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"dlx train failed ({res.returncode}): {res.stderr[-2000:]}")
    return run_dir, seconds


def bench_levels(run_dir: Path, repeat: int) -> dict[str, Any]:
    """Seconds for `dlx verify` and for verify_run per level (best of `repeat`)."""
    from lineage.audit.verify import LEVELS, verify_run

    def best(fn: Any) -> tuple[float, float, Any]:
        """(wall s, CPU s, result) of the fastest of `repeat` runs. CPU seconds count this
        process's threads and the children it waited for (the `dlx` process, anvil): what
        the work costs whatever else the machine is doing."""
        runs = []
        for _ in range(repeat):
            t, c = time.perf_counter(), _cpu()
            out = fn()
            runs.append((time.perf_counter() - t, _cpu() - c, out))
        return min(runs, key=lambda r: r[0])

    cli_s, cli_cpu, res = best(lambda: subprocess.run([DLX, "verify", "--run-dir", str(run_dir), "--json"],
                                                      capture_output=True, text=True))
    if res.returncode != 0:
        raise SystemExit(f"dlx verify failed ({res.returncode}): {res.stdout[-1500:]} {res.stderr[-1500:]}")
    steps = len(json.loads(res.stdout)["steps"])

    t, c = time.perf_counter(), _cpu()
    import trainer.diloco  # noqa: F401  (level 3's math: torch; imported once per process)
    import_s, import_cpu = time.perf_counter() - t, _cpu() - c
    fixed_s, fixed_cpu, _ = best(lambda: verify_run(run_dir, levels=()))
    per_level = {}
    for level in LEVELS:
        s, cpu, report = best(lambda level=level: verify_run(run_dir, levels=(level,)))
        if not report.ok:
            raise SystemExit(f"level {level} failed on an honest run: {report.as_json()}")
        per_level[level] = (s, cpu)
    all_s, all_cpu, report = best(lambda: verify_run(run_dir))
    if not report.ok or len(report.steps) != steps:
        raise SystemExit(f"verify_run failed on an honest run: {report.as_json()}")
    per100 = 100 / steps
    return {
        "steps": steps, "cli_s": cli_s, "cli_cpu_s": cli_cpu, "cli_s_per_100": cli_s * per100,
        "cli_cpu_s_per_100": cli_cpu * per100,
        "in_process_s": all_s, "in_process_cpu_s": all_cpu, "in_process_s_per_100": all_s * per100,
        "fixed_s": fixed_s, "fixed_cpu_s": fixed_cpu, "torch_import_s": import_s, "torch_import_cpu_s": import_cpu,
        "levels": {lv: {"s": s, "cpu_s": cpu, "own_s": max(s - fixed_s, 0.0), "own_cpu_s": max(cpu - fixed_cpu, 0.0),
                        "own_s_per_100": max(s - fixed_s, 0.0) * per100}
                   for lv, (s, cpu) in per_level.items()},
        "load_avg_1min": os.getloadavg()[0], "cpus": os.cpu_count(),
        "target_s_per_100": TARGET_PER_100, "met": cli_s * per100 < TARGET_PER_100,
    }


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_replay(run_dir: Path) -> dict[str, Any] | None:
    """Replay every round of replica 0 in one launch; compare with training compute."""
    try:
        from lineage.audit.replay import replay_many
    except ImportError:
        return None
    from lineage.chain.runrecord import RunRecord

    timings = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    compute = {t["step"]: t["compute_s"] - (timings[i - 1]["compute_s"] if i else 0.0)
               for i, t in enumerate(timings)}
    record = RunRecord.load(run_dir)
    store = record.open_store(run_dir)
    items = [(t["checkpoint"], 0) for t in timings]
    t = time.perf_counter()
    results = replay_many(store, items, tolerance=0.0)
    wall = time.perf_counter() - t
    rounds = []
    for r in results:
        if not r.ok:
            raise SystemExit(f"replay failed on an honest run: {r.failure()}")
        rounds.append({"step": r.step, "replica": r.replica, "replay_s": r.seconds,
                       "train_compute_s": compute[r.step], "x": r.seconds / compute[r.step],
                       "exact": all(s.exact for s in r.stages)})
    replay_s = sum(r["replay_s"] for r in rounds)
    train_s = sum(r["train_compute_s"] for r in rounds)
    return {"rounds": rounds, "replay_s": replay_s, "train_compute_s": train_s, "x": replay_s / train_s,
            "launch_and_checks_s": wall - replay_s, "wall_s": wall,
            "target_x": TARGET_REPLAY_X, "met": replay_s / train_s <= TARGET_REPLAY_X}


def table(out: dict[str, Any]) -> str:
    v = out["verify"]
    per100 = 100 / v["steps"]
    lines = [
        f"examples/tiny.toml model, {v['steps']} outer steps, inner_steps {out['inner_steps']} "
        "(levels 1-3 do not depend on H); 2 replicas x 2 stages; "
        f"{v['cpus']} CPUs, load average {v['load_avg_1min']:.1f} at the end",
        "",
        "| what | wall s | wall s per 100 steps | CPU s | CPU s per 100 steps |",
        "|---|---:|---:|---:|---:|",
        f"| `dlx verify` (levels 1-3, process start-up included) | {v['cli_s']:.2f} | {v['cli_s_per_100']:.2f} "
        f"| {v['cli_cpu_s']:.2f} | {v['cli_cpu_s_per_100']:.2f} |",
        f"| verify_run in process, levels 1-3 | {v['in_process_s']:.2f} | {v['in_process_s_per_100']:.2f} "
        f"| {v['in_process_cpu_s']:.2f} | {v['in_process_cpu_s'] * per100:.2f} |",
        f"| fixed: chain from its state file, the run's events | {v['fixed_s']:.2f} | {v['fixed_s'] * per100:.2f} "
        f"| {v['fixed_cpu_s']:.2f} | {v['fixed_cpu_s'] * per100:.2f} |",
    ]
    names = {"chain": "level 1 chain (own)", "content": "level 2 content (own)", "aggregate": "level 3 aggregate (own)"}
    for lv, d in v["levels"].items():
        lines.append(f"| {names.get(lv, lv)} | {d['own_s']:.2f} | {d['own_s_per_100']:.2f} "
                     f"| {d['own_cpu_s']:.2f} | {d['own_cpu_s'] * per100:.2f} |")
    lines.append(f"| (the torch import for level 3, once per process) | {v['torch_import_s']:.2f} | "
                 f"| {v['torch_import_cpu_s']:.2f} | |")
    verdict = "met" if v["met"] else "MISSED"
    lines.append("")
    lines.append(f"target: levels 1-3 under {TARGET_PER_100:g} s per 100 outer steps: "
                 f"{v['cli_s_per_100']:.2f} s wall with `dlx verify` ({verdict}; "
                 f"{v['cli_cpu_s_per_100']:.2f} CPU s)")
    if out.get("train_s"):
        lines.append(f"(training those steps took {out['train_s']:.0f} s)")
    r = out.get("replay")
    if r is None:
        lines.append("\nreplay: lineage/audit/replay.py is not available; skipped")
    elif r != "skipped":
        lines += ["", f"replay of replica 0's rounds, tiny.toml's inner_steps ({out['replay_inner_steps']}):", "",
                  "| step | replay s | training compute s | x | bit for bit |", "|---:|---:|---:|---:|---|"]
        lines += [f"| {x['step']} | {x['replay_s']:.2f} | {x['train_compute_s']:.2f} | {x['x']:.2f} | "
                  f"{'yes' if x['exact'] else 'no'} |" for x in r["rounds"]]
        lines.append(f"| all | {r['replay_s']:.2f} | {r['train_compute_s']:.2f} | {r['x']:.2f} | |")
        lines.append(f"\nlaunch (spawn, imports, corpus) and state checks: {r['launch_and_checks_s']:.1f} s once per replay call")
        lines.append(f"target: replay <= {TARGET_REPLAY_X:g}x the round's training compute: "
                     f"{r['x']:.2f}x ({'met' if r['met'] else 'MISSED'})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="outer steps to verify (default 100; --quick 20)")
    ap.add_argument("--inner-steps", type=int, default=1, help="H for the verify run (default 1)")
    ap.add_argument("--replay-steps", type=int, default=None,
                    help="outer steps of the replay run, at tiny.toml's H (default 3; --quick 2; 0 skips)")
    ap.add_argument("--repeat", type=int, default=1, help="time each measurement this many times, keep the best")
    ap.add_argument("--quick", action="store_true", help="20 verified steps, 2 replayed rounds")
    ap.add_argument("--work", type=Path, default=None, help="keep the runs here (and reuse finished ones)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    steps = args.steps or (20 if args.quick else 100)
    replay_steps = args.replay_steps if args.replay_steps is not None else (2 if args.quick else 3)
    if steps < 1 or args.inner_steps < 1 or replay_steps < 0 or args.repeat < 1:
        ap.error("--steps, --inner-steps and --repeat must be >= 1, --replay-steps >= 0")

    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        work = args.work.resolve() if args.work else Path(tmp)
        run_dir, train_s = train(work, f"verify-{steps}x{args.inner_steps}", steps, args.inner_steps)
        _say("timing dlx verify and verify_run per level ...")
        out: dict[str, Any] = {"inner_steps": args.inner_steps, "train_s": train_s,
                               "verify": bench_levels(run_dir, args.repeat)}
        if replay_steps:
            replay_run, _ = train(work, f"replay-{replay_steps}", replay_steps, None)
            out["replay_inner_steps"] = int(re.search(r"(?m)^inner_steps = (\d+)$", TINY.read_text()).group(1))
            _say("replaying replica 0's rounds ...")
            out["replay"] = bench_replay(replay_run)
        else:
            out["replay"] = "skipped"
    print(json.dumps(out, indent=2) if args.json else table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
