"""DiLoCo's outer loop: pseudo-gradients, their exchange, the outer optimizer, and the
rules that overlap the exchange with computation.

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
  synchronous (delay 0) or overlapped (delay 1) under one of three rules (`partial`,
  `eager`, `restart`; documented on the class), with `eager_start` and `merge_weights`
  the two pieces a replay and a verifier re-run to derive a round's start weights.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainer.artifacts import bytes_to_tensors, tensors_to_bytes
from trainer.compress import Compressor, ContributionReader, decode_contribution, stream_batches
from trainer.config import AnyOuter
from trainer.hooks import unchanged
from trainer.transport import Pending, Transport

__all__ = [
    "AppliedStep",
    "DeltaHook",
    "DiLoCo",
    "OuterOptimizer",
    "apply_outer_step",
    "contribution",
    "eager_start",
    "fragment_groups",
    "fragment_of",
    "mean_in_order",
    "merge_weights",
    "outer_step_from",
    "step_names",
]


Deltas = Mapping[str, torch.Tensor]
STEP_ELEMENTS = 1 << 16  # values of one tensor a float64 outer step computes at a time
#: (round, honest pseudo-gradient) -> the one a rank publishes and sends (an injected hook).
DeltaHook = Callable[[int, Deltas], Deltas]


@torch.no_grad()
def contribution(
    compressor: Compressor,
    reference: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    round_t: int,
    loss: float | None,
    budget: float | None,
    publish: DeltaHook = unchanged,
    names: Iterable[str] | None = None,
) -> bytes:
    """A round's contribution payload: delta = reference - theta_local (on the CPU, by
    sorted name; over `names`, the round's fragment, or every parameter), passed through
    `publish`, compressed under `budget` bytes. The one function training
    (`DiLoCo.end_round`), an exact resume and a replay (`trainer.rounds.rerun_round`) all
    call, so their payloads agree bit for bit. Each tensor of delta is computed when the
    compressor reads it (`PseudoGradient`), never the whole stage's at once."""
    delta = PseudoGradient(reference, local, sorted(reference if names is None else names))
    return compressor.compress(publish(round_t, delta), round_t, loss, budget)


class PseudoGradient(Mapping[str, torch.Tensor]):
    """delta = reference - theta_local by name (`names`, sorted), each tensor computed on the
    CPU when read: the same values as computing them all at once, in a tensor's memory."""

    def __init__(self, reference: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor],
                 names: list[str]) -> None:
        self.reference, self.local, self.names = reference, local, names

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.reference or name not in self.names:
            raise KeyError(name)
        return self.reference[name] - self.local[name].detach().cpu()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _natural_key(name: str) -> tuple:
    """Sort key reading digit runs as numbers: blocks.2 before blocks.10."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def fragment_groups(shapes: Mapping[str, Sequence[int]], fragments: int) -> list[list[str]]:
    """Streaming DiLoCo's fragments of one stage (Douillard et al. 2025, arXiv 2501.18512):
    its parameter names in natural order (block 2 before block 10, so blocks stay whole
    and in depth order) cut into `fragments` contiguous groups of about equal element
    count, none empty: a tensor joins the group its middle element falls in, by
    cumulative size, but never skips a group and always leaves a tensor for each group
    still empty. Each group's names come sorted. A function of names and shapes alone, so
    a verifier derives the same groups from a shard."""
    names = sorted(shapes, key=_natural_key)
    if not 1 <= fragments <= len(names):
        raise ValueError(f"fragments ({fragments}) must be in [1, {len(names)}] (the stage's tensors)")
    sizes = [math.prod(shapes[n]) for n in names]
    total = max(1, sum(sizes))
    groups: list[list[str]] = [[] for _ in range(fragments)]
    g, seen = 0, 0
    for i, (n, size) in enumerate(zip(names, sizes, strict=True)):
        middle = fragments * (2 * seen + size) // (2 * total)  # the group its middle element falls in
        want = max(g, min(fragments - 1, middle), fragments - (len(names) - i))
        g = min(want, g + 1) if groups[g] else g
        groups[g].append(n)
        seen += size
    return [sorted(group) for group in groups]


def fragment_of(round_t: int, groups: list[list[str]]) -> list[str]:
    """The fragment round `round_t` exchanges: group (t - 1) mod F."""
    return groups[(round_t - 1) % len(groups)]


def step_names(shapes: Mapping[str, Sequence[int]], fragments: int, round_t: int) -> list[str]:
    """The parameter names round `round_t` exchanges, sorted: every one, or with
    `fragments` > 1 the round's group."""
    return sorted(shapes) if fragments == 1 else fragment_of(round_t, fragment_groups(shapes, fragments))


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

    The step is torch.optim.SGD's update (lr, momentum, nesterov; no dampening, no weight
    decay), written out in the run's arithmetic (`_moved`): float64 formulas rounded once,
    the same bits on every machine, or for runs recorded before that existed the float32
    single-tensor update of `SGD(..., foreach=False)`. The momentum
    buffer is always present (zeros at genesis), so the first step takes the same path as
    every later one and a verifier can replay any step from a shard. Written out rather
    than constructed: building a torch optimizer imports torch._dynamo (about 1.5 s), which
    a verifier recomputing an outer step would pay in every process.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        cfg: AnyOuter,
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
        """One outer step with gradient = the replicas' mean pseudo-gradient, on the
        parameters it names (a fragment, or all); the others and their momentum stay. In
        place; under float64 arithmetic `STEP_ELEMENTS` values at a time (its formulas are
        elementwise, so the bits are the whole tensor's), so its float64 temporaries are a
        slice's, not the largest tensor's."""
        assert set(mean_delta) <= set(self.params), "delta names are not outer params"
        for n in sorted(mean_delta):
            p, buf, g = self.params[n], self._momentum[n], mean_delta[n]
            if self.cfg.arithmetic == "float32" or not (p.is_contiguous() and buf.is_contiguous()):
                new_p, new_buf = self._moved(p, buf, g)  # whole tensors: the recorded runs' kernels
                p.copy_(new_p)
                buf.copy_(new_buf)
                continue
            p, buf, g = p.view(-1), buf.view(-1), g.reshape(-1)
            for i in range(0, p.numel(), STEP_ELEMENTS):
                part = slice(i, i + STEP_ELEMENTS)
                new_p, new_buf = self._moved(p[part], buf[part], g[part])
                p[part].copy_(new_p)
                buf[part].copy_(new_buf)

    @torch.no_grad()
    def lookahead(self, mean_delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights `step(mean_delta)` would give, without moving this optimizer: the
        same operations, so the same bits."""
        assert sorted(mean_delta) == self.names, "delta names do not match the outer params"
        return {n: self._moved(self.params[n], self._momentum[n], mean_delta[n])[0] for n in self.names}

    def _moved(self, p: torch.Tensor, buf: torch.Tensor, mean_delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, momentum) after one step of the weights `p` with momentum `buf` and
        gradient `mean_delta`, new tensors (float32), in the run's arithmetic (`OuterConfig.arithmetic`):
        float64: each formula in float64 by separate correctly rounded operations (no fused
        multiply-add, whatever the CPU), rounded to float32 once, so every IEEE-754 machine
        gets the same bits; float32: torch.optim.SGD's single-tensor update as runs before
        2026-12-04 computed it (its `alpha=` adds fuse a multiply-add on CPUs whose kernels
        do, so the bits follow the kernel set)."""
        lr, mu, nesterov = self.cfg.lr, self.cfg.momentum, self.cfg.nesterov
        if self.cfg.arithmetic == "float32":
            grad = mean_delta.to(p.dtype)
            if mu != 0:  # torch.optim.sgd._single_tensor_sgd, dampening 0
                buf = buf.mul(mu).add(grad, alpha=1)
                grad = grad.add(buf, alpha=mu) if nesterov else buf
            return p.add(grad, alpha=-lr), buf
        g = mean_delta.double()
        if mu == 0:
            return (p.double() - g * lr).float(), buf.clone()
        b = buf.double() * mu + g  # momentum: b <- mu b + g
        step = g + b * mu if nesterov else b
        return (p.double() - step * lr).float(), b.float()

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a StageShard holds: ``param/<name>`` and ``momentum/<name>`` (the live tensors)."""
        tensors = {f"param/{n}": p for n, p in self.params.items()}
        tensors.update({f"momentum/{n}": m for n, m in self._momentum.items()})
        return tensors

    def to_bytes(self) -> bytes:
        return tensors_to_bytes(self.tensors())

    @classmethod
    def from_bytes(cls, data: bytes, cfg: AnyOuter) -> OuterOptimizer:
        tensors = bytes_to_tensors(data)
        params = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
        momentum = {
            k.removeprefix("momentum/"): v for k, v in tensors.items() if k.startswith("momentum/")
        }
        if sorted(params) != sorted(momentum):
            raise ValueError("stage shard: param/ and momentum/ keys do not match")
        return cls(params, cfg, momentum, adopt=True)  # bytes_to_tensors gives writable copies


def apply_outer_step(shard: bytes, contributions: list[bytes], cfg: AnyOuter, step: int | None = None) -> bytes:
    """Recompute a stage's new shard (outer step `step`) from its parent shard and the
    replicas' published contributions (any compression kind; see
    `trainer.artifacts.Contribution`), in replica order, over the step's fragment
    (`cfg.fragments`; all parameters when 1). Bit-identical to what training ran: the same
    decoder, the same ordered mean. ValueError if a contribution holds other tensors."""
    outer = OuterOptimizer.from_bytes(shard, cfg)
    shapes = {n: p.shape for n, p in outer.params.items()}
    if cfg.fragments > 1 and step is None:
        raise ValueError("the outer step of a run with fragments needs its step number")
    names = outer.names if step is None else step_names(shapes, cfg.fragments, step)
    outer_step_from(outer, contributions, names, exact_keys=cfg.fragments > 1)
    return outer.to_bytes()


def outer_step_from(outer: OuterOptimizer, contributions: Sequence[bytes], names: list[str], *,
                    exact_keys: bool = False, keep: bool = False,
                    clock: list[float] | None = None) -> list[dict[str, torch.Tensor]] | None:
    """Step `outer` over `names` (sorted) with the mean in replica order (`mean_in_order`) of
    the decoded `contributions`, a batch of tensors at a time (`stream_batches`: decode
    every replica's batch, average, step): the working memory of a batch, not of R decoded
    stages, and the same bits as decoding everything first, since each tensor's mean and
    step involve that tensor alone. `keep`: also return every replica's decoded tensors
    (the eager rule's stale contributions). `clock`: [seconds], to which the decoding's time
    is added. Training (`DiLoCo`) and a verifier (`apply_outer_step`) both step through here."""
    began = time.perf_counter()
    shapes = {n: outer.params[n].shape for n in names}
    readers = [ContributionReader(data, shapes, exact_keys=exact_keys) for data in contributions]
    kept: list[dict[str, torch.Tensor]] | None = [{} for _ in readers] if keep else None
    for batch in stream_batches(names, shapes):
        decoded = [r.decode(batch) for r in readers]
        if clock is not None:
            clock[0] += time.perf_counter() - began
        mean = mean_in_order([[d[n] for n in batch] for d in decoded])
        outer.step(dict(zip(batch, mean, strict=True)))
        if kept is not None:
            for k, d in zip(kept, decoded, strict=True):
                k.update(d)
        began = time.perf_counter()
    return kept


def eager_start(
    outer: OuterOptimizer, stale: list[dict[str, torch.Tensor]] | None, own: dict[str, torch.Tensor],
    replica: int, replicas: int,
) -> dict[str, torch.Tensor]:
    """The eager rule's start weights of round t+1 for the replica at position `replica` of
    the `replicas` present (Kale et al. 2025): one outer step from the committed state
    `outer` (after step t-1) with the mean over the present replicas in replica order of
    the decoded contributions, this replica's fresh one (`own`, round t) in place of its
    stale share, the others' stale ones (`stale`, round t-1; None when round t was the
    first this run, or this membership epoch, computed: they count as zero). A lookahead:
    `outer` itself does not move."""
    names = outer.names
    zero = {n: torch.zeros_like(own[n]) for n in names} if stale is None else None
    shares = [own if j == replica else (stale[j] if stale is not None else zero) for j in range(replicas)]
    mean = mean_in_order([[d[n] for n in names] for d in shares])  # type: ignore[index]
    return outer.lookahead(dict(zip(names, mean, strict=True)))


@torch.no_grad()
def merge_weights(
    local: Mapping[str, torch.Tensor], outer: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor],
    alpha: float | None,
    names: Iterable[str] | None = None,
    arithmetic: str = "float64",
) -> None:
    """The partial rule's merge, in place on `local` (its tensors may live on any device; the
    arithmetic runs in float32 on the CPU, so a replay anywhere gets the same bits), over
    `names` (the exchanged fragment; None: every tensor):
    alpha None: local <- outer + (local - anchor), the new outer weights plus the progress
    made since the send (`anchor`: the weights the round's pseudo-gradient was sent from);
    alpha a number: local <- alpha * local + (1 - alpha) * outer (Streaming DiLoCo's mix).
    `arithmetic`: the run's `OuterConfig.arithmetic` (how the mix computes)."""
    for n in (local if names is None else names):
        p = local[n]
        here = p.detach().to("cpu", torch.float32)
        if alpha is None:  # correctly rounded float32 operations: the same bits everywhere
            merged = outer[n] + (here - anchor[n])
        elif arithmetic == "float32":  # runs before 2026-12-04 (a fused multiply-add where the kernels fuse)
            merged = here.mul(alpha).add(outer[n], alpha=1.0 - alpha)
        else:  # float64, rounded once: the same bits on any IEEE-754 machine
            merged = (here.double() * alpha + outer[n].double() * (1.0 - alpha)).float()
        p.copy_(merged)


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
        cfg: the outer optimizer (lr = eta, momentum = mu, Nesterov), `delay` and the overlap
            rule (`cfg.rule`: sync, partial, eager or restart).
        transport: the stage's cross-replica exchange (counts and shapes every byte).
        compressor: this replica-stage's compressor (error feedback state lives there).

    In every rule the committed outer state is the same function of the published data:
    outer step t = the ordered mean of round t's decoded contributions applied to the
    state after step t-1 (`apply_outer_step`). The rules differ only in when a replica
    waits for the exchange and where its local weights go next. Symbols: theta_t the outer
    weights after step t, L_t replica r's local weights at the end of round t, delta_t^r
    its pseudo-gradient of round t (reference - L_t), D(.) a decoded contribution.

    sync (delay 0; DiLoCo, Douillard et al. 2023): at the end of round t compress delta_t =
      theta_{t-1} - L_t, all-gather, step, restart round t+1 from theta_t.

    restart (delay 1, a whole round of delay; the DiLoCoX paper's one-step delay): at the
      end of round t compress delta_t, wait for round t-1's exchange, step to theta_{t-1},
      restart round t+1 from theta_{t-1} and exchange delta_t during all of round t+1. Its
      pseudo-gradient is one step stale when applied; it needs a damped outer loop.

    eager (delay 1; Kale et al. 2025, "Eager Updates For Overlapped Communication and
      Computation in DiLoCo", arXiv 2502.12996): as restart, but round t+1 starts from a
      lookahead outer step from theta_{t-1} with the mean of this replica's fresh D(delta_t)
      and the others' stale D(delta_{t-1}) (`eager_start`); the pseudo-gradient of round
      t+1 is measured from that start.

    partial (delay 1; Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512, with tau
      overlapped inner steps): at the end of round t compress delta_t = theta_{t-1} - L_t
      and start its exchange, but keep training from L_t. Before inner step tau of round
      t+1 (`merge_step`; tau = H: after the last), wait for the exchange, step to theta_t
      and merge (`merge_weights`): local <- theta_t + (local - L_t), so round t+1's
      pseudo-gradient delta_{t+1} = theta_t - L_{t+1} counts all H of its inner steps and
      only the first tau of them ran from stale weights; or with `alpha`, Streaming
      DiLoCo's mix local <- alpha * local + (1 - alpha) * theta_t. tau = 0 is synchronous
      DiLoCo bit for bit (the merge adds local - L_t = 0).
      With `cfg.fragments` = F > 1 (Streaming DiLoCo's fragments): the stage's parameters
      are F groups (`fragment_groups`) and round t exchanges only group f = (t - 1) mod F:
      delta_t = theta[f] - L_t[f], measured since the group's own previous merge F rounds
      earlier; outer step t moves theta[f] and its momentum only; the merge touches L[f]
      only. Each group syncs every F rounds, staggered, and each exchange is 1/F of the
      stage, so a short overlap hides it where a whole-stage exchange would not.

    Round 1 (and the first round after a resume) has no exchange in flight: it applies
    nothing. `flush()` after the last round applies the last exchange and leaves the local
    weights at the outer ones, in every rule. Round t's contribution is applied, and
    published, at outer step t either way.

    On failure of any replica the collective inside the transport raises (gloo reports the
    closed peer). Without elastic training the round is lost and the job resumes from the
    last committed shard; with it (trainer/engine.py) the rank drops the exchange in flight
    (`drop_pending`) and a new DiLoCo continues over the replicas that remain, from the
    last committed shard. The transport is over the present replicas: `transport.R` is
    their count and `transport.replica` this replica's position among them.
    """

    def __init__(
        self, module: nn.Module, cfg: AnyOuter, transport: Transport, compressor: Compressor,
        publish: DeltaHook = unchanged,
    ):
        """`publish`: the pseudo-gradient this rank publishes and sends, from the one it
        measured (injected: only a test's cheating rank changes it, tests/dlx_testing/cheat.py)."""
        self.module = module
        self.cfg = cfg
        self.rule = cfg.rule
        self.transport = transport
        self.compressor = compressor
        self.local = dict(module.named_parameters())
        self.outer = OuterOptimizer(self.local, cfg)
        self.shapes = {n: p.shape for n, p in self.outer.params.items()}
        self.groups = fragment_groups(self.shapes, cfg.fragments) if cfg.fragments > 1 else None
        self._pending: tuple[Pending, int, bytes, Any] | None = None
        self._reference: dict[str, torch.Tensor] | None = None  # eager: the round's start weights
        self.merge_step: int | None = None  # partial: the inner step of this round to merge before
        self.decode_s = 0.0  # time spent decoding received contributions
        self.exchange_s = 0.0  # how long the latest completed exchange took, start to finish
        self.publish = publish

    @property
    def pending(self) -> bool:
        """Whether an exchange is in flight (not yet applied)."""
        return self._pending is not None

    @property
    def pending_payload(self) -> bytes:
        """This replica's payload in the exchange in flight (b"" when none is)."""
        return b"" if self._pending is None else self._pending[2]

    def drop_pending(self) -> None:
        """Forget the exchange in flight (its world broke): it is never applied. Its daemon
        thread may stay blocked in the dead world's collective until the timeout; nothing
        waits for it."""
        self._pending = None

    def extra_memory_bytes(self) -> int:
        """Bytes DiLoCo holds beyond the model: outer weights, momentum, compressor state
        (and the eager rule's start weights)."""
        outer = sum(4 * p.numel() for p in self.outer.params.values())
        return (3 if self.rule == "eager" else 2) * outer + self.compressor.state_bytes()

    def reference(self) -> dict[str, torch.Tensor]:
        """What the pseudo-gradient delta = reference - theta_local is measured from:
        theta_outer, or under the eager rule the round's start weights."""
        return self.outer.params if self._reference is None else self._reference

    @torch.no_grad()
    def end_round(
        self,
        round_t: int,
        tag: Any = None,
        loss: float | None = None,
        budget_bytes: float | None = None,
    ) -> AppliedStep | None:
        """The round-end protocol; returns the outer step it applied, if any (sync: round
        t's; restart and eager: round t-1's, so round 1 returns None; partial: None, its
        steps are applied by `merge` during the next round)."""
        payload = contribution(self.compressor, self.reference(), self.local, round_t, loss,
                               budget_bytes, self.publish, self.fragment(round_t))
        if self.rule == "sync":
            self._step(self.transport.all_gather(payload), round_t)
            self.reset_local()
            return AppliedStep(round_t, payload, tag)
        if self.rule == "partial":
            assert self._pending is None, "partial: the previous exchange was not merged"
            self._pending = (self.transport.start_all_gather(payload), round_t, payload, tag)
            return None
        applied, stale = self._wait_and_step()
        if self.rule == "restart":
            self.reset_local()
        else:  # eager
            own = decode_contribution(payload, self.shapes)
            start = eager_start(self.outer, stale, own, self.transport.replica, self.transport.R)
            for n in self.outer.names:
                self.local[n].copy_(start[n])
            self._reference = start
        self._pending = (self.transport.start_all_gather(payload), round_t, payload, tag)
        return applied

    @torch.no_grad()
    def merge(self, anchor: Mapping[str, torch.Tensor]) -> AppliedStep:
        """partial: wait for the exchange in flight, step the outer optimizer and merge the
        local weights (`merge_weights`; `anchor` = the weights the exchanged pseudo-gradient
        was measured from, this round's start weights)."""
        applied, _ = self._wait_and_step()
        assert applied is not None, "merge: no exchange in flight"
        merge_weights(self.local, self.outer.params, anchor, self.cfg.alpha, self.fragment(applied.round),
                      self.cfg.arithmetic)
        self.merge_step = None
        return applied

    @torch.no_grad()
    def flush(self) -> AppliedStep | None:
        """Wait for the exchange in flight (if any), apply it and leave the local weights at
        the outer ones."""
        applied, _ = self._wait_and_step()
        if applied is not None:
            self.reset_local()
            self._reference = None
            self.merge_step = None
        return applied

    def _wait_and_step(self) -> tuple[AppliedStep | None, list[dict[str, torch.Tensor]] | None]:
        """Apply the exchange in flight, if any: (the step applied, the decoded contributions)."""
        if self._pending is None:
            return None, None
        pending, round_t, payload, tag = self._pending
        self._pending = None
        start = time.perf_counter()
        blobs = pending.wait()
        self.transport.wait_s += time.perf_counter() - start
        self.exchange_s = pending.seconds
        decoded = self._step(blobs, round_t)
        return AppliedStep(round_t, payload, tag), decoded

    def fragment(self, round_t: int) -> list[str] | None:
        """The parameter names round `round_t` exchanges (None: all of them)."""
        return None if self.groups is None else fragment_of(round_t, self.groups)

    def _step(self, blobs: list[bytes], round_t: int) -> list[dict[str, torch.Tensor]] | None:
        """Outer step `round_t` from the R blobs (`outer_step_from`); the decoded
        contributions under the eager rule (its next start needs them), else None."""
        clock = [0.0]
        names = self.fragment(round_t) or self.outer.names
        decoded = outer_step_from(self.outer, blobs, names, exact_keys=self.groups is not None,
                                  keep=self.rule == "eager", clock=clock)
        self.decode_s += clock[0]
        return decoded

    def reset_local(self) -> None:
        """Local weights := the outer ones (a round's restart; after a resume or a regroup)."""
        for n in self.outer.names:
            self.local[n].copy_(self.outer.params[n])

    @contextmanager
    def outer_weights(self) -> Iterator[None]:
        """Run the body (an evaluation, which must not write to the weights) with theta_outer
        in the module, then put the local weights back: under eager and partial they differ
        when a step is published. On the CPU the module's parameters borrow the outer tensors
        for the while (no copy of the weights); elsewhere the local weights are saved and
        the outer ones copied in."""
        if self.rule in ("sync", "restart"):
            yield
            return
        if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in self.local.values()):
            held = {n: p.data for n, p in self.local.items()}
            try:
                for n, p in self.local.items():
                    p.data = self.outer.params[n]
                yield
            finally:
                for n, p in self.local.items():
                    p.data = held[n]
            return
        with torch.no_grad():
            saved = {n: p.detach().clone() for n, p in self.local.items()}
            self.reset_local()
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.local.items():
                    p.copy_(saved[n])
