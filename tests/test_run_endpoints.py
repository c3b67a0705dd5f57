"""Issue 34, point 5: a run directory is untrusted data. `dlx verify`, `dlx lineage` and
`dlx cas` print which chain and blocks they will use, and refuse a chain or IPFS endpoint
from run.json that is not on this machine unless the user chose one (`--rpc`,
`--ipfs-api`) or passes `--trust-run-endpoints`. Nothing here reaches the network: the
refused addresses are documentation ranges (RFC 5737), and the refusal comes first."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from dlx_testing.here import dlx_here

from lineage.chain.runrecord import RunRecord
from workers.cli.common import is_loopback

FAR_RPC = "http://203.0.113.5:8545"
FAR_IPFS = "/ip4/198.51.100.7/tcp/5001/http"


def _dlx(*args: str) -> subprocess.CompletedProcess:
    """`dlx ARGS` in this process (tests/dlx_testing/here.py): what it contacts, and that it
    answers in seconds rather than after a far endpoint's timeouts, is the point here."""
    start = time.monotonic()
    res = dlx_here(*args, env={"COLUMNS": "300"})
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


HEAD = "bafyreigdmqpykrgxyaxtlafqpqhcsmlpvtuhbkdxq5vkkkxnfsyulbqgom"  # any dag-cbor CID: nothing is read


@pytest.mark.parametrize("command", [["export", "{run}", "-o", "{out}"], ["generate", "{run}", "--prompt", "x"],
                                     ["lineage", "diff", "{run}", "{run}"],
                                     ["export", HEAD, "--run-dir", "{run}", "-o", "{out}"]])
def test_reading_a_runs_blocks_refuses_its_far_ipfs_api(tmp_path: Path, command: list[str]) -> None:
    run = _run(tmp_path, rpc="http://127.0.0.1:9", ipfs_api=FAR_IPFS, head=HEAD)
    res = _dlx(*(a.format(run=run, out=tmp_path / "out") for a in command))
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and FAR_IPFS in line and "--trust-run-endpoints" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["lineage", "5"], ["verify", "5"], ["export", "5", "-o", "{out}"]])
def test_a_run_id_read_through_a_run_directorys_far_chain_is_refused(tmp_path: Path, command: list[str]) -> None:
    run = _run(tmp_path)  # run 1's directory, naming the chain where run 5 would be read
    res = _dlx(*(a.format(out=tmp_path / "out") for a in command), "--run-dir", str(run))
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert "\n" not in line and FAR_RPC in line and "--trust-run-endpoints" in line, line


def test_lineage_compare_refuses_a_far_chain(tmp_path: Path) -> None:
    run = _run(tmp_path)
    res = _dlx("lineage", "compare", str(run), str(run))
    assert res.returncode == 2 and FAR_RPC in res.stderr and "--trust-run-endpoints" in res.stderr, res.stderr


@pytest.mark.parametrize(("extra", "said"), [
    (["--trust-run-endpoints"], f"blocks from IPFS API {FAR_IPFS} (run.json)"),
    (["--ipfs-api", "/ip4/127.0.0.1/tcp/9/http"], "blocks from IPFS API /ip4/127.0.0.1/tcp/9/http (--ipfs-api)"),
])
@pytest.mark.parametrize("command", [["export", "-o", "{out}"], ["generate", "--prompt", "x"]])
def test_export_and_generate_say_which_blocks_they_read(tmp_path: Path, command: list[str], extra: list[str],
                                                         said: str) -> None:
    run = _run(tmp_path, ipfs_api=FAR_IPFS)  # no checkpoint yet: it stops before reading a block
    res = _dlx(command[0], str(run), *(a.format(out=tmp_path / "out") for a in command[1:]), *extra)
    assert res.stderr.splitlines()[0] == f"dlx: run {run}: {said}", res.stderr
    assert res.returncode == 2 and "has no checkpoint yet" in res.stderr


def test_verify_of_a_run_directory_reads_the_users_ipfs_api(tmp_path: Path) -> None:
    run = _run(tmp_path, rpc="http://127.0.0.1:9", ipfs_api=FAR_IPFS)
    res = _dlx("verify", str(run), "--ipfs-api", "/ip4/127.0.0.1/tcp/9/http")  # not refused: the user's own
    first = res.stderr.splitlines()[0]
    assert first == f"dlx: run {run}: chain http://127.0.0.1:9 (run.json); blocks from IPFS API " \
                    "/ip4/127.0.0.1/tcp/9/http (--ipfs-api)", res.stderr
    assert res.returncode == 2 and FAR_IPFS not in res.stderr


@pytest.mark.slow
def test_a_real_run_is_verified_and_exported_from_the_users_store(trained_run, tmp_path: Path) -> None:
    """The run's blocks moved away and its run.json naming a far IPFS API: with --store the
    run directory is still verified and exported, from the user's store, never the far API."""
    import json
    import shutil

    run = Path(shutil.copytree(trained_run[0], tmp_path / "run"))
    record = RunRecord.load(run)
    moved = Path(shutil.move(record.blocks_dir(run), tmp_path / "moved"))
    doc = json.loads((run / "run.json").read_text())
    doc.update(ipfs_api=FAR_IPFS)
    (run / "run.json").write_text(json.dumps(doc))
    res = _dlx("verify", str(run), "--store", str(moved), "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout)["ok"] and f"blocks from {moved} (--store)" in res.stderr.splitlines()[0]
    res = _dlx("export", str(run), "--store", str(moved), "-o", str(tmp_path / "hf"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "hf" / "lineage.json").read_text())["checkpoint"] == record.head
    res = _dlx("export", str(run), "-o", str(tmp_path / "far"))
    assert res.returncode == 2 and FAR_IPFS in res.stderr and not (tmp_path / "far").exists(), res.stderr
