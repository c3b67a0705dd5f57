"""The evidence behind a challenge or an equivocation report, and the checks an arbiter
runs before signing a verdict.

A replay challenge's evidence is content-addressed: the replayed contribution as a UnixFS
file and a DAG-CBOR node `{version, kind: "replay-mismatch", run, step, node, replica,
stage, checkpoint, claimed, replayed, rel_l2, tolerance, chainId, ledger}` (CIDs as
links; also `judged`, `numerics`, `trainedOn`, `replayedOn`, `flips`, `maxFlip` and
`failure`: how the challenger judged the replay) whose digest goes on chain, so an arbiter
can fetch both contributions and replay the same round.

Challenges and verdicts judge a replay as `dlx verify` does (lineage/audit/replay.py): a
portable run's exactly; a native run's bit for bit where the replaying kernels' fingerprint
is the trainer's, else by the flip-aware comparison within the calibrated tolerance
(`default_tolerance`), unless an explicit tolerance is given (not the CLI's old default 0).
An honest node must never be slashable because the challenger's or an arbiter's CPU differs:
an arbiter never signs an uphold of a native run whose replay, on another kernel set than
the trainer's, the calibrated rule accepts, whatever tolerance it was given.

An aggregate challenge's node is `{version, kind: "aggregate-mismatch",
run, step, stage, checkpoint, cosigned, failure, chainId, ledger}`: the step's outer step
recomputed (`dlx verify`'s aggregate level) shows the co-signed shard wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import DlxError

if TYPE_CHECKING:
    from lineage.chain.ledger import ChallengeRecord

EVIDENCE_VERSION = 1


@dataclass(frozen=True)
class Accused:
    """Whose work a challenge disputes: `node`'s slots of `step` in run `run_id`."""

    run_id: int
    step: int
    node: str


class AuditError(DlxError, ValueError):
    """An audit command was asked for something the chain or the store contradicts."""


def replay_slots(store: Any, checkpoint: Any, replicas: list[int], tolerance: float | None) -> list[Any]:
    """`lineage.audit.replay.replay_checkpoint` for `replicas` of `checkpoint` (`tolerance`
    None: judged by the run's numerics and the fingerprints)."""
    try:
        from .replay import replay_checkpoint
    except ImportError:
        raise AuditError("replay is not available in this installation (lineage/audit/replay.py)") from None
    return list(replay_checkpoint(store, checkpoint, replicas=replicas, tolerance=tolerance))


def differs(stage_replay: Any, tolerance: float | None) -> bool:
    """Whether a replayed stage contradicts its claim: a failed state check (its start
    weights are no committed checkpoint's, say), else what its judging finds
    (`StageReplay.failure_detail`); a stage not judged: any byte at tolerance 0, otherwise
    a relative L2 difference above the tolerance."""
    if getattr(stage_replay, "reason", ""):
        return True
    if stage_replay.exact:
        return False
    if getattr(stage_replay, "judged", ""):
        return bool(stage_replay.failure_detail(tolerance or 0.0))
    return not tolerance or not stage_replay.rel_l2 <= tolerance  # NaN differs


def judging_line(rr: Any, st: Any) -> str:
    """How a replayed stage was judged, for a challenger or an arbiter to read."""
    judged = getattr(st, "judged", "")
    if not judged:
        return ""
    rule = "bit for bit" if judged == "exact" else f"flip-aware within {st.tolerance:g}"
    flips = f", {st.flips} code(s) flipped (max {st.max_flip} level)" if getattr(st, "compare", None) else ""
    return (f"{rr.numerics or 'native'} run judged {rule}{flips}; trained on {st.trained_on or 'unrecorded'}, "
            f"replayed on {rr.replayed_on}")


def _replayed(replays: list[Any]) -> list[Any]:
    """`replays`, refusing any round that could not be replayed at all (nothing to judge)."""
    for rr in replays:
        if getattr(rr, "error", ""):
            raise AuditError(f"cannot replay step {rr.step} replica {rr.replica}: {rr.error}")
    return replays


def store_evidence(store: Any, lg: Any, accused: Accused, replay: Any, stage_replay: Any, checkpoint: Any,
                   claimed: Any, tolerance: float | None) -> Any:
    """Store the replayed contribution of slot (`replay.replica`, `stage_replay.stage`)
    (`replay` its ReplicaReplay) and the evidence node (naming `lg`'s chain and ledger, and
    how the replay was judged); returns the evidence CID."""
    import dag_cbor

    from lineage.store.cid import DAG_CBOR, parse_cid
    from lineage.store.unixfs import import_bytes

    replayed = import_bytes(stage_replay.replayed_bytes, store.put).cid
    if stage_replay.replayed and parse_cid(stage_replay.replayed) != replayed:
        raise AuditError(f"the replay reports contribution {stage_replay.replayed} but its bytes hash to {replayed}")
    rel = float(stage_replay.rel_l2)
    node_doc = {
        "version": EVIDENCE_VERSION, "kind": "replay-mismatch", "run": accused.run_id, "step": accused.step,
        "node": accused.node, "replica": replay.replica, "stage": stage_replay.stage, "checkpoint": checkpoint,
        "claimed": claimed, "replayed": replayed, "rel_l2": rel if math.isfinite(rel) else None,
        "tolerance": float(getattr(stage_replay, "tolerance", 0.0) if getattr(stage_replay, "judged", "")
                           else tolerance or 0.0),
        "chainId": lg.chain.chain_id, "ledger": lg.ledger.address,
    }
    if getattr(stage_replay, "reason", ""):
        node_doc["reason"] = stage_replay.reason
    if getattr(stage_replay, "judged", ""):
        node_doc.update({"judged": stage_replay.judged, "numerics": replay.numerics or "native",
                         "trainedOn": stage_replay.trained_on, "replayedOn": replay.replayed_on,
                         "flips": stage_replay.flips, "maxFlip": stage_replay.max_flip,
                         "failure": stage_replay.failure_detail(tolerance or 0.0)})
    return store.put(dag_cbor.encode(node_doc), DAG_CBOR)


def load_evidence(store: Any, digest: bytes) -> dict[str, Any]:
    """The evidence node whose digest a challenge carries (re-hashed on read)."""
    from lineage.store import cbor
    from lineage.store.cid import DAG_CBOR, cid_from_digest

    if digest == bytes(32):
        raise AuditError("the challenge carries no evidence")
    cid = cid_from_digest(digest, DAG_CBOR)
    doc = cbor.decode(store.get(cid), f"evidence {cid}")
    if not isinstance(doc, dict) or doc.get("kind") != "replay-mismatch":
        raise AuditError(f"evidence {cid} is not a replay-mismatch record")
    return doc


def open_replay_challenge(lg: Any, store: Any, challenger: Any, accused: Accused, replays: list[Any],
                          tolerance: float | None, bond: int | None) -> dict[str, Any]:
    """Turn `replays` of the accused node's slots into an on-chain challenge against the
    first slot whose replay contradicts the claim; returns what was done."""
    from lineage.store.cid import DAG_CBOR, cid_from_digest, digest_of
    from lineage.store.manifest import get_manifest

    run_id, step, node = accused.run_id, accused.step, accused.node
    record = step_record(lg, run_id, step)
    slots = slots_of(record, node)
    checkpoint = cid_from_digest(record.checkpoint, DAG_CBOR)
    manifest = get_manifest(store, checkpoint)
    bad = [(rr, st) for rr in _replayed(replays) for st in rr.stages
           if (rr.replica, st.stage) in slots and differs(st, tolerance)]
    if not bad:
        raise AuditError("replay matches the claim; nothing to challenge")
    rr, st = bad[0]
    replica = rr.replica
    if bond is None:
        bond = max(lg.run_params(run_id).min_stake or 0, 1)
    evidence = store_evidence(store, lg, accused, rr, st, checkpoint,
                              manifest.contributions[manifest.row(replica)][st.stage], tolerance)
    challenge_id, tx = lg.open_challenge_tx(challenger, run_id=run_id, step=step, replica=replica,
                                            stage=st.stage, bond=bond, evidence=digest_of(evidence))
    return {"challenge": challenge_id, "run": run_id, "step": step, "node": node, "replica": replica,
            "stage": st.stage, "rel_l2": st.rel_l2, "evidence": str(evidence), "bond_wei": str(bond),
            "challenger": challenger.address, "tx": tx,
            "mismatched_slots": [[r.replica, s.stage] for r, s in bad],
            "judging": judging_line(rr, st), "failure": st.failure_detail(tolerance or 0.0)
            if getattr(st, "judged", "") else ""}


def step_record(lg: Any, run_id: int, step: int) -> Any:
    for rec in lg.steps(run_id):
        if rec.step == step:
            return rec
    raise AuditError(f"run {run_id} has no step {step} on its current chain")


def aggregate_failure(run_dir: Path, step: int, stage: int, rpc: str | None = None) -> str:
    """Recompute the outer steps of the run in `run_dir` from the parent shards and the
    published contributions (`dlx verify`'s aggregate level) and return step `step`'s
    failure if it shows that stage `stage`'s committed shard, the one its replicas co-signed,
    is not the aggregate; else an AuditError saying why there is nothing to challenge."""
    from .verify import verify_run

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


def store_aggregate_evidence(store: Any, lg: Any, run_id: int, record: Any, stage: int, failure: str) -> Any:
    """Store the evidence node of an aggregate challenge against stage `stage` of the
    committed step `record` (a `StepRecord` of run `run_id` on `lg`); returns its CID."""
    import dag_cbor

    from lineage.store.cid import DAG_CBOR, cid_from_digest

    stages = lg.run_created(run_id).stages
    node_doc = {"version": EVIDENCE_VERSION, "kind": "aggregate-mismatch", "run": run_id, "step": record.step,
                "stage": stage, "checkpoint": cid_from_digest(record.checkpoint, DAG_CBOR),
                "cosigned": record.shards(stages)[stage], "failure": failure,
                "chainId": lg.chain.chain_id, "ledger": lg.ledger.address}
    return store.put(dag_cbor.encode(node_doc), DAG_CBOR)


def check_vote_by_recompute(run_dir: Path | None, rpc: str | None, challenge: ChallengeRecord, upheld: bool) -> str:
    """For an aggregate challenge: recompute the challenged step's outer step from the run
    in `run_dir`; refuse a verdict the result contradicts. Returns a one-line account."""
    if run_dir is None:
        raise AuditError("--recompute needs --run-dir: the run whose outer step is recomputed")
    try:
        failure = aggregate_failure(run_dir, challenge.step, challenge.stage, rpc)
    except AuditError as exc:
        if upheld:
            raise AuditError(f"the recomputed outer step contradicts upholding: {exc}") from None
        return f"recomputed: {exc}"
    if not upheld:
        raise AuditError(f"the recomputed outer step contradicts dismissing: {failure}")
    return f"recomputed: {failure}"


def slots_of(record: Any, node: str) -> set[tuple[int, int]]:
    slots = {(int(a["replica"]), int(a["stage"])) for a in record.attestations if a["node"].lower() == node.lower()}
    if not slots:
        raise AuditError(f"node {node} attested no slot of step {record.step}")
    return slots


def check_vote_by_replay(lg: Any, store: Any, challenge: ChallengeRecord, upheld: bool,
                         tolerance: float | None) -> str:
    """Replay the challenged slot from the evidence's checkpoint; refuse a verdict the
    replay contradicts (judged as `replay_slots` judges; an uphold of a native run is also
    refused where the calibrated rule accepts a replay on another kernel set than the
    trainer's, whatever tolerance was asked for). Returns a one-line account of the replay."""
    from lineage.store.cid import digest_of, parse_cid

    ev = load_evidence(store, challenge.evidence)
    for key, want in (("run", challenge.run_id), ("step", challenge.step), ("replica", challenge.replica),
                      ("stage", challenge.stage)):
        if ev.get(key) != want:
            raise AuditError(f"the evidence's {key} is {ev.get(key)}, the challenge's {want}")
    checkpoint = parse_cid(ev["checkpoint"])
    commits = {(c.record.step, c.record.checkpoint) for c in lg.commits(challenge.run_id)}
    if (challenge.step, digest_of(checkpoint)) not in commits:
        raise AuditError(f"the evidence's checkpoint {checkpoint} is no commit of run {challenge.run_id} "
                         f"step {challenge.step}")
    (rr,) = _replayed(replay_slots(store, checkpoint, [challenge.replica], tolerance))
    (st,) = [s for s in rr.stages if s.stage == challenge.stage]
    bad = differs(st, tolerance)
    why = getattr(st, "reason", "") or (st.failure_detail(tolerance or 0.0) if getattr(st, "judged", "") else "")
    account = (f"replay of replica {rr.replica} stage {st.stage}: "
               f"{'differs from' if bad else 'matches'} the claim (relative L2 {st.rel_l2:.3g}"
               + (f"; {why}" if why else "") + ")")
    line = judging_line(rr, st)
    account += f" [{line}]" if line else ""
    if upheld and bad and _honest_elsewhere(rr, st):
        raise AuditError(f"{account}: refusing to sign an uphold: on another kernel set than the trainer's, the "
                         "calibrated flip-aware rule accepts this replay (an honest node's replay differs so)")
    if upheld and not bad:
        raise AuditError(f"{account}: refusing to sign an uphold")
    if not upheld and bad:
        raise AuditError(f"{account}: refusing to sign a dismissal")
    return account


def _honest_elsewhere(rr: Any, st: Any) -> bool:
    """Whether a native run's replayed stage, replayed on another kernel set than the
    trainer's, passes the calibrated flip-aware rule (so an explicit, stricter tolerance
    alone would call it a mismatch)."""
    from .replay import FLIP_AWARE, StageReplay, judging_for

    if getattr(rr, "numerics", "") == "portable" or not isinstance(st, StageReplay) or st.reason:
        return False
    if st.trained_on and st.trained_on == rr.replayed_on:
        return False
    judged, tol = judging_for(rr.numerics, st.trained_on, rr.replayed_on, None, auto_exact=False,
                              compression=getattr(rr, "compression", ""))
    probe = StageReplay(st.stage, st.claimed, st.replayed, st.exact, st.rel_l2, b"", judged=judged, tolerance=tol,
                        compare=st.compare, trained_on=st.trained_on)
    return judged == FLIP_AWARE and not probe.failure_detail()


def check_equivocation(a: Any, b: Any) -> tuple[str, bool]:
    """The node that signed both claims, if they prove an equivocation, and whether it is one
    on the result (two co-signed shards for one stage, any replicas; ledger version 2 on)
    rather than on a slot's contribution; else a clear error. From ledger version 3 on both
    must be over one replica set: after a membership change an honest node signs the step
    again for the new set."""
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
    if ca.replica_set != cb.replica_set:
        raise AuditError(f"the claims are over different replica sets ({ca.replica_set:#x} and {cb.replica_set:#x}): "
                         "re-attesting after a membership change is no equivocation")
    result = cosigned and (ca.contribution == cb.contribution or ca.replica != cb.replica)
    if ca.contribution == cb.contribution and not result:
        raise AuditError(f"both claims carry contribution 0x{ca.contribution.hex()}: no equivocation")
    signer_a, signer_b = a.recover(), b.recover()
    if signer_a != signer_b:
        raise AuditError(f"the claims are signed by different keys: {signer_a} and {signer_b}")
    return signer_a, result


def report_equivocation(lg: Any, reporter: Any, a: Any, b: Any, result: bool) -> tuple[int, str]:
    """Submit two signed claims `check_equivocation` accepted as the proof; returns (the
    amount slashed in wei, the transaction hash). `result`: an equivocation on the co-signed
    shard rather than on a slot's contribution."""
    from lineage.chain.ledger import Attestation

    atts = [Attestation(x.claim.replica, x.claim.stage, x.claim.contribution, x.claim.data_shard,
                        x.claim.code_hash, x.claim.loss_micros, x.signature, x.claim.new_shard, x.claim.replica_set)
            for x in (a, b)]
    c = a.claim
    report = lg.report_result_equivocation if result else lg.report_equivocation_tx
    return report(reporter, run_id=c.run_id, step=c.step, parent=c.parent, a=atts[0], b=atts[1])
