#!/usr/bin/env python
"""How `dlx train` scales with the model: a rank's memory, step time, checkpoint, storage
and verification, for llama models from ~10M parameters to the largest this machine holds.

    .venv/bin/python scripts/bench_scale.py                    # 11M, 43M, 132M: ~11 minutes
    .venv/bin/python scripts/bench_scale.py --quick            # a 1.4M model: ~20 s
    .venv/bin/python scripts/bench_scale.py --sizes 11M 43M --variant before=DIR --variants-only --no-plain --no-verify
    .venv/bin/python scripts/bench_scale.py --sizes 132M --replicas 1 --no-verify   # one replica

Every row is one `dlx train` of a DiLoCoX job (examples/tiny.toml's outer loop: 4-bit
quantised pseudo-gradients with error feedback, outer.delay = 1 with the partial overlap
rule, tau = auto) of a llama with a 4,096-token byte-level BPE (`[data] tokenizer = "bpe"`,
trained once on the standard library's sources and cached), R replicas x 1 stage
(default 2), `--steps` outer steps of `--inner-steps` inner steps of `--batch` x
`--seq-len` tokens. It runs in a worker process that calls what `dlx train` calls
(`workers.run.local.run_job`, with the sink's `on_step` timed); the coordinator samples the
VmHWM (peak resident memory) of every rank process from /proc every 50 ms. Then
`dlx verify --run-dir DIR --replay 1` checks the run (every round replayed) and is timed.

Columns:
  peak MB / rank   each rank's VmHWM (MiB; rank 0 first): it includes the ~300 MB the
                   forked interpreter, torch and the trainer's modules take before training
  budget MB        400 MiB + 40 bytes per parameter: issue 32's bound on a rank's peak
  B/param          (largest rank's peak - 400 MiB) / parameters, against that 40
  launcher MB      the launching process's VmHWM (the sink: it receives every step's bytes)
  s / step         the engine's compute_s (the slowest rank's inner steps) per inner step,
                   after the first round
  plain s / step   scripts/bench_trainer.py's plain single-process loop of the same model,
                   batch and sequence length (median inner step after the first), R copies
                   at once, as the R ranks share the machine
  checkpoint s     the sink's on_step per outer step (stores shards, contributions and
                   round-start states in the blockstore, signs, commits on the ledger)
  stored MB / step the run's blocks directory (du) over the outer steps (genesis, config
                   and dataset included)
  verify s / step  `dlx verify --replay 1` (every level, every round replayed) per step

`--variant NAME=DIR` adds the same rows from another checkout (say the code before a
change, from `git archive`): its `dlx train` and `dlx verify` run with DIR first on
PYTHONPATH (`--variants-only`: only those rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = "@@scale "
MIB = 1 << 20
OVERHEAD_MB, BUDGET_BYTES_PER_PARAM = 400, 40  # issue 32: a rank's peak <= 400 MB + 40 B/param

LLAMA = {"family": "llama", "vocab_size": 4096, "rope_theta": 10000.0}
SIZES = {
    "1.4M": {"d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 352},
    "11M": {"d_model": 384, "n_layers": 5, "n_heads": 6, "n_kv_heads": 2, "intermediate_size": 1024},
    "43M": {"d_model": 640, "n_layers": 8, "n_heads": 10, "n_kv_heads": 5, "intermediate_size": 1792},
    "132M": {"d_model": 1024, "n_layers": 11, "n_heads": 16, "n_kv_heads": 4, "intermediate_size": 2816},
}


def job_toml(name: str, model: dict, args: argparse.Namespace) -> str:
    shape = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {**LLAMA, **model, "seq_len": args.seq_len}.items())
    return f"""name = "{name}"
seed = 0

[model]
{shape}

[parallel]
replicas = {args.replicas}
stages = 1
microbatches = 1

[data]
source = "stdlib"
max_bytes = 4000000
tokenizer = "{args.tokenizer}"
batch_size = {args.batch}
eval_batches = 1

[inner]
lr = 1e-3
warmup = 2

[outer]
lr = 0.7
momentum = 0.9
nesterov = true
steps = {args.steps}
inner_steps = {args.inner_steps}
delay = 1
overlap = "partial"
tau = "auto"

[outer.compression]
kind = "quantize"
bits = 4

[transport]
link = "none"
"""


# ---------------------------------------------------------------------------------------------
# Workers: each in its own process, with its checkout first on sys.path.


def worker_train(spec: dict) -> None:
    """What `dlx train JOB --run-dir DIR` runs, with the sink's on_step timed."""
    sys.path.insert(0, spec["root"])
    from workers.run import sink as sink_module
    from workers.run.jobfile import load_job_file
    from workers.run.local import Callbacks, run_job

    times: list[float] = []
    on_step = sink_module.LedgerSink.on_step

    def timed(self, step):  # type: ignore[no-untyped-def]
        began = time.perf_counter()
        on_step(self, step)
        times.append(time.perf_counter() - began)

    sink_module.LedgerSink.on_step = timed  # type: ignore[method-assign]
    path = Path(spec["job"])
    record = run_job(load_job_file(path), path, Path(spec["run_dir"]), None, Callbacks())
    print(TAG + json.dumps({"status": record.status, "on_step_s": times}), flush=True)
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# The coordinator.


def vm_hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Sampler(threading.Thread):
    """Every 50 ms: the VmHWM of the launcher (`pid`) and of every rank (the children of its
    multiprocessing forkserver, in start order = rank order)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.launcher = pid, 0.0
        self.ranks: dict[int, float] = {}  # pid -> peak MB, in start order
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.launcher = max(self.launcher, vm_hwm_mb(self.pid) or 0.0)
            for child in children(self.pid):
                if "forkserver" in cmdline(child):
                    for rank in children(child):
                        peak = vm_hwm_mb(rank)
                        if peak is not None:
                            self.ranks[rank] = max(self.ranks.get(rank, 0.0), peak)
            self.done.wait(0.05)


def env_for(root: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}


def run_train(name: str, model: dict, root: str, work: Path, args: argparse.Namespace) -> dict:
    job = work / f"{name}.toml"
    job.write_text(job_toml(name, model, args))
    run_dir = work / name
    spec = {"root": root, "job": str(job), "run_dir": str(run_dir)}
    began = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker-train", json.dumps(spec)],
                            cwd=root, env=env_for(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    sampler.done.set()
    sampler.join()
    wall = time.perf_counter() - began
    msg = next((json.loads(line[len(TAG):]) for line in out.splitlines() if line.startswith(TAG)), None)
    if proc.returncode != 0 or msg is None or msg["status"] != "completed":
        raise RuntimeError(f"{name}: training failed (exit {proc.returncode}):\n{err[-3000:]}")
    timings = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    return {
        "run_dir": str(run_dir), "train_wall_s": wall,
        "rank_peaks_mb": list(sampler.ranks.values()), "launcher_mb": sampler.launcher,
        "engine_peak_mb": max(t.get("peak_rss_mb", 0.0) for t in timings),
        # after the first round (warm-up) where there is more than one
        "step_s": (timings[-1]["compute_s"] - (timings[0]["compute_s"] if len(timings) > 1 else 0.0))
        / (args.inner_steps * max(1, len(timings) - 1)),
        "checkpoint_s": statistics.mean(msg["on_step_s"]),
        "stored_mb_per_step": du(run_dir / "blocks") / MIB / args.steps,
    }


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_verify(run_dir: str, root: str, args: argparse.Namespace) -> float:
    """`dlx verify --replay 1` of the run, by the checkout that trained it: seconds per outer step."""
    began = time.perf_counter()
    res = subprocess.run([str(ROOT / ".venv" / "bin" / "dlx"), "verify", "--run-dir", run_dir, "--replay", "1"],
                         cwd=root, env=env_for(root), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"dlx verify --run-dir {run_dir} --replay 1 failed:\n{res.stdout[-3000:]}{res.stderr[-2000:]}")
    return (time.perf_counter() - began) / args.steps


def run_plain(model: dict, args: argparse.Namespace) -> float:
    """scripts/bench_trainer.py's plain loop of the same model, R copies at once (as the R
    ranks share the machine): the median inner step after each copy's first."""
    spec = {"kind": "plain", "mode": "runs", "root": str(ROOT), "family": "llama", "label": "plain",
            "model": {**LLAMA, **model, "seq_len": args.seq_len}, "batch": args.batch,
            "rounds": args.steps, "inner_steps": args.inner_steps}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench_trainer.py"), "--worker", json.dumps(spec)],
                              cwd=ROOT, env=env_for(str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(args.replicas)]
    steps = []
    for proc in procs:
        out, err = proc.communicate()
        rounds = [json.loads(line[len("@@bench "):]) for line in out.splitlines() if line.startswith("@@bench ")]
        mine = [s for r in rounds if "round" in r for s in r["step_s"]]
        if proc.returncode != 0 or not mine:
            raise RuntimeError(f"plain loop failed:\n{err[-3000:]}")
        steps += mine[1:] or mine
    return statistics.median(steps)


def n_params(model: dict, seq_len: int) -> int:
    sys.path.insert(0, str(ROOT))
    from trainer.config import ModelConfig

    return ModelConfig(**{**LLAMA, **model, "seq_len": seq_len}).n_params()


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    rows = []
    trees = [] if args.variants_only else [("", str(ROOT))]
    trees += [(f" [{name}]", str(Path(root).resolve())) for name, root in args.variant]
    for size in args.sizes:
        model = SIZES[size]
        params = n_params(model, args.seq_len)
        plain = None if args.no_plain else run_plain(model, args)
        for suffix, root in trees:
            label = f"{size}{suffix}"
            name = f"scale-{size.lower().replace('.', '_')}-{len(rows)}-{time.strftime('%H%M%S')}"
            print(f"# {label}: training ({params / 1e6:.1f}M params, {args.replicas} x 1)", file=sys.stderr, flush=True)
            row = {"size": label, "params": params, **run_train(name, model, root, work, args), "plain_s": plain}
            if not args.no_verify:
                print(f"# {label}: dlx verify --replay 1", file=sys.stderr, flush=True)
                row["verify_s"] = run_verify(row["run_dir"], root, args)
            rows.append(row)
            print(f"# {label}: {json.dumps({k: v for k, v in row.items() if k != 'run_dir'})}", file=sys.stderr, flush=True)
    return rows


def render(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"llama, vocab 4096 ({args.tokenizer}), {args.replicas} replica(s) x 1 stage, 4-bit quantize, delay 1 "
        f"partial, tau auto; {args.steps} outer steps x {args.inner_steps} inner steps of {args.batch} x "
        f"{args.seq_len} tokens; {os.cpu_count()} cores, 1 thread per rank", "",
        "| model | params | peak MB / rank | budget MB | B/param | launcher MB | s / step | plain s / step "
        "| x plain | checkpoint s | stored MB / step | verify s / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p = r["params"]
        peak = max(r["rank_peaks_mb"] + [r["engine_peak_mb"]])
        budget = OVERHEAD_MB + BUDGET_BYTES_PER_PARAM * p / MIB
        plain, verify = r.get("plain_s"), r.get("verify_s")
        cells = [
            r["size"], f"{p / 1e6:.1f}M", " / ".join(f"{v:.0f}" for v in r["rank_peaks_mb"]), f"{budget:.0f}",
            f"{(peak - OVERHEAD_MB) * MIB / p:.1f}", f"{r['launcher_mb']:.0f}", f"{r['step_s']:.2f}",
            "" if plain is None else f"{plain:.2f}", "" if plain is None else f"{plain / r['step_s']:.2f}",
            f"{r['checkpoint_s']:.2f}", f"{r['stored_mb_per_step']:.0f}", "" if verify is None else f"{verify:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker-train", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one 1.4M model, one short run: < 1 minute")
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None,
                    help="models (default 11M 43M 132M; --quick: 1.4M)")
    ap.add_argument("--replicas", type=int, default=2, help="R (default 2; x 1 stage)")
    ap.add_argument("--steps", type=int, default=2, help="outer steps (default 2)")
    ap.add_argument("--inner-steps", type=int, default=None, help="H (default 3; --quick: 2)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per inner step (default 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128; --quick: 64)")
    ap.add_argument("--tokenizer", default="bpe", help='"bpe" (default) or "bytes" (the same vocabulary size)')
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="also train from the checkout DIR (its rows are labelled NAME)")
    ap.add_argument("--variants-only", action="store_true", help="train only the --variant checkouts")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-loop column")
    ap.add_argument("--no-verify", action="store_true", help="skip dlx verify")
    ap.add_argument("--work", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.worker_train:
        worker_train(json.loads(args.worker_train))
        return 0
    args.variant = [tuple(v.split("=", 1)) for v in args.variant]
    args.sizes = args.sizes or (["1.4M"] if args.quick else ["11M", "43M", "132M"])
    args.inner_steps = args.inner_steps or (2 if args.quick else 3)
    args.seq_len = args.seq_len or (64 if args.quick else 128)
    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        rows = measure(args, work)
    else:
        with tempfile.TemporaryDirectory(prefix="dlx-scale-") as tmp:
            rows = measure(args, Path(tmp))
    print(json.dumps({"rows": rows, "config": vars(args)}, indent=1) if args.json else render(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
