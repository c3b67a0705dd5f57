"""One way to name a run, through the real `dlx`: every command that takes a run (verify,
lineage, lineage diff and compare, export, generate) takes it positionally as a run
directory, a stack job (JOB with --stack), a run id on a named chain, or a checkpoint CID
(resolved in workers/cli/common.py), `--run-dir` still works, every error says which forms
exist, and a stopped stack's run names `dlx up`. `dlx lineage diff` compares two runs, each
from its own blocks, with a summary before any table.

Runs: the session's trained run and one more small run of another seed (a few seconds).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import DLX, small_job_toml
from dlx_testing.here import dlx_here

from lineage.chain.runrecord import RunRecord
from lineage.store.ipfs import open_store
from lineage.store.manifest import get_manifest
from lineage.store.unixfs import read_bytes
from trainer.artifacts import bytes_to_tensors

pytestmark = pytest.mark.slow  # trains runs and drives dlx in subprocesses: not in --quick

FORMS = "a run directory (runs/NAME-...), a stack job (JOB, in .dlx or --stack DIR), a run id on a chain"


def dlx(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`dlx ARGS` without the user's DLX_ settings: `train` as a process of its own, the
    commands that name runs in this one (tests/dlx_testing/here.py: what they resolve and
    report is the point here, not process start-up, which test_cli.py covers)."""
    if args[0] == "train":
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DLX_") or k == "DLX_CACHE"}
        return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                              env={**clean, **(env or {})})
    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DLX_") and k != "DLX_CACHE"}
    with contextlib.chdir(cwd or Path.cwd()):
        return dlx_here(*args, env={**unset, **(env or {})})


def ok(*args: str, cwd: Path | None = None) -> str:
    res = dlx(*args, cwd=cwd)
    assert res.returncode == 0, (args, res.stderr[-2000:])
    return res.stdout


def error(*args: str, cwd: Path | None = None) -> str:
    """The one line of a user error (exit 2, no traceback)."""
    res = dlx(*args, cwd=cwd)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, (args, res.stderr)
    assert lines[0].startswith("dlx: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """A second run of the same shape, another seed, one outer step: its own chain and blocks."""
    root = tmp_path_factory.mktemp("other")
    (root / "job.toml").write_text(small_job_toml("other", seed=8, steps=1, inner_steps=2))
    ok("train", str(root / "job.toml"), "--run-dir", str(root / "run"))
    return root / "run"


@pytest.fixture()
def stopped_stack(trained_run, tmp_path) -> tuple[Path, str]:
    """A stack directory after `dlx down` holding the trained run as job JOB: its run.json
    names the stack, whose stack.json is gone, and a chain URL nothing listens on."""
    job = "0123abcd4567"
    run_dir = Path(shutil.copytree(trained_run[0], tmp_path / ".dlx" / "runs" / job))
    (tmp_path / ".dlx" / "chain").mkdir()
    doc = json.loads((run_dir / "run.json").read_text())
    doc.update(rpc="http://127.0.0.1:9", chain_state=None, stack=str((tmp_path / ".dlx").resolve()))
    (run_dir / "run.json").write_text(json.dumps(doc))
    return tmp_path / ".dlx", job


def test_a_run_directory_is_named_positionally_by_every_command(trained_run, tmp_path):
    run_dir = str(trained_run[0])
    head = RunRecord.load(trained_run[0]).head
    report = json.loads(ok("verify", run_dir, "--json"))
    assert report["ok"] and [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert json.loads(ok("lineage", run_dir, "--json")) == json.loads(ok("lineage", "--run-dir", run_dir, "--json"))
    ok("export", run_dir, "-o", str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "lineage.json").read_text())["checkpoint"] == head
    args = ("--prompt", "ab", "--max-new-tokens", "8", "--temperature", "0")
    assert ok("generate", run_dir, *args) == ok("generate", "--run-dir", run_dir, *args)
    assert "configuration: identical" in ok("lineage", "compare", run_dir, run_dir)
    assert "named twice" in error("verify", run_dir, "--run-dir", run_dir)


def test_a_run_id_on_a_named_chain_and_a_cid(served, tmp_path):
    run_dir, record, url = served
    chain = ("--rpc", url, "--ledger", record.ledger, "--store", str(record.blocks_dir(run_dir)))
    report = json.loads(ok("verify", "1", *chain, "--json"))
    assert report["ok"] and [s["step"] for s in report["steps"]] == [1, 2, 3]
    ok("export", "1", *chain, "--step", "2", "-o", str(tmp_path / "two"))
    middle = json.loads(ok("lineage", "--run-dir", str(run_dir), "--json"))["steps"][1]["checkpoint"]
    assert json.loads((tmp_path / "two" / "lineage.json").read_text())["checkpoint"] == middle
    ok("export", middle, "--store", str(record.blocks_dir(run_dir)), "-o", str(tmp_path / "cid"))
    assert (tmp_path / "cid" / "model.safetensors").read_bytes() == (tmp_path / "two" / "model.safetensors").read_bytes()
    line = error("verify", record.head, "--run-dir", str(run_dir))
    assert ("is one checkpoint: give a run directory (runs/NAME-...), a stack job (JOB, in .dlx or --stack DIR) "
            "or a run id on a chain") in line and f"`dlx lineage {record.head}`" in line
    assert "run 9 not found" in error("verify", "9", *chain)
    assert "no blockstore" in error("verify", "1", *chain[:4])


def test_errors_say_which_forms_name_a_run(trained_run, tmp_path):
    for cmd in (["verify"], ["lineage"], ["export", "-o", str(tmp_path / "x")], ["generate", "--prompt", "x"]):
        assert f"dlx {cmd[0]} needs a run: {FORMS}" in error(*cmd, cwd=tmp_path)
    assert error("verify", "runs/tiny-nope", cwd=tmp_path).endswith("no such run directory: runs/tiny-nope")
    line = error("lineage", "tiny-nope", cwd=tmp_path)
    assert "'tiny-nope' names no run" in line and FORMS in line and "checkpoint CID" in line
    (tmp_path / ".dlx" / "runs").mkdir(parents=True)
    assert "no job tiny-nope in .dlx/runs" in error("export", "tiny-nope", "-o", "x", cwd=tmp_path)
    assert ".dlx is a stack directory, not a run: name one of its jobs" in error("verify", ".dlx", cwd=tmp_path)
    assert "run ids start at 1" in error("verify", "0", cwd=tmp_path)
    assert not (tmp_path / "x").exists()


def test_a_stopped_stacks_run_is_a_stack_job_and_names_dlx_up(stopped_stack, trained_run, tmp_path):
    stack, job = stopped_stack
    up_here = "the stack in .dlx is down, and the run's chain (http://127.0.0.1:9) with it: `dlx up` brings both back"
    for args in (["verify", job], ["verify", "--run-dir", f".dlx/runs/{job}"], ["lineage", job],
                 ["lineage", job, "--stack", ".dlx"], ["lineage", "compare", job, job]):
        assert up_here in error(*args, cwd=tmp_path), args
    elsewhere = error("verify", job, "--stack", str(stack), cwd=stack / "runs")
    assert f"`dlx up --stack {stack.resolve()}` brings both back" in elsewhere
    # Reading blocks needs no chain: export takes the job and its head.
    ok("export", job, "--stack", str(stack), "-o", str(tmp_path / "hf"), cwd=stack / "runs")
    assert json.loads((tmp_path / "hf" / "lineage.json").read_text())["checkpoint"] == RunRecord.load(trained_run[0]).head


def _param_norms(run_dir: Path, cid: str) -> dict[tuple[int, str], np.ndarray]:
    store = open_store(RunRecord.load(run_dir).blocks_dir(run_dir))
    out = {}
    for stage, shard in enumerate(get_manifest(store, cid).stages):
        for name, t in bytes_to_tensors(read_bytes(store, shard)).items():
            if name.startswith("param/"):
                out[(stage, name)] = t.double().numpy()
    return out


def test_lineage_diff_compares_two_runs_each_from_its_own_blocks(trained_run, other_run):
    run_a, run_b = trained_run[0], other_run
    head_a, head_b = RunRecord.load(run_a).head, RunRecord.load(run_b).head
    doc = json.loads(ok("lineage", "diff", str(run_a), str(run_b), "--json"))
    assert (doc["a"], doc["b"], doc["step_a"], doc["step_b"]) == (head_a, head_b, 3, 1)
    assert doc["relation"] == "neither descends from the other"
    assert doc["from"] == {"a": str(run_a), "b": str(run_b)}

    # The summary, against norms computed here from the two runs' own shards.
    a, b = _param_norms(run_a, head_a), _param_norms(run_b, head_b)
    assert a.keys() == b.keys()
    summary = doc["summary"]
    for st in summary["stages"]:
        keys = [k for k in a if k[0] == st["stage"]]
        l2 = math.sqrt(sum(np.sum((b[k] - a[k]) ** 2) for k in keys))
        norm = math.sqrt(sum(np.sum(a[k] ** 2) for k in keys))
        assert math.isclose(st["l2"], l2, rel_tol=1e-9) and math.isclose(st["rel"], l2 / norm, rel_tol=1e-9)
    assert [st["stage"] for st in summary["stages"]] == [0, 1]
    total = math.sqrt(sum(np.sum((b[k] - a[k]) ** 2) for k in a)) / math.sqrt(sum(np.sum(a[k] ** 2) for k in a))
    assert math.isclose(summary["param_rel"], total, rel_tol=1e-9) and summary["param_rel"] > 0
    rels = {k: np.linalg.norm(b[k] - a[k]) / np.linalg.norm(a[k]) for k in a}
    expected = sorted(rels, key=lambda k: -rels[k])[:10]
    assert [(t["stage"], t["name"]) for t in summary["top"]] == expected

    # Two CIDs, each with its own store: the same diff; one store for both cannot find B.
    store_a, store_b = (str(RunRecord.load(d).blocks_dir(d)) for d in (run_a, run_b))
    by_cid = json.loads(ok("lineage", "diff", head_a, head_b, "--store", store_a, "--store", store_b, "--json"))
    assert by_cid["tensors"] == doc["tensors"] and by_cid["summary"] == doc["summary"]
    by_dirs = json.loads(ok("lineage", "diff", head_a, head_b, "--run-dir", str(run_a), "--run-dir", str(run_b), "--json"))
    assert by_dirs["tensors"] == doc["tensors"]
    assert "block not found" in error("lineage", "diff", head_a, head_b, "--store", store_a)
    assert "given 3 times" in error("lineage", "diff", head_a, head_b, *["--store", store_a] * 3)

    # The text: the summary first, then the tables.
    text = ok("lineage", "diff", str(run_a), str(run_b), "--top", "3")
    lines = text.splitlines()
    assert lines[0].startswith(f"A  step 3  {head_a}") and lines[1].startswith(f"B  step 1  {head_b}")
    at = lines.index("top 3 tensors by relative change:")
    assert lines[3].startswith("parameters: ||B - A|| = ")
    assert [ln.split()[0] for ln in lines[4:at]] == ["stage", "stage"]
    assert all(expected[i][1] in lines[at + 1 + i] for i in range(3))
    assert lines[at + 4].strip() == "every tensor (B - A)"
