"""The sample outputs quoted in docs/queue-ux.md are what the commands print (issue 37,
item 8): every ```text block there follows a `<!-- sample: NAME -->` marker, and the test
that runs the command on a real stack (tests/test_queue_ux.py) checks the block against
the real output with `check_sample`: each quoted line, its times, ids, paths, CIDs and
numbers aside, is a line of the output, in order; all of them unless the marker says
`(abridged)`, where `...` stands for lines left out."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "queue-ux.md"
BLOCK = re.compile(r"(?:<!-- sample: (?P<name>[^>]*?)(?P<abridged> \(abridged\))? -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```",
                   re.S)
VOLATILE = [(re.compile(r"\b\d\d:\d\d:\d\d\b"), "<time>"), (re.compile(r"\bbafy\w+"), "<cid>"),
            (re.compile(r"\b0x[0-9a-fA-F]+\b"), "<hex>"), (re.compile(r"\b[0-9a-f]{12}\b"), "<id>"),
            (re.compile(r"(?<![\w.])/[\w./-]+"), "<path>"), (re.compile(r"\d[\d,]*(\.\d+)?(e[-+]?\d+)?"), "<n>")]


def samples() -> dict[str, tuple[bool, list[str]]]:
    """name -> (abridged, the block's lines but its `$ command` lines)."""
    out = {}
    for m in BLOCK.finditer(DOC.read_text()):
        if m["name"]:
            out[m["name"]] = (bool(m["abridged"]), [x for x in m["body"].splitlines() if not x.startswith("$ ")])
    return out


def normal(line: str) -> str:
    for pattern, token in VOLATILE:
        line = pattern.sub(token, line)
    return " ".join(line.split())


def check_sample(name: str, output: str) -> None:
    """Docs/queue-ux.md's sample `name` against a real `output` of its command."""
    abridged, quoted = samples()[name]
    real = [normal(x) for x in output.splitlines() if x.strip()]
    want = [normal(x) for x in quoted if x.strip() and x.strip() != "..."]
    assert abridged or len(want) == len(real), f"sample {name!r}: {len(want)} lines quoted, {len(real)} printed " \
                                               "(mark it `(abridged)` if lines are left out)"
    at = 0
    for line in want:
        assert line in real[at:], f"sample {name!r}: {line!r} is not (in order) in the real output:\n" + "\n".join(real)
        at = real.index(line, at) + 1


def test_every_output_block_of_the_page_is_a_checked_sample():
    blocks = list(BLOCK.finditer(DOC.read_text()))
    assert blocks
    for m in blocks:
        if m["lang"] in ("sh", "bash", "toml"):  # commands to type and files to write, not outputs
            continue
        assert m["name"], f"an output block of {DOC.name} without a `<!-- sample: NAME -->` marker:\n{m['body']}"
    names = set(samples())
    checked = set(re.findall(r'check_sample\("([^"]+)"', (Path(__file__).parent / "test_queue_ux.py").read_text()))
    assert names == checked, f"samples no test checks: {names - checked}; checked but not on the page: {checked - names}"
