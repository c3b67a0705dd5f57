"""A local EVM chain for development: finds Foundry's binaries and runs anvil.

`dlx train` with no `--rpc` starts anvil on a free port with a state file in the run
directory (anvil's `--state`: loaded at start, written at exit), so the chain outlives
the process and `dlx lineage` can start it again to read the run's history.

anvil writes that file only when it exits, so a killed anvil would lose every block since
it started. `dump_state` asks a running anvil for its state and replaces the file
atomically: `dlx train` does it after every transaction it sends to its embedded chain
(`workers.run.local.PersistedChain`), and `python -m lineage.chain.anvil keep URL FILE` after every
new block of a chain others write to (the stack's). A killed chain then loses at most the
transaction in flight, and starting anvil on the file brings back every block before it.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount

from lineage.errors import ChainError

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # lineage/chain/anvil.py -> the checkout
ANVIL_CHAIN_ID = 31337
ANVIL_BALANCE_WEI = 10_000 * 10**18  # what anvil gives each development account (wei)
# anvil's default mnemonic: every key derived from it is public knowledge.
DEV_MNEMONIC = "test test test test test test test test test test test junk"


def tool_path(name: str) -> Path:
    """The native Foundry binary `name` (forge, anvil, cast).

    Looks at `$DLX_<NAME>`, then the npm-installed binary in the project's node_modules
    (never the `.bin` wrapper, which hides exit codes), then `$PATH`.
    """
    env = os.environ.get(f"DLX_{name.upper()}")
    if env:
        return Path(env)
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "amd64")
    local = PROJECT_ROOT / "node_modules" / "@foundry-rs" / f"{name}-linux-{arch}" / "bin" / name
    if local.exists():
        return local
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ChainError(f"{name} not found: run ./scripts/setup (it installs Foundry from npm)")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def dev_accounts(count: int) -> list[LocalAccount]:
    """The first `count` accounts of anvil's public development mnemonic.

    Only for a local chain: these keys are published in Foundry's documentation.
    """
    Account.enable_unaudited_hdwallet_features()
    return [
        Account.from_mnemonic(DEV_MNEMONIC, account_path=f"m/44'/60'/0'/0/{i}")
        for i in range(count)
    ]


def rpc_call(url: str, method: str, params: list | None = None, timeout: float = 2.0) -> object:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params or []})
    req = urllib.request.Request(
        url, data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        reply = json.loads(resp.read())
    if "error" in reply:  # a JSON-RPC error object: its message, not the dict
        error = reply["error"]
        raise ChainError(f"{method} on {url}: {error.get('message', error) if isinstance(error, dict) else error}")
    return reply["result"]


def dump_state(url: str, path: Path) -> None:
    """Write the state of the anvil at `url` to `path` as `anvil --state` reads it, atomically
    (a temporary file, fsynced, then renamed): a crash leaves the old file or the new one."""
    raw = rpc_call(url, "anvil_dumpState", timeout=30.0)
    data = gzip.decompress(bytes.fromhex(str(raw).removeprefix("0x")))
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _die_with_parent() -> Callable[[], None] | None:
    """Linux: a `preexec_fn` that has the child receive SIGTERM when its parent dies, so a
    killed `dlx train` never leaves its anvil running (SIGTERM: anvil writes its state).
    libc is loaded here, in the parent: the forked child only makes the call."""
    if sys.platform != "linux":
        return None
    import ctypes

    PR_SET_PDEATHSIG = 1
    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class Anvil:
    """One anvil process that this object started and will stop (by PID).

    `own_group`: run it in its own process group, so a Ctrl-C at the terminal reaches
    only the parent (which stops the run in order, then anvil), and SIGTERM it when the
    parent dies (Linux), so no crash of the parent leaves it behind."""

    def __init__(
        self,
        state_path: Path | None = None,
        accounts: int = 10,
        port: int | None = None,
        detach_log: Path | None = None,
        own_group: bool = False,
    ) -> None:
        self.state_path = state_path
        self.accounts = accounts
        self.port = port or free_port()
        self.detach_log = detach_log  # set: run in its own session, output to this file
        self.own_group = own_group
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def save_state(self) -> None:
        """Write the chain's state file now (atomically; see `dump_state`)."""
        if self.state_path is not None:
            dump_state(self.url, self.state_path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> Anvil:
        cmd = [
            str(tool_path("anvil")),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--accounts", str(self.accounts),
            "--silent",
        ]
        if self.state_path is not None:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            cmd += ["--state", str(self.state_path)]
        if self.detach_log is not None:
            self.detach_log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.detach_log, "ab") as log:
                self.proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        else:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                process_group=0 if self.own_group else None,
                preexec_fn=_die_with_parent() if self.own_group else None,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode().strip()
                raise ChainError(f"anvil exited at start: {err.splitlines()[-1] if err else self.proc.returncode}")
            try:
                rpc_call(self.url, "eth_chainId", timeout=0.5)
                return self
            except (OSError, ChainError):
                time.sleep(0.05)
        self.stop()
        raise ChainError(f"anvil did not answer on {self.url} within {timeout:.0f}s")

    def stop(self) -> None:
        """Stop anvil gracefully so it writes its state file."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> Anvil:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Seconds `keep_state` goes on asking a chain that does not answer before it stops.
KEEP_PATIENCE_S = 30.0


def keep_state(url: str, path: Path, poll_s: float = 0.25) -> None:
    """Save the state of the anvil at `url` to `path` after every new block, until SIGTERM
    (then once more) or until anvil stops answering: for a chain whose transactions come
    from other processes (the stack's workers)."""
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    saved: object = None
    failing_since: float | None = None
    while True:
        try:
            block = rpc_call(url, "eth_blockNumber")
            if block != saved or stopping:
                dump_state(url, path)
                saved = block
            failing_since = None
        except (OSError, ChainError):
            # gone, or only slow or frozen for a while (SIGSTOP, a loaded machine): give up
            # after KEEP_PATIENCE_S without an answer; its last state is in the file
            failing_since = failing_since or time.monotonic()
            if stopping or time.monotonic() - failing_since > KEEP_PATIENCE_S:
                return
        if stopping:
            return
        time.sleep(poll_s)


if __name__ == "__main__":  # python -m lineage.chain.anvil keep URL FILE
    if len(sys.argv) != 4 or sys.argv[1] != "keep":
        sys.exit("usage: python -m lineage.chain.anvil keep URL STATE_FILE")
    keep_state(sys.argv[2], Path(sys.argv[3]))
