"""The `[model]` section of a job file (`trainer.config` holds the others) and `Section`,
the base every section shares."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

__all__ = ["MAX_PARAMS", "ModelConfig", "Section"]

#: The largest model a job may describe: past 2^40 (1.1 T) parameters one copy of the outer
#: state (float32 weights and momentum) passes 8 TiB, beyond what any job here could hold.
MAX_PARAMS = 2**40


class Section(BaseModel):
    """A job-file section: unknown keys refused, and strict types: a string is never read as
    a number or a boolean, nor a number as a boolean (`d_model = "128"`, `nesterov = "yes"`
    and `nesterov = 1` are errors). An integer is still a valid float (`lr = 1`); inf and nan
    are not."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


_GPT_ONLY = ("mlp_ratio", "dropout")
_LLAMA_ONLY = ("n_kv_heads", "intermediate_size", "rope_theta", "rms_norm_eps", "qkv_bias",
               "tie_embeddings")
_NEWER = ("family", "dtype", "activation_checkpointing", "init")  # absent from older job files


class ModelConfig(Section):
    """The model: a family and its shape.

    `gpt`: a small pre-LN GPT (nanoGPT-style, learned positions, GELU MLP). `llama`: a
    Llama-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention; Qwen2 is
    `qkv_bias = true`), convertible to and from Hugging Face checkpoints by renaming.
    Fields of the other family are refused, not ignored.
    """

    family: Literal["gpt", "llama"] = Field("gpt", description="Model family (trainer/model.py).")
    vocab_size: int = Field(256, ge=2, le=1 << 24, description="Vocabulary size (256 = raw bytes).")
    d_model: int = Field(128, ge=1, le=1 << 16, description="Width of the residual stream (C).")
    n_layers: int = Field(4, ge=1, le=1024, description="Number of transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads per block; must divide d_model.")
    seq_len: int = Field(
        128, ge=1, le=1 << 20, description="Context length T (gpt: also the positional table size)."
    )
    mlp_ratio: int = Field(4, ge=1, description="gpt: MLP hidden width as a multiple of d_model.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="gpt: dropout probability (0 = off).")
    n_kv_heads: int | None = Field(
        None, ge=1, description="llama: key/value heads (grouped-query attention; divides "
        "n_heads). Unset: n_heads."
    )
    intermediate_size: int | None = Field(
        None, ge=1, description="llama: SwiGLU hidden width. Unset: 8/3 x d_model, rounded up "
        "to a multiple of 64."
    )
    rope_theta: float = Field(10000.0, gt=0.0, description="llama: rotary embedding base.")
    rms_norm_eps: float = Field(1e-5, gt=0.0, lt=1.0, description="llama: RMSNorm epsilon.")
    qkv_bias: bool = Field(False, description="llama: bias on the q, k, v projections (Qwen2).")
    tie_embeddings: bool = Field(
        False, description="llama: the head reuses the token embedding matrix (one stage only)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Inner-step compute precision: bfloat16 autocasts forward and "
        "backward; weights, optimizer states, the outer copy and everything hashed stay float32."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward instead of keeping them."
    )
    init: str | None = Field(
        None, description="A local Hugging Face model directory (config.json + safetensors) to "
        "start from: its weights are the genesis checkpoint. Fields left out of [model] are "
        "taken from its config.json; fields given must agree with it."
    )

    @model_validator(mode="after")
    def _family_fields(self) -> ModelConfig:
        foreign = _LLAMA_ONLY if self.family == "gpt" else _GPT_ONLY
        for name in foreign:
            if name in self.model_fields_set and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(f"{name} is not a field of the {self.family} family")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads})"
            )
        if self.family == "gpt" and self.init is not None:
            raise ValueError("init (a Hugging Face directory) needs family = 'llama'")
        if self.n_params() > MAX_PARAMS:
            raise ValueError(
                f"{self.n_params() / 1e9:,.0f}B parameters exceed the {MAX_PARAMS / 1e9:,.0f}B a job may "
                f"have (the outer state alone would take {8 * self.n_params() / 2**40:.1f} TiB)"
            )
        if self.family == "llama":
            if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads != 0:
                raise ValueError(
                    f"n_heads ({self.n_heads}) is not divisible by n_kv_heads ({self.n_kv_heads})"
                )
            if (self.d_model // self.n_heads) % 2:
                raise ValueError(
                    f"head size d_model / n_heads ({self.d_model // self.n_heads}) must be even "
                    "for rotary embeddings"
                )
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        m = -(-8 * self.d_model // 3)  # ceil(8/3 d): SwiGLU's three matrices cost what GELU's two did
        return -(-m // 64) * 64

    @property
    def smallest_side(self) -> int:
        """The smallest dimension of any of the model's matrices (a low-rank factor's bound)."""
        if self.family == "gpt":
            return min(self.d_model, self.vocab_size, self.seq_len)
        kv = self.kv_heads * (self.d_model // self.n_heads)
        return min(self.d_model, self.vocab_size, kv, self.ffn_size)

    def n_params(self) -> int:
        """Parameters of the full model (tied embeddings counted once)."""
        d, V, L = self.d_model, self.vocab_size, self.n_layers
        if self.family == "gpt":
            f = self.mlp_ratio * d
            block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
            return V * d + self.seq_len * d + L * block + 2 * d + d * V
        hs, kv, f = d // self.n_heads, self.kv_heads, self.ffn_size
        attn = d * d + 2 * d * kv * hs + d * d + ((d + 2 * kv * hs) if self.qkv_bias else 0)
        block = 2 * d + attn + 3 * d * f
        return V * d + L * block + d + (0 if self.tie_embeddings else d * V)

    @model_serializer(mode="wrap")
    def _only_this_family(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dump only the fields of this family; a gpt model without the newer fields dumps
        (and hashes) exactly as before they existed."""
        data = handler(self)
        if not isinstance(data, dict):
            return data
        defaults = type(self).model_fields
        drop: tuple[str, ...] = _LLAMA_ONLY if self.family == "gpt" else _GPT_ONLY
        if self.family == "gpt":
            drop += tuple(k for k in _NEWER if getattr(self, k) == defaults[k].default)
        return {k: v for k, v in data.items() if k not in drop}
