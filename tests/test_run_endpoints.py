"""Issue 34, point 5: a run directory is untrusted data. `dlx verify`, `dlx lineage` and
`dlx cas` print which chain and blocks they will use, and refuse a chain or IPFS endpoint
from run.json that is not on this machine unless the user chose one (`--rpc`,
`--ipfs-api`) or passes `--trust-run-endpoints`. Nothing here reaches the network: the
refused addresses are documentation ranges (RFC 5737), and the refusal comes first."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lineage.chain.runrecord import RunRecord
from workers.cli_common import is_loopback

DLX = str(Path(sys.executable).parent / "dlx")
FAR_RPC = "http://203.0.113.5:8545"
FAR_IPFS = "/ip4/198.51.100.7/tcp/5001/http"


def _dlx(*args: str) -> subprocess.CompletedProcess:
    start = time.monotonic()
    res = subprocess.run([DLX, *args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "300"})
    assert time.monotonic() - start < 30
    return res


def _run(tmp_path: Path, **fields: object) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "blocks").mkdir()
    RunRecord(**{"name": "far", "chain_id": 1, "rpc": FAR_RPC, "chain_state": None, "registry": "0x" + "1" * 40,
                 "ledger": "0x" + "2" * 40, "blocks": "blocks", "run_id": 1, **fields}).save(run)  # type: ignore[arg-type]
    return run


def test_loopback_endpoints_are_told_from_others() -> None:
    for near in ("http://127.0.0.1:8545", "http://localhost:1", "http://[::1]:8545", "/ip4/127.0.0.1/tcp/5001/http",
                 "/ip6/::1/tcp/5001"):
        assert is_loopback(near), near
    for far in (FAR_RPC, FAR_IPFS, "http://example.com:8545", "/dns4/example.com/tcp/5001", "not a url", ""):
        assert not is_loopback(far), far


@pytest.mark.parametrize("command", [["verify"], ["lineage"]])
def test_a_far_chain_named_by_a_run_directory_is_refused(tmp_path: Path, command: list[str]) -> None:
    run = _run(tmp_path)
    res = _dlx(*command, str(run))
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and FAR_RPC in line and "--trust-run-endpoints" in line and "--rpc" in line, line


def test_a_far_ipfs_api_named_by_a_run_directory_is_refused(tmp_path: Path) -> None:
    run = _run(tmp_path, rpc="http://127.0.0.1:9", ipfs_api=FAR_IPFS)
    res = _dlx("verify", str(run))
    assert res.returncode == 2 and FAR_IPFS in res.stderr and "--trust-run-endpoints" in res.stderr, res.stderr


def test_the_users_own_rpc_is_used_and_said(tmp_path: Path) -> None:
    run = _run(tmp_path)
    res = _dlx("verify", str(run), "--rpc", "http://127.0.0.1:9")  # nothing listens on port 9
    lines = res.stderr.strip().splitlines()
    assert lines[0] == f"dlx: run {run}: chain http://127.0.0.1:9 (--rpc); blocks from {run / 'blocks'}", lines
    assert res.returncode == 2 and FAR_RPC not in res.stderr


def test_trusting_the_run_says_what_it_will_use(tmp_path: Path) -> None:
    run = _run(tmp_path, rpc="http://127.0.0.1:9", ipfs_api=FAR_IPFS)
    res = _dlx("lineage", str(run), "--trust-run-endpoints")  # the chain on port 9 does not answer: exit 2
    first = res.stderr.strip().splitlines()[0]
    assert first == f"dlx: run {run}: chain http://127.0.0.1:9 (run.json); blocks from IPFS API {FAR_IPFS} (run.json)"


def test_cas_on_a_run_directory_says_it_reads_the_runs_blockstore(tmp_path: Path) -> None:
    run = _run(tmp_path, ipfs_api=FAR_IPFS)
    res = _dlx("cas", "verify", "--run-dir", str(run))  # the run's directory, never its IPFS API
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == f"dlx: run {run}: blocks from {run / 'blocks'}, not its IPFS API {FAR_IPFS}"
    res = _dlx("cas", "gc", "--run-dir", str(run), "--keep", "last:1")  # retention reads the run's chain
    assert res.returncode == 2 and FAR_RPC in res.stderr and "--trust-run-endpoints" in res.stderr, res.stderr
