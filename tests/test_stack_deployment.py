"""`dlx up --rpc URL --deployment FILE` (issue 33, item 6): a job-queue stack on a chain of
the user's (here an anvil of this module's own that mines a block every 0.2 s) with the
contracts `dlx deploy` put there once. No anvil or keeper is started; each worker's node
key comes from DLX_WORKER_KEYS, registers and stakes itself; a job naming the same
deployment file is accepted, commits every step on the deployment's ledger after its
confirmations, and its run still audits after `dlx down` (its chain does not stop with the
stack). Half a chain (`--rpc` alone), missing keys and a deployment of another chain are
refused in one line, with nothing started or written."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DLX, small_job_toml
from test_chain_faults import _anvil

from lineage.chain.anvil import dev_accounts
from lineage.chain.client import Chain
from lineage.chain.deploy import Deployment
from lineage.chain.ledger import Ledger

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without any key or endpoint of the user's, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("DLX_") and ("KEY" in k or k in ("DLX_RPC", "DLX_LEDGER", "DLX_REGISTRY")))}
    return {**env, **extra}


def dlx(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout, env=env or _env())


@pytest.fixture(scope="module")
def users_chain(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """(URL, deployment file): an anvil mining a block every 0.2 s (interval mining, as a
    public chain, five times as fast), deployed on once."""
    with _anvil("--block-time", "0.2") as (_, url):
        out = tmp_path_factory.mktemp("deployment") / "deployment.json"
        res = dlx("deploy", "--rpc", url, "--out", str(out), env=_env(DLX_SUBMITTER_KEY=dev_accounts(10)[9].key.hex()))
        assert res.returncode == 0, res.stderr
        yield url, out


def _keys(n: int) -> list:
    return dev_accounts(9)[5:5 + n]  # funded by anvil; neither the deployer nor anvil's first account


def test_a_stack_on_the_users_chain_runs_a_job_on_the_deployment(users_chain, tmp_path):
    url, dep_file = users_chain
    dep = Deployment.load(dep_file)
    keys = _keys(2)
    env = _env(DLX_WORKER_KEYS=",".join(k.key.hex() for k in keys))
    stack = tmp_path / ".dlx"
    res = dlx("up", "--rpc", url, "--deployment", str(dep_file), "--workers", "2", "--slots", "1",
              "--stack", str(stack), env=env)
    assert res.returncode == 0, res.stderr
    assert "development keys" not in res.stderr and dep.ledger in res.stdout
    info = json.loads((stack / "stack.json").read_text())
    assert (info["anvil_pid"], info["keeper_pid"]) == (0, 0) and info["rpc"] == url
    assert (info["registry"], info["ledger"], info["deployment"]) == (dep.registry, dep.ledger, str(dep_file.resolve()))
    assert not (stack / "chain").exists()  # no anvil state of the stack's own
    try:
        job = tmp_path / "onchain.toml"
        job.write_text(small_job_toml("onchain", steps=2, replicas=2, stages=1)
                       + f'\n[chain]\ndeployment = "{dep_file}"\n')
        res = dlx("submit", str(job), "--stack", str(stack), env=env)
        assert res.returncode == 0, res.stderr
        job_id = res.stdout.strip()
        rec = _wait_done(stack, job_id)
        assert rec["state"] == "completed", rec.get("error")
        ledger = Ledger(Chain(url), dep.registry, dep.ledger)
        run_id = int(rec["run_id"])
        assert [c.record.step for c in ledger.commits(run_id)] == [1, 2]  # on the deployment's ledger
        assert all(ledger.registry.stake_of(k.address) >= 10**18 for k in keys)  # each staked itself
        secrets = [k.key.hex().removeprefix("0x") for k in keys]
        logged = "".join(p.read_text(errors="replace") for p in stack.rglob("*.log"))
        assert not any(s in logged or s in (stack / "stack.json").read_text() for s in secrets)
    finally:
        down = dlx("down", "--stack", str(stack), env=env)
        assert down.returncode == 0, down.stderr
    res = dlx("verify", "--run-dir", rec["run_dir"], "--json", env=_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr  # the user's chain stays up: the run audits


def _wait_done(stack: Path, job_id: str, timeout: float = 600) -> dict:
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    store = JobStore(connect(Stack.load(stack).redis_url))
    deadline = time.monotonic() + timeout
    while (rec := store.get(job_id))["state"] not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, {k: v for k, v in rec.items() if not k.startswith("step_")}
        time.sleep(0.5)
    return rec


def test_up_refuses_half_a_chain_missing_keys_and_another_chains_deployment(users_chain, tmp_path):
    url, dep_file = users_chain
    stack = tmp_path / ".dlx"
    keys = _env(DLX_WORKER_KEYS=",".join(k.key.hex() for k in _keys(2)))
    other = tmp_path / "other-chain.json"
    other.write_text(json.dumps({**json.loads(dep_file.read_text()), "chain_id": 11155111}))
    cases = [
        (("--rpc", url), keys, "--rpc and --deployment go together"),
        (("--deployment", str(dep_file)), keys, "--rpc and --deployment go together"),
        (("--rpc", url, "--deployment", str(dep_file)), _env(), "DLX_WORKER_KEYS holds 0 private key(s)"),
        (("--rpc", url, "--deployment", str(dep_file)), _env(DLX_WORKER_KEYS="0x1234," + _keys(1)[0].key.hex()),
         "key 1 is not a valid private key"),
        (("--rpc", url, "--deployment", str(other)), keys, "chain id 11155111, endpoint is 31337"),
    ]
    for args, env, message in cases:
        res = dlx("up", *args, "--workers", "2", "--stack", str(stack), env=env)
        assert res.returncode == 2, (args, res.returncode, res.stderr)
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not stack.exists(), args  # nothing started, nothing written
