"""What every `dlx` command module shares: one-line errors and exit codes, and where the
chain and the blocks are.

Every user error is one line on stderr and exit code 2 (`user_errors`); a failed check is 1,
a bug of ours 3 (docs/training.md, "Exit codes").

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

`Endpoint.resolve` applies it to the chain and `open_blocks` to the blocks. A command that
only needs the chain is decorated with `with_endpoint`: it gets the six chain options
(`--rpc`, `--chain-id`, `--registry`, `--ledger`, `--run-dir`, `--stack`) last on its help
page and is called with them resolved once, as `ep`; others declare the options (the
`...Opt` types below) and call them.

Naming a run: every command that takes a run (verify, lineage, lineage diff and compare,
export, generate) takes it positionally (`RunArg`) as a run directory, a stack job (JOB,
in .dlx or --stack DIR), a run id on a chain, or a checkpoint CID; `name_run` tells which,
`run_directory` and `run_checkpoint` give what a command reads, and every error lists the
forms (`RUN_FORMS`). `--run-dir DIR` still names a run directory. A run of a stopped stack
(`dlx down`) is refused naming `dlx up`, which brings its chain back (`check_chain`).

Endpoints of an untrusted run: a run directory is data from whoever made it, so the chain
and IPFS endpoints its run.json names (or the stack.json it points at) are printed on
stderr before they are used, and one that is not on this machine (not loopback) is refused
unless the user chose the endpoint (`--rpc`, `--ipfs-api`) or passes
`--trust-run-endpoints` (`check_run_endpoints`; `dlx verify`, `dlx lineage`, `dlx cas`,
`dlx export`, `dlx generate`).
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT_RPC = "http://127.0.0.1:8545"
DEFAULT_STACK = Path(".dlx")
ZERO_ADDRESS = "0x" + "0" * 40


#: Exit codes (docs/training.md, "Exit codes"): every command keeps this table.
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
        from workers.queue.stack import STACK_FILE, Stack

        record = stk = None
        env = {k: os.environ.get(f"DLX_{k.upper()}") or None for k in ("rpc", "chain_id", "registry", "ledger")}
        if run_dir is None and stack is None and not (rpc or registry or ledger or any(env.values())) \
                and (DEFAULT_STACK / STACK_FILE).exists():
            stack = DEFAULT_STACK  # nothing said where: the local stack, if one is up here
        if run_dir is not None:
            from lineage.chain.runrecord import RunRecord

            record = RunRecord.load(run_dir)
            src: dict[str, Any] = {"rpc": record.rpc, "chain_id": record.chain_id, "registry": record.registry,
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

        if self.record is not None and self.rpc == self.record.rpc:
            check_chain(self.record, None)  # a stopped stack's run: `dlx up` brings its chain back
        if self.rpc is None:
            assert self.record is not None and self.run_dir is not None  # `resolve`: rpc None only for a run's chain
            with self.record.open_ledger(self.run_dir, writable=writable) as ledger:
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
            assert ledger is not None  # (not both None: refused above)
            registry = _call(chain.contract("TrainingLedger", ledger).functions.registry(), "ledger", ledger)
        if ledger is None:
            ledger = _call(chain.contract("NodeRegistry", registry).functions.ledger(), "registry", registry)
        # A registry no ledger is bound to yet still serves the node commands; its Ledger
        # object then points its ledger half at the registry, and `node_status` knows.
        out = Ledger(chain, registry, registry if ledger == ZERO_ADDRESS else ledger)
        if self.record is not None and self.run_dir is not None and ledger == self.record.ledger:
            self.record.read_from(out, self.run_dir)  # from the run's creation block
        yield out


#: The chain options `with_endpoint` adds, in the order of a help page.
ENDPOINT_OPTIONS = (("rpc", RpcOpt), ("chain_id", ChainIdOpt), ("registry", RegistryOpt), ("ledger", LedgerOpt),
                    ("run_dir", RunDirOpt), ("stack", StackOpt))


def with_endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A command `fn(..., *, ep: Endpoint)` as Typer sees it: its own parameters, then the
    six chain options (`ENDPOINT_OPTIONS`), resolved once into `ep` (`Endpoint.resolve`)
    before `fn` runs. Under `user_errors`, so that a bad option is a one-line error."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for name, p in sig.parameters.items() if name != "ep"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
             for name, kind in ENDPOINT_OPTIONS]
    params = [*own, *added]

    @wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        where = {name: kwargs.pop(name, None) for name, _ in ENDPOINT_OPTIONS}
        return fn(*args, ep=Endpoint.resolve(**where), **kwargs)

    command.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params} | {"return": sig.return_annotation}
    return command


def _call(fn: Any, what: str, where: str) -> str:
    from web3.exceptions import Web3Exception

    from lineage.errors import ChainError

    try:
        return str(fn.call())
    except (Web3Exception, ValueError):
        raise ChainError(f"no {what} contract answers at {where}") from None


TrustOpt = Annotated[bool, typer.Option("--trust-run-endpoints", help="Use the chain and IPFS endpoints a run directory names even when they are not on this machine (default: refused; --rpc and --ipfs-api choose your own).")]


def is_loopback(endpoint: str) -> bool:
    """Whether an RPC URL (http://host:port) or an IPFS multiaddr (/ip4/127.0.0.1/tcp/5001)
    names this machine: localhost or a loopback address."""
    import ipaddress
    from urllib.parse import urlparse

    if endpoint.startswith("/"):
        parts = endpoint.split("/")
        host = parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") else ""
    else:
        try:
            host = urlparse(endpoint).hostname or ""
        except ValueError:
            return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_run_endpoints(run_dir: Path, record: Any, *, rpc: str | None = None, ipfs_api: str | None = None,
                        store: Path | None = None, trust: bool = False, chain: bool = True,
                        blocks_dir_only: bool = False) -> None:
    """Print on stderr the chain and the blocks a command reads for the run in `run_dir`,
    and refuse (one line, exit 2) an endpoint its run.json names that is not on this machine,
    unless the user chose it (`rpc`, `ipfs_api`) or `trust`s the run. `chain`: the command
    reads the chain (without it, reading only blocks, it tells only where an IPFS API is
    named: `dlx export`, `dlx generate`); `blocks_dir_only`: it reads the run's blockstore
    directory whatever run.json says (`dlx cas`; it says so where run.json names an IPFS API
    it does not use)."""
    from lineage.chain.runrecord import RUN_FILE

    named = Path(run_dir) / RUN_FILE
    if chain and rpc is None and record.rpc and not trust and not is_loopback(record.rpc):
        raise config_error(f"{named} names the chain {record.rpc}, which is not on this machine: pass --rpc URL "
                           "to choose your own, or --trust-run-endpoints to use it")
    if not blocks_dir_only and ipfs_api is None and store is None and record.ipfs_api and not trust and not is_loopback(record.ipfs_api):
        raise config_error(f"{named} names the IPFS API {record.ipfs_api}, which is not on this machine: pass "
                           "--trust-run-endpoints to use it (or import the run's CAR into a store of yours)")
    said = []
    if chain:
        said.append(f"chain {rpc} (--rpc)" if rpc else f"chain {record.rpc} ({RUN_FILE})" if record.rpc
                    else f"the run's own chain state {record.chain_state} (a local anvil)")
    if ipfs_api or store:
        said.append(f"blocks from IPFS API {ipfs_api} (--ipfs-api)" if ipfs_api else f"blocks from {store} (--store)")
    elif record.ipfs_api and not blocks_dir_only:
        said.append(f"blocks from IPFS API {record.ipfs_api} ({RUN_FILE})")
    else:
        said.append(f"blocks from {record.blocks_dir(Path(run_dir))}"
                    + (f", not its IPFS API {record.ipfs_api}" if record.ipfs_api else ""))
    if not chain and not (record.ipfs_api or ipfs_api):
        return  # no chain and no IPFS API, only directories on this machine: nothing to tell
    sys.stderr.write(f"dlx: run {run_dir}: {'; '.join(said)}\n")


NO_BLOCKSTORE = "no blockstore: pass --store DIR, --ipfs-api ADDR, --run-dir DIR or --stack DIR"


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
        from workers.queue.stack import Stack

        return open_store((Stack.load(stack) if isinstance(stack, Path) else stack).blocks)
    if os.environ.get("DLX_IPFS_API") or os.environ.get("DLX_STORE"):
        return open_store(os.environ.get("DLX_STORE"), os.environ.get("DLX_IPFS_API"))
    if default is not None:
        return open_store(default)
    raise config_error(NO_BLOCKSTORE)


def endpoint_blocks(ep: Endpoint, store: Path | None, ipfs_api: str | None) -> Any:
    """`open_blocks` with the run directory or stack the endpoint came from."""
    return open_blocks(store, ipfs_api, run_dir=ep.run_dir, record=ep.record, stack=ep.stack)


# -- naming a run --------------------------------------------------------------------------
#
# Every command that takes a run (verify, lineage, lineage diff and compare, export,
# generate) takes it positionally in any of these forms, resolved here by `name_run`;
# `--run-dir DIR` still names a run directory (or, beside a run id or a CID, says where
# their chain and blocks are).

_DIR = "a run directory (runs/NAME-...)"
_JOB = "a stack job (JOB, in .dlx or --stack DIR)"
_ID = "a run id on a chain (1, with --rpc and --ledger, --stack, or $DLX_RPC and $DLX_LEDGER)"
_CID = "a checkpoint CID (bafy..., its blocks from --store, --run-dir or --stack)"
#: The forms of a RUN argument, for help texts and errors; WHOLE_RUN_FORMS those naming a run.
RUN_FORMS = f"{_DIR}, {_JOB}, {_ID} or {_CID}"
WHOLE_RUN_FORMS = f"{_DIR}, {_JOB} or {_ID}"
RunArg = Annotated[str | None, typer.Argument(metavar="RUN", show_default=False, help=f"The run: {RUN_FORMS}.")]
WholeRunArg = Annotated[str | None, typer.Argument(metavar="RUN", show_default=False, help=f"The run: {WHOLE_RUN_FORMS}.")]


@dataclass(frozen=True)
class RunRef:
    """What a RUN names: a run directory (given, or a stack job's), a run id on a chain, or
    a checkpoint CID; exactly one of `run_dir`, `run_id`, `cid` is set."""

    text: str
    run_dir: Path | None = None
    run_id: int | None = None
    cid: Any = None  # multiformats.CID
    job: str | None = None  # the stack job whose directory `run_dir` is


def name_run(target: str | None, *, run_dir: Path | None = None, stack: Path | None = None) -> RunRef | None:
    """What the positional RUN `target` names (none: `run_dir`'s run; neither: None).

    Tried in order: a job of the stack (`stack`, else `.dlx` here, up or down) by its id;
    a run id (digits: a directory named 3 is written ./3); an existing path (a run
    directory); a CID. Beside `run_dir`, RUN is a run id or a CID whose chain and blocks
    `run_dir` gives."""
    if target is None:
        return None if run_dir is None else RunRef(str(run_dir), run_dir=run_dir)
    ref = _name_run(target, stack)
    if ref.run_dir is not None and run_dir is not None:
        raise config_error(f"the run is named twice ({target} and --run-dir {run_dir}): give one")
    return ref


def _name_run(text: str, stack: Path | None) -> RunRef:
    from lineage.chain.runrecord import RUN_FILE

    stack_dir = stack if stack is not None else DEFAULT_STACK
    job_dir = stack_dir / "runs" / text
    if "/" not in text and text not in (".", "..") and (job_dir / RUN_FILE).is_file():
        return RunRef(text, run_dir=job_dir, job=text)
    if text.isdigit():
        if int(text) < 1:
            raise config_error(f"run ids start at 1, got {text}")
        return RunRef(text, run_id=int(text))
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir() and not (path / RUN_FILE).exists() and (path / "runs").is_dir():
            raise config_error(f"{text} is a stack directory, not a run: name one of its jobs "
                               f"(JOB --stack {text}; `dlx runs --stack {text}` lists them)")
        return RunRef(text, run_dir=path)
    from lineage.store.cid import parse_cid

    try:
        return RunRef(text, cid=parse_cid(text))
    except ValueError:
        pass
    if os.sep in text or text.startswith((".", "~")):
        raise config_error(f"no such run directory: {text}")
    where = f"no job {text} in {stack_dir}/runs, " if stack is not None or DEFAULT_STACK.is_dir() else ""
    raise config_error(f"{text!r} names no run ({where}not a run id, a directory or a CID): give {RUN_FORMS}")


def need_run(ref: RunRef | None, what: str) -> RunRef:
    """`ref`, or a one-line error saying which forms name a run."""
    if ref is None:
        raise config_error(f"{what} needs a run: {RUN_FORMS}")
    return ref


def stack_down(record: Any) -> str | None:
    """Why the chain of a run of the local stack cannot answer: the stack is down (`dlx
    down` removed its stack.json; its anvil stopped with it). None: not a stack's run, or up."""
    if not record.stack or record.stack_rpc() is not None:
        return None
    stack = Path(record.stack)
    here = stack.resolve() == DEFAULT_STACK.resolve()
    up = "dlx up" if here else f"dlx up --stack {_shown(stack)}"
    return (f"the stack in {_shown(stack)} is down, and the run's chain ({record.rpc}) with it: "
            f"`{up}` brings both back (the chain keeps the run), or pass --rpc URL")


def _shown(path: Path) -> str:
    """`path` relative to here where it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def check_chain(record: Any, rpc: str | None) -> None:
    """Refuse, naming `dlx up`, to read the chain of a stopped stack's run (unless `rpc`
    names another endpoint)."""
    why = None if rpc else stack_down(record)
    if why:
        from lineage.errors import ChainError

        raise ChainError(why)


@contextmanager
def run_directory(ref: RunRef, what: str, *, rpc: str | None = None, chain_id: int | None = None,
                  registry: str | None = None, ledger: str | None = None, run_dir: Path | None = None,
                  stack: Path | None = None, store: Path | None = None,
                  ipfs_api: str | None = None, trust_endpoints: bool = False) -> Iterator[Path]:
    """The run directory of `ref`, whose run.json says where its chain and blocks are (what
    `dlx verify` reads): its own (its endpoints printed and checked: `check_run_endpoints`;
    the chain may be `rpc`, the blocks `store` or `ipfs_api`, which the command then opens
    itself); for a run id, a temporary one naming the chain and the blocks the options give
    (as for every command; those of a `run_dir` checked alike). A CID names a checkpoint,
    not a run."""
    from lineage.chain.runrecord import RUN_FILE, RunRecord

    if ref.cid is not None:
        raise config_error(f"{what} takes a whole run, and {ref.text} is one checkpoint: give {WHOLE_RUN_FORMS} "
                           f"(`dlx lineage {ref.text}` shows the checkpoint's ancestors)")
    if ref.run_dir is None and run_dir is not None and RunRecord.load(run_dir).run_id == ref.run_id:
        ref = RunRef(ref.text, run_dir=run_dir)  # the run in --run-dir itself
    if ref.run_dir is not None:
        if (ref.run_dir / RUN_FILE).is_file():  # else the command's own checks come first, then "not a run"
            record = RunRecord.load(ref.run_dir)
            check_chain(record, rpc)
            check_run_endpoints(ref.run_dir, record, rpc=rpc, ipfs_api=ipfs_api, store=store, trust=trust_endpoints)
        yield ref.run_dir
        return
    import tempfile

    if run_dir is not None:  # --run-dir says where the run id's chain and blocks are
        check_run_endpoints(run_dir, RunRecord.load(run_dir), rpc=rpc, ipfs_api=ipfs_api, store=store,
                            trust=trust_endpoints)
    ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, run_dir=run_dir, stack=stack)
    blocks = _blocks_spec(ep, store, ipfs_api)
    with ep.connect() as lg:
        found = RunRecord(name=f"run-{ref.run_id}", chain_id=lg.chain.chain_id, rpc=ep.rpc,
                          chain_state=str((ep.run_dir / ep.record.chain_state).resolve()) if ep.rpc is None else None,
                          registry=lg.registry.address, ledger=lg.ledger.address, run_id=int(ref.run_id or 0),
                          blocks=blocks[0], ipfs_api=blocks[1])
        lg.run_created(found.run_id)  # an unknown run: the ledger's error, before anything else
    with tempfile.TemporaryDirectory(prefix="dlx-run-") as tmp:
        found.save(Path(tmp))
        yield Path(tmp)


def _blocks_spec(ep: Endpoint, store: Path | None, ipfs_api: str | None) -> tuple[str, str | None]:
    """(blockstore directory, IPFS API or None) by `open_blocks`' precedence, as a run.json
    names them."""
    if ipfs_api or store:
        return str(Path(store).resolve()) if store else "blocks", ipfs_api
    if ep.record is not None:
        return str(ep.record.blocks_dir(ep.run_dir).resolve()), ep.record.ipfs_api
    if ep.stack is not None:
        return ep.stack.blocks, None
    if os.environ.get("DLX_IPFS_API") or os.environ.get("DLX_STORE"):
        env_store = os.environ.get("DLX_STORE")
        return str(Path(env_store).resolve()) if env_store else "blocks", os.environ.get("DLX_IPFS_API")
    raise config_error(NO_BLOCKSTORE)


def run_checkpoint(ref: RunRef, *, rpc: str | None = None, chain_id: int | None = None,
                   registry: str | None = None, ledger: str | None = None, run_dir: Path | None = None,
                   stack: Path | None = None, store: Path | None = None,
                   ipfs_api: str | None = None, trust: bool = False) -> tuple[str, Any, Any]:
    """(checkpoint CID, its block store, the run's RunRecord or None) of `ref`: a run
    directory's head (its run.json; no chain read) from its own blocks or the ones the
    options give (what is read printed and checked: `check_run_endpoints`); a run id's head
    on its chain, or a CID itself, from the blocks the options give (as for every command)."""
    from lineage.chain.runrecord import RunRecord

    record: RunRecord | None
    if ref.run_dir is not None:
        record = RunRecord.load(ref.run_dir)
        check_run_endpoints(ref.run_dir, record, ipfs_api=ipfs_api, store=store, trust=trust, chain=False)
        head = record.head or record.genesis
        if not head:
            raise config_error(f"the run in {ref.run_dir} has no checkpoint yet")
        return head, open_blocks(store, ipfs_api, run_dir=ref.run_dir, record=record), record
    if ref.cid is not None:
        record = None
        if run_dir is not None:  # --run-dir says where the blocks are
            record = RunRecord.load(run_dir)
            check_run_endpoints(run_dir, record, ipfs_api=ipfs_api, store=store, trust=trust, chain=False)
        return str(ref.cid), open_blocks(store, ipfs_api, run_dir=run_dir, record=record, stack=stack), record
    from lineage.store.cid import DAG_CBOR, cid_from_digest

    if run_dir is not None:  # --run-dir says where the run id's chain and blocks are
        check_run_endpoints(run_dir, RunRecord.load(run_dir), rpc=rpc, ipfs_api=ipfs_api, store=store, trust=trust)
    ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, run_dir=run_dir, stack=stack)
    blocks = endpoint_blocks(ep, store, ipfs_api)
    with ep.connect() as lg:
        head, _ = lg.head(int(ref.run_id or 0))
    record = ep.record if ep.record is not None and ep.record.run_id == ref.run_id else None
    return str(cid_from_digest(head, DAG_CBOR)), blocks, record
