"""The `dlx` command line.

    dlx train examples/tiny.toml        # train, store checkpoints, record steps on a chain
    dlx lineage runs/tiny-...           # the run's checkpoint chain, read back from the chain
    dlx verify runs/tiny-...            # audit every step (a run: workers/cli/common.py's RUN forms)

Heavy libraries (torch, web3) are imported inside the commands, so `dlx --help` is fast.
Every user error is one line on stderr and exit code 2 (workers/cli/common.py, which also
says where every command finds the chain and the blocks).

This package is the `dlx` command tree: the app, `train` and `verify` here, each group's
commands in a module of its own (audit, cas, data, deploy, jobs, model, node, plan),
common.py and console.py what they share.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from trainer.supervisor import warm_up

from . import audit, cas, data, deploy, jobs, model, node, plan
from .common import (
    DEFAULT_STACK,
    EXIT_FAILED,
    ApiOpt,
    ChainIdOpt,
    LedgerOpt,
    RegistryOpt,
    RunDirOpt,
    StoreOpt,
    TrustOpt,
    WholeRunArg,
    user_errors,
)

app = typer.Typer(
    name="dlx",
    help="DiLoCoX training across slow links, with an auditable on-chain lineage.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# What `dlx train`'s ranks (and `dlx verify --replay`'s processes) import beyond the trainer:
# this module (each runs the dlx script again as __mp_main__) and the shard digest ranks are
# handed (RankControl.shard_digest).
RANK_IMPORTS = ("workers.cli", "lineage.store.unixfs")

# Options the reading commands (lineage, verify) share.
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ReadRpcOption = Annotated[str | None, typer.Option("--rpc", help="Read from this chain instead of the run's own.")]


@app.command()
@user_errors
def train(
    job_file: Annotated[Path | None, typer.Argument(help="Job file (TOML), e.g. examples/tiny.toml; none with --resume.")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Where the run's blocks, chain state and run.json go (default runs/<name>-<time>).")] = None,
    rpc: Annotated[str | None, typer.Option("--rpc", help="JSON-RPC URL of an EVM chain; default: start a local anvil.")] = None,
    resume: Annotated[Path | None, typer.Option("--resume", metavar="RUN_DIR", help="Continue this stopped, failed or crashed run from the last step committed on its chain, with its own job file.")] = None,
) -> None:
    """Train a job as local processes; every outer step is stored and committed on chain.
    SIGINT or SIGTERM stops every rank at the next inner-step boundary (a second one at once);
    the run then resumes with --resume."""
    from trainer.errors import ConfigError
    from workers.run.jobfile import load_job_file

    if (job_file is None) == (resume is None):
        raise ConfigError("give a job file, or --resume RUN_DIR (not both)")
    if resume is not None and run_dir is not None:
        raise ConfigError("--run-dir: not with --resume (a resumed run stays in its directory)")
    if resume is not None:
        from workers.run.local import resumable

        job = resumable(resume)[1]
    elif job_file is not None:  # (one of the two: the check above)
        job = load_job_file(job_file)  # validated before anything heavy is imported or started
    warm_up(RANK_IMPORTS)  # the ranks' imports, once, while this process prepares the data and the chain

    from trainer.launch import check_local
    from workers.cli.console import Ticker, console, count, human_seconds, megabytes
    from workers.cli.data import ticking
    from workers.run.local import Callbacks, default_run_dir, preflight, resume_job, run_job

    run_dir = resume or run_dir or default_run_dir(job)
    if resume:
        device = check_local(job)
    else:
        with Ticker("data", 0) as data_bar:  # tokenizing, where this machine has not yet
            device = preflight(job, run_dir, rpc, data_progress=ticking(data_bar))
    err, out = console(stderr=True), console()
    T, H = job.outer.steps, job.outer.inner_steps
    bar = Ticker("train", T * H)
    sent = [0.0]  # bytes every rank sent, as of the last committed step

    def progress(p: Any) -> None:
        bar.update(p.global_step, f"outer {p.outer_step}/{T} inner {p.inner_step}/{H} loss {p.loss:.3f} "
                   f"lr {p.lr:.2e} {p.tokens_per_s:,.0f} tok/s sent {megabytes(sent[0])} left {human_seconds(p.eta_s)}")

    def committed(step: int, cid: Any, art: Any) -> None:
        sent[0] = art.metrics.get("bytes_sent", 0.0)
        bar.note(f"step {step}/{T}  eval_loss {art.metrics['eval_loss']:.4f}  checkpoint {cid}")

    cb = Callbacks(warn=lambda m: err.print(f"[yellow]warning:[/] {m}"), progress=progress, committed=committed,
                   resuming=lambda step, cid: bar.note(f"resuming from step {step}/{T} (checkpoint {cid}): "
                                                       f"outer step {step + 1} next"))
    m = job.model
    n = m.n_params()
    size = f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    err.print(f"training {job.name}: {m.family} {size} parameters, "
              f"{count(job.parallel.replicas, 'replica')} x {count(job.parallel.stages, 'stage')} on {device}, "
              f"{T} outer steps x {H} inner steps; run directory {run_dir}")
    signalled: list[int] = []

    def stopping(name: str) -> None:
        signalled.append(getattr(signal, name))
        bar.note(f"{name}: stopping at the next inner step (again: at once)")

    cb.stopping = stopping
    with bar:
        record = resume_job(run_dir, rpc, cb) if resume or job_file is None else run_job(job, job_file, run_dir, rpc, cb)
    if record.status == "stopped":
        err.print(f"stopped at step {record.steps}/{T}, head {record.head}; continue with: dlx train --resume {run_dir}")
        raise typer.Exit(128 + signalled[0])
    out.print(f"run id   {record.run_id} (ledger {record.ledger}, chain {record.chain_id})")
    out.print(f"head     {record.head}")
    out.print(f"run dir  {run_dir}")


@app.command()
@user_errors
def verify(
    run: WholeRunArg = None,
    as_json: JsonOption = False,
    rpc: ReadRpcOption = None,
    replay: Annotated[float, typer.Option("--replay", metavar="FRACTION", help="Also replay this fraction (0..1) of the (step, replica) pairs from their start states (at least one when > 0).")] = 0.0,
    tolerance: Annotated[float | None, typer.Option("--tolerance", help="How a native run's replays are judged: 0 bit for bit, X > 0 the flip-aware comparison within relative X (default: bit for bit where this machine's kernel fingerprint is the trainer's, else flip-aware within the calibrated tolerance). A portable run replays bit for bit whatever it says.")] = None,
    queue: Annotated[bool, typer.Option("--queue", help="Fan the replays out to the workers' `verify` queue (Redis from --stack or DLX_REDIS_URL) instead of replaying here.")] = False,
    stack_dir: Annotated[Path | None, typer.Option("--stack", help="The local stack's directory (`dlx up`; default .dlx): its job RUN, its chain for a run id, its queue for --queue.")] = None,
    data_full: Annotated[bool, typer.Option("--data-full", help="Also re-tokenize the stored dataset with the recorded tokenizer and check it gives the token file's CID.")] = False,
    run_dir: RunDirOpt = None,
    chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
    store: StoreOpt = None, ipfs_api: ApiOpt = None, trust_endpoints: TrustOpt = False,
) -> None:
    """Audit every committed step: chain (links, signatures, stakes), content (every block
    present and matching its CID), aggregate (outer step recomputed bit for bit), data (each
    replica's shard re-derived from the stored token file has the attested digest), and with
    --replay the sampled rounds re-run from their start states. Exits 1 if any step fails."""
    from contextlib import nullcontext

    from workers.cli.common import name_run, need_run, open_blocks, run_directory

    ref = need_run(name_run(run, run_dir=run_dir, stack=stack_dir), "dlx verify")
    if replay > 0 and not queue:
        warm_up(RANK_IMPORTS)  # the replay processes' imports, while the chain and blocks are checked
    from lineage.audit.verify import LEVELS, REPLAY, verify_run
    from workers.cli.console import Ticker

    with run_directory(ref, "dlx verify", rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger,
                       run_dir=run_dir, stack=stack_dir, store=store, ipfs_api=ipfs_api,
                       trust_endpoints=trust_endpoints) as where:
        replayer = _queue_replayer(where, stack_dir or DEFAULT_STACK, store, ipfs_api) if queue and replay > 0 else None
        ticker = Ticker("verify", 0) if replay > 0 else None  # replays are the long part
        blocks = open_blocks(store, ipfs_api) if store or ipfs_api else None  # the user's, on a run directory too
        with ticker or nullcontext():
            report = verify_run(where, rpc, replay=replay, tolerance=tolerance,
                                replayer=_ticking(ticker, replayer) if ticker else None, data_full=data_full,
                                store=blocks)
    if as_json:
        sys.stdout.write(json.dumps(report.as_json(), indent=2) + "\n")
    else:
        from rich.table import Table

        from workers.cli.console import cid_column
        from workers.cli.console import console as make_console

        levels = (*LEVELS, REPLAY) if replay > 0 else LEVELS
        table = Table(title=f"verify run {report.run_id}")
        table.add_column("step")
        for level in levels:
            table.add_column(level)
        cid_column(table, "reason")  # it names blocks by CID: never folded inside one
        for s in report.steps:
            marks = ["[green]ok[/]" if lv in s.passed else "[red]FAIL[/]" if lv in s.failures
                     else "n/a" if lv in s.unavailable else "-" for lv in levels]
            table.add_row(str(s.step), *marks, "; ".join(f"{k}: {v}" for k, v in {**s.failures, **s.unavailable}.items()))
        console = make_console()
        console.print(table)
        if report.replay:
            exact = sum(all(st.exact for st in r.stages) and r.ok for r in report.replay)
            console.print(f"replayed {len(report.replay)} (step, replica) rounds in {report.replay_seconds:.1f} s: "
                          f"{sum(r.ok for r in report.replay)} ok, {exact} bit for bit")
            _print_kernels(console, report.kernels)
        for failure in report.run_failures:
            console.print(f"[red]run:[/] {failure}")
        console.print("[green]all steps verified[/]" if report.ok else "[red]verification failed[/]")
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


def _print_kernels(console: Any, kernels: dict[str, Any]) -> None:
    """The kernel fingerprints of the replays (`lineage.audit.replay.kernels_summary`): the
    trainer's (with its slots when they differ), the replaying processes', and how they
    were judged."""
    from rich.markup import escape

    trained = kernels.get("trained_on", {})
    numerics = "/".join(kernels.get("numerics", [])) or "?"
    for fp, slots in trained.items():
        where = "" if len(trained) == 1 else " (slots " + ", ".join(f"({r}, {s})" for r, s in slots) + ")"
        console.print(escape(f"trained on   {fp}{where} [{numerics}]"))
    for fp in kernels.get("replayed_on", []):
        console.print(escape(f"replayed on  {fp}"))
    for note in kernels.get("notes", []):
        console.print(escape(note))


def _ticking(ticker: Any, replayer: Any) -> Any:
    """A replayer (default: here, `lineage.audit.replay.replay_many`) that tells `ticker` how many
    rounds it replays and when they are done."""
    from lineage.audit.replay import replay_many

    def replay(store: Any, items: list[Any], tolerance: float | None) -> list[Any]:
        ticker.update(0, f"replaying {len(items)} (step, replica) rounds", total=len(items))
        results = (replayer or replay_many)(store, items, tolerance)
        ticker.update(len(items), f"replayed {len(items)} (step, replica) rounds")
        return results

    return replay


def _queue_replayer(run_dir: Path, stack_dir: Path, store: Path | None = None, ipfs_api: str | None = None):
    """Replays through the workers: they read the run's blocks from its blockstore directory
    (a path every worker can reach) or from its IPFS daemon, or the ones the user named
    (`store`, `ipfs_api`)."""
    from lineage.audit.replay import ReplicaReplay
    from lineage.chain.runrecord import RunRecord
    from workers.queue.verifyq import replay_via_queue

    broker = os.environ.get("DLX_REDIS_URL")
    if not broker:
        from workers.queue.stack import Stack

        broker = Stack.load(stack_dir).redis_url
    record = RunRecord.load(run_dir)
    if ipfs_api or store:
        spec = ipfs_api or str(Path(store or ".").resolve())
    else:
        spec = record.ipfs_api or str(record.blocks_dir(run_dir).resolve())

    def replayer(store, items, tolerance):  # the workers' results are judged again by verify_run
        return [ReplicaReplay.from_json(d) for d in replay_via_queue(broker, spec, items, tolerance or 0.0)]

    return replayer


app.add_typer(cas.app, name="cas")  # dlx cas ...
app.add_typer(data.app, name="data")  # dlx data prepare
jobs.register(app)  # worker, submit, status, ...
node.register(app)  # node register|stake|...
audit.register(app)  # lineage, challenge, arbiter, ...
model.register(app)  # export, generate
deploy.register(app)  # deploy
app.command(name="plan")(plan.plan)  # dlx plan JOB: cost at scale (workers/run/plan.py)


def command() -> Any:
    """The `dlx` command tree (click's), its help made plain for a terminal: typer's rich
    panels read `[data]` in a help string as markup and drop it, keep a docstring's line
    breaks in the command list, and show flags as `--json <bool>` (which `--json true`
    is not accepted as). Here every page is click's own layout, rewrapped to the terminal;
    placeholders are upper case throughout (`JOB_FILE`, `CID`, `PATH`, `TEXT`); and a
    command's line in its group's list is its first sentence, whole."""
    cmd = typer.main.get_command(app)
    _plain_help(cmd)
    return cmd


_TYPE_METAVAR = {"<path>": "PATH", "<str>": "TEXT", "<int>": "INTEGER", "<float>": "NUMBER",
                 "<int range>": "INTEGER", "<float range>": "NUMBER"}


def _plain_help(cmd: Any) -> None:
    cmd.rich_markup_mode = None
    if cmd.help and not cmd.short_help:
        first = " ".join(cmd.help.split("\n\n")[0].split())
        cmd.short_help = first.split(". ")[0].rstrip(".") + "."
    ctx = typer.Context(cmd, info_name=cmd.name)
    for param in cmd.params:
        if param.param_type_name == "argument":
            _plain_argument(param)
        elif param.param_type_name == "option" and param.metavar is None and not param.is_flag:
            shown = param.display_type(ctx)
            param.metavar = _TYPE_METAVAR.get(shown, shown.strip("<>").upper())
    for sub in getattr(cmd, "commands", {}).values():
        _plain_help(sub)


def _plain_argument(param: Any) -> None:
    """An argument's placeholder: its name in upper case (`JOB_FILE`), in brackets where it
    may be left out, as click writes it (typer's own writes `{job_file}` and `[job_file]`)."""
    name = (param.metavar or param.name).upper()
    many = "..." if param.nargs != 1 else ""
    param.metavar = name
    param.get_usage_pieces = lambda ctx: [f"{name}{many}" if param.required else f"[{name}{many}]"]
    param.display_type_rich = lambda ctx: None


def main() -> None:
    try:
        command()(prog_name="dlx")
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    _leave(code)


def _leave(code: Any) -> None:
    """Exit as `sys.exit(code)` would, without the interpreter's teardown.

    Once torch and web3 are loaded, Python's finalisation (freeing every module and
    object, libtorch's static destructors) takes most of a second, longer than many
    commands' own work. What a clean exit owes the outside world still happens: the
    atexit handlers (multiprocessing's and logging's among them) run, and stdout and
    stderr are flushed; everything of ours is closed by its `with` block before this.
    """
    import atexit

    if code is None:
        code = 0
    elif not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
