"""`dlx` commands for auditors and arbiters: lineage, diff, challenges, verdicts, slashing.

    dlx lineage RUN [--json|--html FILE]          # a run's commits, or one checkpoint's ancestors
    dlx lineage runs/tiny-...                     # the run a `dlx train` left in a directory
    dlx lineage diff A B [--top N] [--json]       # summary, per-tensor change norms, metric deltas
    dlx lineage compare RUN_A RUN_B [--json|--html FILE]  # two run directories side by side

A RUN is a run directory, a stack job, a run id on a chain or a checkpoint CID, resolved in
one place (workers/cli/common.py, `name_run`); `--run-dir DIR` still names a run directory.
    dlx challenge RUN STEP --node ADDR            # replay the node's work; challenge a mismatch
    dlx arbiter vote ID --uphold|--dismiss [--replay] [--out FILE]   # sign a verdict
    dlx arbiter resolve ID --uphold|--dismiss SIG_OR_FILE...         # submit a quorum
    dlx expire-challenge ID                       # no verdict within the period: bond back, step free
    dlx slash-equivocation A.json B.json          # two signed claims of one slot: slash at once

The chain and the blocks are found as for every command (workers/cli/common.py). Keys come
from the environment only: the challenger's is the node key (DLX_NODE_KEY or DLX_KEYSTORE; it
must be staked), an arbiter's DLX_ARBITER_KEY (or DLX_ARBITER_KEYSTORE), a reporter's
DLX_REPORTER_KEY; each falls back to the node key.

Challenge evidence and the arbiters' checks are lineage/audit/evidence.py's; this module
parses options and prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from lineage.audit.evidence import (
    Accused,
    AuditError,
    aggregate_failure,
    check_equivocation,
    check_vote_by_recompute,
    check_vote_by_replay,
    open_replay_challenge,
    replay_slots,
    report_equivocation,
    slots_of,
    step_record,
    store_aggregate_evidence,
)

from .common import (
    RUN_FORMS,
    ApiOpt,
    ChainIdOpt,
    Endpoint,
    LedgerOpt,
    RegistryOpt,
    RpcOpt,
    RunArg,
    RunDirOpt,
    RunRef,
    StackOpt,
    StoreOpt,
    TrustOpt,
    address,
    check_chain,
    check_run_endpoints,
    endpoint_blocks,
    name_run,
    need_run,
    run_checkpoint,
    user_errors,
    with_endpoint,
)
from .node import JsonOpt, chain_time, fmt_wei, load_key, parse_amount

UpholdOpt = Annotated[bool | None, typer.Option("--uphold/--dismiss", help="The verdict: uphold the challenge (slash) or dismiss it.", show_default=False)]
ToleranceOpt = Annotated[float | None, typer.Option("--tolerance", min=0.0, help="How a native run's replay is judged: 0 bit for bit, X > 0 the flip-aware comparison within relative X (default: as dlx verify: bit for bit where this machine's kernel fingerprint is the trainer's, else flip-aware within the calibrated tolerance, so an honest node is never slashable because this CPU differs from its). A portable run is judged bit for bit whatever it says.")]


def _verdict(upheld: bool | None) -> bool:
    if upheld is None:
        raise AuditError("say --uphold or --dismiss")
    return upheld


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")


def _read_signature(text: str, challenge_id: int, upheld: bool, lg: Any) -> bytes:
    """A verdict signature given as 0x-hex, or the file `dlx arbiter vote --out` wrote."""
    if text.startswith("0x") and not Path(text).exists():
        try:
            sig = bytes.fromhex(text[2:])
        except ValueError:
            raise AuditError(f"signature {text[:18]}... is not hex") from None
    else:
        try:
            doc = json.loads(Path(text).read_text())
            sig = bytes.fromhex(str(doc["signature"]).removeprefix("0x"))
        except FileNotFoundError:
            raise AuditError(f"no such verdict file (and not a 0x signature): {text}") from None
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
            raise AuditError(f"{text} is not a verdict file written by `dlx arbiter vote --out`") from None
        for key, want in (("challenge", challenge_id), ("upheld", upheld), ("chainId", lg.chain.chain_id)):
            if doc.get(key) != want:
                raise AuditError(f"{text}: {key} is {doc.get(key)!r}, not {want!r}")
        if str(doc.get("ledger", "")).lower() != lg.ledger.address.lower():
            raise AuditError(f"{text}: for ledger {doc.get('ledger')}, not {lg.ledger.address}")
    if len(sig) != 65:
        raise AuditError(f"a verdict signature has 65 bytes, got {len(sig)}")
    return sig


# -- commands -----------------------------------------------------------------------------

class _LineageGroup(TyperGroup):
    """`dlx lineage ARGS` runs `show` unless ARGS start with a subcommand (`diff`), so
    `dlx lineage 3`, `dlx lineage bafy...` and `dlx lineage --run-dir DIR` all work."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = ["show", *args]
        return super().parse_args(ctx, args)


lineage_app = typer.Typer(
    name="lineage", cls=_LineageGroup,
    help="A run's checkpoint chain as recorded on the ledger, checked against the blockstore: "
         "`dlx lineage RUN` (the `show` command; RUN a run directory, a stack job, a run id or a checkpoint "
         "CID), `dlx lineage diff A B` and `dlx lineage compare RUN_A RUN_B`.")


@lineage_app.command("show")
@user_errors
def show(
    target: RunArg = None,
    run_dir: RunDirOpt = None,
    as_json: JsonOpt = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report to this file.")] = None,
    rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
    stack: StackOpt = None, store: StoreOpt = None, ipfs_api: ApiOpt = None, trust_endpoints: TrustOpt = False,
) -> None:
    """The commits of a run (status pending/finalized/rejected, the replicas that took part,
    signers, contributions, metrics, transaction) or the ancestors of one checkpoint, with
    the run's configuration. A CID shows that checkpoint's ancestors."""
    ref = need_run(name_run(target, run_dir=run_dir, stack=stack), "dlx lineage")
    result = _lineage(ref, run_dir, rpc, chain_id, registry, ledger, stack, store, ipfs_api, trust_endpoints)
    doc = result.as_json()
    if html is not None:
        from lineage.audit.report import render_html
        from workers.run.tracking import read_metrics

        write_report(html, render_html(doc, read_metrics(ref.run_dir) if ref.run_dir is not None else None))
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from rich.table import Table

    from workers.cli.console import cid_column, console

    what = f"checkpoint {result.target} of run" if result.target else "run"
    table = Table(title=f"{what} {result.run_id} ({result.name}) on chain {result.chain_id}, ledger {result.ledger}")
    for col in ("step", "status", "replicas", "checkpoint", "parent", "eval loss", "nodes", "reward", "tx"):
        if col in ("checkpoint", "parent", "nodes", "tx"):
            cid_column(table, col)
        else:
            table.add_column(col, overflow="fold")
    colors = {"finalized": "green", "rejected": "red", "uncommitted": "yellow"}
    for s in result.steps:
        status = s.status + (f" (challenge {s.rejected_by})" if s.rejected_by is not None else "")
        if s.status in colors:
            status = f"[{colors[s.status]}]{status}[/]"
        table.add_row(str(s.step), status, ",".join(map(str, s.replicas)), s.checkpoint, s.parent,
                      "-" if s.loss is None else f"{s.loss:.4f}", "\n".join(s.nodes),
                      _reward_cell(result.rewards.get(s.step) if s.status == "finalized" else None), s.tx)
    out = console()
    out.print(table)
    if html is not None:
        out.print(f"report written to {html}")


def _reward_cell(reward: dict[str, Any] | None) -> str:
    """A final step's reward in `dlx lineage`: the share each slot was paid, and who
    (slot order; "forfeited" for a node slashed after the step), or "-"."""
    if not reward:
        return "-"
    paid = [p or "forfeited" for p in reward["paid"]]
    return f"{fmt_wei(int(reward['share_wei']))} a slot to\n" + "\n".join(paid)


def _lineage(ref: RunRef, run_dir: Path | None, rpc: str | None, chain_id: int | None,
             registry: str | None, ledger: str | None, stack: Path | None, store: Path | None,
             ipfs_api: str | None, trust: bool = False) -> Any:
    """`dlx lineage show`'s query: a run directory read as it recorded itself, or a run id
    or checkpoint CID read through the endpoint the options name (flags win over run.json).
    A run directory's own endpoints are printed and checked (`check_run_endpoints`)."""
    from lineage.audit import query
    from lineage.chain.runrecord import RunRecord

    if ref.run_dir is not None:
        record = RunRecord.load(ref.run_dir)
        check_chain(record, rpc)  # a stopped stack's run names `dlx up` first
        check_run_endpoints(ref.run_dir, record, rpc=rpc, ipfs_api=ipfs_api, store=store, trust=trust)
        if (chain_id, registry, ledger, store, ipfs_api) == (None,) * 5:
            return query.run_lineage(ref.run_dir, rpc)
    elif run_dir is not None:  # --run-dir says where the run id's or CID's chain and blocks are
        check_run_endpoints(run_dir, RunRecord.load(run_dir), rpc=rpc, ipfs_api=ipfs_api, store=store, trust=trust)
    # flags win over run.json (docs/audit.md): read through the endpoint they name
    ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger,
                          run_dir=ref.run_dir or run_dir, stack=stack)
    run_id = ep.record.run_id if ref.run_dir is not None and ep.record is not None else ref.run_id
    blocks = endpoint_blocks(ep, store, ipfs_api)
    with ep.connect() as lg:
        if ref.cid is None:
            name = ep.record.name if ep.record and ep.record.run_id == run_id else None
            return query.ledger_lineage(lg, blocks, int(run_id or 0), name=name)
        return query.checkpoint_lineage(lg, blocks, ref.cid)


@lineage_app.command("compare")
@user_errors
def compare(
    run_a: Annotated[str, typer.Argument(metavar="RUN_A", help="Run A: a run directory (written by `dlx train`) or a stack job (JOB, in .dlx or --stack DIR).", show_default=False)],
    run_b: Annotated[str, typer.Argument(metavar="RUN_B", help="Run B, in either form.", show_default=False)],
    as_json: JsonOpt = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write the comparison as a self-contained HTML page.")] = None,
    stack: StackOpt = None,
    trust_endpoints: TrustOpt = False,
) -> None:
    """Two runs side by side: the configuration keys that differ, and their eval loss,
    train loss and bytes sent per outer step (with --html also inner loss and
    compression error, plotted on shared axes)."""
    from lineage.audit import query
    from lineage.audit.report import config_differences, render_compare_html
    from lineage.chain.runrecord import RunRecord
    from workers.run.tracking import read_metrics

    dir_a, dir_b = (_run_dir_of(text, stack) for text in (run_a, run_b))
    for d in (dir_a, dir_b):
        record = RunRecord.load(d)
        check_chain(record, None)
        check_run_endpoints(d, record, trust=trust_endpoints)

    a, b = (query.run_lineage(d, None).as_json() for d in (dir_a, dir_b))
    diffs = config_differences(a, b)
    if html is not None:
        write_report(html, render_compare_html(a, b, read_metrics(dir_a), read_metrics(dir_b)))
    if as_json:
        doc = {"a": {"run_dir": str(dir_a), "run": a["run"], "name": a["name"], "head": a["head"]},
               "b": {"run_dir": str(dir_b), "run": b["run"], "name": b["name"], "head": b["head"]},
               "config": [{"key": k, "a": va, "b": vb} for k, va, vb in diffs],
               "steps": compare_rows(a, b)}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from rich.table import Table

    from workers.cli.console import cid_column, console

    out = console()
    runs = Table(title="runs")
    for col in ("", "run", "name", "run dir"):
        runs.add_column(col)
    cid_column(runs, "head")
    runs.add_row("A", str(a["run"]), a["name"], str(dir_a), a["head"])
    runs.add_row("B", str(b["run"]), b["name"], str(dir_b), b["head"])
    out.print(runs)
    config = Table(title="configuration differences" if diffs else "configuration: identical")
    for col in ("key", "A", "B"):
        config.add_column(col)
    for k, va, vb in diffs:
        config.add_row(k, json.dumps(va), json.dumps(vb))
    out.print(config)
    curves = Table(title="per outer step")
    for col in ("step", "eval A", "eval B", "train A", "train B", "sent A", "sent B"):
        curves.add_column(col, justify="right")
    for row in compare_rows(a, b):
        curves.add_row(str(row["step"]), *(_num(row[k]) for k in ("eval_loss_a", "eval_loss_b", "train_loss_a", "train_loss_b")),
                       *("-" if row[k] is None else f"{row[k] / 1e6:.2f} MB" for k in ("bytes_sent_a", "bytes_sent_b")))
    out.print(curves)
    if html is not None:
        out.print(f"comparison written to {html}")


@lineage_app.command("diff")
@user_errors
def diff(
    run_a: Annotated[str, typer.Argument(metavar="A", help=f"The base checkpoint, or a run's head: {RUN_FORMS}.", show_default=False)],
    run_b: Annotated[str, typer.Argument(metavar="B", help="Compared as B - A; any form A takes, each from its own blocks.", show_default=False)],
    top: Annotated[int, typer.Option("--top", min=1, help="How many tensors the summary names, by relative change.")] = 10,
    as_json: JsonOpt = False,
    run_dir: Annotated[list[Path] | None, typer.Option("--run-dir", metavar="DIR", help="Blocks (and chain) of a CID or run id: once for both, twice for A's, then B's.")] = None,
    store: Annotated[list[Path] | None, typer.Option("--store", metavar="DIR", help="Blockstore of a CID or run id: once for both, twice for A's, then B's.")] = None,
    ipfs_api: Annotated[list[str] | None, typer.Option("--ipfs-api", metavar="ADDR", help="IPFS daemon of a CID or run id: once for both, twice for A's, then B's.")] = None,
    stack: StackOpt = None,
    rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
    trust_endpoints: TrustOpt = False,
) -> None:
    """What changed from A to B, of one run or of two: a summary first (the parameters'
    relative change ||B - A|| / ||A||, per stage, and the --top tensors that changed most),
    then every tensor's change (L2 of B - A, relative to A, max abs) and the metric deltas.
    A run named by its directory or stack job is read from its own blocks."""
    from lineage.audit.diff import diff_checkpoints

    sides = [_diff_side(text, i, run_dir or [], store or [], ipfs_api or [], stack,
                        dict(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, trust=trust_endpoints))
             for i, text in enumerate((run_a, run_b))]
    (ref_a, cid_a, blocks_a), (ref_b, cid_b, blocks_b) = sides
    result = diff_checkpoints(blocks_a, cid_a, cid_b, store_b=blocks_b)
    if as_json:
        doc = result.as_json(top)
        doc["from"] = {"a": ref_a.text, "b": ref_b.text}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    _print_diff(result, ref_a, ref_b, top)


def _diff_side(text: str, i: int, run_dirs: list[Path], stores: list[Path], apis: list[str],
               stack: Path | None, chain: dict[str, Any]) -> tuple[RunRef, str, Any]:
    """Side `i` (0: A, 1: B) of `dlx lineage diff`: what it names, its checkpoint, its blocks."""
    def pick(values: list[Any], option: str) -> Any:
        if len(values) > 2:
            raise AuditError(f"{option} given {len(values)} times: once for both checkpoints, or twice (A's, B's)")
        return values[min(i, len(values) - 1)] if values else None

    ref = need_run(name_run(text, stack=stack), "dlx lineage diff")
    where = {"run_dir": pick(run_dirs, "--run-dir"), "store": pick(stores, "--store"),
             "ipfs_api": pick(apis, "--ipfs-api")}
    if ref.run_dir is not None:
        where = {}  # a run directory or stack job brings its own blocks
    cid, blocks, _ = run_checkpoint(ref, stack=stack, **chain, **where)
    return ref, cid, blocks


def _print_diff(result: Any, ref_a: RunRef, ref_b: RunRef, top: int) -> None:
    """`dlx lineage diff`'s text: the two checkpoints, the summary, then the tables."""
    from rich.markup import escape
    from rich.table import Table

    from workers.cli.console import console as make_console

    def named(ref: RunRef) -> str:
        return "" if ref.cid is not None else f"  (head of {ref.text})"

    console = make_console()
    console.print(escape(f"A  step {result.step_a}  {result.a}{named(ref_a)}\n"
                         f"B  step {result.step_b}  {result.b}{named(ref_b)}\n{result.relation}"))
    console.print(f"parameters: ||B - A|| = {result.total_l2:.6g}, relative {_rel(result.total_rel)}")
    for st in result.stages():
        console.print(f"  stage {st.stage}: relative {_rel(st.rel)}  (||B - A|| {st.l2:.4g}, ||A|| {st.norm_a:.4g})")
    changed = result.top(top)
    console.print(f"top {len(changed)} tensors by relative change:")
    for t in changed:
        console.print(escape(f"  {_rel(t.rel):>9}  stage {t.stage}  {t.name}  ({'x'.join(map(str, t.shape))})"))
    table = Table(title="every tensor (B - A)")
    for col in ("stage", "tensor", "shape", "||B-A||", "relative", "max |B-A|"):
        table.add_column(col, justify="right" if col not in ("tensor", "shape") else "left",
                         overflow="fold", no_wrap=col != "tensor")
    for t in result.tensors:
        rel = "new" if t.status == "added" else f"{t.rel:.3e}"
        table.add_row(str(t.stage), t.name + ("" if t.status in ("changed", "same") else f" ({t.status})"),
                      "x".join(map(str, t.shape)), f"{t.l2:.4e}", rel, f"{t.max_abs:.4e}")
    console.print(table)
    metrics = Table(title="metrics")
    for col in ("metric", "A", "B", "B - A"):
        metrics.add_column(col, justify="left" if col == "metric" else "right")
    for m in result.metrics:
        metrics.add_row(m.name, _num(m.a), _num(m.b), _num(m.delta, signed=True))
    console.print(metrics)


def _rel(value: float) -> str:
    return "new" if value == float("inf") else f"{value:.3e}"


@user_errors
def challenge(
    run: Annotated[int, typer.Argument(min=1, help="The run id.")],
    step: Annotated[int, typer.Argument(min=1, help="The challenged outer step.")],
    node: Annotated[str, typer.Option("--node", help="The node whose slot(s) at STEP to replay.")],
    tolerance: ToleranceOpt = None,
    bond: Annotated[str | None, typer.Option("--bond", help="The bond, e.g. 1eth (default: the run's minimum stake).")] = None,
    as_json: JsonOpt = False,
    rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
    run_dir: RunDirOpt = None, stack: StackOpt = None, store: StoreOpt = None, ipfs_api: ApiOpt = None,
) -> None:
    """Replay a node's work at STEP; if the replay contradicts its claim, store the
    evidence and open an on-chain challenge (the node key, staked, posts the bond)."""
    from lineage.audit.replay import judging_notes
    from lineage.store.cid import DAG_CBOR, cid_from_digest

    who = address(node, "--node")
    wei = parse_amount(bond) if bond else None
    challenger = load_key("node")
    ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, run_dir=run_dir, stack=stack)
    blocks = endpoint_blocks(ep, store, ipfs_api)
    with ep.connect(writable=True) as lg:
        record = step_record(lg, run, step)
        replicas = sorted({r for r, _ in slots_of(record, who)})
        _err(f"replaying replica(s) {', '.join(map(str, replicas))} of run {run} step {step} ...")
        replays = replay_slots(blocks, cid_from_digest(record.checkpoint, DAG_CBOR), replicas, tolerance)
        for note in judging_notes(replays, tolerance):
            _err(note)
        done = open_replay_challenge(lg, blocks, challenger, Accused(run, step, who), replays, tolerance, wei)
    if as_json:
        sys.stdout.write(json.dumps(done, indent=2) + "\n")
        return
    _out(f"challenge {done['challenge']} opened against {who}: run {run} step {step} slot "
         f"({done['replica']}, {done['stage']}), replay differs (relative L2 {done['rel_l2']:.3g})")
    if done.get("judging"):
        _out(f"judged    {done['judging']}: {done['failure']}" if done.get("failure") else f"judged    {done['judging']}")
    _out(f"evidence  {done['evidence']}")
    _out(f"bond      {fmt_wei(int(done['bond_wei']))} from {done['challenger']}")
    _out(f"tx        {done['tx']}")


@user_errors
def challenge_aggregate(
    step: Annotated[int, typer.Argument(min=1, help="The challenged outer step.")],
    stage: Annotated[int, typer.Option("--stage", min=0, help="The stage whose co-signed shard is disputed.")],
    run_dir: Annotated[Path, typer.Option("--run-dir", metavar="DIR", help="The run: its run.json, chain and blocks.")],
    bond: Annotated[str | None, typer.Option("--bond", help="The bond, e.g. 1eth (default: the run's minimum stake).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Recompute STEP's outer step (verify's aggregate level); if stage STAGE's committed
    shard, which every replica co-signed, is not it, open an aggregate challenge: all the
    co-signers answer, and an upheld verdict slashes every one (the node key, staked,
    posts the bond)."""
    from lineage.chain.runrecord import RunRecord
    from lineage.store.cid import digest_of

    wei = parse_amount(bond) if bond else None
    challenger = load_key("node")
    run_id = RunRecord.load(run_dir).run_id
    failure = aggregate_failure(run_dir, step, stage)  # before the chain is opened for writing
    ep = Endpoint.resolve(run_dir=run_dir)
    blocks = endpoint_blocks(ep, None, None)
    with ep.connect(writable=True) as lg:
        record = step_record(lg, run_id, step)
        stages = lg.run_created(run_id).stages
        if stage >= stages:
            raise AuditError(f"run {run_id} has {stages} stage(s): no stage {stage}")
        evidence = store_aggregate_evidence(blocks, lg, run_id, record, stage, failure)
        if wei is None:
            wei = max(lg.run_params(run_id).min_stake or 0, 1)
        challenge_id, tx = lg.open_aggregate_challenge(challenger, run_id=run_id, step=step, stage=stage,
                                                       bond=wei, evidence=digest_of(evidence))
        co_signers = lg.co_signers_of(challenge_id)
    done = {"challenge": challenge_id, "run": run_id, "step": step, "stage": stage, "co_signers": co_signers,
            "failure": failure, "evidence": str(evidence), "bond_wei": str(wei),
            "challenger": challenger.address, "tx": tx}
    if as_json:
        sys.stdout.write(json.dumps(done, indent=2) + "\n")
        return
    _out(f"challenge {challenge_id} opened against the co-signers of run {run_id} step {step} stage {stage}: "
         f"{', '.join(co_signers)}")
    _out(f"evidence  {evidence} ({failure})")
    _out(f"bond      {fmt_wei(wei)} from {challenger.address}")
    _out(f"tx        {tx}")


arbiter_app = typer.Typer(name="arbiter", no_args_is_help=True,
                          help="An arbiter's commands: sign a verdict on a challenge, submit a quorum.")


@arbiter_app.command("vote")
@user_errors
def vote(
    challenge_id: Annotated[int, typer.Argument(min=1, help="The challenge id.")],
    upheld: UpholdOpt = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write the verdict (JSON) to this file instead of printing the signature.")] = None,
    replay: Annotated[bool, typer.Option("--replay", help="Replay the challenged slot first; refuse a verdict it contradicts.")] = False,
    recompute: Annotated[bool, typer.Option("--recompute", help="An aggregate challenge: recompute the outer step from --run-dir first; refuse a verdict it contradicts.")] = False,
    tolerance: ToleranceOpt = None,
    rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
    run_dir: RunDirOpt = None, stack: StackOpt = None, store: StoreOpt = None, ipfs_api: ApiOpt = None,
) -> None:
    """Sign `Verdict(challengeId, upheld)` with the arbiter key (DLX_ARBITER_KEY, else the
    node key); prints the signature for `dlx arbiter resolve`."""
    from lineage.chain.attest import sign_verdict

    verdict = _verdict(upheld)
    key = load_key("arbiter")
    ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, run_dir=run_dir, stack=stack)
    if recompute:  # verify's own chain and store, before this command holds the run's chain
        with ep.connect() as lg:
            c = lg.challenge(challenge_id)
        if not c.aggregate:
            raise AuditError(f"challenge {challenge_id} disputes a slot's replay: check it with --replay")
        _err(check_vote_by_recompute(run_dir, ep.rpc, c, verdict))
    with ep.connect() as lg:
        c = lg.challenge(challenge_id)
        if c.resolved:
            raise AuditError(f"challenge {challenge_id} is already resolved")
        arbiters, _ = lg.arbiters_of(c.run_id)
        if key.address not in arbiters:
            raise AuditError(f"{key.address} is not an arbiter of run {c.run_id}")
        _err(f"challenge {challenge_id}: run {c.run_id} step {c.step} slot ({c.replica}, {c.stage}), "
             f"node {c.node}, challenger {c.challenger}, bond {fmt_wei(c.bond)}")
        if replay and c.aggregate:
            raise AuditError(f"challenge {challenge_id} disputes stage {c.stage}'s co-signed shard (co-signers "
                             f"{', '.join(lg.co_signers_of(challenge_id))}), not a slot's replay: recompute it "
                             "with `dlx verify` (its aggregate level)")
        if replay:
            _err(check_vote_by_replay(lg, endpoint_blocks(ep, store, ipfs_api), c, verdict, tolerance))
        sig = sign_verdict(lg.chain.chain_id, lg.ledger.address, challenge_id, verdict, key.key)
        doc = {"challenge": challenge_id, "upheld": verdict, "arbiter": key.address,
               "signature": "0x" + sig.hex(), "chainId": lg.chain.chain_id, "ledger": lg.ledger.address}
    if out is None:
        _out(doc["signature"])
        return
    out.write_text(json.dumps(doc, indent=2) + "\n")
    _err(f"{'uphold' if verdict else 'dismiss'} verdict by {key.address} written to {out}")


@arbiter_app.command("resolve")
@user_errors
@with_endpoint
def resolve(
    challenge_id: Annotated[int, typer.Argument(min=1, help="The challenge id.")],
    signatures: Annotated[list[str], typer.Argument(help="Arbiters' verdict signatures (0x-hex) or files from `vote --out`.")],
    upheld: UpholdOpt = None,
    as_json: JsonOpt = False,
    *, ep: Endpoint,
) -> None:
    """Submit a quorum of verdict signatures (sorted by signer, as the ledger requires);
    prints the slash, the rejected steps and the new head."""
    verdict = _verdict(upheld)
    sender = load_key("arbiter")
    with ep.connect(writable=True) as lg:
        c = lg.challenge(challenge_id)
        if c.resolved:
            raise AuditError(f"challenge {challenge_id} is already resolved")
        arbiters, quorum = lg.arbiters_of(c.run_id)
        signed: dict[str, bytes] = {}
        for i, text in enumerate(signatures, start=1):
            sig = _read_signature(text, challenge_id, verdict, lg)
            signer = lg.verdict_signer(challenge_id, verdict, sig)
            if signer not in arbiters:
                raise AuditError(f"signature {i} recovers to {signer}, not an arbiter of run {c.run_id} "
                                 f"(was it signed for challenge {challenge_id}, "
                                 f"{'--uphold' if verdict else '--dismiss'}?)")
            if signer in signed:
                raise AuditError(f"signatures from {signer} given twice")
            signed[signer] = sig
        if len(signed) < quorum:
            raise AuditError(f"{len(signed)} arbiter signature(s) given; run {c.run_id} needs a quorum of {quorum}")
        ordered = [signed[a] for a in sorted(signed, key=lambda a: int(a, 16))]
        res = lg.resolve_with(sender, challenge_id=challenge_id, upheld=verdict, signatures=ordered)
    from lineage.store.cid import DAG_CBOR, cid_from_digest

    head = str(cid_from_digest(res.head, DAG_CBOR)) if res.head else None
    if as_json:
        sys.stdout.write(json.dumps({
            "challenge": res.challenge_id, "run": res.run_id, "step": res.step, "node": res.node,
            "upheld": res.upheld, "slashed_wei": str(res.slashed), "reward_wei": str(res.reward),
            "bond_wei": str(res.bond), "bond_to": res.bond_to, "rejected_steps": res.rejected_steps,
            "head_step": res.head_step, "head": head, "tx": res.tx}, indent=2) + "\n")
        return
    if res.upheld:
        _out(f"challenge {challenge_id} upheld: node {res.node} slashed {fmt_wei(res.slashed)} "
             f"({fmt_wei(res.reward)} to the challenger)" if res.slashed else
             f"challenge {challenge_id} upheld: node {res.node} was already slashed for this offence")
        if res.rejected_steps:
            _out(f"rejected  steps {', '.join(map(str, res.rejected_steps))} of run {res.run_id}")
            _out(f"head      step {res.head_step} {head}")
    else:
        _out(f"challenge {challenge_id} dismissed: node {res.node} keeps its stake")
    _out(f"bond      {fmt_wei(res.bond)} credited to {res.bond_to}")
    _out(f"tx        {res.tx}")


@user_errors
@with_endpoint
def expire_challenge(
    challenge_id: Annotated[int, typer.Argument(min=1, help="The challenge id.")],
    as_json: JsonOpt = False,
    *, ep: Endpoint,
) -> None:
    """Dismiss a challenge no arbiter quorum ruled on within the ledger's resolution
    period (the unbonding delay): the bond goes back to the challenger, the node may
    withdraw again, the step may be finalized. Anyone may send it (the node key pays)."""
    sender = load_key("node")
    with ep.connect(writable=True) as lg:
        c = lg.challenge(challenge_id)
        if c.resolved:
            raise AuditError(f"challenge {challenge_id} is already resolved")
        deadline, now = c.opened_at + lg.resolution_period(), chain_time(lg)
        if now <= deadline:
            raise AuditError(f"challenge {challenge_id} awaits its arbiters until {deadline} (chain time now {now})")
        bond, to, tx = lg.expire_challenge(sender, challenge_id)
    if as_json:
        sys.stdout.write(json.dumps({"challenge": challenge_id, "run": c.run_id, "step": c.step,
                                     "node": c.node, "bond_wei": str(bond), "bond_to": to, "tx": tx},
                                    indent=2) + "\n")
        return
    _out(f"challenge {challenge_id} expired without a verdict: node {c.node} keeps its stake, "
         f"run {c.run_id} step {c.step} may be finalized")
    _out(f"bond      {fmt_wei(bond)} credited back to {to}")
    _out(f"tx        {tx}")


@user_errors
def slash_equivocation(
    claim_a: Annotated[Path, typer.Argument(help="A signed claim (JSON).")],
    claim_b: Annotated[Path, typer.Argument(help="The conflicting signed claim (JSON).")],
    rpc: RpcOpt = None, chain_id: ChainIdOpt = None, stack: StackOpt = None,
) -> None:
    """Slash a node that signed two different contributions for one slot of one step, or
    co-signed two different new shards for one stage of one step: the two signed claims
    are the proof (checked here first, then by the ledger)."""
    from lineage.chain.attest import SignedClaim

    a, b = SignedClaim.load(claim_a), SignedClaim.load(claim_b)
    node, result = check_equivocation(a, b)
    if chain_id is not None and chain_id != a.domain.chain_id:
        raise AuditError(f"wrong chain id: the claims are signed for chain {a.domain.chain_id}, not {chain_id}")
    reporter = load_key("reporter")
    ep = Endpoint.resolve(rpc=rpc, chain_id=a.domain.chain_id, ledger=a.domain.verifying_contract, stack=stack)
    ep.registry = None  # the ledger's own registry, whatever a stack names
    c = a.claim
    with ep.connect(writable=True) as lg:
        amount, tx = report_equivocation(lg, reporter, a, b, result)
    what = f"stage {c.stage}'s new shard" if result else f"slot ({c.replica}, {c.stage})"
    _out(f"slashed {node}: {fmt_wei(amount)} for equivocating at run {c.run_id} step {c.step} "
         f"{what}; reporter {reporter.address}")
    _out(f"tx      {tx}")


def register(app: typer.Typer) -> None:
    """Add lineage, challenge, arbiter and slash-equivocation to the `dlx` app."""
    app.add_typer(lineage_app, name="lineage")
    app.command("challenge")(challenge)
    app.command("challenge-aggregate")(challenge_aggregate)
    app.add_typer(arbiter_app, name="arbiter")
    app.command("expire-challenge")(expire_challenge)
    app.command("slash-equivocation")(slash_equivocation)


def _run_dir_of(text: str, stack: Path | None) -> Path:
    """The run directory RUN `text` names (`dlx lineage compare` reads the runs' metrics)."""
    ref = need_run(name_run(text, stack=stack), "dlx lineage compare")
    if ref.run_dir is None:
        raise AuditError(f"dlx lineage compare reads two run directories (their metrics.jsonl): {text} is a "
                         f"{'checkpoint CID' if ref.cid is not None else 'run id'}; give a run directory or a stack job")
    return ref.run_dir


def write_report(path: Path, page: str) -> None:
    """Write an HTML page whole or not at all (a temporary file beside it, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(page)
    tmp.replace(path)


def compare_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per outer step of either lineage (rejected steps left out): eval loss, train loss
    and bytes sent of A and B (None where a run has no such step)."""
    def by_step(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
        return {s["step"]: s["metrics"] for s in doc["steps"] if s.get("status") != "rejected"}

    ma, mb = by_step(a), by_step(b)
    return [{"step": t, **{f"{key}_{side}": m.get(t, {}).get(key) for key in ("eval_loss", "train_loss", "bytes_sent")
                           for side, m in (("a", ma), ("b", mb))}}
            for t in sorted(ma.keys() | mb.keys())]


def _num(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):+d}" if signed else str(int(value))
    return f"{value:+.6g}" if signed else f"{value:.6g}"
