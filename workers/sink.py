"""The StepSink that turns each outer step into blocks, a manifest and a ledger commit.

For every step it stores the stage shards and contributions as UnixFS files (the CIDs
`ipfs add --cid-version=1` gives the same bytes: a raw block up to 256 KiB, a dag-pb root
above), links them in a DAG-CBOR manifest whose parent is the previous checkpoint, has each (replica, stage)
slot's node key sign an EIP-712 `Contribution`, and commits the step on the ledger.
`run.json` is rewritten only after the chain accepted the step, and the store's pin set for
the run (`<name>-<run id>`) then names the new head, so `dlx cas gc` keeps the whole run.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

import dag_cbor
from eth_account.signers.local import LocalAccount
from multiformats import CID

from lineage.attest import ContributionClaim, Domain, loss_micros
from lineage.blockstore import Blockstore
from lineage.chain import Attestation, Ledger
from lineage.cid import digest_of
from lineage.manifest import Manifest, put_config, put_manifest
from lineage.runrecord import RunRecord
from lineage.unixfs import import_bytes
from trainer.artifacts import GenesisArtifacts, Progress, StepArtifacts, code_hash
from trainer.config import JobConfig
from trainer.errors import TrainingError


class LedgerSink:
    """Stores and commits each outer step; one node key per (replica, stage) slot."""

    def __init__(
        self,
        *,
        job: JobConfig,
        config: dict,
        store: Blockstore,
        ledger: Ledger,
        submitter: LocalAccount,
        slot_keys: list[LocalAccount],
        record: RunRecord,
        run_dir: Path,
        challenge_window: int,
        min_stake: int,
        on_progress: Callable[[Progress], None] | None = None,
        on_committed: Callable[[int, CID, StepArtifacts], None] | None = None,
    ) -> None:
        if len(slot_keys) != job.world_size:
            raise ValueError(f"need {job.world_size} slot keys, got {len(slot_keys)}")
        self.job = job
        self.config = config
        self.store = store
        self.ledger = ledger
        self.submitter = submitter
        self.slot_keys = slot_keys
        self.record = record
        self.run_dir = run_dir
        self.challenge_window = challenge_window
        self.min_stake = min_stake
        self.code = code_hash()
        self.domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
        self._progress = on_progress
        self._committed = on_committed
        self._config_cid: CID | None = None
        self._head: CID | None = None

    # -- StepSink --------------------------------------------------------------------------

    def on_genesis(self, genesis: GenesisArtifacts) -> None:
        self._config_cid = put_config(self.store, self.config)
        stages = [self._put_file(s.data) for s in genesis.stages]
        manifest = Manifest(step=0, parent=None, config=self._config_cid, stages=stages, code=self.code)
        head = put_manifest(self.store, manifest)
        nodes = list(dict.fromkeys(k.address for k in self.slot_keys))
        run_id = self.ledger.create_run(
            self.submitter,
            config_digest=digest_of(self._config_cid),
            genesis_digest=digest_of(head),
            nodes=nodes,
            replicas=self.job.parallel.replicas,
            stages=self.job.parallel.stages,
            challenge_window=self.challenge_window,
            min_stake=self.min_stake,
        )
        self._head = head
        r = self.record
        r.run_id, r.config, r.genesis, r.head, r.nodes, r.status = (
            run_id, str(self._config_cid), str(head), str(head), nodes, "running",
        )
        r.save(self.run_dir)
        self._pin(head)

    def on_step(self, step: StepArtifacts) -> None:
        if self._head is None or self._config_cid is None:
            raise TrainingError("outer step reported before genesis")
        S = self.job.parallel.stages
        R = self.job.parallel.replicas
        if len(step.contributions) != R * S:
            raise TrainingError(f"step {step.step}: {len(step.contributions)} contributions for {R * S} slots")
        stages = [self._put_file(s.data) for s in step.stages]
        contribs = [self._put_file(c.data) for c in step.contributions]
        metrics = dict(step.metrics)
        manifest = Manifest(
            step=step.step,
            parent=self._head,
            config=self._config_cid,
            stages=stages,
            code=self.code,
            run=self.record.run_id,
            contributions=[contribs[r * S:(r + 1) * S] for r in range(R)],
            data=[step.contributions[r * S].data_shard for r in range(R)],
            metrics=metrics,
        )
        checkpoint = put_manifest(self.store, manifest)
        parent = digest_of(self._head)
        attestations = []
        for slot, (contrib, cid) in enumerate(zip(step.contributions, contribs, strict=True)):
            if (contrib.replica, contrib.stage) != divmod(slot, S):
                raise TrainingError(f"step {step.step}: contribution {slot} is for slot "
                                    f"({contrib.replica}, {contrib.stage})")
            claim = ContributionClaim(
                run_id=self.record.run_id, step=step.step, replica=contrib.replica,
                stage=contrib.stage, parent=parent, contribution=digest_of(cid),
                data_shard=contrib.data_shard, code_hash=self.code,
                loss_micros=loss_micros(contrib.loss),
            )
            signature = claim.sign(self.domain, self.slot_keys[slot].key)
            attestations.append(Attestation(
                contrib.replica, contrib.stage, claim.contribution, claim.data_shard,
                claim.code_hash, claim.loss_micros, signature,
            ))
        self.ledger.commit_step(
            self.submitter,
            run_id=self.record.run_id,
            step=step.step,
            parent=parent,
            checkpoint=digest_of(checkpoint),
            metrics_digest=hashlib.sha256(dag_cbor.encode(manifest.to_node()["metrics"])).digest(),
            attestations=attestations,
        )
        self._head = checkpoint
        self.record.head, self.record.steps = str(checkpoint), step.step
        self.record.save(self.run_dir)
        self._pin(checkpoint)
        if self._committed:
            self._committed(step.step, checkpoint, step)

    # -- storage ---------------------------------------------------------------------------

    def _put_file(self, data: bytes) -> CID:
        """Store bytes as a UnixFS file; its CID (and so the on-chain digest) is Kubo's."""
        return import_bytes(data, self.store.put).cid

    def _pin(self, head: CID) -> None:
        """Point the run's pin set at its head: everything the run committed survives gc."""
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.record.name}-{self.record.run_id}")[:128]
        self.store.pin(name, [head])

    def on_progress(self, progress: Progress) -> None:
        if self._progress:
            self._progress(progress)
