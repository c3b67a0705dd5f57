"""The points where a test-only extension changes what a rank does, injected rather than
asked for: the tests' attack harness (tests/dlx_testing/cheat.py, never imported by
production code) builds a `RankHooks` subclass from a job file's `[cheat]` tables and a
launcher passes it in `trainer.engine.RankControl.hooks`. These defaults are what every
honest rank does, so an honest run's round loop holds no cheat branch.

Torch-free on purpose: that harness is imported with job-file parsing and builds on this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.engine import Round, RoundLoop, Topology

__all__ = ["RankHooks", "unchanged"]


def unchanged(round_t: int, delta: Any) -> Any:
    """The honest `trainer.diloco.DeltaHook`: a rank publishes the pseudo-gradient it measured."""
    return delta


class RankHooks:
    """What a rank does at each point an extension may change; honest by default."""

    def publish(self, topo: Topology) -> Callable[[int, Any], Any]:
        """(round, measured pseudo-gradient) -> the one this rank publishes and sends."""
        return unchanged

    def inner_phase(self, loop: RoundLoop, rnd: Round) -> float:
        """Run round `rnd`'s inner steps; returns the round's loss."""
        return loop.inner_steps(rnd)

    def cosigned_shard(self, topo: Topology, step: int, data: bytes,
                       digest: Callable[[bytes], bytes]) -> bytes:
        """The digest this rank co-signs at `step` for its stage's new shard bytes `data`."""
        return digest(data)
