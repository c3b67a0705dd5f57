"""UnixFS directories: our root CIDs equal `ipfs add -r`'s, and trees come back byte for byte.

Oracle (not our code): npm `ipfs-unixfs-importer` with Kubo's settings
(tests/oracles/unixfs_dir.mjs, one node process for the module), in its "kubo" mode: each
directory imported bottom up as Kubo's MFS does. Its "paths" mode (the importer's own tree
builder) is checked to agree wherever subdirectories do not decide a shard. A missing
oracle fails the test rather than skipping it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lineage.errors import CorruptBlockError, StorageError
from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_PB, RAW
from lineage.store.dagpb import T_DIRECTORY, T_HAMT, PBLink, PBNode, UnixFSData
from lineage.store.unixfs import file_cid
from lineage.store.unixfs_dir import (
    HAMT_THRESHOLD,
    TreeInputError,
    import_directory,
    import_tree,
    is_directory,
    list_tree,
    murmur3_x64_64,
    read_tree,
)

ROOT = Path(__file__).resolve().parents[1]
ORACLE = ROOT / "tests" / "oracles" / "unixfs_dir.mjs"
DLX = str(Path(sys.executable).with_name("dlx"))
CID_LEN = {0: 34, 1: 36}

Tree = dict  # name -> bytes (a file) or Tree (a directory)


class JsDirImporter:
    """One long-lived `node unixfs_dir.mjs --serve`: a request per line, an answer per line."""

    def __init__(self) -> None:
        node = shutil.which("node")
        assert node, "node is not installed (scripts/setup installs the oracles)"
        assert (ROOT / "node_modules" / "ipfs-unixfs-importer").is_dir(), \
            "npm ipfs-unixfs-importer is missing: run scripts/setup"
        self.proc = subprocess.Popen([node, str(ORACLE), "--serve"], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def ask(self, req: dict) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        assert "error" not in reply, reply
        return reply

    def cid(self, path: Path, cid_version: int = 1, mode: str = "kubo") -> str:
        return self.ask({"dir": str(path), "cidVersion": cid_version, "mode": mode})["cid"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def js():
    oracle = JsDirImporter()
    yield oracle
    oracle.close()


def write_tree(root: Path, tree: Tree) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, value in tree.items():
        if isinstance(value, dict):
            write_tree(root / name, value)
        else:
            (root / name).write_bytes(value)


def entries_of(tree: Tree, prefix: str = "") -> list[tuple[str, bytes]]:
    out = []
    for name, value in tree.items():
        if isinstance(value, dict):
            out += entries_of(value, f"{prefix}{name}/")
        else:
            out.append((prefix + name, value))
    return out


def assert_matches(js: JsDirImporter, root: Path, tree: Tree, *, entries_too: bool = True) -> None:
    """Ours (from disk and, where the tree has no empty directory, from entries) == the oracle's."""
    write_tree(root, tree)
    for version in (0, 1):
        ours = str(import_directory(root, cid_version=version))
        assert ours == js.cid(root, version), (version, root)
        if entries_too:
            assert str(import_tree(entries_of(tree), cid_version=version)) == ours


BIG = random.Random(7).randbytes(3 * 262_144 + 1234)  # four chunks: a dag-pb file root

CASES: dict[str, Tree] = {
    "flat": {"a.txt": b"hello\n", "b.bin": b"\x00\x01\x02", "c": b"x" * 1000},
    "nested": {"top.txt": b"t", "sub": {"inner.txt": b"i", "deeper": {"leaf": b"l" * 300}}},
    "empty files": {"empty": b"", "sub": {"also-empty": b"", "x": b"x"}},
    "unicode names": {"ünïcødé.txt": b"u", "日本語": {"ファイル": b"j"}, "emoji 🎉": b"e", "Zed": b"z"},
    "byte order": {n: n.encode() for n in ["a", "a.txt", "a-b", "A", "a0", "é", "z", "~", "ab", "a b"]},
    "multi-block file": {"big.bin": BIG, "small": b"s", "d": {"big-again.bin": BIG[:262_145]}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_trees_match_the_js_importer(js, tmp_path, case):
    assert_matches(js, tmp_path / "t", CASES[case])
    assert js.cid(tmp_path / "t", 1, "paths") == js.cid(tmp_path / "t", 1)


def test_empty_directories_match_kubo(js, tmp_path):
    # Kubo's well-known empty directory CIDs, and an empty directory inside a tree.
    (tmp_path / "e").mkdir()
    assert str(import_directory(tmp_path / "e", cid_version=0)) == "QmUNLLsPACCz1vLxQVkXqqLX5R1X345qqfHbsf67hvA3Nn"
    assert str(import_tree([])) == "bafybeiczsscdsbs7ffqz55asqdf3smv6klcw3gofszvwlyarci47bgf354"
    assert js.cid(tmp_path / "e", 1) == str(import_directory(tmp_path / "e"))
    assert_matches(js, tmp_path / "t", {"f": b"f", "empty": {}, "sub": {"empty-too": {}}}, entries_too=False)


def _many(count: int, width: int) -> Tree:
    return {f"{i:0{width}d}": str(i).encode() for i in range(count)}


@pytest.mark.slow  # thousands of entries through the node importer: not in --quick
def test_a_directory_past_the_threshold_shards_as_the_js_importer_does(js, tmp_path):
    tree = _many(5300, 15)  # 5300 x (15 + 36) bytes > 256 KiB for CIDv1 and CIDv0
    assert_matches(js, tmp_path / "t", tree)
    store = Blockstore(tmp_path / "bs")
    root = import_tree(entries_of(tree), store.put)
    node = PBNode.decode(store.get(root))
    fs = UnixFSData.decode(node.data or b"")
    assert (fs.type, fs.fanout, fs.hash_type, len(node.links)) == (T_HAMT, 256, 0x22, 256)
    listed = list_tree(store, root)
    assert [p for p, _, _ in listed] == sorted(tree)
    assert all(cid == file_cid(tree[p]) and size == len(tree[p]) for p, cid, size in listed)


@pytest.mark.slow  # thousands of entries through the node importer: not in --quick
def test_exactly_at_the_threshold_stays_a_plain_directory(js, tmp_path):
    # 4096 x (28 + 36) == 262144: not above the threshold; one more name byte is.
    at = _many(4096, 28)
    assert 4096 * (28 + CID_LEN[1]) == HAMT_THRESHOLD
    above = dict(at, **{"x" * 29: b"x"})
    del above[f"{0:028d}"]
    store = Blockstore(tmp_path / "bs")
    for name, tree, kind in (("at", at, T_DIRECTORY), ("above", above, T_HAMT)):
        write_tree(tmp_path / name, tree)
        root = import_tree(entries_of(tree), store.put)
        assert str(root) == js.cid(tmp_path / name, 1)
        assert UnixFSData.decode(PBNode.decode(store.get(root)).data or b"").type == kind


@pytest.mark.slow  # not in --quick: the JS importer per case
def test_subdirectories_count_in_their_parents_shard_estimate(js, tmp_path):
    # 3000 files and 3000 one-file subdirectories: past the threshold only if the
    # subdirectories count, as they do in Kubo's MFS (the importer's own tree builder
    # leaves them out, so its "paths" mode keeps the directory plain).
    tree: Tree = {f"f-{i:06d}.txt": b"%d" % i for i in range(3000)}
    tree.update({f"d-{i:06d}": {"x": b"%d" % i} for i in range(3000)})
    write_tree(tmp_path / "t", tree)
    ours = import_tree(entries_of(tree))
    assert str(ours) == js.cid(tmp_path / "t", 1)
    assert js.cid(tmp_path / "t", 1, "paths") != str(ours)


def test_murmur3_is_the_importers_hamt_hash(js):
    rng = random.Random(3)
    for size in [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 100]:
        data = rng.randbytes(size)
        assert murmur3_x64_64(data).hex() == js.ask({"murmur3": data.hex()})["hash"], size


NAME = st.text(st.characters(codec="utf-8", exclude_characters="/\0"), min_size=1, max_size=12).filter(
    lambda n: not n.startswith(".") and len(n.encode()) <= 200)
TREES = st.recursive(
    st.dictionaries(NAME, st.binary(max_size=300), max_size=4),
    lambda sub: st.dictionaries(NAME, st.one_of(st.binary(max_size=300), sub), min_size=1, max_size=4),
    max_leaves=12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=TREES)
def test_generated_small_trees_match_and_come_back(js, tree):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "t"
        assert_matches(js, root, tree, entries_too=False)
        store = Blockstore(Path(tmp) / "bs")
        cid = import_directory(root, store.put)
        read_tree(store, cid, Path(tmp) / "back")
        assert import_directory(Path(tmp) / "back") == cid
        assert [p for p, _, _ in list_tree(store, cid)] == sorted(p for p, _ in entries_of(tree))


# -- reading back ----------------------------------------------------------------------------


def _tree_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("version", [0, 1])
def test_round_trip_restores_byte_identical_trees(tmp_path, version):
    tree = dict(CASES["nested"], **CASES["multi-block file"], **{"empty dir": {}, "ünï": {"x": b""}})
    write_tree(tmp_path / "src", tree)
    store = Blockstore(tmp_path / "bs")
    root = import_directory(tmp_path / "src", store.put, cid_version=version)
    assert is_directory(store, root)
    listed = list_tree(store, root)
    files = entries_of(tree)
    assert listed == sorted((p, file_cid(d, version), len(d)) for p, d in files)
    assert not is_directory(store, listed[0][1])
    assert read_tree(store, root, tmp_path / "out") == len(files)
    assert _tree_files(tmp_path / "out") == _tree_files(tmp_path / "src")
    assert (tmp_path / "out" / "empty dir").is_dir()
    assert not list(tmp_path.glob(".*dlx-tmp"))


def test_import_directory_skips_hidden_entries_and_refuses_symlinks(tmp_path):
    write_tree(tmp_path / "a", {"x": b"x", "sub": {"y": b"y"}})
    write_tree(tmp_path / "b", {"x": b"x", ".hidden": b"h", "sub": {"y": b"y", ".git": {"z": b"z"}}})
    assert import_directory(tmp_path / "a") == import_directory(tmp_path / "b")
    os.symlink(tmp_path / "a" / "x", tmp_path / "b" / "link")
    with pytest.raises(TreeInputError, match="link is a symlink"):
        import_directory(tmp_path / "b")
    with pytest.raises(TreeInputError, match="is not a directory"):
        import_directory(tmp_path / "a" / "x")


def test_a_name_that_is_not_utf8_is_refused(tmp_path):
    (tmp_path / "t").mkdir()
    fd = os.open(os.fsencode(tmp_path / "t") + b"/bad-\xff", os.O_CREAT | os.O_WRONLY)
    os.close(fd)
    with pytest.raises(TreeInputError, match="not valid UTF-8"):
        import_directory(tmp_path / "t")


def test_read_tree_into_an_existing_directory_keeps_other_files(tmp_path):
    store = Blockstore(tmp_path / "bs")
    root = import_tree([("a/x", b"new"), ("y", b"y")], store.put)
    write_tree(tmp_path / "out", {"a": {"x": b"old", "keep": b"k"}})
    assert read_tree(store, root, tmp_path / "out") == 2
    assert _tree_files(tmp_path / "out") == {"a/keep": b"k", "a/x": b"new", "y": b"y"}


@pytest.mark.parametrize("path", ["../x", "/abs", "a//b", "a/./b", "a/..", ""])
def test_import_tree_refuses_paths_no_entry_can_have(path):
    with pytest.raises(TreeInputError):
        import_tree([(path, b"x")])


def test_import_tree_refuses_a_path_twice_or_a_file_as_a_directory():
    with pytest.raises(TreeInputError, match="twice"):
        import_tree([("a", b"1"), ("a", b"2")])
    with pytest.raises(TreeInputError, match="is a file"):
        import_tree([("a", b"1"), ("a/b", b"2")])


def test_a_corrupt_block_fails_naming_its_cid(tmp_path):
    store = Blockstore(tmp_path / "bs")
    root = import_tree([("d/f.txt", b"hello"), ("g", b"world")], store.put)
    sub = next(ln.cid for ln in PBNode.decode(store.get(root)).links if ln.name == "d")
    leaf = next(cid for p, cid, _ in list_tree(store, root) if p == "g")
    for victim, call in ((leaf, lambda: read_tree(store, root, tmp_path / "out")),
                         (sub, lambda: list_tree(store, root))):
        path = store._path(victim)
        good = path.read_bytes()
        path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(CorruptBlockError, match=str(victim)):
            call()
        path.write_bytes(good)
    assert not (tmp_path / "out").exists()  # a new output directory appears complete or not at all


@pytest.mark.parametrize("name", ["..", "a/b", "", "."])
def test_read_tree_refuses_names_that_escape(tmp_path, name):
    store = Blockstore(tmp_path / "bs")
    leaf = store.put(b"evil", RAW)
    node = PBNode(UnixFSData(T_DIRECTORY).encode(), [PBLink(leaf, 4, name)]).encode()
    root = store.put(node, DAG_PB)
    with pytest.raises(StorageError, match=str(root)):
        read_tree(store, root, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "evil").exists()


def test_list_tree_of_a_file_is_an_error(tmp_path):
    store = Blockstore(tmp_path / "bs")
    leaf = import_tree([("f", b"x")], store.put)
    file = list_tree(store, leaf)[0][1]
    with pytest.raises(StorageError, match="not a UnixFS directory"):
        list_tree(store, file)


# -- the CLI ---------------------------------------------------------------------------------


def _dlx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DLX, "cas", *args], capture_output=True, text=True, timeout=120)


def test_cli_add_r_then_get_o_restores_the_tree(tmp_path):
    write_tree(tmp_path / "src", CASES["unicode names"] | {"big": BIG})
    store = str(tmp_path / "bs")
    add = _dlx("add", "-r", str(tmp_path / "src"), "--store", store)
    assert add.returncode == 0, add.stderr
    cid = add.stdout.strip()
    assert cid == str(import_directory(tmp_path / "src"))
    v0 = _dlx("cid", "-r", "--cid-version", "0", str(tmp_path / "src"))
    assert v0.stdout.strip() == str(import_directory(tmp_path / "src", cid_version=0))
    get = _dlx("get", cid, "-o", str(tmp_path / "out"), "--store", store)
    assert get.returncode == 0, get.stderr
    assert _tree_files(tmp_path / "out") == _tree_files(tmp_path / "src")
    zed = dict((p, c) for p, c, _ in list_tree(Blockstore(store), cid))["Zed"]
    one = _dlx("get", str(zed), "--store", store)  # a file's CID: today's behaviour, to stdout
    assert one.returncode == 0 and one.stdout == "z", one.stderr


def test_cli_errors_are_one_line_exit_2(tmp_path):
    write_tree(tmp_path / "src", {"f": b"f"})
    os.symlink(tmp_path / "src" / "f", tmp_path / "lnk")
    write_tree(tmp_path / "withlink", {"g": b"g"})
    os.symlink(tmp_path / "src" / "f", tmp_path / "withlink" / "l")
    store = str(tmp_path / "bs")
    cid = _dlx("add", "-r", str(tmp_path / "src"), "--store", store).stdout.strip()
    cases = [
        (("add", str(tmp_path / "src"), "--store", store), "is a directory; add -r"),
        (("cid", "-r", str(tmp_path / "src" / "f")), "is not a directory"),
        (("cid", "-r", str(tmp_path / "nope")), "no such file or directory"),
        (("add", "-r", str(tmp_path / "withlink"), "--store", store), "is a symlink"),
        (("get", cid, "--store", store), "is a directory; give -o DIR"),
        (("get", cid, "-o", str(tmp_path / "src" / "f"), "--store", store), "is not a directory"),
    ]
    for args, message in cases:
        res = _dlx(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()
