"""`dlx node` as an operator meets it, on a real anvil: register, stake, status, unbond,
withdraw and claim through the CLI with keys from the environment (a private key or an
encrypted keystore), reverts as one line naming the contract's error, a wrong chain
refused, amounts with units, and several transactions from one key at once.

Most commands run in-process (`run_dlx`, Click's runner on the real `dlx` app: the same
code, without paying a Python start-up per command); the ones that check what a shell
sees (exit code, one line on stderr) run the installed `dlx` binary (`real=True`)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import DLX
from eth_account import Account
from typer.testing import CliRunner

from lineage.chain.anvil import rpc_call
from lineage.chain.ledger import DEFAULT_UNBONDING_DELAY
from workers.cli import app
from workers.cli.node import fmt_wei, parse_amount

ETHER = 10**18


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def run_dlx(env: dict[str, str], *args: str, real: bool = False, timeout: float = 600) -> Ran:
    """`dlx ARGS` with exactly `env`'s DLX_* variables (the caller's are dropped)."""
    if real:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DLX_")}
        res = subprocess.run([DLX, *args], env={**clean, **env}, capture_output=True, text=True, timeout=timeout)
        return Ran(res.returncode, res.stdout, res.stderr)
    full: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DLX_")}
    res = CliRunner().invoke(app, list(args), env={**full, **env})
    return Ran(res.exit_code, res.stdout, res.stderr)


dlx = run_dlx


def one_line_error(res: Ran) -> str:
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def status(env: dict[str, str], *args: str) -> dict:
    res = dlx(env, "node", "status", "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture()
def chain_env(anvil, ledger) -> dict[str, str]:
    return {"DLX_RPC": anvil.url, "DLX_LEDGER": ledger.ledger.address}


def test_amounts_carry_their_unit():
    assert parse_amount("1.5eth") == 15 * 10**17
    assert parse_amount("2 ether") == 2 * ETHER
    assert parse_amount("3gwei") == 3 * 10**9
    assert parse_amount("10wei") == 10
    for bad in ("10", "1.5", "0eth", "0.5wei", "1e18wei", "-1eth", "1.5 btc"):
        with pytest.raises(ValueError):
            parse_amount(bad)
    assert fmt_wei(15 * 10**17) == "1.5 ETH (1500000000000000000 wei)"
    assert fmt_wei(7) == "7 wei"


@pytest.mark.slow  # not in --quick: a dozen transactions and `dlx` runs
def test_register_stake_status_unbond_withdraw_round_trip(anvil, accounts, ledger, chain_env):
    node, operator = accounts[5], accounts[6]
    env = {**chain_env, "DLX_NODE_KEY": node.key.hex(), "DLX_OPERATOR_KEY": operator.key.hex()}

    doc = status(env)
    assert doc["node"] == node.address and doc["registered"] is False

    res = dlx(env, "node", "register", "--stake", "1.5eth")
    assert res.returncode == 0, res.stderr
    assert f"registered for operator {operator.address}" in res.stdout
    assert ledger.registry.operator_of(node.address) == operator.address
    assert ledger.registry.stake_of(node.address) == 15 * 10**17

    res = dlx(env, "node", "stake", "--amount", "10wei")
    assert res.returncode == 0, res.stderr
    doc = status(env)
    assert doc["operator"] == operator.address
    assert doc["stake_wei"] == str(15 * 10**17 + 10)
    assert doc["unbonding"] == {"amount_wei": "0", "release_at": 0}
    assert doc["open_challenges"] == 0 and doc["challenges"] == []
    text = dlx(env, "node", "status", real=True)
    assert "stake       1.50000000000000001 ETH" in text.stdout, text.stdout

    # Registering twice is the contract's refusal, by name, on one line.
    line = one_line_error(dlx(env, "node", "register"))
    assert f"reverted with RegistryAlreadyRegistered(node={node.address.lower()})" in line

    # Only the operator unbonds: the node key itself is not its operator here.
    as_node = {**env, "DLX_OPERATOR_KEY": node.key.hex()}
    assert "RegistryNotOperator" in one_line_error(dlx(as_node, "node", "unbond"))

    res = dlx(env, "node", "unbond")
    assert res.returncode == 0, res.stderr
    doc = status(env)
    assert doc["stake_wei"] == "0"
    assert doc["unbonding"]["amount_wei"] == str(15 * 10**17 + 10)
    assert doc["unbonding"]["release_at"] == doc["time"] + DEFAULT_UNBONDING_DELAY

    line = one_line_error(dlx(env, "node", "withdraw", real=True))
    assert "reverted with RegistryUnbondingNotDue(" in line
    assert f"releaseAt={doc['unbonding']['release_at']}" in line

    rpc_call(anvil.url, "evm_increaseTime", [DEFAULT_UNBONDING_DELAY])
    rpc_call(anvil.url, "evm_mine")
    before = ledger.chain.w3.eth.get_balance(operator.address)
    res = dlx(env, "node", "withdraw")
    assert res.returncode == 0, res.stderr
    assert f"withdrew 1.50000000000000001 ETH (1500000000000000010 wei) of {node.address}" in res.stdout
    receipt = ledger.chain.w3.eth.get_transaction_receipt(res.stdout.split("(tx ")[1].rstrip(")\n"))
    gas = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    assert ledger.chain.w3.eth.get_balance(operator.address) - before + gas == 15 * 10**17 + 10
    doc = status(env)
    assert doc["stake_wei"] == "0" and doc["unbonding"]["amount_wei"] == "0"

    assert "RegistryNothingToClaim" in one_line_error(dlx(env, "node", "claim", "--operator"))
    assert node.key.hex()[2:] not in text.stdout + text.stderr  # no key ever reaches the output


def test_a_keystore_key_works_and_a_wrong_password_is_one_line(accounts, ledger, chain_env, tmp_path):
    node = accounts[7]
    keystore = tmp_path / "node.json"
    keystore.write_text(json.dumps(Account.encrypt(node.key, "s3cret", kdf="scrypt", iterations=2**10)))
    env = {**chain_env, "DLX_KEYSTORE": str(keystore), "DLX_KEYSTORE_PASSWORD": "s3cret"}
    res = dlx(env, "node", "register", "--stake", "1eth")
    assert res.returncode == 0, res.stderr
    assert ledger.registry.stake_of(node.address) == ETHER and ledger.registry.operator_of(node.address) == node.address
    line = one_line_error(dlx({**env, "DLX_KEYSTORE_PASSWORD": "wrong"}, "node", "status"))
    assert "cannot decrypt keystore" in line


def test_a_wrong_chain_id_or_a_missing_key_is_refused_before_any_transaction(accounts, ledger, chain_env):
    node = accounts[8]
    env = {**chain_env, "DLX_NODE_KEY": node.key.hex()}
    line = one_line_error(dlx(env, "node", "register", "--stake", "1eth", "--chain-id", "1", real=True))
    assert "wrong chain id" in line and "expected 1, got 31337" in line
    line = one_line_error(dlx({**env, "DLX_CHAIN_ID": "5"}, "node", "status"))
    assert "wrong chain id" in line
    assert not ledger.registry.is_registered(node.address)
    assert "no node key" in one_line_error(dlx(chain_env, "node", "status", real=True))
    assert "write a number and a unit" in one_line_error(dlx(env, "node", "stake", "--amount", "5"))
    assert "no contract addresses" in one_line_error(dlx({"DLX_RPC": chain_env["DLX_RPC"], **{
        "DLX_NODE_KEY": node.key.hex()}}, "node", "status"))


@pytest.mark.slow  # not in --quick: many transactions on anvil
def test_several_transactions_from_one_key_at_once_all_land(accounts, ledger, chain_env):
    """Four CLI processes and four threads stake from one payer at the same moment: every
    one lands (the client serialises a key's sends in-process and retries a nonce another
    process took first)."""
    node, payer = accounts[9], accounts[10]
    ledger.registry.ensure_staked(node, ETHER)
    env = {**chain_env, "DLX_OPERATOR_KEY": payer.key.hex(), "DLX_NODE_KEY": node.key.hex()}
    procs = [subprocess.Popen([DLX, "node", "stake", "--amount", f"{i + 1}wei"],
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("DLX_")}, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    errors: list[BaseException] = []

    def stake(amount: int) -> None:
        try:
            ledger.registry.stake(payer, node.address, amount)
        except BaseException as exc:  # collected: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=stake, args=(100 * (i + 1),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert errors == []
    assert ledger.registry.stake_of(node.address) == ETHER + (1 + 2 + 3 + 4) + (100 + 200 + 300 + 400)


@pytest.mark.slow  # not in --quick: reads the session's trained run
def test_run_dir_of_an_embedded_chain_is_written_back(trained_run, tmp_path):
    """`--run-dir` of a `dlx train` run: the node commands start its anvil on the state file
    itself, so a stake added there is still there the next time the chain starts."""
    import shutil

    from lineage.chain.anvil import dev_accounts

    run_dir = Path(shutil.copytree(trained_run[0], tmp_path / "run"))
    node = dev_accounts(2)[1]  # the run's first slot key (anvil's public development key)
    env = {"DLX_NODE_KEY": node.key.hex()}
    before = int(status(env, "--run-dir", str(run_dir))["stake_wei"])
    res = dlx(env, "node", "stake", "--amount", "1gwei", "--run-dir", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert int(status(env, "--run-dir", str(run_dir))["stake_wei"]) == before + 10**9
    lineage = dlx({}, "lineage", "--run-dir", str(run_dir), "--json")
    assert lineage.returncode == 0, lineage.stderr
    assert json.loads(lineage.stdout)["stakes"][node.address] == str(before + 10**9)
