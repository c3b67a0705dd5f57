#!/usr/bin/env python
"""Portable numerics' cost in CPU time: one inner step (4 microbatches of 2 x 128 tokens:
forward, backward, clip, AdamW) of a model, native and portable, in one thread.

    .venv/bin/python scripts/bench_portable.py                           # gpt-small, llama-4x
    .venv/bin/python scripts/bench_portable.py --variant main=/work/main --repeat 3

Each (tree, family) runs in a fresh process; trees and families take turns, repetition by
repetition. A step is timed by the thread's CPU time (`time.thread_time`), not the wall
clock: on a shared machine other jobs' load delays a step without adding to its CPU time,
so these figures hold under a load where scripts/bench_trainer.py's wall-clock rows scatter.
(A busy sibling core still slows the caches: compare only trees measured in one run.) The
table gives medians over repetitions of each run's median step after two warm-up steps;
"x native" is native's step time over portable's, paired within each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {  # scripts/bench_trainer.py's gpt-small and llama-4x
    "gpt-small": {"family": "gpt", "d_model": 96, "n_layers": 4, "n_heads": 4, "seq_len": 128},
    "llama-4x": {"family": "llama", "d_model": 192, "n_layers": 5, "n_heads": 4, "n_kv_heads": 2,
                 "seq_len": 128},
}


def worker(family: str, steps: int) -> dict[str, float]:
    import time

    import torch
    import torch.nn.functional as F

    from trainer import portable as P
    from trainer.config import ModelConfig
    from trainer.model import build_model

    torch.set_num_threads(1)
    out: dict[str, float] = {}
    data = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(1))
    for numerics in ("native", "portable"):
        model = build_model(ModelConfig(**FAMILIES[family]), 0, numerics=numerics)
        if numerics == "portable":
            opt: torch.optim.Optimizer = P.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
            loss_fn, clip = P.lm_loss, P.clip_grad_norm_
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
            loss_fn = lambda lg, t: F.cross_entropy(lg.flatten(0, 1), t.flatten())  # noqa: E731
            clip = torch.nn.utils.clip_grad_norm_
        times = []
        for _ in range(steps + 2):
            start = time.thread_time()
            opt.zero_grad()
            for mb in data.chunk(4):
                (loss_fn(model(mb[:, :-1]), mb[:, 1:]) / 4).backward()
            clip(model.parameters(), 1.0)
            opt.step()
            times.append(time.thread_time() - start)
        out[numerics] = statistics.median(times[2:])
    return out


def run(tree: str, family: str, steps: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", family,
                           "--steps", str(steps)], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_portable: the run of {family} in {tree} failed: {proc.stderr.strip()[-300:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every (tree, family) (default 3)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="also measure the checkout DIR (e.g. the code before a change)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps)))
        return 0
    trees = [("", str(ROOT))]
    for v in args.variant:
        name, sep, path = v.partition("=")
        if not sep or not (Path(path) / "trainer" / "portable.py").is_file():
            print(f"bench_portable: --variant {v!r} is not NAME=DIR with DIR a checkout", file=sys.stderr)
            return 2
        trees.append((f" [{name}]", path))
    if args.steps < 1 or args.repeat < 1:
        print("bench_portable: --steps and --repeat must be at least 1", file=sys.stderr)
        return 2
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for rep in range(args.repeat):
        for family in args.family:
            for label, tree in trees:
                res = run(tree, family, args.steps)
                results.setdefault((family, label), []).append(res)
                print(f"# rep {rep + 1}/{args.repeat} {family}{label}: native {res['native'] * 1e3:.0f} ms, "
                      f"portable {res['portable'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
    print("| model | tree | native ms / step | portable ms / step | x native |")
    print("|---|---|---:|---:|---:|")
    for (family, label), runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) * 1e3 for k in ("native", "portable")}
        ratio = statistics.median(r["native"] / r["portable"] for r in runs)
        print(f"| {family} | {label.strip() or 'this'} | {med['native']:.0f} | {med['portable']:.0f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
