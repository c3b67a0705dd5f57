"""A local stack for the job queue: `dlx up [--workers N]` / `dlx down`.

`dlx up` starts, in a stack directory (default `.dlx/`): its own redis-server and anvil
(with a state file) on free ports, deploys the ledger contracts, and starts N workers,
each with its own funded, registered and staked node key (anvil's development keys:
local chain only). `stack.json` records every PID it started; `dlx down` stops exactly
those processes and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.errors import ConfigError

from .jobs import JobError, connect

STACK_FILE = "stack.json"
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

    @property
    def blocks(self) -> str:
        return str(Path(self.dir).resolve() / "blocks")

    @property
    def runs(self) -> Path:
        return Path(self.dir).resolve() / "runs"

    def save(self) -> None:
        path = Path(self.dir) / STACK_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    return proc.pid


def up(directory: Path, workers: int, slots: int, stake_wei: int = ETHER) -> Stack:
    from lineage.anvil import Anvil, dev_accounts, free_port
    from lineage.chain import Chain, Ledger

    directory = Path(directory)
    if (directory / STACK_FILE).exists():
        old = Stack.load(directory)
        if any(alive(p) for p in [old.redis_pid, old.anvil_pid, *[w["pid"] for w in old.workers]]):
            raise ConfigError(f"a stack is already up in {directory}: `dlx down` first")
    directory.mkdir(parents=True, exist_ok=True)
    logs = directory / "logs"
    port = free_port()
    redis_pid = _spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", str(directory.resolve())], logs / "redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    started: list[int] = [redis_pid]
    try:
        _wait_redis(url)
        anvil = Anvil(state_path=directory.resolve() / "chain" / "state.json", accounts=max(10, workers + 2),
                      detach_log=logs / "anvil.log").start()
        started.append(anvil.proc.pid)  # type: ignore[union-attr]
        accounts = dev_accounts(workers + 1)
        chain = Chain(anvil.url)
        ledger = Ledger.deploy(chain, accounts[0])
        stack = Stack(dir=str(directory), redis_url=url, redis_pid=redis_pid, rpc=anvil.url,
                      anvil_pid=anvil.proc.pid, chain_id=chain.chain_id,  # type: ignore[union-attr]
                      registry=ledger.addresses["registry"], ledger=ledger.addresses["ledger"])
        for i, acct in enumerate(accounts[1:], start=1):
            ledger.ensure_staked(acct, stake_wei)
            env = stack.worker_env(acct.key.hex(), slots)
            pid = _spawn([sys.executable, "-m", "workers.cli", "worker", "--slots", str(slots)],
                         logs / f"worker-{i}.log", env)
            started.append(pid)
            stack.workers.append({"pid": pid, "node": acct.address, "slots": slots, "log": str(logs / f"worker-{i}.log")})
        stack.save()
        return stack
    except BaseException:
        _stop_pids(list(reversed(started)))
        raise


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
    _stop_pids([stack.anvil_pid, stack.redis_pid])
    pids = [*workers, stack.anvil_pid, stack.redis_pid]
    (Path(directory) / STACK_FILE).unlink()
    return pids
