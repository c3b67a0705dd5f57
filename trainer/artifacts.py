"""What training hands to the outside world: the `StepSink` contract and its payloads.

The engine calls a `StepSink` once at genesis, once per outer step and now and then with
progress; the sink (content-addressed storage, a chain client, a test recorder) lives in
the parent process, so it need not be picklable. All tensors travel as safetensors bytes
with sorted keys and no metadata, so identical tensors give identical bytes (and CIDs).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch is imported where tensors are: a launcher handles only bytes
    import torch

__all__ = [
    "KERNELS_KEY",
    "MERGE_STEP_KEY",
    "Contribution",
    "GenesisArtifacts",
    "Progress",
    "StageShard",
    "StepArtifacts",
    "StepSink",
    "bytes_to_tensors",
    "code_hash",
    "param_tensors",
    "same_tensors",
    "tensors_to_bytes",
]


@dataclass(frozen=True)
class StageShard:
    """New outer state of one pipeline stage."""

    stage: int
    # safetensors bytes: keys "param/<name>" (outer params) and "momentum/<name>" (outer
    # Nesterov buffer), sorted, float32, no metadata
    data: bytes


@dataclass(frozen=True)
class Contribution:
    """What replica r's stage s contributed to outer step t: exactly the bytes it sent.

    `data` is safetensors (sorted keys, no metadata), one key family per parameter <name>
    (with `outer.fragments` > 1, per parameter of step t's fragment only:
    `trainer.diloco.fragment_groups`) (the decoder is `trainer.compress.decode_contribution`;
    shapes come from the shard):
    - compression `none`: ``delta/<name>`` float32, theta_outer - theta_local as is;
    - otherwise ``meta/<name>`` int32 [codec, bits, rank] (codec 1 = quantised, 2 = low
      rank), plus for codec 1 ``q/<name>`` uint8 (rows, ceil(cols*bits/8)) and
      ``q_scale/<name>`` float32 (rows,), and for codec 2 ``u/<name>`` (rank, ceil(m*bits/8))
      with ``u_scale/<name>`` (rank,) and ``v/<name>`` (rank, ceil(n*bits/8)) with
      ``v_scale/<name>`` (rank,). A tensor is viewed as (shape[0], rest), a 1-D tensor as
      (1, n); b-bit values are stored offset by 2**(b-1)-1, 8/b per byte, low bits first;
      value = (stored - (2**(b-1)-1)) * scale of its row; a low-rank tensor is
      sum_k outer(u_k, v_k), summed in k order. Codec 3 (sparse) and codec 4 (2-bit values
      in the gaps layout, one ``gaps/stream`` per payload) are in docs/FORMATS.md.
    The new shard of step t is `apply_outer_step(shard of step t-1, [data of r = 0..R-1], cfg, t)`.
    With `outer.delay = 1` the round that produced step t's contribution started, under
    the restart rule, from the shard of step t-2 (genesis for t <= 2); under the eager and
    partial rules from weights derived from committed data (trainer/diloco.py; the
    verifier re-derives them). The contribution carries that round's data shard and loss. Under `parallel.sync = "allreduce"` (the baseline) `data` is an empty
    safetensors blob: there is no outer step to recompute. An adaptive payload whose byte
    budget capped it also holds ``adaptive/budget`` (float64 (1,)), which replay re-uses.

    `start_state` is what replay verification starts from: this rank's state at the start
    of the round that produced `data` (`trainer.engine.round_state`: local weights, inner
    optimizer state, compressor state; safetensors, sorted keys; under the partial rule
    also ``round/merge_step``, int64 (1,), the inner step the round merged before, -1 for
    none). Empty for the baseline.

    `new_shard` is the digest this rank computed of its own stage's new outer shard after the
    outer step (`RankControl.shard_digest` of the `StageShard.data` bytes it would publish):
    the replicas of a stage co-sign it on the ledger, so each computes it from its own state.
    """

    replica: int
    stage: int
    data: bytes  # safetensors bytes of the payload sent (layout above)
    data_shard: bytes  # 32-byte sha256 of the round's tokens for this replica
    loss: float  # mean training loss of this replica over the round's H inner steps
    start_state: bytes = b""  # the round's start state (see above), for replay
    new_shard: bytes = b""  # 32-byte digest of this rank's own new stage shard (see above)


@dataclass(frozen=True)
class GenesisArtifacts:
    stages: list[StageShard]


@dataclass(frozen=True)
class StepArtifacts:
    step: int  # 1-based outer step
    stages: list[StageShard]  # stage order
    # slot order position*S + s over the step's present replicas (all R: r*S + s); each
    # Contribution.replica is the replica id
    contributions: list[Contribution]
    # at least eval_loss, train_loss, tokens (cumulative), inner_steps (cumulative), wall_s;
    # also (cumulative, rank 0 aggregates): bytes_sent (every rank, bytes that crossed
    # replicas), payload_bytes (this step's contributions), compute_s, rounds_wall_s,
    # compress_s, comm_wait_s, modelled_comm_s (slowest rank), peak_rss_mb (largest rank),
    # extra_memory_bytes and param_bytes (one replica), and for compressed runs rel_error,
    # rank_mean, bits_mean, residual_norm (mean over ranks, latest step); train_loss is the
    # mean over the present replicas, tokens counts what the present replicas of every step
    # trained
    metrics: dict[str, float]
    # The replica ids whose contributions this step averages, ascending: () when all R took
    # part (a full run's steps, as before elastic training), else the membership epoch's.
    replicas: tuple[int, ...] = ()
    epoch: int = 0  # the membership epoch (trainer.engine.Membership) that computed the step


@dataclass(frozen=True)
class Progress:
    """One inner step of replica 0, reported by global rank 0 (every inner step; with
    pipeline stages in batches of `trainer.engine.PROGRESS_EVERY`). Only what the step
    already computed: reporting adds no synchronisation beyond that batch's broadcast."""

    outer_step: int  # 1-based outer step being trained
    inner_step: int  # 1-based inner step within it
    loss: float  # replica 0's training loss at that inner step
    outer_steps: int  # T
    inner_steps: int  # H
    lr: float = 0.0  # the inner learning rate of that step (after warmup)
    tokens_per_s: float = 0.0  # tokens all replicas trained per second over the last report's steps
    rank0_bytes_sent: float = 0.0  # cumulative bytes rank 0 sent to other replicas (step records sum every rank)
    eta_s: float = 0.0  # seconds left at the run's average pace so far

    @property
    def global_step(self) -> int:
        """1-based inner step of the whole run."""
        return (self.outer_step - 1) * self.inner_steps + self.inner_step

    def record(self) -> dict[str, float | int | str]:
        """The line `metrics.jsonl` holds for this inner step (the keys `workers.sink` documents)."""
        return {"kind": "inner", "step": self.outer_step, "inner_step": self.inner_step,
                "global_step": self.global_step, "loss": self.loss, "lr": self.lr,
                "tokens_per_s": self.tokens_per_s, "rank0_bytes_sent": self.rank0_bytes_sent, "eta_s": self.eta_s}


class StepSink(Protocol):
    """Where a run's steps go. A sink may also have a `shard_digest(bytes) -> bytes`
    attribute, a picklable module-level function: the launcher hands it to every rank
    (`RankControl.shard_digest`), which then reports the digest of its own new stage shard."""

    def on_genesis(self, genesis: GenesisArtifacts) -> None: ...
    def on_step(self, step: StepArtifacts) -> None: ...
    def on_progress(self, progress: Progress) -> None: ...


MERGE_STEP_KEY = "round/merge_step"  # a partial-rule round state: the inner step it merged before
KERNELS_KEY = "round/kernels"  # a round state: the trainer's kernel fingerprint, UTF-8 (trainer/kernels.py)


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes with sorted keys and no metadata: same tensors, same bytes."""
    from trainer import tensorbytes

    ordered = {k: tensors[k].detach().cpu().contiguous() for k in sorted(tensors)}
    return tensorbytes.encode(ordered)


def bytes_to_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `tensors_to_bytes`; keys come back sorted, tensors writable (they view
    one private copy of the data)."""
    from trainer import tensorbytes

    loaded = tensorbytes.decode(data)
    return {k: loaded[k] for k in sorted(loaded)}


def code_hash() -> bytes:
    """32-byte sha256 over the trainer package's .py sources (sorted relative path + bytes)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix().encode()
        blob = path.read_bytes()
        h.update(len(rel).to_bytes(4, "big") + rel + len(blob).to_bytes(8, "big") + blob)
    return h.digest()


def param_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """The ``param/`` tensors of a round state or stage shard, by parameter name."""
    return {k.removeprefix("param/"): v for k, v in bytes_to_tensors(data).items() if k.startswith("param/")}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bits."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bool((a[k] == b[k]).all()) for k in a)
