"""Event logs read in bounded block ranges.

Public endpoints cap `eth_getLogs` (10,000 blocks per request is common), and a chain of
millions of blocks is slow to scan from block 0. `ranged_logs` reads from a run's creation
block (`RunRecord.created_block`) to the head in windows of `[chain] log_range` blocks, and
halves the window where the endpoint still refuses it as too wide.
"""

from __future__ import annotations

from typing import Any

from web3.exceptions import Web3Exception, Web3RPCError

#: Blocks per request by default (`[chain] log_range`).
DEFAULT_LOG_RANGE = 10_000
_TOO_WIDE = ("range", "too many", "limit", "exceed", "10000", "too large")


def too_wide(exc: BaseException) -> bool:
    """Whether an endpoint refused a log query for the number of blocks or results it spans."""
    text = str(exc).lower()
    return isinstance(exc, Web3RPCError | ValueError) and any(w in text for w in _TOO_WIDE)


def ranged_logs(event: Any, *, from_block: int = 0, log_range: int = DEFAULT_LOG_RANGE,
                argument_filters: dict[str, Any] | None = None, to_block: int | None = None) -> list[Any]:
    """`event.get_logs` from `from_block` to `to_block` (the head when None), at most
    `log_range` blocks per request, oldest first."""
    last = event.w3.eth.block_number if to_block is None else to_block
    out: list[Any] = []
    start, width = max(0, from_block), max(1, log_range)
    while start <= last:
        end = min(last, start + width - 1)
        try:
            out.extend(event.get_logs(from_block=start, to_block=end, argument_filters=argument_filters))
        except Web3Exception as exc:
            if width > 1 and too_wide(exc):
                width //= 2
                continue
            raise
        start = end + 1
    return out
