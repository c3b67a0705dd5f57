"""Calibrate the tolerance a native run's replay on another kernel set is judged within
(lineage/audit/replay.py `DEFAULT_TOLERANCE` for compressed contributions,
`DEFAULT_TOLERANCE_NONE` for kind "none"; the flip-aware comparison), and show what it
still catches.

    .venv/bin/python scripts/calibrate_tolerance.py            # the full table (about 20 min on 2 cores)
    .venv/bin/python scripts/calibrate_tolerance.py --quick    # one seed, two kernel sets, three poisons (~1.5 min)
    .venv/bin/python scripts/calibrate_tolerance.py --json out.json

(a) Honest distribution. Small native runs (2 replicas x 2 stages, a 2-layer d=32 GPT, the
partial overlap rule of examples/tiny.toml; 4-bit quantised contributions, and kind "none";
H = 4 and 20 inner steps a round) are trained under this machine's own kernels, for three
seeds; then every (step, replica) round is replayed under each kernel set a verifier with
another CPU may get, played on this machine with environment variables (`KERNEL_SETS`).
Per configuration, stage and kernel set the table gives the plain relative L2 of the decoded
contributions (min / median / max), the largest figures the tolerance judges (a scale's
difference relative to its tensor's largest scale, the rest's relative L2, the continuity
check's state difference), the flipped codes (of those compared), the largest flip in
levels, and how many rounds pass when judged flip-aware within the kind's tolerance.

(b) Attacks (the tests' harness, tests/dlx_testing/cheat.py, named as the extension below): slot (1, 1) poisons its contribution from step 2 with noise
of std `scale` x its pseudo-gradient's RMS, for decreasing scales; and replica 1 skips its
inner steps from step 2 (in a synchronous run: under the partial rule the skipping replica
stalls the run). Each run is replayed under a foreign kernel set (`FOREIGN`) and judged
flip-aware within the kind's tolerance. The table says how many of the cheating slot's
rounds fail (caught), the first reason, and whether every honest round still passes; the
smallest poison caught in every round closes it.

Per compression kind, the default tolerance is the largest judged figure seen in (a), times
`MARGIN`, rounded up to 1, 2 or 5 times a power of ten (printed beside the constants; the
tables judge at the constants, or with `--suggested` at the suggestions). So is the flip
fraction bound, from the largest fraction of codes one honest round flipped. --quick is a
smoke run: its rounds are short (H = 4), so its suggestions fall below the constants, which
come from the full run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DLX = str(Path(sys.executable).parent / "dlx")
MARGIN = 10.0
# The poison and skip_work runs are the tests' attacks: every `dlx` this script starts reads
# job files with the test-only extension (workers.run.jobfile.EXTENSION_ENV), as the suite does.
os.environ["DLX_TEST_EXTENSION"] = "dlx_testing.cheat"
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

#: Kernel sets a verifier with another CPU may get, played on this machine (name -> environment).
KERNEL_SETS: dict[str, dict[str, str]] = {
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "mkl-sse42": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "mkl-cbwr-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "onednn-sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
    "omp-2-threads": {"OMP_NUM_THREADS": "2"},
    "glibc-no-avx2-fma": {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2,-FMA", "ATEN_CPU_CAPABILITY": "default"},
}
QUICK_SETS = ("aten-default", "onednn-sse41")
FOREIGN = "aten-default"  # the attacks' replay kernels

COMPRESSION = {
    "quantize-4": '[outer.compression]\nkind = "quantize"\nbits = 4\n',
    "none": '[outer.compression]\nkind = "none"\n',
}


def job_toml(name: str, seed: int, kind: str, inner_steps: int = 4, cheat: str = "", overlap: bool = True) -> str:
    """A small native 2x2 job with the partial overlap rule (examples/tiny.toml's shape;
    `overlap=False`: synchronous)."""
    rule = 'delay = 1\noverlap = "partial"\ntau = 1\n' if overlap else ""
    return f"""
name = "{name}"
seed = {seed}

[model]
d_model = 32
n_layers = 2
n_heads = 2
seq_len = 32

[parallel]
replicas = 2
stages = 2
microbatches = 2

[data]
max_bytes = 300000
batch_size = 4
eval_batches = 2

[inner]
lr = 3e-3
warmup = 2

[outer]
steps = 3
inner_steps = {inner_steps}
{rule}
{COMPRESSION[kind]}
{cheat}"""


def train(root: Path, name: str, toml: str) -> Path:
    """`dlx train` of `toml` under this machine's own kernels; its run directory."""
    job = root / f"{name}.toml"
    run_dir = root / name
    record = run_dir / "run.json"
    if job.exists() and job.read_text() == toml and record.exists() and \
            json.loads(record.read_text()).get("status") == "completed":
        return run_dir  # a --workdir kept from an earlier calibration
    job.write_text(toml)
    res = subprocess.run([DLX, "train", str(job), "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=900)
    if res.returncode != 0:
        raise SystemExit(f"training {name} failed:\n{res.stderr[-3000:]}")
    return run_dir


def replay_under(run_dir: Path, env: dict[str, str], tolerance: float | None) -> dict[str, Any]:
    """Every (step, replica) round of `run_dir` replayed in a child process with `env`
    added (its kernels), judged at `tolerance` (None: automatic), continuity included
    (kept beside the run, so a --workdir calibration re-run reuses it)."""
    key = "-".join(f"{k}={v}" for k, v in sorted(env.items())).replace("/", "_")
    cache = run_dir.parent / f"{run_dir.name}.{key}.{tolerance!r}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    res = subprocess.run([sys.executable, __file__, "--child", str(run_dir),
                          "--tolerance", "auto" if tolerance is None else repr(tolerance)],
                         capture_output=True, text=True, timeout=900, env={**os.environ, **env})
    if res.returncode != 0:
        raise SystemExit(f"replaying {run_dir} under {env} failed:\n{res.stderr[-3000:]}")
    cache.write_text(res.stdout)
    return json.loads(res.stdout)


def child(run_dir: Path, tolerance: float | None) -> None:
    """The child's work: replay every round, check continuity, print the results as JSON."""
    from lineage.audit.replay import check_continuity, replay_many
    from lineage.chain.runrecord import RunRecord
    from lineage.store.manifest import get_manifest

    record = RunRecord.load(run_dir)
    store = record.open_store(run_dir)
    chain: list[tuple[int, str, tuple[int, ...]]] = []
    cid: Any = record.head
    while True:
        m = get_manifest(store, cid)
        if m.step == 0:
            break
        chain.append((m.step, str(cid), m.replica_ids()))
        cid = m.parent
    chain.sort()
    items: list[tuple[Any, int]] = [(cp, r) for _, cp, replicas in chain for r in replicas]
    results = replay_many(store, items, tolerance)
    after = {step: cp for step, cp, _ in chain}
    for r in results:
        if r.step + 1 in after and not r.error:
            check_continuity(store, r, after[r.step + 1])
    out = []
    for r in results:
        doc = r.as_json()
        for st, st_doc in zip(r.stages, doc["stages"], strict=True):
            st_doc["verdict"] = st.failure_detail(r.tolerance)  # "" when it passes
        out.append(doc | {"failure": r.failure()})
    print(json.dumps({"replay": out}))


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.1e} / {statistics.median(values):.1e} / {max(values):.1e}"


def _max(values: list[float | None]) -> float:
    return max((math.inf if v is None else v for v in values), default=0.0)


def honest(root: Path, seeds: list[int], sets: list[str], configs: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """(a): one row per configuration, stage and kernel set. The replays are judged at a
    tolerance nothing honest reaches (1.0), so every figure is measured; `judge_rows`
    judges them at the chosen tolerance."""
    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    for kind, H in configs:
        for seed in seeds:
            run_dir = train(root, f"honest-{kind}-h{H}-s{seed}", job_toml(f"cal-{kind}", seed, kind, H))
            for name in sets:
                t0 = time.perf_counter()
                doc = replay_under(run_dir, KERNEL_SETS[name], 1.0)
                print(f"  {kind} H={H} seed {seed} under {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
                for r in doc["replay"]:
                    for st in r["stages"]:
                        row = rows.setdefault((f"{kind} H={H}", st["stage"], name), {
                            "config": f"{kind} H={H}", "stage": st["stage"], "kernels": name, "rel_l2": [],
                            "scale": [], "rest": [], "state": [], "flips": 0, "codes": 0, "max_flip": 0,
                            "swaps": 0, "rounds": 0, "exact": 0, "stages": []})
                        _add(row, r, st)
    return list(rows.values())


def _add(row: dict[str, Any], r: dict[str, Any], st: dict[str, Any]) -> None:
    cmp = st["compare"] or {}
    row["rounds"] += 1
    row["exact"] += bool(st["exact"])
    row["rel_l2"].append(math.inf if st["rel_l2"] is None else st["rel_l2"])
    row["scale"].append(cmp.get("scale_rel", 0.0))
    row["rest"].append(cmp.get("rest_rel_l2", 0.0))
    if st["state_rel_l2"] is not None:
        row["state"].append(st["state_rel_l2"])
    row["flips"] += cmp.get("flips", 0)
    row["codes"] += cmp.get("codes", 0)
    row["swaps"] += cmp.get("swaps", 0)
    row["max_flip"] = max(row["max_flip"], cmp.get("max_flip", 0))
    row["stages"].append({"where": f"step {r['step']} replica {r['replica']}", "error": r["error"],
                          "reason": st["reason"], "exact": st["exact"], "compare": st["compare"],
                          "state": st["state_rel_l2"]})


def judge_rows(rows: list[dict[str, Any]], tolerances: dict[str, float]) -> None:
    """Each row's `passed` (and up to three `failures`): its rounds judged flip-aware at
    its compression kind's tolerance from their recorded figures, continuity's state
    difference included."""
    from lineage.audit.replay import flip_failure

    for row in rows:
        tolerance = row["tolerance"] = tolerances[_kind(row["config"])]
        row["passed"], row["failures"] = 0, []
        for st in row["stages"]:
            why = st["error"] or st["reason"]
            if not why and not st["exact"]:
                why = flip_failure(st["compare"] or {}, tolerance)
            if not why and st["state"] is not None and st["state"] > tolerance:
                why = f"state differs by relative L2 {st['state']:.3g}"
            row["passed"] += not why
            if why and len(row["failures"]) < 3:
                row["failures"].append(f"{st['where']}: {why}")


def _kind(config: str) -> str:
    """The compression kind of a configuration's name ("none", or compressed)."""
    return "none" if config.split()[0] == "none" else "compressed"


def attacks(root: Path, scales: list[float], kinds: list[str], tolerances: dict[str, float]) -> list[dict[str, Any]]:
    """(b): one row per attack, replayed under FOREIGN at its kind's tolerance."""
    rows = []
    cheats = [(kind, "poison", s) for kind in kinds for s in scales] + [(kinds[0], "skip_work", 0.0)]
    for kind, mode, scale in cheats:
        if mode == "poison":
            cheat = f'[[cheat]]\nmode = "poison"\nreplica = 1\nstage = 1\nfrom_step = 2\nscale = {scale!r}\n'
            bad = {(t, 1, 1) for t in (2, 3)}
        else:  # synchronous: a replica skipping its steps under the partial rule stalls the run
            cheat = '[[cheat]]\nmode = "skip_work"\nreplica = 1\nfrom_step = 2\n'
            bad = {(t, 1, s) for t in (2, 3) for s in (0, 1)}
        run_dir = train(root, f"attack-{kind}-{mode}-{scale:g}",
                        job_toml(f"cal-{kind}", 7, kind, cheat=cheat, overlap=mode == "poison"))
        tolerance = tolerances[_kind(kind)]
        doc = replay_under(run_dir, KERNEL_SETS[FOREIGN], tolerance)
        caught, honest_ok, why, figures = [], True, "", []
        for r in doc["replay"]:
            for st in r["stages"]:
                slot = (r["step"], r["replica"], st["stage"])
                failed = bool(r["error"] or st["verdict"])
                if slot in bad:
                    caught.append(failed)
                    why = why or (r["error"] or st["verdict"])
                    figures.append(st["rel_l2"])
                elif failed:
                    honest_ok = False
        rows.append({"kind": kind, "attack": mode, "scale": scale, "caught": sum(caught), "slots": len(caught),
                     "honest_ok": honest_ok, "rel_l2": figures, "why": why, "tolerance": tolerance})
        print(f"  attack {kind} {mode} {scale:g}: caught {sum(caught)}/{len(caught)}", file=sys.stderr)
    return rows


def choose(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per compression kind (and "flips": the flip fraction bound): (the largest judged
    figure of its honest rows, the value it suggests: times MARGIN, rounded up to 1, 2 or
    5 times a power of ten)."""
    out = {}
    for kind in sorted({_kind(r["config"]) for r in rows}):
        mine = [r for r in rows if _kind(r["config"]) == kind]
        worst = max((_max(r["scale"] + r["rest"] + r["state"]) for r in mine), default=0.0)
        out[kind] = (worst, _round_up(worst * MARGIN))
    fractions = [st["compare"]["flips"] / st["compare"]["codes"] for r in rows for st in r["stages"]
                 if st["compare"] and st["compare"].get("codes")]
    worst = max(fractions, default=0.0)
    out["flips"] = (worst, _round_up(worst * MARGIN))
    return out


def _round_up(want: float) -> float:
    """`want` rounded up to 1, 2 or 5 times a power of ten."""
    if want <= 0:
        return 0.0
    e = math.floor(math.log10(want))
    for m in (1, 2, 5, 10):
        if m * 10**e >= want * (1 - 1e-12):
            return m * 10.0**e
    return 10.0 ** (e + 1)


def print_tables(honest_rows: list[dict[str, Any]], attack_rows: list[dict[str, Any]]) -> None:
    print("(a) honest replays under other kernel sets; pass: judged flip-aware within the kind's tolerance T")
    print("| config | stage | kernels | rounds | bit for bit | pass (T) | rel_l2 min / median / max | max scale diff "
          "| max rest rel_l2 | max state rel_l2 | flipped codes | max flip | sparse swaps |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in honest_rows:
        print(f"| {r['config']} | {r['stage']} | {r['kernels']} | {r['rounds']} | {r['exact']} "
              f"| {r['passed']} ({r['tolerance']:g}) "
              f"| {_stats(r['rel_l2'])} | {_max(r['scale']):.1e} | {_max(r['rest']):.1e} "
              f"| {_max(r['state']):.1e} | {r['flips']} / {r['codes']} | {r['max_flip']} | {r['swaps']} |")
        for f in r["failures"]:
            print(f"|  | | | | | | failure: {f[:300]} | | | | | | |")
    print()
    print(f"(b) attacks replayed under {FOREIGN}, judged flip-aware within the kind's tolerance T")
    print("| compression | T | attack | scale | cheating rounds caught | honest rounds all pass | rel_l2 of the cheat "
          "| first reason |")
    print("|---|---|---|---|---|---|---|---|")
    for r in attack_rows:
        rels = ", ".join("inf" if x is None else f"{x:.1e}" for x in r["rel_l2"][:2])
        scale = f"{r['scale']:g}" if r["attack"] == "poison" else "-"
        print(f"| {r['kind']} | {r['tolerance']:g} | {r['attack']} | {scale} | {r['caught']} / {r['slots']} | "
              f"{'yes' if r['honest_ok'] else 'NO'} | {rels} | {r['why'][:160]} |")
    for kind in sorted({r["kind"] for r in attack_rows}):
        caught = [r["scale"] for r in attack_rows
                  if r["kind"] == kind and r["attack"] == "poison" and r["caught"] == r["slots"]]
        print(f"smallest poison caught in every round, {kind}: {min(caught):g}" if caught else
              f"smallest poison caught, {kind}: none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="One seed, two kernel sets, three poison scales.")
    ap.add_argument("--json", type=Path, help="Also write every figure to this JSON file.")
    ap.add_argument("--workdir", type=Path, help="Keep the runs here (default: a temporary directory).")
    ap.add_argument("--suggested", action="store_true",
                    help="Judge at the tolerance (a) suggests rather than DEFAULT_TOLERANCE.")
    ap.add_argument("--tolerance", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, None if args.tolerance in (None, "auto") else float(args.tolerance))
        return
    sys.path.insert(0, str(ROOT))
    from lineage.audit.replay import DEFAULT_TOLERANCE, DEFAULT_TOLERANCE_NONE, FLIP_FRACTION

    if args.quick:
        seeds, sets, configs = [0], list(QUICK_SETS), [("quantize-4", 4), ("none", 4)]
        scales, kinds = [1e-2, 1e-4, 1e-6], ["quantize-4"]
    else:
        seeds, sets = [0, 1, 2], list(KERNEL_SETS)
        configs = [("quantize-4", 4), ("none", 4), ("quantize-4", 20), ("none", 20)]
        scales, kinds = [1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6], ["quantize-4", "none"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlx-calibrate-") as tmp:
        root = args.workdir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        honest_rows = honest(root, seeds, sets, configs)
        chosen = choose(honest_rows)
        defaults = {"compressed": DEFAULT_TOLERANCE, "none": DEFAULT_TOLERANCE_NONE, "flips": FLIP_FRACTION}
        tolerances = {k: chosen[k][1] if args.suggested else defaults[k] for k in ("compressed", "none")}
        judge_rows(honest_rows, tolerances)
        attack_rows = attacks(root, scales, kinds, tolerances)
    print_tables(honest_rows, attack_rows)
    for kind, (worst, suggested) in chosen.items():
        what = "flipped fraction of one round's codes" if kind == "flips" else f"judged figure ({kind})"
        print(f"largest honest {what}: {worst:.2e}; x{MARGIN:g} margin suggests {suggested:g}; "
              f"lineage/audit/replay.py has {defaults[kind]:g}")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"honest": honest_rows, "attacks": attack_rows, "chosen": chosen,
                                         "defaults": defaults},
                                        default=str, indent=1) + "\n")


if __name__ == "__main__":
    main()
