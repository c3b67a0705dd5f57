"""Replay verification (DESIGN.md section 7, level 4): re-run a replica's inner steps of a
committed round from its published start state and compare what comes out with what it
claimed.

    results = replay_checkpoint(store, checkpoint)              # every replica of one step
    results = replay_many(store, [(cp2, 0), (cp3, 1)])          # one process launch for all
    all(r.ok for r in results)

For step t, replica r, stage s the manifest links the claimed contribution
(`contributions[row][s]`) and the round's start state (`replay[row][s]`, written by the
trainer: local weights, inner optimizer state, compressor state), where `row` is replica
r's row (`Manifest.row`: replica ids are not positions once a step of an elastic run has
only some replicas; only the replicas a step had can be replayed for it). Before replaying, the
start state's weights must be what the run's exchange rule derives from committed data:
the shard of step t-1 (synchronous, and any run's first round or first after a resume),
of step t-2 (the restart rule), the eager lookahead from step t-2 and the published
contributions (eager), or the end of round t-1, bound to its published contribution and
compressor state (partial; see `_check_start_weights`).
`trainer.replay.replay_rounds` then re-runs the round on S local processes with the job
configuration from the manifest's config block, the data shard the ledger attests and the
trainer's own code; the adaptive rule re-uses the byte budget the claim recorded. On the
machine class that trained, an honest replay is bit-identical (`exact`); elsewhere
`rel_l2` = ||decoded(replayed) - decoded(claimed)|| / ||decoded(claimed)|| over the stage's
tensors is what a `tolerance` judges.

`check_continuity` closes the chain between rounds: the state a replayed round leaves
(inner optimizer, compressor) must be the next round's published start state, or a fresh
one (a resumed overlapped run, delay 1, restarts both; a synchronous one resumes exactly).
Across a step whose replica set changed: a replica absent from step t-1 has no previous
state, so its round t must start from the parent shard (with whatever inner state, fresh
for a joiner); a replica absent from step t+1 has no next state to compare with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from multiformats import CID

from lineage.errors import DlxError
from lineage.store.manifest import Manifest, get_manifest
from lineage.store.runconfig import RunConfig
from lineage.store.unixfs import file_cid, read_bytes

__all__ = ["ReplicaReplay", "StageReplay", "check_continuity", "job_of", "replay_checkpoint", "replay_many"]


@dataclass
class StageReplay:
    stage: int
    claimed: str  # CID of the claimed contribution file
    replayed: str  # CID the replayed payload would have as a file
    exact: bool  # replayed bytes == claimed bytes
    rel_l2: float  # ||decoded(replayed) - decoded(claimed)|| / ||decoded(claimed)||
    replayed_bytes: bytes
    reason: str = ""  # a failed state check (start weights, data shard, continuity); "" if none

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "claimed": self.claimed, "replayed": self.replayed, "exact": self.exact,
                "rel_l2": self.rel_l2 if math.isfinite(self.rel_l2) else None, "reason": self.reason}


@dataclass
class ReplicaReplay:
    step: int
    replica: int
    stages: list[StageReplay]
    seconds: float  # replay wall time of this round (slowest stage); process start-up excluded
    checkpoint: str = ""
    tolerance: float = 0.0
    error: str = ""  # the round could not be replayed at all (no start states, unreadable block)
    end_states: list[bytes] = field(default_factory=list, repr=False)  # per stage, for continuity

    @property
    def ok(self) -> bool:
        """Every stage exact, or within `tolerance`, and every state check passed."""
        return not self.error and bool(self.stages) and all(
            not s.reason and (s.exact or s.rel_l2 <= self.tolerance) for s in self.stages)

    def failure(self) -> str:
        """One line saying why the replay failed ("" when it passed)."""
        where = f"step {self.step} replica {self.replica}"
        if self.error:
            return f"{where}: {self.error}"
        for s in self.stages:
            if s.reason:
                return f"{where} stage {s.stage}: {s.reason}"
            if not (s.exact or s.rel_l2 <= self.tolerance):
                return (f"{where} stage {s.stage}: replayed contribution {s.replayed} differs from the claimed "
                        f"{s.claimed} (rel_l2 {s.rel_l2:.3g}, tolerance {self.tolerance:g})")
        return "" if self.stages else f"{where}: nothing replayed"

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "replica": self.replica, "checkpoint": self.checkpoint, "ok": self.ok,
                "seconds": self.seconds, "error": self.error, "tolerance": self.tolerance,
                "stages": [s.as_json() for s in self.stages]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ReplicaReplay:
        """Back from `as_json()` (a replay done elsewhere, e.g. on the verify queue), without
        the replayed bytes and end states, so `check_continuity` has nothing to compare."""
        stages = [StageReplay(stage=s["stage"], claimed=s["claimed"], replayed=s["replayed"], exact=s["exact"],
                              rel_l2=math.inf if s["rel_l2"] is None else float(s["rel_l2"]), replayed_bytes=b"",
                              reason=s.get("reason", "")) for s in doc["stages"]]
        return cls(step=doc["step"], replica=doc["replica"], stages=stages, seconds=doc["seconds"],
                   checkpoint=doc.get("checkpoint", ""), tolerance=doc.get("tolerance", 0.0),
                   error=doc.get("error", ""))


class _Skip(Exception):
    """This item cannot be replayed; the message says why."""


def job_of(store: Any, config: CID | str, *, with_data: bool = True) -> Any:
    """The trainer's JobConfig from a run's config block (chain and storage sections dropped);
    `with_data`: reading the token file the block names, fetched by CID from `store` (a run
    that predates recorded data re-reads its corpus as it was configured)."""
    from lineage.store.datasets import fetch_prepared

    run_config = RunConfig.load(store, config)
    cfg = run_config.training_job()
    record = run_config.data if with_data else None
    if record is None:
        return cfg
    return cfg.with_prepared(fetch_prepared(store, record))


def replay_checkpoint(store: Any, checkpoint: CID | str, replicas: list[int] | None = None,
                      tolerance: float = 0.0) -> list[ReplicaReplay]:
    """Replay every replica the step had (or `replicas`) of one committed step."""
    m = get_manifest(store, checkpoint)
    return replay_many(store, [(checkpoint, r) for r in (m.replica_ids() if replicas is None else replicas)],
                       tolerance)


@dataclass
class _Prepared:
    result: ReplicaReplay
    job: Any = None
    manifest: Manifest | None = None
    claimed: list[bytes] = field(default_factory=list)
    starts: list[bytes] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    outer: list[bytes] | None = None  # the partial rule: the parent's stage shards
    row: int = 0  # the replica's row in the manifest's tables


def replay_many(store: Any, items: list[tuple[CID | str, int]], tolerance: float = 0.0) -> list[ReplicaReplay]:
    """Replay each (checkpoint, replica) item; one process launch per distinct job, so the
    start-up cost is paid once. Results in item order; nothing raises for a bad item (its
    `error` says why), only for a replay process that dies."""
    from trainer.replay import ReplayItem, replay_rounds

    manifests: dict[str, Manifest] = {}
    jobs: dict[str, Any] = {}
    prepared = [_prepare(store, str(cp), replica, tolerance, manifests, jobs) for cp, replica in items]
    groups: dict[bytes, list[_Prepared]] = {}
    for p in prepared:
        if not p.result.error:
            groups.setdefault(p.job.canonical_json(), []).append(p)
    for group in groups.values():
        job = group[0].job
        outs = replay_rounds(job, [ReplayItem(p.result.step, p.result.replica, p.starts, p.claimed, p.outer)
                                   for p in group])
        for p, out in zip(group, outs, strict=True):
            _judge(p, out)
    return [p.result for p in prepared]


def _prepare(store: Any, checkpoint: str, replica: int, tolerance: float, manifests: dict[str, Manifest],
             jobs: dict[str, Any]) -> _Prepared:
    p = _Prepared(ReplicaReplay(step=0, replica=replica, stages=[], seconds=0.0, checkpoint=checkpoint,
                                tolerance=tolerance))
    try:
        m = _manifest(store, checkpoint, manifests)
        p.result.step = m.step
        if m.step == 0:
            raise _Skip("the genesis has no round to replay")
        key = str(m.config)
        if key not in jobs:
            jobs[key] = job_of(store, m.config)
        p.job = job = jobs[key]
        R, S = job.parallel.replicas, job.parallel.stages
        if not 0 <= replica < R:
            raise _Skip(f"no replica {replica} (the run has {R})")
        ids = m.replica_ids(R)
        if replica not in ids:
            raise _Skip(f"replica {replica} was not in step {m.step} (its replicas: {', '.join(map(str, ids))})")
        if not m.replay:
            raise _Skip("the manifest links no start states (an AllReduce baseline or an older run)")
        if len(m.replay) != len(ids) or any(len(row) != S for row in m.replay):
            raise _Skip("the start-state table is not the step's replicas x stages")
        p.row = row = ids.index(replica)
        p.claimed = [read_bytes(store, m.contributions[row][s]) for s in range(S)]
        p.starts = [read_bytes(store, m.replay[row][s]) for s in range(S)]
        p.manifest = m
        p.reasons = _check_start_weights(store, m, p.starts, job, replica, manifests)
        if job.outer.rule == "partial":  # the round merged, and measured from, step t-1's shard
            if m.parent is None:  # a malformed manifest: a step past the genesis links its parent
                raise ValueError(f"step {m.step} links no parent manifest")
            p.outer = [read_bytes(store, _manifest(store, m.parent, manifests).stages[s]) for s in range(S)]
    except _Skip as exc:
        p.result.error = str(exc)
    except (DlxError, ValueError, KeyError, TypeError) as exc:
        p.result.error = " ".join(str(exc).split()) or type(exc).__name__
    return p


def _manifest(store: Any, cid: CID | str, cache: dict[str, Manifest]) -> Manifest:
    key = str(cid)
    if key not in cache:
        cache[key] = get_manifest(store, cid)
    return cache[key]


def _check_start_weights(store: Any, m: Manifest, starts: list[bytes], job: Any, replica: int,
                         cache: dict[str, Manifest]) -> list[str]:
    """Per stage, "" when the start state's weights are what the run's exchange rule
    derives from committed data, else why not. Every rule may start a run's first round
    (and the first after a resume, or after the replica set changed) from the parent
    shard, and a replica that was not in step t-1 has nothing else to start from; then
    - sync: only that;
    - restart: or the shard of step t-2;
    - eager: or `trainer.diloco.eager_start` of step t-2's shard with the published
      contributions of rounds t-1 (this replica's) and t-2 (every replica's);
    - partial: or the end of round t-1, bound to its published contribution and compressor
      state (`trainer.replay.partial_start_reason`)."""
    from trainer.artifacts import param_tensors, same_tensors
    from trainer.replay import eager_start_matches, partial_start_reason

    assert m.parent is not None
    rule = job.outer.rule
    parent = _manifest(store, m.parent, cache)
    grand = _manifest(store, parent.parent, cache) if parent.parent is not None else None
    R = job.parallel.replicas
    before = parent.row(replica) if parent.step > 0 and replica in parent.replica_ids(R) else None
    reasons = []
    for s, start in enumerate(starts):
        try:
            weights = param_tensors(start)
        except Exception as exc:  # safetensors raises its own error type for bad bytes
            reasons.append(f"start state is not safetensors: {exc}")
            continue
        parent_shard = read_bytes(store, parent.stages[s])
        if same_tensors(weights, param_tensors(parent_shard)):
            reasons.append("")
            continue
        if grand is None or rule == "sync":
            reasons.append(f"start weights are not the outer weights of step {parent.step}")
            continue
        if before is None and rule != "restart":  # no round t-1 of this replica to derive from
            reasons.append(f"start weights are not the outer weights of step {parent.step} (replica {replica} "
                           f"was not in step {parent.step}, so its round starts from them)")
            continue
        grand_shard = read_bytes(store, grand.stages[s])
        try:
            if rule == "restart":
                ok = same_tensors(weights, param_tensors(grand_shard))
                reason = "" if ok else f"start weights are not the outer weights of step {parent.step} or {grand.step}"
            elif rule == "eager":
                assert before is not None
                own = read_bytes(store, parent.contributions[before][s])
                parent_start = read_bytes(store, parent.replay[before][s])
                first = grand.step == 0 or same_tensors(param_tensors(parent_start), param_tensors(grand_shard))
                stale = None if first else [read_bytes(store, row[s]) for row in grand.contributions]
                ok = eager_start_matches(job, replica, start, grand_shard, own, stale, m.replica_ids(R))
                reason = "" if ok else (f"start weights are neither step {parent.step}'s outer weights nor the eager "
                                        f"step derived from steps {grand.step} and {parent.step}")
            else:  # partial
                assert before is not None
                reason = partial_start_reason(
                    job, replica, s, start, read_bytes(store, parent.replay[before][s]),
                    read_bytes(store, parent.contributions[before][s]), grand_shard)
        except (DlxError, ValueError, KeyError, IndexError) as exc:
            reason = f"start weights cannot be derived: {' '.join(str(exc).split())}"
        reasons.append(reason)
    return reasons


def _rel_l2(replayed: bytes, claimed: bytes, shapes: dict[str, Any]) -> float:

    from trainer.compress import decode_contribution

    try:
        a = decode_contribution(replayed, shapes)
        b = decode_contribution(claimed, shapes)
    except Exception:  # an undecodable claim is as far off as it gets
        return math.inf
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in shapes)
    norm = sum(float(b[n].double().pow(2).sum()) for n in shapes)
    if diff == 0.0:
        return 0.0
    return math.sqrt(diff / norm) if norm > 0 else math.inf


def _judge(p: _Prepared, out: Any) -> None:
    from trainer.artifacts import bytes_to_tensors
    from trainer.diloco import step_names

    r, m = p.result, p.manifest
    assert m is not None
    r.seconds = out.seconds
    if out.error:
        r.error = out.error
        return
    r.end_states = list(out.end_states)
    shard_reason = "" if out.data_shard == m.data[p.row] else "replayed data shard differs from the attested one"
    fragments = p.job.outer.fragments if p.job is not None else 1
    for s, (payload, claimed) in enumerate(zip(out.payloads, p.claimed, strict=True)):
        shapes = {k.removeprefix("param/"): v.shape for k, v in bytes_to_tensors(p.starts[s]).items()
                  if k.startswith("param/")}
        if len(shapes) >= fragments:  # the round sent its fragment (all of them when 1)
            shapes = {n: shapes[n] for n in step_names(shapes, fragments, m.step)}
        exact = payload == claimed
        r.stages.append(StageReplay(
            stage=s, claimed=str(m.contributions[p.row][s]), replayed=str(file_cid(payload)), exact=exact,
            rel_l2=0.0 if exact else _rel_l2(payload, claimed, shapes), replayed_bytes=payload,
            reason=p.reasons[s] or shard_reason))


def check_continuity(store: Any, result: ReplicaReplay, next_checkpoint: CID | str) -> None:
    """Compare the state `result`'s round left (inner optimizer, compressor) with the start
    states the next step published for the same replica; a mismatch becomes the stage's
    `reason`. A fresh state (a resumed overlapped run, delay 1, restarts both; a replica
    back in an elastic run's set) also passes, and a replica the next step did not have has
    nothing to compare. With a tolerance the float tensors may differ by that relative L2."""
    from trainer.replay import fresh_state_core, state_core

    if not result.end_states or not result.stages:
        return
    nxt = get_manifest(store, next_checkpoint)
    if not nxt.replay:
        return
    job = job_of(store, nxt.config, with_data=False)
    if result.replica not in nxt.replica_ids(job.parallel.replicas):
        return  # the replica left the set: no next round of its to continue
    row = nxt.row(result.replica)
    weights = job.outer.fragments > 1  # the end states hold the weights, most never sent
    for s, stage in enumerate(result.stages):
        if stage.reason:
            continue
        start = read_bytes(store, nxt.replay[row][s])
        if _same_state(state_core(start, weights), result.end_states[s], result.tolerance):
            continue
        if state_core(start) == fresh_state_core(job, result.replica, s, nxt.step) and (
                not weights or _fresh_weights(store, nxt, s, start)):
            continue
        stage.reason = (f"the start state step {nxt.step} published ({nxt.replay[row][s]}) is not "
                        f"the state this round leaves")


def _fresh_weights(store: Any, nxt: Manifest, stage: int, start: bytes) -> bool:
    """Whether a start state's weights are the committed shard the step builds on (a
    fresh start: a resume, or a replica back in the set)."""
    from trainer.artifacts import param_tensors, same_tensors

    if nxt.parent is None:
        return False
    parent = get_manifest(store, nxt.parent)
    return same_tensors(param_tensors(start), param_tensors(read_bytes(store, parent.stages[stage])))


def _same_state(a: bytes, b: bytes, tolerance: float) -> bool:
    if a == b:
        return True
    if tolerance <= 0:
        return False
    from trainer.artifacts import bytes_to_tensors

    x, y = bytes_to_tensors(a), bytes_to_tensors(b)
    if x.keys() != y.keys():
        return False
    diff = norm = 0.0
    for k in x:
        if x[k].shape != y[k].shape or x[k].dtype != y[k].dtype:
            return False
        if x[k].is_floating_point():
            diff += float((x[k].double() - y[k].double()).pow(2).sum())
            norm += float(y[k].double().pow(2).sum())
        elif not bool((x[k] == y[k]).all()):
            return False
    return diff == 0 or (norm > 0 and math.sqrt(diff / norm) <= tolerance)
