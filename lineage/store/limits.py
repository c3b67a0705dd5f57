"""What a reader of untrusted blocks accepts: the bounds every store reader enforces.

A block from a store or a CAR is at most `MAX_BLOCK` bytes: Kubo's limit (1 MiB), above
the largest block this project writes (a 256 KiB chunk, a directory node of at most
256 KiB before it becomes a HAMT, a manifest of a few KiB). A walk over a file or
directory DAG goes at most `max_depth()` nodes deep, and a directory walk lists at most
`max_entries()` entries; both may be raised by environment (a file DAG of Kubo's layout
is 8 levels deep at 2^64 bytes; the largest dataset here has thousands of files):

    DLX_MAX_DAG_DEPTH=64          DLX_MAX_TREE_ENTRIES=100000

A value that is not a positive integer is a one-line error.
"""

from __future__ import annotations

import os

from trainer.errors import ConfigError

MAX_BLOCK = 1 << 20
MAX_CBOR_DEPTH = 64  # a manifest nests 4 levels; a DAG-CBOR value deeper is refused
DEFAULT_DEPTH = 64
DEFAULT_ENTRIES = 100_000


def _positive(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"${name} must be a positive integer, not {text!r}")
    return value


def max_in_memory() -> int:
    """The largest file read whole into memory (`unixfs.read_bytes`: shards, contributions,
    round states): half this machine's memory ($DLX_MAX_FILE_IN_MEMORY, bytes). A file DAG
    whose sizes are consistent can still declare 1 TB over one repeated leaf; it is refused
    before its first leaf is read."""
    try:
        half = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        half = 8 << 30
    return _positive("DLX_MAX_FILE_IN_MEMORY", half)


def max_depth() -> int:
    """The deepest file or directory DAG a walk follows ($DLX_MAX_DAG_DEPTH)."""
    return _positive("DLX_MAX_DAG_DEPTH", DEFAULT_DEPTH)


def max_entries() -> int:
    """The most entries a directory walk lists ($DLX_MAX_TREE_ENTRIES)."""
    return _positive("DLX_MAX_TREE_ENTRIES", DEFAULT_ENTRIES)
