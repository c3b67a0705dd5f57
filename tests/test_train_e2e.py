"""End to end: `dlx train` runs real multi-process pipeline-parallel DiLoCo, stores every
checkpoint in the blockstore, commits every outer step on a real anvil, and
`dlx lineage --json` reads the chain back, consistent with the stored blocks (its JSON
read in this process, tests/dlx_testing/here.py; its table from the installed `dlx`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import dag_cbor
import pytest
from dlx_testing.here import dlx_here

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import parse_cid

DLX = str(Path(sys.executable).parent / "dlx")

@pytest.mark.slow
def test_train_then_lineage_gives_a_verified_checkpoint_chain(trained_run):
    run_dir, res = trained_run
    assert "development keys" in res.stderr  # the warning about anvil's public keys
    record = RunRecord.load(run_dir)
    assert record.status == "completed" and record.steps == 3
    assert (run_dir / "chain" / "state.json").exists()
    assert f"head     {record.head}" in res.stdout

    res = dlx_here("lineage", "--run-dir", run_dir, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["run"] == record.run_id
    steps = out["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    store = Blockstore(run_dir / "blocks")
    parent = record.genesis
    for s in steps:
        assert s["parent"] == parent
        cid = parse_cid(s["checkpoint"])
        block = store.get(cid)
        assert hashlib.sha256(block).digest() == bytes(cid.raw_digest)
        node = dag_cbor.decode(block)
        assert node["step"] == s["step"] and str(parse_cid(node["parent"])) == parent
        assert s["loss"] == node["metrics"]["eval_loss"]
        assert len(s["nodes"]) == 4 and len(set(s["nodes"])) == 4
        assert s["tx"].startswith("0x")
        for row in node["contributions"]:
            for c in row:
                store.get(c)
        parent = s["checkpoint"]
    assert steps[-1]["checkpoint"] == record.head

    # the human-readable table names every step too
    env = {**os.environ, "COLUMNS": "400"}
    res = subprocess.run([DLX, "lineage", "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0
    assert record.head in res.stdout


@pytest.mark.slow
def test_lineage_html_report_is_one_self_contained_file(trained_run, tmp_path):
    run_dir, _ = trained_run
    out = tmp_path / "report.html"
    res = dlx_here("lineage", "--run-dir", run_dir, "--html", out, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "<script" not in page and "http://" not in page.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    assert 'aria-label="checkpoint chain"' in page and 'aria-label="loss curve"' in page
    for s in doc["steps"]:
        assert s["checkpoint"] in page and f"title='{s['tx']}'" in page
        assert [c["node"] for c in s["contributions"]] == s["nodes"]
        assert s["metrics"]["eval_loss"] == s["loss"]
    assert doc["config"]["job"]["name"] == "e2e"
    assert all(int(v) >= 10**18 for v in doc["stakes"].values())


@pytest.mark.slow
def test_the_same_job_and_seed_give_the_same_checkpoint_cids(trained_run, tmp_path):
    run_dir, _ = trained_run
    job = run_dir / "job.toml"  # the run directory keeps the job file it ran
    again = tmp_path / "again"
    res = subprocess.run([DLX, "train", str(job), "--run-dir", str(again)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = RunRecord.load(run_dir), RunRecord.load(again)
    assert (first.genesis, first.head) == (second.genesis, second.head)
    assert (again / "timings.jsonl").read_text().count("\n") == 3  # wall times live here
