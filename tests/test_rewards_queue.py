"""Issue 35, Must-show 1 on the queue: an `open` elastic job starts with the slots that are
live, and a worker with a brand-new node key joins it, signs and is paid for the steps it
attested, all through the real CLI on a real local stack (redis-server, anvil, Celery
workers).

A stack of 2 workers with 1 slot each runs an elastic 3 x 1 job with `min_replicas = 2`, a
reward per step and a short challenge window: `dlx submit` takes it (2 live slots reach
min_replicas), its third ticket stays queued, and past the rendezvous timeout the first
world forms with replicas 0 and 1 (workers/queue/rendezvous.py). After step 2 a third key, never
seen by the chain, is funded, registered (`dlx node register`) and staked (`dlx node
stake`), and `dlx worker` is started with it in its environment: it takes the queued ticket,
calls `joinRun` (the run is open) and is seated at the next growth boundary (the ranks hold
before step 4 until it waits to join, so an 8-step job is long enough on any machine). From then on the
lineage shows three replicas with the new node among the signers; once the steps are final
`dlx node status --json` shows its share credited, and `dlx node claim` raises its balance by
exactly that, less the claim's gas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dlx_testing.cheat import hold_before

from tests.test_elastic_queue import _commits, _down, _job, _joiner_waiting, _up, wait_for

DLX = str(Path(sys.executable).parent / "dlx")
ETHER = 10**18
REWARD = 3 * 10**16  # wei a final step pays, split over its attested slots

pytestmark = pytest.mark.slow


def dlx_as(key_hex: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`dlx ...` with a node key in the environment (never on argv)."""
    env = {**os.environ, "DLX_NODE_KEY": key_hex, "COLUMNS": "400"}  # wide: rich tables fold narrow columns
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout, env=env)


def _submit(stack: Path, path: Path, collective_timeout: str, rendezvous_timeout: str) -> str:
    res = subprocess.run([DLX, "submit", str(path), "--stack", str(stack), "--collective-timeout", collective_timeout,
                          "--rendezvous-timeout", rendezvous_timeout], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _wait_ready(stack: Path, timeout: float) -> None:
    """Until every stack worker's Celery consumer says it is ready (its log's `ready.`)."""
    info = json.loads((stack / "stack.json").read_text())
    deadline = time.monotonic() + timeout
    logs = [Path(w["log"]) for w in info["workers"]]
    while not all(log.exists() and " ready." in log.read_text(errors="replace") for log in logs):
        assert time.monotonic() < deadline, "the stack's workers did not come up"
        time.sleep(0.2)


def _new_node(stack: Path) -> tuple[str, str]:
    """A brand-new key, funded with gas money by an unused dev account, then registered and
    staked through the CLI. Returns (key hex, address)."""
    from eth_account import Account

    from lineage.chain.anvil import dev_accounts
    from lineage.chain.client import Chain
    from workers.queue.stack import Stack

    acct = Account.create()
    chain = Chain(Stack.load(stack).rpc)
    _send(chain, dev_accounts(10)[9], acct.address, 5 * ETHER)
    key = acct.key.hex()
    for args in (("node", "register"), ("node", "stake", "--amount", "2eth")):
        res = dlx_as(key, *args, "--stack", str(stack))
        assert res.returncode == 0, res.stderr
    return key, acct.address


def _send(chain, sender, to: str, wei: int) -> None:
    w3 = chain.w3
    tx = {"to": to, "value": wei, "gas": 21_000, "gasPrice": w3.eth.gas_price, "chainId": chain.chain_id,
          "nonce": w3.eth.get_transaction_count(sender.address, "pending")}
    sent = w3.eth.send_raw_transaction(sender.sign_transaction(tx).raw_transaction)
    assert w3.eth.wait_for_transaction_receipt(sent)["status"] == 1


def _start_new_worker(stack: Path, key: str) -> None:
    from workers.queue.stack import Stack, start_worker

    s = Stack.load(stack)
    start_worker(s, key, 1, "worker-new")  # DLX_NODE_KEY in its environment
    s.save()  # `dlx down` stops it


def _finalize_everything(rec: dict) -> None:
    """Past the challenge window on the chain's clock, then the due steps made final by a
    third party (anyone may), so that `dlx node status` shows every share credited."""
    from lineage.chain.anvil import dev_accounts, rpc_call
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from lineage.chain.rewards import finalize_due

    rpc_call(rec["rpc"], "evm_increaseTime", [5])
    rpc_call(rec["rpc"], "evm_mine")
    ledger = Ledger(Chain(rec["rpc"]), rec["registry"], rec["ledger"])
    finalize_due(ledger, dev_accounts(10)[9], int(rec["run_id"]))
    assert ledger.finalized_step(int(rec["run_id"])) == len(_commits(rec))


def _check_status_shows_the_pool(stack: Path, job: str) -> None:
    """`dlx status` (text and --json): the run's reward per step and what its pool holds."""
    res = subprocess.run([DLX, "status", job, "--stack", str(stack), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    pool = json.loads(res.stdout)["rewards"]
    assert pool["admission"] == "open" and pool["reward_per_step_wei"] == str(REWARD), pool
    assert 0 < int(pool["pool_wei"]) < ETHER  # the final steps so far were paid from it
    res = subprocess.run([DLX, "status", job, "--stack", str(stack)], capture_output=True, text=True, timeout=120)
    assert f"rewards: 0.03 ETH ({REWARD} wei) a final step, pool " in res.stdout, res.stdout
    assert "(admission open)" in res.stdout, res.stdout


def _check_lineage_shows_who_earned(key: str, rec: dict, node: str, signed: list[int], tmp_path: Path) -> None:
    """`dlx lineage` (text and its HTML report): each final step's share and the nodes paid."""
    html = tmp_path / "lineage.html"
    res = dlx_as(key, "lineage", "--run-dir", rec["run_dir"], "--html", str(html))
    assert res.returncode == 0, res.stderr
    assert "a slot to" in res.stdout and node[:10] in res.stdout, res.stdout
    page = html.read_text()
    assert page.count("ETH a slot") == len(_commits(rec)), page.count("ETH a slot")  # every step is final
    assert page.count(f"title='{node}'") == len(signed)  # paid once a step it signed


def test_two_live_slots_start_an_open_3x1_job_and_a_new_key_joins_signs_and_is_paid(tmp_path, small_job):
    stack = _up(tmp_path, workers=2, slots=1)
    # The ranks wait before step 4 until the new node waits to join: however slowly its
    # worker starts, the run does not end first.
    hold = tmp_path / "joiner-waits"
    try:
        steps = 8
        chain = (f'\n[chain]\nadmission = "open"\nreward_wei_per_step = {REWARD}\nfund_wei = {ETHER}\n'
                 "challenge_window_s = 1\n")
        path = _job(tmp_path, small_job, "open-3x1", 2, steps=steps, inner_steps=20, replicas=3, stages=1,
                    extra=chain)
        hold_before(path, 4, hold)
        # The rendezvous timeout is the wait for the third slot: both stack workers, ready
        # before the submit, take their tickets within a second or two, then the job starts
        # without it.
        _wait_ready(stack, timeout=120)
        job = _submit(stack, path, collective_timeout="90", rendezvous_timeout="15")
        rec = wait_for(stack, job, lambda s: s.get("members") is not None or s["state"] in ("failed", "cancelled"),
                       timeout=300)
        assert rec["state"] == "running" and rec["members"] == [0, 1] and rec["epoch"] == 0, rec.get("error")
        assert len(rec["nodes"]) == 2
        wait_for(stack, job, lambda s: (s.get("step") or 0) >= 2, timeout=600)
        key, node = _new_node(stack)
        _start_new_worker(stack, key)
        _joiner_waiting(stack, job)
        hold.touch()
        rec = wait_for(stack, job, lambda s: s["state"] in ("completed", "failed", "cancelled"), timeout=1200)
        assert rec["state"] == "completed", rec.get("error")
        assert _commits(rec) == list(range(1, steps + 1))
        assert rec["members"] == [0, 1, 2] and rec["member_nodes"]["2"] == [node], rec.get("member_nodes")

        _check_status_shows_the_pool(stack, job)
        res = dlx_as(key, "lineage", "--run-dir", rec["run_dir"], "--json")
        assert res.returncode == 0, res.stderr
        lineage = {s["step"]: s for s in json.loads(res.stdout)["steps"] if s["step"] > 0}
        assert lineage[1]["replicas"] == [0, 1] and lineage[2]["replicas"] == [0, 1], lineage  # started with two
        signed = [t for t, s in lineage.items() if node in s["nodes"]]
        assert signed, {t: s["nodes"] for t, s in lineage.items()}
        assert all(lineage[t]["replicas"] == [0, 1, 2] for t in signed), lineage
        assert signed == list(range(signed[0], steps + 1)), signed  # from its first step to the end
        assert signed[0] >= 3  # joined after step 2, signs from a later step

        _finalize_everything(rec)
        res = dlx_as(key, "node", "status", "--json", "--stack", str(stack))
        assert res.returncode == 0, res.stderr
        status = json.loads(res.stdout)
        credited = int(status["rewards"]["runs"][str(rec["run_id"])]["credited_wei"])
        assert credited == len(signed) * (REWARD // 3)  # one share of three slots a step it signed
        assert int(status["rewards"]["claimable_wei"]) == credited

        from lineage.chain.client import Chain

        w3 = Chain(rec["rpc"]).w3
        before = w3.eth.get_balance(node)
        res = dlx_as(key, "node", "claim", "--stack", str(stack))
        assert res.returncode == 0, res.stderr
        tx = res.stdout.rsplit("(tx ", 1)[1].split(")")[0]
        receipt = w3.eth.get_transaction_receipt(tx)
        gas = receipt["gasUsed"] * receipt["effectiveGasPrice"]
        assert w3.eth.get_balance(node) == before + credited - gas
        _check_lineage_shows_who_earned(key, rec, node, signed, tmp_path)
    finally:
        hold.touch()
        _down(stack)
