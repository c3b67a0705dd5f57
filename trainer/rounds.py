"""A round of inner steps, the state it starts from and running it again.

`inner_round` is the one inner loop that training (`trainer.engine.RoundLoop`), an exact
resume and a replay all run; `round_state` / `round_tensors` serialise a rank's state at a
round's start (the format every contribution publishes), `load_round_state` and
`merge_step_of` read it back, and `rerun_round` computes a round once more from it
(replay verification, exact resumes: `catch_up`), so a replay from that state is bit-identical on the
same machine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from trainer.artifacts import KERNELS_KEY, MERGE_STEP_KEY, tensor_views, tensors_to_bytes
from trainer.compress import Compressor
from trainer.control import ResumePoint
from trainer.data import derive_seed
from trainer.diloco import contribution, fragment_groups, fragment_of, merge_weights
from trainer.errors import TrainingError
from trainer.kernels import kernel_fingerprint
from trainer.pipeline import StageRank, clip_pipeline_grad_norm, warmup_lr

__all__ = [
    "catch_up",
    "inner_round",
    "load_round_state",
    "merge_step_of",
    "rerun_round",
    "round_state",
    "round_tensors",
]


def _broadcast_scalar(value: float | None, src: int, group: dist.ProcessGroup | None) -> float:
    t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64)
    dist.broadcast(t, src=src, group=group)
    return t.item()


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


def catch_up(rank: StageRank, replica: int, start: ResumePoint) -> None:
    """An exact resume: re-run round `start.step` from its published start state (as
    `trainer.replay` does) so the inner optimizer and compressor hold what that round left;
    the caller then loads the committed outer state. The round's pseudo-gradient is
    compressed only for the state compression keeps (error feedback, warm starts, the
    adaptive rule's history), with the byte budget the published payload recorded."""
    from trainer.compress import payload_budget

    try:
        round_t, first_step = load_round_state(start.state, rank.module, rank.inner, rank.compressor)
    except ValueError as exc:
        raise TrainingError(f"resume: this rank's start state of round {start.step}: {exc}") from None
    if round_t != start.step:
        raise TrainingError(f"resume: the start state is for round {round_t}, not {start.step}")
    rerun_round(rank, replica, round_t, first_step, payload_budget(start.claimed) if start.claimed else None)
