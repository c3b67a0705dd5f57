"""What `dlx` prints when stdout and stderr are pipes (CI logs, `| grep`, `| tee`): no line
broken inside a CID, a hash or an address, however long the paths around them, no colour
codes, progress as plain lines, and `dlx status --follow` one line per committed step.

A broken line is caught by its fragments: every CID (CIDv1, sha2-256, base32: 59
characters) and every 0x-hash or address printed must appear whole, and be one the run
really holds.

    .venv/bin/pytest -q tests/test_output_pipe.py
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

DLX = str(Path(sys.executable).parent / "dlx")
CID = re.compile(r"(?<![0-9A-Za-z])baf[a-z2-7]+")  # not the letters "baf" inside a hex hash
HEX = re.compile(r"0x[0-9a-fA-F]+")
LONG = "a-run-directory-with-a-name-long-enough-to-push-every-line-past-any-terminal-width"


def dlx(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout)


def known_ids(run_dir: Path) -> set[str]:
    """Every CID, transaction hash and address the run's lineage names."""
    res = dlx("lineage", "--run-dir", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    ids = {doc["genesis"], doc["config_cid"], doc["head"], doc["ledger"], doc["registry"], *doc["stakes"]}
    for s in doc["steps"]:
        ids |= {s["checkpoint"], s["parent"], s["tx"], *s["nodes"]}
        ids |= {c["cid"] for c in s["contributions"] if c["cid"]}
    return ids


def assert_unbroken(text: str, known: set[str]) -> int:
    """Every CID and 0x-value in `text` is whole and one of `known`; returns how many."""
    assert "\x1b[" not in text, "colour codes in piped output"
    cids, hexes = CID.findall(text), HEX.findall(text)
    for cid in cids:
        assert len(cid) == 59 and cid in known, f"broken or unknown CID {cid!r} in:\n{text}"
    for value in hexes:
        assert len(value) in (42, 66) and (value in known or len(value) == 66), f"broken {value!r} in:\n{text}"
    return len(cids)


@pytest.fixture(scope="module")
def long_run(trained_run, tmp_path_factory):
    """The shared trained run, copied under a long directory name."""
    run_dir = tmp_path_factory.mktemp("pipe") / LONG / LONG
    shutil.copytree(trained_run[0], run_dir)
    return run_dir, known_ids(run_dir)


def test_ticker_off_a_terminal_prints_a_plain_line_now_and_then_while_a_call_blocks(capsys):
    from workers.cli.console import Ticker

    with Ticker("work", 4, every_s=0.05) as ticker:
        ticker.update(1, "one done")
        time.sleep(0.4)  # a long call that reports nothing
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 3 and all(line.startswith("work 1/4 one done (0:0") for line in lines), lines


@pytest.mark.slow
def test_train_prints_whole_cids_and_plain_progress_lines(trained_run):
    run_dir, res = trained_run
    text = res.stdout + res.stderr
    known = known_ids(run_dir)
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(CID.search(line).group() in known for line in steps), text
    assert f"head     {json.loads((run_dir / 'run.json').read_text())['head']}" in res.stdout.splitlines()
    assert any(line.startswith("training e2e: ") and line.endswith(f"run directory {run_dir}")
               for line in res.stderr.splitlines()), res.stderr
    progress = [line for line in res.stderr.splitlines() if line.startswith("train ")]
    assert progress and progress[-1].startswith("train 12/12 outer 3/3 inner 4/4 loss "), res.stderr
    assert "tok/s" in progress[-1] and " left 0:00" in progress[-1]
    assert assert_unbroken(text, known) >= 4


@pytest.mark.slow
def test_lineage_verify_and_compare_through_a_pipe_keep_every_id_whole(long_run):
    run_dir, known = long_run
    table = dlx("lineage", "--run-dir", str(run_dir))
    assert table.returncode == 0, table.stderr
    assert assert_unbroken(table.stdout, known) == 6  # 3 checkpoints, 3 parents
    heads = [s for s in known if s in table.stdout and s.startswith("bafyrei")]
    assert known_head(run_dir) in heads
    page = run_dir / "report.html"
    report = dlx("lineage", "--run-dir", str(run_dir), "--html", str(page))
    assert report.returncode == 0 and f"report written to {page}" in report.stdout.splitlines(), report.stdout
    verify = dlx("verify", "--run-dir", str(run_dir))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.splitlines()[-1] == "all steps verified"
    assert_unbroken(verify.stdout + verify.stderr, known)
    compare = dlx("lineage", "compare", str(run_dir), str(run_dir))
    assert compare.returncode == 0, compare.stderr
    rows = [line for line in compare.stdout.splitlines() if str(run_dir) in line]
    assert len(rows) == 2 and all(line.rstrip(" │").endswith(known_head(run_dir)) for line in rows), compare.stdout
    assert "configuration: identical" in compare.stdout
    assert_unbroken(compare.stdout, known)


def known_head(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["head"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipe-stack") / ".dlx"
    res = dlx("up", "--workers", "1", "--slots", "1", "--stack", str(d))
    assert res.returncode == 0, res.stderr
    yield d
    res = dlx("down", "--stack", str(d))
    assert res.returncode == 0, res.stderr


@pytest.mark.slow
def test_status_follow_through_a_pipe_prints_one_line_per_outer_step(stack, tmp_path, small_job):
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    job_file = tmp_path / "follow.toml"
    job_file.write_text(small_job("follow", steps=3, inner_steps=40, replicas=1, stages=1))
    res = dlx("submit", str(job_file), "--stack", str(stack))
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip()
    store = JobStore(connect(Stack.load(stack).redis_url))
    follow = subprocess.Popen([DLX, "status", job, "--follow", "--stack", str(stack)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        first = follow.stdout.readline()
        state_then = store.get(job)["state"]  # the line came while the job still ran
        rest, err = follow.communicate(timeout=300)
    finally:
        if follow.poll() is None:
            follow.kill()
    assert follow.returncode == 0, err
    lines = [first.rstrip("\n"), *rest.splitlines()]
    assert first.startswith(f"job {job}: step 1/3 eval_loss ") and state_then == "running", (state_then, lines)
    assert [line.split()[3] for line in lines[:3]] == ["1/3", "2/3", "3/3"], lines
    status = json.loads(dlx("status", job, "--stack", str(stack), "--json").stdout)
    assert status["state"] == "completed" and lines[3] == f"job {job}: completed, run {status['run_id']}, head {status['head']}"
    known = known_ids(Path(status["run_dir"]))
    heads = [line.rsplit(" ", 1)[1] for line in lines[:3]]
    assert heads[-1] == status["head"] and len(set(heads)) == 3
    assert assert_unbroken("\n".join(lines), known) == 4
    assert all(key in status for key in ("lr", "tokens_per_s", "eta_s")) and status["tokens_per_s"] > 0
    # The coordinator keeps the queue run's metrics.jsonl in its run directory, as dlx train does.
    records = [json.loads(line) for line in (Path(status["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_step"] for r in records if r["kind"] == "inner"] == list(range(1, 3 * 40 + 1))
    assert [r["checkpoint"] for r in records if r["kind"] == "outer"] == heads
