"""`dlx plan`: a job's cost at 10, 100 and 1,000 replicas, before it runs (workers/run/plan.py).

    dlx plan examples/tiny.toml                               # the job as written, on H200s
    dlx plan examples/tiny.toml --params 107e9 --stages 40 --link 1Gbps --gpu a100
    dlx plan examples/slow-link.toml --nodes 2 --nodes 16 --gpu cpu --json

Options are read as text and checked here, so every bad value is one line and exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import user_errors

DEFAULT_NODES = ["10", "100", "1000"]


def _number(text: str | None, what: str, low: float, high: float = math.inf, *, open_low: bool = False) -> float | None:
    """`text` as a finite number in [low, high] ((low, high] with `open_low`); None stays None."""
    from trainer.errors import ConfigError

    if text is None:
        return None
    try:
        value = float(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise ConfigError(f"{what}: not a number: {text!r}") from None
    if not math.isfinite(value) or value < low or (open_low and value == low) or value > high:
        side = "(" if open_low else "["
        raise ConfigError(f"{what}: must be in {side}{low:g}, {high:g}] (got {text})")
    return value


def _hardware(text: str | None, what: str) -> Any:
    from trainer.errors import ConfigError
    from workers.run.plan import HARDWARE

    if text is None:
        return None
    hw = HARDWARE.get(text.strip().lower())
    if hw is None:
        raise ConfigError(f"{what}: unknown device {text!r} (one of {', '.join(sorted(HARDWARE))})")
    return hw


def _link_per(text: str | None) -> str:
    from trainer.errors import ConfigError

    if text is None:
        return "rank"
    if text not in ("rank", "replica"):
        raise ConfigError(f"--link-per: rank or replica (got {text!r})")
    return text


def _job(job_file: Path, params: str | None, stages: str | None) -> tuple[Any, list[str]]:
    """The job file, with --params (a llama of that size) and --stages applied and the
    result validated again as a job; and what was changed to make it valid."""
    from trainer.config import JobConfig, load_job
    from workers.run.jobfile import load_job_file
    from workers.run.plan import parse_count, scaled_llama

    job = load_job_file(job_file)
    if params is None and stages is None:
        return job, []
    data = {k: v for k, v in job.model_dump(mode="json").items() if k in JobConfig.model_fields}
    notes = []
    S = parse_count(stages, "--stages") if stages is not None else job.parallel.stages
    if stages is not None:
        data["parallel"]["stages"] = S
        if job.parallel.schedule == "1F1B" and job.parallel.microbatches < S:
            data["parallel"]["microbatches"] = S
            notes.append(f"parallel.microbatches {job.parallel.microbatches} -> {S} (1F1B needs at least one a stage)")
    if params is not None:
        model = scaled_llama(job.model, parse_count(params, "--params"), S)
        data["model"] = model.model_dump(mode="json", exclude={"init"})
        notes.append(f"model: a llama of {model.n_params():,} parameters (d {model.d_model}, {model.n_layers} layers, "
                     f"{model.n_heads} heads, {model.kv_heads} key/value heads, SwiGLU {model.ffn_size})")
    return load_job(data), notes


def _assumptions(job: Any, o: dict[str, Any]) -> Any:
    """The options as `workers.run.plan.Assumptions`: the job's link where none is given, the
    model's defaults for the rest."""
    from workers.run.plan import Assumptions, parse_count, parse_rate

    given: dict[str, Any] = {
        "hardware": _hardware(o["gpu"], "--gpu"),
        "mfu": _number(o["mfu"], "--mfu", 0.0, 1.0, open_low=True),
        "tokens_per_s": _number(o["tokens_per_s"], "--tokens-per-s", 0.0, open_low=True),
        "link_bps": parse_rate(o["link"]) if o["link"] is not None else job.transport.bandwidth_mbps * 1e6,
        "link_per": _link_per(o["link_per"]),
        "latency_s": _number(o["latency_ms"], "--latency-ms", 0.0),
        "block_time_s": _number(o["block_time"], "--block-time", 0.0),
        "block_gas": parse_count(o["block_gas"], "--block-gas") if o["block_gas"] is not None else None,
        "store_bytes_per_s": _number(o["store_rate"], "--store-rate", 0.0, open_low=True),
        "verify_fraction": _number(o["verify"], "--verify", 0.0, 1.0),
        "verifier": _hardware(o["verifier"], "--verifier"),
    }
    if given["latency_s"] is None:
        given["latency_s"] = job.transport.latency_ms
    given["latency_s"] /= 1e3  # ms
    if given["store_bytes_per_s"] is not None:
        given["store_bytes_per_s"] *= 2**20  # MiB/s
    keep = ("mfu", "tokens_per_s", "verifier")  # None means "not stated" there
    return Assumptions(**{k: v for k, v in given.items() if v is not None or k in keep})


@user_errors
def plan(
    job_file: Annotated[Path, typer.Argument(help="Job file (TOML), e.g. examples/tiny.toml.")],
    params: Annotated[str | None, typer.Option("--params", help="Plan a llama of about this many parameters (107e9, 7B, 11.2M) with the job's vocabulary and context, instead of the job's model.")] = None,
    nodes: Annotated[list[str] | None, typer.Option("--nodes", help="Replica counts to plan (repeat the option; default 10, 100 and 1,000).")] = None,
    stages: Annotated[str | None, typer.Option("--stages", help="Pipeline stages per replica (default: the job's).")] = None,
    link: Annotated[str | None, typer.Option("--link", help="Link bandwidth of each rank to the other replicas, e.g. 1Gbps, 100Mbps (default: the job's \\[transport] bandwidth_mbps).")] = None,
    link_per: Annotated[str | None, typer.Option("--link-per", help="rank: each stage's exchange has a link of --link to itself (the trainer's \\[transport] model); replica: a replica's stages share one link of --link (a node's one NIC).")] = None,
    latency_ms: Annotated[str | None, typer.Option("--latency-ms", help="One-way latency per ring hop, ms (default: the job's).")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="Device per rank: h200, h100, a100 (a800), cpu (default h200).")] = None,
    mfu: Annotated[str | None, typer.Option("--mfu", help="Model-FLOP utilisation, (0, 1] (default 0.40 on GPUs, below the 0.43-0.46 an H200 measured for 0.8B-2.6B llamas; 1 on cpu, whose figure is measured).")] = None,
    tokens_per_s: Annotated[str | None, typer.Option("--tokens-per-s", help="A measured throughput per replica (tokens/s), in place of the FLOP model.")] = None,
    block_time: Annotated[str | None, typer.Option("--block-time", help="Seconds per block of the chain (default 12, Ethereum's slot; dlx train's anvil mines at once: 0).")] = None,
    block_gas: Annotated[str | None, typer.Option("--block-gas", help="Gas a block holds (default 30M, anvil's).")] = None,
    store_rate: Annotated[str | None, typer.Option("--store-rate", help="Blockstore write rate, MiB/s (default 236, measured by scripts/bench_cas.py here).")] = None,
    verify: Annotated[str | None, typer.Option("--verify", help="Fraction of (step, replica) rounds a verifier replays, [0, 1] (default 0.05).")] = None,
    verifier: Annotated[str | None, typer.Option("--verifier", help="The verifier's device (default: the training device).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Model what JOB_FILE costs at each replica count: round time and what binds it
    (compute, link, chain or storage), bytes sent, commit gas and bytes stored per step and
    per day, and the verifier's replay cost. Exchange and storage bytes are exact (the
    trainer's own layouts); compute, chain and storage rates are measured or stated."""
    from workers.run.plan import parse_count, plan_job

    job, changed = _job(job_file, params, stages)
    counts = [parse_count(n, "--nodes") for n in (nodes or DEFAULT_NODES)]
    options = {"gpu": gpu, "link": link, "link_per": link_per, "latency_ms": latency_ms, "mfu": mfu, "tokens_per_s": tokens_per_s,
               "block_time": block_time, "block_gas": block_gas, "store_rate": store_rate, "verify": verify,
               "verifier": verifier}
    result = plan_job(job, _assumptions(job, options), counts)
    result.notes = changed + result.notes
    if as_json:
        sys.stdout.write(json.dumps(result.as_json(), indent=2) + "\n")
        return
    sys.stdout.write(render(result, job) + "\n")


# -- the text report ---------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    if math.isinf(s):
        return "never"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3)):
        if s >= size:
            return f"{s / size:.3g} {unit}"
    return "0 s" if s == 0 else f"{s * 1e6:.3g} us"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _flops(n: float) -> str:
    return f"{n / 1e9:,.4g} GFLOP" if n >= 1e9 else f"{n / 1e6:,.4g} MFLOP"


def _header(p: Any, job: Any) -> list[str]:
    from workers.run.plan import COMMIT_GAS_AT_4, COMMIT_GAS_PER_ATTESTATION

    a, sh, o, c = p.assumptions, p.shape, job.outer, job.outer.compression
    m = job.model
    size = f"{p.params / 1e9:.3g}B" if p.params >= 1e9 else f"{p.params / 1e6:.3g}M"
    rule = ("AllReduce every inner step" if job.parallel.sync == "allreduce" else "synchronous (delay 0)"
            if o.delay == 0 else f"delay 1, {o.overlap}" + (f", tau {o.tau}" if o.overlap == "partial" else ""))
    kind = c.kind + (f" {c.bits} bits" if c.kind in ("quantize", "lowrank", "sparse") else "")
    kind += f" {c.coding}" if c.coding != "fixed" else ""
    bits = 8 * sum(sh.payload) / max(1, p.params)
    if a.tokens_per_s is not None:
        rate = f"{a.tokens_per_s:,.0f} tokens/s a replica (stated)"
    else:
        rate = (f"{a.hardware.name}, {a.hardware.tflops:.4g} TFLOP/s x utilisation {a.utilisation:g} "
                f"({'stated' if a.mfu is not None else 'default'}; {a.hardware.source})")
    return [
        f"plan {p.job}: {m.family} {size} parameters ({p.params:,}), {_flops(sh.flops_per_token)} a token "
        f"(6N + 12 L d T), {p.stages} stages x {job.parallel.microbatches} microbatches, H = {o.inner_steps} inner steps "
        f"of {sh.tokens_per_inner_step:,} tokens a replica",
        f"compute: {rate}",
        f"exchange: {kind}, {rule}, {o.fragments} fragment(s); a replica's contribution {_bytes(sum(sh.payload))} a round "
        f"({bits:.3g} bits a parameter; exact: trainer/compress.py's layout); ring all-gather, link "
        f"{a.link_bps / 1e9:g} Gbit/s a {a.link_per}, {a.latency_s * 1e3:g} ms a hop",
        f"stored a step: shards {_bytes(sum(sh.shard))} + R x (contributions {_bytes(sum(sh.payload))} + round-start "
        f"states {_bytes(sum(sh.start_state))}) (exact: workers/run/sink.py's blocks), written at "
        f"{a.store_bytes_per_s / 2**20:.0f} MiB/s",
        f"chain: commitStep {COMMIT_GAS_AT_4:,} gas + {COMMIT_GAS_PER_ATTESTATION:,} per attestation past 4 (measured), "
        f"R x {p.stages} attestations; "
        f"{a.block_time_s:g} s blocks, {a.block_gas:,} gas a block (assumed); verifier replays "
        f"{a.verify_fraction:g} of the rounds on {(a.verifier or a.hardware).name}",
    ]


def render(p: Any, job: Any) -> str:
    """The plan as text: the assumptions, a table per step, a table per day, the notes."""
    from workers.run.plan import DAY

    lines = _header(p, job)
    lines += ["", "per outer step:", "",
              "| replicas | compute | exchange (hidden) | round | chain | storage | binds | sent a rank | sent, all ranks | commit gas | stored |",
              "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in p.rows:
        lines.append(f"| {r.replicas:,} | {_seconds(r.compute_s)} | {_seconds(r.link_s)} ({_seconds(min(r.link_s, r.window_s))}) "
                     f"| {_seconds(r.round_s)} | {_seconds(r.chain_s)} | {_seconds(r.storage_s)} | {r.binds} "
                     f"| {_bytes(r.link_bytes_per_rank)} | {_bytes(r.bytes_sent)} | {r.gas:,} | {_bytes(r.stored)} |")
    lines += ["", "per day:", "",
              "| replicas | steps | tokens | sent | gas | of the chain | stored | verify GPU-h | AllReduce round / this round |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    a = p.assumptions
    capacity = a.block_gas * DAY / a.block_time_s if a.block_time_s else 0.0  # gas a day the chain holds
    for r in p.rows:
        speedup = r.allreduce_round_s / r.round_s if r.round_s else 1.0
        share = f"{100 * r.per_day(r.gas) / capacity:.3g}%" if capacity else "-"
        lines.append(f"| {r.replicas:,} | {r.steps_per_day:,.4g} | {_count(r.tokens_per_day)} | {_bytes(r.per_day(r.bytes_sent))} "
                     f"| {_count(r.per_day(r.gas))} | {share} | {_bytes(r.per_day(r.stored))} "
                     f"| {r.per_day(r.verify_gpu_s) / 3600:,.3g} | {speedup:,.3g} |")
    if p.notes:
        lines += [""] + [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
