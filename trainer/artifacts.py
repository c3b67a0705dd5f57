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
from typing import Protocol

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

__all__ = [
    "Contribution",
    "GenesisArtifacts",
    "Progress",
    "StageShard",
    "StepArtifacts",
    "StepSink",
    "bytes_to_tensors",
    "code_hash",
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
    """What replica r's stage s contributed this round."""

    replica: int
    stage: int
    data: bytes  # safetensors bytes: keys "delta/<name>" (theta_outer - theta_local), sorted
    data_shard: bytes  # 32-byte sha256 of the round's tokens for this replica
    loss: float  # mean training loss of this replica over the round's H inner steps


@dataclass(frozen=True)
class GenesisArtifacts:
    stages: list[StageShard]


@dataclass(frozen=True)
class StepArtifacts:
    step: int  # 1-based outer step
    stages: list[StageShard]  # stage order
    contributions: list[Contribution]  # slot order r*S + s
    # at least eval_loss, train_loss, tokens (cumulative), inner_steps (cumulative), wall_s
    metrics: dict[str, float]


@dataclass(frozen=True)
class Progress:
    outer_step: int  # 1-based outer step being trained
    inner_step: int  # 1-based inner step within it
    loss: float  # replica 0's training loss at that inner step
    outer_steps: int  # T
    inner_steps: int  # H


class StepSink(Protocol):
    def on_genesis(self, genesis: GenesisArtifacts) -> None: ...
    def on_step(self, step: StepArtifacts) -> None: ...
    def on_progress(self, progress: Progress) -> None: ...


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes with sorted keys and no metadata: same tensors, same bytes."""
    ordered = {k: tensors[k].detach().cpu().contiguous() for k in sorted(tensors)}
    return bytes(_st_save(ordered))


def bytes_to_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `tensors_to_bytes`; keys come back sorted."""
    loaded = _st_load(data)
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
