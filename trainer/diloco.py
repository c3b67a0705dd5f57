"""DiLoCo's outer loop: pseudo-gradients, their exchange, the outer optimizer, and the
one-step-delay overlap.

DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models"; DiLoCoX, 2025, adds pipelining, overlap and compression): each replica
takes H inner AdamW steps alone, then the replicas average their pseudo-gradients
delta = theta_outer - theta_local and an outer Nesterov-SGD step moves theta_outer.

Pieces here are small and swappable:
- all cross-replica traffic goes through a `Transport` (trainer/transport.py): each
  replica all-gathers its compressed contribution (trainer/compress.py), and every replica
  decodes the R contributions and averages them in replica order (`mean_in_order`);
- `OuterOptimizer` is the outer copy of one stage's parameters plus its momentum; it is
  what a `StageShard` serialises, and `apply_outer_step` lets a verifier recompute a step
  from the published contribution bytes (any compression kind) with exactly the code the
  trainer ran;
- `DiLoCo` ties a stage's local module to its outer copy and runs the round-end protocol,
  synchronous (delay 0) or one step behind (delay 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.compress import Compressor, decode_contribution
from trainer.config import OuterConfig
from trainer.transport import Pending, Transport

__all__ = [
    "AppliedStep",
    "DiLoCo",
    "OuterOptimizer",
    "apply_outer_step",
    "mean_in_order",
]


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


class OuterOptimizer:
    """theta_outer and its Nesterov momentum for one stage; the content of a StageShard.

    The step is torch.optim.SGD's single-tensor update (lr, momentum, nesterov; no
    dampening, no weight decay), written out with the same tensor operations in the same
    order, so it is bit for bit what `SGD(..., foreach=False)` computes. The momentum
    buffer is always present (zeros at genesis), so the first step takes the same path as
    every later one and a verifier can replay any step from a shard. Written out rather
    than constructed: building a torch optimizer imports torch._dynamo (about 1.5 s), which
    a verifier recomputing an outer step would pay in every process.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        cfg: OuterConfig,
        momentum: dict[str, torch.Tensor] | None = None,
        *,
        adopt: bool = False,
    ):
        """`adopt`: take float32 tensors nobody else holds (freshly decoded) as they are,
        rather than copying them."""
        # Always on the CPU: the outer copy is what crosses the slow link and gets hashed.
        own = (lambda t: t.detach().float()) if adopt else (lambda t: t.detach().to("cpu", torch.float32, copy=True))
        self.names = sorted(params)
        self.cfg = cfg
        self.params = {n: own(params[n]) for n in self.names}
        self._momentum = {}
        for n, p in self.params.items():
            buf = own(momentum[n]) if momentum is not None else torch.zeros_like(p)
            assert buf.shape == p.shape, (
                f"momentum/{n}: shape {tuple(buf.shape)} != {tuple(p.shape)}"
            )
            self._momentum[n] = buf

    def momentum(self) -> dict[str, torch.Tensor]:
        return dict(self._momentum)

    @torch.no_grad()
    def step(self, mean_delta: dict[str, torch.Tensor]) -> None:
        """One outer step with gradient = the replicas' mean pseudo-gradient."""
        assert sorted(mean_delta) == self.names, "delta names do not match the outer params"
        lr, mu, nesterov = self.cfg.lr, self.cfg.momentum, self.cfg.nesterov
        for n, p in self.params.items():
            grad = mean_delta[n].to(p.dtype)
            if mu != 0:  # torch.optim.sgd._single_tensor_sgd, dampening 0
                buf = self._momentum[n]
                buf.mul_(mu).add_(grad, alpha=1)
                grad = grad.add(buf, alpha=mu) if nesterov else buf
            p.add_(grad, alpha=-lr)

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
        return cls(params, cfg, momentum, adopt=True)  # bytes_to_tensors gives writable copies


def apply_outer_step(shard: bytes, contributions: list[bytes], cfg: OuterConfig) -> bytes:
    """Recompute a stage's new shard from its parent shard and the replicas' published
    contributions (any compression kind; see `trainer.artifacts.Contribution`), in replica
    order. Bit-identical to what training ran: the same decoder, the same ordered mean."""
    outer = OuterOptimizer.from_bytes(shard, cfg)
    shapes = {n: p.shape for n, p in outer.params.items()}
    per_replica = []
    for data in contributions:
        deltas = decode_contribution(data, shapes)
        per_replica.append([deltas[n] for n in outer.names])
    mean = mean_in_order(per_replica)
    outer.step(dict(zip(outer.names, mean, strict=True)))
    return outer.to_bytes()


@dataclass(frozen=True)
class AppliedStep:
    """An outer step that was just applied: the round whose pseudo-gradients it averaged,
    this replica's published contribution for that round, and the caller's tag for it."""

    round: int
    payload: bytes
    tag: Any


class DiLoCo:
    """The outer loop for one pipeline stage of one replica.

    Args:
        module: this rank's stage (theta_local, trained by the inner optimizer).
        cfg: the outer optimizer (lr = eta, momentum = mu, Nesterov) and `delay` (the
            one-step-delay overlap: 0 synchronous, 1 one step behind).
        transport: the stage's cross-replica exchange (counts and shapes every byte).
        compressor: this replica-stage's compressor (error feedback state lives there).

    One-step-delay overlap (delay 1), at the end of round t:
      1. compute delta_t against theta_outer (not yet updated) and compress it;
      2. wait for the exchange of delta_{t-1} started at the end of round t-1;
      3. step the outer optimizer with mean(delta_{t-1});
      4. copy theta_outer into the local model and start exchanging delta_t in the
         background, while round t+1's inner steps run.
    Round 1 has no pending exchange (step 3 is skipped; the local model still restarts from
    theta_outer); `flush()` after the last round applies the last pending exchange. So
    round t's contribution is applied, and published, at outer step t either way.

    On failure of any replica the collective inside the transport raises (gloo reports the
    closed peer); the round is lost and the job resumes from the last committed shard.
    """

    def __init__(
        self, module: nn.Module, cfg: OuterConfig, transport: Transport, compressor: Compressor
    ):
        self.module = module
        self.cfg = cfg
        self.transport = transport
        self.compressor = compressor
        self.local = dict(module.named_parameters())
        self.outer = OuterOptimizer(self.local, cfg)
        self.shapes = {n: p.shape for n, p in self.outer.params.items()}
        self._pending: tuple[Pending, int, bytes, Any] | None = None
        self.decode_s = 0.0  # time spent decoding received contributions
        # Test-only (trainer/cheat.py): (round, honest delta) -> the delta published and sent.
        self.tamper: Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def extra_memory_bytes(self) -> int:
        """Bytes DiLoCo holds beyond the model: outer weights, momentum, compressor state."""
        outer = sum(4 * p.numel() for p in self.outer.params.values())
        return 2 * outer + self.compressor.state_bytes()

    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """delta = theta_outer - theta_local (points where the inner steps did not go)."""
        return {n: (self.outer.params[n] - self.local[n].detach().cpu()) for n in self.outer.names}

    @torch.no_grad()
    def end_round(
        self,
        round_t: int,
        tag: Any = None,
        loss: float | None = None,
        budget_bytes: float | None = None,
    ) -> AppliedStep | None:
        """The round-end protocol; returns the outer step it applied, if any (delay 1
        applies round t-1's exchange, so round 1 returns None)."""
        delta = self.pseudo_gradient()
        delta = delta if self.tamper is None else self.tamper(round_t, delta)
        payload = self.compressor.compress(delta, round_t, loss, budget_bytes)
        if self.cfg.delay == 0:
            self._apply(self.transport.all_gather(payload))
            return AppliedStep(round_t, payload, tag)
        applied = self.flush()
        if applied is None:
            self._reset_local()
        self._pending = (self.transport.start_all_gather(payload), round_t, payload, tag)
        return applied

    @torch.no_grad()
    def flush(self) -> AppliedStep | None:
        """Wait for the exchange in flight (if any) and apply it."""
        if self._pending is None:
            return None
        pending, round_t, payload, tag = self._pending
        self._pending = None
        start = time.perf_counter()
        blobs = pending.wait()
        self.transport.wait_s += time.perf_counter() - start
        self._apply(blobs)
        return AppliedStep(round_t, payload, tag)

    def _apply(self, blobs: list[bytes]) -> None:
        start = time.perf_counter()
        decoded = [decode_contribution(b, self.shapes) for b in blobs]
        self.decode_s += time.perf_counter() - start
        names = self.outer.names
        mean = mean_in_order([[d[n] for n in names] for d in decoded])
        self.outer.step(dict(zip(names, mean, strict=True)))
        self._reset_local()

    def _reset_local(self) -> None:
        for n in self.outer.names:
            self.local[n].copy_(self.outer.params[n])
