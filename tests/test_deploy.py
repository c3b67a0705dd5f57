"""`dlx deploy` and `[chain] deployment` (issue 33, item 6): the ledger contracts deployed
once, with the submitter's keystore, on an anvil that mines a block every 0.2 s; a deployment
file that a job names; `dlx train` using it instead of deploying, and refusing (exit 2, one
line) a file of another chain, one whose contracts are not there, and an overwrite."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import DLX, small_job_toml
from eth_account import Account
from test_chain_faults import _anvil

from lineage.chain.anvil import dev_accounts
from lineage.chain.client import Chain
from lineage.chain.deploy import Deployment
from lineage.chain.ledger import Ledger
from lineage.chain.runrecord import RunRecord
from lineage.errors import ChainError
from workers.run.jobfile import load_job_file

PASSWORD = "correct horse battery staple"


def _env(**extra: str) -> dict[str, str]:
    """The test's environment without any key of the user's, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith("DLX_") and "KEY" in k)}
    return {**env, **extra}


@pytest.fixture(scope="module")
def mining() -> Iterator[str]:
    """An anvil of this module's own that mines a block every 0.2 s (interval mining: every
    confirmation is waited for, as on a public chain, five times as fast); yields its URL."""
    with _anvil("--block-time", "0.2") as (_, url):
        yield url


@pytest.fixture(scope="module")
def deployer(tmp_path_factory) -> tuple[Any, Path]:
    """A development account and its keystore file (PBKDF2, cheap to decrypt in a test)."""
    acct = dev_accounts(10)[9]  # anvil funds its first 10 accounts; train uses the first 5
    keystore = tmp_path_factory.mktemp("keys") / "deployer.json"
    keystore.write_text(json.dumps(Account.encrypt(acct.key, PASSWORD, kdf="pbkdf2", iterations=2)))
    return acct, keystore


@pytest.fixture(scope="module")
def deployed(mining, deployer, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`dlx deploy` run once on the mining anvil; (the deployment file, the process)."""
    out = tmp_path_factory.mktemp("deploy") / "deployment.json"
    res = _deploy(mining, out, deployer[1])
    assert res.returncode == 0, res.stderr
    return out, res


def _deploy(url: str, out: Path, keystore: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, "deploy", "--rpc", url, "--out", str(out), *args], capture_output=True, text=True,
                          timeout=120, env=_env(DLX_SUBMITTER_KEYSTORE=str(keystore),
                                                DLX_SUBMITTER_KEYSTORE_PASSWORD=PASSWORD))


def test_deploy_writes_a_file_of_bound_contracts_after_its_confirmations(mining, deployer, deployed):
    out, res = deployed
    acct, _ = deployer
    dep = Deployment.load(out)
    assert set(json.loads(out.read_text())) == {"chain_id", "registry", "ledger", "block", "deployer"}
    assert dep.chain_id == 31337 and dep.deployer == acct.address and dep.block > 0
    chain = Chain(mining)
    ledger = Ledger(chain, dep.registry, dep.ledger)
    assert ledger.registry.contract.functions.ledger().call() == dep.ledger  # bound
    # bindLedger, the last transaction, had 2 blocks on top when the command returned
    assert chain.w3.eth.block_number >= dep.block + 2
    assert str(out) in res.stdout and dep.ledger in res.stdout
    secret = acct.key.hex().removeprefix("0x")
    for text in (res.stdout, res.stderr):  # neither the key nor the keystore's password is printed
        assert secret not in text and PASSWORD not in text
    assert not [p for p in out.parent.iterdir() if p.name != out.name]  # no temporary file left


def test_an_existing_deployment_file_is_not_overwritten(mining, deployer, deployed):
    out, _ = deployed
    before = out.read_text()
    res = _deploy(mining, out, deployer[1])
    assert res.returncode == 2
    assert res.stderr.strip() == f"dlx: error: deployment {out} already exists: pass --force to replace it"
    assert out.read_text() == before


def test_deploy_without_a_key_is_one_line_and_exit_2(mining, tmp_path):
    res = subprocess.run([DLX, "deploy", "--rpc", mining, "--out", str(tmp_path / "d.json")],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "no deployer key: set DLX_SUBMITTER_KEY" in res.stderr
    assert not (tmp_path / "d.json").exists()


def test_a_deployment_file_is_checked_when_read(tmp_path):
    path = tmp_path / "d.json"
    with pytest.raises(ChainError, match="no such file"):
        Deployment.load(path)
    path.write_text('{"chain_id": 1}')
    with pytest.raises(ChainError, match="missing registry, ledger, block, deployer"):
        Deployment.load(path)
    path.write_text(json.dumps({"chain_id": 1, "registry": "0x12", "ledger": "0x12", "block": 1, "deployer": "0x1"}))
    with pytest.raises(ChainError, match="registry is not an address"):
        Deployment.load(path)


def test_a_job_names_its_deployment_relative_to_the_job_file(tmp_path):
    (tmp_path / "jobs").mkdir()
    job = tmp_path / "jobs" / "job.toml"
    job.write_text(small_job_toml("named") + '\n[chain]\nrpc = "http://127.0.0.1:1"\ndeployment = "d/deployment.json"\n')
    assert load_job_file(job).chain.deployment == str(tmp_path / "jobs" / "d" / "deployment.json")


def _train(job: Path, run_dir: Path, url: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, "train", str(job), "--run-dir", str(run_dir), "--rpc", url],
                          capture_output=True, text=True, timeout=timeout, env=_env())


def _job(tmp_path: Path, name: str, deployment: Path, steps: int = 2) -> Path:
    job = tmp_path / f"{name}.toml"
    job.write_text(small_job_toml(name, steps=steps, inner_steps=2)
                   + f'\n[chain]\ndeployment = "{os.path.relpath(deployment, tmp_path)}"\n')
    return job


def test_a_deployment_of_another_chain_is_refused_with_exit_2(mining, deployed, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(deployed[0].read_text()), "chain_id": 11155111}))
    res = _train(_job(tmp_path, "other", other), tmp_path / "run", mining)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"dlx: error: deployment {other}: chain id 11155111, endpoint is 31337"
    assert not (tmp_path / "run").exists()


def test_a_deployment_without_its_contracts_is_refused_with_exit_2(mining, deployed, tmp_path):
    gone = tmp_path / "gone.json"
    nowhere = dev_accounts(12)[10].address  # an account: no code
    gone.write_text(json.dumps({**json.loads(deployed[0].read_text()), "ledger": nowhere}))
    res = _train(_job(tmp_path, "gone", gone), tmp_path / "run", mining)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"dlx: error: deployment {gone}: no contract at {nowhere}"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_uses_the_deployment_and_the_run_verifies(mining, deployed, tmp_path):
    dep = Deployment.load(deployed[0])
    run_dir = tmp_path / "run"
    res = _train(_job(tmp_path, "deployed", deployed[0]), run_dir, mining)
    assert res.returncode == 0, res.stderr[-3000:]
    record = RunRecord.load(run_dir)
    assert record.status == "completed" and record.steps == 2
    assert (record.registry, record.ledger) == (dep.registry, dep.ledger)  # not a ledger of its own
    ledger = Ledger(Chain(mining), dep.registry, dep.ledger)
    assert [c.record.step for c in ledger.commits(record.run_id)] == [1, 2]
    verify = subprocess.run([DLX, "verify", str(run_dir), "--rpc", mining], capture_output=True, text=True,
                            timeout=300, env=_env())
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]


def test_deploy_to_an_endpoint_that_does_not_answer_is_exit_2_at_once(deployer, tmp_path):
    from lineage.chain.anvil import free_port

    url = f"http://127.0.0.1:{free_port()}"
    res = _deploy(url, tmp_path / "d.json", deployer[1])
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == f"dlx: error: cannot reach the chain at {url}: connection refused"
    assert not (tmp_path / "d.json").exists()
