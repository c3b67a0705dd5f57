"""Audit a run from the chain and the content-addressed store alone.

    dlx verify --run-dir runs/tiny-... [--json]

Levels, per committed step (DESIGN.md section 7):

1. chain: steps are contiguous and each step's parent is the previous checkpoint (the
   genesis for step 1); every attestation's signature, taken from the `commitStep`
   transaction itself, recovers to the node the ledger recorded, a member of the run
   with stake at that block; the contributions root matches the attested digests.
2. content: the manifest, its stage shards, every contribution and every round-start
   state are present and hash to their CIDs; the manifest agrees with the chain (step,
   parent, run, config, metrics digest, each slot's contribution digest and data-shard hash).
3. aggregate: applying the outer step to the parent shards with the published
   contributions reproduces every new shard bit for bit.
4. replay (`replay` > 0, a fraction of the (step, replica) pairs, sampled deterministically
   from the head's CID, at least one): re-running the replica's inner steps from its
   published start state reproduces its contributions (lineage/replay.py: exact on the
   machine class that trained, else within `tolerance` relative L2), its start weights are
   a committed checkpoint's, and the state its round leaves is the next round's start state.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dag_cbor
from eth_utils import keccak

from trainer.errors import ConfigError

from .attest import ContributionClaim, Domain
from .blockstore import Blockstore, CachedReader
from .chain import StepRecord
from .cid import DAG_CBOR, cid_from_digest, digest_of
from .errors import DlxError
from .manifest import Manifest, get_manifest
from .query import open_ledger
from .runrecord import RunRecord
from .unixfs import check_file

LEVELS = ("chain", "content", "aggregate")
REPLAY = "replay"  # level 4, sampled: verify_run(..., replay=FRACTION)

#: (store, [(checkpoint CID, replica)], tolerance) -> results; lineage.replay.replay_many by
#: default, or a stand-in that runs the same replays elsewhere (a verify queue).
Replayer = Callable[[Any, list[tuple[str, int]], float], list[Any]]


@dataclass
class StepReport:
    step: int
    checkpoint: str
    failures: dict[str, str] = field(default_factory=dict)  # level -> first reason
    passed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "checkpoint": self.checkpoint, "ok": self.ok,
                "passed": self.passed, "failures": self.failures}


@dataclass
class RunReport:
    run_id: int
    steps: list[StepReport]
    run_failures: list[str] = field(default_factory=list)
    replay: list[Any] = field(default_factory=list)  # lineage.replay.ReplicaReplay, sampled pairs
    replay_seconds: float = 0.0  # wall time of all replays, process start-up included

    @property
    def ok(self) -> bool:
        return not self.run_failures and all(s.ok for s in self.steps)

    def as_json(self) -> dict[str, Any]:
        return {"run": self.run_id, "ok": self.ok, "run_failures": self.run_failures,
                "steps": [s.as_json() for s in self.steps],
                "replay": [r.as_json() for r in self.replay], "replay_seconds": self.replay_seconds}


class _Fail(Exception):
    pass


def _check(cond: bool, reason: str | Callable[[], str]) -> None:
    """Fail with `reason`; pass a lambda where it names a CID: multiformats takes about a
    millisecond to print one, and an honest run never shows the message."""
    if not cond:
        raise _Fail(reason if isinstance(reason, str) else reason())


def verify_run(run_dir: Path, rpc: str | None = None, levels: tuple[str, ...] = LEVELS,
               replay: float = 0.0, tolerance: float = 0.0, replayer: Replayer | None = None) -> RunReport:
    """Audit a run (levels above); `replay` is the fraction of (step, replica) pairs to
    replay, `tolerance` the relative L2 a replay may differ by (0: bit for bit)."""
    if not 0.0 <= replay <= 1.0 or math.isnan(replay):
        raise ConfigError(f"--replay must be a fraction between 0 and 1 (got {replay:g})")
    if not 0.0 <= tolerance < math.inf:
        raise ConfigError(f"--tolerance must be a finite number >= 0 (got {tolerance:g})")
    record = RunRecord.load(run_dir)
    store = CachedReader(record.open_store(run_dir))  # levels 2 and 3 read the shards: hash them once
    with open_ledger(run_dir, record, rpc) as ledger:
        created = ledger.run_created(record.run_id)
        steps = ledger.steps(record.run_id)
        calldata: dict[int, dict[str, Any]] = {}
        stakes: dict[tuple[str, int], int] = {}
        if "chain" in levels:  # batched: a few requests for the whole run, not a few per step
            calls = ledger.commit_calls(steps)
            calldata = {s.step: calls[s.tx] for s in steps}
            stakes = ledger.stakes_at((a["node"], s.block) for s in steps for a in s.attestations)
        domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    report = RunReport(record.run_id, [])
    genesis = cid_from_digest(bytes(created["genesisDigest"]), DAG_CBOR)
    config_cid = cid_from_digest(bytes(created["configDigest"]), DAG_CBOR)
    members = set(created["nodes"])
    R, S = int(created["replicas"]), int(created["stages"])
    outer_cfg = None
    prev_checkpoint, prev_manifest = genesis, None
    for expected_step, rec in enumerate(steps, start=1):
        checkpoint = cid_from_digest(rec.checkpoint, DAG_CBOR)
        sr = StepReport(rec.step, str(checkpoint))
        manifest: Manifest | None = None
        for level in levels:
            try:
                if level == "chain":
                    _verify_chain(rec, expected_step, prev_checkpoint, calldata[rec.step], domain,
                                  record.run_id, members, stakes, R, S)
                elif level == "content":
                    manifest = _verify_content(store, rec, record.run_id, prev_checkpoint, config_cid, R, S)
                elif level == "aggregate":
                    if manifest is None:
                        manifest = get_manifest(store, checkpoint)
                    if prev_manifest is None:
                        prev_manifest = get_manifest(store, prev_checkpoint)
                    if outer_cfg is None:
                        outer_cfg = _outer_config(store, config_cid)
                    _verify_aggregate(store, prev_manifest, manifest, outer_cfg, R, S)
                sr.passed.append(level)
            except _Fail as exc:
                sr.failures[level] = str(exc)
            except DlxError as exc:
                sr.failures[level] = str(exc)
        report.steps.append(sr)
        prev_checkpoint = checkpoint
        prev_manifest = manifest  # None: the aggregate level loads it if it runs
    if record.head and steps and str(cid_from_digest(steps[-1].checkpoint, DAG_CBOR)) != record.head:
        report.run_failures.append(f"run.json head {record.head} is not the chain's head at step {steps[-1].step}")
    if replay > 0 and steps:
        _verify_replay(store, report, steps, R, replay, tolerance, replayer)
    return report


def sample_pairs(steps: list[int], replicas: int, fraction: float, seed: bytes) -> list[tuple[int, int]]:
    """A fraction of the (step, replica) pairs, at least one, chosen by a generator seeded
    with `seed` (the head's digest): anyone re-running the audit draws the same pairs, and
    nobody knows them before the head exists."""
    pairs = [(t, r) for t in steps for r in range(replicas)]
    n = min(len(pairs), max(1, math.ceil(fraction * len(pairs) - 1e-9)))
    rng = random.Random(int.from_bytes(hashlib.sha256(b"dlx-replay:" + seed).digest()[:8], "big"))
    return sorted(rng.sample(pairs, n))


def _verify_replay(store: Blockstore, report: RunReport, steps: list[StepRecord], R: int, fraction: float,
                   tolerance: float, replayer: Replayer | None) -> None:
    from .replay import check_continuity, replay_many

    checkpoints = {rec.step: str(cid_from_digest(rec.checkpoint, DAG_CBOR)) for rec in steps}
    chosen = sample_pairs(sorted(checkpoints), R, fraction, steps[-1].checkpoint)
    started = time.perf_counter()
    results = (replayer or replay_many)(store, [(checkpoints[t], r) for t, r in chosen], tolerance)
    for result in results:
        if result.ok and result.step + 1 in checkpoints:
            try:
                check_continuity(store, result, checkpoints[result.step + 1])
            except DlxError as exc:
                result.error = f"next step's start state: {exc}"
    report.replay_seconds = time.perf_counter() - started
    report.replay = results
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


def _verify_chain(rec: StepRecord, expected_step: int, prev: Any, args: dict[str, Any], domain: Domain,
                  run_id: int, members: set[str], stakes: dict, R: int, S: int) -> None:
    _check(rec.step == expected_step, f"step {rec.step} follows step {expected_step - 1}")
    _check(rec.parent == digest_of(prev), lambda: f"parent is not the previous checkpoint {prev}")
    atts = args["attestations"]
    _check(len(atts) == R * S, f"{len(atts)} attestations for {R * S} slots")
    _check(len(rec.attestations) == R * S, f"{len(rec.attestations)} attestation events for {R * S} slots")
    for slot, (att, event) in enumerate(zip(atts, sorted(rec.attestations, key=lambda a: (a["replica"], a["stage"])), strict=True)):
        replica, stage, contribution, data_shard, code, loss, signature = (
            att["replica"], att["stage"], att["contribution"], att["dataShard"], att["codeHash"],
            att["lossMicros"], att["signature"])
        _check((replica, stage) == divmod(slot, S), f"attestation {slot} is for slot ({replica}, {stage})")
        claim = ContributionClaim(run_id, rec.step, replica, stage, rec.parent, bytes(contribution),
                                  bytes(data_shard), bytes(code), int(loss))
        try:
            signer = claim.recover(domain, bytes(signature))
        except Exception:  # eth_keys raises several types for malformed signatures
            raise _Fail(f"slot ({replica}, {stage}): malformed signature") from None
        _check(signer == event["node"], f"slot ({replica}, {stage}): signature recovers to {signer}, "
                                        f"the ledger recorded {event['node']}")
        _check(signer in members, f"slot ({replica}, {stage}): {signer} is not a member of the run")
        _check(stakes[(event["node"], rec.block)] > 0, f"slot ({replica}, {stage}): {signer} had no stake")
    root = keccak(b"".join(bytes(a["contribution"]) for a in atts))
    _check(root == rec.contributions_root, "contributions root does not match the attested contributions")


def _verify_content(store: Blockstore, rec: StepRecord, run_id: int, prev: Any, config: Any,
                    R: int, S: int) -> Manifest:
    checkpoint = cid_from_digest(rec.checkpoint, DAG_CBOR)
    m = get_manifest(store, checkpoint)  # present and hashing to the on-chain digest
    _check(m.step == rec.step, f"manifest says step {m.step}")
    _check(m.run == run_id, f"manifest says run {m.run}")
    _check(m.parent == prev, lambda: f"manifest parent {m.parent} is not {prev}")
    _check(m.config == config, lambda: f"manifest config {m.config} is not the run's {config}")
    metrics = hashlib.sha256(dag_cbor.encode(m.to_node()["metrics"])).digest()
    _check(metrics == rec.metrics_digest, "metrics do not match the on-chain metrics digest")
    _check(len(m.stages) == S, f"{len(m.stages)} stage shards for {S} stages")
    _check(len(m.contributions) == R and all(len(row) == S for row in m.contributions),
           "contributions table is not replicas x stages")
    by_slot = {(a["replica"], a["stage"]): a for a in rec.attestations}
    for r in range(R):
        for s in range(S):
            cid = m.contributions[r][s]
            att = by_slot[(r, s)]
            _check(digest_of(cid) == bytes(att["contribution"]),
                   lambda cid=cid, r=r, s=s: f"slot ({r}, {s}): manifest contribution {cid} is not the attested one")
            _check(m.data[r] == bytes(att["dataShard"]), f"slot ({r}, {s}): data shard differs from the attested one")
            check_file(store, cid)
    if m.replay:  # the round-start states replay verification starts from
        _check(len(m.replay) == R and all(len(row) == S for row in m.replay),
               "start-state table is not replicas x stages")
        for row in m.replay:
            for cid in row:
                check_file(store, cid)
    for cid in m.stages:
        check_file(store, cid)
    return m


def _outer_config(store: Blockstore, config: Any) -> Any:
    import torch

    from trainer.config import JobConfig  # the verifier re-derives with the trainer's own math

    # One thread, as the trainer's ranks run: at shard sizes more threads only contend
    # (ten times slower on two busy cores), and the elementwise outer step is the same.
    torch.set_num_threads(1)
    job = dict(dag_cbor.decode(store.get(config))["job"])
    job.pop("chain", None)
    job.pop("storage", None)
    return JobConfig.model_validate(job).outer


def _verify_aggregate(store: Blockstore, parent: Manifest, m: Manifest, outer_cfg: Any, R: int, S: int) -> None:
    from trainer.diloco import apply_outer_step

    for s in range(S):
        parent_shard = read_file(store, parent.stages[s])
        contributions = [read_file(store, m.contributions[r][s]) for r in range(R)]
        expected = apply_outer_step(parent_shard, contributions, outer_cfg)
        _check(expected == read_file(store, m.stages[s]),
               lambda s=s: f"stage {s}: recomputed shard differs from {m.stages[s]}")


def read_file(store: Blockstore, cid: Any) -> bytes:
    """The bytes of a stored UnixFS file (shard or contribution), every block re-hashed."""
    from .unixfs import read_bytes

    return read_bytes(store, cid)
