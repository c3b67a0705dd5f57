"""What a job would cost at scale, before it runs: the model behind `dlx plan`.

    plan = plan_job(job, Assumptions(hardware=HARDWARE["h200"], link_bps=1e9), nodes=[10, 100, 1000])

Every figure is one of three kinds, and the report says which:

- exact, from the code that does the work: the bytes of each contribution (the layout
  `trainer.compress` writes, safetensors header included, for every tensor of every stage
  as `trainer.model` builds it, fragment by fragment as `trainer.diloco.fragment_groups`
  cuts them), what `trainer.transport` counts a ring all-gather as sending, and what
  `workers.run.sink` stores per step (stage shards, contributions, round-start states);
- measured here and stated as such: commitStep's gas (`forge test --gas-report`), the
  blockstore's write rate (`scripts/bench_cas.py`), one CPU core's throughput, the gaps
  layout's bits per value, an H200's small-model throughput;
- assumed and stated: GPU peak TFLOP/s (datasheets) times a model-FLOP utilisation, the
  chain's block time and gas limit, the fraction of rounds a verifier replays.

The time of one outer step (a round) is its compute, H inner steps, plus whatever part of
the exchange the overlap rule does not hide: none with `delay = 0`, the first tau inner
steps of the next round under the partial rule (tau = auto: at most a quarter of F
rounds), the whole next round under eager and restart. The chain and the blockstore work
beside the ranks (`dlx train`'s parent process commits and stores each step while they
train the next), so they bind only when a step takes them longer than a round.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import ValidationError

from trainer.config import MAX_PARAMS, CompressionConfig, JobConfig, LlamaConfig, ModelConfig
from trainer.errors import ConfigError

__all__ = [
    "HARDWARE",
    "Assumptions",
    "Hardware",
    "Plan",
    "Row",
    "commit_gas",
    "flops_per_token",
    "parse_count",
    "parse_rate",
    "payload_bytes",
    "plan_job",
    "safetensors_bytes",
    "scaled_llama",
    "stage_shapes",
    "start_state_bytes",
]


@dataclass(frozen=True)
class Hardware:
    """One device a rank computes on."""

    key: str
    name: str
    tflops: float  # peak dense bf16 TFLOP/s (the CPU: measured float32 TFLOP/s of one core)
    memory_gb: float  # device memory (0: not checked)
    mfu: float  # the default model-FLOP utilisation
    source: str


#: The one CPU figure measured here: gpt-small (502,848 parameters, T = 64, 3.31 MFLOP a token
#: by `flops_per_token`) ran an inner step of 8 x 64 tokens in 23.4 ms per replica, one core
#: each (docs/benchmarks.md, "DiLoCoX benchmark", 2026-12-03): 72.5 GFLOP/s.
CPU_TFLOPS = 8 * 64 * (6 * 502_848 + 12 * 4 * 96 * 64) / 0.0234 / 1e12
#: The default for GPUs, below what an H200 measured here (2026-12-04, torch 2.11.0+cu130): a
#: plain bf16-autocast llama training loop (eager PyTorch, SDPA attention, AdamW; not the
#: trainer's rank loop) ran 0.84B parameters (B 8 x T 2048) at 456 model TFLOP/s, 0.46 of the
#: 989 peak, and 2.6B (B 4 x T 2048) at 425, 0.43. A pipeline's bubble is counted apart.
GPU_MFU = 0.40
HARDWARE = {
    "h200": Hardware("h200", "NVIDIA H200", 989.0, 141.0, GPU_MFU,
                     "bf16 dense peak 989 TFLOP/s (datasheet; bf16 matrix products measured on this "
                     "project's H200 at about 790)"),
    "h100": Hardware("h100", "NVIDIA H100 SXM", 989.0, 80.0, GPU_MFU, "bf16 dense peak 989 TFLOP/s (datasheet)"),
    "a100": Hardware("a100", "NVIDIA A100/A800", 312.0, 80.0, GPU_MFU,
                     "bf16 dense peak 312 TFLOP/s (datasheet; the A800 computes as the A100)"),
    "cpu": Hardware("cpu", "one CPU core", CPU_TFLOPS, 0.0, 1.0,
                    f"measured: {CPU_TFLOPS * 1e3:.1f} GFLOP/s float32 per core (gpt-small's inner step, "
                    "docs/benchmarks.md, DiLoCoX benchmark); utilisation 1: the figure is already a measured one"),
}
HARDWARE["a800"] = HARDWARE["a100"]
#: Measured on this project's H200 (docs/models.md): llama 11.2M, bf16, B = 32 x T = 512 ran
#: 322,457 tokens/s = 27.0 model TFLOP/s, 2.7% of peak: a model this small is launch-bound.
SMALL_MODEL_NOTE = ("models this small are launch-bound: an H200 ran llama 11.2M at 322,457 tokens/s = "
                    "27.0 TFLOP/s, 2.7% of peak (measured); pass --mfu 0.027 or --tokens-per-s")

#: commitStep's gas per transaction, base and calldata included, steady state (the same signers
#: as the step before), measured by `forge test --gas-report` (docs/ledger.md):
#: 148,078 with 4 attestations, 12,994 for each further one (the IR pipeline, issue 35;
#: 150,429 and 13,482 before).
COMMIT_GAS_AT_4, COMMIT_GAS_PER_ATTESTATION = 148_078, 12_994
LEDGER_MAX_REPLICAS = 256  # TrainingLedger._MAX_REPLICAS: createRun refuses more
#: `scripts/bench_cas.py`: adding a 256 MiB file to the blockstore ran at 236-243 MiB/s here.
STORE_BYTES_PER_S = 236 * 2**20
#: The gaps layout's stream, bits per value: data-dependent, so measured, not derived. Over the
#: benchmark's whole runs (docs/dilocox_target_runs.json, docs/dilocox_fragment_runs.json) it
#: was 1.01-1.02 on gpt-small and 0.95 on llama-4x; a run's first steps send more (1.1-1.4);
#: 2 is its ceiling.
GAPS_BITS_PER_VALUE = 1.0
ONE_D_BITS = 8  # trainer.compress.ONE_D_BITS: norms and biases of the non-quantize kinds
TAU_AUTO_MAX_FRACTION = 0.25  # trainer.engine: tau = auto overlaps at most a quarter of F rounds
LENGTH_HEADER = 8  # trainer.transport.HEADER_BYTES: sent ahead of every blob
DAY = 86_400.0

Entry = tuple[str, str, tuple[int, ...]]  # (name, safetensors dtype, shape)


@dataclass(frozen=True)
class Assumptions:
    """Everything the plan takes beyond the job file (the CLI's options)."""

    hardware: Hardware = HARDWARE["h200"]
    mfu: float | None = None  # None: the hardware's default
    tokens_per_s: float | None = None  # a measured throughput per replica, in place of FLOPs
    link_bps: float = 1e9  # each way: a rank's own link, or with link_per = "replica" one link its stages share
    link_per: str = "rank"  # "rank": each stage's exchange has the whole link; "replica": the S share it
    latency_s: float = 0.0  # per ring hop
    block_time_s: float = 12.0
    confirmations: int = 1
    block_gas: int = 30_000_000
    store_bytes_per_s: float = STORE_BYTES_PER_S
    verify_fraction: float = 0.05
    verifier: Hardware | None = None  # None: the training hardware
    gaps_bits: float = GAPS_BITS_PER_VALUE

    @property
    def utilisation(self) -> float:
        return self.hardware.mfu if self.mfu is None else self.mfu

    def rank_bps(self, stages: int) -> float:
        """The bandwidth one rank's exchange gets (the S stages exchange at once)."""
        return self.link_bps / (stages if self.link_per == "replica" else 1)


# -- parsing the CLI's quantities -----------------------------------------------------------

_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"([0-9][0-9,_]*\.?[0-9]*(?:e[+-]?[0-9]+)?)"


def parse_count(text: str, what: str) -> int:
    """"107e9", "107B", "11.2M", "1k", "1,000" -> an integer >= 1; ConfigError otherwise."""
    m = re.fullmatch(_NUMBER + r"\s*([kmbgt]?)", text.strip(), re.IGNORECASE)
    if not m:
        raise ConfigError(f"{what}: not a count: {text!r} (e.g. 1000, 1k, 107e9, 107B)")
    value = float(m.group(1).replace(",", "").replace("_", "")) * _SCALE[m.group(2).lower()]
    if not math.isfinite(value) or value < 1 or value != round(value):
        raise ConfigError(f"{what}: must be a whole number >= 1 (got {text!r})")
    return int(value)


def parse_rate(text: str, what: str = "--link") -> float:
    """"1Gbps", "100 Mbit/s", "10gbps" -> bits per second; ConfigError otherwise."""
    m = re.fullmatch(_NUMBER + r"\s*([kmgt]?)(?:bps|bit/s|b/s)", text.strip(), re.IGNORECASE)
    if not m:
        raise ConfigError(f"{what}: not a bit rate: {text!r} (e.g. 1Gbps, 100Mbps)")
    value = float(m.group(1).replace(",", "").replace("_", "")) * _SCALE[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{what}: must be > 0 (got {text!r})")
    return value


# -- the model's shape -------------------------------------------------------------------------


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token: 6N + 12 L d T (forward and backward; the attention term
    PaLM's appendix gives, what scripts/gpu_check counts)."""
    return 6.0 * model.n_params() + 12.0 * model.n_layers * model.d_model * model.seq_len


def scaled_llama(model: ModelConfig, params: int, stages: int = 1) -> LlamaConfig:
    """A llama of about `params` parameters with the job's vocabulary, context and dtype.
    For each width d (by 64 below 1024, head size 64; then by 1024, head size 128, 8 query
    heads per key/value head where the heads allow it), n_layers = max(2, stages, d / 100)
    (Qwen1.5-110B and Llama-2-70B are 8192 / 80) and the SwiGLU width (a multiple of 64)
    that brings the count to `params`; the width whose SwiGLU is nearest 8/3 d (Llama's
    ratio) wins. ConfigError if no shape comes within 5% of `params`."""
    if params > MAX_PARAMS:
        raise ConfigError(f"--params {params:,}: more than the {MAX_PARAMS / 1e9:,.0f}B parameters a job may have")
    best: tuple[float, LlamaConfig] | None = None
    for d in [*range(64, 1024, 64), *range(1024, 65536 + 1, 1024)]:
        heads = d // 128 if d >= 1024 else d // 64
        base = {"family": "llama", "vocab_size": model.vocab_size, "d_model": d, "n_heads": heads,
                "n_kv_heads": heads // 8 if heads % 8 == 0 else heads, "seq_len": model.seq_len,
                "dtype": model.dtype, "n_layers": max(2, stages, round(d / 100))}
        try:
            at64 = ModelConfig.model_validate({**base, "intermediate_size": 64}).n_params()
            per64 = ModelConfig.model_validate({**base, "intermediate_size": 128}).n_params() - at64
        except ValidationError:  # past the largest model a job may describe
            break
        if at64 > params:  # wider only grows
            break
        ffn = 64 * (1 + round((params - at64) / per64))
        if not d // 2 <= ffn <= 16 * d:
            continue
        try:
            cfg = LlamaConfig.model_validate({**base, "intermediate_size": ffn})
        except ValidationError:
            continue
        key = abs(math.log(ffn / d / (8 / 3)))
        if abs(cfg.n_params() - params) <= 0.05 * params and (best is None or key < best[0]):
            best = (key, cfg)
    if best is None:
        raise ConfigError(f"--params {params:,}: no llama of vocabulary {model.vocab_size} and at least "
                          f"{max(2, stages)} layers comes near it")
    return best[1]


def stage_shapes(model: ModelConfig, stages: int) -> list[dict[str, tuple[int, ...]]]:
    """Each stage's parameter names and shapes, from the trainer's own modules built on the
    meta device (no memory, any size)."""
    import torch

    from trainer.model import build_model

    cfg = model.model_copy(update={"init": None})
    with torch.device("meta"):
        full: Any = build_model(cfg, seed=0)
        return [{n: tuple(p.shape) for n, p in full.stage(s, stages).named_parameters()}
                for s in range(stages)]


# -- bytes, exactly as the trainer writes them -------------------------------------------------

_ITEMSIZE = {"I64": 8, "F64": 8, "F32": 4, "I32": 4, "U8": 1}
#: trainer.tensorbytes' data order (the safetensors library's dtype order), then by name.
_LAYOUT = {code: i for i, code in enumerate(["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"])}


def safetensors_bytes(entries: list[Entry]) -> int:
    """The length of `trainer.tensorbytes.encode` of tensors with these names, dtypes and
    shapes: the 8-byte header length, the JSON header padded to a multiple of 8, the data."""
    header, offset = 2, 0
    for i, (name, code, shape) in enumerate(sorted(entries, key=lambda e: (_LAYOUT[e[1]], e[0]))):
        size = _ITEMSIZE[code] * math.prod(shape)
        dims = ",".join(str(d) for d in shape)
        header += len(f'"{name}":{{"dtype":"{code}","shape":[{dims}],"data_offsets":[{offset},{offset + size}]}}')
        header += 1 if i else 0  # the comma
        offset += size
    return 8 + header + (-header % 8) + offset


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """trainer.compress_bits.as_matrix_shape: (shape[0], rest) for >= 2-D, (1, n) for 1-D."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


def _quantised(name: str, m: int, n: int, bits: int) -> list[Entry]:
    return [(f"meta/{name}", "I32", (3,)), (f"q/{name}", "U8", (m, math.ceil(n * bits / 8))),
            (f"q_scale/{name}", "F32", (m,))]


def _tensor_payload(name: str, shape: tuple[int, ...], c: CompressionConfig) -> tuple[list[Entry], int]:
    """One tensor's entries in a contribution, and the values it adds to the gaps stream."""
    from trainer.compress import sparse_k

    if c.kind == "none":
        return [(f"delta/{name}", "F32", shape)], 0
    m, n = _matrix(shape)
    if len(shape) < 2 or c.kind == "quantize":
        if c.kind == "quantize" and c.coding == "gaps":
            return [(f"meta/{name}", "I32", (3,)), (f"q_scale/{name}", "F32", (m,))], m * n
        return _quantised(name, m, n, c.bits if c.kind == "quantize" else ONE_D_BITS), 0
    if c.kind == "sparse":
        chunk = min(c.chunk, m * n)
        k, groups, width = sparse_k(c.density, chunk), math.ceil(m * n / chunk), max(1, (chunk - 1).bit_length())
        return [(f"meta/{name}", "I32", (4,)), (f"sp/{name}", "U8", (groups, math.ceil(k * c.bits / 8))),
                (f"sp_scale/{name}", "F32", (groups,)),
                (f"sp_idx/{name}", "U8", (math.ceil(groups * k * width / 8),))], 0
    if c.kind == "lowrank":
        r = min(c.rank, m, n)
        return [(f"meta/{name}", "I32", (3,)), (f"u/{name}", "U8", (r, math.ceil(m * c.bits / 8))),
                (f"u_scale/{name}", "F32", (r,)), (f"v/{name}", "U8", (r, math.ceil(n * c.bits / 8))),
                (f"v_scale/{name}", "F32", (r,))], 0
    # adaptive: the rule sends a matrix whole at 4 bits unless its factors or top-k cost less
    # (step 3), so 4 bits is the ceiling of what it sends (short of 8-bit factors).
    return _quantised(name, m, n, 4), 0


def payload_bytes(shapes: dict[str, tuple[int, ...]], c: CompressionConfig,
                  gaps_bits: float = GAPS_BITS_PER_VALUE) -> int:
    """The bytes of one contribution of these tensors (a stage, or one of its fragments):
    exact but for the gaps stream (`gaps_bits` a value) and adaptive (its 4-bit ceiling)."""
    entries: list[Entry] = []
    values = 0
    for name in sorted(shapes):
        if math.prod(shapes[name]) == 0:
            continue
        more, count = _tensor_payload(name, shapes[name], c)
        entries += more
        values += count
    if values:
        entries += [("gaps/stream", "U8", (math.ceil(values * gaps_bits / 8),)), ("gaps/meta", "I64", (3,))]
    return safetensors_bytes(entries)


def start_state_bytes(shapes: dict[str, tuple[int, ...]], job: JobConfig, kernels_len: int = 45) -> int:
    """One rank's round-start state (`trainer.rounds.round_state`) once its inner optimizer
    has state (every round but a run's first): weights, AdamW's two moments and step,
    the compressor's residual, bits and warm starts, its generator, the round counters and
    the kernel fingerprint (`kernels_len` bytes: 45 on this machine)."""
    c, outer = job.outer.compression, job.outer
    entries: list[Entry] = [("round/outer_step", "I64", (1,)), ("round/inner_step", "I64", (1,)),
                            ("round/kernels", "U8", (kernels_len,)), ("compress/rng", "U8", (5056,)),
                            ("compress/ease", "F64", (1,))]
    if outer.delay == 1 and outer.overlap == "partial":
        entries.append(("round/merge_step", "I64", (1,)))
    if c.kind == "adaptive":
        entries.append(("compress/prev_loss", "F64", (1,)))
    residual = c.kind != "none" and c.error_feedback
    for n, shape in shapes.items():
        entries += [(f"param/{n}", "F32", shape), (f"compress/bits/{n}", "I32", (1,)),
                    (f"compress/residual/{n}", "F32", shape if residual else (0,))]
        if job.inner.optimizer == "adamw":
            entries += [(f"inner/exp_avg/{n}", "F32", shape), (f"inner/exp_avg_sq/{n}", "F32", shape),
                        (f"inner/step/{n}", "F32", ())]
        if len(shape) >= 2 and c.kind in ("lowrank", "adaptive"):
            m, cols = _matrix(shape)
            entries.append((f"compress/warm/{n}", "F32", (cols, min(c.rank if c.kind == "lowrank" else c.max_rank, m, cols))))
    return safetensors_bytes(entries)


def shard_bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    """A stage shard: the outer weights and the outer momentum, float32."""
    return safetensors_bytes([(f"{k}/{n}", "F32", s) for n, s in shapes.items() for k in ("param", "momentum")])


def commit_gas(attestations: int) -> int:
    """commitStep's gas with this many attestations (linear in them, as measured)."""
    return COMMIT_GAS_AT_4 + COMMIT_GAS_PER_ATTESTATION * (attestations - 4)


def _manifest_bytes(replicas: int, stages: int) -> int:
    """A step's DAG-CBOR manifest, about: 40 bytes per CID link (stages, contributions and
    start states) and 34 per data digest, plus about 1.5 kB of config link, code hash and
    metrics. Under 0.01% of a step of any model worth planning."""
    return 1500 + 40 * (stages + 2 * replicas * stages) + 34 * replicas


# -- per job: what does not depend on the replica count ----------------------------------------


@dataclass
class Shape:
    """The job's per-stage figures (replica-count independent)."""

    params: int
    stage_params: list[int]
    flops_per_token: float
    tokens_per_inner_step: int  # per replica
    payload: list[float]  # per stage: mean contribution bytes per round (over the F fragments)
    payload_max: list[int]  # per stage: the largest fragment's
    shard: list[int]
    start_state: list[int]
    state_per_param: float  # training memory per parameter of a rank (bytes)


def job_shape(job: JobConfig, gaps_bits: float = GAPS_BITS_PER_VALUE) -> Shape:
    from trainer.diloco import fragment_groups
    from trainer.kernels import kernel_fingerprint

    S, F = job.parallel.stages, job.outer.fragments
    shapes = stage_shapes(job.model, S)
    kernels = len(kernel_fingerprint().encode())
    c = job.outer.compression
    payload, payload_max = [], []
    for stage in shapes:
        if job.parallel.sync == "allreduce":
            sizes = [safetensors_bytes([])]
        else:
            sizes = [payload_bytes({n: stage[n] for n in group}, c, gaps_bits)
                     for group in fragment_groups(stage, F)]
        payload.append(sum(sizes) / len(sizes))
        payload_max.append(max(sizes))
    compressed_ef = c.kind != "none" and c.error_feedback
    return Shape(
        params=job.model.n_params(),
        stage_params=[sum(math.prod(s) for s in stage.values()) for stage in shapes],
        flops_per_token=flops_per_token(job.model),
        tokens_per_inner_step=job.data.batch_size * job.model.seq_len,
        payload=payload, payload_max=payload_max,
        shard=[shard_bytes(stage) for stage in shapes],
        start_state=[0 if job.parallel.sync == "allreduce" else start_state_bytes(stage, job, kernels)
                     for stage in shapes],
        # weights, gradients, AdamW's two moments; the outer copy and momentum; the residual
        state_per_param=16.0 + (0.0 if job.parallel.sync == "allreduce" else 8.0 + 4.0 * compressed_ef),
    )


# -- per replica count ---------------------------------------------------------------------


@dataclass
class Row:
    """One replica count's plan. Times in seconds, sizes in bytes, per outer step unless
    the name says per day."""

    replicas: int
    inner_step_s: float
    compute_s: float
    link_s: float  # the whole exchange, slowest stage
    window_s: float  # how much of it the overlap rule hides
    exposed_s: float  # what the round waits for it
    round_s: float  # compute + exposed
    chain_s: float
    storage_s: float
    step_s: float  # the period: the largest of round, chain and storage
    binds: str
    link_bytes_per_rank: float  # the busiest rank's, one step
    bytes_sent: float  # every rank, one step (the metric `bytes_sent` grows by this)
    gas: int
    stored: float
    stored_parts: dict[str, float]
    allreduce_round_s: float
    verify_gpu_s: float  # the verifier's device-seconds per step
    steps_per_day: float = 0.0
    tokens_per_day: float = 0.0
    notes: list[str] = field(default_factory=list)

    def per_day(self, per_step: float) -> float:
        return per_step * self.steps_per_day


def _inner_step_s(job: JobConfig, shape: Shape, a: Assumptions) -> float:
    """One inner step of one replica: its FLOPs over the stages' devices at the stated
    utilisation, stretched by the pipeline's fill and drain ((M + S - 1) / M), or a stated
    measured throughput."""
    if a.tokens_per_s is not None:
        return shape.tokens_per_inner_step / a.tokens_per_s
    S, M = job.parallel.stages, job.parallel.microbatches
    flops = shape.tokens_per_inner_step * shape.flops_per_token
    return flops / (S * a.hardware.tflops * 1e12 * a.utilisation) * (M + S - 1) / M


def _window_steps(job: JobConfig) -> int:
    """Inner steps of the next round the exchange may run behind (trainer/diloco.py)."""
    o, H = job.outer, job.outer.inner_steps
    if job.parallel.sync == "allreduce" or o.delay == 0:
        return 0
    if o.overlap != "partial":
        return H  # eager, restart: the whole next round
    if o.tau == "auto":
        return max(1, min(H, int(o.fragments * H * TAU_AUTO_MAX_FRACTION)))
    return o.tau


def _allreduce_step_s(shape: Shape, R: int, a: Assumptions) -> float:
    """One inner step's gradient all-reduce (ring, float32) on the slowest stage."""
    if R == 1:
        return 0.0
    busiest = max(2 * (R - 1) / R * 4 * n for n in shape.stage_params)
    return 2 * (R - 1) * a.latency_s + busiest * 8 / a.rank_bps(len(shape.stage_params))


def plan_row(job: JobConfig, shape: Shape, R: int, a: Assumptions) -> Row:
    S, H = job.parallel.stages, job.outer.inner_steps
    t_inner = _inner_step_s(job, shape, a)
    compute = H * t_inner
    if job.parallel.sync == "allreduce":
        per_rank = [2 * (R - 1) / R * 4 * n * H for n in shape.stage_params]
        link = H * _allreduce_step_s(shape, R, a)
    else:  # the ring all-gather of blobs: each rank forwards the R - 1 others
        per_rank = [(R - 1) * (p + LENGTH_HEADER) for p in shape.payload]
        link = max((R - 1) * a.latency_s + (R - 1) * (p + LENGTH_HEADER) * 8 / a.rank_bps(S)
                   for p in shape.payload_max) if R > 1 else 0.0
    window = _window_steps(job) * t_inner
    exposed = link if job.parallel.sync == "allreduce" else max(0.0, link - window)
    gas = commit_gas(R * S)
    # dlx train's sink sends one commitStep a step and waits for it: a block a step at best;
    # a step whose commit no block can hold is never committed.
    chain = a.block_time_s * max(1, a.confirmations) if gas <= a.block_gas else math.inf
    parts = {"shards": float(sum(shape.shard)), "contributions": R * sum(shape.payload),
             "start states": float(R * sum(shape.start_state)), "manifest": float(_manifest_bytes(R, S))}
    stored = sum(parts.values())
    storage = stored / a.store_bytes_per_s
    round_s = compute + exposed
    step_s = max(round_s, chain, storage)
    binds = ("storage" if step_s == storage and storage > round_s else
             "chain" if step_s == chain and chain > round_s else
             "link" if exposed > 0.05 * round_s else "compute")
    speed = (a.verifier or a.hardware).tflops / a.hardware.tflops  # the verifier at the same utilisation
    row = Row(replicas=R, inner_step_s=t_inner, compute_s=compute, link_s=link, window_s=window,
              exposed_s=exposed, round_s=round_s, chain_s=chain, storage_s=storage, step_s=step_s,
              binds=binds, link_bytes_per_rank=max(per_rank) if R > 1 else 0.0,
              bytes_sent=R * sum(per_rank), gas=gas, stored=stored, stored_parts=parts,
              allreduce_round_s=H * (t_inner + _allreduce_step_s(shape, R, a)),
              verify_gpu_s=a.verify_fraction * R * S * compute / speed)
    row.steps_per_day = DAY / step_s if math.isfinite(step_s) else 0.0
    row.tokens_per_day = row.steps_per_day * R * H * shape.tokens_per_inner_step
    row.notes = _row_notes(row, S, a)
    return row


def _row_notes(row: Row, S: int, a: Assumptions) -> list[str]:
    notes = []
    if row.binds == "storage":
        notes.append(f"R = {row.replicas}: storage binds; {row.stored / row.round_s / 1e6:,.0f} MB/s would keep "
                     "up with the rounds (--store-rate; [storage] keep prunes old states, but every step writes them)")
    if row.replicas > LEDGER_MAX_REPLICAS:
        notes.append(f"R = {row.replicas}: the ledger takes at most {LEDGER_MAX_REPLICAS} replicas a run "
                     "(createRun reverts LedgerInvalidShape); the chain figures are for a ledger without the cap")
    if row.gas > a.block_gas:
        notes.append(f"R = {row.replicas}: commitStep's {row.gas:,} gas ({row.replicas * S} attestations) is more "
                     f"than a block's {a.block_gas:,}: no block can hold the step")
    return notes


# -- the whole plan ----------------------------------------------------------------------------


@dataclass
class Plan:
    job: str
    model: dict[str, Any]
    params: int
    stages: int
    shape: Shape
    assumptions: Assumptions
    rows: list[Row]
    notes: list[str]

    def as_json(self) -> dict[str, Any]:
        a = asdict(self.assumptions)
        a["utilisation"] = self.assumptions.utilisation
        return {"job": self.job, "model": self.model, "params": self.params, "stages": self.stages,
                "shape": asdict(self.shape), "assumptions": a,
                "rows": [{**asdict(r), "bytes_sent_per_day": r.per_day(r.bytes_sent),
                          "gas_per_day": r.per_day(r.gas), "stored_per_day": r.per_day(r.stored),
                          "verify_gpu_hours_per_day": r.per_day(r.verify_gpu_s) / 3600} for r in self.rows],
                "notes": self.notes}


def plan_job(job: JobConfig, a: Assumptions, nodes: list[int]) -> Plan:
    """The plan of `job` (its model and stages already as wanted) at each replica count."""
    shape = job_shape(job, a.gaps_bits)
    notes = []
    if a.tokens_per_s is None and shape.params < 1e9 and a.hardware.key != "cpu" and a.mfu is None:
        notes.append(SMALL_MODEL_NOTE)
    if a.hardware.memory_gb:
        need = max(shape.stage_params) * shape.state_per_param / 1e9
        if need > a.hardware.memory_gb:
            notes.append(f"a stage's training state alone ({shape.state_per_param:.0f} B a parameter: weights, "
                         f"gradients, AdamW, outer copy and momentum{', residual' if shape.state_per_param > 24 else ''}) "
                         f"is {need:,.0f} GB, more than the {a.hardware.name}'s {a.hardware.memory_gb:.0f} GB: "
                         f"use at least {math.ceil(shape.params * shape.state_per_param / 1e9 / a.hardware.memory_gb)} "
                         "stages (activations not counted)")
    if job.outer.compression.kind == "adaptive":
        notes.append("adaptive compression: modelled at its ceiling (every matrix at 4 bits); the rule sends "
                     "less whenever factors or top-k are cheaper")
    if job.outer.compression.kind == "quantize" and job.outer.compression.coding == "gaps":
        notes.append(f"gaps layout: {a.gaps_bits:g} bits a value (measured on this project's pseudo-gradients; "
                     "data-dependent, 2 at most)")
    rows = [plan_row(job, shape, R, a) for R in nodes]
    model = job.model.model_dump(mode="json", exclude={"init"})
    return Plan(job=job.name, model=model, params=shape.params, stages=job.parallel.stages,
                shape=shape, assumptions=a, rows=rows, notes=notes + [n for r in rows for n in r.notes])
