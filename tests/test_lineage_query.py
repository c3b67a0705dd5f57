"""`dlx lineage` without a run directory (a run id on any ledger, or a checkpoint CID and
its ancestors) agrees with `--run-dir`, and `dlx lineage diff` reports what the
checkpoints' own bytes say, on the session's trained run."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from test_node_cli import one_line_error, run_dlx

from lineage.store.ipfs import open_store
from lineage.store.manifest import get_manifest
from lineage.store.unixfs import read_bytes
from trainer.artifacts import bytes_to_tensors


def lineage(env: dict[str, str], *args: str) -> dict[str, Any]:
    res = run_dlx(env, "lineage", *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.slow  # not in --quick: reads the session's trained run
def test_run_id_and_checkpoint_cid_give_the_steps_of_the_run_dir(served):
    run_dir, record, url = served
    by_dir = lineage({}, "--run-dir", str(run_dir))
    assert [s["step"] for s in by_dir["steps"]] == [1, 2, 3]
    assert all(s["status"] == "pending" for s in by_dir["steps"])  # inside the challenge window
    chain = {"DLX_RPC": url, "DLX_LEDGER": record.ledger}
    store = ["--store", str(record.blocks_dir(run_dir))]

    by_id = lineage(chain, "1", *store)
    assert by_id["steps"] == by_dir["steps"]
    for key in ("run", "name", "chain_id", "ledger", "registry", "genesis", "config_cid", "config", "stakes", "head"):
        assert by_id[key] == by_dir[key], key
    assert by_id["head"] == record.head and by_id["target"] is None

    by_head = lineage(chain, record.head, *store)
    assert by_head["steps"] == by_dir["steps"] and by_head["target"] == record.head
    middle = by_dir["steps"][1]["checkpoint"]
    assert lineage(chain, middle, *store)["steps"] == by_dir["steps"][:2]
    assert lineage(chain, record.genesis, *store)["steps"] == []

    # Everything from the environment, and the registry found through the ledger.
    env = {**chain, "DLX_STORE": str(record.blocks_dir(run_dir))}
    assert lineage(env, "1")["steps"] == by_dir["steps"]
    assert lineage({"DLX_RPC": url, "DLX_REGISTRY": record.registry, "DLX_STORE": env["DLX_STORE"]},
                   record.head)["steps"] == by_dir["steps"]

    # The table names each step's status; the HTML draws one box per step.
    res = run_dlx(env, "lineage", record.head, "--html", str(run_dir.parent / "served.html"), real=True)
    assert res.returncode == 0, res.stderr
    assert "pending" in res.stdout and f"checkpoint {record.head}" in res.stdout.replace("\n", "")
    page = (run_dir.parent / "served.html").read_text()
    assert page.count('class="ckpt pending"') == 3 and "The ancestors of checkpoint" in page


@pytest.mark.slow  # not in --quick: reads the session's trained run
def test_lineage_errors_are_one_line(served, tmp_path):
    run_dir, record, url = served
    env = {"DLX_RPC": url, "DLX_LEDGER": record.ledger, "DLX_STORE": str(record.blocks_dir(run_dir))}
    assert "dlx lineage needs a run: a run directory" in one_line_error(run_dlx({}, "lineage", real=True))
    assert "LedgerUnknownRun(runId=9)" in one_line_error(run_dlx(env, "lineage", "9"))
    assert "'bafy-not-a-cid' names no run" in one_line_error(run_dlx(env, "lineage", "bafy-not-a-cid"))
    assert "block not found" in one_line_error(run_dlx({**env, "DLX_STORE": str(tmp_path)}, "lineage", record.head))
    no_store = {k: v for k, v in env.items() if k != "DLX_STORE"}
    assert "no blockstore" in one_line_error(run_dlx(no_store, "lineage", "1"))
    assert "cannot reach the chain" in one_line_error(
        run_dlx({**env, "DLX_RPC": "http://127.0.0.1:9"}, "lineage", "1"))


@pytest.mark.slow  # not in --quick: reads the session's trained run
def test_diff_between_step_1_and_step_3(served):
    run_dir, record, _ = served
    steps = lineage({}, "--run-dir", str(run_dir))["steps"]
    a, b = steps[0]["checkpoint"], steps[2]["checkpoint"]
    res = run_dlx({}, "lineage", "diff", a, b, "--run-dir", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["step_a"], doc["step_b"]) == (1, 3)
    assert doc["relation"] == "B descends from A, 2 steps later"

    # Every tensor of every stage, against norms computed here from the shards' bytes.
    store = open_store(record.blocks_dir(run_dir))
    ma, mb = get_manifest(store, a), get_manifest(store, b)
    rows = {(t["stage"], t["name"]): t for t in doc["tensors"]}
    expected_keys = set()
    param_sq = 0.0
    for stage in range(len(ma.stages)):
        ta = bytes_to_tensors(read_bytes(store, ma.stages[stage]))
        tb = bytes_to_tensors(read_bytes(store, mb.stages[stage]))
        assert ta.keys() == tb.keys()
        for name in ta:
            expected_keys.add((stage, name))
            d = tb[name].double() - ta[name].double()
            row = rows[(stage, name)]
            assert row["shape"] == list(ta[name].shape)
            assert math.isclose(row["l2"], d.norm().item(), rel_tol=1e-9)
            assert math.isclose(row["rel"], d.norm().item() / ta[name].double().norm().item(), rel_tol=1e-9)
            assert math.isclose(row["max_abs"], d.abs().max().item(), rel_tol=1e-9)
            assert row["status"] == "changed"
            if name.startswith("param/"):
                param_sq += d.norm().item() ** 2
    assert set(rows) == expected_keys and any(k[1].startswith("momentum/") for k in rows)
    assert math.isclose(doc["param_l2"], math.sqrt(param_sq), rel_tol=1e-9)

    metrics = {m["name"]: m for m in doc["metrics"]}
    for name in ("eval_loss", "train_loss", "tokens"):
        assert metrics[name]["a"] == ma.metrics[name] and metrics[name]["b"] == mb.metrics[name]
        assert metrics[name]["delta"] == pytest.approx(mb.metrics[name] - ma.metrics[name])
    assert metrics["tokens"]["delta"] > 0 and metrics["eval_loss"]["delta"] < 0

    # The same checkpoint twice: nothing changed; the other way round: A descends from B.
    same = json.loads(run_dlx({}, "lineage", "diff", a, a, "--run-dir", str(run_dir), "--json").stdout)
    assert same["relation"] == "same" and same["param_l2"] == 0
    assert all(t["l2"] == 0 and t["status"] == "same" for t in same["tensors"])
    back = json.loads(run_dlx({}, "lineage", "diff", b, a, "--run-dir", str(run_dir), "--json").stdout)
    assert back["relation"] == "A descends from B, 2 steps later"

    table = run_dlx({}, "lineage", "diff", a, b, "--store", str(record.blocks_dir(run_dir)), real=True)
    assert table.returncode == 0, table.stderr
    assert "eval_loss" in table.stdout and "param/wte.weight" in table.stdout.replace("\n", "")
    assert "'nope' names no run" in one_line_error(run_dlx({}, "lineage", "diff", a, "nope", "--run-dir", str(run_dir)))

