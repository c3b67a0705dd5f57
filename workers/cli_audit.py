"""`dlx` commands for auditors and arbiters: lineage, diff, challenges, verdicts, slashing.

    dlx lineage RUN|CID [--json|--html FILE]      # a run's commits, or one checkpoint's ancestors
    dlx lineage --run-dir runs/tiny-...           # the run a `dlx train` left in a directory
    dlx lineage diff CID_A CID_B [--json]         # per-tensor change norms, metric deltas
    dlx lineage compare RUN_A RUN_B [--json|--html FILE]  # two run directories side by side
    dlx challenge RUN STEP --node ADDR            # replay the node's work; challenge a mismatch
    dlx arbiter vote ID --uphold|--dismiss [--replay] [--out FILE]   # sign a verdict
    dlx arbiter resolve ID --uphold|--dismiss SIG_OR_FILE...         # submit a quorum
    dlx expire-challenge ID                       # no verdict within the period: bond back, step free
    dlx slash-equivocation A.json B.json          # two signed claims of one slot: slash at once

The chain is found as for `dlx node` (workers/cli_node.py); blocks come from `--store DIR`,
`--ipfs-api ADDR`, the run directory or stack given, or $DLX_STORE / $DLX_IPFS_API. Keys come
from the environment only: the challenger's is the node key (DLX_NODE_KEY or DLX_KEYSTORE; it
must be staked), an arbiter's DLX_ARBITER_KEY (or DLX_ARBITER_KEYSTORE), a reporter's
DLX_REPORTER_KEY; each falls back to the node key.

Challenge evidence is content-addressed: the replayed contribution as a UnixFS file and a
DAG-CBOR node `{version, kind, run, step, node, replica, stage, checkpoint, claimed,
replayed, rel_l2, tolerance, chainId, ledger}` (CIDs as links) whose digest goes on chain,
so an arbiter can fetch both contributions and replay the same round.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from trainer.errors import DlxError

from .cli_node import (
    ChainIdOpt,
    Endpoint,
    JsonOpt,
    LedgerOpt,
    RegistryOpt,
    RpcOpt,
    RunDirOpt,
    StackOpt,
    address,
    chain_time,
    fmt_wei,
    load_key,
    parse_amount,
)

EVIDENCE_VERSION = 1
StoreOpt = Annotated[Path | None, typer.Option("--store", help="Blockstore directory (default: the run's or stack's, $DLX_STORE).")]
ApiOpt = Annotated[str | None, typer.Option("--ipfs-api", help="Read blocks from an IPFS daemon's RPC API (default $DLX_IPFS_API).")]
UpholdOpt = Annotated[bool | None, typer.Option("--uphold/--dismiss", help="The verdict: uphold the challenge (slash) or dismiss it.", show_default=False)]
ToleranceOpt = Annotated[float, typer.Option("--tolerance", min=0.0, help="Relative L2 difference a replay may show and still match (0: bit for bit).")]


class AuditError(DlxError, ValueError):
    """An audit command was asked for something the chain or the store contradicts."""


def open_blocks(store: Path | None, ipfs_api: str | None, *, run_dir: Path | None = None,
                record: Any = None, stack: Path | Any = None) -> Any:
    """The block store: --ipfs-api, --store, the run's (`record` is its loaded run.json) or
    the stack's (a directory or a loaded Stack), else $DLX_IPFS_API or $DLX_STORE."""
    from lineage.store.ipfs import open_store

    if ipfs_api or store:
        return open_store(store, ipfs_api)
    if run_dir is not None:
        from lineage.chain.runrecord import RunRecord

        return (record or RunRecord.load(run_dir)).open_store(run_dir)
    if stack is not None:
        from workers.stack import Stack

        return open_store((Stack.load(stack) if isinstance(stack, Path) else stack).blocks)
    if os.environ.get("DLX_IPFS_API") or os.environ.get("DLX_STORE"):
        return open_store(os.environ.get("DLX_STORE"), os.environ.get("DLX_IPFS_API"))
    raise AuditError("no blockstore: pass --store DIR, --ipfs-api ADDR, --run-dir or --stack")


def endpoint_blocks(ep: Endpoint, store: Path | None, ipfs_api: str | None) -> Any:
    """`open_blocks` with the run directory or stack the endpoint came from."""
    return open_blocks(store, ipfs_api, run_dir=ep.run_dir, record=ep.record, stack=ep.stack)


def _verdict(upheld: bool | None) -> bool:
    if upheld is None:
        raise AuditError("say --uphold or --dismiss")
    return upheld


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")


def _err(line: str) -> None:
    sys.stderr.write(line + "\n")


# -- replay and evidence -------------------------------------------------------------------

def replay_slots(store: Any, checkpoint: Any, replicas: list[int], tolerance: float) -> list[Any]:
    """`lineage.audit.replay.replay_checkpoint` for `replicas` of `checkpoint`."""
    try:
        from lineage.audit.replay import replay_checkpoint
    except ImportError:
        raise AuditError("replay is not available in this installation (lineage/replay.py)") from None
    return list(replay_checkpoint(store, checkpoint, replicas=replicas, tolerance=tolerance))


def differs(stage_replay: Any, tolerance: float) -> bool:
    """Whether a replayed stage contradicts its claim: a failed state check (its start
    weights are no committed checkpoint's, say), any byte at tolerance 0, otherwise a
    relative L2 difference above the tolerance."""
    if getattr(stage_replay, "reason", ""):
        return True
    if stage_replay.exact:
        return False
    return tolerance == 0 or not stage_replay.rel_l2 <= tolerance  # NaN differs


def _replayed(replays: list[Any]) -> list[Any]:
    """`replays`, refusing any round that could not be replayed at all (nothing to judge)."""
    for rr in replays:
        if getattr(rr, "error", ""):
            raise AuditError(f"cannot replay step {rr.step} replica {rr.replica}: {rr.error}")
    return replays


def store_evidence(store: Any, *, run_id: int, step: int, node: str, replica: int, stage: int,
                   checkpoint: Any, claimed: Any, stage_replay: Any, tolerance: float,
                   chain_id: int, ledger: str) -> Any:
    """Store the replayed contribution and the evidence node; returns the evidence CID."""
    import dag_cbor

    from lineage.store.cid import DAG_CBOR, parse_cid
    from lineage.store.unixfs import import_bytes

    replayed = import_bytes(stage_replay.replayed_bytes, store.put).cid
    if stage_replay.replayed and parse_cid(stage_replay.replayed) != replayed:
        raise AuditError(f"the replay reports contribution {stage_replay.replayed} but its bytes hash to {replayed}")
    rel = float(stage_replay.rel_l2)
    node_doc = {
        "version": EVIDENCE_VERSION, "kind": "replay-mismatch", "run": run_id, "step": step,
        "node": node, "replica": replica, "stage": stage, "checkpoint": checkpoint,
        "claimed": claimed, "replayed": replayed, "rel_l2": rel if math.isfinite(rel) else None,
        "tolerance": float(tolerance), "chainId": chain_id, "ledger": ledger,
    }
    if getattr(stage_replay, "reason", ""):
        node_doc["reason"] = stage_replay.reason
    return store.put(dag_cbor.encode(node_doc), DAG_CBOR)


def load_evidence(store: Any, digest: bytes) -> dict[str, Any]:
    """The evidence node whose digest a challenge carries (re-hashed on read)."""
    import dag_cbor

    from lineage.store.cid import DAG_CBOR, cid_from_digest

    if digest == bytes(32):
        raise AuditError("the challenge carries no evidence")
    cid = cid_from_digest(digest, DAG_CBOR)
    doc = dag_cbor.decode(store.get(cid))
    if not isinstance(doc, dict) or doc.get("kind") != "replay-mismatch":
        raise AuditError(f"evidence {cid} is not a replay-mismatch record")
    return doc


def open_replay_challenge(lg: Any, store: Any, challenger: Any, *, run_id: int, step: int, node: str,
                          replays: list[Any], tolerance: float, bond: int | None) -> dict[str, Any]:
    """Turn `replays` of `node`'s slots at `step` into an on-chain challenge against the
    first slot whose replay contradicts the claim; returns what was done."""
    from lineage.store.cid import DAG_CBOR, cid_from_digest, digest_of
    from lineage.store.manifest import get_manifest

    record = _step_record(lg, run_id, step)
    slots = _slots_of(record, node)
    checkpoint = cid_from_digest(record.checkpoint, DAG_CBOR)
    manifest = get_manifest(store, checkpoint)
    bad = [(rr.replica, st) for rr in _replayed(replays) for st in rr.stages
           if (rr.replica, st.stage) in slots and differs(st, tolerance)]
    if not bad:
        raise AuditError("replay matches the claim; nothing to challenge")
    replica, st = bad[0]
    if bond is None:
        bond = max(int(lg.run_params(run_id).get("minStake") or 0), 1)
    evidence = store_evidence(
        store, run_id=run_id, step=step, node=node, replica=replica, stage=st.stage, checkpoint=checkpoint,
        claimed=manifest.contributions[replica][st.stage], stage_replay=st, tolerance=tolerance,
        chain_id=lg.chain.chain_id, ledger=lg.ledger.address)
    challenge_id, tx = lg.open_challenge_tx(challenger, run_id=run_id, step=step, replica=replica,
                                            stage=st.stage, bond=bond, evidence=digest_of(evidence))
    return {"challenge": challenge_id, "run": run_id, "step": step, "node": node, "replica": replica,
            "stage": st.stage, "rel_l2": st.rel_l2, "evidence": str(evidence), "bond_wei": str(bond),
            "challenger": challenger.address, "tx": tx,
            "mismatched_slots": [[r, s.stage] for r, s in bad]}


def _step_record(lg: Any, run_id: int, step: int) -> Any:
    for rec in lg.steps(run_id):
        if rec.step == step:
            return rec
    raise AuditError(f"run {run_id} has no step {step} on its current chain")


def aggregate_failure(run_dir: Path, step: int, stage: int, rpc: str | None = None) -> str:
    """Recompute the outer steps of the run in `run_dir` from the parent shards and the
    published contributions (`dlx verify`'s aggregate level) and return step `step`'s
    failure if it shows that stage `stage`'s committed shard, the one its replicas co-signed,
    is not the aggregate; else an AuditError saying why there is nothing to challenge."""
    from lineage.audit.verify import verify_run

    for sr in verify_run(run_dir, rpc, levels=("aggregate",)).steps:
        if sr.step != step:
            continue
        failure = sr.failures.get("aggregate")
        if failure is None:
            raise AuditError(f"step {step}: the recomputed outer step gives every committed shard; nothing to challenge")
        if not failure.startswith(f"stage {stage}: recomputed shard differs"):
            raise AuditError(f"step {step}: {failure} (it does not show stage {stage}'s shard wrong)")
        return failure
    raise AuditError(f"the run in {run_dir} has no step {step} on its current chain")


def store_aggregate_evidence(store: Any, *, run_id: int, step: int, stage: int, checkpoint: Any, cosigned: bytes,
                             failure: str, chain_id: int, ledger: str) -> Any:
    """Store the evidence node of an aggregate challenge; returns its CID."""
    import dag_cbor

    from lineage.store.cid import DAG_CBOR

    node_doc = {"version": EVIDENCE_VERSION, "kind": "aggregate-mismatch", "run": run_id, "step": step,
                "stage": stage, "checkpoint": checkpoint, "cosigned": cosigned, "failure": failure,
                "chainId": chain_id, "ledger": ledger}
    return store.put(dag_cbor.encode(node_doc), DAG_CBOR)


def check_vote_by_recompute(run_dir: Path | None, rpc: str | None, challenge: dict[str, Any], upheld: bool) -> str:
    """For an aggregate challenge: recompute the challenged step's outer step from the run
    in `run_dir`; refuse a verdict the result contradicts. Returns a one-line account."""
    if run_dir is None:
        raise AuditError("--recompute needs --run-dir: the run whose outer step is recomputed")
    try:
        failure = aggregate_failure(run_dir, int(challenge["step"]), int(challenge["stage"]), rpc)
    except AuditError as exc:
        if upheld:
            raise AuditError(f"the recomputed outer step contradicts upholding: {exc}") from None
        return f"recomputed: {exc}"
    if not upheld:
        raise AuditError(f"the recomputed outer step contradicts dismissing: {failure}")
    return f"recomputed: {failure}"


def _slots_of(record: Any, node: str) -> set[tuple[int, int]]:
    slots = {(int(a["replica"]), int(a["stage"])) for a in record.attestations if a["node"].lower() == node.lower()}
    if not slots:
        raise AuditError(f"node {node} attested no slot of step {record.step}")
    return slots


def check_vote_by_replay(lg: Any, store: Any, challenge: dict[str, Any], upheld: bool, tolerance: float) -> str:
    """Replay the challenged slot from the evidence's checkpoint; refuse a verdict the
    replay contradicts. Returns a one-line account of the replay."""
    from lineage.store.cid import digest_of, parse_cid

    ev = load_evidence(store, challenge["evidence"])
    for key, want in (("run", challenge["runId"]), ("step", challenge["step"]), ("replica", challenge["replica"]),
                      ("stage", challenge["stage"])):
        if ev.get(key) != want:
            raise AuditError(f"the evidence's {key} is {ev.get(key)}, the challenge's {want}")
    checkpoint = parse_cid(ev["checkpoint"])
    commits = {(c.record.step, c.record.checkpoint) for c in lg.commits(challenge["runId"])}
    if (challenge["step"], digest_of(checkpoint)) not in commits:
        raise AuditError(f"the evidence's checkpoint {checkpoint} is no commit of run {challenge['runId']} "
                         f"step {challenge['step']}")
    (rr,) = _replayed(replay_slots(store, checkpoint, [challenge["replica"]], tolerance))
    (st,) = [s for s in rr.stages if s.stage == challenge["stage"]]
    bad = differs(st, tolerance)
    account = (f"replay of replica {rr.replica} stage {st.stage}: "
               f"{'differs from' if bad else 'matches'} the claim (relative L2 {st.rel_l2:.3g}"
               + (f"; {st.reason}" if getattr(st, "reason", "") else "") + ")")
    if upheld and not bad:
        raise AuditError(f"{account}: refusing to sign an uphold")
    if not upheld and bad:
        raise AuditError(f"{account}: refusing to sign a dismissal")
    return account


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


def register(app: typer.Typer, user_errors: Any) -> None:
    """Add lineage, challenge, arbiter and slash-equivocation to the `dlx` app."""
    lineage_app = typer.Typer(
        name="lineage", cls=_LineageGroup,
        help="A run's checkpoint chain as recorded on the ledger, checked against the blockstore: "
             "`dlx lineage RUN|CID` or `--run-dir DIR` (the `show` command), `dlx lineage diff A B` and "
             "`dlx lineage compare RUN_A RUN_B`.")
    app.add_typer(lineage_app, name="lineage")

    @lineage_app.command("show")
    @user_errors
    def show(
        target: Annotated[str | None, typer.Argument(help="A run id, or a checkpoint CID (its ancestors).", show_default=False)] = None,
        run_dir: RunDirOpt = None,
        as_json: JsonOpt = False,
        html: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report to this file.")] = None,
        rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
        stack: StackOpt = None, store: StoreOpt = None, ipfs_api: ApiOpt = None,
    ) -> None:
        """The commits of a run (status pending/finalized/rejected, signers, contributions,
        metrics, transaction) or the ancestors of one checkpoint, with the run's configuration."""
        from lineage.audit import query

        if target is None and run_dir is None:
            raise AuditError("give a run id, a checkpoint CID, or --run-dir DIR")
        if target is None and (chain_id, registry, ledger, store, ipfs_api) == (None,) * 5:
            result = query.run_lineage(run_dir, rpc)  # type: ignore[arg-type]
        else:  # flags win over run.json (README): read through the endpoint they name
            cid = None
            if target is not None and not target.isdigit():
                from lineage.store.cid import parse_cid

                try:
                    cid = parse_cid(target)
                except ValueError:
                    raise AuditError(f"{target!r} is neither a run id nor a CID") from None
            ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger,
                                  run_dir=run_dir, stack=stack)
            if target is None:  # the run in --run-dir
                target = str(ep.record.run_id)  # type: ignore[union-attr]
            blocks = endpoint_blocks(ep, store, ipfs_api)
            with ep.connect() as lg:
                if cid is None:
                    name = ep.record.name if ep.record and ep.record.run_id == int(target) else None
                    result = query.ledger_lineage(lg, blocks, int(target), name=name)
                else:
                    result = query.checkpoint_lineage(lg, blocks, cid)
        doc = result.as_json()
        if html is not None:
            from lineage.audit.report import render_html
            from workers.tracking import read_metrics

            write_report(html, render_html(doc, read_metrics(run_dir) if run_dir is not None else None))
        if as_json:
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            return
        from rich.table import Table

        from workers.console import cid_column, console

        what = f"checkpoint {result.target} of run" if result.target else "run"
        table = Table(title=f"{what} {result.run_id} ({result.name}) on chain {result.chain_id}, ledger {result.ledger}")
        for col in ("step", "status", "checkpoint", "parent", "eval loss", "nodes", "tx"):
            if col in ("checkpoint", "parent", "nodes", "tx"):
                cid_column(table, col)
            else:
                table.add_column(col, overflow="fold")
        colors = {"finalized": "green", "rejected": "red", "uncommitted": "yellow"}
        for s in result.steps:
            status = s.status + (f" (challenge {s.rejected_by})" if s.rejected_by is not None else "")
            if s.status in colors:
                status = f"[{colors[s.status]}]{status}[/]"
            table.add_row(str(s.step), status, s.checkpoint, s.parent, "-" if s.loss is None else f"{s.loss:.4f}",
                          "\n".join(s.nodes), s.tx)
        out = console()
        out.print(table)
        if html is not None:
            out.print(f"report written to {html}")

    @lineage_app.command("compare")
    @user_errors
    def compare(
        run_a: Annotated[Path, typer.Argument(help="Run directory A (written by `dlx train`, or a stack's runs/JOB).")],
        run_b: Annotated[Path, typer.Argument(help="Run directory B.")],
        as_json: JsonOpt = False,
        html: Annotated[Path | None, typer.Option("--html", help="Also write the comparison as a self-contained HTML page.")] = None,
    ) -> None:
        """Two runs side by side: the configuration keys that differ, and their eval loss,
        train loss and bytes sent per outer step (with --html also inner loss and
        compression error, plotted on shared axes)."""
        from lineage.audit import query
        from lineage.audit.report import config_differences, render_compare_html
        from workers.tracking import read_metrics

        a, b = (query.run_lineage(d, None).as_json() for d in (run_a, run_b))
        diffs = config_differences(a, b)
        if html is not None:
            write_report(html, render_compare_html(a, b, read_metrics(run_a), read_metrics(run_b)))
        if as_json:
            doc = {"a": {"run_dir": str(run_a), "run": a["run"], "name": a["name"], "head": a["head"]},
                   "b": {"run_dir": str(run_b), "run": b["run"], "name": b["name"], "head": b["head"]},
                   "config": [{"key": k, "a": va, "b": vb} for k, va, vb in diffs],
                   "steps": compare_rows(a, b)}
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
            return
        from rich.table import Table

        from workers.console import cid_column, console

        out = console()
        runs = Table(title="runs")
        for col in ("", "run", "name", "run dir"):
            runs.add_column(col)
        cid_column(runs, "head")
        runs.add_row("A", str(a["run"]), a["name"], str(run_a), a["head"])
        runs.add_row("B", str(b["run"]), b["name"], str(run_b), b["head"])
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
        cid_a: Annotated[str, typer.Argument(help="Checkpoint A (the base).")],
        cid_b: Annotated[str, typer.Argument(help="Checkpoint B, compared as B - A.")],
        as_json: JsonOpt = False,
        run_dir: RunDirOpt = None, stack: StackOpt = None, store: StoreOpt = None, ipfs_api: ApiOpt = None,
    ) -> None:
        """Per-tensor change norms (L2 of B - A, relative to A, max abs) and metric deltas."""
        from lineage.audit.diff import diff_checkpoints
        from lineage.store.cid import parse_cid

        for text in (cid_a, cid_b):
            try:
                parse_cid(text)
            except ValueError as exc:
                raise AuditError(str(exc)) from None
        result = diff_checkpoints(open_blocks(store, ipfs_api, run_dir=run_dir, stack=stack), cid_a, cid_b)
        if as_json:
            sys.stdout.write(json.dumps(result.as_json(), indent=2) + "\n")
            return
        from rich.table import Table

        from workers.console import console as make_console

        console = make_console()
        console.print(f"A  step {result.step_a}  {result.a}\nB  step {result.step_b}  {result.b}\n{result.relation}; "
                      f"parameters ||B - A|| = {result.total_l2:.6g}")
        table = Table(title="tensors (B - A)")
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

    @app.command("challenge")
    @user_errors
    def challenge(
        run: Annotated[int, typer.Argument(min=1, help="The run id.")],
        step: Annotated[int, typer.Argument(min=1, help="The challenged outer step.")],
        node: Annotated[str, typer.Option("--node", help="The node whose slot(s) at STEP to replay.")],
        tolerance: ToleranceOpt = 0.0,
        bond: Annotated[str | None, typer.Option("--bond", help="The bond, e.g. 1eth (default: the run's minimum stake).")] = None,
        as_json: JsonOpt = False,
        rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
        run_dir: RunDirOpt = None, stack: StackOpt = None, store: StoreOpt = None, ipfs_api: ApiOpt = None,
    ) -> None:
        """Replay a node's work at STEP; if the replay contradicts its claim, store the
        evidence and open an on-chain challenge (the node key, staked, posts the bond)."""
        from lineage.store.cid import DAG_CBOR, cid_from_digest

        who = address(node, "--node")
        wei = parse_amount(bond) if bond else None
        challenger = load_key("node")
        ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, run_dir=run_dir, stack=stack)
        blocks = endpoint_blocks(ep, store, ipfs_api)
        with ep.connect(writable=True) as lg:
            record = _step_record(lg, run, step)
            replicas = sorted({r for r, _ in _slots_of(record, who)})
            _err(f"replaying replica(s) {', '.join(map(str, replicas))} of run {run} step {step} ...")
            replays = replay_slots(blocks, cid_from_digest(record.checkpoint, DAG_CBOR), replicas, tolerance)
            done = open_replay_challenge(lg, blocks, challenger, run_id=run, step=step, node=who,
                                         replays=replays, tolerance=tolerance, bond=wei)
        if as_json:
            sys.stdout.write(json.dumps(done, indent=2) + "\n")
            return
        _out(f"challenge {done['challenge']} opened against {who}: run {run} step {step} slot "
             f"({done['replica']}, {done['stage']}), replay differs (relative L2 {done['rel_l2']:.3g})")
        _out(f"evidence  {done['evidence']}")
        _out(f"bond      {fmt_wei(int(done['bond_wei']))} from {done['challenger']}")
        _out(f"tx        {done['tx']}")

    @app.command("challenge-aggregate")
    @user_errors
    def challenge_aggregate(
        step: Annotated[int, typer.Argument(min=1, help="The challenged outer step.")],
        stage: Annotated[int, typer.Option("--stage", min=0, help="The stage whose co-signed shard is disputed.")],
        run_dir: Annotated[Path, typer.Option("--run-dir", help="The run: its run.json, chain and blocks.")],
        bond: Annotated[str | None, typer.Option("--bond", help="The bond, e.g. 1eth (default: the run's minimum stake).")] = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Recompute STEP's outer step (verify's aggregate level); if stage STAGE's committed
        shard, which every replica co-signed, is not it, open an aggregate challenge: all the
        co-signers answer, and an upheld verdict slashes every one (the node key, staked,
        posts the bond)."""
        from lineage.chain.runrecord import RunRecord
        from lineage.store.cid import DAG_CBOR, cid_from_digest, digest_of

        wei = parse_amount(bond) if bond else None
        challenger = load_key("node")
        run_id = RunRecord.load(run_dir).run_id
        failure = aggregate_failure(run_dir, step, stage)  # before the chain is opened for writing
        ep = Endpoint.resolve(run_dir=run_dir)
        blocks = endpoint_blocks(ep, None, None)
        with ep.connect(writable=True) as lg:
            record = _step_record(lg, run_id, step)
            stages = int(lg.run_created(run_id)["stages"])
            if stage >= stages:
                raise AuditError(f"run {run_id} has {stages} stage(s): no stage {stage}")
            evidence = store_aggregate_evidence(
                blocks, run_id=run_id, step=step, stage=stage, checkpoint=cid_from_digest(record.checkpoint, DAG_CBOR),
                cosigned=record.shards(stages)[stage], failure=failure, chain_id=lg.chain.chain_id,
                ledger=lg.ledger.address)
            if wei is None:
                wei = max(int(lg.run_params(run_id).get("minStake") or 0), 1)
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
    app.add_typer(arbiter_app, name="arbiter")

    @arbiter_app.command("vote")
    @user_errors
    def vote(
        challenge_id: Annotated[int, typer.Argument(min=1, help="The challenge id.")],
        upheld: UpholdOpt = None,
        out: Annotated[Path | None, typer.Option("--out", help="Write the verdict (JSON) to this file instead of printing the signature.")] = None,
        replay: Annotated[bool, typer.Option("--replay", help="Replay the challenged slot first; refuse a verdict it contradicts.")] = False,
        recompute: Annotated[bool, typer.Option("--recompute", help="An aggregate challenge: recompute the outer step from --run-dir first; refuse a verdict it contradicts.")] = False,
        tolerance: ToleranceOpt = 0.0,
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
            if not c["aggregate"]:
                raise AuditError(f"challenge {challenge_id} disputes a slot's replay: check it with --replay")
            _err(check_vote_by_recompute(run_dir, ep.rpc, c, verdict))
        with ep.connect() as lg:
            c = lg.challenge(challenge_id)
            if c["resolved"]:
                raise AuditError(f"challenge {challenge_id} is already resolved")
            arbiters, _ = lg.arbiters_of(c["runId"])
            if key.address not in arbiters:
                raise AuditError(f"{key.address} is not an arbiter of run {c['runId']}")
            _err(f"challenge {challenge_id}: run {c['runId']} step {c['step']} slot ({c['replica']}, {c['stage']}), "
                 f"node {c['node']}, challenger {c['challenger']}, bond {fmt_wei(int(c['bond']))}")
            if replay and c["aggregate"]:
                raise AuditError(f"challenge {challenge_id} disputes stage {c['stage']}'s co-signed shard (co-signers "
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
    def resolve(
        challenge_id: Annotated[int, typer.Argument(min=1, help="The challenge id.")],
        signatures: Annotated[list[str], typer.Argument(help="Arbiters' verdict signatures (0x-hex) or files from `vote --out`.")],
        upheld: UpholdOpt = None,
        as_json: JsonOpt = False,
        rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
        run_dir: RunDirOpt = None, stack: StackOpt = None,
    ) -> None:
        """Submit a quorum of verdict signatures (sorted by signer, as the ledger requires);
        prints the slash, the rejected steps and the new head."""
        verdict = _verdict(upheld)
        sender = load_key("arbiter")
        ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, run_dir=run_dir, stack=stack)
        with ep.connect(writable=True) as lg:
            c = lg.challenge(challenge_id)
            if c["resolved"]:
                raise AuditError(f"challenge {challenge_id} is already resolved")
            arbiters, quorum = lg.arbiters_of(c["runId"])
            signed: dict[str, bytes] = {}
            for i, text in enumerate(signatures, start=1):
                sig = _read_signature(text, challenge_id, verdict, lg)
                signer = lg.verdict_signer(challenge_id, verdict, sig)
                if signer not in arbiters:
                    raise AuditError(f"signature {i} recovers to {signer}, not an arbiter of run {c['runId']} "
                                     f"(was it signed for challenge {challenge_id}, "
                                     f"{'--uphold' if verdict else '--dismiss'}?)")
                if signer in signed:
                    raise AuditError(f"signatures from {signer} given twice")
                signed[signer] = sig
            if len(signed) < quorum:
                raise AuditError(f"{len(signed)} arbiter signature(s) given; run {c['runId']} needs a quorum of {quorum}")
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

    @app.command("expire-challenge")
    @user_errors
    def expire_challenge(
        challenge_id: Annotated[int, typer.Argument(min=1, help="The challenge id.")],
        as_json: JsonOpt = False,
        rpc: RpcOpt = None, chain_id: ChainIdOpt = None, registry: RegistryOpt = None, ledger: LedgerOpt = None,
        run_dir: RunDirOpt = None, stack: StackOpt = None,
    ) -> None:
        """Dismiss a challenge no arbiter quorum ruled on within the ledger's resolution
        period (the unbonding delay): the bond goes back to the challenger, the node may
        withdraw again, the step may be finalized. Anyone may send it (the node key pays)."""
        sender = load_key("node")
        ep = Endpoint.resolve(rpc=rpc, chain_id=chain_id, registry=registry, ledger=ledger, run_dir=run_dir, stack=stack)
        with ep.connect(writable=True) as lg:
            c = lg.challenge(challenge_id)
            if c["resolved"]:
                raise AuditError(f"challenge {challenge_id} is already resolved")
            deadline, now = int(c["openedAt"]) + lg.resolution_period(), chain_time(lg)
            if now <= deadline:
                raise AuditError(f"challenge {challenge_id} awaits its arbiters until {deadline} (chain time now {now})")
            bond, to, tx = lg.expire_challenge(sender, challenge_id)
        if as_json:
            sys.stdout.write(json.dumps({"challenge": challenge_id, "run": int(c["runId"]), "step": int(c["step"]),
                                         "node": c["node"], "bond_wei": str(bond), "bond_to": to, "tx": tx},
                                        indent=2) + "\n")
            return
        _out(f"challenge {challenge_id} expired without a verdict: node {c['node']} keeps its stake, "
             f"run {c['runId']} step {c['step']} may be finalized")
        _out(f"bond      {fmt_wei(bond)} credited back to {to}")
        _out(f"tx        {tx}")

    @app.command("slash-equivocation")
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
        from lineage.chain.ledger import Attestation

        a, b = SignedClaim.load(claim_a), SignedClaim.load(claim_b)
        node, result = check_equivocation(a, b)
        if chain_id is not None and chain_id != a.domain.chain_id:
            raise AuditError(f"wrong chain id: the claims are signed for chain {a.domain.chain_id}, not {chain_id}")
        reporter = load_key("reporter")
        ep = Endpoint.resolve(rpc=rpc, chain_id=a.domain.chain_id, ledger=a.domain.verifying_contract, stack=stack)
        ep.registry = None  # the ledger's own registry, whatever a stack names
        c = a.claim
        with ep.connect(writable=True) as lg:
            atts = [Attestation(x.claim.replica, x.claim.stage, x.claim.contribution, x.claim.data_shard,
                                x.claim.code_hash, x.claim.loss_micros, x.signature, x.claim.new_shard) for x in (a, b)]
            report = lg.report_result_equivocation if result else lg.report_equivocation_tx
            amount, tx = report(reporter, run_id=c.run_id, step=c.step, parent=c.parent, a=atts[0], b=atts[1])
        what = f"stage {c.stage}'s new shard" if result else f"slot ({c.replica}, {c.stage})"
        _out(f"slashed {node}: {fmt_wei(amount)} for equivocating at run {c.run_id} step {c.step} "
             f"{what}; reporter {reporter.address}")
        _out(f"tx      {tx}")


def check_equivocation(a: Any, b: Any) -> tuple[str, bool]:
    """The node that signed both claims, if they prove an equivocation, and whether it is one
    on the result (two co-signed shards for one stage, any replicas; ledger version 2) rather
    than on a slot's contribution; else a clear error."""
    if a.domain != b.domain:
        raise AuditError(f"the claims are for different ledgers: chain {a.domain.chain_id} "
                         f"{a.domain.verifying_contract} and chain {b.domain.chain_id} {b.domain.verifying_contract}")
    ca, cb = a.claim, b.claim
    cosigned = a.domain.version != "1" and ca.new_shard != cb.new_shard
    for name in ("run_id", "step", "stage") if cosigned else ("run_id", "step", "replica", "stage"):
        if getattr(ca, name) != getattr(cb, name):
            raise AuditError(f"the claims are for different slots: {name} {getattr(ca, name)} and {getattr(cb, name)}")
    if ca.parent != cb.parent:
        raise AuditError("the claims build on different parents: re-attesting after a rollback is no equivocation")
    result = cosigned and (ca.contribution == cb.contribution or ca.replica != cb.replica)
    if ca.contribution == cb.contribution and not result:
        raise AuditError(f"both claims carry contribution 0x{ca.contribution.hex()}: no equivocation")
    signer_a, signer_b = a.recover(), b.recover()
    if signer_a != signer_b:
        raise AuditError(f"the claims are signed by different keys: {signer_a} and {signer_b}")
    return signer_a, result


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
