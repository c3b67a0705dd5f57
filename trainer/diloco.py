"""DiLoCo's outer loop: pseudo-gradients, their cross-replica average, the outer optimizer.

DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models"; DiLoCoX, 2025, adds pipelining, overlap and compression): each replica
takes H inner AdamW steps alone, then the replicas average their pseudo-gradients
delta = theta_outer - theta_local and an outer Nesterov-SGD step moves theta_outer.

Pieces here are small and swappable:
- `average_across_replicas` is the only cross-replica traffic. A later `Transport` (with
  compression, byte counting and link shaping) replaces it behind the same call.
- `OuterOptimizer` is the outer copy of one stage's parameters plus its momentum; it is
  what a `StageShard` serialises, and `apply_outer_step` lets a verifier recompute a step
  from published bytes with exactly the code the trainer ran.
- `DiLoCo` ties a stage's local module to its outer copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.config import OuterConfig

__all__ = [
    "Averager",
    "DiLoCo",
    "OuterOptimizer",
    "apply_outer_step",
    "average_across_replicas",
    "mean_in_order",
]

# Averages a list of tensors across replicas; every replica gets the same bits back.
Averager = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def mean_in_order(per_replica: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Mean over replicas, summed in replica order 0..R-1 then divided by R.

    The fixed order makes the float result reproducible by anyone holding the published
    contributions (an all-reduce's summation order belongs to the backend, not to us).
    """
    n = len(per_replica)
    assert n >= 1, "need at least one replica"
    out = [t.detach().clone() for t in per_replica[0]]
    for tensors in per_replica[1:]:
        assert len(tensors) == len(out), (
            f"replicas disagree on tensor count: {len(tensors)} != {len(out)}"
        )
        for acc, t in zip(out, tensors, strict=True):
            acc.add_(t)
    for acc in out:
        acc.div_(n)
    return out


def average_across_replicas(
    tensors: list[torch.Tensor], group: dist.ProcessGroup | None, replicas: int
) -> list[torch.Tensor]:
    """Average `tensors` over the stage's data-parallel group (all-gather, ordered sum).

    All tensors are packed into one flat float32 buffer so the exchange is one collective.
    """
    if replicas == 1:
        return [t.detach().clone() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])  # (N,)
    gathered = [torch.empty_like(flat) for _ in range(replicas)]
    # Deadlock hazard: every rank of the group must reach this call with the same N, in
    # the same order relative to other collectives on `group`.
    dist.all_gather(gathered, flat, group=group)
    (mean,) = mean_in_order([[g] for g in gathered])
    out, offset = [], 0
    for t in tensors:
        out.append(mean[offset : offset + t.numel()].view_as(t).to(t.dtype))
        offset += t.numel()
    return out


class OuterOptimizer:
    """theta_outer and its Nesterov momentum for one stage; the content of a StageShard.

    Uses torch.optim.SGD (lr, momentum, nesterov; no dampening, no weight decay) with
    the momentum buffer always present (zeros at genesis), so the first step takes the
    same code path as every later one and a verifier can replay any step from a shard.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        cfg: OuterConfig,
        momentum: dict[str, torch.Tensor] | None = None,
    ):
        self.names = sorted(params)
        self.params = {n: params[n].detach().clone().float() for n in self.names}
        self.cfg = cfg
        self._sgd = torch.optim.SGD(
            list(self.params.values()),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            foreach=False,
        )
        for n, p in self.params.items():
            buf = momentum[n].clone().float() if momentum is not None else torch.zeros_like(p)
            assert buf.shape == p.shape, (
                f"momentum/{n}: shape {tuple(buf.shape)} != {tuple(p.shape)}"
            )
            self._sgd.state[p]["momentum_buffer"] = buf

    def momentum(self) -> dict[str, torch.Tensor]:
        return {n: self._sgd.state[p]["momentum_buffer"] for n, p in self.params.items()}

    @torch.no_grad()
    def step(self, mean_delta: dict[str, torch.Tensor]) -> None:
        """One outer step with gradient = the replicas' mean pseudo-gradient."""
        assert sorted(mean_delta) == self.names, "delta names do not match the outer params"
        for n, p in self.params.items():
            p.grad = mean_delta[n].to(p.dtype).clone()
        self._sgd.step()
        for p in self.params.values():
            p.grad = None

    def to_bytes(self) -> bytes:
        tensors = {f"param/{n}": p for n, p in self.params.items()}
        tensors.update({f"momentum/{n}": m for n, m in self.momentum().items()})
        return tensors_to_bytes(tensors)

    @classmethod
    def from_bytes(cls, data: bytes, cfg: OuterConfig) -> OuterOptimizer:
        tensors = bytes_to_tensors(data)
        params = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
        momentum = {
            k.removeprefix("momentum/"): v for k, v in tensors.items() if k.startswith("momentum/")
        }
        if sorted(params) != sorted(momentum):
            raise ValueError("stage shard: param/ and momentum/ keys do not match")
        return cls(params, cfg, momentum)


def apply_outer_step(shard: bytes, contributions: list[bytes], cfg: OuterConfig) -> bytes:
    """Recompute a stage's new shard from its parent shard and the replicas' contributions
    (`delta/<name>` safetensors, in replica order). Bit-identical to what training ran."""
    outer = OuterOptimizer.from_bytes(shard, cfg)
    per_replica = []
    for data in contributions:
        deltas = {k.removeprefix("delta/"): v for k, v in bytes_to_tensors(data).items()}
        if sorted(deltas) != outer.names:
            raise ValueError("contribution: delta/ keys do not match the shard's params")
        per_replica.append([deltas[n] for n in outer.names])
    mean = mean_in_order(per_replica)
    outer.step(dict(zip(outer.names, mean, strict=True)))
    return outer.to_bytes()


class DiLoCo:
    """The outer loop for one pipeline stage of one replica.

    Args:
        module: this rank's stage (theta_local, trained by the inner optimizer).
        cfg: the outer optimizer (lr = eta, momentum = mu, Nesterov).
        average: cross-replica mean of a list of tensors (synchronous here; the later
            overlap mode starts it in the background and waits one round later).

    On failure of any replica the collective inside `average` raises (gloo reports the
    closed peer); the round is lost and the job resumes from the last committed shard.
    """

    def __init__(self, module: nn.Module, cfg: OuterConfig, average: Averager):
        self.module = module
        self.average = average
        self.local = dict(module.named_parameters())
        self.outer = OuterOptimizer(self.local, cfg)

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """delta = theta_outer - theta_local (points where the inner steps did not go)."""
        return {n: (self.outer.params[n] - self.local[n].detach()) for n in self.outer.names}

    @torch.no_grad()
    def sync(self) -> dict[str, torch.Tensor]:
        """End of round: average the deltas, step theta_outer, reset theta_local to it.

        Returns this replica's own (unaveraged) delta, the contribution it publishes.
        """
        delta = self.pseudo_gradient()
        names = self.outer.names
        mean = self.average([delta[n] for n in names])
        self.outer.step(dict(zip(names, mean, strict=True)))
        for n in names:
            self.local[n].copy_(self.outer.params[n])
        return delta
