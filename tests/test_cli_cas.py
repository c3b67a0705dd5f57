"""`dlx cas`: add, cid, get, export, import, verify, gc (in-process, on a local store)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.car import export_car
from lineage.store.cid import parse_cid
from lineage.store.manifest import Manifest, put_config, put_manifest
from lineage.store.unixfs import file_cid, import_bytes
from workers.cli import app


@pytest.fixture()
def dlx(tmp_path, monkeypatch):
    monkeypatch.setenv("DLX_STORE", str(tmp_path / "store"))
    monkeypatch.delenv("DLX_IPFS_API", raising=False)
    runner = CliRunner()

    def run(*args: str):
        return runner.invoke(app, ["cas", *map(str, args)])

    return run


def _file(tmp_path: Path, size: int, seed: int = 0) -> Path:
    path = tmp_path / f"f{size}-{seed}.bin"
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def test_add_prints_the_kubo_cid_and_get_gives_the_bytes_back(dlx, tmp_path):
    src = _file(tmp_path, 600_000)
    res = dlx("add", src)
    assert res.exit_code == 0, res.output
    cid = res.stdout.strip()
    assert cid == str(file_cid(src.read_bytes()))
    assert dlx("get", cid, "-o", tmp_path / "back").exit_code == 0
    assert (tmp_path / "back").read_bytes() == src.read_bytes()


def test_cid_computes_both_versions_and_stores_nothing(dlx, tmp_path):
    src = _file(tmp_path, 300_000)
    assert dlx("cid", src).stdout.strip() == str(file_cid(src.read_bytes(), 1))
    assert dlx("cid", "--cid-version", "0", src).stdout.strip() == str(file_cid(src.read_bytes(), 0))
    assert not (tmp_path / "store").exists()


def test_a_flipped_bit_fails_get_and_verify_naming_the_cid(dlx, tmp_path):
    src = _file(tmp_path, 1000)
    cid = parse_cid(dlx("add", src).stdout.strip())
    path = Blockstore(tmp_path / "store")._path(cid)
    raw = bytearray(path.read_bytes())
    raw[10] ^= 0x04
    path.write_bytes(bytes(raw))
    res = dlx("get", cid, "-o", tmp_path / "out")
    assert res.exit_code == 2 and str(cid) in res.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written under the real name
    res = dlx("verify")
    assert res.exit_code == 1 and f"corrupt {cid}" in res.stdout


def test_user_errors_are_one_line_with_exit_code_2(dlx, tmp_path):
    for args in (("get", "not-a-cid", "-o", tmp_path / "x"), ("add", tmp_path / "missing"),
                 ("import", tmp_path / "missing.car"),
                 ("get", str(file_cid(b"nowhere")), "-o", tmp_path / "x")):
        res = dlx(*args)
        assert res.exit_code == 2, (args, res.output)
        assert res.stderr.startswith("dlx: error: ") and res.stderr.count("\n") == 1, res.stderr


def _run_dir(tmp_path: Path) -> tuple[Path, str]:
    run_dir = tmp_path / "run"
    store = Blockstore(run_dir / "blocks")
    config = put_config(store, {"name": "cli"})
    shard = import_bytes(random.Random(1).randbytes(400_000), store.put).cid
    genesis = put_manifest(store, Manifest(0, None, config, [shard], b"\0" * 32))
    head = put_manifest(store, Manifest(1, genesis, config, [shard], b"\0" * 32, run=1,
                                        contributions=[[import_bytes(b"c", store.put).cid]], data=[b"d"]))
    store.put(b"an unreferenced block")
    RunRecord(name="cli", chain_id=1, rpc=None, chain_state=None, registry="0x", ledger="0x",
              blocks="blocks", genesis=str(genesis), head=str(head)).save(run_dir)
    return run_dir, str(head)


def test_export_a_run_then_import_it_elsewhere(dlx, tmp_path):
    run_dir, head = _run_dir(tmp_path)
    car = tmp_path / "run.car"
    res = dlx("export", "--run-dir", run_dir, "-o", car)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == head
    res = dlx("import", car)
    assert res.exit_code == 0, res.output
    assert res.stdout.split() == [head]
    imported = Blockstore(tmp_path / "store")
    assert len(list(imported)) == len(list(Blockstore(run_dir / "blocks"))) - 1  # not the stray block
    assert imported.verify() == []


def test_gc_removes_only_unpinned_blocks(dlx, tmp_path):
    run_dir, head = _run_dir(tmp_path)
    store = Blockstore(run_dir / "blocks")
    store.pin("cli-1", [parse_cid(head)])
    stray = store.put(b"an unreferenced block")
    before = set(map(str, store))
    res = dlx("gc", "--run-dir", run_dir, "--grace", "0")
    assert res.exit_code == 0, res.output
    assert res.stdout.split() == ["removed", str(stray)]
    assert set(map(str, store)) == before - {str(stray)}
    # a young unpinned block is kept by the grace period
    young = store.put(b"just written")
    assert dlx("gc", "--run-dir", run_dir).exit_code == 0 and store.has(young)


def test_a_truncated_car_import_fails_and_leaves_the_store_unchanged(dlx, tmp_path):
    src = Blockstore(tmp_path / "src")
    root = import_bytes(random.Random(2).randbytes(700_000), src.put).cid
    car = tmp_path / "t.car"
    with open(car, "wb") as fh:
        export_car(src, [root], fh)
    car.write_bytes(car.read_bytes()[:-1000])
    res = dlx("import", car)
    assert res.exit_code == 2 and "truncated CAR" in res.stderr
    assert list(Blockstore(tmp_path / "store")) == []
