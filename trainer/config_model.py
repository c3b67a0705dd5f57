"""The `[model]` section of a job file (`trainer.config` holds the others): one class per
model family, `GptConfig` and `LlamaConfig`, a discriminated union on `family` (`AnyModel`),
so a field of the other family is an unknown key, named as such."""

from __future__ import annotations

from abc import abstractmethod
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from trainer.config_base import Section, Tagged, dispatch, shown

__all__ = ["MAX_PARAMS", "AnyModel", "GptConfig", "LlamaConfig", "ModelConfig", "Section"]

#: The largest model a job may describe: past 2^40 (1.1 T) parameters one copy of the outer
#: state (float32 weights and momentum) passes 8 TiB, beyond what any job here could hold.
MAX_PARAMS = 2**40


class ModelConfig(Tagged):
    """The model: a family and its shape. The fields every family has; `GptConfig` and
    `LlamaConfig` add their own. `ModelConfig(**fields)` and `ModelConfig.model_validate(data)`
    give the family's class (gpt when `family` is not given)."""

    SECTION = "model"

    family: Literal["gpt", "llama"] = Field("gpt", description="Model family (trainer/model.py).")
    vocab_size: int = Field(256, ge=2, le=1 << 24, description="Vocabulary size (256 = raw bytes).")
    d_model: int = Field(128, ge=1, le=1 << 16, description="Width of the residual stream (C).")
    n_layers: int = Field(4, ge=1, le=1024, description="Number of transformer blocks.")
    n_heads: int = Field(4, ge=1, description="Attention heads per block; must divide d_model.")
    seq_len: int = Field(
        128, ge=1, le=1 << 20, description="Context length T (gpt: also the positional table size)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Inner-step compute precision: bfloat16 autocasts forward and "
        "backward; weights, optimizer states, the outer copy and everything hashed stay float32."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward instead of keeping them."
    )

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads})"
            )
        self._check_family()
        if self.n_params() > MAX_PARAMS:
            raise ValueError(
                f"{self.n_params() / 1e9:,.0f}B parameters exceed the {MAX_PARAMS / 1e9:,.0f}B a job may "
                f"have (the outer state alone would take {8 * self.n_params() / 2**40:.1f} TiB)"
            )
        return self

    def _check_family(self) -> None:
        """ValueError if the family's own fields do not fit the shape."""

    @abstractmethod
    def n_params(self) -> int:
        """Parameters of the full model (tied embeddings counted once)."""

    @property
    @abstractmethod
    def smallest_side(self) -> int:
        """The smallest dimension of any of the model's matrices (a low-rank factor's bound)."""

    @classmethod
    def tag_of(cls, data: Any) -> str:
        family = data.get("family", "gpt") if isinstance(data, dict) else getattr(data, "family", "gpt")
        return family if isinstance(family, str) else repr(family)

    @classmethod
    def unrouted(cls, data: Any) -> tuple[str, str]:
        return "family", f"Input should be 'gpt' or 'llama' (got {shown(data.get('family'))})"

    @classmethod
    def foreign_message(cls, key: str, owner: str) -> str:
        return f"{key} is not a field of the {cls.TAG} family"


class GptConfig(ModelConfig):
    """`gpt`: a small pre-LN GPT (nanoGPT-style, learned positions, GELU MLP)."""

    TAG = "gpt"
    family: Literal["gpt"] = Field("gpt", description="Model family (trainer/model.py).")
    mlp_ratio: int = Field(4, ge=1, description="gpt: MLP hidden width as a multiple of d_model.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="gpt: dropout probability (0 = off).")

    @classmethod
    def foreign_message(cls, key: str, owner: str) -> str:
        if key == "init":
            return "init (a Hugging Face directory) needs family = 'llama'"
        return super().foreign_message(key, owner)

    @property
    def tie_embeddings(self) -> bool:
        """Never: the gpt head has its own matrix (`tie_embeddings` is a llama field)."""
        return False

    @property
    def init(self) -> None:
        """Never: a gpt model starts from its seed (`init` is a llama field)."""
        return None

    @property
    def smallest_side(self) -> int:
        return min(self.d_model, self.vocab_size, self.seq_len)

    def n_params(self) -> int:
        d, V, L, f = self.d_model, self.vocab_size, self.n_layers, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return V * d + self.seq_len * d + L * block + 2 * d + d * V


class LlamaConfig(ModelConfig):
    """`llama`: a Llama-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention;
    Qwen2 is `qkv_bias = true`), convertible to and from Hugging Face checkpoints by renaming."""

    TAG = "llama"
    family: Literal["llama"] = Field(description="Model family (trainer/model.py).")
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
    init: str | None = Field(
        None, description="A local Hugging Face model directory (config.json + safetensors) to "
        "start from: its weights are the genesis checkpoint. Fields left out of [model] are "
        "taken from its config.json; fields given must agree with it."
    )

    def _check_family(self) -> None:
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) is not divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"head size d_model / n_heads ({self.d_model // self.n_heads}) must be even "
                "for rotary embeddings"
            )

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
        kv = self.kv_heads * (self.d_model // self.n_heads)
        return min(self.d_model, self.vocab_size, kv, self.ffn_size)

    def n_params(self) -> int:
        d, V, L = self.d_model, self.vocab_size, self.n_layers
        hs, kv, f = d // self.n_heads, self.kv_heads, self.ffn_size
        attn = d * d + 2 * d * kv * hs + d * d + ((d + 2 * kv * hs) if self.qkv_bias else 0)
        block = 2 * d + attn + 3 * d * f
        return V * d + L * block + d + (0 if self.tie_embeddings else d * V)


#: The `[model]` section: the family's class, chosen by `family` (gpt when absent).
AnyModel = Annotated[
    Annotated[GptConfig, Tag("gpt")] | Annotated[LlamaConfig, Tag("llama")],
    Discriminator(ModelConfig.tag_of),
]
dispatch(ModelConfig, AnyModel)
