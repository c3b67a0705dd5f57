"""Shared fixtures: a real anvil per test module, contracts from contracts/out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lineage.anvil import Anvil, dev_accounts
from lineage.chain import Chain, Ledger


@pytest.fixture(scope="module")
def anvil():
    with Anvil(accounts=12) as node:
        yield node


@pytest.fixture(scope="module")
def accounts():
    return dev_accounts(12)


@pytest.fixture()
def ledger(anvil, accounts):
    """A freshly deployed registry + ledger (each test gets its own deployment)."""
    return Ledger.deploy(Chain(anvil.url), accounts[0])


DLX = str(Path(sys.executable).parent / "dlx")

E2E_JOB = """
name = "e2e"
seed = 7

[model]
d_model = 32
n_layers = 2
n_heads = 2
seq_len = 32

[parallel]
replicas = 2
stages = 2
microbatches = 2

[data]
max_bytes = 300000
batch_size = 4
eval_batches = 2

[inner]
lr = 3e-3
warmup = 2

[outer]
steps = 3
inner_steps = 4
"""



@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One real `dlx train` of a small 2x2 job (about 30 s), shared by the tests that
    read it; tests that tamper with it work on a copy."""
    root = tmp_path_factory.mktemp("e2e")
    job = root / "job.toml"
    job.write_text(E2E_JOB)
    run_dir = root / "run"
    res = subprocess.run([DLX, "train", str(job), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir, res
