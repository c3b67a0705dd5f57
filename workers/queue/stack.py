"""A local stack for the job queue: `dlx up [--workers N]` / `dlx down`.

`dlx up` starts, in a stack directory (default `.dlx/`): its own redis-server and anvil
(with a state file) on free ports, deploys the ledger contracts, and starts N workers,
each with its own funded, registered and staked node key (anvil's development keys:
local chain only). `stack.json` records every PID it started; `dlx down` stops exactly
those processes and nothing else.

The chain keeps the stack's history: a keeper process (`python -m lineage.chain.anvil keep`)
rewrites anvil's state file atomically after every new block, so a killed anvil loses at
most the transaction in flight, and `<stack>/chain/chain.json` remembers the chain's port
and contract addresses. `dlx up` after `dlx down` starts anvil on that state file, on the
same port where it is free, and keeps the ledger it finds there (no redeployment), so runs
committed before still audit; a run's run.json names its stack, and finds the chain
wherever the stack's anvil listens now (`lineage.chain.runrecord.RunRecord.load`).

A stack on a chain of its user's (`dlx up --rpc URL --deployment FILE`, `up_on_deployment`):
no anvil and no keeper; the contracts are the deployment file's (`dlx deploy`, checked
against the endpoint's chain id and code), and each worker's node key comes from the
environment (DLX_WORKER_KEYS: one private key per worker, comma-separated, never on a
command line), registers itself and stakes from its own balance, and pays the gas of the
steps it commits. Its runs name no stack: their chain does not stop with it.

Redis is durable: an append-only file in `<stack>/redis/`, fsynced on every write (the
job store and broker write little), so a restarted redis-server (`restart_redis`) comes
back with every job record, lease and queued task. It asks for a password, generated
here and kept out of every command line: it is in `<stack>/redis/redis.conf` and in the
Redis URL of `stack.json` (both readable by the owner only). With `host` set, Redis and
anvil also listen on that address, for workers on other hosts (or network namespaces).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.errors import ConfigError

from .jobs import JobError, connect

if TYPE_CHECKING:
    from eth_account.signers.local import LocalAccount

    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger

STACK_FILE = "stack.json"
CHAIN_FILE = "chain/chain.json"  # the chain's port and contracts, kept across down and up
CHAIN_STATE = "chain/state.json"
ETHER = 10**18


@dataclass
class Stack:
    dir: str
    redis_url: str
    redis_pid: int
    rpc: str
    anvil_pid: int
    chain_id: int
    registry: str
    ledger: str
    workers: list[dict] = field(default_factory=list)
    host: str = "127.0.0.1"
    keeper_pid: int = 0  # saves the chain's state file after every block
    deployment: str | None = None  # set: the chain is the user's (no anvil: anvil_pid 0), with this file's contracts

    @property
    def blocks(self) -> str:
        return str(Path(self.dir).resolve() / "blocks")

    @property
    def runs(self) -> Path:
        return Path(self.dir).resolve() / "runs"

    def save(self) -> None:
        """Write stack.json, readable by its owner only (the Redis URL holds the password)."""
        path = Path(self.dir) / STACK_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(asdict(self), indent=2) + "\n")
        tmp.replace(path)

    @classmethod
    def load(cls, directory: Path) -> Stack:
        try:
            return cls(**json.loads((Path(directory) / STACK_FILE).read_text()))
        except FileNotFoundError:
            raise ConfigError(f"no local stack in {directory}: run `dlx up` first") from None
        except (json.JSONDecodeError, TypeError) as exc:
            raise ConfigError(f"malformed {Path(directory) / STACK_FILE}: {exc}") from None

    def worker_env(self, key_hex: str, slots: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"DLX_NODE_KEY": key_hex, "DLX_REDIS_URL": self.redis_url, "DLX_RPC": self.rpc,
                    "DLX_CHAIN_ID": str(self.chain_id), "DLX_REGISTRY": self.registry,
                    "DLX_LEDGER": self.ledger, "DLX_WORKER_SLOTS": str(slots)})
        return env


def alive(pid: int) -> bool:
    """Whether `pid` runs. A zombie does not: `up`'s processes outlive it, so their parent is
    init, which may take a second or two to reap one that exited (waiting on `kill -0`
    alone made every `dlx down` wait out those seconds per stage)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (not Linux), or it exited meanwhile
        return True


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    return proc.pid


def up(directory: Path, workers: int, slots: int, stake_wei: int = ETHER, host: str = "127.0.0.1") -> Stack:
    """Start the stack; `host`: the address Redis and the chain also listen on."""
    from lineage.chain.anvil import dev_accounts, free_port
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger

    directory = Path(directory)
    _refuse_a_live_stack(directory)
    directory.mkdir(parents=True, exist_ok=True)
    url, started = _start_stack_redis(directory, host, free_port(host))
    try:
        before = _chain_history(directory)
        anvil_pid, rpc = _start_anvil(directory, host, accounts=max(10, workers + 2), port=before.get("port"))
        started.append(anvil_pid)
        keeper_pid = _spawn([sys.executable, "-m", "lineage.chain.anvil", "keep", rpc,
                             str(Path(directory).resolve() / CHAIN_STATE)], Path(directory) / "logs" / "keeper.log")
        started.append(keeper_pid)
        accounts = dev_accounts(workers + 1)
        chain = Chain(rpc)
        ledger = _kept_ledger(chain, before) or Ledger.deploy(chain, accounts[0])
        stack = Stack(dir=str(directory), redis_url=url, redis_pid=started[0], rpc=rpc, anvil_pid=anvil_pid,
                      chain_id=chain.chain_id, registry=ledger.addresses["registry"],
                      ledger=ledger.addresses["ledger"], host=host, keeper_pid=keeper_pid)
        _save_chain_history(stack)
        for acct in accounts[1:]:
            ledger.registry.ensure_staked(acct, stake_wei)
        return _start_workers(stack, accounts[1:], slots, started)
    except BaseException:
        _stop_pids(list(reversed(started)))
        raise


def up_on_deployment(directory: Path, rpc: str, deployment: Path, keys: list[LocalAccount], slots: int,
                     stake_wei: int = ETHER, host: str = "127.0.0.1") -> Stack:
    """Start a stack on the user's chain at `rpc` with the contracts of `deployment` (module
    docstring): Redis and one worker per key of `keys`, each registered and staked by
    itself. Nothing is started when the deployment is not on that chain."""
    from lineage.chain.anvil import free_port
    from lineage.chain.client import Chain
    from lineage.chain.deploy import open_deployment

    directory = Path(directory)
    _refuse_a_live_stack(directory)
    chain = Chain(rpc)
    ledger = open_deployment(chain, deployment)  # before anything starts: another chain, no code
    for acct in keys:
        ledger.registry.ensure_staked(acct, stake_wei)
    directory.mkdir(parents=True, exist_ok=True)
    url, started = _start_stack_redis(directory, host, free_port(host))
    try:
        stack = Stack(dir=str(directory), redis_url=url, redis_pid=started[0], rpc=rpc, anvil_pid=0,
                      chain_id=chain.chain_id, registry=ledger.addresses["registry"],
                      ledger=ledger.addresses["ledger"], host=host, deployment=str(Path(deployment).resolve()))
        return _start_workers(stack, keys, slots, started)
    except BaseException:
        _stop_pids(list(reversed(started)))
        raise


def _start_workers(stack: Stack, keys: list[LocalAccount], slots: int, started: list[int]) -> Stack:
    """A worker per key of `keys` (each staked), their PIDs added to `started`; then
    stack.json, which `dlx down` reads."""
    for i, acct in enumerate(keys, start=1):
        started.append(start_worker(stack, acct.key.hex(), slots, f"worker-{i}"))
    stack.save()
    return stack


def _refuse_a_live_stack(directory: Path) -> None:
    if (directory / STACK_FILE).exists():
        old = Stack.load(directory)
        if any(alive(p) for p in [old.redis_pid, old.anvil_pid, old.keeper_pid, *[w["pid"] for w in old.workers]] if p):
            raise ConfigError(f"a stack is already up in {directory}: `dlx down` first")


def _start_stack_redis(directory: Path, host: str, port: int) -> tuple[str, list[int]]:
    """The stack's redis-server, answering; (its URL, [its pid])."""
    password = secrets.token_hex(16)
    redis_pid = start_redis(directory, host, port, password)
    url = f"redis://:{password}@{host}:{port}/0"
    try:
        _wait_redis(url)
    except BaseException:
        _stop_pids([redis_pid])
        raise
    return url, [redis_pid]


def _chain_history(directory: Path) -> dict:
    """What an earlier `up` here left of its chain: port and contracts (empty if none, or if
    the chain's state file is gone with it)."""
    directory = Path(directory)
    try:
        history = json.loads((directory / CHAIN_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return history if (directory / CHAIN_STATE).is_file() else {}


def _kept_ledger(chain: Chain, history: dict) -> Ledger | None:
    """The ledger an earlier `up` deployed, if the chain (restarted on its state file) still
    holds both contracts at the recorded addresses on the recorded chain."""
    from lineage.chain.ledger import Ledger

    if not history or history.get("chain_id") != chain.chain_id:
        return None
    w3 = chain.w3
    if any(not w3.eth.get_code(w3.to_checksum_address(history[k])) for k in ("registry", "ledger")):
        return None
    return Ledger(chain, history["registry"], history["ledger"])


def _save_chain_history(stack: Stack) -> None:
    from urllib.parse import urlparse

    path = Path(stack.dir) / CHAIN_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"port": urlparse(stack.rpc).port, "chain_id": stack.chain_id,
                               "registry": stack.registry, "ledger": stack.ledger}, indent=2) + "\n")
    tmp.replace(path)


def start_worker(stack: Stack, key_hex: str, slots: int, name: str, address: str | None = None,
                 prefix: tuple[str, ...] = (), args: tuple[str, ...] = ()) -> int:
    """Start one worker node with `key_hex` (passed in its environment, never its argv),
    record it in the stack (`save()` to keep it) and return its PID. `prefix` runs it
    inside something, e.g. `("ip", "netns", "exec", NS)` (which execs: the PID is the
    worker's); `args` are more `dlx worker` options."""
    from eth_account import Account

    log = Path(stack.dir) / "logs" / f"{name}.log"
    cmd = [*prefix, sys.executable, "-m", "workers.cli", "worker", "--slots", str(slots)]
    if address:
        cmd += ["--address", address]
    cmd += args
    pid = _spawn(cmd, log, stack.worker_env(key_hex, slots))
    stack.workers.append({"pid": pid, "node": Account.from_key(key_hex).address, "slots": slots, "log": str(log)})
    return pid


def start_redis(directory: Path, host: str, port: int, password: str) -> int:
    """redis-server for the stack: append-only, fsync on every write, in `<stack>/redis`,
    with a password (in its config file, never on its command line)."""
    data = Path(directory).resolve() / "redis"
    data.mkdir(parents=True, exist_ok=True)
    bind = "127.0.0.1" if host == "127.0.0.1" else f"127.0.0.1 {host}"
    conf = data / "redis.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f'port {port}\nbind {bind}\nsave ""\nappendonly yes\nappendfsync always\n'
                 f'dir "{data}"\nrequirepass "{password}"\n')
    return _spawn(["redis-server", str(conf)], Path(directory) / "logs" / "redis.log")


def restart_redis(directory: Path, down_s: float = 0.0) -> int:
    """Stop the stack's redis-server (SIGTERM: it flushes its append-only file), wait
    `down_s`, start it again on the same port and directory; returns the new PID."""
    from urllib.parse import urlparse

    stack = Stack.load(directory)
    _stop_pids([stack.redis_pid])
    time.sleep(down_s)
    url = urlparse(stack.redis_url)
    stack.redis_pid = start_redis(Path(stack.dir), stack.host, int(url.port or 6379), url.password or "")
    stack.save()
    _wait_redis(stack.redis_url)
    return stack.redis_pid


def _start_anvil(directory: Path, host: str, accounts: int, timeout: float = 30.0,
                 port: int | None = None) -> tuple[int, str]:
    """anvil on `host` with its state file in `<stack>/chain/state.json` (loaded if there);
    on `port` if it is free, else on any free port; (PID, RPC URL)."""
    from lineage.chain.anvil import free_port, rpc_call, tool_path
    from lineage.errors import ChainError

    state = Path(directory).resolve() / CHAIN_STATE
    state.parent.mkdir(parents=True, exist_ok=True)
    port = port if port and _port_free(host, port) else free_port(host)
    pid = _spawn([str(tool_path("anvil")), "--host", host, "--port", str(port), "--accounts", str(accounts),
                  "--silent", "--state", str(state)], Path(directory) / "logs" / "anvil.log")
    rpc = f"http://{host}:{port}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            rpc_call(rpc, "eth_chainId", timeout=0.5)
            return pid, rpc
        except (OSError, ChainError):
            if not alive(pid) or time.monotonic() > deadline:
                _stop_pids([pid])
                raise ChainError(f"anvil did not answer on {rpc}: see {Path(directory) / 'logs' / 'anvil.log'}") from None
            _reap(pid)
            time.sleep(0.05)


def _port_free(host: str, port: int) -> bool:
    """Whether a server could listen on `port` now (SO_REUSEADDR, as anvil's: a port left in
    TIME_WAIT by the last `down` counts as free)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _wait_redis(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            connect(url)
            return
        except JobError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _stop_pids(pids: list[int], timeout: float = 15.0) -> None:
    """SIGTERM all of `pids` at once (each may save state), then SIGKILL what is left."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        for p in pids:
            _reap(p)
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def down(directory: Path) -> list[int]:
    """Stop exactly the processes `up` started in `directory`; returns their PIDs."""
    stack = Stack.load(directory)
    workers = [w["pid"] for w in stack.workers]
    _stop_pids(workers)  # first the workers, while Redis and the chain still answer them
    keeper = [stack.keeper_pid] if stack.keeper_pid else []
    _stop_pids(keeper)  # its last save, while anvil answers; then anvil saves once more at exit
    servers = [p for p in (stack.anvil_pid, stack.redis_pid) if p]  # no anvil on the user's chain
    _stop_pids(servers)
    pids = [*workers, *keeper, *servers]
    (Path(directory) / STACK_FILE).unlink()  # chain/ stays: the next `up` resumes its chain
    return pids


def run_summaries(directory: Path | None, stack_dir: Path | None) -> list[dict]:
    """One row per run in `directory` (or the directory itself, if it is a run), else in the
    stack's `runs/`: id, name, steps, head, state, eval loss at the head, run directory. A
    stack's run takes its job's state from Redis while the stack is up, else from its
    run.json (where the job's end is written too: `workers.queue.jobs.settle_run_file`)."""
    from lineage.chain.runrecord import RUN_FILE

    root = Path(directory) if directory is not None else Path(stack_dir or ".dlx") / "runs"
    if directory is not None and not root.is_dir():
        raise ConfigError(f"not a directory: {root}")
    dirs = [root] if (root / RUN_FILE).is_file() else sorted(
        (d for d in root.iterdir() if (d / RUN_FILE).is_file()), key=lambda d: d.stat().st_mtime
    ) if root.is_dir() else []
    states = _job_states(stack_dir, [d.name for d in dirs]) if directory is None else {}
    return [_summary(d, states.get(d.name)) for d in dirs]


def _summary(run_dir: Path, job_state: str | None) -> dict:
    from lineage.chain.runrecord import RunRecord
    from lineage.store.manifest import get_manifest

    record = RunRecord.load(run_dir)
    loss = None
    if record.head and record.steps:
        try:
            loss = get_manifest(record.open_store(run_dir), record.head).metrics.get("eval_loss")
        except Exception:  # a store that is gone or unreachable: the row still lists the run
            loss = None
    written = time.strftime("%Y-%m-%d %H:%M", time.localtime((run_dir / "run.json").stat().st_mtime))
    return {"id": record.run_id, "name": record.name, "steps": record.steps, "head": record.head or None,
            "state": job_state or record.status, "loss": loss, "updated": written, "run_dir": str(run_dir)}


def _job_states(stack_dir: Path | None, job_ids: list[str]) -> dict[str, str]:
    """The jobs' states from the stack's Redis, if the stack is up; else none."""
    from .jobs import JobStore

    if stack_dir is None or not (Path(stack_dir) / STACK_FILE).is_file() or not job_ids:
        return {}
    store = JobStore(connect(Stack.load(stack_dir).redis_url))
    states = {}
    for job in job_ids:
        try:
            states[job] = store.state(job)
        except JobError:
            continue
    return states


def rank_logs(stack_dir: Path, job_id: str, rank: int | None = None) -> list[Path]:
    """A job's rank logs (`workers.queue.tasks.rank_log`), every attempt, in (rank, attempt)
    order; only rank `rank`'s when given."""
    from .tasks import rank_log

    stack_dir = Path(stack_dir)
    run_dir = stack_dir.resolve() / "runs" / job_id
    if (stack_dir / STACK_FILE).is_file():  # up: the job record says where its run is
        from .jobs import JobStore

        try:
            run_dir = Path(JobStore(connect(Stack.load(stack_dir).redis_url)).get(job_id)["run_dir"])
        except (JobError, KeyError):
            pass
    logs = sorted(rank_log(run_dir, 0, 0).parent.glob("rank-*.log"),
                  key=lambda p: [int(x) for x in p.stem.split("-")[1::2]])
    return [p for p in logs if rank is None or p.stem.split("-")[1] == str(rank)]


def rank_log_title(path: Path) -> str:
    """`rank 1, attempt 2 (PATH)` for a rank log's path."""
    return f"{path.stem.replace('-', ' ', 1).replace('-attempt-', ', attempt ')} ({path})"


def job_logs(stack_dir: Path, job_id: str, rank: int | None = None) -> list[tuple[str, list[str]]]:
    """(title, lines) for each of a job's rank logs (every attempt; rank `rank`'s only when
    given) and, for all ranks, each worker log that mentions the job (task received,
    finished, failed)."""
    stack_dir = Path(stack_dir)
    found = [(rank_log_title(p), p.read_text(errors="replace").splitlines(keepends=True))
             for p in rank_logs(stack_dir, job_id, rank)]
    for log in sorted((stack_dir / "logs").glob("worker-*.log")) if rank is None else []:
        lines = [line for line in log.read_text(errors="replace").splitlines(keepends=True) if job_id in line]
        if lines:
            found.append((f"{log.stem} ({log})", lines))
    if not found:
        which = f"rank {rank} of job {job_id}" if rank is not None else f"job {job_id}"
        raise ConfigError(f"no logs of {which} in {stack_dir}" + ("" if rank is None else
                          " (`dlx logs JOB` without --rank lists every rank's)"))
    return found
