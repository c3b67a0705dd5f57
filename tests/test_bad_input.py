"""Bad input through the real `dlx`: job files that `dlx train` and `dlx submit` must refuse
before anything starts (exit code 2, one line on stderr, no run directory, nothing queued),
and `dlx verify` of things that are not runs.

The job-file variants are the values a sweep once found failing later (inside a rank, on
chain, or by completing on the wrong chain): wrong types, out-of-range values, unknown keys,
a wrong chain id, a refused RPC, an unreachable IPFS API, more rank slots than the stack
has, a stake above the funding accounts' balance, more arbiters than a block's gas allows.
The submit cases share one real stack (redis-server, anvil, one worker).
"""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import DLX, small_job_toml

from lineage.chain.anvil import free_port

ETH = 10**18
ARBITERS = [f"0x{i:040x}" for i in range(1, 258)]  # one more than a run may have
REFUSED = f"http://127.0.0.1:{free_port()}"  # nothing listens there
NO_IPFS = f"/ip4/127.0.0.1/tcp/{free_port()}/http"

# name: (changes to the small test job, what the one line must say)
INVALID = {  # refused by validation alone, by both commands
    "string_for_int": ({"model": {"d_model": "128"}}, 'model.d_model: Input should be a valid integer (got "128")'),
    "string_for_bool": ({"outer": {"nesterov": "yes"}}, 'outer.nesterov: Input should be a valid boolean (got "yes")'),
    "int_for_bool": ({"outer": {"nesterov": 1}}, "outer.nesterov: Input should be a valid boolean (got 1)"),
    "beta_of_one": ({"inner": {"betas": [0.9, 1.0]}}, "inner.betas: beta2 must be in [0, 1) (got 1)"),
    "negative_beta": ({"inner": {"betas": [-0.1, 0.9]}}, "inner.betas: beta1 must be in [0, 1) (got -0.1)"),
    "float_seed": ({"seed": 1e20}, "seed: Input should be a valid integer (got 1e+20)"),
    "seed_past_64_bits": ({"seed": 10**20}, "seed: Input should be less than or equal to 9223372036854775807"),
    "d_model_2_30": ({"model": {"d_model": 2**30}}, "model.d_model: Input should be less than or equal to 65536"),
    "too_many_parameters": ({"model": {"d_model": 65536, "n_layers": 1024}}, "parameters exceed the 1,100B"),
    "infinite_lr": ({"inner": {"lr": float("inf")}}, "inner.lr: Input should be a finite number"),
    "unknown_key": ({"inner": {"beta": [0.9, 0.9]}}, "inner.beta: unknown key (did you mean betas?)"),
    "too_many_arbiters": ({"chain": {"arbiters": ARBITERS, "quorum": 1}},
                          "chain.arbiters: List should have at most 256 items"),
    "not_an_http_rpc": ({"chain": {"rpc": "ftp://x"}}, "chain.rpc: must be an http:// or https:// JSON-RPC URL"),
}
TRAIN_ONLY = {  # need the job's chain or daemon: checked by dlx train's preflight
    "wrong_embedded_chain_id": ({"chain": {"chain_id": 5}}, "embedded anvil (chain id 31337)"),
    "wrong_chain_id": ({"chain": {"rpc": "ANVIL", "chain_id": 5}}, "wrong chain id at ANVIL: expected 5, got 31337"),
    "refused_rpc": ({"chain": {"rpc": REFUSED}}, f"cannot reach the chain at {REFUSED}: connection refused"),
    "unreachable_ipfs": ({"storage": {"backend": "ipfs", "api": NO_IPFS}},
                         f"no IPFS daemon answers at {NO_IPFS}: connection refused"),
    "stake_above_embedded_balance": ({"chain": {"stake_wei": 20_000 * ETH, "min_stake_wei": 1}},
                                     "more than the embedded chain gives each node key (10000 ETH"),
    "stake_above_balance": ({"chain": {"rpc": "ANVIL", "stake_wei": 20_000 * ETH, "min_stake_wei": 1}},
                            "chain.stake_wei: a stake of 20000000000000000000000 wei (20000 ETH) is more than "),
}
SUBMIT_ONLY = {  # what the stack (1 worker, 4 rank slots, nodes staked 1 ETH) cannot honour
    "wrong_chain_id": ({"chain": {"chain_id": 5}}, "chain.chain_id is 5, but the stack's chain at"),
    "refused_rpc": ({"chain": {"rpc": REFUSED}}, f"the stack records every job on its own chain (STACK_RPC), not {REFUSED}"),
    "unreachable_ipfs": ({"storage": {"backend": "ipfs", "api": NO_IPFS}},
                         "storage: the stack stores every job's blocks in its own blockstore"),
    "too_many_slots": ({"parallel": {"replicas": 3}}, "the job needs 6 rank slots; the stack's live workers offer 4"),
    "stake_above_balance": ({"chain": {"stake_wei": 20_000 * ETH, "min_stake_wei": 1}},
                            "chain.stake_wei: the job wants nodes holding 20000000000000000000000 wei; the live "
                            "workers whose nodes hold that offer 0 of its 4 rank slots"),
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if value == float("inf"):
        return "inf"
    return repr(value)


def _toml(doc: dict[str, Any], prefix: str = "") -> str:
    """A job dict as TOML (scalars and arrays, then each table): enough for these jobs."""
    scalars = [f"{k} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [f"\n[{prefix}{k}]\n" + _toml(v, f"{prefix}{k}.") for k, v in doc.items() if isinstance(v, dict)]
    return "\n".join(scalars) + "\n" + "".join(tables)


def job_file(tmp_path: Path, changes: dict[str, Any], **names: str) -> Path:
    """The small test job with `changes` merged in; the strings ANVIL, STACK_RPC in them
    become `names`' URLs."""
    doc = tomllib.loads(small_job_toml("bad"))
    for section, value in changes.items():
        if isinstance(value, dict):
            value = {k: names.get(v, v) if isinstance(v, str) else v for k, v in value.items()}
            doc[section] = {**doc.get(section, {}), **value}
        else:
            doc[section] = value
    path = tmp_path / "job.toml"
    path.write_text(_toml(doc))
    return path


def dlx(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DLX_SUBMITTER_KEY", "DLX_NODE_KEYS")}
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env)


def assert_one_line_error(res: subprocess.CompletedProcess[str], needle: str, code: int = 2) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, res.stderr
    assert len(lines) == 1 and lines[0].startswith("dlx: error: "), res.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize("case", sorted({**INVALID, **TRAIN_ONLY}))
def test_dlx_train_refuses_a_bad_job_before_anything_starts(tmp_path, anvil, case):
    changes, needle = {**INVALID, **TRAIN_ONLY}[case]
    job = job_file(tmp_path, changes, ANVIL=anvil.url)
    run_dir = tmp_path / "run"
    res = dlx("train", str(job), "--run-dir", str(run_dir), cwd=tmp_path)
    assert_one_line_error(res, needle.replace("ANVIL", anvil.url))
    assert not run_dir.exists()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One real stack for every submit case: redis-server, anvil, one worker with 4 slots."""
    d = tmp_path_factory.mktemp("stack") / ".dlx"
    res = subprocess.run([DLX, "up", "--workers", "1", "--slots", "4", "--stack", str(d)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    yield d
    res = subprocess.run([DLX, "down", "--stack", str(d)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def queued(stack: Path) -> tuple[list[bytes], int]:
    """Every job record in the stack's Redis, and the rank tasks waiting in its broker."""
    from workers.queue.jobs import connect
    from workers.queue.stack import Stack

    r = connect(Stack.load(stack).redis_url)
    return sorted(r.scan_iter(match="dlx:job:*")), int(r.llen("train"))


@pytest.mark.parametrize("case", sorted({**INVALID, **SUBMIT_ONLY}))
def test_dlx_submit_refuses_what_the_stack_cannot_honour_before_queueing(tmp_path, stack, case):
    from workers.queue.stack import Stack

    changes, needle = {**INVALID, **SUBMIT_ONLY}[case]
    rpc = Stack.load(stack).rpc
    res = dlx("submit", str(job_file(tmp_path, changes)), "--stack", str(stack), cwd=tmp_path)
    assert_one_line_error(res, needle.replace("STACK_RPC", rpc))
    assert res.stdout == ""  # no job id
    assert queued(stack) == ([], 0)


def test_a_good_job_still_passes_the_stack_checks(tmp_path, stack):
    """The refusals above are not a stack that refuses everything: the same job unchanged
    is queued (and cancelled at once, so the worker trains nothing)."""
    res = dlx("submit", str(job_file(tmp_path, {})), "--stack", str(stack), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip()
    assert dlx("cancel", job, "--stack", str(stack), cwd=tmp_path).returncode == 0
    assert len(queued(stack)[0]) >= 1


@pytest.mark.slow  # not in --quick: `dlx verify` runs
def test_verify_of_what_is_not_a_run_is_a_user_error_naming_the_path(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a run\n")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "run.json").write_bytes(bytes(range(256)))
    for path, needle in ((a_file, f"not a run directory (a file, not a directory): {a_file}"),
                         (tmp_path, f"not a run directory (no run.json): {tmp_path}"),
                         (garbage, f"malformed {garbage / 'run.json'}: not UTF-8 text")):
        assert_one_line_error(dlx("verify", "--run-dir", str(path), cwd=tmp_path), needle)


def test_a_stake_above_the_payers_balance_is_refused_before_anything_is_sent(tmp_path, anvil, accounts, ledger):
    """`dlx node register --stake` and `dlx node stake`: the operator key holds 10,000 ETH;
    20,000 is refused in one line naming the account and its balance, and the node stays
    unregistered (the refusal comes before the registration, not between it and the stake)."""
    node, operator = accounts[7], accounts[8]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DLX_")}, "DLX_RPC": anvil.url,
           "DLX_LEDGER": ledger.ledger.address, "DLX_NODE_KEY": node.key.hex(), "DLX_OPERATOR_KEY": operator.key.hex()}
    needle = f"is more than {operator.address} holds on {anvil.url}: 10000000000000000000000 wei (10000 ETH)"
    for args in (["node", "register", "--stake", "20000eth"], ["node", "stake", "--amount", "20000eth"]):
        res = subprocess.run([DLX, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert_one_line_error(res, needle)
    assert not ledger.registry.is_registered(node.address)


@pytest.mark.slow
def test_a_failed_run_with_no_committed_steps_does_not_verify(tmp_path):
    """A run that diverges in its first round is created on chain but commits nothing: the
    training is a job failure (1), and so is its verification ("no committed steps"), never 0."""
    job = job_file(tmp_path, {"inner": {"lr": 1e6}, "parallel": {"replicas": 1, "stages": 1, "microbatches": 1},
                              "outer": {"steps": 1, "inner_steps": 2}})
    run_dir = tmp_path / "run"
    res = dlx("train", str(job), "--run-dir", str(run_dir), cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("dlx: error: training diverged at step 1"), res.stderr
    res = dlx("verify", "--run-dir", str(run_dir), "--json", cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["steps"] == []
    assert doc["run_failures"] == ["no committed steps (run.json status: failed)"]


@pytest.mark.slow  # not in --quick: `dlx` runs
def test_a_run_directory_that_cannot_be_one_is_refused_naming_the_path(tmp_path):
    job = job_file(tmp_path, {})
    a_file = tmp_path / "taken"
    a_file.write_text("")
    for run_dir, needle in ((a_file, f"run directory is a file: {a_file}"),
                            (a_file / "run", f"cannot create run directory {a_file / 'run'}: {a_file} is not a "
                                             "writable directory")):
        assert_one_line_error(dlx("train", str(job), "--run-dir", str(run_dir), cwd=tmp_path), needle)
    assert a_file.read_text() == ""


def test_a_lost_chain_is_one_line_naming_its_endpoint(accounts):
    """A chain that goes away under a connected client: the error names the endpoint and
    says what happened, not urllib3's retry chain."""
    from lineage.chain.anvil import Anvil
    from lineage.chain.client import Chain
    from lineage.errors import ChainError

    with Anvil() as node:
        chain = Chain(node.url)
    with pytest.raises(ChainError) as err:
        chain.require_funds(accounts[1].address, 1, "a stake")
    assert str(err.value) == f"balance of {accounts[1].address}: chain at {node.url}: connection refused"
