"""`run.json`: where a run's chain, contracts and blocks are, kept in its run directory.

Written atomically after every committed step, so it always names the last head the
chain accepted. Readers (`dlx lineage`) trust the chain, not this file, for the history:
the file only says where to look. A run of the local job-queue stack (`dlx up`) also
names the stack's directory: its chain may listen on another port after `dlx down` and
`dlx up`, and `load` then points `rpc` at wherever the stack's anvil is now.

`RunRecord.open_ledger` is how every reader reaches a run's ledger: on the recorded (or a
given) endpoint, or on an anvil started on the run's embedded chain state.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.bounded import read_bounded
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from lineage.chain.ledger import Ledger

RUN_FILE = "run.json"
STACK_FILE = "stack.json"  # workers.queue.stack's record of a running stack (its `rpc` is read here)


@dataclass
class RunRecord:
    name: str
    chain_id: int
    rpc: str | None          # None: the embedded anvil whose state file is `chain_state`
    chain_state: str | None  # relative to the run directory
    registry: str
    ledger: str
    blocks: str              # blockstore directory, relative to the run directory if not absolute
    run_id: int = 0
    config: str = ""         # CID of the job configuration block
    genesis: str = ""        # CID of the genesis manifest
    head: str = ""           # CID of the last committed checkpoint
    steps: int = 0
    nodes: list[str] = field(default_factory=list)
    status: str = "created"  # created | running | completed | stopped (SIGINT, SIGTERM) | failed
    ipfs_api: str | None = None  # set: blocks live in this IPFS daemon, not in `blocks`
    stack: str | None = None  # set: the local stack (`dlx up`) whose chain this run is on
    job_dir: str | None = None  # the job file's directory (its relative `[model] init` paths)
    created_block: int = 0   # the block createRun was mined in: where reads of the run's events start

    def read_from(self, ledger: Any, run_dir: Path) -> None:
        """Have `ledger` (`lineage.chain.ledger.Ledger`) read this run's events from its
        creation block, `log_range` blocks at a time (the run's job file's `[chain]
        log_range`, else the default)."""
        ledger.from_block = self.created_block
        try:
            with open(Path(run_dir) / "job.toml", "rb") as fh:
                log_range = tomllib.load(fh).get("chain", {}).get("log_range")
        except (OSError, tomllib.TOMLDecodeError, AttributeError):
            log_range = None
        if isinstance(log_range, int) and log_range >= 1:
            ledger.log_range = log_range

    def save(self, run_dir: Path) -> None:
        tmp = run_dir / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, run_dir / RUN_FILE)

    @classmethod
    def load(cls, run_dir: Path) -> RunRecord:
        path = Path(run_dir) / RUN_FILE
        if Path(run_dir).exists() and not Path(run_dir).is_dir():
            raise ConfigError(f"not a run directory (a file, not a directory): {run_dir}")
        try:
            data = json.loads(read_bounded(path, 16 << 20, RUN_FILE).decode("utf-8"))
            if not isinstance(data, dict):
                raise TypeError("expected a JSON object")
            record = cls(**data)
        except FileNotFoundError:
            raise ConfigError(f"not a run directory (no {RUN_FILE}): {run_dir}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"malformed {path}: not UTF-8 text") from None
        except (ValueError, TypeError, RecursionError) as exc:  # JSONDecodeError, the int digit limit
            raise ConfigError(f"malformed {path}: {str(exc).removeprefix('RunRecord.__init__() ')}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
        record.rpc = record.stack_rpc() or record.rpc
        return record

    def stack_rpc(self) -> str | None:
        """Where the run's stack's chain listens now, if the stack is up."""
        if not self.stack:
            return None
        try:
            return json.loads((Path(self.stack) / STACK_FILE).read_text())["rpc"]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # the stack is down: the recorded URL is all there is

    @contextmanager
    def open_ledger(self, run_dir: Path, rpc: str | None = None, *, writable: bool = False) -> Iterator[Ledger]:
        """The run's ledger, its logs read from the run's creation block on (`read_from`): on
        `rpc`, else the recorded endpoint, else an anvil started on the run's embedded chain
        state: on a copy to read, or on the file itself (`writable`), which anvil rewrites at
        exit so that transactions sent meanwhile stay in the run's chain."""
        from lineage.chain.client import Chain
        from lineage.chain.ledger import Ledger

        with self._chain_url(Path(run_dir), rpc, writable) as url:
            ledger = Ledger(Chain(url, self.chain_id), self.registry, self.ledger)
            self.read_from(ledger, run_dir)
            yield ledger

    @contextmanager
    def _chain_url(self, run_dir: Path, rpc: str | None, writable: bool) -> Iterator[str]:
        if url := rpc or self.rpc:
            yield url
            return
        from lineage.chain.anvil import Anvil
        from lineage.errors import ChainError

        state = run_dir / (self.chain_state or "")
        if not self.chain_state or not state.exists():
            raise ChainError(f"the run's chain state file is missing: {state}")
        if writable:
            with Anvil(state_path=state) as anvil:
                yield anvil.url
            return
        with tempfile.TemporaryDirectory(prefix="dlx-chain-") as tmp:
            copy = Path(tmp) / "state.json"
            shutil.copyfile(state, copy)  # read from a copy: anvil rewrites its state at exit
            with Anvil(state_path=copy) as anvil:
                yield anvil.url

    def open_store(self, run_dir: Path) -> Any:
        """The run's block store: the IPFS daemon it used, or its blockstore directory."""
        from lineage.store.ipfs import open_store

        return open_store(self.blocks_dir(run_dir), self.ipfs_api)

    def blocks_dir(self, run_dir: Path) -> Path:
        p = Path(self.blocks)
        return p if p.is_absolute() else Path(run_dir) / p
