"""The project's exception hierarchy.

`DlxError` is the root of every error the project raises on purpose; each subclass also
inherits the matching built-in, so callers that catch `ValueError` or `RuntimeError` keep
working. The `dlx` CLI turns any `DlxError` into one line and exit code 2 (a user error),
a `TrainingError` into exit code 1 (a run that started and failed), and anything else into
exit code 3 (a bug); docs/training.md, "Exit codes".
"""

from __future__ import annotations

__all__ = ["Cancelled", "ConfigError", "DlxError", "TrainingDiverged", "TrainingError"]


class DlxError(Exception):
    """Root of all project errors."""


class ConfigError(DlxError, ValueError):
    """A job file or configuration value is invalid; the message names the field."""


class TrainingError(DlxError, RuntimeError):
    """A training run failed (a rank died or raised, or the run timed out)."""


class TrainingDiverged(TrainingError):
    """The loss became NaN or infinite: raised before anything of that step is stored or
    committed, so the run keeps exactly the steps before it (a job failure, as every
    TrainingError)."""


class Cancelled(Exception):
    """The launcher asked the ranks to stop; raised on every rank at the same inner step
    (`trainer.engine`). Not a DlxError: a stop is an outcome, not a failure."""
