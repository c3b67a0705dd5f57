"""A model's initial weights as a program, so that one pipeline stage is built alone with
the bits the whole model would give it.

A model family's initialisation draws from one generator seeded with the job's seed, in
one sequential stream (torch's CPU generator, a Mersenne Twister: no jumping ahead), every
tensor in turn: first what torch's module constructors draw (nn.Linear's kaiming-uniform
weight and uniform bias, nn.Embedding's standard normal; values the family's own init then
overwrites, but draws that move the stream), then the family's init (normal(0, 0.02)
through `Ops.normal_`, native or portable, and constants). A tensor's values depend on
where in that stream it is drawn, so a stage built alone must pass over every draw of the
tensors before it.

`Step` is one write of one tensor; a family's `init_steps()` lists them in the whole
model's order (the module constructors' order, then its init's), with its ties (a
parameter that is another's: Llama's tied head). `materialise` turns a stage cut from a
meta-device skeleton of the whole model into real tensors and walks the program once with
one generator: a step on a tensor the stage holds writes it; any other step advances the
generator by exactly what it would have drawn, into one reused scratch buffer (portable
normals: the uniforms alone, `Ops.skip_normal`). Building stage s of S holds the stage's
tensors plus that buffer (the largest tensor the stage does not hold), and takes the
draws before the stage's last tensor in time. The whole model is the one stage of one.

Every tensor of the stage must be written by some step (else `materialise` refuses: the
uninitialised memory would go unnoticed); tests/test_stage_init.py holds every stage built
alone to the same stage cut from a whole model built by the constructors and the family's
init code run in place, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from trainer.ops import Ops

__all__ = ["KINDS", "Step", "constructor_steps", "materialise"]

#: A step's kinds, and what each writes (each draws as the torch call named, nothing else):
KINDS = {
    "kaiming": "nn.Linear's weight: nn.init.kaiming_uniform_(a=sqrt(5))",
    "fan_in_uniform": "nn.Linear's bias: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = value",
    "std_normal": "nn.Embedding's weight: nn.init.normal_ (0, 1)",
    "normal": "the family's init: Ops.normal_(mean 0, std value)",
    "fill": "the constant value (no draw)",
}


@dataclass(frozen=True)
class Step:
    """One write of one tensor: `name` is the whole model's parameter as its own module
    holds it before any tie; `kind` one of KINDS, with its `value`."""

    name: str
    shape: tuple[int, ...]
    kind: str
    value: float = 0.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def constructor_steps(modules: Iterable[tuple[str, nn.Module]]) -> list[Step]:
    """What torch's constructors of these (named) modules write, in this order: nn.Linear
    and nn.Embedding draw, nn.LayerNorm fills; other modules write nothing here (a family
    adds its own modules' constants)."""
    steps = []
    for name, m in modules:
        pre = f"{name}." if name else ""
        if isinstance(m, nn.Linear):
            steps.append(Step(pre + "weight", tuple(m.weight.shape), "kaiming"))
            if m.bias is not None:
                steps.append(Step(pre + "bias", tuple(m.bias.shape), "fan_in_uniform", m.in_features))
        elif isinstance(m, nn.Embedding):
            assert m.padding_idx is None, "nn.Embedding with padding_idx also zeroes a row"
            steps.append(Step(pre + "weight", tuple(m.weight.shape), "std_normal"))
        elif isinstance(m, nn.LayerNorm):
            assert m.elementwise_affine, "a LayerNorm without weights writes nothing"
            steps.append(Step(pre + "weight", tuple(m.weight.shape), "fill", 1.0))
            if m.bias is not None:
                steps.append(Step(pre + "bias", tuple(m.bias.shape), "fill", 0.0))
    return steps


def _write(step: Step, t: torch.Tensor, g: torch.Generator, ops: Ops) -> None:
    """Carry out `step` on `t` (the stage's tensor, or scratch to pass over it)."""
    if step.kind == "kaiming":
        nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
    elif step.kind == "fan_in_uniform":
        bound = 1 / math.sqrt(step.value) if step.value > 0 else 0.0
        nn.init.uniform_(t, -bound, bound, generator=g)
    elif step.kind == "std_normal":
        nn.init.normal_(t, generator=g)
    elif step.kind == "normal":
        ops.normal_(t, mean=0.0, std=step.value, generator=g)
    elif step.kind == "fill":
        t.fill_(step.value)
    else:
        raise ValueError(f"unknown init step kind {step.kind!r}")


def _skip(step: Step, scratch: torch.Tensor, g: torch.Generator, ops: Ops) -> None:
    """Advance `g` by exactly what `step` draws, writing nothing of the stage's."""
    if step.kind == "fill":
        return
    view = scratch[: step.numel].view(step.shape)
    if step.kind == "normal":
        ops.skip_normal(view, g)
    else:  # torch's constructors' draws: the call itself, into scratch
        _write(step, view, g, ops)


def _to_cpu(stage: nn.Module) -> None:
    """Give `stage`'s meta parameters uninitialised CPU memory, a parameter that several
    modules share staying one. (Not `to_empty`: from a meta tensor, `empty_like` imports
    sympy, 0.5 s and 30 MB once per process, and it unshares shared parameters.)"""
    made: dict[int, nn.Parameter] = {}
    for module in stage.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
            module.register_parameter(key, made[id(p)])


@torch.no_grad()
def materialise(stage: nn.Module, steps: list[Step], ties: dict[str, str], seed: int,
                ops: Ops) -> nn.Module:
    """`stage` (modules on the meta device, cut from the whole model whose program `steps`
    is) with real CPU tensors holding exactly what the whole model built under `seed` holds
    there. `ties`: parameter name -> the name of the parameter it is (its own module's
    draws are passed over). The global RNG is left alone."""
    assert not list(stage.buffers()), "buffers are not part of the init program"
    _to_cpu(stage)
    targets: dict[str, torch.Tensor] = {}
    for name, p in stage.named_parameters(remove_duplicate=False):
        targets[ties.get(name, name)] = p
    skipped = [s.numel for s in steps if s.name not in targets and s.kind != "fill"]
    scratch = torch.empty(max(skipped, default=0))
    g = torch.Generator().manual_seed(seed)
    written = set()
    for step in steps:
        t = targets.get(step.name)
        if t is None:
            _skip(step, scratch, g, ops)
            continue
        assert tuple(t.shape) == step.shape, f"{step.name}: the program says {step.shape}, the model {tuple(t.shape)}"
        _write(step, t, g, ops)
        written.add(step.name)
    unwritten = sorted(set(targets) - written)
    if unwritten:
        raise RuntimeError(f"the init program writes no {unwritten[0]} ({len(unwritten)} tensors unwritten)")
    return stage
