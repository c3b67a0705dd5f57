"""A Llama-architecture decoder in one file (after nanoGPT and torchtitan's Llama), and its
split into pipeline stages.

RMSNorm, rotary position embeddings (`rope_theta`), grouped-query attention (`n_kv_heads`
key/value heads shared by `n_heads` query heads), a SwiGLU MLP, no biases except the
optional q/k/v bias that Qwen2 sets (`qkv_bias`), and optionally tied input and output
embeddings. Parameter names are Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM`'s
without the leading `model.` (`embed_tokens.weight`, `layers.3.self_attn.q_proj.weight`,
`norm.weight`, `lm_head.weight`), with the same layouts, and the rotary embedding is the
same "rotate half" form, so converting a checkpoint either way is a rename
(`trainer/hf.py`); tests hold the logits to transformers' own.

`LlamaStage` is a contiguous slice of layers; the first stage holds the embeddings, the
last the final norm and head. `KVCache` lets `generate` feed one token at a time.

Modules compute through an `Ops` namespace (trainer/model.py): torch's own kernels
(native), or trainer/portable.py's (the same bits on every CPU); the RMSNorm and rotary
table formulas live there, one per numerics.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.config import LlamaConfig, stage_layers
from trainer.ops import Ops
from trainer.stage_init import Step, constructor_steps

__all__ = ["KVCache", "Llama", "LlamaStage"]


class RMSNorm(nn.Module):
    """x / rms(x) * weight (native: in float32 whatever the input's dtype, as HF does)."""

    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, nh, T, hs) queries or keys by their positions' angles."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


class KVCache:
    """Keys and values seen so far, per layer: (B, n_kv, T_seen, hs) each."""

    def __init__(self) -> None:
        self.layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pos = 0  # tokens already in the cache

    def extend(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.layers:
            pk, pv = self.layers[layer]
            k, v = torch.cat((pk, k), dim=2), torch.cat((pv, v), dim=2)
        self.layers[layer] = (k, v)
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, name: str, ops: Ops):
        super().__init__()
        self.ops = ops
        self.name = name  # the cache key
        self.n_heads, self.n_kv = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        d, hs = cfg.d_model, self.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hs, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * hs, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * hs, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * hs, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hs, ops = self.head_dim, self.ops
        q = ops.linear(self.q_proj, x).view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = ops.linear(self.k_proj, x).view(B, T, self.n_kv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = ops.linear(self.v_proj, x).view(B, T, self.n_kv, hs).transpose(1, 2)  # (B, nkv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        past = 0
        if cache is not None:
            past = cache.pos
            k, v = cache.extend(self.name, k, v)  # (B, nkv, past + T, hs)
        if self.n_kv != self.n_heads:  # each kv head serves n_heads / n_kv query heads
            rep = self.n_heads // self.n_kv
            k = ops.repeat_kv(k, rep)  # (B, nh, S, hs)
            v = ops.repeat_kv(v, rep)
        if past == 0:
            y = ops.attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:  # query i (position past + i) sees keys 0 .. past + i
            S = k.size(2)
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = ops.attention(q, k, v, mask=mask)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * hs)  # (B, T, nh*hs)
        return ops.linear(self.o_proj, y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        d, f = cfg.d_model, cfg.ffn_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        h = ops.silu(ops.linear(self.gate_proj, x)) * ops.linear(self.up_proj, x)  # (B, T, F)
        return ops.linear(self.down_proj, h)  # (B, T, C)


class DecoderLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, index: int, ops: Ops):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, str(index), ops)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStage(nn.Module):
    """A contiguous slice of the decoder: optional embeddings, some layers, optional head.

    Input: int64 tokens (B, T) if it holds the embeddings, else activations (B, T, C).
    Output: logits (B, T, V) if it holds the head, else activations (B, T, C).
    """

    def __init__(self, cfg: LlamaConfig, *, embed_tokens: nn.Embedding | None,
                 layers: dict[str, nn.Module], norm: RMSNorm | None, lm_head: nn.Linear | None,
                 ops: Ops | None = None):
        super().__init__()
        assert (norm is None) == (lm_head is None), "final norm and head go together"
        self.ops = ops if ops is not None else Ops()
        self.cfg = cfg
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleDict(layers)  # keys: global layer indices, stable across splits
        self.norm = norm
        self.lm_head = lm_head
        self.checkpointing = cfg.activation_checkpointing

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        ops = self.ops
        if self.embed_tokens is not None:
            x = ops.embedding(self.embed_tokens, x)  # (B, T) -> (B, T, C)
        T = x.size(1)
        start = cache.pos if cache is not None else 0
        positions = torch.arange(start, start + T, device=x.device)  # (T,)
        cos, sin = ops.rope_tables(self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta, positions)
        for layer in self.layers.values():
            if self.checkpointing and self.training and cache is None:
                # Keep only each layer's input; recompute its activations in backward.
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cache)  # (B, T, C)
        if cache is not None:
            cache.pos += T
        if self.lm_head is not None:
            assert self.norm is not None
            x = ops.linear(self.lm_head, self.norm(x))  # (B, T, V)
        return x


class Llama(LlamaStage):
    """The whole model: a LlamaStage holding every part."""

    def __init__(self, cfg: LlamaConfig, ops: Ops | None = None):
        ops = ops if ops is not None else Ops()
        embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        super().__init__(
            cfg,
            embed_tokens=embed,
            layers={str(i): DecoderLayer(cfg, i, ops) for i in range(cfg.n_layers)},
            norm=RMSNorm(cfg.d_model, cfg.rms_norm_eps, ops),
            lm_head=head,
            ops=ops,
        )
        if cfg.tie_embeddings:  # one matrix reads tokens in and scores them out
            head.weight = embed.weight

    def init_steps(self) -> tuple[list[Step], dict[str, str]]:
        """The whole model's initialisation (trainer/stage_init.py), in its order: torch's
        constructors in construction order (the embedding, the head, the layers: RMSNorm
        weights one), then HF's, module by module: every Linear and Embedding weight
        normal(0, initializer_range = 0.02), biases zero. Tied, the head is the embedding
        (its own draws are passed over, as the untied head it was until the tie)."""
        modules = list(self.named_modules())
        built_first = ("embed_tokens", "lm_head")  # constructed before the layers, in __init__
        steps = constructor_steps([(n, m) for n, m in modules if n in built_first]
                                  + [(n, m) for n, m in modules if n not in built_first])
        for name, m in modules:
            if isinstance(m, RMSNorm):
                steps.append(Step(f"{name}.weight", tuple(m.weight.shape), "fill", 1.0))
            if isinstance(m, nn.Linear | nn.Embedding):
                steps.append(Step(f"{name}.weight", tuple(m.weight.shape), "normal", 0.02))
            if isinstance(m, nn.Linear) and m.bias is not None:
                steps.append(Step(f"{name}.bias", tuple(m.bias.shape), "fill", 0.0))
        return steps, ({"lm_head.weight": "embed_tokens.weight"} if self.cfg.tie_embeddings else {})

    def stage(self, stage: int, stages: int) -> LlamaStage:
        """The part of this model that pipeline stage `stage` of `stages` holds (shared modules)."""
        first, last = stage == 0, stage == stages - 1
        return LlamaStage(
            self.cfg,
            embed_tokens=self.embed_tokens if first else None,
            layers={str(i): self.layers[str(i)] for i in stage_layers(self.cfg.n_layers, stage, stages)},
            norm=self.norm if last else None,
            lm_head=self.lm_head if last else None,
            ops=self.ops,
        )
