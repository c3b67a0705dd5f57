"""Audit a run from the chain and the content-addressed store alone.

    dlx verify --run-dir runs/tiny-... [--json]

Levels, per committed step (DESIGN.md section 7):

1. chain: steps are contiguous and each step's parent is the previous checkpoint (the
   genesis for step 1); the attestations cover exactly the step's replica set (from
   `StepCommitted`; every replica on ledgers before version 3) x its stages, each signed
   over that set, and the manifest names the same set (`replicas`; absent: all R); every
   attestation's signature, taken from the `commitStep` transaction itself, recovers to
   the node the ledger recorded, a member of the run with stake at that block; the
   contributions root matches the attested digests; from ledger version 2 on, the present
   replicas of each stage co-signed one new shard digest, the step's shards root hashes
   them, and the manifest's stage links are exactly those (version 1 runs, committed before
   co-signed shards, are checked under their own typed data).
2. content: the manifest, its stage shards, every contribution and every round-start
   state are present and hash to their CIDs (a start state stored by reference to a
   committed shard, lineage/store/roundstate.py: its node and files do, its shard is step
   t-1's or t-2's of its stage, and the state rebuilt from them has the node's digest);
   the manifest agrees with the chain (step, parent, run, config, metrics digest, each
   slot's contribution digest and data-shard hash).
3. aggregate: applying the outer step to the parent shards with the published
   contributions of exactly the step's replicas (ascending id) reproduces every new shard
   bit for bit.
   data: the dataset, tokenizer and token file the run's config names are in the store
   and hash to their CIDs, and each (step, replica id) shard re-derived from the token file
   has the attested `dataShard` digest (lineage/store/datasets.py); with `data_full`, the stored
   dataset re-tokenized with the recorded tokenizer gives the token file's CID again.
4. replay (`replay` > 0, a fraction of the (step, present replica) pairs, sampled
   deterministically from the head's CID, at least one): re-running the replica's inner steps from its
   published start state reproduces its contributions (lineage/audit/replay.py: judged by the
   run's numerics: a portable run bit for bit anywhere; a native one bit for bit where the
   replaying kernels' fingerprint is the trainer's, else by the flip-aware comparison within a
   calibrated tolerance, unless `tolerance` says otherwise), its start weights are a committed
   checkpoint's, and the state its round leaves is the next round's start state. The report's
   `kernels` names the fingerprints on both sides and how the replays were judged.

Retention (`[storage] keep`, lineage/store/retention.py) may have removed round-start states and
superseded shards. Such a file, gone where the run's policy (or the store's record of a
`dlx cas gc --keep`) allows it, is not a failure: level 2 checks what is kept, level 3
recomputes a removed shard forward from the last kept one (the genesis at worst) and checks
it against the CID its manifest names, and a replay that lacks its inputs is reported as
not possible (`StepReport.unavailable`). A file an open challenge window needs, or one the
policy keeps, is still a failure when gone.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lineage.chain.attest import (
    ContributionClaim,
    Domain,
    contributions_root,
    shards_root,
)
from lineage.chain.ledger import Attestation, CommitCall, StepRecord
from lineage.chain.runrecord import RunRecord
from lineage.errors import DlxError
from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_CBOR, block_name, cid_from_digest, digest_of
from lineage.store.manifest import Manifest, get_manifest
from lineage.store.roundstate import check_round_state, is_reference, reference_shards
from lineage.store.runconfig import RunConfig
from lineage.store.unixfs import check_file, file_cid, read_bytes
from trainer.errors import ConfigError

DATA = "data"
LEVELS = ("chain", "content", "aggregate", DATA)
REPLAY = "replay"  # level 4, sampled: verify_run(..., replay=FRACTION)

#: (store, [(checkpoint CID, replica)], tolerance) -> results; lineage.audit.replay.replay_many by
#: default, or a stand-in that runs the same replays elsewhere (a verify queue). The tolerance
#: is None for the automatic choice; the results are judged again here either way.
Replayer = Callable[[Any, list[tuple[str, int]], Any], list[Any]]


@dataclass
class StepReport:
    step: int
    checkpoint: str
    failures: dict[str, str] = field(default_factory=dict)  # level -> first reason
    passed: list[str] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # level -> why the kept blocks do not allow it

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "ok": self.ok,
                "passed": self.passed, "failures": self.failures, "unavailable": self.unavailable}


@dataclass
class RunReport:
    run_id: int
    steps: list[StepReport]
    run_failures: list[str] = field(default_factory=list)
    replay: list[Any] = field(default_factory=list)  # lineage.audit.replay.ReplicaReplay, sampled pairs
    replay_seconds: float = 0.0  # wall time of all replays, process start-up included
    kernels: dict[str, Any] = field(default_factory=dict)  # lineage.audit.replay.kernels_summary of the replays

    @property
    def ok(self) -> bool:
        return not self.run_failures and all(s.ok for s in self.steps)

    def as_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "ok": self.ok, "run_failures": self.run_failures,
                "steps": [s.as_json() for s in self.steps],
                "replay": [r.as_json() for r in self.replay], "replay_seconds": self.replay_seconds,
                "kernels": self.kernels}


class _Fail(Exception):
    pass


def _check(cond: bool, reason: str | Callable[..., str]) -> None:
    """Fail with `reason`; pass a lambda where it names a CID: multiformats takes about a
    millisecond to print one, and an honest run never shows the message. The lambda is
    called with no arguments (`...`: its defaults bind a loop's current values)."""
    if not cond:
        raise _Fail(reason if isinstance(reason, str) else reason())


def verify_run(run_dir: Path, rpc: str | None = None, levels: tuple[str, ...] = LEVELS,
               replay: float = 0.0, tolerance: float | None = None, replayer: Replayer | None = None,
               data_full: bool = False, store: Any = None) -> RunReport:
    """Audit a run (levels above); `replay` is the fraction of (step, replica) pairs to
    replay, `tolerance` the relative tolerance a native run's replay is judged within (0:
    bit for bit; None: automatic, lineage/audit/replay.py; a portable run is bit for bit
    whatever it says); `data_full` also re-tokenizes the dataset (a run-level check);
    `store` the blocks to read (None: the run's own, `RunRecord.open_store`)."""
    if not 0.0 <= replay <= 1.0 or math.isnan(replay):
        raise ConfigError(f"--replay must be a fraction between 0 and 1 (got {replay:g})")
    if tolerance is not None and not 0.0 <= tolerance < math.inf:
        raise ConfigError(f"--tolerance must be a finite number >= 0 (got {tolerance:g})")
    record = RunRecord.load(run_dir)
    store = record.open_store(run_dir) if store is None else store
    with record.open_ledger(run_dir, rpc) as ledger:
        created = ledger.run_created(record.run_id)
        steps = ledger.steps(record.run_id)
        facts: ChainFacts | None = None
        calldata: list[CommitCall] = []
        if "chain" in levels:  # batched: a few requests for the whole run, not a few per step
            calls = ledger.commit_calls(steps)
            calldata = [calls[s.tx] for s in steps]
            facts = ChainFacts(ledger.domain, record.run_id, set(created.nodes),
                               ledger.registry.stakes_at((a["node"], s.block) for s in steps for a in s.attestations),
                               created.replicas, created.stages, created.min_replicas)
        checkpoints = [cid_from_digest(rec.checkpoint, DAG_CBOR) for rec in steps]
        pruned = _pruned(store, run_dir, checkpoints[-1] if steps else None, ledger, record.run_id)
    genesis = cid_from_digest(created.genesis_digest, DAG_CBOR)
    config = cid_from_digest(created.config_digest, DAG_CBOR)
    no_outer = _no_outer_step(store, config)
    work = _Work(store, steps, [genesis, *checkpoints], record.run_id, config, created.replicas, created.stages,
                 tuple(lv for lv in levels if lv not in ("chain", DATA) and not (no_outer and lv == "aggregate")),
                 pruned.blocks)
    with _levels_2_3_started(work) as results:  # in worker processes, while level 1 runs here
        chain = _level_1(work, calldata, facts) if facts is not None else []
    data = _verify_data(store, work.config, steps, data_full) if DATA in levels or data_full else _Data()
    report = RunReport(record.run_id, [], run_failures=list(data.run_failures))
    if not steps:  # nothing to vouch for: a run that committed no step is not "verified"
        report.run_failures.append(f"no committed steps (run.json status: {record.status})")
    for i, rec in enumerate(steps):
        sr = StepReport(rec.step, str(checkpoints[i]), unavailable=dict(pruned.unavailable.get(rec.step, {})))
        for level in levels:
            if level == DATA and data.unavailable:
                sr.unavailable[DATA] = data.unavailable
                continue
            if level == "aggregate" and no_outer:
                sr.unavailable[level] = no_outer
                continue
            failure = chain[i] if level == "chain" else data.failures.get(rec.step) if level == DATA \
                else results[i][level]
            if failure is None:
                sr.passed.append(level)
            else:
                sr.failures[level] = failure
        report.steps.append(sr)
    # A writer killed between a commit and run.json's update leaves it one step behind the chain.
    lagging = record.status != "completed" and record.head == str([genesis, *checkpoints][-2]) if steps else False
    if record.head and steps and str(checkpoints[-1]) != record.head and not lagging:
        report.run_failures.append(f"run.json head {record.head} is not the chain's head at step {steps[-1].step}")
    if replay > 0 and steps:
        _verify_replay(store, report, steps, work.R, replay, tolerance, replayer, pruned.starts_gone)
    return report


def _level_1(work: _Work, calls: list[CommitCall], facts: ChainFacts) -> list[str | None]:
    """Level 1 of every step (its commit `calls[i]`, checked against `facts`): None where
    it passed, else the first reason."""
    out: list[str | None] = []
    for i, rec in enumerate(work.steps):
        try:
            verify_commit(rec, i + 1, work.checkpoints[i], calls[i], facts)
            manifest = _manifest_or_none(work.store, work.checkpoints[i + 1])
            _verify_manifest_set(rec, manifest, work.R)
            if facts.domain.version != "1":  # co-signed shards exist from ledger version 2 on
                _verify_cosigned(rec, manifest, calls[i].attestations, work.S)
            out.append(None)
        except (_Fail, DlxError) as exc:
            out.append(str(exc))
    return out


def _manifest_or_none(store: Blockstore, checkpoint: Any) -> Manifest | None:
    """The step's manifest for level 1's comparisons; None when it cannot be read (the
    content level names the block)."""
    try:
        return get_manifest(store, checkpoint)
    except DlxError:
        return None


@dataclass
class _Data:
    """The data level's findings: step -> first failure; or why it cannot be checked."""

    failures: dict[int, str] = field(default_factory=dict)
    unavailable: str | None = None
    run_failures: list[str] = field(default_factory=list)  # --data-full's


def _verify_data(store: Any, config: Any, steps: list[StepRecord], full: bool) -> _Data:
    """The data level of every step, and with `full` the re-tokenization (lineage.store.datasets)."""
    from lineage.store.datasets import (
        check_shards,
        check_stored,
        check_tokenization,
        fetch_prepared,
    )

    try:
        run_config = RunConfig.load(store, config)
    except DlxError as exc:
        return _Data({s.step: f"config {config}: {exc}" for s in steps})
    record = run_config.data
    if record is None:
        return _Data(unavailable="the run predates recorded data: its config names no token file")
    job = run_config.training_job()
    problems = check_stored(store, record)
    if problems:
        return _Data({s.step: problems[0] for s in steps}, run_failures=problems if full else [])
    prepared = fetch_prepared(store, record)
    attested = [(s.step, int(a["replica"]), bytes(a["dataShard"])) for s in steps for a in s.attestations]
    return _Data(check_shards(prepared, job, attested),
                 run_failures=check_tokenization(store, record, job) if full else [])


@dataclass(frozen=True)
class _Pruned:
    """What retention removed from a run, as far as its policy allows."""

    blocks: frozenset[str] = frozenset()  # names of the removed start-state and shard files
    unavailable: dict[int, dict[str, str]] = field(default_factory=dict)  # step -> level -> why not
    starts_gone: frozenset[int] = frozenset()  # steps whose start states are gone


def _pruned(store: Any, run_dir: Path, head: Any, ledger: Any, run_id: int) -> _Pruned:
    """The start-state and shard files retention removed and was allowed to, and per step
    the levels that leaves impossible, with why."""
    from lineage.store.retention import ALL, allowed_missing, history, open_steps, run_policy

    policy = run_policy(run_dir)
    if head is None or (policy == ALL and not (store.pruned() if hasattr(store, "pruned") else set())):
        return _Pruned()
    try:
        hist = history(store, head)
    except DlxError:  # a manifest is missing: level 2 says which
        return _Pruned()
    allowed = allowed_missing(store, hist, policy, open_steps(ledger, run_id, hist[-1].step))
    gone = frozenset(name for name in allowed if not store.has(name))
    if not gone:
        return _Pruned()
    from .replay import job_of

    sync = job_of(store, hist[-1].config, with_data=False).outer.rule == "sync"

    def lost(cids: Any) -> bool:
        return any(block_name(c)[0] in gone for c in cids)

    unavailable: dict[int, dict[str, str]] = {}
    for m in hist[1:]:
        parent = hist[m.step - 1]
        needs = [("start state pruned", [c for row in m.replay for c in row]),
                 (f"step {parent.step}'s shards pruned", parent.stages)]
        if not sync and parent.step > 0:  # the overlapped rules derive start weights from two steps back
            needs += [(f"step {parent.step}'s start state pruned", [c for row in parent.replay for c in row]),
                      (f"step {parent.step - 1}'s shards pruned", hist[parent.step - 1].stages)]
        why = next((what for what, cids in needs if lost(cids)), None)
        if m.replay and why:
            unavailable[m.step] = {REPLAY: f"not possible: {why}"}
    return _Pruned(gone, unavailable, frozenset(m.step for m in hist[1:] if lost(c for row in m.replay for c in row)))


@dataclass
class _Work:
    """What levels 2 and 3 need, for every step; `checkpoints[i]` is step i's (0: genesis)."""

    store: Blockstore
    steps: list[StepRecord]
    checkpoints: list[Any]
    run_id: int
    config: Any
    R: int
    S: int
    levels: tuple[str, ...]  # of "content", "aggregate", in the caller's order
    pruned: frozenset[str] = frozenset()  # block names of files retention removed (allowed)


_WORK: _Work | None = None  # the forked workers' copy (fork shares it; nothing is pickled)

#: Steps per process below which levels 2 and 3 stay in this process.
MIN_STEPS_PER_WORKER = 8


@contextmanager
def _levels_2_3_started(work: _Work) -> Iterator[list[dict[str, str | None]]]:
    """Levels 2 and 3 of every step, as a list of {level: None (passed) or the first
    reason} that is filled in when the `with` body ends.

    Both are CPU-bound (re-hashing some 30 MB a step, recomputing the outer step), so the
    steps are cut into contiguous ranges checked by forked processes, one a core (threads
    would share one interpreter lock with the checks themselves), while the body runs
    here. A range's first step reads its parent's shards from the store; every later one
    takes them from the step before, already checked equal to the recomputation. torch is
    imported before the fork, so each worker starts with level 3's math loaded."""
    global _WORK
    n = len(work.steps)
    results: list[dict[str, str | None]] = [{} for _ in range(n)]
    procs = min(os.cpu_count() or 1, n // MIN_STEPS_PER_WORKER, 16)
    if not work.levels or not n:
        yield results
        return
    if "aggregate" in work.levels:
        _import_outer_math()
    if procs <= 1 or not isinstance(work.store, Blockstore) or "fork" not in multiprocessing.get_all_start_methods():
        # one process: a short run, one core, or an IPFS daemon's HTTP client (whose
        # pooled connections a fork would share between processes)
        yield results
        results[:] = _levels_2_3(work, 0, n)
        return
    bounds = [n * k // procs for k in range(procs + 1)]
    _WORK = work
    try:
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            pending = pool.starmap_async(_forked_levels_2_3, zip(bounds, bounds[1:], strict=False))
            yield results
            results[:] = [result for part in pending.get() for result in part]
    finally:
        _WORK = None


def _forked_levels_2_3(lo: int, hi: int) -> list[dict[str, str | None]]:
    assert _WORK is not None, "levels 2 and 3 run in a forked worker"
    return _levels_2_3(_WORK, lo, hi)


def _levels_2_3(work: _Work, lo: int, hi: int) -> list[dict[str, str | None]]:
    out = []
    outer_cfg = None
    prev_shards = None  # the parent's stage shards, once read
    parent: dict[str, bytes] = {}  # the same, by block name, when the step before was checked here
    for i in range(lo, hi):
        rec, checkpoint, prev = work.steps[i], work.checkpoints[i + 1], work.checkpoints[i]
        result: dict[str, str | None] = {}
        manifest = shards = None
        read: dict[str, bytes] = {}  # level 2's reads of what level 3 recomputes with
        for level in work.levels:
            try:
                if manifest is None:
                    manifest = get_manifest(work.store, checkpoint)  # present, hashing to the on-chain digest
                if level == "content":
                    _verify_content(work, manifest, rec, prev, read if "aggregate" in work.levels else None, parent)
                elif level == "aggregate":
                    if outer_cfg is None:
                        outer_cfg = _outer_config(work.store, work.config)
                    if prev_shards is None:
                        prev_shards = _shards_of(work, i, outer_cfg)
                    shards = _verify_aggregate(work, manifest, prev_shards, outer_cfg, rec.replicas(work.R), read)
                result[level] = None
            except (_Fail, DlxError) as exc:
                result[level] = str(exc)
        out.append(result)
        prev_shards = shards  # None: the next step reads them, if it needs them
        parent = {block_name(c)[0]: b for c, b in zip(manifest.stages, shards, strict=True)} \
            if manifest is not None and shards is not None else {}
    return out


def _shards_of(work: _Work, i: int, outer_cfg: Any) -> list[bytes]:
    """The stage shards of checkpoint `i` (0: the genesis): read, or, where retention
    removed them, recomputed forward from the last checkpoint that kept its own (the genesis
    always does) with the published contributions; level 3 of each of those steps checks
    its recomputation against its manifest's CIDs."""
    from trainer.diloco import apply_outer_step

    def removed(m: Manifest) -> bool:
        return any(block_name(c)[0] in work.pruned for c in m.stages)

    j = i
    while j > 0 and removed(get_manifest(work.store, work.checkpoints[j])):
        j -= 1
    shards = [read_bytes(work.store, c, workers=0) for c in get_manifest(work.store, work.checkpoints[j]).stages]
    for k in range(j + 1, i + 1):
        m = get_manifest(work.store, work.checkpoints[k])
        shards = [apply_outer_step(shards[s], [read_bytes(work.store, row[s], workers=0) for row in m.contributions],
                                   outer_cfg, m.step) for s in range(work.S)]
    return shards


def sample_pairs(steps: list[int], replicas: int | dict[int, tuple[int, ...]], fraction: float,
                 seed: bytes) -> list[tuple[int, int]]:
    """A fraction of the (step, replica) pairs, at least one, chosen by a generator seeded
    with `seed` (the head's digest): anyone re-running the audit draws the same pairs, and
    nobody knows them before the head exists. `replicas`: the run's R (every step had every
    replica), or each step's present replica ids (an elastic run's partial steps)."""
    present = replicas if isinstance(replicas, dict) else {t: tuple(range(replicas)) for t in steps}
    pairs = [(t, r) for t in steps for r in present[t]]
    n = min(len(pairs), max(1, math.ceil(fraction * len(pairs) - 1e-9)))
    rng = random.Random(int.from_bytes(hashlib.sha256(b"dlx-replay:" + seed).digest()[:8], "big"))
    return sorted(rng.sample(pairs, n))


def _verify_replay(store: Blockstore, report: RunReport, steps: list[StepRecord], R: int, fraction: float,
                   tolerance: float | None, replayer: Replayer | None,
                   starts_gone: frozenset[int] = frozenset()) -> None:
    """Level 4 on a sample of the steps whose kept blocks allow it; `starts_gone`: steps
    whose start states retention removed (no continuity check against them)."""
    from .replay import apply_judging, check_continuity, kernels_summary, replay_many

    checkpoints = {rec.step: str(cid_from_digest(rec.checkpoint, DAG_CBOR)) for rec in steps}
    blocked = {sr.step for sr in report.steps if REPLAY in sr.unavailable}
    possible = sorted(set(checkpoints) - blocked)
    if not possible:
        return
    chosen = sample_pairs(possible, {rec.step: rec.replicas(R) for rec in steps}, fraction, steps[-1].checkpoint)
    started = time.perf_counter()
    results = (replayer or replay_many)(store, [(checkpoints[t], r) for t, r in chosen], tolerance)
    for result in results:
        apply_judging(result, tolerance)  # the same judging wherever the replay ran
    for result in results:
        if result.ok and result.step + 1 in checkpoints and result.step + 1 not in starts_gone:
            try:
                check_continuity(store, result, checkpoints[result.step + 1])
            except DlxError as exc:
                result.error = f"next step's start state: {exc}"
    report.replay_seconds = time.perf_counter() - started
    report.replay = results
    report.kernels = kernels_summary(results, tolerance)
    by_step: dict[int, list[Any]] = {}
    for (t, _), result in zip(chosen, results, strict=True):
        by_step.setdefault(t, []).append(result)
    for sr in report.steps:
        if sr.step not in by_step:
            continue
        failed = [r.failure() for r in by_step[sr.step] if not r.ok]
        if failed:
            sr.failures[REPLAY] = "; ".join(failed)
        else:
            sr.passed.append(REPLAY)


@dataclass(frozen=True)
class ChainFacts:
    """What level 1 checks each step's commit against: the deployment's typed-data domain,
    the run (id, members, shape, `min_replicas`) and every signer's stake at its commit's
    block (`Registry.stakes_at`)."""

    domain: Domain
    run_id: int
    members: set[str]
    stakes: dict[tuple[str, int], int]
    R: int
    S: int
    min_replicas: int = 1


def verify_commit(rec: StepRecord, expected_step: int, prev: Any, call: CommitCall, run: ChainFacts) -> None:
    """Level 1 of one step: it follows `prev` (the previous checkpoint) as step
    `expected_step`, and its commit `call` carries one valid signature per slot of its
    replica set, each by a staked member, over the contributions its root hashes; raises
    the first reason it does not."""
    _check(rec.step == expected_step, f"step {rec.step} follows step {expected_step - 1}")
    _check(rec.parent == digest_of(prev), lambda: f"parent is not the previous checkpoint {prev}")
    S = run.S
    replicas = _chain_set(rec, call, run.R, run.min_replicas)
    atts, slots = call.attestations, len(replicas) * S
    _check(len(atts) == slots, f"{len(atts)} attestations for {slots} slots ({_ids(replicas)} x {S} stages)")
    _check(len(rec.attestations) == slots, f"{len(rec.attestations)} attestation events for {slots} slots")
    events = sorted(rec.attestations, key=lambda a: (a["replica"], a["stage"]))
    for slot, (att, event) in enumerate(zip(atts, events, strict=True)):
        replica, stage = att.replica, att.stage
        _check((replica, stage) == (replicas[slot // S], slot % S), f"attestation {slot} is for slot ({replica}, {stage})")
        if rec.replica_set is not None:
            _check(att.replica_set == rec.replica_set, f"slot ({replica}, {stage}): signed over replica set "
                                                       f"{att.replica_set:#x}, not the step's")
        claim = ContributionClaim(run.run_id, rec.step, replica, stage, rec.parent, att.contribution,
                                  att.data_shard, att.code_hash, att.loss_micros, att.new_shard, rec.replica_set or 0)
        try:
            signer = claim.recover(run.domain, att.signature)
        except Exception:  # eth_keys raises several types for malformed signatures
            raise _Fail(f"slot ({replica}, {stage}): malformed signature") from None
        _check(signer == event["node"], f"slot ({replica}, {stage}): signature recovers to {signer}, "
                                        f"the ledger recorded {event['node']}")
        _check(signer in run.members, f"slot ({replica}, {stage}): {signer} is not a member of the run")
        _check(run.stakes[(event["node"], rec.block)] > 0, f"slot ({replica}, {stage}): {signer} had no stake")
    root = contributions_root(a.contribution for a in atts)
    _check(root == rec.contributions_root, "contributions root does not match the attested contributions")


def _ids(replicas: tuple[int, ...] | list[int]) -> str:
    """Replica ids as a set reads in a report: `{0, 2}`."""
    return "{" + ", ".join(map(str, replicas)) + "}"


def _chain_set(rec: StepRecord, call: CommitCall, R: int, min_replicas: int) -> tuple[int, ...]:
    """The step's replica set as the chain records it (its event, and the commit's own
    argument from ledger version 3 on), checked against the run: ids below R, at least
    `min_replicas` of them. Ledgers before version 3 had every replica in every step."""
    if rec.replica_set is None:
        return rec.replicas(R)
    _check(call.replica_set == rec.replica_set, "the commit's replica set is not its event's")
    _check(rec.replica_set >> R == 0, f"replica set {rec.replica_set:#x} names a replica the run ({R}) lacks")
    replicas = rec.replicas(R)
    _check(len(replicas) >= min_replicas,
           f"replica set {_ids(replicas)} has fewer than the run's min_replicas ({min_replicas})")
    return replicas


def _verify_manifest_set(rec: StepRecord, manifest: Manifest | None, R: int) -> None:
    """Level 1: the manifest names the step's replica set as the chain records it (a
    manifest that cannot be read fails the content level, which names the block)."""
    if manifest is None:
        return
    chain, listed = rec.replicas(R), manifest.replica_ids(R)
    _check(listed == chain, f"the manifest's replicas {_ids(listed)} are not the chain's replica set {_ids(chain)}")


def _verify_cosigned(rec: StepRecord, manifest: Manifest | None, atts: tuple[Attestation, ...], S: int) -> None:
    """Level 1 from ledger version 2 on: every present replica of a stage co-signed one new
    shard digest, the step's shards root hashes them, and the manifest links exactly those
    shards (a coordinator can commit nothing but what the replicas computed). A manifest
    that cannot be read fails the content level, which names the block, not this one."""
    shards = [atts[s].new_shard for s in range(S)]  # the first present replica's
    first = atts[0].replica if atts else 0
    for att in atts:
        r, s = att.replica, att.stage
        _check(att.new_shard == shards[s], lambda r=r, s=s, att=att: (
            f"stage {s}: replica {r} co-signed shard 0x{att.new_shard.hex()[:16]}.., "
            f"replica {first} 0x{shards[s].hex()[:16]}.."))
    _check(rec.shards_root == shards_root(shards), "shards root does not match the co-signed shards")
    if manifest is None:  # missing or corrupt: the content level names the block
        return
    links = manifest.stages
    _check(len(links) == S, f"{len(links)} stage shards for {S} stages")
    for s, cid in enumerate(links):
        _check(digest_of(cid) == shards[s], lambda s=s, cid=cid: (
            f"stage {s}: the manifest links shard {cid}, not the one its replicas co-signed "
            f"(0x{shards[s].hex()[:16]}..)"))


def _verify_content(work: _Work, m: Manifest, rec: StepRecord, prev: Any, keep: dict[str, bytes] | None,
                    shards: dict[str, bytes] | None = None) -> None:
    """Level 2 of step `rec` (manifest `m`, parent checkpoint `prev`); with `keep`, the
    contributions' and shards' bytes are left there for level 3 (read once, hashed once), by
    block name (the CID: codec and digest). `shards`: the parent's shards, by block name,
    where level 3 has them already (a start state stored by reference rebuilds from them).
    Files in `work.pruned` (removed by retention, as allowed) are not looked for."""
    store, run_id, config, R, S, pruned = work.store, work.run_id, work.config, work.R, work.S, work.pruned

    def check(cid: Any) -> None:
        if pruned and block_name(cid)[0] in pruned:
            return
        if keep is None:
            check_file(store, cid, workers=0)
        else:
            keep[block_name(cid)[0]] = read_bytes(store, cid, workers=0)

    _check(m.step == rec.step, f"manifest says step {m.step}")
    _check(m.run == run_id, f"manifest says run {m.run}")
    _check(m.parent == prev, lambda: f"manifest parent {m.parent} is not {prev}")
    _check(m.config == config, lambda: f"manifest config {m.config} is not the run's {config}")
    _check(m.metrics_digest() == rec.metrics_digest, "metrics do not match the on-chain metrics digest")
    _check(len(m.stages) == S, f"{len(m.stages)} stage shards for {S} stages")
    replicas = rec.replicas(R)
    _check(m.replica_ids(R) == replicas, lambda: f"the manifest's replicas {_ids(m.replica_ids(R))} are not "
                                                 f"the chain's replica set {_ids(replicas)}")
    _check(len(m.contributions) == len(replicas) and all(len(row) == S for row in m.contributions)
           and len(m.data) == len(replicas), "contributions table is not the step's replicas x stages")
    by_slot = {(a["replica"], a["stage"]): a for a in rec.attestations}
    for row, r in enumerate(replicas):
        for s in range(S):
            cid = m.contributions[row][s]
            att = by_slot.get((r, s))
            _check(att is not None, f"slot ({r}, {s}): no attestation on the chain")
            assert att is not None
            _check(digest_of(cid) == bytes(att["contribution"]),
                   lambda cid=cid, r=r, s=s: f"slot ({r}, {s}): manifest contribution {cid} is not the attested one")
            _check(m.data[row] == bytes(att["dataShard"]), f"slot ({r}, {s}): data shard differs from the attested one")
            check(cid)  # every block present and hashing to its CID
    if m.replay:  # the round-start states replay verification starts from
        _check(len(m.replay) == len(replicas) and all(len(row) == S for row in m.replay),
               "start-state table is not the step's replicas x stages")
        manifests: dict[str, Manifest] = {}
        for starts in m.replay:
            for s, cid in enumerate(starts):
                if block_name(cid)[0] in pruned:
                    continue
                if is_reference(cid):  # rebuilt from the shard it names, one it may start from
                    check_round_state(store, cid, shards=reference_shards(store, m.parent, s, manifests),
                                      known=shards, workers=0)
                else:
                    check_file(store, cid, workers=0)
    for cid in m.stages:
        check(cid)


def _no_outer_step(store: Blockstore, config: Any) -> str:
    """Why level 3 does not apply to the run (the AllReduce baseline), or "" where it does."""
    try:
        baseline = RunConfig.load(store, config).sync == "allreduce"
    except (DlxError, KeyError, TypeError, AttributeError):
        return ""  # an unreadable config: level 2 names it
    return "the AllReduce baseline has no outer step to recompute (its shards are the all-reduced weights)" \
        if baseline else ""


def _outer_config(store: Blockstore, config: Any) -> Any:
    return RunConfig.load(store, config).training_job().outer


def _import_outer_math() -> None:
    import torch

    import trainer.diloco  # noqa: F401  (level 3 re-derives with the trainer's own math)

    # One thread, as the trainer's ranks run: at shard sizes more threads only contend
    # (ten times slower on two busy cores), and the elementwise outer step is the same.
    # Set before any worker forks: a fork must not inherit a started OpenMP pool.
    torch.set_num_threads(1)


def _verify_aggregate(work: _Work, m: Manifest, parent_shards: list[bytes], outer_cfg: Any,
                      replicas: tuple[int, ...], read: dict[str, bytes]) -> list[bytes]:
    """Recompute each stage's new shard over exactly the step's `replicas` (the chain's
    set; the manifest's rows, ascending id); returns the stored (equal) shards, the next
    step's parents. `read`: files level 2 has read already, by block name. A shard in
    `work.pruned` (removed by retention) is checked by its CID instead: the recomputed
    bytes must import to the file the manifest names."""
    from trainer.diloco import apply_outer_step

    store, R, S, pruned = work.store, work.R, work.S, work.pruned

    def get(cid: Any) -> bytes:
        data = read.get(block_name(cid)[0])
        return data if data is not None else read_bytes(store, cid, workers=0)

    _check(len(m.stages) == S and len(parent_shards) == S, f"{len(m.stages)} stage shards for {S} stages")
    _check(m.replica_ids(R) == replicas,
           lambda: f"the manifest's replicas {_ids(m.replica_ids(R))} are not the chain's replica set {_ids(replicas)}")
    _check(len(m.contributions) == len(replicas) and all(len(row) == S for row in m.contributions),
           "contributions table is not the step's replicas x stages")
    shards = []
    for s in range(S):
        contributions = [get(m.contributions[row][s]) for row in range(len(replicas))]
        expected = apply_outer_step(parent_shards[s], contributions, outer_cfg, m.step)
        if pruned and block_name(m.stages[s])[0] in pruned:
            _check(file_cid(expected) == m.stages[s],
                   lambda s=s: f"stage {s}: recomputed shard is not {m.stages[s]} (removed by retention)")
            shards.append(expected)
            continue
        stored = get(m.stages[s])
        _check(expected == stored, lambda s=s: f"stage {s}: recomputed shard differs from {m.stages[s]}")
        shards.append(stored)
    return shards
