"""Sampling text from a full model (`trainer.model.build_model`), for `dlx generate`.

    tokens = generate(model, prompt_ids, max_new_tokens=200, temperature=0.8, top_k=50, seed=0)

Temperature 0 is greedy (argmax, the first of equal logits). Otherwise the next token is
drawn from softmax(logits / temperature) restricted to the `top_k` likeliest tokens, by a
CPU `torch.Generator` seeded with `seed`: the same model, prompt and seed give the same
tokens, on any device.

Context: both families see at most `seq_len` tokens, the length they were trained on.
The gpt (learned positions, no cache) re-reads the last `seq_len` tokens for every new
one. The llama keeps a KV cache: it prefills the prompt's last `seq_len` tokens, then
feeds one token at a time; when the cache is full it restarts from the last `seq_len / 2`
tokens (one prefill every `seq_len / 2` tokens), so its context runs between half a
window and a whole one instead of sliding token by token. Rotary positions are
relative, so the restart costs only the context dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from trainer.config import ModelConfig

__all__ = ["generate"]


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.8,
             top_k: int | None = 50, seed: int = 0, on_token: Callable[[int], None] | None = None) -> list[int]:
    """The `max_new_tokens` tokens `model` continues `prompt_ids` with; `on_token` is
    called with each as soon as it is chosen (to stream it)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    model.eval()
    cfg: ModelConfig = cast(ModelConfig, model.cfg)
    device = next(model.parameters()).device
    next_logits = _cached(model, cfg.seq_len, device) if cfg.family == "llama" else _windowed(model, cfg.seq_len, device)
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = _pick(next_logits(ids), temperature, top_k, gen)
        ids.append(token)
        out.append(token)
        if on_token is not None:
            on_token(token)
    return out


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    """One token from the last position's logits (V,)."""
    logits = logits.float().cpu()
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties at the k-th stay in
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def _windowed(model: nn.Module, seq_len: int, device: torch.device) -> Callable[[list[int]], torch.Tensor]:
    def next_logits(ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids[-seq_len:]], device=device)  # (1, T <= seq_len)
        return model(x)[0, -1]  # (V,)

    return next_logits


def _cached(model: nn.Module, seq_len: int, device: torch.device) -> Callable[[list[int]], torch.Tensor]:
    from trainer.llama import KVCache

    cache: KVCache | None = None
    fed = 0  # how many of `ids` the model has seen (the cache holds the last cache.pos)

    def next_logits(ids: list[int]) -> torch.Tensor:
        nonlocal cache, fed
        new = ids[fed:]
        if cache is None or cache.pos + len(new) > seq_len:
            # First call: the prompt's last seq_len tokens; a full cache: the last half window.
            keep = seq_len if cache is None else max(1, seq_len // 2)
            cache, new = KVCache(), ids[-keep:]
        x = torch.tensor([new], device=device)  # (1, T)
        fed = len(ids)
        return model(x, cache)[0, -1]  # (V,)

    return next_logits
