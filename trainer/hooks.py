"""The points where a test-only extension changes what a rank does, injected rather than
asked for: the tests' attack harness (tests/dlx_testing/cheat.py, never imported by
production code) builds a `RankHooks` subclass from a job file's `[cheat]` tables and a
launcher passes it in `trainer.control.RankControl.hooks`. These defaults are what every
honest rank does, so an honest run's round loop holds no cheat branch.

Torch-free on purpose: that harness is imported with job-file parsing and builds on this.
What a hook is handed is typed by the protocols below (what it reads of it), not by the
round loop's classes: this module sits below trainer.engine and imports none of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["Place", "RankHooks", "RoundPhases", "unchanged"]

RoundT = TypeVar("RoundT")
RoundT_contra = TypeVar("RoundT_contra", contravariant=True)


class Place(Protocol):
    """Where a rank sits (`trainer.world.Topology`): its replica id and its stage."""

    @property
    def replica(self) -> int: ...

    @property
    def stage(self) -> int: ...


class RoundPhases(Protocol[RoundT_contra]):
    """The round loop as a hook drives it (`trainer.engine.RoundLoop`, whose rounds are
    `trainer.engine.Round`)."""

    def inner_steps(self, rnd: RoundT_contra) -> float: ...


def unchanged(round_t: int, delta: Any) -> Any:
    """The honest `trainer.diloco.DeltaHook`: a rank publishes the pseudo-gradient it measured."""
    return delta


class RankHooks:
    """What a rank does at each point an extension may change; honest by default."""

    def publish(self, topo: Place) -> Callable[[int, Any], Any]:
        """(round, measured pseudo-gradient) -> the one this rank publishes and sends."""
        return unchanged

    def inner_phase(self, loop: RoundPhases[RoundT], rnd: RoundT) -> float:
        """Run round `rnd`'s inner steps; returns the round's loss."""
        return loop.inner_steps(rnd)

    def cosigned_shard(self, topo: Place, step: int, data: bytes,
                       digest: Callable[[bytes], bytes]) -> bytes:
        """The digest this rank co-signs at `step` for its stage's new shard bytes `data`."""
        return digest(data)
