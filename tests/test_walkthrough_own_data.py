"""docs/walkthrough-own-data.md, run as written: every `file=` block is written to its path
and every `sh` block runs in order (with `dlx` the venv's and /tmp/own-data a fresh
directory). It shows issue 34's first point: a job with paths relative to the job file and
one with absolute paths train and verify from another working directory, and the same
corpus at two places gives the same dataset CID."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "walkthrough-own-data.md"
PLACE = "/tmp/own-data"
BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.M | re.S)


def blocks(text: str) -> list[tuple[str, str | None, str]]:
    """(language, the `file=` path or None, body) of every fenced block, in order."""
    out = []
    for lang, info, body in BLOCK.findall(text):
        m = re.search(r"file=(\S+)", info)
        out.append((lang, m.group(1) if m else None, body))
    return out


def _dataset_cid(job: Path, root: Path, env: dict[str, str]) -> str:
    res = subprocess.run([str(Path(sys.executable).parent / "dlx"), "data", "prepare", str(job), "--json"],
                         capture_output=True, text=True, env=env, cwd="/", timeout=300)
    assert res.returncode == 0, res.stderr
    return str(json.loads(res.stdout)["dataset"])


@pytest.mark.slow
def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    root = tmp_path / "own-data"
    root.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "DLX_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    found = blocks(DOC.read_text())
    assert sum(1 for lang, _, _ in found if lang == "sh") >= 4 and sum(1 for _, f, _ in found if f) == 3
    for lang, file, body in found:
        body = body.replace(PLACE, str(root))
        if file is not None:
            target = Path(file.replace(PLACE, str(root)))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
        elif lang == "sh":
            res = subprocess.run(["bash", "-e", "-c", body], capture_output=True, text=True, env=env,
                                 cwd=tmp_path, timeout=900)
            assert res.returncode == 0, f"{body}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    # the runs trained and verified (the sh blocks ran train and verify with -e); the two
    # jobs name the corpus at two places, by relative and by absolute globs: one dataset CID
    relative, absolute = root / "own.toml", root / "jobs" / "own-abs.toml"
    assert "/" not in relative.read_text().split("paths = ")[1].split('"')[1][:1]
    assert _dataset_cid(relative, root, env) == _dataset_cid(absolute, root, env)
    for run in ("own", "abs"):
        assert (root / "runs" / run / "run.json").is_file()
