"""Stages built alone (trainer/stage_init.py) hold the bits of the whole model's.

The reference is the way every rank built its stage before: the whole model's modules
constructed on the CPU from the global generator seeded with the job's seed (torch's
constructors drawing as they go), the family's init code run over them in place (kept
here as it was), then the stage cut out. Every stage built alone must equal that cut:
the same state_dict keys, in order, and every tensor `torch.equal`; parameters shared in
the reference (a tied head) shared alike. Both families, native and portable numerics, S
= 1, 2, 3, tied and untied embeddings, q/k/v biases, and a portable normal longer than one
Box-Muller chunk.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from trainer import portable
from trainer.config import ModelConfig
from trainer.llama import Llama
from trainer.model import GPT, build_model, build_stage, ops_for, skeleton
from trainer.stage_init import Step, materialise

SEED = 11

CONFIGS = {
    "gpt": dict(d_model=32, n_layers=3, n_heads=2, seq_len=16, vocab_size=64),
    "llama": dict(family="llama", d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=80,
                  seq_len=16),
    "llama-tied-qkv-bias": dict(family="llama", d_model=32, n_layers=3, n_heads=4, vocab_size=48,
                                seq_len=16, tie_embeddings=True, qkv_bias=True),
}


def _old_gpt_init(model: GPT, cfg: ModelConfig) -> None:
    """GPT.__init__'s init before stages were built alone."""
    ops = model.ops

    def init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            ops.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            ops.normal_(module.weight, mean=0.0, std=0.02)

    model.apply(init_weights)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            ops.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))


def _old_llama(cfg: ModelConfig, numerics: str) -> Llama:
    """Llama.__init__ before stages were built alone: the modules (the head its own until
    the tie), HF's init in place, then the tie."""
    ops = ops_for(numerics)
    model = Llama(cfg.model_copy(update={"tie_embeddings": False}), ops)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            ops.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            ops.normal_(module.weight, mean=0.0, std=0.02)
    model.cfg = cfg
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # type: ignore[union-attr]
    return model


@torch.no_grad()
def old_whole_model(cfg: ModelConfig, seed: int, numerics: str) -> Any:
    """The whole model as `build_model` built it before: on the CPU, from the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if cfg.family == "llama":
            return _old_llama(cfg, numerics)
        model = GPT(cfg, ops_for(numerics))
        _old_gpt_init(model, cfg)
        return model


def _assert_same(alone: nn.Module, cut: nn.Module) -> None:
    a, b = alone.state_dict(keep_vars=True), cut.state_dict(keep_vars=True)
    assert list(a) == list(b)
    for name in a:
        assert a[name].device.type == "cpu" and a[name].dtype == torch.float32, name
        assert torch.equal(a[name], b[name]), name

    def sharing(m: nn.Module) -> list[list[str]]:
        groups: dict[int, list[str]] = {}
        for n, p in m.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(n)
        return sorted(groups.values())

    assert sharing(alone) == sharing(cut)


@pytest.mark.parametrize("numerics", ["native", "portable"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_stage_built_alone_is_the_old_whole_models_cut(name: str, numerics: str) -> None:
    cfg = ModelConfig(**CONFIGS[name])
    old = old_whole_model(cfg, SEED, numerics)
    _assert_same(build_model(cfg, SEED, numerics), old)
    for stages in (1, 2, 3):
        for s in range(stages):
            _assert_same(build_stage(cfg, s, stages, SEED, numerics), old.stage(s, stages))
    if cfg.tie_embeddings:  # one parameter, as the tie made it
        whole = build_stage(cfg, 0, 1, SEED, numerics)
        assert whole.lm_head.weight is whole.embed_tokens.weight  # type: ignore[union-attr]


def test_a_portable_normal_over_several_chunks_is_passed_over_exactly() -> None:
    """An embedding of more than 2**19 values: normal_ draws it in two chunks, which a
    later stage passes over with `skip_normal`'s uniforms alone."""
    cfg = ModelConfig(family="llama", d_model=64, n_layers=2, n_heads=2, vocab_size=8200, seq_len=8)
    assert cfg.vocab_size * cfg.d_model > 2 * portable._NORMAL_PAIRS
    old = old_whole_model(cfg, SEED, "portable")
    _assert_same(build_stage(cfg, 1, 2, SEED, "portable"), old.stage(1, 2))


def test_a_stage_holds_only_its_own_tensors_and_the_program_must_write_each() -> None:
    cfg = ModelConfig(**CONFIGS["llama"])
    last = build_stage(cfg, 2, 3, SEED)
    assert sorted({n.split(".")[0] for n in last.state_dict()}) == ["layers", "lm_head", "norm"]
    assert all(p.device.type == "cpu" for p in last.parameters())
    model: Any = skeleton(cfg)
    steps, ties = model.init_steps()
    short = [s for s in steps if s.name != "norm.weight"]
    with pytest.raises(RuntimeError, match="writes no norm.weight"):
        materialise(model.stage(2, 3), short, ties, SEED, model.ops)
    wrong = [Step(s.name, (1,), s.kind, s.value) if s.name == "norm.weight" else s for s in steps]
    with pytest.raises(AssertionError, match="norm.weight"):
        materialise(skeleton(cfg).stage(2, 3), wrong, ties, SEED, model.ops)  # type: ignore[operator]
