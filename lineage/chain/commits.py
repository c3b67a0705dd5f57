"""A run's commits kept on a chain that reorganises: the one place `commitStep` is sent from
a run (`workers.run.sink.LedgerSink`, under `dlx train` and in the job queue's sink task).

`StepCommits.commit` first checks that the chain's head for the run is the step this process
believes (`repair`): a reorganisation deeper than the confirmations can remove commits that
were confirmed, and those are sent again, in order, with the signatures they had (they stay
valid: a signature covers the step's content, not its block), one line each through `say`.
A commit the ledger refuses as a duplicate (`LedgerWrongStep`, or any refusal) counts as
done when the step the chain records is ours: a commit sent twice (once lost in a reorg,
once again) never fails a run. A chain that fails the run raises `ChainFailure` (exit 1); a
refusal that no reorganisation explains stays the ledger's named error (exit 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lineage.errors import ChainError, ChainFailure, ChainRevertError, TrainingError

#: How many of the latest commits are kept to send again after a reorganisation.
KEEP = 256


@dataclass(frozen=True)
class StepCommit:
    """`Ledger.commit_step`'s arguments for one step, kept until no reorganisation can reach it."""

    run_id: int
    step: int
    parent: bytes
    checkpoint: bytes
    metrics_digest: bytes
    attestations: list[Any]
    replica_set: int | None = None


class StepCommits:
    """The commits of one run by one submitter (`ledger`: a `lineage.chain.ledger.Ledger`)."""

    def __init__(self, ledger: Any, submitter: Any, say: Callable[[str], None]) -> None:
        self.ledger, self.submitter, self.say = ledger, submitter, say
        self._sent: dict[int, StepCommit] = {}

    def commit(self, c: StepCommit) -> None:
        """Repair the run up to `c.step - 1`, then commit `c` (success if already recorded)."""
        self.repair(c.run_id, c.step - 1)
        self._send(c)
        self._sent[c.step] = c
        for old in [s for s in self._sent if s <= c.step - KEEP]:
            del self._sent[old]

    def repair(self, run_id: int, believed: int) -> list[int]:
        """Re-commit, in order, every step up to `believed` that the chain's head for
        `run_id` no longer includes; returns them. A removed step this process did not
        commit (a resumed run's earlier steps) cannot be sent again: ChainFailure."""
        head = self._head(run_id)
        repaired = []
        for step in range(head + 1, believed + 1):
            c = self._sent.get(step)
            if c is None:
                raise ChainFailure(f"run {run_id}: the chain's head is step {head}, not {believed}; a reorganisation "
                                   f"removed step {step}, which this process cannot commit again")
            self.say(f"chain: step {step} of run {run_id} was removed by a reorganisation; committing it again")
            self._send(c)
            repaired.append(step)
        return repaired

    def recorded(self, c: StepCommit) -> bool:
        """Whether the chain's current head for the run includes `c`'s step with `c`'s checkpoint."""
        if self._head(c.run_id) < c.step:
            return False
        fn = self.ledger.ledger.functions.stepCheckpoint(c.run_id, c.step)
        return bytes(guard(fn.call, f"stepCheckpoint({c.run_id}, {c.step})")) == c.checkpoint

    def _head(self, run_id: int) -> int:
        return int(guard(lambda: self.ledger.head(run_id), f"runHead({run_id})")[1])

    def _send(self, c: StepCommit, again: bool = True) -> None:
        try:
            self.ledger.commit_step(
                self.submitter, run_id=c.run_id, step=c.step, parent=c.parent, checkpoint=c.checkpoint,
                metrics_digest=c.metrics_digest, attestations=c.attestations, replica_set=c.replica_set)
        except TrainingError:  # the endpoint stayed away, fees above the cap: nothing to check
            raise
        except ChainError as exc:  # a refusal, or a failed transaction
            if self.recorded(c):  # sent before (lost, then mined after all, or sent twice): done
                return
            # a reorganisation between the check before this commit and its block removed
            # its parent: repair, then send it once more
            if again and self._head(c.run_id) < c.step - 1 and self.repair(c.run_id, c.step - 1):
                self._send(c, again=False)
                return
            if isinstance(exc, ChainRevertError):
                raise  # the ledger refused this commit itself: its error by name, as before (exit 2)
            raise ChainFailure(str(exc)) from None


def guard(call: Callable[[], Any], context: str) -> Any:
    """`call()`, with a chain failure as a `ChainFailure` (exit 1: the run failed, not its input)."""
    from web3.exceptions import Web3Exception

    try:
        return call()
    except (TrainingError, ChainRevertError):  # already exit 1; a refusal names its error as it is
        raise
    except ChainError as exc:
        raise ChainFailure(str(exc)) from None
    except (OSError, Web3Exception) as exc:
        from .tx import why_failed

        raise ChainFailure(f"{context}: {why_failed(exc)}") from None
