"""The kernels the model families compute with, chosen per model by `parallel.numerics`:
`Ops` (native: torch's own kernels, the modules' own forward) or `PortableOps`
(trainer/portable.py: the same bits on every CPU). Modules call `self.ops.linear(layer, x)`
and the like, so one module tree serves both."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer import portable

__all__ = ["NUMERICS", "Ops", "PortableOps", "ops_for"]


class Ops:
    """The kernels a model computes with ("native"): torch's own, the modules' own forward.
    Modules call `self.ops.linear(self.c_fc, x)` and the like; `PortableOps` swaps them all."""

    name = "native"

    def normal_(self, t: torch.Tensor, mean: float, std: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
        return nn.init.normal_(t, mean=mean, std=std, generator=generator)

    def skip_normal(self, scratch: torch.Tensor, generator: torch.Generator) -> None:
        """Move `generator` on exactly as `normal_` on a contiguous float32 tensor of
        `scratch`'s size would (`scratch`: such a tensor, overwritten)."""
        nn.init.normal_(scratch, generator=generator)

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def layer_norm(self, layer: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / rms(x) * weight, computed in float32 whatever the input's dtype (as HF does)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def embedding(self, layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return layer(ids)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a + b where b broadcasts over a's leading dimensions."""
        return a + b

    def gelu(self, layer: nn.GELU, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def dropout(self, layer: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    def repeat_kv(self, x: torch.Tensor, rep: int) -> torch.Tensor:
        """(B, n_kv, T, hs) -> (B, n_kv * rep, T, hs), each head repeated rep times in place."""
        return x.repeat_interleave(rep, dim=1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  is_causal: bool = False, mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0) -> torch.Tensor:
        """softmax(q k^T / sqrt(hs)) v over (B, nh, T, hs); mask: bool, True = may attend."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
        )

    def rope_tables(self, head_dim: int, theta: float,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin tables, (T, hs) each, for the given positions (T,)."""
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs): the two halves rotate together
        return emb.cos(), emb.sin()


class PortableOps(Ops):
    """Every forward and backward through trainer/portable.py: the same bits on every CPU
    (float32 only; bfloat16 autocast does not reach these kernels)."""

    name = "portable"

    def normal_(self, t: torch.Tensor, mean: float, std: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
        return portable.normal_(t, mean=mean, std=std, generator=generator)

    def skip_normal(self, scratch: torch.Tensor, generator: torch.Generator) -> None:
        portable.skip_normal(scratch.numel(), generator)  # the uniforms alone, not the transform

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return portable.linear(x, layer.weight, layer.bias)

    def layer_norm(self, layer: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        assert len(layer.normalized_shape) == 1, "portable layer_norm: the last dimension only"
        return portable.layer_norm(x, layer.weight, layer.bias, layer.eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return portable.rms_norm(x, weight, eps)

    def embedding(self, layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        return portable.embedding(ids, layer.weight)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return portable.add(a, b)  # the broadcast operand's gradient: an exact sum

    def gelu(self, layer: nn.GELU, x: torch.Tensor) -> torch.Tensor:
        if layer.approximate != "none":
            raise NotImplementedError("portable numerics: the exact (erf) GELU only")
        return portable.gelu(x)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        return portable.silu(x)

    def dropout(self, layer: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
        return portable.dropout(x, layer.p, layer.training)

    def repeat_kv(self, x: torch.Tensor, rep: int) -> torch.Tensor:
        return portable.repeat_kv(x, rep, dim=1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  is_causal: bool = False, mask: torch.Tensor | None = None,
                  dropout_p: float = 0.0) -> torch.Tensor:
        return portable.scaled_dot_product_attention(
            q, k, v, causal=is_causal, mask=mask, dropout_p=dropout_p
        )

    def rope_tables(self, head_dim: int, theta: float,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return portable.rope_tables(head_dim, theta, positions)


NUMERICS = ("native", "portable")


def ops_for(numerics: str) -> Ops:
    """The Ops namespace of `numerics` ("native" or "portable")."""
    if numerics == "native":
        return Ops()
    if numerics == "portable":
        return PortableOps()
    raise ValueError(f"numerics must be one of {NUMERICS}, not {numerics!r}")
