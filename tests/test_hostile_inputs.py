"""Issue 34's red-team inputs, each a regression test through the real CLI: exit 2 within a
few seconds, one line naming the CID or file, no traceback, in a process whose address
space is capped (RLIMIT_AS), and nothing written outside the target.

Blocks are built by hand (lineage.store.unixfs's dag-pb and UnixFS encoders), put in a
local blockstore, and `dlx cas get / verify / import`, `dlx data prepare` and `dlx verify`
are pointed at them."""

from __future__ import annotations

import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import dag_cbor
import pytest
from multiformats import CID, multihash

from lineage.store.blockstore import Blockstore
from lineage.store.car import encode_header
from lineage.store.cid import DAG_CBOR, DAG_PB, RAW, cid_of_block
from lineage.store.dagpb import (
    T_DIRECTORY,
    T_FILE,
    T_HAMT,
    PBLink,
    PBNode,
    UnixFSData,
    write_varint,
)

DLX = str(Path(sys.executable).parent / "dlx")
GIB = 1 << 30


def dlx(*args: str, mem: int = GIB, timeout: float = 30, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`dlx ARGS` with its address space capped at `mem` bytes; asserts it took under
    `timeout` seconds."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    start = time.monotonic()
    res = subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout, preexec_fn=cap,
                         cwd=cwd, env={**os.environ, "COLUMNS": "300"})
    res.elapsed = time.monotonic() - start  # type: ignore[attr-defined]
    return res


def refused(res: subprocess.CompletedProcess, *needles: str, seconds: float = 10) -> str:
    """One line on stderr, exit 2, no traceback, quickly; the line holds every needle."""
    line = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "\n" not in line and "Traceback" not in line, line
    assert res.elapsed < seconds, res.elapsed  # type: ignore[attr-defined]
    for needle in needles:
        assert needle in line, line
    return line


def _node(store: Blockstore, fs: UnixFSData, links: list[PBLink]) -> CID:
    return store.put(PBNode(fs.encode(), links).encode(), DAG_PB)


def _file_node(store: Blockstore, child: CID, width: int, child_size: int, filesize: int | None = None) -> CID:
    fs = UnixFSData(T_FILE, filesize=width * child_size if filesize is None else filesize,
                    blocksizes=[child_size] * width)
    return _node(store, fs, [PBLink(child, child_size)] * width)


def _snapshot(root: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = os.readlink(p) if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
    return out


@pytest.fixture
def store(tmp_path: Path) -> Blockstore:
    return Blockstore(tmp_path / "blocks")


# --- UnixFS files -------------------------------------------------------------------------


def test_a_file_whose_leaves_outgrow_its_declared_size_stops_at_the_first_lie(tmp_path, store) -> None:
    """Root declares 256 KiB; under it 174^3 leaves of 256 KiB (1.3 TB) in 4 blocks."""
    leaf = store.put(os.urandom(262_144), RAW)
    n1 = _file_node(store, leaf, 174, 262_144)
    n2 = _file_node(store, n1, 174, 174 * 262_144)
    n3 = _file_node(store, n2, 174, 174 * 174 * 262_144)
    root = _node(store, UnixFSData(T_FILE, filesize=262_144, blocksizes=[262_144]), [PBLink(n3, 262_144)])
    for args in (["-o", str(tmp_path / "out")], []):
        res = dlx("cas", "get", str(root), "--store", str(store.root), *args)
        refused(res, str(n3), "parent says 262144")
        assert len(res.stdout) == 0
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_blocksizes_that_lie_about_the_children_are_refused_before_reading_them(store) -> None:
    leaf = store.put(b"x" * 1000, RAW)
    root = _node(store, UnixFSData(T_FILE, filesize=10, blocksizes=[1000, 1000]), [PBLink(leaf, 1000)] * 2)
    refused(dlx("cas", "get", str(root), "--store", str(store.root)), str(root), "add up to 2000 bytes")


def test_a_deep_file_dag_is_refused_at_the_depth_limit(store) -> None:
    node = store.put(b"y", RAW)
    for _ in range(80):
        node = _file_node(store, node, 1, 1)
    refused(dlx("cas", "get", str(node), "--store", str(store.root)), "deeper than 64 levels")


# --- directories and HAMTs ----------------------------------------------------------------


def test_a_directory_naming_2_to_the_40_paths_stops_at_the_entry_limit(tmp_path, store) -> None:
    """42 blocks: a leaf and 41 directories, each naming the one below twice."""
    leaf = store.put(b"hello\n", RAW)
    node = _node(store, UnixFSData(T_DIRECTORY), [PBLink(leaf, 6, "a"), PBLink(leaf, 6, "b")])
    for _ in range(39):
        node = _node(store, UnixFSData(T_DIRECTORY), [PBLink(node, 1, "a"), PBLink(node, 1, "b")])
    out = tmp_path / "out"
    refused(dlx("cas", "get", str(node), "--store", str(store.root), "-o", str(out)),
            str(node), "more than 100000 entries")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["blocks"]


def test_deep_directories_and_deep_hamts_are_refused_at_the_depth_limit(tmp_path, store) -> None:
    leaf = store.put(b"z", RAW)
    node = _node(store, UnixFSData(T_DIRECTORY), [PBLink(leaf, 1, "f")])
    for _ in range(80):
        node = _node(store, UnixFSData(T_DIRECTORY), [PBLink(node, 1, "d")])
    refused(dlx("cas", "get", str(node), "--store", str(store.root), "-o", str(tmp_path / "o1")),
            "deeper than 64 levels")
    shard = _node(store, UnixFSData(T_HAMT, hash_type=0x22, fanout=256), [PBLink(leaf, 1, "00f")])
    for _ in range(80):
        shard = _node(store, UnixFSData(T_HAMT, hash_type=0x22, fanout=256), [PBLink(shard, 1, "00")])
    refused(dlx("cas", "get", str(shard), "--store", str(store.root), "-o", str(tmp_path / "o2")),
            "deeper than 64 levels")


# --- block files that are not blocks --------------------------------------------------------


def test_a_block_file_linked_to_dev_zero_or_a_fifo_is_refused_without_reading_it(tmp_path, store) -> None:
    cid = store.put(b"a block", RAW)
    path = store._path(cid)
    path.unlink()
    path.symlink_to("/dev/zero")
    refused(dlx("cas", "get", str(cid), "--store", str(store.root)), str(cid), "symbolic link")
    path.unlink()
    os.mkfifo(path)
    refused(dlx("cas", "get", str(cid), "--store", str(store.root)), str(cid), "not a regular file")
    res = dlx("cas", "verify", "--store", str(store.root))  # a failed check (1), not a hang
    assert res.returncode == 1 and str(cid) in res.stdout + res.stderr and res.elapsed < 10


def test_a_file_in_the_store_that_is_no_cid_is_named(store) -> None:
    store.put(b"fine", RAW)
    stray = store.root / "ab" / "not-a-cid"
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"?")
    refused(dlx("cas", "verify", "--store", str(store.root)), str(stray), "no CID")


def test_a_cid_naming_another_hash_is_refused_by_name(store) -> None:
    data = b"served under a blake2b name"
    cid = cid_of_block(data)
    fake = CID("base32", 1, RAW, multihash.wrap(bytes(cid.raw_digest), "blake2b-256"))
    store.put(data, RAW)
    refused(dlx("cas", "get", str(fake), "--store", str(store.root)), str(fake), "blake2b-256")
    shard = store.root / str(fake)[-3:-1]
    shard.mkdir(exist_ok=True)
    (shard / str(fake)).write_bytes(data)
    refused(dlx("cas", "verify", "--store", str(store.root)), str(fake))


# --- writes -----------------------------------------------------------------------------------


def test_restoring_into_a_directory_never_follows_a_planted_symlink(tmp_path, store) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "g.txt").write_text("keep")
    from lineage.store.unixfs_dir import import_tree

    root = import_tree([("g.txt", b"new g"), ("sub/f.txt", b"new f")], store.put)
    out = tmp_path / "out"
    out.mkdir()
    (out / "g.txt").symlink_to(outside / "g.txt")
    (out / "sub").symlink_to(outside, target_is_directory=True)
    before = _snapshot(outside)
    refused(dlx("cas", "get", str(root), "--store", str(store.root), "-o", str(out)), "sub", "symlink")
    assert _snapshot(outside) == before
    assert (out / "g.txt").read_bytes() == b"new g" and not (out / "g.txt").is_symlink()


def test_a_file_get_never_writes_through_or_removes_what_sits_at_a_temporary_name(tmp_path, store) -> None:
    cid = store.put(b"payload", RAW)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "victim").write_text("keep")
    (out / ".f.dlx-tmp").symlink_to(tmp_path / "victim")  # the old temporary name
    (out / ".dlx-tmp").write_text("mine")
    res = dlx("cas", "get", str(cid), "--store", str(store.root), "-o", str(out / "f"))
    assert res.returncode == 0, res.stderr
    assert (out / "f").read_bytes() == b"payload" and (tmp_path / "victim").read_text() == "keep"
    assert (out / ".dlx-tmp").read_text() == "mine" and (out / ".f.dlx-tmp").is_symlink()


# --- DAG-CBOR and CAR --------------------------------------------------------------------


def _car(roots: list, blocks: list[tuple[CID, bytes]]) -> bytes:
    header = dag_cbor.encode({"roots": roots, "version": 1}) if not isinstance(roots, bytes) else roots
    out = io.BytesIO()
    out.write(write_varint(len(header)) + header)
    for cid, block in blocks:
        section = bytes(cid) + block
        out.write(write_varint(len(section)) + section)
    return out.getvalue()


def test_deep_cbor_and_car_roots_that_are_no_cids_are_refused(tmp_path, store) -> None:
    deep = b"\x81" * 5000 + b"\x00"
    cid = cid_of_block(deep, DAG_CBOR)
    cases = {
        "deep.car": (_car([cid], [(cid, deep)]), [str(cid), "nested deeper than 64"]),
        "number-root.car": (_car([1], []), ["root that is no CID"]),
        "text-root.car": (_car(["hello"], []), ["root that is no CID"]),
        "deep-header.car": (_car(b"\x81" * 5000 + b"\x00", []), ["CAR header", "nested deeper"]),
        "indefinite.car": (_car(b"\x9f" * 100, []), ["CAR header", "indefinite"]),
    }
    assert encode_header([cid])  # the encoder this test's CARs mimic
    for name, (blob, needles) in cases.items():
        (tmp_path / name).write_bytes(blob)
        refused(dlx("cas", "import", str(tmp_path / name), "--store", str(store.root)), *needles)
    assert not list(store)


# --- job files, init directories, run directories ----------------------------------------------


JOB = """name = "h"
[model]
{model}
[data]
source = "files"
paths = ["corpus/*.txt"]
{data}
[outer]
steps = 1
inner_steps = 1
"""


@pytest.mark.slow  # not in --quick: a `dlx` run per input
def test_hostile_job_inputs_are_one_line_errors(tmp_path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text " * 400)
    init = tmp_path / "init"
    init.mkdir()
    (init / "config.json").write_text('{"model_type": "llama", "hidden_size": ' + "1" * 100_000 + "}")
    (tmp_path / "big-int.toml").write_text(JOB.format(model='family = "llama"\ninit = "init"', data=""))
    refused(dlx("data", "prepare", "big-int.toml", cwd=tmp_path, mem=4 * GIB), "config.json", "not valid JSON")
    os.mkfifo(tmp_path / "tok.json")
    (tmp_path / "fifo-tok.toml").write_text(JOB.format(model="vocab_size = 512", data='tokenizer = "tok.json"'))
    refused(dlx("data", "prepare", str(tmp_path / "fifo-tok.toml"), mem=4 * GIB), "tok.json", "not a regular file")
    os.mkfifo(tmp_path / "fifo.toml")
    refused(dlx("data", "prepare", str(tmp_path / "fifo.toml"), mem=4 * GIB), "fifo.toml", "not a regular file")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    refused(dlx("data", "prepare", str(tmp_path / "deep.toml"), mem=4 * GIB), "deep.toml")


@pytest.mark.slow  # not in --quick: `dlx` runs under a memory cap
def test_a_run_json_with_a_huge_integer_is_a_one_line_error(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"run_id": ' + "9" * 100_000 + "}")
    refused(dlx("verify", "--run-dir", str(run), mem=4 * GIB, timeout=60), "run.json", seconds=30)
    (run / "run.json").write_text(json.dumps({"x": 1}) + " " * (17 << 20))
    refused(dlx("verify", "--run-dir", str(run), mem=4 * GIB, timeout=60), "run.json", seconds=30)


def test_a_consistent_terabyte_over_one_leaf_is_not_read_into_memory(tmp_path, store) -> None:
    """Sizes that add up (174^3 leaves of 256 KiB, the same leaf) declare 1.3 TB: a reader
    into memory (`read_bytes`: shards, contributions) refuses it before the first leaf."""
    leaf = store.put(os.urandom(262_144), RAW)
    node = leaf
    for level in range(4):
        node = _file_node(store, node, 174, 174 ** level * 262_144)
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
              "from lineage.store.blockstore import Blockstore\nfrom lineage.store.unixfs import read_bytes\n"
              "from lineage.errors import StorageError\n"
              f"try:\n    read_bytes(Blockstore({str(store.root)!r}), {str(node)!r})\n"
              "except StorageError as exc:\n    print(exc)\n    sys.exit(2)\n")
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "more than the" in res.stdout and str(node) in res.stdout, res.stdout + res.stderr
    assert time.monotonic() - start < 10
