"""The StepSink that turns each outer step into blocks, a manifest and a ledger commit.

For every step it stores the stage shards, the contributions and the ranks' round-start
states (what replay verification starts from) as UnixFS files (the CIDs
`ipfs add --cid-version=1` gives the same bytes: a raw block up to 256 KiB, a dag-pb root
above; a round-start state whose weights are a committed shard's, the parent's or under
the restart rule the one before, as a reference to that shard and a file of the rest of
the state: lineage/store/roundstate.py), links them in a DAG-CBOR manifest whose parent is
the previous checkpoint, has each (replica, stage) slot's node key sign an EIP-712
`Contribution` (with the digest of the new stage shard that slot's rank computed itself:
the replicas co-sign the aggregate), and commits the step on the ledger. An elastic run's
step may have only some replicas (`StepArtifacts.replicas`, at least `[parallel]
min_replicas`; empty: all R): its manifest then lists them (`replicas`), its rows and
claims are theirs in ascending id order, and every claim and the commit carry the step's
replica set.
`run.json` is rewritten only after the chain accepted the step, and the store's pin set for
the run (`<name>-<run id>`) then names the new head, so `dlx cas gc` keeps the whole run.
Every inner step's progress and every committed step's metrics also go to
`<run dir>/metrics.jsonl` and the job's trackers (workers/run/tracking.py). A NaN or infinite
loss or metric stops the run (`TrainingDiverged`) before anything of its step is stored.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Required, TypedDict, Unpack

from eth_account.signers.local import LocalAccount
from multiformats import CID

from lineage.chain.attest import (
    ContributionClaim,
    Domain,
    loss_micros,
    replica_bitmap,
    shard_digest,
)
from lineage.chain.commits import StepCommit, StepCommits, guard
from lineage.chain.ledger import Attestation, Ledger, RunSpec
from lineage.chain.rewards import finalize_due
from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import digest_of, parse_cid
from lineage.store.manifest import Manifest, get_manifest, put_config, put_manifest
from lineage.store.roundstate import param_digest, put_round_state, reference_shards
from lineage.store.unixfs import file_cid, import_bytes, read_bytes
from trainer.artifacts import GenesisArtifacts, Progress, StepArtifacts, code_hash
from trainer.config import JobConfig
from trainer.errors import TrainingDiverged, TrainingError

from .tracking import open_trackers

#: Wall-clock measurements: reported, but kept out of manifests (they are not reproducible).
TIMING_METRICS = frozenset({"wall_s", "compute_s", "rounds_wall_s", "compress_s", "comm_wait_s", "peak_rss_mb"})
TIMINGS_FILE = "timings.jsonl"

Signer = Callable[[int, list[ContributionClaim]], list[bytes]]


class CommitHooks:
    """Where a test-only extension changes what the coordinator commits: the tests'
    `dlx_testing.cheat.Cheats` (built from a job file's `[cheat]` tables) is injected in its place. These defaults are
    what an honest coordinator does, so an honest run's commit path holds no cheat branch."""

    def stored_shard(self, step: int, stage: int, data: bytes) -> bytes:
        """The stage shard bytes stored for `step`: the aggregate the ranks computed."""
        return data

    def stale_parent(self, step: int) -> bool:
        """Whether `step` is committed on an older parent than the head: never."""
        return False

    def signing_slot(self, step: int, slot: int) -> int:
        """Whose key signs `slot`'s claim at `step`: its own."""
        return slot


HONEST = CommitHooks()


def local_signer(keys: list[LocalAccount], domain: Domain, hooks: CommitHooks = HONEST,
                 stages: int | None = None) -> Signer:
    """Sign every slot's claim with that slot's key, held in this process (`dlx train`), or
    with the key `hooks.signing_slot` names (a test's shared_key cheat). `keys[r * S + s]`
    is slot (r, s)'s key: with `stages` (S) each claim is signed by its own (replica, stage)
    slot's key, as a partial step needs; without, claim i by key i (a full step's claims)."""

    def sign(step: int, claims: list[ContributionClaim]) -> list[bytes]:
        slots = [i if stages is None else c.replica * stages + c.stage for i, c in enumerate(claims)]
        return [c.sign(domain, keys[hooks.signing_slot(step, slot)].key) for slot, c in zip(slots, claims, strict=True)]

    return sign


def content_digest(data: bytes) -> bytes:
    """The on-chain digest of a contribution: its UnixFS file CID's sha-256 (nothing stored)."""
    return digest_of(file_cid(data))


class SinkOptions(TypedDict, total=False):
    """`LedgerSink`'s keyword options. Either `slot_keys` (one local key per slot: `dlx
    train`) or `slot_nodes` and a `signer` that obtains each slot's signature from its own
    node (the job queue)."""

    job: Required[JobConfig]
    config: Required[dict]  # the run-config document (lineage.store.runconfig.RunConfig.to_doc)
    store: Required[Blockstore]
    ledger: Required[Ledger]
    submitter: Required[LocalAccount]  # sends createRun and every commitStep
    record: Required[RunRecord]
    run_dir: Required[Path]
    challenge_window: Required[int]  # seconds; the run's `[chain]` terms from here on
    min_stake: Required[int]
    arbiters: list[str] | None
    quorum: int  # default 0
    independence: str  # the run's `[chain] independence` ("keys", the default, or "operators")
    slot_keys: list[LocalAccount] | None
    slot_nodes: list[str] | None
    signer: Signer | None
    on_progress: Callable[[Progress], None] | None
    on_committed: Callable[[int, CID, StepArtifacts], None] | None
    tracking: object | None  # the job file's `[tracking]` section (workers.run.jobfile.TrackingConfig)
    hooks: CommitHooks  # what is stored, committed on and signed (default HONEST; a test injects cheats)
    say: Callable[[str], None] | None  # one line per repaired reorganisation (default: stderr)
    max_pending: int | None  # steps that may wait to be committed before the ranks pause (None: no limit)


def _slot_signing(options: SinkOptions, domain: Domain, hooks: CommitHooks) -> tuple[list[str], Signer]:
    """Each slot's node and the signer of their claims, from `options`."""
    keys, nodes, signer = options.get("slot_keys"), options.get("slot_nodes"), options.get("signer")
    if keys is not None:
        nodes = [k.address for k in keys]
        signer = local_signer(keys, domain, hooks, options["job"].parallel.stages)
    if nodes is None or signer is None:
        raise ValueError("LedgerSink needs slot_keys, or slot_nodes and a signer")
    return nodes, signer


def _reward_terms(config: dict[str, Any]) -> dict[str, Any]:
    """The run's admission rule and reward terms (issue 35) from the recorded job file's
    `[chain]` section; a job file from before them makes a closed run without rewards."""
    job = config.get("job")
    chain = (job.get("chain") if isinstance(job, dict) else None) or {}
    return {"admission": chain.get("admission", "closed"),
            "reward_per_step": int(chain.get("reward_wei_per_step", 0)), "fund_wei": int(chain.get("fund_wei", 0))}


class LedgerSink:
    """Stores and commits each outer step; one node key per (replica, stage) slot."""

    #: What each rank co-signs for its new stage shard (trainer.artifacts.StepSink).
    shard_digest = staticmethod(shard_digest)

    def __init__(self, **options: Unpack[SinkOptions]) -> None:
        """The keyword options are `SinkOptions`'."""
        job, ledger, record, run_dir = options["job"], options["ledger"], options["record"], options["run_dir"]
        self.job = job
        self.hooks = options.get("hooks", HONEST)
        self.slot_nodes, self.signer = _slot_signing(options, ledger.domain, self.hooks)
        if len(self.slot_nodes) != job.world_size:
            raise ValueError(f"need {job.world_size} slot nodes, got {len(self.slot_nodes)}")
        self.config = options["config"]
        self.store = options["store"]
        self.ledger = ledger
        self.submitter = options["submitter"]
        self.record = record
        self.run_dir = run_dir
        self.challenge_window = options["challenge_window"]
        self.min_stake = options["min_stake"]
        self.arbiters, self.quorum = list(options.get("arbiters") or []), options.get("quorum", 0)
        self.independence = options.get("independence", "keys")
        self.code = code_hash()
        self._progress = options.get("on_progress")
        self.commits = StepCommits(ledger, self.submitter, options.get("say") or _say)
        #: Steps that may wait to be committed before the ranks pause (`[chain] max_pending`;
        #: trainer.launch reads it, as `shard_digest`).
        self.max_pending = options.get("max_pending")
        self._committed = options.get("on_committed")
        self._config_cid: CID | None = None
        self._head: CID | None = None
        self._head_genesis: CID | None = None  # the genesis manifest, while createRun is sent
        # the `param_digest` of the shards stored lately, by CID text: what round-start
        # states may refer to (a resumed run reads its last ones back once)
        self._weights: dict[str, bytes | None] = {}
        self.trackers = open_trackers(run_dir, options.get("tracking"), record.name, self.config.get("job", {}),
                                      {"dlx.run_dir": str(run_dir)})

    def resume_from(self, checkpoint: CID | str) -> None:
        """Continue the run recorded in `record` from a committed checkpoint."""
        manifest = get_manifest(self.store, checkpoint)
        if manifest.step > 0 and manifest.run != self.record.run_id:
            raise TrainingError(f"checkpoint {checkpoint} belongs to run {manifest.run}, not {self.record.run_id}")
        self._head = parse_cid(checkpoint)
        self._config_cid = manifest.config

    # -- StepSink --------------------------------------------------------------------------

    def on_genesis(self, genesis: GenesisArtifacts) -> None:
        with self.store.batch() as staged:  # on disk, synced once, before the ledger names them
            self._config_cid = put_config(staged, self.config)
            stages = [self._put_shard(staged, s.data) for s in genesis.stages]
            manifest = Manifest(step=0, parent=None, config=self._config_cid, stages=stages, code=self.code)
            head = put_manifest(staged, manifest)
        self._head_genesis = head
        nodes = list(dict.fromkeys(self.slot_nodes))
        before = guard(self.ledger.block_number, "eth_blockNumber")
        run_id = guard(lambda: self._create_run(nodes), "createRun")
        self._head = head
        r = self.record
        r.run_id, r.config, r.genesis, r.head, r.nodes, r.status = (
            run_id, str(self._config_cid), str(head), str(head), nodes, "running",
        )
        r.created_block = self._created_block(run_id, before)
        r.save(self.run_dir)
        self._pin(head)

    def _create_run(self, nodes: list[str]) -> int:
        head = self._head_genesis
        assert self._config_cid is not None and head is not None
        return int(self.ledger.create_run(self.submitter, RunSpec(
            config_digest=digest_of(self._config_cid),
            genesis_digest=digest_of(head),
            nodes=nodes,
            replicas=self.job.parallel.replicas,
            stages=self.job.parallel.stages,
            min_replicas=self.job.parallel.min_present,
            challenge_window=self.challenge_window,
            min_stake=self.min_stake,
            arbiters=self.arbiters,
            quorum=self.quorum,
            independence=self.independence,
            **_reward_terms(self.config),
        )))

    def _created_block(self, run_id: int, before: int) -> int:
        """The block the run's createRun was mined in (searched from `before`, the head
        when it was sent), where reads of its events start (`RunRecord.created_block`)."""
        return int(guard(lambda: self.ledger.created_block(run_id, before), "RunCreated"))

    def on_step(self, step: StepArtifacts) -> None:
        if self._head is None or self._config_cid is None:
            raise TrainingError("outer step reported before genesis")
        present = self._present(step)
        self._refuse_divergence(step)
        shards = [self.hooks.stored_shard(step.step, s.stage, s.data) for s in step.stages]
        parent_cid = self._head
        if self.hooks.stale_parent(step.step):
            parent_cid = get_manifest(self.store, self._head).parent or self._head
        with self.store.batch() as staged:  # on disk, synced once, before the ledger names them
            stages = [self._put_shard(staged, shard) for shard in shards]
            contribs = [_put_file(staged, c.data) for c in step.contributions]
            checkpoint, manifest = self._put_manifest(staged, step, present, stages, parent_cid, contribs)
        claims = self._claims(step, present, digest_of(parent_cid), contribs)
        if not self._already_committed(step.step, checkpoint):  # redelivery: nothing to do
            signatures = self.signer(step.step, claims)
            attestations = [
                Attestation(c.replica, c.stage, c.contribution, c.data_shard, c.code_hash, c.loss_micros, sig,
                            c.new_shard, c.replica_set)
                for c, sig in zip(claims, signatures, strict=True)
            ]
            self.commits.commit(StepCommit(
                run_id=self.record.run_id, step=step.step, parent=digest_of(parent_cid),
                checkpoint=digest_of(checkpoint), metrics_digest=manifest.metrics_digest(),
                attestations=attestations, replica_set=replica_bitmap(present),
            ))
        self._head = checkpoint
        if _reward_terms(self.config)["reward_per_step"]:
            # Nobody has to finalize by hand: each commit pays the steps whose window closed.
            guard(lambda: finalize_due(self.ledger, self.submitter, self.record.run_id), "finalizeSteps")
        timings = {k: v for k, v in step.metrics.items() if k in TIMING_METRICS}
        with open(self.run_dir / TIMINGS_FILE, "a") as fh:
            fh.write(json.dumps({"step": step.step, "checkpoint": str(checkpoint), **timings}) + "\n")
        self.record.head, self.record.steps = str(checkpoint), step.step
        self.record.save(self.run_dir)
        self._pin(checkpoint)
        for tracker in self.trackers:
            tracker.outer(step.step, str(checkpoint), step.metrics)
            if step.step == self.job.outer.steps:
                tracker.finish(True)
        if self._committed:
            self._committed(step.step, checkpoint, step)
        if step.step == self.job.outer.steps:
            self.finish()

    def finish(self) -> None:
        """At the end of a run: check that the chain's head is the last step committed,
        committing again what a reorganisation removed (`StepCommits.repair`)."""
        if self.record.run_id and self.record.steps:
            self.commits.repair(self.record.run_id, self.record.steps)

    def _present(self, step: StepArtifacts) -> tuple[int, ...]:
        """The replica ids `step` averages (all R when it names none), checked against the
        run's shape, `min_replicas` and the contributions' slot order."""
        R, S = self.job.parallel.replicas, self.job.parallel.stages
        present = tuple(step.replicas) or tuple(range(R))
        if list(present) != sorted(set(present)) or not 0 <= present[0] <= present[-1] < R:
            raise TrainingError(f"step {step.step}: replicas {list(present)} are not distinct ids below {R}, ascending")
        if len(present) < self.job.parallel.min_present:
            raise TrainingError(f"step {step.step}: {len(present)} replicas, fewer than min_replicas "
                                f"({self.job.parallel.min_present})")
        if len(step.contributions) != len(present) * S:
            raise TrainingError(f"step {step.step}: {len(step.contributions)} contributions for "
                                f"{len(present) * S} slots")
        for slot, c in enumerate(step.contributions):
            if (c.replica, c.stage) != (present[slot // S], slot % S):
                raise TrainingError(f"step {step.step}: contribution {slot} is for slot ({c.replica}, {c.stage}), "
                                    f"not ({present[slot // S]}, {slot % S})")
        return present

    def _put_manifest(self, store: Blockstore, step: StepArtifacts, present: tuple[int, ...], stages: list[CID],
                      parent: CID, contribs: list[CID]) -> tuple[CID, Manifest]:
        """Store the step's round-start states (for replay; none for the baseline) and its
        manifest, one row per present replica, in `store`; returns (its CID, the manifest)."""
        assert self._config_cid is not None
        S, n = self.job.parallel.stages, len(present)
        starts = []
        if all(c.start_state for c in step.contributions):
            manifests: dict[str, Manifest] = {}
            shards = [self._reference_shards(parent, s, manifests) for s in range(S)]
            starts = [self._put_start(store, c.start_state, shards[c.stage]) for c in step.contributions]
        self._forget_weights(stages, parent)
        # Timings differ between two runs of the same job; they go to a local log, not into
        # the manifest, so the same job and seed give the same checkpoint CIDs.
        manifest = Manifest(
            step=step.step,
            parent=parent,
            config=self._config_cid,
            stages=stages,
            code=self.code,
            run=self.record.run_id,
            contributions=[contribs[p * S:(p + 1) * S] for p in range(n)],
            data=[step.contributions[p * S].data_shard for p in range(n)],
            metrics={k: v for k, v in step.metrics.items() if k not in TIMING_METRICS},
            replay=[starts[p * S:(p + 1) * S] for p in range(n)] if starts else [],
            replicas=list(present) if n != self.job.parallel.replicas else [],
        )
        return put_manifest(store, manifest), manifest

    def _claims(self, step: StepArtifacts, present: tuple[int, ...], parent: bytes,
                contribs: list[CID]) -> list[ContributionClaim]:
        """One claim per present slot, in slot order, each over the step's replica set."""
        replica_set = replica_bitmap(present)
        claims = []
        for slot, (contrib, cid) in enumerate(zip(step.contributions, contribs, strict=True)):
            if len(contrib.new_shard) != 32:
                raise TrainingError(f"step {step.step}: slot {slot} computed no new shard digest "
                                    "(the ranks need RankControl.shard_digest)")
            claims.append(ContributionClaim(
                run_id=self.record.run_id, step=step.step, replica=contrib.replica,
                stage=contrib.stage, parent=parent, contribution=digest_of(cid),
                data_shard=contrib.data_shard, code_hash=self.code,
                loss_micros=loss_micros(contrib.loss), new_shard=contrib.new_shard,
                replica_set=replica_set,
            ))
        return claims

    def _refuse_divergence(self, step: StepArtifacts) -> None:
        """Raise `TrainingDiverged` (trackers ended as failed) if any loss or metric of the
        step is not finite: DAG-CBOR cannot hold it, and nothing trained on it is worth keeping."""
        values = {"eval loss": step.metrics.get("eval_loss", 0.0), "train loss": step.metrics.get("train_loss", 0.0)}
        values.update({f"replica {c.replica} loss": c.loss for c in step.contributions})
        values.update({k: v for k, v in step.metrics.items() if k not in ("eval_loss", "train_loss")})
        for what, value in values.items():
            if not math.isfinite(value):
                self._diverged(f"training diverged at step {step.step} ({what} {value})")

    def _diverged(self, message: str) -> None:
        for tracker in self.trackers:
            tracker.finish(False)
        raise TrainingDiverged(message)

    def _already_committed(self, step: int, checkpoint: CID) -> bool:
        run_id = self.record.run_id
        _, head_step = guard(lambda: self.ledger.head(run_id), f"runHead({run_id})")
        if head_step < step:
            return False
        on_chain = guard(self.ledger.ledger.functions.stepCheckpoint(run_id, step).call,
                         f"stepCheckpoint({run_id}, {step})")
        if bytes(on_chain) != digest_of(checkpoint):
            raise TrainingError(f"step {step} is already committed with another checkpoint "
                                f"(0x{bytes(on_chain).hex()}); this run cannot continue from {self._head}")
        return True

    # -- storage ---------------------------------------------------------------------------

    def _put_shard(self, store: Blockstore, data: bytes) -> CID:
        """Store a stage shard as a UnixFS file in `store`, keeping the digest of its weights
        for the round-start states of the next two steps to refer to."""
        cid = _put_file(store, data)
        self._weights[str(cid)] = param_digest(data)
        return cid

    def _put_start(self, store: Blockstore, data: bytes, shards: list[tuple[CID, bytes | None]]) -> CID:
        """Store a round-start state in `store`: by reference where its weights are one of
        `shards`' (each with its weights' digest), else as a UnixFS file."""
        return put_round_state(store, data, shards)

    def _reference_shards(self, parent: CID, stage: int,
                          manifests: dict[str, Manifest]) -> list[tuple[CID, bytes | None]]:
        """The committed shards a round-start state of `stage` in the step on `parent` may
        refer to (`lineage.store.roundstate.reference_shards`), with their weights' digests."""
        out = []
        for cid in reference_shards(self.store, parent, stage, manifests):
            if str(cid) not in self._weights:  # a resumed run: read back once
                self._weights[str(cid)] = param_digest(read_bytes(self.store, cid))
            out.append((cid, self._weights[str(cid)]))
        return out

    def _forget_weights(self, stages: list[CID], parent: CID) -> None:
        """Keep only the digests the next step's states may refer to: of this step's
        shards and its parent's."""
        keep = {str(c) for c in [*stages, *get_manifest(self.store, parent).stages]}
        self._weights = {k: v for k, v in self._weights.items() if k in keep}

    def _pin(self, head: CID) -> None:
        """Point the run's pin set at its head: everything the run committed survives gc."""
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.record.name}-{self.record.run_id}")[:128]
        self.store.pin(name, [head])

    def on_progress(self, progress: Progress) -> None:
        if not math.isfinite(progress.loss):
            self._diverged(f"training diverged at step {progress.outer_step} "
                           f"(inner loss {progress.loss} at inner step {progress.inner_step})")
        record = progress.record()
        for tracker in self.trackers:
            tracker.inner(record)
        if self._progress:
            self._progress(progress)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _put_file(store: Blockstore, data: bytes) -> CID:
    """Store bytes as a UnixFS file; its CID (and so the on-chain digest) is Kubo's."""
    return import_bytes(data, store.put).cid
