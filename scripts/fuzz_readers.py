"""Fuzz every reader of untrusted input (issue 34): each must return, or raise the project's
own error (a `DlxError`: one line, exit 2), within a time and memory cap per input.

    .venv/bin/python scripts/fuzz_readers.py --seconds 40            # Hypothesis, every target
    .venv/bin/python scripts/fuzz_readers.py --seconds 3600 --engine atheris   # coverage-guided
    .venv/bin/python scripts/fuzz_readers.py --target cbor --seconds 60 --report out.json

Targets (`TARGETS`): a block file in a store, CIDs, dag-pb and UnixFS nodes, UnixFS files
(`cat`, `read_file`), directories and HAMTs (`list_tree`, `read_tree`), DAG-CBOR, CAR
files (`import_car`), checkpoint manifests, round-state references, safetensors, run.json,
job files, an init directory's config.json and a tokenizer.json. Each input runs in this
process under RLIMIT_AS (`--memory-mb`, default 2048) with an interval timer
(`--per-input-s`, default 2 s); anything else than a clean return or a DlxError is a
crash: a timeout, MemoryError, RecursionError or another exception type. Hypothesis
draws both raw bytes and structured inputs (dag-pb nodes linking to a fixed set of real
blocks with arbitrary sizes and names, CBOR values, CAR sections), so the structure checks
past the parsers are reached. The report (stdout, or --report FILE as JSON) gives the inputs
run per target and every crash with its input in hex; the exit code is 1 if any crashed.
tests/test_fuzz_readers.py runs it for a bounded time in the suite.
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.errors import DlxError  # noqa: E402

Target = Callable[[bytes, Path], None]


class _Timeout(BaseException):
    """The per-input timer ran out (a BaseException, so no reader's `except Exception` eats it)."""


# --- the fixture every input shares: a store holding a few real blocks ---------------------------


class Fixture:
    """A blockstore with a small file, a two-leaf file, a directory and a manifest-like
    CBOR node: structured inputs link to these."""

    def __init__(self, root: Path) -> None:
        from lineage.store.blockstore import Blockstore
        from lineage.store.unixfs import import_bytes
        from lineage.store.unixfs_dir import import_tree

        self.store = Blockstore(root / "blocks")
        self.small = import_bytes(b"hello fuzz\n", self.store.put).cid
        self.big = import_bytes(bytes(range(256)) * 1100, self.store.put, chunk_size=1024, max_links=4).cid
        self.tree = import_tree([("a.txt", b"a"), ("d/b.txt", b"bb")], self.store.put)
        self.links = [self.small, self.big, self.tree]


_FIXTURE: Fixture | None = None


def fixture() -> Fixture:
    global _FIXTURE
    if _FIXTURE is None:
        _FIXTURE = Fixture(Path(tempfile.mkdtemp(prefix="dlx-fuzz-")))
    return _FIXTURE


def _with_block(data: bytes, codec: str) -> Any:
    """`data` stored as a block of `codec` in the fixture's store; its CID."""
    return fixture().store.put(data, codec)


# --- targets ------------------------------------------------------------------------------------


def t_block_file(data: bytes, scratch: Path) -> None:
    from lineage.store.blockstore import Blockstore
    from lineage.store.cid import cid_of_block

    store = Blockstore(scratch / "s")
    cid = cid_of_block(b"x")
    path = store._path(cid)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    try:
        store.get(cid)
    except DlxError:
        pass
    for _ in store:
        pass


def t_cid(data: bytes, scratch: Path) -> None:
    from lineage.store.cid import block_name, parse_cid

    for value in (data, data.decode("latin-1")):
        try:
            parse_cid(value)
        except DlxError:
            pass
        try:
            block_name(value)
        except DlxError:
            pass


def t_dag_pb(data: bytes, scratch: Path) -> None:
    from lineage.store.dag import links_of
    from lineage.store.dagpb import PBNode, UnixFSData

    cid = _with_block(data, "dag-pb")
    links_of(cid, data)
    try:
        node = PBNode.decode(data)
        UnixFSData.decode(node.data or b"")
    except (ValueError, UnicodeDecodeError):  # the node decoders' documented errors; callers wrap them
        pass


def t_unixfs_file(data: bytes, scratch: Path) -> None:
    from lineage.store.unixfs import cat, check_file, read_bytes, read_file

    store, cid = fixture().store, _with_block(data, "dag-pb")
    for read in (lambda: read_file(store, cid, open(scratch / "out", "wb")),
                 lambda: sum(len(p) for p in cat(store, cid, workers=0)),
                 lambda: check_file(store, cid), lambda: read_bytes(store, cid)):
        try:
            read()
        except DlxError:
            pass


def t_unixfs_dir(data: bytes, scratch: Path) -> None:
    from lineage.store.unixfs_dir import list_tree, read_tree

    store, cid = fixture().store, _with_block(data, "dag-pb")
    for read in (lambda: list_tree(store, cid), lambda: read_tree(store, cid, scratch / "tree")):
        try:
            read()
        except DlxError:
            pass
    outside = [p for p in scratch.iterdir() if p.name not in ("tree", "out")]
    if outside:
        raise AssertionError(f"read_tree wrote outside its target: {outside}")


def t_cbor(data: bytes, scratch: Path) -> None:
    from lineage.store import cbor

    try:
        cbor.decode(data)
    except DlxError:
        pass


def t_manifest(data: bytes, scratch: Path) -> None:
    from lineage.store.manifest import get_manifest
    from lineage.store.roundstate import round_state_ref

    cid = _with_block(data, "dag-cbor")
    for read in (lambda: get_manifest(fixture().store, cid), lambda: round_state_ref(fixture().store, cid)):
        try:
            read()
        except DlxError:
            pass


def t_car(data: bytes, scratch: Path) -> None:
    from lineage.store.blockstore import Blockstore
    from lineage.store.car import import_car

    try:
        import_car(Blockstore(scratch / "car-store"), io.BytesIO(data))
    except DlxError:
        pass


def t_safetensors(data: bytes, scratch: Path) -> None:
    from trainer.artifacts import bytes_to_tensors, tensor_views

    for read in (bytes_to_tensors, tensor_views):
        try:
            read(data)
        except DlxError:
            pass


def t_run_json(data: bytes, scratch: Path) -> None:
    from lineage.chain.runrecord import RunRecord

    (scratch / "run.json").write_bytes(data)
    try:
        RunRecord.load(scratch)
    except DlxError:
        pass


def t_job_file(data: bytes, scratch: Path) -> None:
    from workers.run.jobfile import load_job_file

    (scratch / "job.toml").write_bytes(data)
    try:
        load_job_file(scratch / "job.toml")
    except DlxError:
        pass


def t_init_config(data: bytes, scratch: Path) -> None:
    from trainer.config import ModelConfig
    from trainer.hf import resolve_init

    (scratch / "init").mkdir()
    (scratch / "init" / "config.json").write_bytes(data)
    try:
        resolve_init(ModelConfig(family="llama", init="init"), scratch)
    except DlxError:
        pass


def t_tokenizer(data: bytes, scratch: Path) -> None:
    from trainer.dataset import _user_tokenizer

    (scratch / "tokenizer.json").write_bytes(data)
    try:
        _user_tokenizer(scratch / "tokenizer.json", 70_000)
    except DlxError:
        pass


TARGETS: dict[str, Target] = {
    "block-file": t_block_file, "cid": t_cid, "dag-pb": t_dag_pb, "unixfs-file": t_unixfs_file,
    "unixfs-dir": t_unixfs_dir, "cbor": t_cbor, "manifest": t_manifest, "car": t_car,
    "safetensors": t_safetensors, "run-json": t_run_json, "job-file": t_job_file,
    "init-config": t_init_config, "tokenizer": t_tokenizer,
}


# --- running one input ------------------------------------------------------------------------


class Runner:
    """Runs inputs against targets under the per-input timer; counts inputs and keeps crashes."""

    def __init__(self, per_input_s: float) -> None:
        self.per_input_s = per_input_s
        self.inputs: dict[str, int] = {name: 0 for name in TARGETS}
        self.crashes: list[dict[str, str]] = []
        self._seen: set[tuple[str, str]] = set()

        def alarm(signum: int, frame: Any) -> None:
            raise _Timeout

        signal.signal(signal.SIGALRM, alarm)

    def run(self, name: str, data: bytes) -> str | None:
        """The crash `data` causes in target `name` (recorded), or None."""
        self.inputs[name] += 1
        scratch = Path(tempfile.mkdtemp(prefix="dlx-fuzz-in-"))
        why = None
        signal.setitimer(signal.ITIMER_REAL, self.per_input_s)
        try:
            TARGETS[name](data, scratch)
        except _Timeout:
            why = f"timeout: more than {self.per_input_s} s"
        except DlxError:
            pass
        except BaseException as exc:  # noqa: BLE001 - a crash is whatever is not the project's error
            if isinstance(exc, KeyboardInterrupt):
                raise
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            shutil.rmtree(scratch, ignore_errors=True)
        if why is not None:  # one example per (target, kind of error), with a count
            key = (name, why.split(":")[0])
            if key not in self._seen:
                self._seen.add(key)
                self.crashes.append({"target": name, "error": why, "input": data[:4096].hex(), "count": 0})
            next(c for c in self.crashes if (c["target"], c["error"].split(":")[0]) == key)["count"] += 1
        return why


# --- engines ------------------------------------------------------------------------------------


def _strategies() -> dict[str, Any]:
    """Hypothesis strategies per target: raw bytes, and structured inputs."""
    from hypothesis import strategies as st

    from lineage.store.dagpb import PBLink, PBNode, UnixFSData

    fx = fixture()
    names = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(["", ".", "..", "a/b", "00", "0A1"])
    sizes = st.integers(min_value=0, max_value=1 << 66) | st.integers(min_value=0, max_value=300_000)
    links = st.builds(PBLink, st.sampled_from(fx.links), sizes, names)
    fs = st.builds(UnixFSData, st.integers(0, 7), st.none() | st.binary(max_size=64), st.none() | sizes,
                   st.lists(sizes, max_size=6), st.none() | st.integers(0, 1 << 40), st.none() | st.integers(0, 1 << 20))
    node = st.builds(lambda f, ls: PBNode(f.encode(), ls).encode(), fs, st.lists(links, max_size=6))
    cbor_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8)
        | st.binary(max_size=8) | st.sampled_from(fx.links),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
        max_leaves=20)

    def encode(value: Any) -> bytes:
        import dag_cbor

        try:
            return bytes(dag_cbor.encode(value))
        except Exception:  # a value the encoder refuses (DAG-CBOR has no such map key...): raw bytes then
            return repr(value).encode()

    cbor = cbor_values.map(encode)
    nested = st.integers(1, 3000).map(lambda n: b"\x81" * n + b"\x00") | st.integers(1, 3000).map(lambda n: b"\xa1\x61a" * n + b"\x00")
    raw = st.binary(max_size=512)

    def car_of(header: bytes, sections: list[bytes]) -> bytes:
        from lineage.store.dagpb import write_varint

        return write_varint(len(header)) + header + b"".join(write_varint(len(s)) + s for s in sections)

    section = st.builds(lambda c, b: bytes(c) + b, st.sampled_from(fx.links), st.binary(max_size=64)) | raw
    car = st.builds(car_of, cbor | nested, st.lists(section, max_size=4)) | raw
    json_text = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                             lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                             max_leaves=12).map(lambda v: json.dumps(v).encode())
    huge_int = st.integers(4000, 120_000).map(lambda n: b'{"hidden_size": ' + b"7" * n + b"}")
    deep_json = st.integers(100, 50_000).map(lambda n: b"[" * n + b"]" * n)
    toml = st.text(max_size=300).map(str.encode) | st.integers(100, 20_000).map(lambda n: b"a = " + b"[" * n + b"]" * n)
    st_header = st.builds(lambda h, tail: len(h).to_bytes(8, "little") + h + tail, json_text, st.binary(max_size=64))
    return {
        "block-file": raw, "cid": raw | st.text(max_size=80).map(str.encode), "dag-pb": node | raw,
        "unixfs-file": node | raw, "unixfs-dir": node | raw, "cbor": cbor | nested | raw, "manifest": cbor | raw,
        "car": car, "safetensors": st_header | raw, "run-json": json_text | huge_int | deep_json | raw,
        "job-file": toml, "init-config": json_text | huge_int | deep_json | raw, "tokenizer": json_text | deep_json | raw,
    }


def run_hypothesis(runner: Runner, targets: list[str], seconds: float) -> None:
    """Each target in turn for its share of `seconds`, in batches of fresh Hypothesis runs."""
    strategies = _strategies()
    share = seconds / len(targets)
    for name in targets:
        end = time.monotonic() + share
        batch = 0
        while time.monotonic() < end:
            _batch(runner, name, strategies[name], end, batch)
            batch += 1


def _batch(runner: Runner, name: str, strategy: Any, end: float, batch: int) -> None:
    """One Hypothesis run (seed `batch`) of up to 50 inputs of target `name`, until `end`."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as fixed_seed

    @fixed_seed(batch)
    @settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(data: bytes) -> None:
        if time.monotonic() < end:
            runner.run(name, data)

    one()


def run_atheris(runner: Runner, targets: list[str], seconds: float, report: Callable[[], None]) -> None:
    """libFuzzer through atheris: the first byte picks the target; coverage-guided over the
    instrumented lineage, trainer and workers modules. libFuzzer ends the process itself
    when its time is up, so `report` is written every 2,000 inputs and at each crash."""
    import atheris

    with atheris.instrument_imports(include=["lineage", "trainer", "workers"]):
        import lineage.store.car  # noqa: F401
        import lineage.store.cbor  # noqa: F401
        import lineage.store.unixfs_dir  # noqa: F401

    def one(data: bytes) -> None:
        if data:
            crashed = runner.run(targets[data[0] % len(targets)], data[1:])
            if crashed or sum(runner.inputs.values()) % 2000 == 0:
                report()

    atheris.Setup([sys.argv[0], f"-max_total_time={int(seconds)}", "-rss_limit_mb=0", "-timeout=0"], one)
    try:
        atheris.Fuzz()
    except SystemExit:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="total fuzzing time")
    ap.add_argument("--engine", choices=["hypothesis", "atheris"], default="hypothesis")
    ap.add_argument("--target", action="append", choices=sorted(TARGETS), help="only these targets (repeatable)")
    ap.add_argument("--per-input-s", type=float, default=2.0)
    ap.add_argument("--memory-mb", type=int, default=2048)
    ap.add_argument("--report", type=Path, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    targets = args.target or list(TARGETS)
    import tokenizers  # noqa: F401
    import torch  # noqa: F401  - imported before the memory cap: its libraries map much address space

    fixture()
    runner = Runner(args.per_input_s)
    limit = args.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    start = time.monotonic()

    def report() -> str:
        text = json.dumps({"engine": args.engine, "seconds": round(time.monotonic() - start, 1),
                           "inputs": runner.inputs, "total_inputs": sum(runner.inputs.values()),
                           "crashes": runner.crashes}, indent=2)
        if args.report:
            args.report.write_text(text + "\n")
        return text

    if args.engine == "atheris":
        run_atheris(runner, targets, args.seconds, report)
    else:
        run_hypothesis(runner, targets, args.seconds)
    print(report())
    return 1 if runner.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
