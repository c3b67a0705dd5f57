"""CAR v1 export and import, checked against the npm `ipfs-car` tool (not our code)."""

from __future__ import annotations

import io
import random
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lineage.store.blockstore import Blockstore
from lineage.store.car import CarError, export_car, import_car, read_car
from lineage.store.cid import parse_cid
from lineage.store.dag import reachable
from lineage.store.manifest import Manifest, put_config, put_manifest
from lineage.store.unixfs import import_bytes, read_file

ROOT = Path(__file__).resolve().parents[1]
IPFS_CAR = ROOT / "node_modules" / ".bin" / "ipfs-car"


def ipfs_car(*args: str | Path, cwd: Path) -> str:
    assert IPFS_CAR.exists(), "npm ipfs-car is missing: run scripts/setup"
    res = subprocess.run([str(IPFS_CAR), *map(str, args)], cwd=cwd, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _file(store: Blockstore, size: int, seed: int = 0):
    data = random.Random(seed).randbytes(size)
    return data, import_bytes(data, store.put).cid


def _run_dag(store: Blockstore):
    """A two-step manifest chain whose stages are multi-chunk UnixFS files."""
    config = put_config(store, {"name": "car"})
    head = None
    for step in range(2):
        stages = [_file(store, 300_000 + 1000 * step + s, seed=10 * step + s)[1] for s in range(2)]
        if step == 0:
            head = put_manifest(store, Manifest(0, None, config, stages, b"\0" * 32))
            continue
        contribs = [[import_bytes(f"c{step}-{r}".encode(), store.put).cid] for r in range(2)]
        head = put_manifest(store, Manifest(step, head, config, stages, b"\0" * 32, run=1,
                                            contributions=contribs, data=[b"d", b"d"]))
    return head


def test_ipfs_car_reads_our_car_and_unpacks_the_same_bytes(tmp_path):
    store = Blockstore(tmp_path / "bs")
    data, root = _file(store, 700_000)
    car = tmp_path / "f.car"
    with open(car, "wb") as fh:
        export_car(store, [root], fh)
    assert ipfs_car("roots", car, cwd=tmp_path).split() == [str(root)]
    listed = ipfs_car("blocks", car, cwd=tmp_path).split()
    assert sorted(listed) == sorted(str(c) for c in reachable(store, [root]))
    ipfs_car("unpack", car, "-o", tmp_path / "out.bin", cwd=tmp_path)
    assert (tmp_path / "out.bin").read_bytes() == data


def test_a_whole_run_exports_and_every_block_is_listed_by_ipfs_car(tmp_path):
    store = Blockstore(tmp_path / "bs")
    head = _run_dag(store)
    car = tmp_path / "run.car"
    with open(car, "wb") as fh:
        count = export_car(store, [head], fh)
    assert count == len(list(store))  # every block of the run is reachable from its head
    assert ipfs_car("roots", car, cwd=tmp_path).split() == [str(head)]
    assert sorted(ipfs_car("blocks", car, cwd=tmp_path).split()) == sorted(str(c) for c in store)
    other = Blockstore(tmp_path / "other")
    with open(car, "rb") as fh:
        assert import_car(other, fh) == [head]
    assert sorted(map(str, other)) == sorted(map(str, store))
    assert other.verify() == []


@pytest.mark.parametrize("size", [0, 5, 1_500_000])
def test_a_car_packed_by_ipfs_car_imports_with_the_same_root(tmp_path, size):
    data = random.Random(size).randbytes(size)
    (tmp_path / "in.bin").write_bytes(data)
    ipfs_car("pack", "in.bin", "--no-wrap", "-o", "in.car", cwd=tmp_path)
    want = ipfs_car("roots", "in.car", cwd=tmp_path).split()
    store = Blockstore(tmp_path / "bs")
    with open(tmp_path / "in.car", "rb") as fh:
        roots = import_car(store, fh)
    assert [str(r) for r in roots] == want
    out = io.BytesIO()
    read_file(store, roots[0], out)  # ipfs-car chunks at 1 MiB, 1024 wide: a different DAG, read all the same
    assert out.getvalue() == data


def _car_bytes(tmp_path: Path) -> bytes:
    """A CAR of a 2 kB file cut into 300-byte chunks, 3 links wide: 3 levels, 11 blocks."""
    src = Blockstore(tmp_path / "src")
    root = import_bytes(random.Random(3).randbytes(2_000), src.put, chunk_size=300, max_links=3).cid
    buf = io.BytesIO()
    export_car(src, [root], buf)
    return buf.getvalue()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0, 1, exclude_max=True))
def test_a_truncated_car_fails_cleanly_and_leaves_the_store_unchanged(tmp_path_factory, cut):
    tmp = tmp_path_factory.mktemp("car")
    car = _car_bytes(tmp)
    store = Blockstore(tmp / "dst")
    store.put(b"already here")
    before = sorted(map(str, store))
    with pytest.raises(CarError):
        import_car(store, io.BytesIO(car[:int(len(car) * cut)]))
    assert sorted(map(str, store)) == before
    assert not [p for p in store.root.rglob(".*") if p.name != ".pins"]


def test_a_corrupt_block_in_a_car_is_named(tmp_path):
    car = _car_bytes(tmp_path)
    _, sections = read_car(io.BytesIO(car))
    last_cid, last_block = list(sections)[-1]
    bad = bytearray(car)
    bad[len(car) - len(last_block) + 1] ^= 0x01  # inside the last block's bytes
    store = Blockstore(tmp_path / "dst")
    with pytest.raises(CarError, match=str(last_cid)):
        import_car(store, io.BytesIO(bytes(bad)))
    assert list(store) == []


def test_a_car_without_its_root_is_refused(tmp_path):
    from lineage.store.car import encode_header

    store = Blockstore(tmp_path)
    missing = parse_cid("bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku")
    with pytest.raises(CarError, match=f"root {missing} is missing"):
        import_car(store, io.BytesIO(encode_header([missing])))
    assert list(store) == []


def test_a_car_cut_at_any_section_boundary_is_refused_as_incomplete(tmp_path):
    car = _car_bytes(tmp_path)
    fh = io.BytesIO(car)
    _, sections = read_car(fh)
    boundaries = [fh.tell()]
    for _ in sections:
        boundaries.append(fh.tell())
    assert boundaries[-1] == len(car) and len(boundaries) == 12  # header + 11 blocks
    store = Blockstore(tmp_path / "dst")
    for cut in boundaries[:-1]:
        with pytest.raises(CarError, match="incomplete or truncated CAR"):
            import_car(store, io.BytesIO(car[:cut]))
    assert list(store) == []
    assert import_car(store, io.BytesIO(car)) and len(list(store)) == 11
