"""The `[outer]` section of a job file: the outer optimizer, the round counts, the
pseudo-gradient's compression (`CompressionConfig`) and the exchange rule, one class per
rule as a discriminated union (`AnyOuter`):

- `SyncOuter` (delay = 0): synchronous DiLoCo;
- `PartialOuter` (delay = 1, overlap = "partial", the default of delay 1): Streaming
  DiLoCo's overlap, with its own settings `tau`, `alpha` and `fragments`;
- `EagerOuter` (delay = 1, overlap = "eager") and `RestartOuter` (delay = 1,
  overlap = "restart").

A setting of another rule is an unknown key of this one (`tau` under delay = 0, say), named
with the rule it belongs to. Every rule reads `tau`, `alpha` and `fragments`: the rules
without them read the values that mean "none" (`_NoPartialSettings`), so callers need not
ask which rule they hold.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from trainer.config_base import Section, Tagged, dispatch, shown

__all__ = ["AnyOuter", "CompressionConfig", "EagerOuter", "OuterConfig", "PartialOuter", "RestartOuter",
           "SyncOuter"]

ALLOWED_BITS = (1, 2, 4, 8)
CHUNK_MIN, CHUNK_MAX = 64, 65536  # sparse chunk sizes: indices fit 6 to 16 bits


class CompressionConfig(Section):
    """How a replica's pseudo-gradient is compressed before it crosses the link.

    Every kind keeps an error-feedback buffer (unless `error_feedback = false`): what
    compression dropped this round is added to the next round's pseudo-gradient.
    """

    SECTION = "outer.compression"

    kind: Literal["none", "quantize", "lowrank", "sparse", "adaptive"] = Field(
        "none",
        description="none: float32; quantize: `bits`-bit integers with per-row scales; "
        "lowrank: rank-`rank` factors (PowerSGD-style power iteration, warm start) quantised "
        "to `bits`, 1-D tensors quantised only; sparse: the top `density` of each `chunk` "
        "consecutive values by magnitude, quantised to `bits` (SparseLoCo-style), 1-D tensors "
        "quantised only; adaptive: low rank, sparse or whole quantisation, rank, density and "
        "bits chosen per tensor each outer step (trainer/compress.py documents the rule).",
    )
    bits: int = Field(8, description="Bits per quantised value: 1 (the sign, scaled by the mean magnitude), "
                      "2, 4 or 8.")
    rank: int = Field(4, ge=1, description="Low-rank factor rank (kind = lowrank).")
    power_iters: int = Field(1, ge=1, le=8, description="Power iterations per outer step.")
    error_feedback: bool = Field(True, description="Carry the compression error to the next round.")
    max_rank: int = Field(
        32, ge=1, description="adaptive: the largest rank the rule may pick for any tensor."
    )
    energy: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="adaptive: fraction of a tensor's squared norm (with its error-feedback "
        "residual) the low-rank factors should capture at the end of the warm-up schedule.",
    )
    warmup_steps: int = Field(
        4,
        ge=0,
        description="adaptive: outer steps over which the energy target rises from half its "
        "value to `energy` (more aggressive early).",
    )

    density: float = Field(
        0.02,
        description="sparse: fraction of each chunk's values kept (top-k by magnitude, "
        "k = max(1, ceil(density * chunk length))), in (0, 1].",
    )
    chunk: int = Field(
        4096,
        description="sparse, adaptive: values per top-k chunk, a power of two from 64 to 65536 "
        "(indices are sent at log2(chunk) bits).",
    )

    coding: Literal["fixed", "gaps"] = Field(
        "fixed",
        description="quantize at bits = 2 (values -1, 0 or +1 times the row's scale): how the "
        "values are laid out. fixed: 2 bits each; gaps: the run of zeros before each nonzero "
        "value as w-bit tokens (w picked per payload) plus one sign bit per nonzero: the same "
        "values, decoded bit for bit alike, in fewer bytes when most round to zero (1.7-1.9x "
        "fewer on the benchmark's pseudo-gradients; docs/FORMATS.md, codec 4).",
    )

    @model_validator(mode="after")
    def _gaps_need_ternary(self) -> CompressionConfig:
        if self.coding == "gaps" and (self.kind != "quantize" or self.bits != 2):
            raise ValueError(f"coding = 'gaps' needs kind = 'quantize' and bits = 2 "
                             f"(kind is '{self.kind}', bits {self.bits})")
        return self

    @field_validator("bits")
    @classmethod
    def _valid_bits(cls, bits: int) -> int:
        if bits not in ALLOWED_BITS:
            raise ValueError(f"must be one of 1, 2, 4, 8 (got {bits})")
        return bits

    @field_validator("density")
    @classmethod
    def _valid_density(cls, density: float) -> float:
        if not 0.0 < density <= 1.0:  # also refuses NaN
            raise ValueError(f"must be in (0, 1] (got {density})")
        return density

    @field_validator("chunk")
    @classmethod
    def _valid_chunk(cls, chunk: int) -> int:
        if not (CHUNK_MIN <= chunk <= CHUNK_MAX and chunk & (chunk - 1) == 0):
            raise ValueError(f"must be a power of two between {CHUNK_MIN} and {CHUNK_MAX} (got {chunk})")
        return chunk


RULES = ("partial", "eager", "restart")


class OuterConfig(Tagged):
    """Outer optimizer: Nesterov SGD on the outer copy, gradient = mean pseudo-gradient. The
    fields every exchange rule has; `OuterConfig(**fields)` and `OuterConfig.model_validate`
    give the rule's class (`SyncOuter` when `delay` is not given)."""

    SECTION = "outer"

    lr: float = Field(0.7, gt=0.0, description="Outer learning rate.")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Outer momentum.")
    nesterov: bool = Field(True, description="Use Nesterov momentum.")
    steps: int = Field(ge=1, description="T: number of outer steps.")
    inner_steps: int = Field(ge=1, description="H: inner steps per outer step.")
    compression: CompressionConfig = Field(
        default_factory=CompressionConfig, description="Pseudo-gradient compression."
    )
    arithmetic: Literal["float64", "float32"] = Field(
        "float64",
        description="Recorded by a run, not a setting: how the outer step and the merge compute "
        "(trainer/diloco.py). float64: each elementwise formula in float64, separate correctly "
        "rounded operations, rounded to float32 once: the same bits on every IEEE-754 machine, "
        "kernel set and thread count. float32: the arithmetic of runs recorded before "
        "2026-12-04 (float32 kernels, fused multiply-adds where the CPU's kernels use them): "
        "such a run's record has no `arithmetic` and reads as float32, so it keeps verifying "
        "on machines of its class.",
    )

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterConfig:
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov = true needs momentum > 0 (set nesterov = false)")
        return self

    @property
    def rule(self) -> str:
        """The exchange rule in force: "sync" (delay 0) or the overlap rule."""
        return self.TAG

    @classmethod
    def tag_of(cls, data: Any) -> str:
        if not isinstance(data, dict):
            return getattr(data, "rule", "sync")
        delay = data.get("delay", 0)
        if type(delay) is not int or delay not in (0, 1):
            return f"delay {delay!r}"  # no rule's: `unrouted` says why
        overlap = data.get("overlap", "partial") if delay == 1 else None
        return "sync" if overlap is None else overlap if overlap in RULES else f"overlap {overlap!r}"

    @classmethod
    def unrouted(cls, data: Any) -> tuple[str, str]:
        delay = data.get("delay", 0)
        if type(delay) is not int:
            return "delay", f"Input should be a valid integer (got {shown(delay)})"
        if delay not in (0, 1):
            return "delay", f"must be 0 or 1 (got {delay})"
        return "overlap", f"Input should be 'partial', 'eager' or 'restart' (got {shown(data.get('overlap'))})"

    @classmethod
    def foreign_message(cls, key: str, owner: str) -> str:
        if cls.TAG == "sync":
            return f"{key} needs delay = 1 (an overlapped exchange); delay = 0 is synchronous"
        return f'{key} is a setting of overlap = "{owner}" (overlap is "{cls.TAG}")'


DELAY = ("0: synchronous DiLoCo (every replica waits for the exchange at the end of each round); "
         "1: the exchange of round t overlaps computation (`overlap` says how).")
OVERLAP = ("delay = 1 only. partial (the default): the exchange of round t runs during the first "
           "`tau` inner steps of round t+1, then the outer step and a merge (Streaming DiLoCo); "
           "eager: round t+1 starts from an outer step that uses the replica's own fresh "
           "pseudo-gradient in place of its stale share (Kale et al. 2025); restart: a whole round "
           "of delay, round t+1 restarts from the outer copy (trainer/diloco.py documents each).")


class _NoPartialSettings:
    """What a rule other than partial reads for the partial rule's settings: no steps of the
    next round hidden behind the exchange ("auto", never consulted), no mixing, one fragment."""

    @property
    def tau(self) -> Literal["auto"]:
        return "auto"

    @property
    def alpha(self) -> None:
        return None

    @property
    def fragments(self) -> int:
        return 1


class SyncOuter(_NoPartialSettings, OuterConfig):
    """delay = 0: synchronous DiLoCo."""

    TAG = "sync"
    delay: Literal[0] = Field(0, description=DELAY)


class PartialOuter(OuterConfig):
    """delay = 1, overlap = "partial": Streaming DiLoCo's overlapped exchange and merge."""

    TAG = "partial"
    delay: Literal[1] = Field(description=DELAY)
    overlap: Literal["partial"] = Field("partial", description=OVERLAP)
    tau: int | Literal["auto"] = Field(
        "auto",
        description="Inner steps of round t+1 the exchange may take, 0..H "
        "(0 waits at once: synchronous DiLoCo's result); auto: derived each round from the "
        "measured exchange and inner-step times so that the exchange stays hidden (the ranks "
        "agree on the largest estimate one round late, without waiting), at most H/4 "
        "(longer overlaps cost quality; a longer exchange makes the round wait) (a wall-clock "
        "decision, recorded in each round's start state so replay is exact; two runs of one job "
        "may merge at different steps, so fix tau where reruns must give the same CIDs).",
    )
    alpha: float | None = Field(
        None,
        description="Unset merges exactly (local <- new outer weights + the "
        "progress made since the send); a value in [0, 1] mixes instead, as Streaming DiLoCo "
        "does: local <- alpha * local + (1 - alpha) * new outer weights.",
    )
    fragments: int = Field(
        1,
        ge=1,
        description="F, Streaming DiLoCo's fragments. Each stage's parameters "
        "are cut into F contiguous groups of about equal size (`trainer.diloco.fragment_groups`) "
        "and round t exchanges only group (t - 1) mod F, measured since that group's previous "
        "exchange: each group syncs every F rounds, staggered, and each exchange is 1/F of the "
        "stage (1: every round exchanges everything).",
    )

    @field_validator("tau", mode="before")
    @classmethod
    def _int_or_auto(cls, tau: Any) -> Any:
        if tau == "auto" or (isinstance(tau, int) and not isinstance(tau, bool)):
            return tau
        raise ValueError(f'must be an integer in [0, inner_steps] or "auto" (got {tau!r})')

    @field_validator("alpha")
    @classmethod
    def _valid_alpha(cls, alpha: float | None) -> float | None:
        if alpha is not None and not 0.0 <= alpha <= 1.0:
            raise ValueError(f"must be in [0, 1] (got {alpha:g})")
        return alpha

    @model_validator(mode="after")
    def _tau_within_round(self) -> PartialOuter:
        if isinstance(self.tau, int) and not 0 <= self.tau <= self.inner_steps:
            raise ValueError(f"tau ({self.tau}) must be in [0, inner_steps = {self.inner_steps}]")
        return self


class EagerOuter(_NoPartialSettings, OuterConfig):
    """delay = 1, overlap = "eager": the stale share replaced by the replica's own fresh one."""

    TAG = "eager"
    delay: Literal[1] = Field(description=DELAY)
    overlap: Literal["eager"] = Field(description=OVERLAP)


class RestartOuter(_NoPartialSettings, OuterConfig):
    """delay = 1, overlap = "restart": a whole round of delay, each round from the outer copy."""

    TAG = "restart"
    delay: Literal[1] = Field(description=DELAY)
    overlap: Literal["restart"] = Field(description=OVERLAP)


#: The `[outer]` section: the exchange rule's class, chosen by `delay` and `overlap`.
AnyOuter = Annotated[
    Annotated[SyncOuter, Tag("sync")] | Annotated[PartialOuter, Tag("partial")]
    | Annotated[EagerOuter, Tag("eager")] | Annotated[RestartOuter, Tag("restart")],
    Discriminator(OuterConfig.tag_of),
]
dispatch(OuterConfig, AnyOuter)
