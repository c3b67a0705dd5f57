"""The rank function: one process = one pipeline stage of one DiLoCo replica.

World = R replicas x S stages, rank = r*S + s (an elastic run's world holds the replicas
present, placed by position: below). Each replica's S ranks run a
torch.distributed.pipelining schedule (1F1B or GPipe) over M microbatches; stage s of
every replica forms the data-parallel group that exchanges stage s's (compressed)
pseudo-gradients at each outer step through a `Transport`, synchronously or overlapped
with computation (`outer.delay`, `outer.overlap`: trainer/diloco.py).
`parallel.sync = "allreduce"` runs the AllReduce-DDP baseline instead: the same model,
pipeline, data order and inner optimizer, with gradients all-reduced through the same
Transport every inner step. Only global rank 0 reports, through `emit(kind, payload)`:
("genesis", GenesisArtifacts), then per outer step one ("progress", Progress) per inner
step and one ("step", StepArtifacts); with `RankControl.emit_contributions` every rank
also emits its own ("contribution", (step, Contribution)) and, at each membership
epoch's start, ("epoch", {"epoch", "rank", "members"}).

A rank's run is a `RoundLoop` whose methods are its phases (begin, open_round,
inner_steps, end_round, report). Test-only misbehaviour is injected through
`RankControl.hooks` (`trainer.hooks.RankHooks`, honest by default; tests/dlx_testing/cheat.py).

Run it through `trainer.launch.train_local`, or from any launcher that starts R*S
processes sharing an `init_method` (the Celery workers do, under `trainer.supervisor`).

For replay verification every DiLoCo rank serialises its round-start state once per round
(`round_state`: local weights, which are theta_outer at that moment, the inner AdamW state
and the compressor state) and publishes it with its contribution; `inner_round` is the
one inner loop and `trainer.diloco.contribution` the one payload function that training
and `rerun_round` (replays, exact resumes) both run, so a replay from that state is
bit-identical on the same machine.

Elastic training (`[parallel] min_replicas`, a launcher's `RankControl.regroup`). A run
has R replica slots; a membership epoch is a world of the replicas present, `members`
(ids, ascending, at least min_replicas), x S stages, global rank = position * S + stage
(`Topology`). A replica's id, never its position, fixes its data shards, its seeds
(dropout, compressor), its `Contribution.replica` and its ledger slot; the position only
places it in the world (process groups, the Transport, progress and eval on the first
member). An outer step averages the present replicas' contributions in replica order
(`StepArtifacts.replicas`); with all R present every byte is as without elastic training.
- A loss: when a collective raises or times out because a peer died (`world_failure`:
  gloo's closed connection or timeout, a torch.distributed error), the rank drops the
  exchange in flight (its daemon thread may stay blocked on the dead world; nothing waits
  for it), releases and destroys its process groups and calls `control.regroup(epoch,
  reason)`, which blocks until the next epoch's `Membership` or raises (fewer than
  min_replicas remain, the job ended, Cancelled). Any other error (a bug, a divergence,
  a bad input, Cancelled) fails the rank as before; so does every error without `regroup`.
- Growth: with `regroup` set, after each round's reports rank 0 asks
  `control.grow_requested` and every rank learns the answer in one broadcast; on yes they
  apply and report the exchange in flight and regroup with reason "grow", a boundary
  where nothing is lost. A joiner's launcher starts it with the new epoch's
  `control.members` and `epoch` and `control.start` = the committed shard.
- Continuing in epoch m: join m's world, rebuild the process groups, pipeline, Transport
  and DiLoCo over the present replicas; outer state := m.shard (the committed shard after
  m.start_step), local weights := the outer ones, nothing in flight; inner optimizer and
  compressor restored from this rank's own start state of round start_step + 1 (a rank
  keeps its last KEEP_STATES round-start states in memory; between rounds its live state
  is the next round's), else fresh (a joiner, a rank that never ran that round); rounds go
  on from start_step + 1. That round's published start state therefore holds the
  committed shard's weights (under the partial rule merge_step -1), as any run's first
  round does, and a joiner's the fresh state core (`trainer.replay.fresh_state_core`).
- What a loss costs: the round in flight, never a committed step; under delay 1 also the
  exchange of the previous round that overlapped it when its step was not yet committed
  (restart and eager apply step t at the end of round t + 1, partial before inner step
  tau of round t + 1), whose round is then computed again. A departed replica's
  error-feedback state leaves with it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.artifacts import (
    KERNELS_KEY,
    MERGE_STEP_KEY,
    Blob,
    Contribution,
    GenesisArtifacts,
    Progress,
    Spill,
    StageShard,
    StepArtifacts,
    StoredTensors,
    tensor_views,
    tensors_to_bytes,
    to_bytes,
)
from trainer.compress import Compressor
from trainer.config import JobConfig
from trainer.control import RANK_COUNTERS, Membership, RankControl, ResumePoint
from trainer.data import derive_seed, load_corpus
from trainer.diloco import (
    AppliedStep,
    DiLoCo,
    OuterOptimizer,
    contribution,
    fragment_groups,
    fragment_of,
    merge_weights,
)
from trainer.errors import Cancelled, DlxError, TrainingError
from trainer.hooks import RankHooks
from trainer.kernels import kernel_fingerprint
from trainer.model import build_stage
from trainer.supervisor import Emitter, error_line, peer_loss
from trainer.transport import Transport, all_gather_bytes_sent

__all__ = [
    "Cancelled",
    "Emit",
    "Membership",
    "RankControl",
    "RankHooks",
    "ResumePoint",
    "Round",
    "RoundLoop",
    "StageRank",
    "Topology",
    "check_members",
    "inner_round",
    "load_round_state",
    "merge_step_of",
    "rerun_round",
    "round_state",
    "round_tensors",
    "run_rank",
    "world_failure",
]

Emit = Callable[[str, Any], None]


TAU_MARGIN = 1.25  # tau = auto: the exchange estimate is padded by this factor
TAU_AUTO_MAX_FRACTION = 0.25  # tau = auto overlaps at most this share of a round
LONE_STAGE_SHORTCUT = True  # S = 1 runs the model directly (Pipeline._lone_stage_step)
PROGRESS_EVERY = 5  # S > 1: inner steps whose losses reach rank 0 in one broadcast
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
KEEP_STATES = 3  # elastic runs: round-start states a rank keeps, for a regroup to restore


class Topology:
    """Who is who in a world of the present replicas `members` (replica ids, ascending; all
    R by default) x S stages, and the process groups every rank must create. Global rank =
    position * S + stage, where position = members.index(replica): a replica's id fixes its
    data, seeds and ledger slot; its position only where it sits in this world."""

    def __init__(self, rank: int, replicas: int, stages: int, members: tuple[int, ...] | None = None):
        self.rank, self.R, self.S = rank, replicas, stages
        self.members = tuple(range(replicas)) if members is None else tuple(members)
        self.n = len(self.members)  # replicas present
        self.position, self.stage = divmod(rank, stages)
        self.replica = self.members[self.position]
        self.is_first = self.stage == 0
        self.is_last = self.stage == stages - 1
        self.lead = self.position == 0  # the first member: progress, eval and the shards

    @property
    def full(self) -> bool:
        """Whether every one of the R replicas is present."""
        return self.members == tuple(range(self.R))

    def global_rank(self, position: int, stage: int) -> int:
        return position * self.S + stage

    def create_groups(self, pipe_backend: str | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """(pipeline group of my replica, data-parallel group of my stage). The pipeline
        group may take another backend (CUDA ranks: NCCL for activations, gloo for CPU
        scalars); the data-parallel group is always gloo: the Transport's slow link.

        Deadlock hazard: new_group is collective over the whole world, so every rank
        creates every group, in the same order, even the ones it is not in.
        """
        pipe = dp = None
        for p in range(self.n):
            g = dist.new_group([self.global_rank(p, s) for s in range(self.S)], backend=pipe_backend)
            if p == self.position:
                pipe = g
        for s in range(self.S):
            g = dist.new_group([self.global_rank(p, s) for p in range(self.n)])
            if s == self.stage:
                dp = g
        assert pipe is not None and dp is not None
        return pipe, dp


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # (B*T, V) vs (B*T,)


def loss_fn(job: JobConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The job's language-model loss: `lm_loss`, or under `parallel.numerics = "portable"`
    its portable twin (trainer/portable.py: the same mean cross-entropy, exact reductions)."""
    if job.parallel.numerics == "portable":
        from trainer import portable

        return portable.lm_loss
    return lm_loss


def mean_loss(losses: list[torch.Tensor], job: JobConfig) -> float:
    """The mean of a step's microbatch losses: torch's mean, or under portable numerics the
    correctly rounded mean of their values (math.fsum: the same bits on every machine)."""
    if job.parallel.numerics == "portable":
        return math.fsum(loss.item() for loss in losses) / len(losses)
    return torch.stack([loss.detach() for loss in losses]).mean().item()


def warmup_lr(base: float, warmup: int, step: int) -> float:
    """Linear warmup over `warmup` inner steps (0-based `step`), then constant."""
    return base * min(1.0, (step + 1) / warmup) if warmup > 0 else base


def build_inner_optimizer(module: nn.Module, job: JobConfig) -> torch.optim.Optimizer:
    """AdamW (or plain SGD) with weight decay on matrices only (not norms, biases)."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": job.inner.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if job.parallel.numerics == "portable":  # the same updates in float64, rounded once
        from trainer import portable

        if job.inner.optimizer == "sgd":
            return portable.SGD(groups, lr=job.inner.lr)
        return portable.AdamW(groups, lr=job.inner.lr, betas=job.inner.betas)
    if job.inner.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=job.inner.lr, foreach=False)
    return torch.optim.AdamW(groups, lr=job.inner.lr, betas=job.inner.betas)


@torch.no_grad()
def clip_pipeline_grad_norm(
    params: list[nn.Parameter], max_norm: float, group: dist.ProcessGroup | None, stages: int,
    portable: bool = False,
) -> float:
    """Clip by the global grad norm over the whole pipeline (all stages' params).

    Each stage knows only its own params, so the squared norms are summed over the
    pipeline group first: one scalar all-reduce per inner step. `portable`: each stage's
    sum of squares exact (`trainer.portable.grad_sq_norm`), gathered and summed in stage
    order, so the norm has the same bits on every machine.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if portable:
        total = math.sqrt(_stage_sum(_portable_sq(grads), group, stages))
    else:
        sq = torch.zeros(1, dtype=torch.float64, device=params[0].device if params else None)
        for g in grads:
            sq += g.double().pow(2).sum()
        if stages > 1:
            dist.all_reduce(sq, group=group)
        total = math.sqrt(sq.item())
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def _portable_sq(grads: list[torch.Tensor]) -> float:
    from trainer import portable

    return float(portable.grad_sq_norm(grads)) if grads else 0.0


def _stage_sum(value: float, group: dist.ProcessGroup | None, stages: int) -> float:
    """The stages' values summed in stage order (math.fsum: correctly rounded)."""
    if stages == 1:
        return value
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(stages)]
    dist.all_gather(out, torch.tensor([value], dtype=torch.float64), group=group)
    return math.fsum(float(t.item()) for t in out)


def autocast(job: JobConfig, device: torch.device) -> Any:
    """The inner steps' precision: bfloat16 autocast (matmuls in bf16, reductions, norms and
    the loss in float32), or a no-op for float32. Parameters stay float32 either way."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.model.dtype == "bfloat16")


class Pipeline:
    """This rank's pipeline stage plus a schedule for training and p2p for evaluation."""

    def __init__(self, module: nn.Module, topo: Topology, group: dist.ProcessGroup, job: JobConfig,
                 device: torch.device | None = None):
        self.module, self.topo, self.group, self.job = module, topo, group, job
        self.loss = loss_fn(job)
        self.device = device or torch.device("cpu")
        self.schedule: Any = None
        if topo.S > 1 or not LONE_STAGE_SHORTCUT:  # one stage has nothing to pipeline
            # Imported here, not with the module: it costs about 1.4 s per rank process (it
            # imports torch.export and fx), and a one-stage rank never needs it.
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(module, topo.stage, topo.S, self.device, group=group)
            schedule_cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[job.parallel.schedule]
            self.schedule = schedule_cls(
                stage, n_microbatches=job.parallel.microbatches, loss_fn=self.loss
            )

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        """One forward/backward over the batch; the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        x, y = x.to(self.device), y.to(self.device)
        if self.schedule is None:
            return self._lone_stage_step(x, y)
        with autocast(self.job, self.device):
            if self.topo.is_first and self.topo.is_last:
                self.schedule.step(x, target=y, losses=losses, return_outputs=False)
            elif self.topo.is_first:
                self.schedule.step(x, return_outputs=False)
            elif self.topo.is_last:
                self.schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        if self.topo.is_last:
            return mean_loss(losses, self.job)
        return None

    def _lone_stage_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """S = 1: what either schedule does for a lone stage, bit for bit, without its
        machinery (tests/test_llama_train.py holds the two equal): each microbatch's mean
        loss backward in turn, the gradients accumulating, then divided by M once."""
        M = self.job.parallel.microbatches
        losses = []
        with autocast(self.job, self.device):
            for xm, ym in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
                loss = self.loss(self.module(xm), ym)
                loss.backward()
                losses.append(loss.detach())
        if M > 1:  # as PipelineStage.scale_grads
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.div_(M)
        return mean_loss(losses, self.job)

    @torch.no_grad()
    def eval_loss(self, batches: torch.Tensor) -> float | None:
        """Forward only over (n, B, T+1) held-out batches with plain send/recv between
        stages (switching the training schedule to eval mode and back would redo its
        shape inference every round). Mean loss on the last stage, else None."""
        topo, cfg = self.topo, self.job.model
        was_training = self.module.training
        self.module.eval()
        total = 0.0
        for batch in batches:
            batch = batch.to(self.device)
            x, y = batch[:, :-1], batch[:, 1:]  # (B, T) each
            with autocast(self.job, self.device):
                if topo.is_first:
                    h = self.module(x)
                else:
                    h = torch.empty(x.size(0), x.size(1), cfg.d_model, device=self.device)  # (B, T, C)
                    dist.recv(h, src=topo.global_rank(topo.position, topo.stage - 1), group=self.group)
                    h = self.module(h)
            if topo.is_last:
                total += self.loss(h.float(), y).item()
            else:
                dist.send(
                    h.contiguous(),
                    dst=topo.global_rank(topo.position, topo.stage + 1),
                    group=self.group,
                )
        self.module.train(was_training)
        return total / len(batches) if topo.is_last else None


def _broadcast_scalar(value: float | None, src: int, group: dist.ProcessGroup | None) -> float:
    t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64)
    dist.broadcast(t, src=src, group=group)
    return t.item()


@dataclass
class StageRank:
    """One rank's stage and what trains it: the pieces a round runs on, in training, in an
    exact resume and in a replay (`inner_round`, `rerun_round`)."""

    job: JobConfig
    pipeline: Pipeline
    inner: torch.optim.Optimizer
    compressor: Compressor
    corpus: Any
    params: list[nn.Parameter] = field(init=False)

    def __post_init__(self) -> None:
        self.params = [p for p in self.module.parameters() if p.requires_grad]

    @property
    def module(self) -> nn.Module:
        return self.pipeline.module


def inner_round(
    rank: StageRank,
    replica: int,
    round_t: int,
    tokens: torch.Tensor,
    first_step: int,
    *,
    before_step: Callable[[int], None] | None = None,
    sync_grads: Callable[[list[torch.Tensor]], None] | None = None,
    after_step: Callable[[int, float | None], None] | None = None,
) -> float:
    """Replica `replica`'s inner steps of round `round_t` on this rank's stage, from the
    module's and the inner optimizer's current state: one step per row of `tokens`
    (H, B, T + 1), warmup counted from inner step `first_step` of the run. Returns the
    round's mean loss on every stage of the pipeline (a broadcast from the last stage).

    Training and replay both run exactly this, so the same start state gives the same bits.
    Hooks: `before_step(h)` (cancellation, merges), `sync_grads(grads)` (the AllReduce
    baseline), `after_step(h, loss)` (progress; loss is None off the last stage).
    """
    pipeline, inner, params, job = rank.pipeline, rank.inner, rank.params, rank.job
    topo = pipeline.topo
    torch.manual_seed(derive_seed("round", job.seed, replica, round_t))  # dropout, if any
    H = tokens.size(0)
    losses: list[float] = []
    for h in range(H):
        inner.zero_grad(set_to_none=True)  # before the hook: a merge runs without the old grads
        if before_step is not None:
            before_step(h)
        lr = warmup_lr(job.inner.lr, job.inner.warmup, first_step + h)
        for g in inner.param_groups:
            g["lr"] = lr
        x, y = tokens[h, :, :-1], tokens[h, :, 1:]  # (B, T) each
        loss = pipeline.train_step(x, y)
        if sync_grads is not None:
            sync_grads([p.grad for p in params if p.grad is not None])
        clip_pipeline_grad_norm(params, job.inner.clip, pipeline.group, topo.S,
                                job.parallel.numerics == "portable")
        inner.step()
        if loss is not None:
            losses.append(loss)
        if after_step is not None:
            after_step(h, loss)
    inner.zero_grad(set_to_none=True)  # the round end and the report need no gradients
    # The round's loss lives on the last stage; every stage's Contribution carries it.
    round_loss = sum(losses) / H if topo.is_last else None
    if topo.S > 1:
        round_loss = _broadcast_scalar(round_loss, topo.global_rank(topo.position, topo.S - 1), pipeline.group)
    assert round_loss is not None
    return round_loss


def round_state(
    module: nn.Module,
    inner: torch.optim.Optimizer,
    compressor: Compressor,
    round_t: int,
    first_step: int,
    *,
    weights: bool = True,
    merge_step: int | None = None,
) -> bytes:
    """`round_tensors` as safetensors bytes (`tensors_to_bytes`)."""
    return tensors_to_bytes(round_tensors(module, inner, compressor, round_t, first_step, weights=weights,
                                          merge_step=merge_step))


def round_tensors(
    module: nn.Module,
    inner: torch.optim.Optimizer,
    compressor: Compressor,
    round_t: int,
    first_step: int,
    *,
    weights: bool = True,
    merge_step: int | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's state at the start of round `round_t`, as safetensors (sorted keys, so
    the same state gives the same bytes): ``param/<name>`` the local weights (theta_outer
    at round start, also the pseudo-gradient's reference), ``inner/<key>/<name>`` the inner
    optimizer's per-parameter state (absent before its first step), ``compress/...`` the
    compressor's state, ``round/outer_step`` and ``round/inner_step`` (the warmup counter).
    `weights=False` leaves the weights out (the state a round leaves for the next one).
    `merge_step` (the partial overlap rule only): ``round/merge_step``, the inner step
    before which the round merges the previous round's exchange (-1: none in flight).
    ``round/kernels``: the kernel fingerprint of the process (`trainer.kernels`), UTF-8
    bytes, which a verifier prints beside its own. The tensors are the live ones (views, no
    copies): serialise them before anything trains on."""
    tensors: dict[str, torch.Tensor] = {
        "round/outer_step": torch.tensor([round_t], dtype=torch.int64),
        "round/inner_step": torch.tensor([first_step], dtype=torch.int64),
        KERNELS_KEY: torch.frombuffer(bytearray(kernel_fingerprint().encode()), dtype=torch.uint8),
    }
    if merge_step is not None:
        tensors[MERGE_STEP_KEY] = torch.tensor([merge_step], dtype=torch.int64)
    named = dict(module.named_parameters())
    by_param = {id(p): n for n, p in named.items()}
    for p, state in inner.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"inner/{key}/{by_param[id(p)]}"] = value.detach()
    if weights:
        tensors.update({f"param/{n}": p.detach() for n, p in named.items()})
    tensors.update(compressor.state_tensors())
    return tensors


@torch.no_grad()
def load_round_state(
    data: bytes, module: nn.Module, inner: torch.optim.Optimizer, compressor: Compressor
) -> tuple[int, int]:
    """Load a `round_state` into a module, a fresh inner optimizer and a fresh compressor
    (each copies what it keeps from views of `data`); returns (outer step, first inner
    step). ValueError if it does not fit them."""
    try:
        tensors = tensor_views(data)
    except Exception as exc:  # safetensors raises its own error type for bad bytes
        raise ValueError(f"start state is not safetensors: {exc}") from None
    named = dict(module.named_parameters())
    for n, p in named.items():
        w = tensors.get(f"param/{n}")
        if w is None or w.shape != p.shape or w.dtype != p.dtype:
            raise ValueError(f"start state: param/{n} is missing or has the wrong shape or type")
        p.copy_(w)
    extra = {k.removeprefix("param/") for k in tensors if k.startswith("param/")} - set(named)
    if extra:
        raise ValueError(f"start state: unknown parameter {sorted(extra)[0]}")
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("inner/"):
            key, _, name = k.removeprefix("inner/").partition("/")
            if name not in named:
                raise ValueError(f"start state: {k} names no parameter of this stage")
            # AdamW keeps its step counter on the CPU whatever the parameter's device.
            where = "cpu" if key == "step" else named[name].device
            per_param.setdefault(name, {})[key] = v.to(where, copy=True)
    for name, state in per_param.items():
        inner.state[named[name]] = state
    compressor.load_state_tensors(tensors)
    try:
        return int(tensors["round/outer_step"][0]), int(tensors["round/inner_step"][0])
    except KeyError as exc:
        raise ValueError(f"start state: missing {exc.args[0]}") from None


def merge_step_of(state: bytes) -> int | None:
    """The inner step before which a partial-rule round merged (`round/merge_step`), or None
    (no merge, or another rule). ValueError for bytes that are not a round state."""
    try:
        tensors = tensor_views(state)
    except Exception as exc:  # safetensors raises its own error type for bad bytes
        raise ValueError(f"start state is not safetensors: {exc}") from None
    t = tensors.get(MERGE_STEP_KEY)
    step = None if t is None else int(t.reshape(-1)[0])
    return None if step is None or step < 0 else step


def run_rank(
    rank: int,
    world_size: int,
    init_method: str,
    job: JobConfig,
    emit: Emit,
    control: RankControl | None = None,
) -> None:
    """Train `job` as global rank `rank` of the world of `control.members` (all R replicas
    by default) x S stages; `emit` is called on rank 0 only (and on every rank for its own
    contributions and epochs when `control.emit_contributions`). Raises `Cancelled` on
    every rank when rank 0's `control.stop_requested()` says so."""
    control = control or RankControl()
    R, S = job.parallel.replicas, job.parallel.stages
    members = check_members(tuple(range(R)) if control.members is None else tuple(control.members), job,
                            control.epoch)
    if world_size != len(members) * S:
        raise ValueError(f"world_size ({world_size}) != replicas present x stages ({len(members)} x {S})")
    torch.set_num_threads(1)
    # cuBLAS needs a fixed workspace to be deterministic; it reads this before CUDA starts.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    topo = Topology(rank, R, S, members)
    init_world(init_method, rank, world_size, control.timeout_s)
    try:
        RoundLoop(topo, job, emit, control, agree_device(job, control.gpu)).run()
    finally:
        if dist.is_initialized():  # a failed regroup leaves none
            dist.destroy_process_group()


def init_world(init_method: str, rank: int, world_size: int, timeout_s: float | None) -> None:
    """Join a world over gloo (every membership epoch's, too) with the collective timeout:
    how soon a lost peer fails a collective."""
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s) if timeout_s else COLLECTIVE_TIMEOUT,
    )


def check_members(members: tuple[int, ...], job: JobConfig, epoch: int) -> tuple[int, ...]:
    """`members` if they are distinct replica ids of the job, ascending, at least
    `parallel.min_replicas` of them; TrainingError otherwise."""
    R, least = job.parallel.replicas, job.parallel.min_present
    if list(members) != sorted(set(members)) or not all(0 <= r < R for r in members):
        raise TrainingError(f"membership epoch {epoch}: replicas {list(members)} are not distinct ids "
                            f"in 0..{R - 1}, ascending")
    if len(members) < least:
        raise TrainingError(f"membership epoch {epoch}: {len(members)} replica(s) {list(members)} remain, "
                            f"fewer than parallel.min_replicas ({least}): the job stops (dlx resume "
                            "continues it from the last committed step)")
    return members


def world_failure(exc: BaseException) -> bool:
    """Whether `exc` says this rank's world broke (a peer died or stopped answering: a
    torch.distributed error, or gloo's RuntimeError naming a lost peer or a timeout) rather
    than a failure of its own (a bug, a divergence, a bad input, a stop)."""
    if isinstance(exc, Cancelled | DlxError):
        return False
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and peer_loss(str(exc))


def gpu_usable(gpu: int | None) -> bool:
    return gpu is not None and torch.cuda.is_available() and 0 <= gpu < torch.cuda.device_count()


def agree_device(job: JobConfig, gpu: int | None, *, strict: bool = True) -> torch.device:
    """Every rank's device, agreed over the world (a collective: every rank calls it):
    CUDA when the job allows it and every rank has a GPU of its own, else the CPU (one
    device kind per world: stages exchange activations of one kind). A job that asks for
    cuda where some rank has none fails on every rank, naming that rank (unless not
    `strict`: a replay elsewhere falls back to the CPU and its tolerance)."""
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, gpu_usable(gpu))
    want = job.parallel.device
    if want == "cuda" and strict and not all(seen):
        raise TrainingError(f"parallel.device = 'cuda' but rank {seen.index(False)} has no GPU of its own")
    if want != "cpu" and all(seen):
        assert gpu is not None
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu)
    return torch.device("cpu")


_LIBC: Any = None  # glibc, once loaded (False: not there, or it has no malloc_trim)


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`, every arena):
    called between a round's phases, so that what a phase freed (activations, gradients,
    serialised bytes, decoded tensors) stops counting in the rank's resident memory rather
    than lingering in the heap, where the next phase's differently sized buffers would not
    fit and would take fresh pages. A no-op where the C library has no such call."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _peak_rss_mb() -> float:
    """This rank's own peak resident memory. Not `ru_maxrss`: Linux carries the launching
    process's peak into a spawned child's (exec records the old address space's high-water
    mark), so a rank started by a 2 GB parent reported 2 GB. `VmHWM` is the peak of the
    rank's own address space."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rerun_round(rank: StageRank, replica: int, round_t: int, first_step: int, budget: float | None, *,
                outer: dict[str, torch.Tensor] | None = None,
                merge_step: int | None = None) -> tuple[bytes, float, bytes]:
    """Round `round_t` of `replica` once more, from the start state already loaded into
    `rank` (`load_round_state`): the same inner steps on the same data shard, then the
    round's `contribution` under `budget` (the one the published payload recorded, or
    None). Returns (payload, the round's loss, the data shard's digest); the state it
    leaves stays in `rank`. Replay verification and an exact resume both run it.

    The partial overlap rule: `outer` = the committed outer weights of step round_t - 1
    (the round's pseudo-gradient reference) and `merge_step` = the inner step before which
    the round merged them (`trainer.diloco.merge_weights`, anchored at the start weights;
    None: no merge, as in a run's first round). Otherwise the reference is the start
    weights."""
    job, module = rank.job, rank.module
    H, B, L = job.outer.inner_steps, job.data.batch_size, job.model.seq_len
    # The round's start weights, on the CPU as DiLoCo's outer copy is.
    start = {n: p.detach().to("cpu", copy=True) for n, p in module.named_parameters()}
    reference = start if outer is None else outer
    local = dict(module.named_parameters())
    groups = fragment_groups({n: p.shape for n, p in start.items()}, job.outer.fragments) \
        if job.outer.fragments > 1 else None

    def merge(h: int) -> None:
        if h == merge_step:
            assert outer is not None
            merge_weights(local, outer, start, job.outer.alpha,
                          None if groups is None else fragment_of(round_t - 1, groups), job.outer.arithmetic)

    data = rank.corpus.shard(job.seed, replica, round_t, H, B, L)
    loss = inner_round(rank, replica, round_t, data.tokens, first_step,
                       before_step=merge if merge_step is not None else None)
    if merge_step == H:
        merge(H)
    return contribution(rank.compressor, reference, local, round_t, loss, budget,
                        names=None if groups is None else fragment_of(round_t, groups)), loss, data.digest


def auto_tau(transport: Transport, payload_len: int, measured_s: float, step_s: float, H: int,
             fragments: int = 1) -> int:
    """tau = auto: enough inner steps to hide the exchange just started, from the link model
    of its ring all-gather and the latest measured exchange (padded by `TAU_MARGIN`), but
    at most a quarter of the period between two syncs of the same weights
    (`TAU_AUTO_MAX_FRACTION`: longer overlaps cost quality, docs/benchmarks.md, "DiLoCoX benchmark"; past
    that the round waits): a quarter of the round, or with F fragments (each synced every
    F rounds) a quarter of F rounds, at most the whole next round."""
    R = transport.R
    modelled = transport.link.seconds(all_gather_bytes_sent([payload_len] * R, 0), R - 1)
    estimate = max(modelled, measured_s) * TAU_MARGIN
    cap = max(1, min(H, int(fragments * H * TAU_AUTO_MAX_FRACTION)))
    return min(cap, max(1, math.ceil(estimate / max(step_s, 1e-9))))


@dataclass
class Round:
    """One round's bookkeeping: its number `t`, its first inner step of the run, the inner
    step before which it merges the previous round's exchange (the partial rule; None when
    nothing is in flight), its serialised start state (what a replay starts from: bytes,
    or a `Blob` where the rank spills), its data shard and, when it merges, its start
    weights (the merge's anchor: the ``param/`` tensors of the start state, read back from
    it one at a time rather than held as a copy)."""

    t: int
    first_step: int
    merge_at: int | None
    start_state: bytes | Blob
    data: Any
    anchor: StoredTensors | None = None


class _Regroup(Exception):
    """Raised on every rank of a world at once (a growth boundary): regroup for `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RoundLoop:
    """One rank's run as named phases: `__init__` builds the stage (model, pipeline, inner
    optimizer, compressor, DiLoCo); `begin` starts from the seed (genesis) or a committed
    checkpoint; each `round` opens (`open_round`: the start state), runs its inner steps
    (`inner_steps`, through `RankHooks.inner_phase`), ends (`end_round`: exchange, outer
    step, tau) and `report`s every outer step it applied; `run` ties them together and
    flushes the last exchange. Only global rank 0 emits; every rank takes part in every
    collective, in the same order (a deadlock hazard otherwise).

    Elastic (`control.regroup` set): `run` catches a broken world (`world_failure`) or a
    growth boundary (`grow_boundary`), tears the world down (`_leave`), asks the launcher
    for the next epoch and continues in it (`_enter`); the module's docstring has the rules."""

    def __init__(self, topo: Topology, job: JobConfig, emit: Emit, control: RankControl,
                 device: torch.device) -> None:
        self.topo, self.job, self.emit, self.control, self.hooks = topo, job, emit, control, control.hooks
        self.allreduce = job.parallel.sync == "allreduce"
        self.partial = not self.allreduce and job.outer.rule == "partial"
        self.device, self.epoch = device, control.epoch
        self.corpus = load_corpus(job.data, job.model.vocab_size)
        self.eval_batches = self.corpus.eval_batches(job.data.eval_batches, job.data.batch_size,
                                                     job.model.seq_len, seed=job.seed)
        self.module = self._build_module(device)
        self._wire(topo)
        self.first_round = 1
        self.stop_flag = torch.zeros(1, dtype=torch.int32)
        # compute_s: inner steps (comm waits excluded); rounds_wall_s: inner steps + round end;
        # compress_s: compression + decoding of every contribution.
        # report_s: publishing steps mid-round (partial rule), kept out of the other two;
        # merge_s: the partial rule's mid-round outer step and merge (wall, not compute).
        self.clock = {"compute_s": 0.0, "rounds_wall_s": 0.0, "compress_s": 0.0, "report_s": 0.0,
                      "merge_s": 0.0}
        self.compress_before = 0.0  # compress_s of the epochs before this one
        self.taus: list[int] = []  # the partial rule: the tau each round merged at
        self.lr = job.inner.lr  # the inner learning rate of the latest inner step
        self.unreported: list[float] = []  # replica 0: inner losses not yet reported
        self.started = self.since = time.perf_counter()  # rank 0: run start, last progress report
        self.paced = (self.started, 1)  # rank 0: (when, round) this epoch's rounds began, for the ETA
        self.tokens = 0  # cumulative tokens the present replicas trained, through the last step reported
        self.tokens_at: dict[int, int] = {}  # outer step -> tokens through it (elastic runs)
        # Elastic runs: round -> this rank's start state of it, the last KEEP_STATES rounds
        # opened (a regroup restores the inner optimizer and compressor from them), and the
        # last round opened and the last one whose end completed.
        self.kept: dict[int, bytes | Blob] = {}
        self.opened = self.completed = 0
        # Where this rank's large bytes go as they are made (None: held in memory); only
        # through a Supervisor's queue does a Blob reach the launcher as bytes.
        self.spill = Spill(control.spill_dir) if control.spill_dir and isinstance(emit, Emitter) else None
        self.counters = (0, 0.0, 0.0)  # the Transport's counters, carried into the next epoch

    def _build_module(self, device: torch.device) -> nn.Module:
        """This rank's stage, seeded (or the imported weights at genesis), on `device`."""
        job, topo = self.job, self.topo
        module = build_stage(job.model, topo.stage, topo.S, job.seed, job.parallel.numerics)
        if job.model.init is not None and self.control.start is None:  # genesis = the imported weights
            from trainer.hf import load_init_weights

            load_init_weights(module, job.model.init)
        return module.to(device)

    def _wire(self, topo: Topology) -> None:
        """What trains the module in the world of `topo`: its process groups, pipeline, a
        fresh inner optimizer and compressor (seeded by replica id), the Transport over the
        present replicas and DiLoCo (whose outer copy starts at the module's weights)."""
        job, module, device = self.job, self.module, self.device
        self.topo = topo
        self.pipe_group, dp_group = topo.create_groups("cpu:gloo,cuda:nccl" if device.type == "cuda" else None)
        pipeline = Pipeline(module, topo, self.pipe_group, job, device)
        inner = build_inner_optimizer(module, job)
        shapes = {n: p.shape for n, p in module.named_parameters()}
        seed = derive_seed("compress", job.seed, topo.replica, topo.stage)
        self.rank = StageRank(job, pipeline, inner, Compressor(job.outer.compression, shapes, seed), self.corpus)
        self.transport = Transport(dp_group, topo.n, topo.position, job.transport)
        self.tau_votes: list[tuple[Any, torch.Tensor]] = []  # tau = auto: agreements in flight
        self.diloco = DiLoCo(module, job.outer, self.transport, self.rank.compressor, self.hooks.publish(topo))

    def run(self) -> None:
        """Every round from the first this run computes to `outer.steps`, then the last
        exchange in flight; elastic: in as many membership epochs as it takes."""
        enter: Callable[[], None] = self.begin
        while True:
            try:
                enter()
                if enter == self.begin:
                    self.started = self.since = time.perf_counter()
                self._rounds()
                return
            except Exception as exc:  # a broken world regroups; anything else fails the rank
                reason = self._regroup_reason(exc)
                if reason is None:
                    raise
            # Out of the except block: the traceback's frames no longer hold the old world.
            enter = functools.partial(self._enter, self._regroup(reason))

    def _rounds(self) -> None:
        """This epoch's rounds, then the last exchange in flight."""
        T = self.job.outer.steps
        self.paced = (time.perf_counter(), self.first_round)
        for t in range(self.first_round, T + 1):
            self.round(t)
            if t < T:
                self.grow_boundary()
        self._settle_votes()
        applied = self.diloco.flush()
        if applied is not None:
            self.report(applied)

    def begin(self) -> None:
        """Start from `control.start` (resume: the committed outer state, re-running its
        round where that is exact; a joiner: the committed outer state, fresh inner state)
        or from the seed (rank 0 emits the genesis shards)."""
        start = self.control.start
        self._announce()
        step = 0 if start is None else start.step
        self.tokens = self._tokens_through(step) if self.epoch else self._full_tokens(step)
        self.opened = self.completed = step
        if start is None:
            shards = self._gather(StageShard(self.topo.stage, cast(bytes, self._held(self.diloco.outer.tensors())))
                                  if self.topo.lead else None)
            if self.topo.rank == 0:
                assert shards is not None
                self.emit("genesis", GenesisArtifacts(stages=[shards[s] for s in range(self.topo.S)]))
            return
        if start.state and self.job.outer.delay == 0 and not self.allreduce:
            self._catch_up(start)
        self.diloco.outer = OuterOptimizer.from_bytes(start.shard, self.job.outer)
        with torch.no_grad():
            self.diloco.reset_local()
        self.first_round = start.step + 1
        self._carry(start.counters)

    def _carry(self, counters: dict[str, float]) -> None:
        """A resumed rank counts on from the head's cumulative counters (`ResumePoint.counters`)."""
        t = self.transport
        t.bytes_sent = int(counters.get("bytes_sent", t.bytes_sent))
        t.modelled_s = float(counters.get("modelled_comm_s", t.modelled_s))
        self.tokens = int(counters.get("tokens", self.tokens))

    # -- elastic training: membership epochs ----------------------------------------------

    def grow_boundary(self) -> None:
        """Elastic runs, after each round's reports: rank 0 asks `control.grow_requested` and
        every rank learns the answer in one broadcast; yes: apply and report the exchange in
        flight (nothing is lost) and regroup (reason "grow") so that joiners come in."""
        if self.control.regroup is None:
            return
        flag = torch.zeros(1, dtype=torch.int32)
        if self.topo.rank == 0:
            grow = self.control.grow_requested
            flag[0] = int(bool(grow and grow()))
        dist.broadcast(flag, src=0)
        if flag[0]:
            self._settle_votes()
            applied = self.diloco.flush()
            if applied is not None:
                self.report(applied)
            raise _Regroup("grow")

    def _regroup_reason(self, exc: Exception) -> str | None:
        """Why this rank regroups after `exc` (one line), or None: it fails as without elastic
        training (no `control.regroup`, or not a broken world)."""
        if isinstance(exc, _Regroup):
            return exc.reason
        if self.control.regroup is None or not world_failure(exc):
            return None
        return error_line(exc)

    def _regroup(self, reason: str) -> Membership:
        """Leave the broken (or growing) world and get the next epoch from the launcher:
        TrainingError when it has fewer than min_replicas, or does not hold this rank."""
        assert self.control.regroup is not None
        failed = self.epoch
        self._keep_live_state()
        self._leave()
        m = self.control.regroup(failed, reason)
        members = check_members(tuple(m.members), self.job, m.epoch)
        position, stage = divmod(m.rank, self.topo.S)
        if m.epoch <= failed or stage != self.topo.stage or position >= len(members) \
                or members[position] != self.topo.replica:
            raise TrainingError(f"regroup: epoch {m.epoch} (after {failed}) puts rank {m.rank} at replica "
                                f"{members[position] if position < len(members) else None} stage {stage}, "
                                f"but this is replica {self.topo.replica} stage {self.topo.stage}")
        return m

    def _keep_live_state(self) -> None:
        """Between rounds (the last one opened has ended), this rank's live inner and
        compressor state is the start state of the next round: keep it, as if opened."""
        nxt = self.completed + 1
        rank = vars(self).get("rank")  # None: a regroup broke off before the world was wired
        if rank is not None and self.opened == self.completed and nxt not in self.kept and not self.allreduce:
            self.kept[nxt] = self._held(round_tensors(rank.module, rank.inner, rank.compressor, nxt,
                                                      (nxt - 1) * self.job.outer.inner_steps))

    def _leave(self) -> None:
        """Tear this rank's world down: drop the exchange in flight (its daemon thread may
        stay blocked on the dead world until the collective timeout; nobody waits for it),
        every reference to a process group (a live one keeps its sockets open, and peers
        blocked on this rank would wait for the timeout rather than fail at once), then the
        process groups themselves, tolerating errors: the world is broken. Whatever `_wire`
        built goes, all or part (a world may break while an epoch is being entered)."""
        held = vars(self)
        diloco, rank, transport = held.pop("diloco", None), held.pop("rank", None), held.pop("transport", None)
        held.pop("pipe_group", None)
        held.pop("tau_votes", None)  # agreements of the broken world: nobody waits for them
        if diloco is not None:
            diloco.drop_pending()
            self.compress_before += diloco.decode_s
        if rank is not None:
            self.compress_before += rank.compressor.total_s
        if transport is not None:
            self.counters = (transport.bytes_sent, transport.modelled_s, transport.wait_s)
        del diloco, rank, transport
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _enter(self, m: Membership) -> None:
        """Continue in epoch `m`: join its world, rebuild what trains the module there, load
        the committed outer state after `m.start_step` (local weights := outer, nothing in
        flight), restore the inner optimizer and compressor from this rank's kept start
        state of round start_step + 1 (else fresh), and go on from that round.

        Deadlock hazard: a joiner's `run_rank` + `begin` run the same collectives in the same
        order (init, agree_device, create_groups, the tokens' all-reduce)."""
        job, S = self.job, self.topo.S
        self.epoch = m.epoch
        init_world(m.init_method, m.rank, len(m.members) * S, self.control.timeout_s)
        device = agree_device(job, self.control.gpu)
        if device != self.device:
            self.module.to(device)
            self.device = device
        self._wire(Topology(m.rank, job.parallel.replicas, S, tuple(m.members)))
        self.transport.bytes_sent, self.transport.modelled_s, self.transport.wait_s = self.counters
        nxt = m.start_step + 1
        state = self.kept.get(nxt)
        if state is not None:
            rank = self.rank
            try:
                load_round_state(to_bytes(state), rank.module, rank.inner, rank.compressor)
            except ValueError as exc:
                raise TrainingError(f"regroup: this rank's kept start state of round {nxt}: {exc}") from None
        self.kept = {t: v for t, v in self.kept.items() if t <= nxt}
        self.diloco.outer = OuterOptimizer.from_bytes(m.shard, job.outer)
        with torch.no_grad():
            self.diloco.reset_local()
        self.first_round = nxt
        self.opened = self.completed = m.start_step
        self.unreported.clear()
        self._announce()
        self.tokens = self._tokens_through(m.start_step)

    def _announce(self) -> None:
        if self.control.emit_contributions:  # every rank: the epoch it trains in, and where
            self.emit("epoch", {"epoch": self.epoch, "rank": self.topo.rank, "members": self.topo.members})

    def _round_tokens(self) -> int:
        """Tokens one replica trains in a round."""
        job = self.job
        return job.outer.inner_steps * job.data.batch_size * job.model.seq_len

    def _full_tokens(self, step: int) -> int:
        """Tokens through outer step `step` had every replica trained every round."""
        return step * self.job.parallel.replicas * self._round_tokens()

    def _tokens_through(self, step: int) -> int:
        """A new epoch's start: the tokens through `step` that any rank of the world counted
        (a joiner knows none), else `_full_tokens` (a collective: every rank calls it)."""
        known = torch.tensor([self.tokens_at.get(step, -1)], dtype=torch.int64)
        dist.all_reduce(known, op=dist.ReduceOp.MAX)
        return int(known.item()) if known.item() >= 0 else self._full_tokens(step)

    def _catch_up(self, start: ResumePoint) -> None:
        """Re-run round `start.step` from its published start state (as `trainer.replay`
        does) so the inner optimizer and compressor hold what that round left; `begin` then
        loads the committed outer state. The round's pseudo-gradient is compressed only for
        the state compression keeps (error feedback, warm starts, the adaptive rule's
        history), with the byte budget the published payload recorded."""
        from trainer.compress import payload_budget

        rank = self.rank
        try:
            round_t, first_step = load_round_state(start.state, rank.module, rank.inner, rank.compressor)
        except ValueError as exc:
            raise TrainingError(f"resume: this rank's start state of round {start.step}: {exc}") from None
        if round_t != start.step:
            raise TrainingError(f"resume: the start state is for round {round_t}, not {start.step}")
        rerun_round(rank, self.topo.replica, round_t, first_step,
                    payload_budget(start.claimed) if start.claimed else None)

    def round(self, t: int) -> None:
        """Round `t`: start state, inner steps, round end, and the report of any outer
        step it applied."""
        H = self.job.outer.inner_steps
        began = time.perf_counter()
        rnd = self.open_round(t)
        round_start = time.perf_counter()
        wait_before, report_before = self.transport.wait_s, self.clock["report_s"]
        merge_before = self.clock["merge_s"]
        rnd.data = self.rank.corpus.shard(self.job.seed, self.topo.replica, t, H, self.job.data.batch_size,
                                          self.job.model.seq_len)
        round_loss = self.hooks.inner_phase(self, rnd)
        self.lr = warmup_lr(self.job.inner.lr, self.job.inner.warmup, rnd.first_step + H - 1)
        reported = self.clock["report_s"] - report_before
        merged = self.clock["merge_s"] - merge_before
        compute = (time.perf_counter() - round_start - (self.transport.wait_s - wait_before) - reported
                   - merged)
        self.clock["compute_s"] += compute
        release_free_memory()  # the inner steps' activations and gradients
        applied = self.end_round(rnd, round_loss, compute)
        release_free_memory()  # compression's working memory
        self.completed = t
        self.clock["rounds_wall_s"] += time.perf_counter() - began - (self.clock["report_s"] - report_before)
        self.clock["compress_s"] = self.compress_before + self.rank.compressor.total_s + self.diloco.decode_s
        if applied is not None:
            self.report(applied)

    def open_round(self, t: int) -> Round:
        """Round `t`'s bookkeeping and its start state, serialised once before any inner
        step (what a replay starts from; the AllReduce baseline publishes none)."""
        first_step = (t - 1) * self.job.outer.inner_steps  # warmup is not repeated on resume
        merge_at = self.diloco.merge_step if self.diloco.pending else None
        rank = self.rank
        start_state = b"" if self.allreduce else self._held(round_tensors(
            rank.module, rank.inner, rank.compressor, t, first_step,
            merge_step=(-1 if merge_at is None else merge_at) if self.partial else None))
        self.opened = t
        if self.control.regroup is not None and start_state:  # what a regroup restores
            self.kept[t] = start_state
            self.kept = {k: v for k, v in self.kept.items() if k > t - KEEP_STATES}
        anchor = None if merge_at is None else StoredTensors(start_state, "param/")
        return Round(t, first_step, merge_at, start_state, data=None, anchor=anchor)

    def _held(self, tensors: dict[str, torch.Tensor]) -> bytes | Blob:
        """`tensors_to_bytes(tensors)`, or where this rank spills the same bytes in a file."""
        return tensors_to_bytes(tensors) if self.spill is None else self.spill.tensors(tensors)

    def inner_steps(self, rnd: Round) -> float:
        """The round's honest inner steps (with stops, the partial rule's merge and
        progress reports between them); returns the round's loss."""
        hooked = self.control.cancellable or rnd.merge_at is not None
        loss = inner_round(
            self.rank, self.topo.replica, rnd.t, rnd.data.tokens, rnd.first_step,
            before_step=functools.partial(self._before_step, rnd) if hooked else None,
            sync_grads=self.transport.all_reduce_mean_ if self.allreduce else None,
            after_step=functools.partial(self._progress, rnd),
        )
        if rnd.merge_at == self.job.outer.inner_steps:
            self.merge(rnd)
        return loss

    def _before_step(self, rnd: Round, h: int) -> None:
        if self.control.cancellable:
            self.check_stop(rnd, h)
        if h == rnd.merge_at:
            self.merge(rnd)

    def check_stop(self, rnd: Round, h: int) -> None:
        """Raise `Cancelled` on every rank at once when rank 0 was asked to stop: rank 0
        decides, every rank learns it in the same collective (an inner-step boundary)."""
        if self.topo.rank == 0:
            stop = self.control.stop_requested
            self.stop_flag[0] = int(bool(stop and stop()))
        dist.broadcast(self.stop_flag, src=0)
        if self.stop_flag[0]:
            raise Cancelled(f"stopped at outer step {rnd.t}, inner step {h + 1}")

    def merge(self, rnd: Round) -> None:
        """partial: apply the previous round's exchange mid-round, then publish its step.
        The wait for the exchange stays in the round's wall time (`transport.wait_s`), the
        outer step and merge go to `merge_s`, the publishing to `report_s`; the round's
        compute counts none of them."""
        began = time.perf_counter()
        release_free_memory()  # the inner steps' activations, before the outer step's buffers
        wait_before = self.transport.wait_s
        assert rnd.anchor is not None, "merge: the round has no anchor"
        applied = self.diloco.merge(rnd.anchor)
        rnd.anchor = None
        published = time.perf_counter()
        self.clock["merge_s"] += published - began - (self.transport.wait_s - wait_before)
        self.report(applied)
        self.clock["report_s"] += time.perf_counter() - published

    def end_round(self, rnd: Round, round_loss: float, compute: float) -> AppliedStep | None:
        """The exchange and outer step (`DiLoCo.end_round`), or the baseline's empty step;
        under the partial rule also the next round's tau. The outer step applied, if any."""
        tag = (rnd.data.digest, round_loss, rnd.start_state)
        if self.allreduce:
            return AppliedStep(rnd.t, tensors_to_bytes({}), tag)
        # The exchange must fit the overlap window: the link moves this many bytes in
        # the round's compute time, and ring all-gather sends payloads per rank.
        budget = self.transport.link.bandwidth * compute / max(1, self.topo.n - 1)
        applied = self.diloco.end_round(rnd.t, tag, round_loss, budget)
        if self.partial and rnd.t < self.job.outer.steps:
            self.diloco.merge_step = self._next_tau(compute, len(self.diloco.pending_payload))
            self.taus.append(self.diloco.merge_step)
        return applied

    def _next_tau(self, compute: float, payload_len: int) -> int:
        """The tau of the next round. Under `auto` every rank takes the largest estimate,
        agreed one round late so that no rank waits for another at a round's end: this
        round's estimates go into an all-reduce (max) that completes in the background, and
        round t + 1 merges at the agreement on round t - 1's. The first round of an epoch has
        none earlier: it waits for its own (round 2 and round 3 merge at round 1's)."""
        H = self.job.outer.inner_steps
        if self.job.outer.tau != "auto":
            return int(self.job.outer.tau)
        vote = torch.tensor([auto_tau(self.transport, payload_len, self.diloco.exchange_s, compute / H, H,
                                      self.job.outer.fragments)],
                            dtype=torch.int64)
        self.tau_votes.append((dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True), vote))
        work, agreed = self.tau_votes.pop(0) if len(self.tau_votes) > 1 else self.tau_votes[0]
        work.wait()
        return int(agreed.item())

    def _settle_votes(self) -> None:
        """Wait for the tau agreements still in flight (a world that ends or regroups whole)."""
        while self.tau_votes:
            self.tau_votes.pop(0)[0].wait()

    def _gather(self, payload: Any) -> list[Any] | None:
        out = [None] * (self.topo.n * self.topo.S) if self.topo.rank == 0 else None
        dist.gather_object(payload, out, dst=0)
        return out

    def _progress(self, rnd: Round, h: int, loss: float | None) -> None:
        """The first member reports every inner step's loss. With S > 1 the loss lives on the
        last stage; it sends the losses of the last PROGRESS_EVERY steps to rank 0 in one
        broadcast (the one sync progress costs), so rank 0 reports them in a batch."""
        topo, H = self.topo, self.job.outer.inner_steps
        if not topo.lead:
            return
        self.unreported.append(0.0 if loss is None else loss)
        if topo.S > 1 and not (h % PROGRESS_EVERY == PROGRESS_EVERY - 1 or h == H - 1):
            return
        values = torch.tensor(self.unreported, dtype=torch.float64)
        if topo.S > 1:
            dist.broadcast(values, src=topo.global_rank(0, topo.S - 1), group=self.pipe_group)
        self.unreported.clear()
        if topo.rank == 0:
            self._emit_progress(rnd, h, values.tolist())

    def _emit_progress(self, rnd: Round, h: int, values: list[float]) -> None:
        """Rank 0: one `Progress` per inner step in `values` (the last of them is step h)."""
        job, t = self.job, rnd.t
        H, T, B, L = job.outer.inner_steps, job.outer.steps, job.data.batch_size, job.model.seq_len
        now = time.perf_counter()
        rate = len(values) * self.topo.n * B * L / max(now - self.since, 1e-9)
        self.since = now
        began, first_round = self.paced
        done = (t - first_round) * H + h + 1  # inner steps this epoch has run
        eta = (now - began) / done * ((T - t) * H + H - h - 1)
        first = h + 1 - len(values)
        for k, value in enumerate(values):
            lr = warmup_lr(job.inner.lr, job.inner.warmup, (t - 1) * H + first + k)
            self.emit("progress", Progress(t, first + k + 1, value, T, H, lr=lr, tokens_per_s=rate,
                                           rank0_bytes_sent=float(self.transport.bytes_sent), eta_s=eta))

    def shard_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's new stage shard's tensors: the outer state (views), or the baseline's
        weights with zero momentum (it has no outer optimizer)."""
        if self.allreduce:
            named = dict(self.rank.module.named_parameters())
            tensors = {f"param/{n}": p.detach().float().cpu() for n, p in named.items()}
            tensors.update({f"momentum/{n}": torch.zeros_like(p) for n, p in named.items()})
            return tensors
        return self.diloco.outer.tensors()

    def report(self, applied: AppliedStep) -> None:
        """Publish outer step `applied.round` (every rank takes part: gathers and eval)."""
        topo = self.topo
        # Every replica serialises its own new outer shard: the replicas of a stage are
        # independent witnesses of the aggregate, and each co-signs the digest of its own.
        # Its bytes are made only where they are needed (the digest; the first member's
        # StageShard, which a spilling rank writes straight to its file) and freed at once.
        release_free_memory()  # the outer step's decoded tensors, before the shard's bytes
        tensors = self.shard_tensors()
        signs = self.control.shard_digest is not None
        own = tensors_to_bytes(tensors) if signs or (topo.lead and self.spill is None) else None
        contribution = self._contribution(applied, own)
        shard = None
        if topo.lead:
            data = own if self.spill is None else self.spill.tensors(tensors) if own is None else self.spill.bytes(own)
            shard = StageShard(topo.stage, cast(bytes, data))
        del own, tensors
        if self.control.emit_contributions:  # so this rank's node can check what it attests
            self.emit("contribution", (applied.round, contribution))
        eval_loss = None
        if topo.lead:  # the committed weights, whatever the local ones are now
            with contextlib.nullcontext() if self.allreduce else self.diloco.outer_weights():
                eval_loss = self.rank.pipeline.eval_loss(self.eval_batches)
        self.tokens += topo.n * self._round_tokens()  # what the present replicas trained
        self.tokens_at[applied.round] = self.tokens
        gathered = self._gather((contribution, shard, eval_loss, self._rank_stats()))
        if topo.rank == 0:
            assert gathered is not None
            if self.control.step_slots is not None:  # the sink's backlog is full: wait for it
                self.control.step_slots.acquire()
            self.emit("step", self._step_artifacts(applied.round, gathered))
        del gathered, contribution, shard
        release_free_memory()

    def _contribution(self, applied: AppliedStep, own_shard: bytes | None) -> Contribution:
        """This rank's contribution to `applied`; its start state may be a spilled `Blob`,
        which reaches the launcher as the bytes (`trainer.artifacts.Blob`)."""
        digest, round_loss, start_state = applied.tag
        sign = self.control.shard_digest
        new_shard = b""
        if sign is not None:
            assert own_shard is not None
            new_shard = self.hooks.cosigned_shard(self.topo, applied.round, own_shard, sign)
        return Contribution(
            replica=self.topo.replica,
            stage=self.topo.stage,
            data=applied.payload,
            data_shard=digest,
            loss=round_loss,
            start_state=cast(bytes, start_state),
            new_shard=new_shard,
        )

    def _rank_stats(self) -> dict[str, float]:
        """This rank's counters for the step's metrics (rank 0 combines every rank's)."""
        compressor = self.rank.compressor
        return {
            **self.clock,
            "bytes_sent": float(self.transport.bytes_sent),
            "modelled_comm_s": self.transport.modelled_s,
            "comm_wait_s": self.transport.wait_s,
            "peak_rss_mb": _peak_rss_mb(),
            "extra_memory_bytes": float(0 if self.allreduce else self.diloco.extra_memory_bytes()),
            "param_bytes": float(4 * sum(p.numel() for p in self.rank.params)),
            **{k: v for k, v in compressor.last_stats.items() if k != "compress_s"},
        }

    def _step_artifacts(self, t: int, gathered: list[Any]) -> StepArtifacts:
        """Rank 0: outer step `t` from every rank's (contribution, shard, eval, stats)."""
        S = self.topo.S
        contributions = [c for c, _, _, _ in gathered]
        stages = [gathered[s][1] for s in range(S)]
        (eval_value,) = [e for _, _, e, _ in gathered if e is not None]
        metrics = self._metrics(t, contributions, eval_value, [st for _, _, _, st in gathered])
        return StepArtifacts(step=t, stages=stages, contributions=contributions, metrics=metrics,
                             replicas=() if self.topo.full else self.topo.members, epoch=self.epoch)

    def _metrics(self, t: int, contributions: list[Contribution], eval_value: float,
                 rank_stats: list[dict[str, float]]) -> dict[str, float]:
        """Outer step `t`'s metrics: losses (over the present replicas), tokens, the learning
        rate, bytes and times."""
        n, S, H = self.topo.n, self.topo.S, self.job.outer.inner_steps
        metrics = {
            "eval_loss": eval_value,
            "train_loss": sum(contributions[p * S].loss for p in range(n)) / n,
            "tokens": float(self.tokens),
            "inner_steps": float(t * H),
            "wall_s": time.perf_counter() - self.started,
            "lr": self.lr,
            # Summed over the world's ranks, cumulative: bytes that crossed replicas.
            "bytes_sent": sum(st["bytes_sent"] for st in rank_stats),
            "payload_bytes": float(sum(len(c.data) for c in contributions)),
        }
        for key in ("compute_s", "rounds_wall_s", "compress_s", "modelled_comm_s",
                    "comm_wait_s", "peak_rss_mb"):
            metrics[key] = max(st[key] for st in rank_stats)  # the slowest rank
        for key in ("extra_memory_bytes", "param_bytes"):  # one replica's stages
            metrics[key] = sum(st[key] for st in rank_stats[:S])
        for key in RANK_COUNTERS:  # each rank's own, which a resumed rank continues from
            metrics.update({f"{key}.r{r}": st[key] for r, st in enumerate(rank_stats)})
        if self.taus:  # the partial rule: the tau each round merged at, mean so far
            metrics["tau_mean"] = sum(self.taus) / len(self.taus)
        for key in ("rel_error", "rank_mean", "bits_mean", "residual_norm"):
            if key in rank_stats[0]:
                metrics[key] = sum(st[key] for st in rank_stats) / len(rank_stats)
        return metrics
