"""What every `dlx` command module shares: one-line errors and exit codes, and where the
chain and the blocks are.

Every user error is one line on stderr and exit code 2 (`user_errors`); a failed check is 1,
a bug of ours 3 (README, "Exit codes").

Where the chain and the blocks are: one precedence for every command, first match wins.

1. The command's own options: `--rpc`, `--chain-id`, `--registry`, `--ledger` for the chain;
   `--ipfs-api`, then `--store`, for the blocks.
2. The run directory (`--run-dir`: its run.json names the chain, and its blocks are the
   run's) or the local stack (`--stack`: its stack.json).
3. The environment: DLX_RPC, DLX_CHAIN_ID, DLX_REGISTRY, DLX_LEDGER; DLX_IPFS_API, then
   DLX_STORE.
4. The stack in `.dlx/`, if one is up there and nothing above named a chain.
5. The defaults: http://127.0.0.1:8545 for the chain; for the blocks `dlx cas`'s
   ~/.dlx/blocks, while the audit commands refuse to guess and say what to pass.

`Endpoint.resolve` applies it to the chain and `open_blocks` to the blocks; a command only
declares the options (the `...Opt` types below) and calls them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT_RPC = "http://127.0.0.1:8545"
DEFAULT_STACK = Path(".dlx")
ZERO_ADDRESS = "0x" + "0" * 40


#: Exit codes (README, "Exit codes"): every command keeps this table.
EXIT_OK, EXIT_FAILED, EXIT_USER, EXIT_INTERNAL = 0, 1, 2, 3


def _fail(message: str, code: int = EXIT_USER) -> None:
    """One line on stderr, then exit with `code` (default: a user error)."""
    sys.stderr.write(f"dlx: error: {message}\n")
    raise typer.Exit(code)


def user_errors(fn: Any) -> Any:
    """Turn the project's errors into one line and exit code 2 (no traceback); anything
    else is a bug of ours, exit code 3, so scripts can tell it from a failed check (1)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from trainer.errors import DlxError, TrainingError

        try:
            return fn(*args, **kwargs)
        except TrainingError as exc:  # the job ran and failed: not the user's input
            _fail(_first_line(exc), EXIT_FAILED)
        except DlxError as exc:
            _fail(_first_line(exc))
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as exc:
            if os.environ.get("DLX_DEBUG"):
                raise
            known = _library_error(exc)
            if known:
                _fail(known)
            _fail(f"internal error: {exc.__class__.__name__}: {_first_line(exc)}"
                  " (set DLX_DEBUG=1 for the traceback)", EXIT_INTERNAL)

    return wrapper


def _library_error(exc: Exception) -> str | None:
    """A library's error that reached the top without a project wrapper, in the user's
    terms: a request to a chain or daemon that failed (naming the endpoint, not urllib3's
    retry chain), bytes that are not DAG-CBOR, a file operation refused (naming the path).
    None: a bug of ours."""
    url = getattr(getattr(exc, "request", None), "url", None)
    if isinstance(exc, OSError) and url:
        from lineage.chain.client import why_failed

        return f"{url}: {why_failed(exc)}"
    if type(exc).__module__.startswith("dag_cbor."):
        return f"not a DAG-CBOR block: {_first_line(exc)}"
    if isinstance(exc, OSError) and exc.filename and exc.strerror:  # a path that is not what it should be
        return f"{exc.filename}: {exc.strerror}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


def config_error(message: str) -> Exception:
    from trainer.errors import ConfigError

    return ConfigError(message)


def address(text: str, what: str = "address") -> str:
    """A checksummed address, or a one-line error naming `what`."""
    from eth_utils import is_address, to_checksum_address

    if not is_address(text):
        raise config_error(f"{what} {text!r} is not an address")
    return to_checksum_address(text)


# -- where the chain and the blocks are ----------------------------------------------------

# Chain options every chain-touching command takes.
RpcOpt = Annotated[str | None, typer.Option("--rpc", help="JSON-RPC URL of the chain (default: the run's or stack's, $DLX_RPC, else http://127.0.0.1:8545).")]
ChainIdOpt = Annotated[int | None, typer.Option("--chain-id", min=1, help="Refuse any chain with another id (default: the run's or stack's, $DLX_CHAIN_ID).")]
RegistryOpt = Annotated[str | None, typer.Option("--registry", help="NodeRegistry address (default: the run's or stack's, $DLX_REGISTRY, or the ledger's registry).")]
LedgerOpt = Annotated[str | None, typer.Option("--ledger", help="TrainingLedger address (default: the run's or stack's, $DLX_LEDGER, or the registry's ledger).")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Take the chain (and blocks) from this run directory's run.json.")]
StackOpt = Annotated[Path | None, typer.Option("--stack", help="Take the chain (and blocks) from this `dlx up` stack directory (default .dlx if present).")]
StoreOpt = Annotated[Path | None, typer.Option("--store", help="Blockstore directory (default: the run's or stack's, $DLX_STORE).")]
ApiOpt = Annotated[str | None, typer.Option("--ipfs-api", help="Read blocks from an IPFS daemon's RPC API (default $DLX_IPFS_API).")]


@dataclass
class Endpoint:
    """Where to find the chain, the contracts and (for the audit commands) the blocks."""

    rpc: str | None
    chain_id: int | None
    registry: str | None
    ledger: str | None
    run_dir: Path | None = None  # set with rpc None: the run's embedded anvil state
    record: Any = None  # the run directory's RunRecord
    stack: Any = None  # the stack directory's Stack

    @classmethod
    def resolve(cls, *, rpc: str | None = None, chain_id: int | None = None, registry: str | None = None,
                ledger: str | None = None, run_dir: Path | None = None, stack: Path | None = None) -> Endpoint:
        """First match wins: the options, the run or stack directory, the environment, the
        stack in `.dlx/`, the default URL."""
        from workers.stack import STACK_FILE, Stack

        record = stk = None
        env = {k: os.environ.get(f"DLX_{k.upper()}") or None for k in ("rpc", "chain_id", "registry", "ledger")}
        if run_dir is None and stack is None and not (rpc or registry or ledger or any(env.values())) \
                and (DEFAULT_STACK / STACK_FILE).exists():
            stack = DEFAULT_STACK  # nothing said where: the local stack, if one is up here
        if run_dir is not None:
            from lineage.chain.runrecord import RunRecord

            record = RunRecord.load(run_dir)
            src = {"rpc": record.rpc, "chain_id": record.chain_id, "registry": record.registry,
                   "ledger": record.ledger}
        elif stack is not None:
            stk = Stack.load(stack)
            src = {"rpc": stk.rpc, "chain_id": stk.chain_id, "registry": stk.registry, "ledger": stk.ledger}
        else:
            if env["chain_id"] is not None and not env["chain_id"].isdigit():
                raise config_error(f"DLX_CHAIN_ID is not a chain id: {env['chain_id']!r}")
            src = {**env, "rpc": env["rpc"] or DEFAULT_RPC,
                   "chain_id": int(env["chain_id"]) if env["chain_id"] else None}
        ep = cls(rpc=rpc or src["rpc"], chain_id=chain_id if chain_id is not None else src["chain_id"],
                 registry=address(registry, "--registry") if registry else src["registry"],
                 ledger=address(ledger, "--ledger") if ledger else src["ledger"],
                 run_dir=run_dir, record=record, stack=stk)
        if ep.rpc is None and record is not None and not record.chain_state:
            raise config_error(f"run directory {run_dir} names no chain: pass --rpc")
        return ep

    @contextmanager
    def connect(self, *, writable: bool = False) -> Iterator[Any]:
        """A `lineage.chain.ledger.Ledger` on this endpoint. A run's embedded chain is started on
        its state file: a copy to read, the file itself when `writable`."""
        from lineage.chain.client import Chain
        from lineage.chain.ledger import Ledger

        if self.rpc is None:
            from lineage.audit.query import open_ledger

            with open_ledger(self.run_dir, self.record, writable=writable) as ledger:  # type: ignore[arg-type]
                if self.chain_id is not None and ledger.chain.chain_id != self.chain_id:  # --chain-id wins
                    from lineage.errors import ChainError

                    raise ChainError(f"wrong chain id: the chain of {self.run_dir} has id {ledger.chain.chain_id}, "
                                     f"not {self.chain_id}")
                yield ledger
            return
        chain = Chain(self.rpc, self.chain_id)
        registry, ledger = self.registry, self.ledger
        if registry is None and ledger is None:
            raise config_error("no contract addresses: pass --ledger (or --registry), --run-dir, --stack, "
                                "or set DLX_LEDGER")
        if registry is None:
            registry = _call(chain.contract("TrainingLedger", ledger).functions.registry(), "ledger", ledger)
        if ledger is None:
            ledger = _call(chain.contract("NodeRegistry", registry).functions.ledger(), "registry", registry)
        # A registry no ledger is bound to yet still serves the node commands; its Ledger
        # object then points its ledger half at the registry, and `node_status` knows.
        yield Ledger(chain, registry, registry if ledger == ZERO_ADDRESS else ledger)


def _call(fn: Any, what: str, where: str) -> str:
    from web3.exceptions import Web3Exception

    from lineage.errors import ChainError

    try:
        return str(fn.call())
    except (Web3Exception, ValueError):
        raise ChainError(f"no {what} contract answers at {where}") from None


def open_blocks(store: Path | None, ipfs_api: str | None, *, run_dir: Path | None = None,
                record: Any = None, stack: Path | Any = None, default: Path | None = None,
                run_directory_only: bool = False) -> Any:
    """The block store, by the precedence above: `ipfs_api`, `store`, the run's (`record`
    is its loaded run.json) or the stack's (a directory or a loaded Stack), $DLX_IPFS_API,
    $DLX_STORE, else `default` (none: a one-line error saying what to pass).
    `run_directory_only`: a run's blockstore directory even where the run used an IPFS
    daemon (`dlx cas` manages the directory itself)."""
    from lineage.store.ipfs import open_store

    if ipfs_api or store:
        return open_store(store, ipfs_api)
    if run_dir is not None:
        from lineage.chain.runrecord import RunRecord

        record = record or RunRecord.load(run_dir)
        return open_store(record.blocks_dir(run_dir)) if run_directory_only else record.open_store(run_dir)
    if stack is not None:
        from workers.stack import Stack

        return open_store((Stack.load(stack) if isinstance(stack, Path) else stack).blocks)
    if os.environ.get("DLX_IPFS_API") or os.environ.get("DLX_STORE"):
        return open_store(os.environ.get("DLX_STORE"), os.environ.get("DLX_IPFS_API"))
    if default is not None:
        return open_store(default)
    raise config_error("no blockstore: pass --store DIR, --ipfs-api ADDR, --run-dir or --stack")


def endpoint_blocks(ep: Endpoint, store: Path | None, ipfs_api: str | None) -> Any:
    """`open_blocks` with the run directory or stack the endpoint came from."""
    return open_blocks(store, ipfs_api, run_dir=ep.run_dir, record=ep.record, stack=ep.stack)
