"""A chain that behaves like a real one (issue 33): outages retried with backoff, EIP-1559 fees
with a cap and bumped replacements, lost transactions sent again, confirmations, reorganisations
repaired, and event reads in bounded block ranges.

The unit tests pin the classification of failures, the backoff and the fee arithmetic. The
slow ones run the real `dlx` against an anvil that mines a block a second, through a small
HTTP proxy in this process that can answer 429 or refuse wide `eth_getLogs` queries, while
the test freezes anvil (SIGSTOP), reorganises it, drops its pool and raises its base fee;
the runs are then checked by `dlx verify` run in this process (tests/dlx_testing/here.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import DLX, small_job_toml
from dlx_testing.here import dlx_here
from test_chain import _attest, _run, h
from web3.exceptions import Web3RPCError

from lineage.chain.anvil import dev_accounts, free_port, rpc_call, tool_path
from lineage.chain.client import Chain
from lineage.chain.commits import StepCommit, StepCommits
from lineage.chain.ledger import Ledger
from lineage.chain.logs import ranged_logs, too_wide
from lineage.chain.runrecord import RunRecord
from lineage.chain.tx import (
    GWEI,
    MIN_BUMP,
    Fees,
    Outage,
    backoff,
    bump,
    fees,
    rpc_error_transient,
    transient,
)
from lineage.errors import ChainFailure, ChainFeeError, ChainRevertError, ChainUnavailable
from trainer.errors import TrainingError

# -- unit: what is retried, how long, and what fees ----------------------------------------


def _http_error(status: int) -> requests.exceptions.HTTPError:
    response = requests.Response()
    response.status_code = status
    return requests.exceptions.HTTPError(f"{status}", response=response)


@pytest.mark.parametrize(("exc", "retry"), [
    (requests.exceptions.ConnectionError("Connection refused"), True),
    (requests.exceptions.ReadTimeout("read timed out"), True),
    (ConnectionRefusedError(), True),
    (_http_error(429), True),
    (_http_error(502), True),
    (_http_error(503), True),
    (_http_error(404), False),
    (_http_error(400), False),
    (requests.exceptions.InvalidSchema("no adapter"), False),
    (Web3RPCError("x", rpc_response={"error": {"code": -32005, "message": "rate limit exceeded"}}), True),
    (Web3RPCError("x", rpc_response={"error": {"code": -32000, "message": "header not found"}}), True),
    (Web3RPCError("x", rpc_response={"error": {"code": 3, "message": "execution reverted"}}), False),
    (Web3RPCError("x", rpc_response={"error": {"code": -32000, "message": "nonce too low"}}), False),
    (Web3RPCError("x", rpc_response={"error": {"code": -32005, "message": "query exceeds max block range 10000"}}),
     False),
    (ValueError("bad"), False),
])
def test_outages_are_retried_and_refusals_are_not(exc: BaseException, retry: bool) -> None:
    assert transient(exc) is retry


def test_a_log_query_refused_as_too_wide_is_narrowed_not_retried() -> None:
    error = {"code": -32005, "message": "query exceeds max block range 10000"}
    assert not rpc_error_transient(error)
    assert too_wide(Web3RPCError(error["message"], rpc_response={"error": error}))
    assert not too_wide(Web3RPCError("execution reverted"))


def test_backoff_doubles_up_to_its_ceiling_and_an_outage_ends_at_its_budget() -> None:
    assert [backoff(i) for i in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    outage = Outage("http://rpc.example", 10.0, "eth_call", clock=lambda: now[0], sleep=sleep)
    error = _http_error(429)
    with pytest.raises(ChainUnavailable, match=r"^chain at http://rpc\.example unavailable for 10 s \(eth_call\), "
                                              r"past chain\.outage_s \(10 s\); last error: HTTP 429"):
        for _ in range(100):
            outage.retry(error)
    assert slept == [0.25, 0.5, 1.0, 2.0, 4.0, 2.25]  # the last wait stops at the budget
    assert issubclass(ChainUnavailable, TrainingError)  # exit 1, not the bad-input 2
    with pytest.raises(requests.exceptions.HTTPError):  # no budget: the failure as it came
        Outage("http://rpc.example", 0.0).retry(error)


def test_fees_follow_the_base_fee_under_the_cap_and_a_cap_below_it_is_named() -> None:
    assert fees(10 * GWEI, GWEI, None) == Fees(21 * GWEI, GWEI)
    assert fees(10 * GWEI, GWEI, 15) == Fees(15 * GWEI, GWEI)  # capped
    assert fees(10 * GWEI, 2 * GWEI, 10) == Fees(10 * GWEI, 2 * GWEI)
    with pytest.raises(ChainFeeError, match=r"^commitStep\(run 1, step 3\): the chain's base fee is 300 gwei, "
                                            r"above chain\.max_fee_gwei \(50\)"):
        fees(300 * GWEI, GWEI, 50, "commitStep(run 1, step 3)")
    assert issubclass(ChainFeeError, ChainFailure)


def test_a_replacement_raises_both_fees_by_at_least_an_eighth_and_to_what_the_chain_asks() -> None:
    old = Fees(3 * GWEI + 1, GWEI + 1)
    new = bump(old, Fees(GWEI, GWEI // 2))
    assert new.max_fee >= old.max_fee * (1 + MIN_BUMP) and new.priority >= old.priority * (1 + MIN_BUMP)
    assert new == Fees(-(-(3 * GWEI + 1) * 9 // 8), -(-(GWEI + 1) * 9 // 8))  # rounded up
    jumped = bump(old, fees(300 * GWEI, GWEI, None))  # the base fee jumped: what the chain asks now
    assert jumped == Fees(601 * GWEI, -(-(GWEI + 1) * 9 // 8))
    with pytest.raises(ChainFeeError, match="above chain.max_fee_gwei"):
        bump(Fees(10 * GWEI, GWEI), Fees(GWEI, GWEI), max_fee_gwei=11)


class _FakeEvent:
    """An event whose endpoint refuses ranges wider than `cap` blocks."""

    def __init__(self, head: int, cap: int, at: list[int]) -> None:
        self.w3 = type("W3", (), {"eth": type("Eth", (), {"block_number": head})()})()
        self.cap, self.at, self.calls = cap, at, 0

    def get_logs(self, from_block: int, to_block: int, argument_filters: Any = None) -> list[int]:
        self.calls += 1
        if to_block - from_block + 1 > self.cap:
            raise Web3RPCError("query exceeds max block range")
        return [b for b in self.at if from_block <= b <= to_block]


def test_ranged_reads_cover_every_block_once_and_narrow_where_refused() -> None:
    event = _FakeEvent(head=25_000, cap=10_000, at=[0, 9_999, 10_000, 24_999, 25_000])
    assert ranged_logs(event, from_block=0, log_range=10_000) == event.at
    assert event.calls == 3
    narrow = _FakeEvent(head=25_000, cap=3_000, at=[5, 12_345, 25_000])
    assert ranged_logs(narrow, from_block=1, log_range=10_000) == [5, 12_345, 25_000]


# -- a proxy between dlx and anvil ----------------------------------------------------------


class Proxy:
    """A JSON-RPC forwarder to `upstream` on a free port: answers HTTP 429 until
    `fail_until`, and refuses `eth_getLogs` over more than `max_log_blocks` blocks."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.fail_until = 0.0
        self.max_log_blocks: int | None = None
        self.refused = self.throttled = self.log_queries = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, reply = proxy.answer(body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def answer(self, body: bytes) -> tuple[int, bytes]:
        if time.monotonic() < self.fail_until:
            self.throttled += 1
            return 429, b'{"error": "too many requests"}'
        request = json.loads(body)
        if isinstance(request, dict) and request.get("method") == "eth_getLogs":
            self.log_queries += 1
            if self.max_log_blocks is not None and self._span(request["params"][0]) > self.max_log_blocks:
                self.refused += 1
                error = {"code": -32005, "message": f"query exceeds max block range {self.max_log_blocks}"}
                return 200, json.dumps({"jsonrpc": "2.0", "id": request["id"], "error": error}).encode()
        forward = urllib.request.Request(self.upstream, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(forward, timeout=60) as resp:
            return resp.status, resp.read()

    def _span(self, query: dict[str, Any]) -> int:
        def block(tag: Any) -> int:
            if tag in (None, "latest", "pending", "safe", "finalized"):
                return int(str(rpc_call(self.upstream, "eth_blockNumber")), 16)
            return 0 if tag == "earliest" else int(tag, 16)

        return block(query.get("toBlock")) - block(query.get("fromBlock")) + 1

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def _anvil(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """An anvil of this test's own with `args` (by PID, stopped after, never left frozen)."""
    port = free_port()
    proc = subprocess.Popen([str(tool_path("anvil")), "--host", "127.0.0.1", "--port", str(port), "--silent",
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                rpc_call(url, "eth_chainId", timeout=0.5)
                break
            except Exception:
                assert proc.poll() is None, "anvil exited at start"
                time.sleep(0.05)
        yield proc, url
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(10)


@pytest.fixture()
def mining_anvil() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """An anvil that mines a block every second."""
    with _anvil("--block-time", "1") as node:
        yield node


@pytest.fixture()
def proxy(mining_anvil: tuple[subprocess.Popen[bytes], str]) -> Iterator[Proxy]:
    p = Proxy(mining_anvil[1])
    yield p
    p.close()


def _steps_named(run_dir: Path) -> tuple[int, int]:
    """(run id, steps) run.json names now ((0, -1) before createRun)."""
    try:
        data = json.loads((run_dir / "run.json").read_text())
    except (OSError, ValueError):
        return 0, -1
    return int(data.get("run_id") or 0), int(data.get("steps", 0)) if data.get("run_id") else -1


@contextmanager
def _quick_blocks(url: str, run_dir: Path) -> Iterator[None]:
    """Until run.json names the run: a block every 50 ms beside anvil's one a second, so that
    the set-up transactions, each waiting for its confirmations (deployment, registrations,
    stakes, createRun), take seconds rather than most of a minute. The steps, and every
    fault, come after, on the one-second chain."""
    stop = threading.Event()

    def mine() -> None:
        while not stop.is_set() and _steps_named(run_dir)[1] < 0:
            rpc_call(url, "evm_mine")
            time.sleep(0.05)

    thread = threading.Thread(target=mine, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _when_pending(url: str, timeout: float = 30.0) -> bool:
    """Wait until anvil's pool holds a transaction; False if none came within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status: Any = rpc_call(url, "txpool_status")
        if int(str(status["pending"]), 16) + int(str(status["queued"]), 16) > 0:
            return True
        time.sleep(0.02)
    return False


class Faults:
    """The faults, each once, as run.json names steps; what happened, for the assertions."""

    def __init__(self, anvil: subprocess.Popen[bytes], url: str, proxy: Proxy, run_dir: Path) -> None:
        self.anvil, self.url, self.proxy, self.run_dir = anvil, url, proxy, run_dir
        self.done: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _wait_step(self, step: int) -> bool:
        while not self.stop.is_set():
            if _steps_named(self.run_dir)[1] >= step:
                return True
            time.sleep(0.05)
        return False

    def _run(self) -> None:
        if not self._wait_step(1):
            return
        os.kill(self.anvil.pid, signal.SIGSTOP)  # a frozen node: requests hang, then time out
        time.sleep(6)
        os.kill(self.anvil.pid, signal.SIGCONT)
        self.done.append("freeze 6 s")
        if not self._wait_step(2):
            return
        rpc_call(self.url, "anvil_reorg", [4, []])  # deeper than the 2 confirmations
        self.done.append("reorg 4")
        if _when_pending(self.url):
            rpc_call(self.url, "anvil_dropAllTransactions")
            self.done.append("drop")
        if not self._wait_step(3):
            return
        if _when_pending(self.url):
            rpc_call(self.url, "anvil_setNextBlockBaseFeePerGas", [hex(300 * GWEI)])
            self.done.append("base fee 300 gwei")
        if not self._wait_step(4):
            return
        if _when_pending(self.url):  # no blocks for 5 s: the commit is stuck, and replaced
            rpc_call(self.url, "evm_setIntervalMining", [0])
            time.sleep(5)
            rpc_call(self.url, "evm_setIntervalMining", [1])
            self.done.append("no blocks for 5 s")
        self.proxy.fail_until = time.monotonic() + 6
        self.done.append("429 for 6 s")


@pytest.mark.slow
def test_a_run_completes_through_a_freeze_a_reorg_a_drop_a_fee_jump_and_rate_limits(mining_anvil, proxy,
                                                                                        tmp_path):
    anvil, url = mining_anvil
    job = tmp_path / "job.toml"
    job.write_text(small_job_toml("faults", steps=5, inner_steps=2)
                   + "\n[chain]\nreplace_after_s = 3\noutage_s = 120\n")
    run_dir = tmp_path / "run"
    faults = Faults(anvil, url, proxy, run_dir)
    faults.thread.start()
    started = time.monotonic()
    try:
        with _quick_blocks(url, run_dir):
            res = subprocess.run([DLX, "train", str(job), "--run-dir", str(run_dir), "--rpc", proxy.url],
                                 capture_output=True, text=True, timeout=300)
    finally:
        faults.stop.set()
        faults.thread.join(30)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr[-3000:]
    assert faults.done == ["freeze 6 s", "reorg 4", "drop", "base fee 300 gwei", "no blocks for 5 s",
                           "429 for 6 s"], faults.done
    assert proxy.throttled > 0
    lines = res.stderr.splitlines()
    repairs = [line for line in lines if "removed by a reorganisation; committing it again" in line]
    assert len(repairs) == 1 and "step 2 " in repairs[0], res.stderr[-3000:]
    # the dropped transaction, and the one below the jumped base fee (anvil drops it too), sent again
    assert sum("the node lost the transaction" in line for line in lines) >= 2, res.stderr[-3000:]
    assert any("replaced with the same nonce" in line for line in lines), res.stderr[-3000:]
    record = RunRecord.load(run_dir)
    assert record.status == "completed" and record.steps == 5
    assert record.created_block > 0
    ledger = Ledger(Chain(url), record.registry, record.ledger)
    commits = ledger.commits(record.run_id)
    steps = [c.record.step for c in commits if c.status != "rejected"]
    assert steps == [1, 2, 3, 4, 5], steps  # every step on chain exactly once
    assert len(commits) == 5, [(c.record.step, c.status) for c in commits]
    verify = dlx_here("verify", run_dir, "--rpc", url)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
    print(f"faults run: {took:.0f} s, 429 answers: {proxy.throttled}; chain lines:",
          *[line for line in lines if line.startswith("chain: ")], sep="\n  ")


@pytest.mark.slow
def test_past_the_outage_budget_a_run_fails_with_exit_1_naming_the_endpoint(mining_anvil, proxy, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(small_job_toml("outage", steps=3, inner_steps=2) + "\n[chain]\noutage_s = 3\nconfirmations = 0\n")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([DLX, "train", str(job), "--run-dir", str(run_dir), "--rpc", proxy.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    with _quick_blocks(mining_anvil[1], run_dir):
        while _steps_named(run_dir)[1] < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    proxy.fail_until = time.monotonic() + 3600
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"dlx: error: chain at {proxy.url} unavailable for "), last
    assert "past chain.outage_s (3 s); last error: HTTP 429" in last
    proxy.fail_until = 0.0
    assert RunRecord.load(run_dir).status == "failed"
    again = subprocess.run([DLX, "train", "--resume", str(run_dir), "--rpc", proxy.url], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert RunRecord.load(run_dir).steps == 3


# -- commits on a reorganising chain --------------------------------------------------------


def _commits(ledger: Ledger, accounts: list[Any], steps: int, say: Any = None) -> tuple[int, StepCommits,
                                                                                         list[StepCommit]]:
    run_id, nodes = _run(ledger, accounts)
    commits = StepCommits(ledger, accounts[0], say or (lambda line: None))
    parent, out = h("genesis"), []
    for step in range(1, steps + 1):
        c = StepCommit(run_id=run_id, step=step, parent=parent, checkpoint=h(f"ckpt{step}"), metrics_digest=h("m"),
                       attestations=_attest(ledger, run_id, step, parent, nodes))
        commits.commit(c)
        out.append(c)
        parent = c.checkpoint
    return run_id, commits, out


def _commit_steps(ledger: Ledger, accounts: list[Any], steps: int) -> int:
    return _commits(ledger, accounts, steps)[0]


def test_a_duplicate_commit_is_success_when_the_chain_records_our_step(ledger, accounts):
    run_id, commits, sent = _commits(ledger, accounts, 2)
    commits._send(sent[1])  # the ledger refuses it (LedgerWrongStep): ours is recorded, so done
    other = StepCommit(**{**sent[1].__dict__, "checkpoint": h("another")})
    # another checkpoint at a recorded step: the ledger's refusal by name (exit 2), not an outage
    with pytest.raises(ChainRevertError, match=r"reverted with LedgerWrongStep\(expected=3, got=2\)"):
        commits._send(other)
    assert ledger.head(run_id) == (h("ckpt2"), 2)


def test_steps_a_reorganisation_removed_are_committed_again_in_order(anvil, ledger, accounts):
    said: list[str] = []
    snapshot = rpc_call(anvil.url, "evm_snapshot")
    run_id, commits, sent = _commits(ledger, accounts, 1, said.append)
    try:
        # steps 2 and 3 land, then the chain loses them (a reorganisation back to step 1)
        inner = rpc_call(anvil.url, "evm_snapshot")
        commits._sent.update({c.step: c for c in sent})
        nodes = accounts[1:5]
        parent = sent[0].checkpoint
        for step in (2, 3):
            c = StepCommit(run_id=run_id, step=step, parent=parent, checkpoint=h(f"ckpt{step}"),
                           metrics_digest=h("m"), attestations=_attest(ledger, run_id, step, parent, nodes))
            commits.commit(c)
            parent = c.checkpoint
        rpc_call(anvil.url, "evm_revert", [inner])
        assert ledger.head(run_id)[1] == 1
        assert commits.repair(run_id, 3) == [2, 3]
        assert ledger.head(run_id) == (h("ckpt3"), 3)
        assert said == [f"chain: step {s} of run {run_id} was removed by a reorganisation; committing it again"
                        for s in (2, 3)]
        assert commits.repair(run_id, 3) == []
        fresh = StepCommits(ledger, accounts[0], said.append)  # a resumed process: nothing to send again
        rpc_call(anvil.url, "evm_revert", [rpc_call(anvil.url, "evm_snapshot")])
        with pytest.raises(ChainFailure, match="which this process cannot commit again"):
            fresh.repair(run_id, 4)
    finally:
        rpc_call(anvil.url, "evm_revert", [snapshot])


def test_a_reorganisation_between_the_check_and_the_commit_is_repaired_too(anvil, ledger, accounts):
    said: list[str] = []
    snapshot = rpc_call(anvil.url, "evm_snapshot")
    try:
        run_id, commits, sent = _commits(ledger, accounts, 1, said.append)
        before_2 = rpc_call(anvil.url, "evm_snapshot")
        nodes = accounts[1:5]
        c2 = StepCommit(run_id=run_id, step=2, parent=sent[0].checkpoint, checkpoint=h("ckpt2"),
                        metrics_digest=h("m"), attestations=_attest(ledger, run_id, 2, sent[0].checkpoint, nodes))
        commits.commit(c2)
        rpc_call(anvil.url, "evm_revert", [before_2])  # step 2 gone after commit()'s own check
        c3 = StepCommit(run_id=run_id, step=3, parent=c2.checkpoint, checkpoint=h("ckpt3"),
                        metrics_digest=h("m"), attestations=_attest(ledger, run_id, 3, c2.checkpoint, nodes))
        commits._send(c3)  # refused (LedgerWrongStep): step 2 is repaired, then step 3 sent again
        assert ledger.head(run_id) == (h("ckpt3"), 3)
        assert said == [f"chain: step 2 of run {run_id} was removed by a reorganisation; committing it again"]
    finally:
        rpc_call(anvil.url, "evm_revert", [snapshot])


# -- reads at scale -------------------------------------------------------------------------


#: A genesis at block 100,000 (anvil_mine of 100,000 blocks takes over an hour with this
#: anvil: each mined block costs time in proportion to the chain's length).
GENESIS_AT_100K = {
    "config": {"chainId": 31337, **{f"{fork}Block": 0 for fork in (
        "homestead", "eip150", "eip155", "eip158", "byzantium", "constantinople", "petersburg", "istanbul",
        "berlin", "london")}, "shanghaiTime": 0, "cancunTime": 0},
    "number": hex(100_000), "gasLimit": hex(30_000_000), "difficulty": "0x0", "baseFeePerGas": hex(GWEI),
    "timestamp": "0x0", "alloc": {},
}


@pytest.mark.slow
def test_lineage_after_100k_blocks_through_an_endpoint_capped_at_10k_blocks(tmp_path):
    genesis = tmp_path / "genesis.json"
    genesis.write_text(json.dumps(GENESIS_AT_100K))
    with _anvil("--init", str(genesis), "--accounts", "12") as (_, url):
        rpc_call(url, "anvil_mine", [hex(1_000)], timeout=120)  # and some real blocks too
        accounts = dev_accounts(12)
        ledger = Ledger.deploy(Chain(url), accounts[0])
        run_id = _commit_steps(ledger, accounts, 3)
        created = ledger.run_created(run_id)  # uncapped: from block 0 in one query
        uncapped = ledger.steps(run_id)
        head = int(str(rpc_call(url, "eth_blockNumber")), 16)
        p = Proxy(url)
        p.max_log_blocks = 10_000
        try:
            capped = Ledger(Chain(p.url), ledger.registry.address, ledger.ledger.address)
            started = time.monotonic()
            assert capped.run_created(run_id) == created
            assert capped.steps(run_id) == uncapped
            from_zero = time.monotonic() - started
            queries, p.log_queries = p.log_queries, 0
            capped.from_block = head - 20  # what run.json's created_block gives
            started = time.monotonic()
            assert capped.steps(run_id) == uncapped
            from_created = time.monotonic() - started
        finally:
            p.close()
    assert head > 101_000 and p.refused == 0
    assert queries == 3 * (head // 10_000 + 1) and p.log_queries == 2
    print(f"capped lineage of 3 steps at block {head}: {from_zero:.2f} s from block 0 ({queries} eth_getLogs), "
          f"{from_created:.3f} s from the creation block")


# -- at most max_pending steps wait to be committed -----------------------------------------


class _SlowSink:
    """A sink whose first commit takes `delay_s` (a chain outage), with `max_pending` set."""

    def __init__(self, max_pending: int | None, delay_s: float) -> None:
        self.max_pending, self.delay_s = max_pending, delay_s
        self.called: dict[int, float] = {}
        self.returned: dict[int, float] = {}

    def on_genesis(self, genesis: Any) -> None:
        pass

    def on_step(self, step: Any) -> None:
        self.called[step.step] = time.monotonic()
        if step.step == 1:
            time.sleep(self.delay_s)
        self.returned[step.step] = time.monotonic()

    def on_progress(self, progress: Any) -> None:
        pass


@pytest.mark.slow
def test_the_ranks_pause_while_max_pending_steps_wait_to_be_committed():
    from test_trainer import SMALL_JOB

    from trainer.config import load_job
    from trainer.launch import train_local

    job = load_job({**SMALL_JOB, "outer": {"steps": 3, "inner_steps": 20}})
    sink = _SlowSink(max_pending=1, delay_s=4.0)
    assert train_local(job, sink, timeout_s=180) == "completed"
    # Step 2 was trained while step 1 was committed, but step 3 only after step 2 could be
    # handed over: a whole round after step 1's commit returned (measured: 0.30 s). Without
    # the pause both would have been queued long before (measured: 0.013 s).
    assert sink.called[3] - sink.returned[1] > 0.1, (sink.called, sink.returned)
    assert sink.called[2] - sink.returned[1] < 0.1


# -- the job queue's sink ------------------------------------------------------------------


@pytest.mark.slow
def test_a_queued_job_completes_through_a_freeze_and_a_reorganisation_of_the_stacks_chain(tmp_path):
    from workers.queue.jobs import JobStore, connect
    from workers.queue.stack import Stack

    stack = tmp_path / ".dlx"
    up = subprocess.run([DLX, "up", "--workers", "2", "--slots", "2", "--stack", str(stack)], capture_output=True,
                        text=True, timeout=180)
    assert up.returncode == 0, up.stderr
    try:
        s = Stack.load(stack)
        job_file = tmp_path / "job.toml"
        job_file.write_text(small_job_toml("q-faults", seed=3, steps=4, inner_steps=3))
        sub = subprocess.run([DLX, "submit", str(job_file), "--stack", str(stack)], capture_output=True, text=True,
                             timeout=180)
        assert sub.returncode == 0, sub.stderr
        job = sub.stdout.strip()
        store = JobStore(connect(s.redis_url))

        def wait(pred: Any) -> dict[str, Any]:
            deadline = time.monotonic() + 300
            while not pred(rec := store.get(job)):
                assert time.monotonic() < deadline and rec.get("state") not in ("failed", "cancelled"), rec
                time.sleep(0.1)
            return rec

        wait(lambda r: (r.get("step") or 0) >= 1)
        os.kill(s.anvil_pid, signal.SIGSTOP)  # every worker's requests hang for 6 s
        try:
            time.sleep(6)
        finally:
            os.kill(s.anvil_pid, signal.SIGCONT)
        rec = wait(lambda r: (r.get("step") or 0) >= 2)
        ledger = Ledger(Chain(s.rpc), rec["registry"], rec["ledger"])
        before = ledger.head(int(rec["run_id"]))[1]
        rpc_call(s.rpc, "anvil_reorg", [1, []])  # the last block (the head's commit: step 2's, or already step 3's) is gone
        after = ledger.head(int(rec["run_id"]))[1]
        rec = wait(lambda r: r.get("state") in ("completed", "failed", "cancelled"))
        assert rec["state"] == "completed", rec
        commits = ledger.commits(int(rec["run_id"]))
        assert [c.record.step for c in commits if c.status != "rejected"] == [1, 2, 3, 4]
        assert len(commits) == 4
        verify = dlx_here("verify", rec["run_dir"])
        assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
        logs = [*(Path(rec["run_dir"]) / "logs").glob("*.log"), *(stack / "logs").glob("*.log")]
        lines = [line for log in sorted(logs) for line in log.read_text().splitlines() if "chain: " in line]
        print(f"stack: head {before} -> {after} after the reorganisation; sink lines:", *lines, sep="\n  ")
        if after < before:  # the head's commit was the chain's last block: the sink repaired it, either
            # by its head check before the next commit or, when that commit's own receipt was the
            # one that vanished (the sink was already waiting on it), by sending it again
            assert any((f"step {before} of run" in line and "committing it again" in line)
                       or (f"step {before}): the node lost the transaction" in line and "sending it again" in line)
                       for line in lines), lines
    finally:
        subprocess.run([DLX, "down", "--stack", str(stack)], capture_output=True, text=True, timeout=120)
