"""One rank's pipeline stage and what trains it: the language-model loss and its mean
(`lm_loss`, `loss_fn`, `mean_loss`), the inner learning rate and optimizer (`warmup_lr`,
`build_inner_optimizer`), clipping by the whole pipeline's gradient norm
(`clip_pipeline_grad_norm`), the precision (`autocast`), the stage with its schedule
(`Pipeline`) and the pieces a round runs on (`StageRank`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.compress import Compressor
from trainer.config import JobConfig
from trainer.world import Topology

__all__ = [
    "LONE_STAGE_SHORTCUT",
    "Pipeline",
    "StageRank",
    "autocast",
    "build_inner_optimizer",
    "clip_pipeline_grad_norm",
    "lm_loss",
    "loss_fn",
    "mean_loss",
    "warmup_lr",
]

LONE_STAGE_SHORTCUT = True  # S = 1 runs the model directly (Pipeline._lone_stage_step)


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
