"""Job configuration: pydantic models for the `[model]`, `[parallel]`, `[data]`, `[inner]`
and `[outer]` sections of a job file, plus `load_job`, which turns validation failures into
one-line `ConfigError`s naming every problem's field path, unknown keys first.

Every section forbids unknown keys. `[model]` and `[outer]` take one of several forms,
pydantic discriminated unions (the model family: trainer/config_model.py; the exchange rule:
trainer/config_outer.py), so a key of another form is an unknown key. What a job records, and
so what its config CID hashes, is its dump, defined in one place: trainer/config_dump.py.
`JobConfig` may be subclassed to add sections (the worker's job-file loader adds `chain` and
`storage`); pass the subclass to `load_job`.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Self, TypeVar, overload

from pydantic import (
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema

from trainer.config_base import Section as _Section
from trainer.config_errors import one_line
from trainer.config_model import MAX_PARAMS, AnyModel, GptConfig, LlamaConfig, ModelConfig
from trainer.config_outer import (
    ALLOWED_BITS,
    CHUNK_MAX,
    CHUNK_MIN,
    AnyOuter,
    CompressionConfig,
    EagerOuter,
    OuterConfig,
    PartialOuter,
    RestartOuter,
    SyncOuter,
)
from trainer.dataset import BPE_MIN_VOCAB, BYTE_VOCAB, PreparedData
from trainer.errors import ConfigError

__all__ = [
    "ALLOWED_BITS",
    "CHUNK_MAX",
    "CHUNK_MIN",
    "MAX_PARAMS",
    "AnyModel",
    "AnyOuter",
    "CompressionConfig",
    "DataConfig",
    "EagerOuter",
    "GptConfig",
    "InnerConfig",
    "JobConfig",
    "LlamaConfig",
    "ModelConfig",
    "OuterConfig",
    "ParallelConfig",
    "PartialOuter",
    "RestartOuter",
    "SyncOuter",
    "TransportConfig",
    "load_job",
    "one_line",
    "stage_layers",
]

SEED_MAX = 2**63 - 1


class ParallelConfig(_Section):
    """How the world is laid out: R DiLoCo replicas, each a pipeline of S stages."""

    SECTION = "parallel"

    replicas: int = Field(2, ge=1, description="R: DiLoCo replicas (data-parallel workers).")
    stages: int = Field(2, ge=1, description="S: pipeline stages per replica.")
    microbatches: int = Field(
        4, ge=1, description="M: microbatches per inner step in the pipeline schedule."
    )
    schedule: Literal["1F1B", "GPipe"] = Field("1F1B", description="Pipeline schedule, by name.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where ranks compute: cuda gives each rank its own GPU (stage-to-stage "
        "traffic over NCCL within a host); auto picks cuda when every rank can have a GPU, "
        "else cpu. The cross-replica exchange always goes through the Transport, on the CPU.",
    )
    sync: Literal["diloco", "allreduce"] = Field(
        "diloco",
        description="How replicas sync: DiLoCo outer steps every H inner steps, or the "
        "AllReduce-DDP baseline (gradients all-reduced every inner step; its checkpoints carry "
        "the weights with zero momentum and empty contributions, not a verifiable outer step).",
    )

    numerics: Literal["native", "portable"] = Field(
        "native",
        description="How the inner steps compute. native: PyTorch's kernels for this CPU (fast; "
        "a replay on another kind of CPU differs in the last bits, so the verifier compares "
        "within a tolerance). portable: kernels whose bits do not depend on the CPU, its "
        "instruction set, the math libraries' dispatch or the thread count "
        "(trainer/portable.py: matmuls by exact integer slices, our own exp/log/tanh/erf, "
        "fixed-order reductions), so a replay anywhere is bit for bit and a challenge exact; "
        "float32 only, and compression kinds none, quantize and sparse.",
    )
    min_replicas: int | None = Field(
        None, ge=1,
        description="The fewest replicas an outer step may average (elastic training, "
        "parallel.sync = 'diloco' only): a replica that is lost leaves the others training "
        "while at least this many remain, and one that joins is in from a later step. Unset: "
        "replicas (every replica in every step, a lost one fails the round).",
    )

    @field_validator("min_replicas")
    @classmethod
    def _valid_min_replicas(cls, value: int | None, info: ValidationInfo) -> int | None:
        R, sync = info.data.get("replicas"), info.data.get("sync")
        if value is None or R is None:
            return value
        if value > R:
            raise ValueError(f"must be at most replicas ({R}) (got {value})")
        if value < R and sync == "allreduce":
            raise ValueError(f"must equal replicas ({R}) under sync = 'allreduce' (elastic "
                             "training averages whichever replicas finished a round: DiLoCo only)")
        return value

    @property
    def min_present(self) -> int:
        """The fewest replicas an outer step may average: `min_replicas`, else R."""
        return self.replicas if self.min_replicas is None else self.min_replicas


class DataConfig(_Section):
    """The corpus and its tokenizer (trainer/dataset.py): Python's standard library sources,
    user globs or a directory, in plain text, JSON Lines or Parquet files."""

    SECTION = "data"

    source: Literal["stdlib", "files", "dir"] = Field(
        "stdlib", description="Where the corpus comes from: the standard library's sources, "
        "`paths` globs, or every file under `dir`."
    )
    paths: list[str] = Field(
        default_factory=list, description="Glob patterns of text files (source = 'files'): absolute, `~`, or "
        "relative to the job file's directory; each file is named relative to the patterns' glob "
        "base (docs/data.md)."
    )
    dir: str | None = Field(
        None, min_length=1, description="source = 'dir': a directory (absolute, `~`, or relative "
        "to the job file's directory); every regular file under it, recursively, by relative path, hidden files and directories skipped (as `ipfs add "
        "-r`)."
    )
    tokenizer: str = Field(
        "bytes", min_length=1, description='"bytes": one token per byte; "bpe": a byte-level BPE '
        "of model.vocab_size tokens trained on the training split; or the path of a local "
        "tokenizer.json (absolute, `~`, or relative to the job file's directory)."
    )
    text_field: str = Field(
        "text", min_length=1, description="The text's field in .jsonl records, its column in "
        ".parquet files."
    )
    max_bytes: int = Field(
        4_000_000, ge=1024, description="Corpus cap in bytes (whole files, sorted order)."
    )
    eval_fraction: float = Field(
        0.05, gt=0.0, lt=1.0, description="Fraction of documents held out for eval (by key hash)."
    )
    batch_size: int = Field(8, ge=1, description="Sequences per replica per inner step.")
    eval_batches: int = Field(
        4, ge=1, description="Held-out batches evaluated after each outer step."
    )
    prepared: SkipJsonSchema[PreparedData | None] = Field(
        None, exclude=True, description="The token file to read instead of preparing one: set "
        "by dlx through `with_prepared`, never in a job file (nor dumped or hashed)."
    )

    @model_validator(mode="before")
    @classmethod
    def _not_prepared_on_input(cls, data: Any) -> Any:
        if isinstance(data, dict) and "prepared" in data:
            raise ValueError("prepared is set by dlx itself (the token file it made), not in a "
                             "job file")
        return data

    @model_validator(mode="after")
    def _paths_match_source(self) -> DataConfig:
        if self.source == "files" and not self.paths:
            raise ValueError("paths must name at least one glob when source is 'files'")
        if self.source == "dir" and self.dir is None:
            raise ValueError("dir must name a directory when source is 'dir'")
        if self.dir is not None and self.source != "dir":
            raise ValueError(f"dir needs source = 'dir' (source is '{self.source}')")
        return self

    def with_prepared(self, prepared: PreparedData) -> DataConfig:
        """This config, reading `prepared`'s token file rather than preparing its own."""
        return self.model_copy(update={"prepared": prepared})

    @property
    def min_vocab(self) -> int | None:
        """The least model.vocab_size the tokenizer allows, if known before loading it."""
        return {"bytes": BYTE_VOCAB, "bpe": BPE_MIN_VOCAB}.get(self.tokenizer)


class InnerConfig(_Section):
    """Inner optimizer: AdamW on each replica's stage, state kept across rounds."""

    optimizer: Literal["adamw", "sgd"] = Field(
        "adamw", description="AdamW (default), or plain SGD (used by equivalence tests)."
    )
    lr: float = Field(1e-3, gt=0.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.1, ge=0.0, description="Decoupled weight decay (matrices only).")
    betas: tuple[float, float] = Field(
        (0.9, 0.95), description="AdamW (beta1, beta2), each in [0, 1) (torch's AdamW refuses others)."
    )
    clip: float = Field(1.0, gt=0.0, description="Max global grad norm over the whole pipeline.")
    warmup: int = Field(10, ge=0, description="Inner steps of linear LR warmup.")

    @field_validator("betas", mode="before")
    @classmethod
    def _pair(cls, betas: Any) -> Any:
        """TOML and JSON give a list; strict mode wants the tuple."""
        return tuple(betas) if isinstance(betas, list) else betas

    @field_validator("betas")
    @classmethod
    def _valid_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:  # also refuses NaN
                raise ValueError(f"beta{i + 1} must be in [0, 1) (got {beta:g})")
        return betas


class TransportConfig(_Section):
    """The link between replicas: every cross-replica byte is counted; the link may be shaped."""

    link: Literal["none", "simulated", "netns"] = Field(
        "none",
        description="none: loopback, bytes counted only; simulated: each exchange completes "
        "no earlier than latency + bytes / bandwidth after it starts (in a background thread); "
        "netns: replicas in network namespaces joined by tc-shaped veth links (root only).",
    )
    bandwidth_mbps: float = Field(1000.0, description="Link bandwidth in Mbit/s (> 0).")
    latency_ms: float = Field(0.0, ge=0.0, description="One-way latency per ring hop, in ms.")

    @field_validator("bandwidth_mbps")
    @classmethod
    def _positive_bandwidth(cls, mbps: float) -> float:
        if not mbps > 0:
            raise ValueError(f"must be > 0 (got {mbps:g})")
        return mbps


class JobConfig(_Section):
    """A whole training job. Subclass to add sections (e.g. chain, storage)."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$", description="Job name (letters, digits, _ . -)."
    )
    seed: int = Field(
        0, ge=0, le=SEED_MAX, description="Run seed; every other seed derives from it. At most "
        "2^63 - 1: torch's generators take 64-bit seeds and the manifest stores 64-bit integers."
    )
    model: AnyModel = Field(default_factory=GptConfig, description="Model shape, by family.")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="Replicas x stages layout."
    )
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus and batching.")
    inner: InnerConfig = Field(default_factory=InnerConfig, description="Inner optimizer.")
    outer: AnyOuter = Field(description="Outer optimizer, round counts and exchange rule.")
    transport: TransportConfig = Field(
        default_factory=TransportConfig, description="Cross-replica link: counting and shaping."
    )

    @model_validator(mode="after")
    def _cross_section(self) -> JobConfig:
        p, m, d = self.parallel, self.model, self.data
        if p.stages > m.n_layers:
            raise ValueError(f"parallel.stages ({p.stages}) exceeds model.n_layers ({m.n_layers})")
        if d.batch_size % p.microbatches != 0:
            raise ValueError(
                f"data.batch_size ({d.batch_size}) is not divisible by "
                f"parallel.microbatches ({p.microbatches})"
            )
        if p.schedule == "1F1B" and p.microbatches < p.stages:
            raise ValueError(
                f"parallel.microbatches ({p.microbatches}) must be >= parallel.stages "
                f"({p.stages}) for the 1F1B schedule"
            )
        if m.tie_embeddings and p.stages > 1:
            raise ValueError(
                "model.tie_embeddings needs parallel.stages = 1 (the embeddings live on the first "
                "stage, the head on the last)"
            )
        if d.min_vocab is not None and m.vocab_size < d.min_vocab:
            what = "byte values" if d.tokenizer == "bytes" else "256 bytes and <|endoftext|>"
            raise ValueError(
                f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's vocabulary "
                f"({d.min_vocab}: {what})"
            )
        if self.outer.fragments > max(1, m.n_layers // p.stages):
            raise ValueError(
                f"outer.fragments ({self.outer.fragments}) exceeds the blocks per stage "
                f"({m.n_layers // p.stages}: model.n_layers / parallel.stages)"
            )
        c = self.outer.compression
        if p.numerics == "portable" and m.dtype != "float32":
            raise ValueError(f'parallel.numerics = "portable" computes in float32 (model.dtype is "{m.dtype}")')
        if p.numerics == "portable":
            _portable_settings(self)
        smallest = m.smallest_side
        if c.kind == "lowrank" and c.rank > smallest:
            raise ValueError(
                f"outer.compression.rank ({c.rank}) exceeds the smallest side ({smallest}) of "
                f"the model's matrices"
            )
        if c.kind == "adaptive" and c.max_rank > smallest:
            raise ValueError(
                f"outer.compression.max_rank ({c.max_rank}) exceeds the smallest side "
                f"({smallest}) of the model's matrices"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.parallel.replicas * self.parallel.stages

    def with_prepared(self, prepared: PreparedData) -> Self:
        """This job, its ranks reading `prepared`'s token file (`DataConfig.with_prepared`)."""
        return self.model_copy(update={"data": self.data.with_prepared(prepared)})

    def canonical_json(self) -> bytes:
        """The config as compact JSON with sorted keys: the bytes that get hashed."""
        return json.dumps(
            self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()


def _portable_settings(job: JobConfig) -> None:
    """What `parallel.numerics = "portable"` cannot compute portably yet: ValueError."""
    c = job.outer.compression
    if c.kind in ("lowrank", "adaptive"):
        raise ValueError(f'outer.compression.kind = "{c.kind}" is not portable yet (its power '
                         'iteration and SVD): use none, quantize or sparse with parallel.numerics = "portable"')
    if c.kind != "none" and c.bits == 1:
        raise ValueError('outer.compression.bits = 1 is not portable yet (its scale is a mean): '
                         'use 2, 4 or 8 with parallel.numerics = "portable"')
    if isinstance(job.model, GptConfig) and job.model.dropout > 0:
        raise ValueError('model.dropout must be 0 with parallel.numerics = "portable"')


def stage_layers(n_layers: int, stage: int, stages: int) -> range:
    """Block indices of `stage`: as even as possible, earlier stages take the remainder."""
    if not 0 <= stage < stages <= n_layers:
        raise ValueError(f"need 0 <= stage ({stage}) < stages ({stages}) <= n_layers ({n_layers})")
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


J = TypeVar("J", bound=JobConfig)


@overload
def load_job(data: Any) -> JobConfig: ...
@overload
def load_job(data: Any, cls: type[J]) -> J: ...
def load_job(data: Any, cls: type[Any] = JobConfig) -> Any:
    """Validate a parsed job file (a dict) into `cls`; raise ConfigError with one line."""
    if not isinstance(data, dict):
        raise ConfigError(f"job: expected a table of sections, got {type(data).__name__}")
    outer = data.get("outer")
    if isinstance(outer, dict) and outer.get("arithmetic", "float64") != "float64":
        raise ConfigError('outer.arithmetic: a new run computes in "float64" ("float32" is how '
                          "runs recorded before 2026-12-04 read)")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(one_line(err, model=cls)) from None
