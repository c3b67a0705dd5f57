"""Shared fixtures: a real anvil per test module, contracts from contracts/out."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lineage.chain.anvil import Anvil, dev_accounts
from lineage.chain.client import Chain
from lineage.chain.ledger import Ledger
from lineage.chain.runrecord import RunRecord
from workers.run.jobfile import EXTENSION_ENV

#: The attack harness (tests/dlx_testing, a test-only package production code never imports)
#: is this suite's extension: every `dlx` a test starts, and the ranks it spawns, read job
#: files with its `[cheat]` tables (workers.run.jobfile.job_file_class). Production never sets it.
TESTS = Path(__file__).resolve().parent
os.environ[EXTENSION_ENV] = "dlx_testing.cheat"
os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])


#: The modules that take longest (a stack and its workers, a chain mining on a clock, a
#: kernel-set matrix, many trainings or replays), in the order they start. Under `--dist
#: loadscope` a module runs whole on one worker and modules are handed out in collection
#: order, so starting the long ones first leaves the many short ones to even out the
#: workers at the end, instead of one long module running alone while the others idle.
LONG_FIRST = ("test_queue", "test_chain_faults", "test_portable_audit", "test_tolerance", "test_elastic_queue",
              "test_rewards_queue", "test_bad_input", "test_replay", "test_data_lineage", "test_elastic_trainer",
              "test_attacks", "test_queue_ux", "test_stops", "test_run_names", "test_trainer", "test_stack_history")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`LONG_FIRST`'s modules first, in its order; the others after, as collected."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(Path(item.nodeid.split("::")[0]).stem, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory):
    """Tests (and the processes they start) tokenize into a data cache of their own, never
    the user's (~/.cache/dlx): `DLX_CACHE`, shared by the session."""
    old = os.environ.get("DLX_CACHE")
    os.environ["DLX_CACHE"] = str(tmp_path_factory.mktemp("dlx-cache"))
    yield Path(os.environ["DLX_CACHE"])
    if old is None:
        os.environ.pop("DLX_CACHE", None)
    else:
        os.environ["DLX_CACHE"] = old


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

def small_job_toml(name: str, *, seed: int = 7, steps: int = 3, inner_steps: int = 4,
                   replicas: int = 2, stages: int = 2, n_layers: int = 2, extra: str = "") -> str:
    """A job small enough for tests (a 2-layer d=32 GPT), with `extra` TOML appended."""
    return f"""
name = "{name}"
seed = {seed}

[model]
d_model = 32
n_layers = {n_layers}
n_heads = 2
seq_len = 32

[parallel]
replicas = {replicas}
stages = {stages}
microbatches = 2

[data]
max_bytes = 300000
batch_size = 4
eval_batches = 2

[inner]
lr = 3e-3
warmup = 2

[outer]
steps = {steps}
inner_steps = {inner_steps}
{extra}"""


@pytest.fixture(scope="session")
def small_job():
    """`small_job(name, steps=..., ...)`: the TOML of a small test job (see small_job_toml)."""
    return small_job_toml


@pytest.fixture(scope="module")
def served(trained_run, tmp_path_factory) -> Any:
    """`trained_run`'s chain served by an anvil of its own (from a copy of its state).
    Yields (run directory, its RunRecord, the anvil's URL)."""
    run_dir = trained_run[0]
    record = RunRecord.load(run_dir)
    state = tmp_path_factory.mktemp("served") / "state.json"
    shutil.copyfile(run_dir / record.chain_state, state)
    with Anvil(state_path=state) as node:
        yield run_dir, record, node.url


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """One real `dlx train` of a small 2x2 job (about 30 s), shared by the tests that
    read it; tests that tamper with it work on a copy."""
    return train_small(tmp_path_factory.mktemp("e2e"))


def train_small(root: Path, env: dict[str, str] | None = None,
                job: str | None = None) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`dlx train` of the small job (or the TOML `job`) in `root` (with `env` added to the
    environment): (run directory, the finished process)."""
    path = root / "job.toml"
    path.write_text(small_job_toml("e2e") if job is None else job)
    job = str(path)
    run_dir = root / "run"
    res = subprocess.run([DLX, "train", job, "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=600, env=None if env is None else {**os.environ, **env})
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir, res
