"""The one way `dlx` commands print with rich, and show progress.

Rich wraps at the terminal's width, or at 80 columns when stdout is a pipe or a file,
which breaks CIDs and hashes for grep, copy-paste and CI logs. `console()` never wraps
plain lines (`soft_wrap`), and off a terminal renders tables at their natural width with
no colour codes. `progress()` draws a live bar on a terminal and otherwise writes a
plain line now and then, so a long command in CI shows it is alive.
"""

from __future__ import annotations

import sys
import threading
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


def count(n: int, noun: str) -> str:
    """`1 stage`, `2 stages`: a number with its noun (plural in -s) agreeing."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def cid_column(table: Any, header: str) -> None:
    """Add a table column for CIDs, hashes or addresses: never folded or cut, even on a
    narrow terminal (the row grows past the edge instead)."""
    table.add_column(header, no_wrap=True, overflow="ignore", min_width=len(header))


class Ticker:
    """Progress of a long command towards `total` units, on stderr: a live bar on a
    terminal; otherwise the line ``<label> <done>/<total> <text> (<elapsed>)`` every
    `every_s` seconds (from a background thread, so a long call that reports nothing still
    shows it is alive) and once at the end. `note()` prints a permanent line either way."""

    def __init__(self, label: str, total: float, *, every_s: float = PLAIN_EVERY_S) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.console = console(stderr=True)
        self.done, self.text = 0.0, ""
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._bar: Any = None
        self._task: Any = None
        if is_tty(stderr=True):
            from rich.progress import BarColumn, Progress, TextColumn
            from rich.table import Column

            # A short bar and no clock leave the terminal's width to the text (train's says the time left).
            # The label (a job id) is never cut; a narrow terminal cuts the text's tail instead.
            self._bar = Progress(TextColumn("[bold]{task.description}",
                                            table_column=Column(no_wrap=True, min_width=len(label))),
                                 BarColumn(bar_width=10),
                                 TextColumn("{task.fields[text]}", table_column=Column(no_wrap=True, ratio=1)),
                                 console=self.console)
            self._task = self._bar.add_task(label, total=total or None, text="")

    def __enter__(self) -> Ticker:
        self._started = time.monotonic()
        if self._bar is not None:
            self._bar.start()
        else:
            self._beat = threading.Thread(target=self._heartbeat, name=f"ticker-{self.label}", daemon=True)
            self._beat.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        if self._bar is not None:
            self._bar.stop()
        elif kind is None:
            self._plain()

    def update(self, done: float, text: str = "", total: float | None = None) -> None:
        """Progress is now `done` of `total`; `text` says the rest (loss, rate, time left)."""
        self.done, self.text = done, text
        if total is not None:
            self.total = total
        if self._bar is not None:
            self._bar.update(self._task, completed=done, text=text, total=self.total or None)

    def note(self, line: str) -> None:
        """A line that stays (above the bar on a terminal)."""
        self.console.print(line, markup=False, highlight=False)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.every_s):
            self._plain()

    def _plain(self) -> None:
        done = f"{self.done:g}/{self.total:g}" if self.total else ""
        elapsed = human_seconds(time.monotonic() - self._started)
        line = " ".join(part for part in (self.label, done, self.text, f"({elapsed})") if part)
        self.console.print(line, markup=False, highlight=False)


def megabytes(n: float) -> str:
    """Bytes as megabytes (decimal, as link speeds are quoted): 1234567 -> '1.23 MB'."""
    return f"{n / 1e6:.2f} MB"


def human_seconds(s: float) -> str:
    """75 -> '1:15', 3700 -> '1:01:40'."""
    s = max(0, int(round(s)))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"
