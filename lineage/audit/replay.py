"""Replay verification (DESIGN.md section 7, level 4): re-run a replica's inner steps of a
committed round from its published start state and compare what comes out with what it
claimed.

    results = replay_checkpoint(store, checkpoint)              # every replica of one step
    results = replay_many(store, [(cp2, 0), (cp3, 1)])          # one process launch for all
    all(r.ok for r in results)

For step t, replica r, stage s the manifest links the claimed contribution
(`contributions[row][s]`) and the round's start state (`replay[row][s]`, written by the
trainer: local weights, inner optimizer state, compressor state, and the kernel
fingerprint of the process that trained, ``round/kernels``), where `row` is replica
r's row (`Manifest.row`: replica ids are not positions once a step of an elastic run has
only some replicas; only the replicas a step had can be replayed for it). Before replaying, the
start state's weights must be what the run's exchange rule derives from committed data:
the shard of step t-1 (synchronous, and any run's first round or first after a resume),
of step t-2 (the restart rule), the eager lookahead from step t-2 and the published
contributions (eager), or the end of round t-1, bound to its published contribution and
compressor state (partial; see `_check_start_weights`). A start state stored by reference
to the committed shard whose weights it holds (lineage/store/roundstate.py) is rebuilt
first, its weights one of steps t-1 and t-2's shards of the same stage; one stored as a
plain file (older runs, derived weights) is read as it is.
`trainer.replay.replay_rounds` then re-runs the round on S local processes with the job
configuration from the manifest's config block, the data shard the ledger attests and the
trainer's own code; the adaptive rule re-uses the byte budget the claim recorded.

How a replayed stage is judged (`judging_for`) follows the run's `parallel.numerics`:
- portable: bit for bit, always (its kernels give the same bits on every CPU); a
  tolerance does not loosen it;
- native, same kernel fingerprint as the trainer's (`trainer.kernels`): bit for bit;
- native, another fingerprint (or none recorded, a run from before fingerprints): the
  flip-aware comparison (`compare_payloads`, lineage/audit/flips.py) within `default_tolerance(kind)`, calibrated
  by scripts/calibrate_tolerance.py: `DEFAULT_TOLERANCE` for compressed contributions,
  `DEFAULT_TOLERANCE_NONE` for kind "none", whose float32 deltas (the reference minus
  weights that differ in their last bits) show the kernels' difference far more. An honest
  replay on other kernels differs in the last bits: a quantised value near a rounding
  boundary lands one code away, a scale (max|row| / levels) moves by a few ulps, a sparse
  index may swap at a tie of magnitudes. So every differing code must differ by exactly
  one level, at most `FLIP_FRACTION` of the codes (plus `FLIP_SLACK`) may, sparse swaps
  likewise and only at the chunk's smallest kept magnitudes, every scale must be within
  the tolerance (relative to its tensor's largest scale), and the rest (the claimed codes
  at the replayed scales against the claim, or for kind "none" the plain difference)
  within the tolerance in relative L2;
- an explicit tolerance (`--tolerance X`) replaces the automatic choice for a native run:
  0 is bit for bit, X > 0 the flip-aware comparison within X.
Challenges and arbiters (lineage/audit/evidence.py) judge alike, and an arbiter never
upholds a native run's replay on another kernel set than the trainer's that the calibrated
rule accepts, whatever tolerance it was asked for (`judging_for(..., auto_exact=False)`).
Bit for bit from equal fingerprints trusts the fingerprint's probe (trainer/kernels.py) to
see every kernel difference the inner steps meet.

`check_continuity` closes the chain between rounds: the state a replayed round leaves
(inner optimizer, compressor) must be the next round's published start state, or a fresh
one (a resumed overlapped run, delay 1, restarts both; a synchronous one resumes exactly).
Under the flip-aware comparison the float tensors may differ within the tolerance, and the
compressor residuals, at as many positions as the payload's codes flipped, by the size of
the flip. Across a step whose replica set changed: a replica absent from step t-1 has no
previous state, so its round t must start from the parent shard (with whatever inner state,
fresh for a joiner); a replica absent from step t+1 has no next state to compare with.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from multiformats import CID

from lineage.errors import DlxError
from lineage.store.manifest import Manifest, get_manifest
from lineage.store.roundstate import read_start_state
from lineage.store.runconfig import RunConfig
from lineage.store.unixfs import file_cid, read_bytes

from .flips import (
    FLIP_FRACTION,
    FLIP_SLACK,
    compare_payloads,
    finite_or_none,
    flip_allowance,
    flip_failure,
)

__all__ = [
    "DEFAULT_TOLERANCE",
    "DEFAULT_TOLERANCE_NONE",
    "EXACT",
    "FLIP_AWARE",
    "FLIP_FRACTION",
    "FLIP_SLACK",
    "UNRECORDED",
    "ReplicaReplay",
    "StageReplay",
    "apply_judging",
    "check_continuity",
    "compare_payloads",
    "default_tolerance",
    "flip_allowance",
    "flip_failure",
    "job_of",
    "judging_for",
    "kernels_summary",
    "replay_checkpoint",
    "replay_many",
    "replayer_fingerprint",
]

#: The relative tolerance a native run's replay on another kernel set is judged within
#: (flip-aware), for compressed contributions: scripts/calibrate_tolerance.py replayed
#: honest runs (4-bit quantised, H = 4 and 20) under seven kernel sets; the largest judged
#: figure it saw (a scale, 5.6e-5 at H = 20) times 10, rounded up (docs/audit.md, "An audit that
#: holds on any machine"). Longer rounds diverge further: past the calibrated ones, measure
#: (`--tolerance`), or train with `parallel.numerics = "portable"`.
DEFAULT_TOLERANCE = 1e-3
#: The same for kind "none" (plain relative L2 of the float32 deltas; 2.3e-3 seen at H = 20).
DEFAULT_TOLERANCE_NONE = 5e-2
UNRECORDED = "unrecorded"  # a start state from before kernel fingerprints were recorded
EXACT, FLIP_AWARE = "exact", "flip-aware"


@dataclass
class StageReplay:
    stage: int
    claimed: str  # CID of the claimed contribution file
    replayed: str  # CID the replayed payload would have as a file
    exact: bool  # replayed bytes == claimed bytes
    rel_l2: float  # ||decoded(replayed) - decoded(claimed)|| / ||decoded(claimed)||
    replayed_bytes: bytes
    reason: str = ""  # a failed state check (start weights, data shard, continuity); "" if none
    trained_on: str = ""  # the trainer's kernel fingerprint (its start state's), or UNRECORDED
    judged: str = ""  # EXACT or FLIP_AWARE (`apply_judging`); "": the replica's tolerance, plain rel_l2
    tolerance: float = 0.0  # what FLIP_AWARE judges within
    compare: dict[str, Any] | None = None  # `compare_payloads` of a stage that is not bit for bit
    state_rel_l2: float | None = None  # continuity: the state's difference (None: not compared)

    def failure_detail(self, default_tolerance: float = 0.0) -> str:
        """Why this stage fails ("" when it passes): its state check's reason, else what
        its judging finds in the replayed contribution."""
        if self.reason:
            return self.reason
        if self.exact:
            return ""
        if self.judged == EXACT:
            return "not bit for bit"
        if self.judged == FLIP_AWARE:
            if self.compare is None:  # a result from before the comparison: plain rel_l2
                return "" if self.rel_l2 <= self.tolerance else "relative L2 above the tolerance"
            return flip_failure(self.compare, self.tolerance)
        return "" if self.rel_l2 <= default_tolerance else "relative L2 above the tolerance"

    @property
    def flips(self) -> int:
        return int(self.compare.get("flips", 0)) if self.compare else 0

    @property
    def max_flip(self) -> int:
        return int(self.compare.get("max_flip", 0)) if self.compare else 0

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "claimed": self.claimed, "replayed": self.replayed, "exact": self.exact,
                "rel_l2": finite_or_none(self.rel_l2), "reason": self.reason, "trained_on": self.trained_on,
                "judged": self.judged, "tolerance": self.tolerance, "flips": self.flips,
                "max_flip": self.max_flip, "compare": self.compare, "state_rel_l2": finite_or_none(self.state_rel_l2)}

    @classmethod
    def from_json(cls, s: dict[str, Any]) -> StageReplay:
        state = s.get("state_rel_l2")
        return cls(stage=s["stage"], claimed=s["claimed"], replayed=s["replayed"], exact=s["exact"],
                   rel_l2=math.inf if s["rel_l2"] is None else float(s["rel_l2"]), replayed_bytes=b"",
                   reason=s.get("reason", ""), trained_on=s.get("trained_on", ""), judged=s.get("judged", ""),
                   tolerance=float(s.get("tolerance", 0.0)), compare=s.get("compare"),
                   state_rel_l2=None if state is None else float(state))


@dataclass
class ReplicaReplay:
    step: int
    replica: int
    stages: list[StageReplay]
    seconds: float  # replay wall time of this round (slowest stage); process start-up excluded
    checkpoint: str = ""
    tolerance: float = 0.0  # asked for (0: none); stages judged by `apply_judging` carry their own
    error: str = ""  # the round could not be replayed at all (no start states, unreadable block)
    end_states: list[bytes] = field(default_factory=list, repr=False)  # per stage, for continuity
    replayed_on: str = ""  # the replaying process's kernel fingerprint (`replayer_fingerprint`)
    numerics: str = ""  # the run's parallel.numerics: "native" or "portable"
    compression: str = ""  # the run's outer.compression.kind (its default tolerance)

    @property
    def ok(self) -> bool:
        """Every stage passes its judging (or, not judged, is exact or within `tolerance`),
        and every state check passed."""
        return not self.error and bool(self.stages) and not any(
            s.failure_detail(self.tolerance) for s in self.stages)

    def failure(self) -> str:
        """One line saying why the replay failed ("" when it passed)."""
        where = f"step {self.step} replica {self.replica}"
        if self.error:
            return f"{where}: {self.error}"
        for s in self.stages:
            if s.reason:
                return f"{where} stage {s.stage}: {s.reason}"
            detail = s.failure_detail(self.tolerance)
            if not detail:
                continue
            line = (f"{where} stage {s.stage}: replayed contribution {s.replayed} differs from the claimed "
                    f"{s.claimed} (rel_l2 {s.rel_l2:.3g}, tolerance {s.tolerance if s.judged else self.tolerance:g})")
            if s.judged == EXACT:
                same = s.trained_on and s.trained_on == self.replayed_on
                return line + (": judged bit for bit" + (
                    " (a portable run replays bit for bit on every CPU)" if self.numerics == "portable" else
                    " (the trainer's kernel fingerprint; where math libraries differ beyond its probe, "
                    "--tolerance judges flip-aware)" if same else ""))
            return line + (f": {detail}" if s.judged == FLIP_AWARE else "")
        return "" if self.stages else f"{where}: nothing replayed"

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "replica": self.replica, "checkpoint": self.checkpoint, "ok": self.ok,
                "seconds": self.seconds, "error": self.error, "tolerance": self.tolerance,
                "replayed_on": self.replayed_on, "numerics": self.numerics, "compression": self.compression,
                "stages": [s.as_json() for s in self.stages]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ReplicaReplay:
        """Back from `as_json()` (a replay done elsewhere, e.g. on the verify queue), without
        the replayed bytes and end states, so `check_continuity` has nothing to compare."""
        return cls(step=doc["step"], replica=doc["replica"], stages=[StageReplay.from_json(s) for s in doc["stages"]],
                   seconds=doc["seconds"], checkpoint=doc.get("checkpoint", ""), tolerance=doc.get("tolerance", 0.0),
                   error=doc.get("error", ""), replayed_on=doc.get("replayed_on", ""),
                   numerics=doc.get("numerics", ""), compression=doc.get("compression", ""))


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
                      tolerance: float | None = None) -> list[ReplicaReplay]:
    """Replay every replica the step had (or `replicas`) of one committed step (`tolerance`
    as for `replay_many`)."""
    m = get_manifest(store, checkpoint)
    return replay_many(store, [(checkpoint, r) for r in (m.replica_ids() if replicas is None else replicas)],
                       tolerance)


@dataclass
class _Prepared:
    result: ReplicaReplay
    job: Any = None
    manifest: Manifest | None = None
    claimed: list[bytes] = field(default_factory=list)
    starts: list[Any] = field(default_factory=list)  # bytes, then (spilled) trainer.artifacts.Blob
    reasons: list[str] = field(default_factory=list)
    outer: list[Any] | None = None  # the partial rule: the parent's stage shards (as starts)
    row: int = 0  # the replica's row in the manifest's tables


def replay_many(store: Any, items: list[tuple[CID | str, int]], tolerance: float | None = None) -> list[ReplicaReplay]:
    """Replay each (checkpoint, replica) item; one process launch per distinct job, so the
    start-up cost is paid once. Results in item order; nothing raises for a bad item (its
    `error` says why), only for a replay process that dies. Each stage is judged by
    `apply_judging`: `tolerance` None is the automatic choice (module docstring), a number
    an explicit one. Each item's start states and shards go to a temporary directory once
    checked (`trainer.artifacts.Spill`), so that memory holds one item's, not every item's."""
    from trainer.artifacts import Spill, spill_directory
    from trainer.replay import ReplayItem, replay_rounds

    manifests: dict[str, Manifest] = {}
    jobs: dict[str, Any] = {}
    with spill_directory("verify") as tmp:
        spill, prepared = Spill(tmp), []
        for cp, replica in items:
            p = _prepare(store, str(cp), replica, tolerance or 0.0, manifests, jobs)
            p.starts = [spill.bytes(b) for b in p.starts]
            p.outer = None if p.outer is None else [spill.bytes(b) for b in p.outer]
            prepared.append(p)
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
        for p in prepared:
            p.starts, p.outer = [], None
    fingerprint = replayer_fingerprint()
    for p in prepared:
        p.result.replayed_on = fingerprint
        p.result.numerics = p.job.parallel.numerics if p.job is not None else ""
        p.result.compression = p.job.outer.compression.kind if p.job is not None else ""
        apply_judging(p.result, tolerance)
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
        p.starts = [read_start_state(store, m, row, s, manifests=manifests) for s in range(S)]
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
                parent_start = read_start_state(store, parent, before, s, manifests=cache)
                first = grand.step == 0 or same_tensors(param_tensors(parent_start), param_tensors(grand_shard))
                stale = None if first else [read_bytes(store, row[s]) for row in grand.contributions]
                ok = eager_start_matches(job, replica, start, grand_shard, own, stale, m.replica_ids(R))
                reason = "" if ok else (f"start weights are neither step {parent.step}'s outer weights nor the eager "
                                        f"step derived from steps {grand.step} and {parent.step}")
            else:  # partial
                assert before is not None
                reason = partial_start_reason(
                    job, replica, s, start, read_start_state(store, parent, before, s, manifests=cache),
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
    from trainer.artifacts import StoredTensors, bytes_to_tensors, to_bytes
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
        try:
            start: Any = StoredTensors(p.starts[s])  # each tensor read as needed, not all of them at once
        except ValueError:  # a layout only the safetensors library reads
            start = bytes_to_tensors(to_bytes(p.starts[s]))
        shapes = {k.removeprefix("param/"): start[k].shape for k in start if k.startswith("param/")}
        if len(shapes) >= fragments:  # the round sent its fragment (all of them when 1)
            shapes = {n: shapes[n] for n in step_names(shapes, fragments, m.step)}
        exact = payload == claimed
        r.stages.append(StageReplay(
            stage=s, claimed=str(m.contributions[p.row][s]), replayed=str(file_cid(payload)), exact=exact,
            rel_l2=0.0 if exact else _rel_l2(payload, claimed, shapes), replayed_bytes=payload,
            reason=p.reasons[s] or shard_reason, trained_on=kernels_of(start),
            compare=None if exact else compare_payloads(payload, claimed, shapes)))


def kernels_of(state: dict[str, Any]) -> str:
    """The kernel fingerprint a round-start state (its tensors) records, or UNRECORDED."""
    from trainer.artifacts import KERNELS_KEY

    t = state.get(KERNELS_KEY)
    if t is None:
        return UNRECORDED
    return bytes(t.numpy().tobytes()).decode("utf-8", "replace") or UNRECORDED


@functools.cache
def replayer_fingerprint() -> str:
    """The kernel fingerprint of the replay processes `replay_many` starts: this process's
    kernels (the processes inherit its environment) at one thread, as they compute
    (`trainer.replay` sets one thread in each; the trainer's ranks do too)."""
    import torch

    from trainer.kernels import kernel_fingerprint

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return kernel_fingerprint.__wrapped__()  # not the cache: this process may run more threads
    finally:
        torch.set_num_threads(threads)


# --- judging ----------------------------------------------------------------------------


def default_tolerance(compression: str) -> float:
    """The calibrated tolerance of a native run's replay on other kernels, by its
    compression kind."""
    return DEFAULT_TOLERANCE_NONE if compression == "none" else DEFAULT_TOLERANCE


def judging_for(numerics: str, trained_on: str, replayed_on: str, tolerance: float | None,
                auto_exact: bool = True, compression: str = "") -> tuple[str, float]:
    """(EXACT or FLIP_AWARE, tolerance) for one replayed stage (the module docstring)."""
    if numerics == "portable":
        return EXACT, 0.0
    if tolerance is not None:
        return (EXACT, 0.0) if tolerance == 0 else (FLIP_AWARE, float(tolerance))
    if auto_exact and trained_on not in ("", UNRECORDED) and trained_on == replayed_on:
        return EXACT, 0.0
    return FLIP_AWARE, default_tolerance(compression)


def apply_judging(result: ReplicaReplay, tolerance: float | None) -> None:
    """Set how each of `result`'s stages is judged, from the run's numerics, the two
    fingerprints and `tolerance` (None: automatic). A replay done elsewhere (the verify
    queue) is judged here again from its recorded figures."""
    for st in result.stages:
        st.judged, st.tolerance = judging_for(result.numerics, st.trained_on, result.replayed_on, tolerance,
                                              compression=result.compression)
    if tolerance is not None:
        result.tolerance = tolerance


def judging_notes(results: list[ReplicaReplay], tolerance: float | None) -> list[str]:
    """One line per way the replays were judged that a reader should know of: a native
    run checked on another kernel set, a tolerance that does not loosen a portable run."""
    notes: list[str] = []
    for r in results:
        for st in r.stages:
            if r.numerics == "portable" and tolerance:
                line = f"portable run: every replay must be bit for bit; --tolerance {tolerance:g} does not loosen it"
            elif st.judged == FLIP_AWARE and st.trained_on != r.replayed_on:
                line = (f"native run: trained on {st.trained_on or UNRECORDED}, replayed on {r.replayed_on}: "
                        f"judged within tolerance {st.tolerance:g} with flip-aware comparison")
            elif st.judged == FLIP_AWARE:
                line = (f"native run: trained and replayed on {r.replayed_on}: judged within tolerance "
                        f"{st.tolerance:g} with flip-aware comparison")
            else:
                continue
            if line not in notes:
                notes.append(line)
    return notes


def kernels_summary(results: list[ReplicaReplay], tolerance: float | None) -> dict[str, Any]:
    """What `dlx verify` reports of the kernels: the run's numerics, each fingerprint the
    trainer recorded with the (replica, stage) slots that recorded it, the replaying
    processes' fingerprints, and `judging_notes`."""
    trained: dict[str, set[tuple[int, int]]] = {}
    for r in results:
        for st in r.stages:
            trained.setdefault(st.trained_on or UNRECORDED, set()).add((r.replica, st.stage))
    judged = sorted({(st.judged, st.tolerance) for r in results for st in r.stages if st.judged})
    return {"numerics": sorted({r.numerics for r in results if r.numerics}),
            "trained_on": {fp: [list(slot) for slot in sorted(slots)] for fp, slots in sorted(trained.items())},
            "replayed_on": sorted({r.replayed_on for r in results if r.replayed_on}),
            "judged": [{"judged": j, "tolerance": t} for j, t in judged],
            "notes": judging_notes(results, tolerance)}


# --- continuity -------------------------------------------------------------------------


def check_continuity(store: Any, result: ReplicaReplay, next_checkpoint: CID | str) -> None:
    """Compare the state `result`'s round left (inner optimizer, compressor) with the start
    states the next step published for the same replica; a mismatch becomes the stage's
    `reason`. A fresh state (a resumed overlapped run, delay 1, restarts both; a replica
    back in an elastic run's set) also passes, and a replica the next step did not have has
    nothing to compare. A stage judged bit for bit needs the same bytes; one judged
    flip-aware, float tensors within its tolerance (relative L2, `stage.state_rel_l2`),
    the compressor residuals moved by its flips at most where they flipped. Not judged:
    within the replica's tolerance."""
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
        start = read_start_state(store, nxt, row, s)
        core = state_core(start, weights)
        if _continues(stage, core, result.end_states[s], result.tolerance):
            continue
        if state_core(start) == fresh_state_core(job, result.replica, s, nxt.step) and (
                not weights or _fresh_weights(store, nxt, s, start)):
            continue
        stage.reason = (f"the start state step {nxt.step} published ({nxt.replay[row][s]}) is not "
                        f"the state this round leaves")


def _continues(stage: StageReplay, published: bytes, left: bytes, default_tolerance: float) -> bool:
    """Whether the published start state is the state the replayed round left, as the
    stage is judged (records `stage.state_rel_l2`)."""
    if published == left:
        stage.state_rel_l2 = 0.0
        return True
    if stage.judged == EXACT:
        return False
    tolerance = stage.tolerance if stage.judged == FLIP_AWARE else default_tolerance
    if tolerance <= 0:
        return False
    allowance = {f"compress/residual/{t['name']}": (int(t.get("out", 0)), float(t.get("jump", 0.0)))
                 for t in (stage.compare or {}).get("tensors", []) if stage.judged == FLIP_AWARE}
    problem, rel = _state_difference(published, left, allowance)
    stage.state_rel_l2 = rel
    return not problem and rel <= tolerance


def _fresh_weights(store: Any, nxt: Manifest, stage: int, start: bytes) -> bool:
    """Whether a start state's weights are the committed shard the step builds on (a
    fresh start: a resume, or a replica back in the set)."""
    from trainer.artifacts import param_tensors, same_tensors

    if nxt.parent is None:
        return False
    parent = get_manifest(store, nxt.parent)
    return same_tensors(param_tensors(start), param_tensors(read_bytes(store, parent.stages[stage])))


def _state_difference(a: bytes, b: bytes, allowance: dict[str, tuple[int, float]]) -> tuple[str, float]:
    """Two round states: (why they cannot be one state, "" if they may; the relative L2 of
    their float tensors' difference). Integer tensors must be equal; `allowance`: per
    tensor, how many values may move by at most how much (a compressor residual where the
    payload's codes flipped), left out of the relative L2."""
    from trainer.artifacts import bytes_to_tensors

    x, y = bytes_to_tensors(a), bytes_to_tensors(b)
    if x.keys() != y.keys():
        return "they hold different tensors", math.inf
    diff = norm = 0.0
    for k in x:
        if x[k].shape != y[k].shape or x[k].dtype != y[k].dtype:
            return f"{k} differs in shape or type", math.inf
        if not x[k].is_floating_point():
            if not bool((x[k] == y[k]).all()):
                return f"{k} differs", math.inf
            continue
        d = (x[k].double() - y[k].double()).reshape(-1)
        count, jump = allowance.get(k, (0, 0.0))
        if count and d.numel():
            top = d.abs().topk(min(count, d.numel()))
            if bool((top.values > jump * 1.01).any()):
                return f"{k} moved by more than the payload's flips explain", math.inf
            d[top.indices] = 0.0
        diff += float(d.pow(2).sum())
        norm += float(y[k].double().pow(2).sum())
    if diff == 0:
        return "", 0.0
    return "", math.sqrt(diff / norm) if norm > 0 else math.inf
