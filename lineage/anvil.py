"""A local EVM chain for development: finds Foundry's binaries and runs anvil.

`dlx train` with no `--rpc` starts anvil on a free port with a state file in the run
directory (anvil's `--state`: loaded at start, written at exit), so the chain outlives
the process and `dlx lineage` can start it again to read the run's history.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount

from .errors import ChainError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
ANVIL_CHAIN_ID = 31337
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


class Anvil:
    """One anvil process that this object started and will stop (by PID)."""

    def __init__(
        self,
        state_path: Path | None = None,
        accounts: int = 10,
        port: int | None = None,
        detach_log: Path | None = None,
    ) -> None:
        self.state_path = state_path
        self.accounts = accounts
        self.port = port or free_port()
        self.detach_log = detach_log  # set: run in its own session, output to this file
        self.proc: subprocess.Popen[bytes] | None = None

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
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
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
