"""The one way `dlx` commands print with rich, and show progress.

Rich wraps at the terminal's width, or at 80 columns when stdout is a pipe or a file,
which breaks CIDs and hashes for grep, copy-paste and CI logs. `console()` never wraps
plain lines (`soft_wrap`), and off a terminal renders tables at their natural width with
no colour codes. `progress()` draws a live bar on a terminal and otherwise writes a
plain line now and then, so a long command in CI shows it is alive.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any

#: Off a terminal: wide enough that no table or line of ours is ever folded.
PIPE_WIDTH = 100_000
#: Off a terminal: seconds between plain progress lines.
PLAIN_EVERY_S = 10.0


def _stream(stderr: bool) -> Any:
    return sys.stderr if stderr else sys.stdout


def is_tty(stderr: bool = False) -> bool:
    """Whether the command's stdout (or stderr) is a terminal."""
    stream = _stream(stderr)
    return bool(getattr(stream, "isatty", None) and stream.isatty())


def console(stderr: bool = False) -> Any:
    """A rich Console for stdout (or stderr) that never breaks a line of ours."""
    from rich.console import Console

    if is_tty(stderr):
        return Console(stderr=stderr, soft_wrap=True)
    return Console(stderr=stderr, soft_wrap=True, width=PIPE_WIDTH, no_color=True, highlight=False,
                   force_terminal=False, force_interactive=False)


def cid_column(table: Any, header: str) -> None:
    """Add a table column for CIDs, hashes or addresses: never folded or cut, even on a
    narrow terminal (the row grows past the edge instead)."""
    table.add_column(header, no_wrap=True, overflow="ignore", min_width=len(header))


class Ticker:
    """Progress of a long command towards `total` units, on stderr: a live bar on a
    terminal; otherwise the line ``<label> <done>/<total> <text>`` at most every
    `every_s` seconds, and once at the end. `note()` prints a permanent line either way."""

    def __init__(self, label: str, total: float, *, every_s: float = PLAIN_EVERY_S, unit: str = "") -> None:
        self.label, self.total, self.every_s, self.unit = label, total, every_s, unit
        self.console = console(stderr=True)
        self.done, self.text = 0.0, ""
        self._last = 0.0
        self._printed: tuple[float, str] | None = None
        self._bar: Any = None
        self._task: Any = None
        if is_tty(stderr=True):
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[text]}"), TimeElapsedColumn(), console=self.console)
            self._task = self._bar.add_task(label, total=total, text="")

    def __enter__(self) -> Ticker:
        if self._bar is not None:
            self._bar.start()
        self._last = time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif kind is None:
            self._plain()

    def update(self, done: float, text: str = "") -> None:
        """Progress is now `done` of `total`; `text` says the rest (loss, rate, time left)."""
        self.done, self.text = done, text
        if self._bar is not None:
            self._bar.update(self._task, completed=done, text=text)
        elif time.monotonic() - self._last >= self.every_s:
            self._plain()

    def note(self, line: str) -> None:
        """A line that stays (above the bar on a terminal)."""
        self.console.print(line, markup=False, highlight=False)

    def _plain(self) -> None:
        self._last = time.monotonic()
        if self._printed == (self.done, self.text):
            return
        self._printed = (self.done, self.text)
        done = f"{self.done:g}/{self.total:g}{self.unit}"
        self.console.print(f"{self.label} {done} {self.text}".rstrip(), markup=False, highlight=False)


def megabytes(n: float) -> str:
    """Bytes as megabytes (decimal, as link speeds are quoted): 1234567 -> '1.23 MB'."""
    return f"{n / 1e6:.2f} MB"


def human_seconds(s: float) -> str:
    """75 -> '1:15', 3700 -> '1:01:40'."""
    s = max(0, int(round(s)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
