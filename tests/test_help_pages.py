"""Every `dlx ... --help` page as a user reads it in an 80-column terminal: each word of
the command's help and of each parameter's help reaches the page whole (no markup eaten,
as `[data]` once was; no word broken across lines; no help cut off with "..."); no line
is wider than the terminal; no literal markup, backspace or `<bool>` artefacts; and
placeholders are written one way (upper case, brackets only where optional). Issue 37,
item 7."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from workers.cli import command

WIDTH = 80
DLX = str(Path(sys.executable).parent / "dlx")


def _pages() -> list[tuple[str, str, object]]:
    """(command path, rendered page, click command) for the whole tree."""
    out = []

    def walk(cmd, parent, path):
        ctx = typer.Context(cmd, info_name=path[-1], parent=parent)
        out.append((" ".join(path), cmd.get_help(ctx), cmd))
        for name in sorted(getattr(cmd, "commands", {})):
            walk(cmd.commands[name], ctx, [*path, name])

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)  # what click asks the terminal, as `dlx` would
    try:
        walk(command(), None, ["dlx"])
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return out


PAGES = _pages()


def _words(text: str) -> list[str]:
    return " ".join(text.partition("\f")[0].split()).split(" ") if text.strip() else []


def _missing(words: list[str], shown: set[str]) -> list[str]:
    """The words not on the page; one wrapped at its own hyphen ("co-" / "signed,") is there."""
    def whole(w: str) -> bool:
        if w in shown:
            return True
        parts = w.split("-")
        return len(parts) > 1 and all(f"{p}-" in shown or p in shown for p in parts)
    return [w for w in words if not whole(w)]


@pytest.mark.parametrize(("path", "page", "cmd"), PAGES, ids=[p for p, _, _ in PAGES])
def test_a_help_page_keeps_every_word_and_fits_the_terminal(path, page, cmd):
    shown = set(page.split())
    texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
    for text in texts:
        lost = _missing(_words(text), shown)
        assert not lost, f"{path}: words of its help missing from the page (markup eaten or broken): {lost}"
    for name, sub in getattr(cmd, "commands", {}).items():  # a group's list: each line whole
        lost = _missing(_words(sub.short_help or ""), shown)
        assert not lost, f"{path}: {name}'s line in the command list lost {lost}"
    wide = [line for line in page.splitlines() if len(line) > WIDTH]
    assert not wide, f"{path}: lines wider than {WIDTH}: {wide}"
    for artefact in ("[bold", "[/", "\b", "\\b", "<bool>", "[dim", "\x1b"):
        assert artefact not in page, f"{path}: {artefact!r} on the page"
    usage = page.splitlines()[0]
    assert "{" not in usage and not re.search(r"\[[a-z_]+\]", usage), f"{path}: placeholders not in upper case: {usage}"
    assert not re.search(r"--[a-z-]+ <", page), f"{path}: an option's placeholder in typer's <type> style"
    body = page.split("\n", 1)[1]  # the usage line's `ARGS...` means "one or more"
    assert not re.search(r"\w\.\.\.$", body, re.M), f"{path}: a line cut off with ..."


def test_the_installed_dlx_prints_the_same_pages():
    for path in ("dlx", "dlx data prepare", "dlx lineage diff"):
        res = subprocess.run([DLX, *path.split()[1:], "--help"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "COLUMNS": str(WIDTH)})
        assert res.returncode == 0, res.stderr
        assert res.stdout.rstrip("\n") == next(page for p, page, _ in PAGES if p == path)
    prepare = next(page for p, page, _ in PAGES if p == "dlx data prepare")
    assert "Job file (TOML) whose [data] to prepare." in prepare
    assert "Usage: dlx data prepare [OPTIONS] JOB_FILE" in prepare
