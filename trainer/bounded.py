"""Reading a small input file (a job file, run.json, config.json, tokenizer.json) with
bounds: only a regular file (a FIFO or a device is refused without waiting on it), at
most `limit` bytes, and any failure one ConfigError naming the file.

    raw = read_bounded(path, 1 << 20, "job file")
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError

__all__ = ["JSON_LIMIT", "read_bounded", "read_json"]

#: The largest JSON input read whole (a tokenizer.json of a 150k-token vocabulary is ~10 MB).
JSON_LIMIT = 64 << 20


def read_fd(fd: int, limit: int) -> bytes | None:
    """At most `limit` bytes from `fd` to its end; None if it holds more (a file that grew
    after its size was checked)."""
    chunks, left = [], limit + 1
    while left and (piece := os.read(fd, left)):
        chunks.append(piece)
        left -= len(piece)
    return None if not left else b"".join(chunks)


def read_bounded(path: str | os.PathLike[str], limit: int, what: str) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them; ConfigError otherwise
    (FileNotFoundError passes through, for callers that say so their own way)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {path} is not a regular file")
        if st.st_size > limit:
            raise ConfigError(f"{what} {path} has {st.st_size} bytes, more than the {limit} read")
        data = read_fd(fd, limit)
        if data is None:
            raise ConfigError(f"{what} {path} grew past the {limit} bytes read")
        return data
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike[str], what: str, limit: int = JSON_LIMIT) -> Any:
    """`read_bounded`, parsed as JSON: malformed JSON, an integer of more digits than Python
    converts, nesting deeper than the parser's recursion: ConfigError naming the file."""
    raw = read_bounded(Path(path), limit, what)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, the int digit limit
        raise ConfigError(f"{what} {path} is not valid JSON: {str(exc)[:200]}") from None
