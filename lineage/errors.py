"""Errors raised by the lineage package (storage, chain, attestations).

All derive from `trainer.errors.DlxError`, the project's one root exception, and from
the matching built-in, so callers can catch either.
"""

from __future__ import annotations

from trainer.errors import DlxError


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
    """A transaction or call reverted; `name` and `args` come from the contract's custom error."""

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
