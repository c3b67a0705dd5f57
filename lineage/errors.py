"""Errors raised by the lineage package (storage, chain, attestations).

All derive from `trainer.errors.DlxError`, the project's one root exception, and from
the matching built-in, so callers can catch either.
"""

from __future__ import annotations

from typing import ClassVar

from trainer.errors import DlxError, TrainingError


class StorageError(DlxError, OSError):
    """A content-addressed store could not read or write a block."""


class BlockNotFoundError(StorageError, KeyError):
    """The requested CID is not in the store; `where` says which store was searched."""

    def __init__(self, cid: object, where: str = "") -> None:
        super().__init__(f"block not found: {cid}" + (f" (searched {where})" if where else ""))
        self.cid = cid

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class CorruptBlockError(StorageError):
    """A stored block does not hash to its CID."""

    def __init__(self, cid: object, detail: str = "content does not match its CID") -> None:
        super().__init__(f"corrupt block {cid}: {detail}")
        self.cid = cid


class ChainError(DlxError, RuntimeError):
    """The chain could not be reached, answered unexpectedly, or rejected a transaction."""


class ChainRevertError(ChainError):
    """A transaction or call reverted; `name` and `args` come from the contract's custom error.

    Each custom error of the contracts is a subclass of its own name, generated from their
    ABIs into lineage/chain/reverts.py (`except LedgerStaleParent:`); a subclass carries the
    error's 4-byte `selector` and its ABI `inputs` as (name, type) pairs.
    """

    selector: ClassVar[str] = ""
    inputs: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, name: str, args: dict[str, object], context: str = "") -> None:
        rendered = ", ".join(f"{k}={_fmt(v)}" for k, v in args.items())
        where = f"{context}: " if context else ""
        super().__init__(f"{where}reverted with {name}({rendered})")
        self.name = name
        self.error_args = args


def _fmt(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    return str(value)


class ChainFailure(ChainError, TrainingError):
    """A run's chain failed it after it started (exit code 1, not the bad-input 2): the
    endpoint stayed unavailable, fees rose past the cap, or a commit was refused; the chain
    holds every step committed before, and `--resume` continues (docs/chain.md)."""


class ChainUnavailable(ChainFailure):
    """The endpoint refused, timed out or rate-limited for longer than `[chain] outage_s`."""


class ChainFeeError(ChainFailure):
    """The chain's base fee is above `[chain] max_fee_gwei`."""
