"""The model families behind one interface, and the small GPT (after nanoGPT).

`build_model(cfg, seed)` builds the full model of `cfg.family` (`gpt`, here, or `llama`,
trainer/llama.py); `build_stage` builds one pipeline stage alone: the full model's
`skeleton` on the meta device, the stage cut from it (every family's full model has
`.stage(stage, stages)`), and only the stage's tensors made and initialised, with the
bits the full model would hold (the family's `.init_steps()`, trainer/stage_init.py). A
stage maps tokens (first stage) or activations to activations or logits (last stage), and
its parameter names do not depend on the split.

Numerics (`build_model(cfg, seed, numerics=...)`): modules compute through an `Ops`
namespace. `native` (the default) is torch's own kernels, today's bits (pinned checkpoint
CIDs depend on them), which differ between CPUs; `portable` computes every forward and
backward through trainer/portable.py, the same bits on every CPU, with the same modules and
parameter names.

The GPT:

Pre-LN transformer blocks with causal self-attention and a GELU MLP, learned positional
embeddings, a final LayerNorm and an untied head. `GPT` is the full model (its modules; its
initialisation is `GPT.init_steps`, GPT-2's); `build_stage` gives one pipeline stage the
weights the full model has under a fixed seed (so every replica starts identical). Stage
parameter names equal the full model's names (`wte.weight`, `blocks.2.attn.c_attn.weight`,
`lm_head.weight`, ...), so they are stable across stage counts and deterministic.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from trainer.config import GptConfig, LlamaConfig, ModelConfig, stage_layers
from trainer.ops import NUMERICS, Ops, PortableOps, ops_for
from trainer.stage_init import Step, constructor_steps, materialise

__all__ = [
    "GPT", "NUMERICS", "Block", "GPTStage", "Ops", "PortableOps", "build_model", "build_stage",
    "ops_for", "skeleton", "stage_layers",
]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GptConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.ops.linear(self.c_attn, x).split(C, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_heads
        q = q.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_heads, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = self.ops.attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.ops.dropout(self.resid_dropout, self.ops.linear(self.c_proj, y))


class MLP(nn.Module):
    def __init__(self, cfg: GptConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.c_fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        h = ops.gelu(self.gelu, ops.linear(self.c_fc, x))  # (B, T, 4C)
        return ops.dropout(self.dropout, ops.linear(self.c_proj, h))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN: normalise, transform, add back to the residual stream."""

    def __init__(self, cfg: GptConfig, ops: Ops):
        super().__init__()
        self.ops = ops
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, ops)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same-shape adds are portable as they are (forward and backward).
        x = x + self.attn(self.ops.layer_norm(self.ln_1, x))
        return x + self.mlp(self.ops.layer_norm(self.ln_2, x))


class GPTStage(nn.Module):
    """A contiguous slice of the GPT: optional embeddings, some blocks, optional head.

    Input: int64 tokens (B, T) if it holds the embeddings, else activations (B, T, C).
    Output: logits (B, T, V) if it holds the head, else activations (B, T, C).
    """

    def __init__(
        self,
        *,
        wte: nn.Embedding | None,
        wpe: nn.Embedding | None,
        blocks: dict[str, nn.Module],
        ln_f: nn.LayerNorm | None,
        lm_head: nn.Linear | None,
        drop: nn.Dropout | None = None,
        checkpointing: bool = False,
        ops: Ops | None = None,
    ):
        super().__init__()
        self.ops = ops if ops is not None else Ops()
        self.checkpointing = checkpointing  # recompute each block's activations in backward
        assert (wte is None) == (wpe is None), "token and position embeddings go together"
        assert (ln_f is None) == (lm_head is None), "final norm and head go together"
        self.wte = wte
        self.wpe = wpe
        self.drop = drop if drop is not None else nn.Dropout(0.0)
        # Keys are the global block indices, so names do not depend on the split.
        self.blocks = nn.ModuleDict(blocks)
        self.ln_f = ln_f
        self.lm_head = lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            T = x.size(1)
            assert self.wpe is not None
            assert T <= self.wpe.num_embeddings, f"sequence length {T} > {self.wpe.num_embeddings}"
            pos = torch.arange(T, device=x.device)  # (T,)
            ops = self.ops
            x = ops.dropout(self.drop, ops.add(ops.embedding(self.wte, x), ops.embedding(self.wpe, pos)))  # (B, T, C) + (T, C)
        for block in self.blocks.values():
            if self.checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)  # (B, T, C); keeps only the input
            else:
                x = block(x)  # (B, T, C)
        if self.lm_head is not None:
            assert self.ln_f is not None
            x = self.ops.linear(self.lm_head, self.ops.layer_norm(self.ln_f, x))  # (B, T, V)
        return x


class GPT(GPTStage):
    """The whole model: a GPTStage that holds every part."""

    def __init__(self, cfg: GptConfig, ops: Ops | None = None):
        ops = ops if ops is not None else Ops()
        super().__init__(
            wte=nn.Embedding(cfg.vocab_size, cfg.d_model),
            wpe=nn.Embedding(cfg.seq_len, cfg.d_model),
            blocks={str(i): Block(cfg, ops) for i in range(cfg.n_layers)},
            ln_f=nn.LayerNorm(cfg.d_model),
            lm_head=nn.Linear(cfg.d_model, cfg.vocab_size, bias=False),
            drop=nn.Dropout(cfg.dropout),
            checkpointing=cfg.activation_checkpointing,
            ops=ops,
        )
        self.cfg = cfg  # the parameters are as torch's constructors leave them: see init_steps

    def init_steps(self) -> tuple[list[Step], dict[str, str]]:
        """The whole model's initialisation (trainer/stage_init.py), in its order: torch's
        constructors (module order is construction order here), then GPT-2's: every Linear
        and Embedding weight normal(0, 0.02), biases zero, then the residual projections
        again with std 0.02 / sqrt(2 * n_layers), so the residual stream's variance does
        not grow with depth. No ties."""
        modules = list(self.named_modules())
        steps = constructor_steps(modules)
        for name, m in modules:
            if isinstance(m, nn.Linear | nn.Embedding):
                steps.append(Step(f"{name}.weight", tuple(m.weight.shape), "normal", 0.02))
            if isinstance(m, nn.Linear) and m.bias is not None:
                steps.append(Step(f"{name}.bias", tuple(m.bias.shape), "fill", 0.0))
        std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        steps += [Step(name, tuple(p.shape), "normal", std)
                  for name, p in self.named_parameters() if name.endswith("c_proj.weight")]
        return steps, {}

    def stage(self, stage: int, stages: int) -> GPTStage:
        """The part of this model that pipeline stage `stage` of `stages` holds (shared modules)."""
        first, last = stage == 0, stage == stages - 1
        return GPTStage(
            wte=self.wte if first else None,
            wpe=self.wpe if first else None,
            blocks={
                str(i): self.blocks[str(i)] for i in stage_layers(self.cfg.n_layers, stage, stages)
            },
            ln_f=self.ln_f if last else None,
            lm_head=self.lm_head if last else None,
            drop=self.drop if first else None,
            checkpointing=self.cfg.activation_checkpointing,
            ops=self.ops,
        )


class _NoMetaNormal(TorchFunctionMode):
    """Constructors' `normal_` on meta tensors does nothing: on the meta device torch runs
    it through a Python reference that imports torch._dynamo (1.3 s and 70 MB, once per
    process), to fill nothing."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if func in (nn.init.normal_, torch.Tensor.normal_) and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def skeleton(cfg: ModelConfig, numerics: str = "native") -> nn.Module:
    """The full model of `cfg.family` (`GPT` or `trainer.llama.Llama`) on the meta device:
    its modules, names and shapes, no memory and no values. Either has `.stage(stage,
    stages)` and `.init_steps()`."""
    ops = ops_for(numerics)
    with torch.device("meta"), _NoMetaNormal():
        if isinstance(cfg, LlamaConfig):
            from trainer.llama import Llama

            return Llama(cfg, ops)
        if isinstance(cfg, GptConfig):
            return GPT(cfg, ops)
        raise TypeError(f"no model of family {cfg.family!r}")


def build_model(cfg: ModelConfig, seed: int, numerics: str = "native") -> nn.Module:
    """The full model of `cfg.family` (`GPT` or `trainer.llama.Llama`), initialised from
    `seed` without touching the caller's RNG state. Either has `.stage(stage, stages)`.
    `numerics`: "native" (torch's kernels) or "portable" (trainer/portable.py: the same
    initial weights and training bits on every CPU; other weights than native's)."""
    model: Any = skeleton(cfg, numerics)  # GPT or Llama: nn.Module's type hides `.init_steps`
    steps, ties = model.init_steps()
    return materialise(model, steps, ties, seed, model.ops)


def build_stage(cfg: ModelConfig, stage: int, stages: int, seed: int,
                numerics: str = "native") -> nn.Module:
    """Pipeline stage `stage` of `stages`, alone: only its tensors are made, with the bits
    the full model built under `seed` holds there (trainer/stage_init.py)."""
    model: Any = skeleton(cfg, numerics)  # GPT or Llama: nn.Module's type hides `.stage`
    steps, ties = model.init_steps()
    return materialise(model.stage(stage, stages), steps, ties, seed, model.ops)
