#!/usr/bin/env python
"""Our rank loop against the plain PyTorch training loop a user would write instead.

    .venv/bin/python scripts/bench_trainer.py                  # gpt and llama, ~10 minutes
    .venv/bin/python scripts/bench_trainer.py --quick          # smoke run, < 1 minute
    .venv/bin/python scripts/bench_trainer.py --family gpt --steps 60 --repeat 5
    .venv/bin/python scripts/bench_trainer.py --variant new=/tmp/scratch   # + rows from another tree
    .venv/bin/python scripts/bench_trainer.py --mode runs      # whole train_local runs, compute_s
    .venv/bin/python scripts/bench_trainer.py --family gpt-small llama-4x --no-s2   # portable rows
    python3 scripts/bench_trainer.py --device cuda --family gpt-small llama-4x --no-s2 --batch 32   # on GPU 0

Rows (every one its own fresh process, or R x S of them, on this machine):
  plain     a single-process loop over `trainer.model.build_model(cfg, seed)`: AdamW with the
            job's lr, warmup, betas and weight decay on matrices only, whole-batch forward,
            cross_entropy, backward, `clip_grad_norm_(1.0)`, step, the loss read every step
            (as the engine does); `torch.set_num_threads(1)` and
            `torch.use_deterministic_algorithms(True)` as the ranks run (`--nondet` adds a
            row without deterministic algorithms, `--plain-fused` one with fused AdamW).
  R1xS1 Mm  the engine's rank loop (`trainer.engine.run_rank`, whose `inner_round` every
            launcher runs) with 1 replica x 1 stage and m microbatches.
  R1xS2 Mm  the same with 2 pipeline stages (two processes on two cores): the pipeline's
            cost; the "x S=1" column compares it with R1xS1 at the same m.
  R1xS1 Mm portable  the R1xS1 row under `parallel.numerics = "portable"` (trainer/portable.py:
            kernels whose bits do not depend on the CPU); "x native" is its speed over the
            native row's at the same m (1.0: as fast; 0.5: half the tokens per second).

--mode lockstep (default): all rows of a family are alive at once and take turns, one round
of H inner steps each, the order rotating every round, so a change in machine load (this
machine is shared) hits every row alike. The engine runs `run_rank` in the worker process
(world size 1; at S=2 rank 1 is a spawned process) with `RankControl(cancellable=True)`:
its `stop_requested` hook, polled before every inner step, timestamps the steps and holds
the rank at round starts until its turn (the pause falls between rounds, outside any timed
step). So one sample is exactly one inner step (set lr, zero_grad, the pipeline schedule,
clip, AdamW, the progress hook, plus the cancellation broadcast: ~10 us at world size 1);
a round's last step is not timed (the outer step follows it). The plain loop times every step.
--mode runs: whole `trainer.launch.train_local` runs one after another (order rotating every
repetition), timed by the engine's own per-round `compute_s` (inner steps only), / H.

A run's figure is the median over its inner steps after the first round (warm-up). Every
measurement is repeated --repeat times (fresh processes); the table shows the median over
repetitions and the spread (min-max). "x plain" is paired: in each repetition, the median
over rounds of (plain's round / the row's same round, each a median step), then the median
over repetitions; "x S=1" likewise against R1xS1 at the same m. Peak memory: VmHWM of the largest rank (the engine's
`peak_rss_mb` in --mode runs), VmHWM of the plain loop's process.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = "@@bench "  # worker -> coordinator lines on stdout (anything else there is ignored)

FAMILIES = {
    # The model of examples/tiny.toml.
    "gpt": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128, "mlp_ratio": 4},
    # A Llama small enough to measure in a few minutes (4.6M parameters; examples/
    # llama-small.toml's is 11M: --llama-toml examples/llama-small.toml).
    "llama": {"family": "llama", "d_model": 256, "n_layers": 6, "n_heads": 8, "n_kv_heads": 4,
              "seq_len": 128},
    # The models of scripts/bench_dilocox.py.
    "gpt-small": {"family": "gpt", "d_model": 96, "n_layers": 4, "n_heads": 4, "seq_len": 128},
    "llama-4x": {"family": "llama", "d_model": 192, "n_layers": 5, "n_heads": 4, "n_kv_heads": 2,
                 "seq_len": 128},
}
QUICK = {
    "gpt": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64, "mlp_ratio": 4},
    "llama": {"family": "llama", "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "seq_len": 64},
}


def job_dict(spec: dict) -> dict:
    return {
        "name": "bench-trainer",
        "seed": 0,
        "model": spec["model"],
        "parallel": {"replicas": 1, "stages": spec.get("stages", 1),
                     "microbatches": spec.get("microbatches", 1), "schedule": "1F1B",
                     "numerics": spec.get("numerics", "native"), "device": spec.get("device", "cpu")},
        "data": {"batch_size": spec["batch"], "eval_batches": 1, "max_bytes": 4_000_000},
        "inner": {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "clip": 1.0,
                  "warmup": 10},
        "outer": {"steps": spec["rounds"], "inner_steps": spec["inner_steps"]},
        "transport": {"link": "none"},
    }


def vm_hwm_mb() -> float:
    with open("/proc/self/status", "rb") as fh:
        for line in fh:
            if line.startswith(b"VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------------------------
# Workers: each row runs in its own interpreter (`--worker SPEC`) with spec["root"] first on
# sys.path, so rows from another checkout (--variant) are measured in the same run.


class Turns:
    """The worker's side of lockstep: report a round's step times, wait for the next turn."""

    def __init__(self, lockstep: bool):
        self.lockstep = lockstep

    def send(self, **msg) -> None:
        if msg.get("ready"):  # which checkout this worker really imported
            msg["trainer"] = sys.modules["trainer"].__file__
        sys.stdout.write(TAG + json.dumps(msg) + "\n")
        sys.stdout.flush()

    def wait(self) -> None:
        if self.lockstep and sys.stdin.readline().strip() != "go":
            os._exit(3)  # the coordinator went away


def worker_plain(spec: dict, turns: Turns) -> None:
    import torch
    import torch.nn.functional as F

    from trainer import load_job
    from trainer.data import load_corpus
    from trainer.model import build_model

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(spec.get("deterministic", True))
    job = load_job(job_dict(spec))
    cfg, inner = job.model, job.inner
    H, B, L = job.outer.inner_steps, job.data.batch_size, cfg.seq_len
    corpus = load_corpus(job.data)

    device = torch.device(spec.get("device", "cpu"))
    model = build_model(cfg, job.seed).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": inner.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    extra = {"fused": True} if spec.get("fused") else {}
    opt = torch.optim.AdamW(groups, lr=inner.lr, betas=inner.betas, **extra)

    step = 0
    turns.send(ready=True)
    for t in range(1, job.outer.steps + 1):
        turns.wait()
        start = time.perf_counter()
        tokens = corpus.shard(job.seed, 0, t, H, B, L).tokens.to(device)  # (H, B, L + 1), as the engine
        times = []
        for h in range(H):
            lr = inner.lr * min(1.0, (step + 1) / inner.warmup) if inner.warmup else inner.lr
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = tokens[h, :, :-1], tokens[h, :, 1:]
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, inner.clip)
            opt.step()
            loss.item()
            step += 1
            now = time.perf_counter()
            times.append(now - start)
            start = now
        turns.send(round=t, step_s=times, round_s=sum(times))
    turns.send(end=True, peak_rss_mb=vm_hwm_mb())


def _peer_rank(rank: int, world: int, init_method: str, job, out) -> None:
    """A rank other than 0 in lockstep mode (a spawned process)."""
    from trainer.control import RankControl
    from trainer.engine import run_rank

    run_rank(rank, world, init_method, job, lambda kind, payload: None,
             RankControl(cancellable=True, timeout_s=3600, gpu=rank if job.parallel.device == "cuda" else None))
    out.put(vm_hwm_mb())


def worker_engine_lockstep(spec: dict, turns: Turns) -> None:
    import multiprocessing as mp

    from trainer import load_job
    from trainer.control import RankControl
    from trainer.engine import run_rank
    from trainer.launch import free_port

    job = load_job(job_dict(spec))
    H, world = job.outer.inner_steps, job.world_size
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    peaks = ctx.Queue()
    peers = [ctx.Process(target=_peer_rank, args=(r, world, init_method, job, peaks), daemon=True)
             for r in range(1, world)]
    for p in peers:
        p.start()
    state = {"calls": 0, "last": 0.0, "times": []}

    def hook() -> bool:  # rank 0, before every inner step
        now = time.perf_counter()
        h = state["calls"] % H
        if h > 0:
            state["times"].append(now - state["last"])
        else:  # a round starts: report the last one, wait for our turn
            if state["calls"] == 0:
                turns.send(ready=True)
            else:
                turns.send(round=state["calls"] // H, step_s=state["times"])
            state["times"] = []
            turns.wait()
        state["calls"] += 1
        state["last"] = time.perf_counter()
        return False

    run_rank(0, world, init_method, job, lambda kind, payload: None,
             RankControl(stop_requested=hook, cancellable=True, timeout_s=3600,
                         gpu=0 if job.parallel.device == "cuda" else None))
    turns.send(round=state["calls"] // H, step_s=state["times"])
    peak = max([vm_hwm_mb()] + [peaks.get(timeout=60) for _ in peers])
    for p in peers:
        p.join(timeout=30)
    turns.send(end=True, peak_rss_mb=peak)


def worker_engine_run(spec: dict, turns: Turns) -> None:
    """--mode runs: the whole train_local path; per-round compute_s from the step metrics."""
    from trainer import load_job, train_local

    class Sink:
        def __init__(self) -> None:
            self.compute: list[float] = []
            self.peak = 0.0

        def on_genesis(self, genesis) -> None:
            pass

        def on_step(self, step) -> None:
            self.compute.append(step.metrics["compute_s"])  # cumulative, the slowest rank
            self.peak = step.metrics["peak_rss_mb"]

        def on_progress(self, progress) -> None:
            pass

    job = load_job(job_dict(spec))
    H = job.outer.inner_steps
    sink = Sink()
    turns.send(ready=True)
    train_local(job, sink, timeout_s=3600)
    for t, (a, b) in enumerate(zip([0.0] + sink.compute[:-1], sink.compute, strict=True), 1):
        turns.send(round=t, step_s=[(b - a) / H], round_s=b - a)
    turns.send(end=True, peak_rss_mb=sink.peak)


def worker_main(raw: str) -> int:
    spec = json.loads(raw)
    sys.path.insert(0, spec["root"])
    turns = Turns(spec["mode"] == "lockstep")
    if spec["kind"] == "plain":
        worker_plain(spec, turns)
    elif spec["mode"] == "lockstep":
        worker_engine_lockstep(spec, turns)
    else:
        worker_engine_run(spec, turns)
    sys.stdout.flush()
    os._exit(0)  # skip torch's interpreter teardown


# ---------------------------------------------------------------------------------------------
# The coordinator.


class Worker:
    def __init__(self, spec: dict):
        self.spec = spec
        self.err = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, cwd=spec["root"],
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.rounds: list[list[float]] = []
        self.peak = float("nan")

    def recv(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                self.err.seek(0)
                raise RuntimeError(f"{self.spec['label']} failed (exit {self.proc.returncode}):\n"
                                   f"{self.err.read()[-3000:]}")
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])

    def ready(self, msg: dict) -> None:
        root = Path(self.spec["root"]).resolve()
        if not msg.get("ready") or not Path(msg["trainer"]).resolve().is_relative_to(root):
            raise RuntimeError(f"{self.spec['label']}: imported {msg.get('trainer')}, not from {root}")

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def take(self, msg: dict) -> None:
        if "round" in msg:
            self.rounds.append(msg["step_s"])
        if msg.get("end"):
            self.peak = msg["peak_rss_mb"]

    def finish(self) -> None:
        while True:  # the rest of the rounds' reports, then the end (peak memory)
            msg = self.recv()
            self.take(msg)
            if msg.get("end"):
                break
        self.proc.wait(timeout=120)

    def result(self) -> dict:
        steps = [s for r in self.rounds[1:] for s in r]  # the first round is warm-up
        return {"step_s": statistics.median(steps), "rounds": self.rounds, "peak_rss_mb": self.peak}


def run_lockstep(rows: list[dict], rounds: int) -> dict[str, dict]:
    workers = [Worker(r) for r in rows]
    try:
        for w in workers:
            w.ready(w.recv())
        for t in range(rounds):
            k = t % len(workers)
            for w in workers[k:] + workers[:k]:  # rotate: no row has a fixed position
                w.go()
                w.take(w.recv())
        for w in workers:
            w.finish()
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
    return {w.spec["label"]: w.result() for w in workers}


def run_one(row: dict) -> dict:
    w = Worker(row)
    w.ready(w.recv())
    w.finish()
    return w.result()


def rows_for(args: argparse.Namespace) -> list[dict]:
    families = ["gpt", "llama"] if args.family == ["both"] else args.family
    rounds = 1 + max(1, -(-args.steps // args.inner_steps))
    rows = []
    for fam in families:
        model = dict((QUICK if args.quick and fam in QUICK else FAMILIES)[fam])
        path = args.llama_toml if fam == "llama" else args.gpt_toml if fam == "gpt" else None
        if path:
            with open(path, "rb") as fh:
                model = {k: v for k, v in tomllib.load(fh)["model"].items()
                         if k not in ("init", "dtype", "activation_checkpointing")}
        base = {"family": fam, "model": model, "batch": args.batch, "rounds": rounds,
                "inner_steps": args.inner_steps, "root": str(ROOT), "mode": args.mode, "device": args.device}
        rows.append({**base, "kind": "plain", "layout": "plain"})
        if args.nondet:
            rows.append({**base, "kind": "plain", "layout": "plain nondet", "deterministic": False})
        if args.plain_fused:
            rows.append({**base, "kind": "plain", "layout": "plain fused-AdamW", "fused": True})
        trees = [("", str(ROOT))] + [(f" [{name}]", root) for name, root in args.variant]
        for suffix, root in trees:
            for m in args.s1_microbatches:
                rows.append({**base, "kind": "engine", "stages": 1, "microbatches": m,
                             "layout": f"R1xS1 M{m}{suffix}", "root": str(Path(root).resolve())})
            if not args.no_portable:
                m = args.s1_microbatches[-1]
                rows.append({**base, "kind": "engine", "stages": 1, "microbatches": m, "numerics": "portable",
                             "layout": f"R1xS1 M{m} portable{suffix}", "native": f"R1xS1 M{m}{suffix}",
                             "root": str(Path(root).resolve())})
            if not args.no_s2:
                m = args.s2_microbatches
                rows.append({**base, "kind": "engine", "stages": 2, "microbatches": m,
                             "layout": f"R1xS2 M{m}{suffix}", "s1": f"R1xS1 M{m}{suffix}",
                             "root": str(Path(root).resolve())})
    for r in rows:
        r["label"] = f"{r['family']} {r['layout']}"
    return rows


def paired_ratio(plain: dict, row: dict) -> float:
    """Plain over row, round by round (round t of every row ran within the same turn cycle,
    seconds apart): the median of the per-round ratios of median step times."""
    pairs = [statistics.median(a) / statistics.median(b)
             for a, b in zip(plain["rounds"][1:], row["rounds"][1:], strict=True) if a and b]
    return statistics.median(pairs)


def summarise(rows: list[dict], reps: list[dict[str, dict]], args) -> list[dict]:
    out = []
    for r in rows:
        runs = [rep[r["label"]] for rep in reps]
        plain = [rep[f"{r['family']} plain"] for rep in reps]
        ms = [run["step_s"] * 1e3 for run in runs]
        ratios = [paired_ratio(p, run) for run, p in zip(runs, plain, strict=True)]
        vs_s1 = vs_native = None
        s1 = f"{r['family']} {r.get('s1')}"
        if r.get("s1") and s1 in reps[0]:
            vs_s1 = statistics.median(paired_ratio(rep[s1], rep[r["label"]]) for rep in reps)
        native = f"{r['family']} {r.get('native')}"
        if r.get("native") and native in reps[0]:
            vs_native = statistics.median(paired_ratio(rep[native], rep[r["label"]]) for rep in reps)
        med = statistics.median(ms)
        out.append({
            "family": r["family"], "layout": r["layout"],
            "ms": med, "ms_min": min(ms), "ms_max": max(ms),
            "tokens_per_s": args.batch * r["model"]["seq_len"] / (med / 1e3),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "vs_s1": vs_s1, "vs_native": vs_native,
            "peak_rss_mb": statistics.median(run["peak_rss_mb"] for run in runs),
            "runs_ms": ms,
        })
    return out


def n_params(model: dict) -> float:
    sys.path.insert(0, str(ROOT))
    from trainer.config import ModelConfig

    return ModelConfig(**model).n_params()


def render(summary: list[dict], rows: list[dict], args) -> str:
    lines = []
    for fam in dict.fromkeys(r["family"] for r in rows):
        m = next(r["model"] for r in rows if r["family"] == fam)
        shape = ", ".join(f"{k} {v}" for k, v in m.items() if k != "family")
        lines.append(f"{fam}: {n_params(m) / 1e6:.2f}M params ({shape}); batch {args.batch} x "
                     f"seq {m['seq_len']} = {args.batch * m['seq_len']} tokens per inner step")
    how = ("lockstep: rows take turns round by round" if args.mode == "lockstep"
           else "whole train_local runs, engine compute_s")
    lines.append(
        f"{args.steps} measured inner steps per run (rounds of H={args.inner_steps} + 1 warm-up round), "
        f"{args.repeat} repetitions, {how}; ms = median (min-max over repetitions); "
        f"torch {torch_version()}, {os.cpu_count()} cores, 1 thread per process"
        + (f"; on {args.device}" if args.device != "cpu" else ""))
    lines += ["",
              "| family | layout | ms / inner step | tokens/s | x plain | x S=1 | x native | peak RSS MB / rank |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in summary:
        vs = f"{s['vs_s1']:.2f}" if s["vs_s1"] is not None else ""
        nat = f"{s['vs_native']:.2f}" if s["vs_native"] is not None else ""
        lines.append(
            f"| {s['family']} | {s['layout']} | {s['ms']:.1f} ({s['ms_min']:.1f}-{s['ms_max']:.1f}) "
            f"| {s['tokens_per_s']:.0f} | {s['ratio']:.3f} ({s['ratio_min']:.3f}-{s['ratio_max']:.3f}) "
            f"| {vs} | {nat} | {s['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def torch_version() -> str:
    try:
        import importlib.metadata

        return importlib.metadata.version("torch")
    except Exception:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small models, few steps: < 1 minute")
    ap.add_argument("--family", nargs="+", choices=[*FAMILIES, "both"], default=None,
                    help="models (default both: gpt and llama; --quick: gpt; gpt-small and "
                    "llama-4x are scripts/bench_dilocox.py's)")
    ap.add_argument("--steps", type=int, default=None, help="measured inner steps per run (default 40)")
    ap.add_argument("--inner-steps", type=int, default=None, help="H: inner steps per round (default 10)")
    ap.add_argument("--repeat", type=int, default=None, help="repetitions of every measurement (default 3)")
    ap.add_argument("--mode", choices=["lockstep", "runs"], default="lockstep",
                    help="rows take turns round by round (default), or whole train_local runs")
    ap.add_argument("--batch", type=int, default=8, help="sequences per inner step")
    ap.add_argument("--s1-microbatches", type=int, nargs="+", default=[1, 4],
                    help="microbatch counts of the R1xS1 rows (default 1 4; 4 is examples/tiny.toml's)")
    ap.add_argument("--s2-microbatches", type=int, default=4, help="microbatches of the R1xS2 row")
    ap.add_argument("--no-s2", action="store_true", help="skip the R1xS2 rows")
    ap.add_argument("--no-portable", action="store_true", help="skip the portable-numerics rows")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: every row on GPU 0 (float32; R1xS2 rows need two GPUs)")
    ap.add_argument("--nondet", action="store_true", help="add a plain row without deterministic algorithms")
    ap.add_argument("--plain-fused", action="store_true", help="add a plain row with fused AdamW")
    ap.add_argument("--llama-toml", help="take the llama model from this job file's [model]")
    ap.add_argument("--gpt-toml", help="take the gpt model from this job file's [model]")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="also measure the engine rows from the checkout DIR (e.g. a patched copy)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    args.variant = [tuple(v.split("=", 1)) for v in args.variant]
    if args.quick:
        args.family = args.family or ["gpt"]
        args.steps = args.steps or 12
        args.inner_steps = args.inner_steps or 4
        args.repeat = args.repeat or 1
    args.family = args.family or ["both"]
    args.steps = args.steps or 40
    args.inner_steps = args.inner_steps or 10
    args.repeat = args.repeat or 3
    if args.inner_steps < 2 and args.mode == "lockstep":
        ap.error("--inner-steps must be >= 2 in lockstep mode (a round's last step is not timed)")

    rows = rows_for(args)
    reps: list[dict[str, dict]] = []
    for k in range(args.repeat):
        rep: dict[str, dict] = {}
        for fam in dict.fromkeys(r["family"] for r in rows):
            mine = [copy.deepcopy(r) for r in rows if r["family"] == fam]
            start = time.perf_counter()
            if args.mode == "lockstep":
                rep.update(run_lockstep(mine, mine[0]["rounds"]))
            else:
                for r in mine[k % len(mine):] + mine[:k % len(mine)]:  # rotate the order
                    rep[r["label"]] = run_one(r)
            for r in mine:
                res = rep[r["label"]]
                print(f"# rep {k + 1}/{args.repeat} {r['label']}: {res['step_s'] * 1e3:.1f} ms/step, "
                      f"peak {res['peak_rss_mb']:.0f} MB", file=sys.stderr, flush=True)
            print(f"# rep {k + 1}/{args.repeat} {fam}: {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
        reps.append(rep)
    summary = summarise(rows, reps, args)
    if args.json:
        print(json.dumps({"summary": summary, "config": vars(args)}, indent=1))
    else:
        print(render(summary, rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
