"""The IPFS daemon backend against a real daemon that speaks the Kubo RPC API.

The daemon is npm `ipfs@0.66` (js-ipfs; TOOLCHAIN.md), started offline with its own
repository directory and free ports, and stopped by PID. When it cannot start the tests
fail with its log, never skip: CI cannot pass without having talked to a real daemon.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from lineage.chain.anvil import free_port
from lineage.errors import BlockNotFoundError
from lineage.store.blockstore import Blockstore
from lineage.store.car import export_car, import_car
from lineage.store.cid import parse_cid
from lineage.store.ipfs import IpfsStore, open_store
from lineage.store.manifest import Manifest, get_manifest, put_config, put_manifest
from lineage.store.unixfs import file_cid, import_bytes, read_file

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]
ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "node_modules" / "ipfs" / "src" / "cli.js"
POLYFILL = ROOT / "tests" / "oracles" / "promise_with_resolvers.cjs"


class DaemonError(RuntimeError):
    pass


class JsIpfsDaemon:
    def __init__(self, repo: Path, ready_timeout: float = 90) -> None:
        self.repo = Path(repo)
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.repo.parent / f"{self.repo.name}.log"
        self.api = ""

    def _env(self) -> dict[str, str]:
        opts = f"{os.environ.get('NODE_OPTIONS', '')} --require {POLYFILL}".strip()
        return {**os.environ, "IPFS_PATH": str(self.repo), "NODE_OPTIONS": opts}

    def start(self) -> JsIpfsDaemon:
        node = shutil.which("node")
        if not node or not CLI.exists():
            raise DaemonError(f"js-ipfs is not installed ({CLI}): run scripts/setup (npm ci)")
        init = subprocess.run([node, str(CLI), "init", "--empty-repo"], env=self._env(),
                              capture_output=True, text=True, timeout=120)
        if init.returncode != 0:
            raise DaemonError(f"jsipfs init failed: {init.stderr[-2000:]}")
        for _ in range(4):  # a free port can be taken before the daemon binds it (other tests start services)
            if self._launch(node):
                return self
        raise DaemonError(f"js-ipfs daemon: its ports were taken four times:\n{self.log.read_text(errors='replace')[-2000:]}")

    def _launch(self, node: str) -> bool:
        """Start the daemon on fresh free ports: True once ready, False when a port was taken."""
        config_path = self.repo / "config"
        config = json.loads(config_path.read_text())
        ports: set[int] = set()
        while len(ports) < 3:  # three distinct ports (a port freed a moment ago can come back)
            ports.add(free_port())
        api, gateway, rpc = sorted(ports)
        config["Addresses"].update({
            "Swarm": [], "API": f"/ip4/127.0.0.1/tcp/{api}", "Gateway": f"/ip4/127.0.0.1/tcp/{gateway}",
            "RPC": f"/ip4/127.0.0.1/tcp/{rpc}", "Delegates": [],
        })
        config["Bootstrap"] = []
        config.setdefault("Discovery", {}).update({"MDNS": {"Enabled": False}, "webRTCStar": {"Enabled": False}})
        config_path.write_text(json.dumps(config, indent=2))
        self.api = f"/ip4/127.0.0.1/tcp/{api}/http"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([node, str(CLI), "daemon", "--offline"], env=self._env(),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            if "Daemon is ready" in text:
                return True
            if "EADDRINUSE" in text:
                self.stop()
                return False
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        tail = self.log.read_text(errors="replace")[-2000:]
        self.stop()
        raise DaemonError(f"js-ipfs daemon did not become ready in {self.ready_timeout:.0f} s:\n{tail}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)  # our own child, by PID
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def __enter__(self) -> JsIpfsDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with JsIpfsDaemon(tmp_path_factory.mktemp("jsipfs") / "repo") as d:
        yield d


@pytest.fixture()
def store(daemon):
    return IpfsStore(daemon.api, miss_timeout="1s")


def _daemon_add(store: IpfsStore, data: bytes, **kwargs) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return str(parse_cid(store.client.add(io.BytesIO(data), **kwargs)["Hash"]))


@pytest.mark.parametrize("size", [0, 1, 262_144, 262_145, 1_000_000])
def test_files_get_the_same_cids_through_the_daemon_as_locally_and_as_its_own_add(store, tmp_path, size):
    data = random.Random(size).randbytes(size)
    res = import_bytes(data, store.put)
    assert res.cid == file_cid(data) == import_bytes(data, Blockstore(tmp_path).put).cid
    assert _daemon_add(store, data, cid_version=1, raw_leaves=True) == str(res.cid)
    assert _daemon_add(store, data) == str(file_cid(data, 0))
    out = io.BytesIO()
    assert read_file(store, res.cid, out) == size  # every block re-hashed on the way back
    assert out.getvalue() == data
    assert store.has(res.cid)


def test_a_missing_block_is_an_error_naming_it(store):
    cid = file_cid(b"never stored anywhere " + os.urandom(8))
    assert not store.has(cid)
    with pytest.raises(BlockNotFoundError, match=str(cid)):
        store.get(cid)


def _dag_get(store: IpfsStore, path: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return store.client._client.request("/dag/get", (path,), decoder="json")[0]


def test_manifests_walk_history_with_dag_get_parent(store):
    config = put_config(store, {"name": "daemon"})
    shard = import_bytes(b"shard", store.put).cid
    head = put_manifest(store, Manifest(0, None, config, [shard], b"\1" * 32))
    for step in (1, 2):
        head = put_manifest(store, Manifest(step, head, config, [shard], b"\1" * 32, run=7,
                                            contributions=[[shard]], data=[b"d"]))
    assert get_manifest(store, head).step == 2
    # `ipfs dag get CID/parent/parent/...` resolved by the daemon itself (js-ipfs 0.66
    # answers 500 for whole nodes holding bytes, so the paths end at scalars)
    assert _dag_get(store, f"{head}/step") == 2
    assert _dag_get(store, f"{head}/parent/step") == 1
    assert _dag_get(store, f"{head}/parent/parent/step") == 0
    assert _dag_get(store, f"{head}/parent/parent/config") == {"name": "daemon"}


def test_a_car_moves_between_the_local_store_and_the_daemon(store, tmp_path):
    local = Blockstore(tmp_path / "local")
    data = random.Random(5).randbytes(600_000)
    root = import_bytes(data, local.put).cid
    car = io.BytesIO()
    export_car(local, [root], car)
    car.seek(0)
    assert import_car(store, car) == [root]
    back = io.BytesIO()
    n = export_car(store, [root], back)
    assert n == len(list(local)) and back.getvalue() == car.getvalue()


def test_pins_survive_the_daemons_gc_and_unpinned_blocks_do_not(store):
    kept = import_bytes(os.urandom(1000), store.put).cid
    dropped = import_bytes(os.urandom(1000), store.put).cid
    store.pin("run", [kept])
    removed = {str(c) for c in store.gc()}
    assert str(dropped) in {str(parse_cid(c)) for c in removed}
    assert store.has(kept) and not store.has(dropped)


def test_dlx_cas_add_and_get_through_the_daemon(daemon, tmp_path):
    dlx = str(Path(sys.executable).parent / "dlx")
    src = tmp_path / "f.bin"
    src.write_bytes(random.Random(9).randbytes(300_000))
    env = {**os.environ, "DLX_IPFS_API": daemon.api}
    add = subprocess.run([dlx, "cas", "add", str(src)], capture_output=True, text=True, env=env, timeout=120)
    assert add.returncode == 0, add.stderr
    assert add.stdout.strip() == str(file_cid(src.read_bytes()))
    get = subprocess.run([dlx, "cas", "get", add.stdout.strip(), "-o", str(tmp_path / "back")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert get.returncode == 0, get.stderr
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    assert isinstance(open_store(api=daemon.api), IpfsStore)


@pytest.mark.slow
def test_a_run_stored_in_the_daemon_trains_and_verifies(daemon, tmp_path, small_job):
    """`[storage] backend = "ipfs"`: every checkpoint block goes to the daemon, and
    `dlx lineage` and `dlx verify` read them back from it (nothing in a local blockstore)."""
    dlx = str(Path(sys.executable).parent / "dlx")
    job = tmp_path / "job.toml"
    job.write_text(small_job("ipfs-run", seed=5, steps=2, inner_steps=3,
                             extra=f'[storage]\nbackend = "ipfs"\napi = "{daemon.api}"\n'))
    run_dir = tmp_path / "run"
    res = subprocess.run([dlx, "train", str(job), "--run-dir", str(run_dir)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (run_dir / "blocks").exists()
    res = subprocess.run([dlx, "verify", "--run-dir", str(run_dir), "--json"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert [s["passed"] for s in report["steps"]] == [["chain", "content", "aggregate", "data"]] * 2
    head = json.loads((run_dir / "run.json").read_text())["head"]
    assert IpfsStore(daemon.api).has(head)


def test_an_unreachable_daemon_is_refused_before_anything_starts(tmp_path):
    dlx = str(Path(sys.executable).parent / "dlx")
    job = tmp_path / "job.toml"
    job.write_text('name = "x"\n[outer]\nsteps = 1\ninner_steps = 1\n'
                   f'[storage]\nbackend = "ipfs"\napi = "/ip4/127.0.0.1/tcp/{free_port()}/http"\n')
    res = subprocess.run([dlx, "train", str(job), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "no IPFS daemon answers" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
