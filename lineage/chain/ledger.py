"""Typed access to the ledger contracts (NodeRegistry, TrainingLedger) over web3.

A `Ledger` reads its deployment's version (ERC-5267 `eip712Domain()`) and speaks it:
version 3 (this code's contracts) commits partial steps, each over its replica set (a
bitmap of the replicas present, signed in every attestation and carried by `StepCommitted`),
co-signs stage shards and takes EIP-2098 signatures; version 2 and version 1 deployments
(contracts/legacy/) are read with their own ABIs, every step of theirs having all R
replicas, so runs committed before the changes still verify.

Transactions go through `lineage.chain.client.Chain` (signed locally, waited on, a revert
decoded into the contract's custom error by name). The records it takes and returns are in
`lineage.chain.records` and re-exported here (`__all__`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from eth_account.signers.local import LocalAccount
from eth_typing import HexStr
from eth_utils import to_checksum_address
from web3.exceptions import Web3Exception
from web3.logs import DISCARD

from lineage.errors import ChainError

from .attest import (
    DOMAIN_NAME,
    DOMAIN_VERSION,
    DOMAIN_VERSIONS,
    Domain,
    Verdict,
    contributions_root,
    replica_bitmap,
    sign_verdict,
    verdict_signable_digest,
)
from .client import (
    Chain,
    artifact,
    call_view,
    chain_failure,
)
from .logs import DEFAULT_LOG_RANGE, ranged_logs
from .records import (
    ADMISSION,
    INDEPENDENCE,
    Attestation,
    ChallengeRecord,
    Commit,
    CommitCall,
    OpenedChallenge,
    Rejection,
    Resolution,
    RunInfo,
    RunParams,
    RunSpec,
    StepInfo,
    StepRecord,
)
from .registry import Registry

__all__ = [
    "ADMISSION", "BURN_ADDRESS", "DEFAULT_REPORTER_SHARE_BPS", "DEFAULT_UNBONDING_DELAY", "DOMAIN_VERSION",
    "INDEPENDENCE", "Attestation", "ChallengeRecord", "Commit", "CommitCall", "Ledger", "OpenedChallenge",
    "Rejection", "Resolution", "RunInfo", "RunParams", "RunSpec", "StepInfo", "StepRecord", "ledger_version",
]

#: Where slashed stake goes when no treasury is named: nobody holds its key.
BURN_ADDRESS = "0x000000000000000000000000000000000000dEaD"
#: The reporter's (or successful challenger's) share of a slash, in basis points.
DEFAULT_REPORTER_SHARE_BPS = 5_000
#: Seconds between unbonding and withdrawal; every challenge window stays below it.
DEFAULT_UNBONDING_DELAY = 7 * 24 * 3600


_RUN_SPEC_TUPLE = ("(bytes32,bytes32,address[],uint32,uint32,uint32,uint64,uint256,address[],uint32,uint8,"
                   "uint8,uint128)")


class Ledger:
    """The TrainingLedger and its NodeRegistry at known addresses."""

    def __init__(self, chain: Chain, registry: str, ledger: str) -> None:
        self.chain = chain
        #: Where event reads start (a run's `RunRecord.created_block`) and how many blocks
        #: one `eth_getLogs` spans (`[chain] log_range`): `lineage.chain.logs`.
        self.from_block, self.log_range = 0, DEFAULT_LOG_RANGE
        self.registry = Registry(chain, registry)
        self.version = ledger_version(chain, ledger)
        name = "TrainingLedger" if self.version == DOMAIN_VERSION else f"TrainingLedger-v{self.version}"
        self.ledger = chain.contract(name, ledger)

    @property
    def domain(self) -> Domain:
        """The EIP-712 domain attestations to this deployment are signed in."""
        return Domain(self.chain.chain_id, self.ledger.address, self.version)

    def _require_current(self, what: str) -> None:
        if self.version != DOMAIN_VERSION:
            raise ChainError(f"{what} needs a version {DOMAIN_VERSION} ledger; {self.ledger.address} is "
                             f"version {self.version} (its runs can be read and verified, not extended)")

    @classmethod
    def deploy(
        cls,
        chain: Chain,
        deployer: LocalAccount,
        *,
        treasury: str = BURN_ADDRESS,
        reporter_share_bps: int = DEFAULT_REPORTER_SHARE_BPS,
        unbonding_delay: int = DEFAULT_UNBONDING_DELAY,
    ) -> Ledger:
        """Deploy a NodeRegistry and a TrainingLedger on it, and bind the two.

        `treasury` receives the non-reporter share of slashed stake (the burn address by
        default); every run's challenge window must stay below `unbonding_delay` seconds.
        """
        registry = chain.deploy(
            "NodeRegistry", deployer, to_checksum_address(treasury), reporter_share_bps, unbonding_delay
        )
        ledger = chain.deploy("TrainingLedger", deployer, registry)
        out = cls(chain, registry, ledger)
        chain.transact(out.registry.contract.functions.bindLedger(ledger), deployer, context="bindLedger")
        return out

    @property
    def addresses(self) -> dict[str, str]:
        return {"registry": self.registry.address, "ledger": self.ledger.address}

    # -- runs -----------------------------------------------------------------------------

    def create_run(self, sender: LocalAccount, run: RunSpec) -> int:
        """Create `run` (`RunSpec`); returns its id."""
        self._require_current("createRun")
        if run.admission not in ADMISSION:
            raise ChainError(f"admission {run.admission!r} is not one of {', '.join(ADMISSION)}")
        spec = (
            run.config_digest, run.genesis_digest, [to_checksum_address(n) for n in run.nodes],
            run.replicas, run.stages, run.replicas if run.min_replicas is None else run.min_replicas,
            run.challenge_window, run.min_stake, run.arbiters or [], run.quorum, INDEPENDENCE[run.independence],
            ADMISSION[run.admission], run.reward_per_step,
        )
        fn = self.ledger.get_function_by_signature(f"createRun({_RUN_SPEC_TUPLE})")(spec)
        receipt = self.chain.transact(fn, sender, value=run.fund_wei, context="createRun")
        (event,) = self.ledger.events.RunCreated().process_receipt(receipt, errors=DISCARD)
        return int(event["args"]["runId"])

    def commit_step(
        self,
        sender: LocalAccount,
        *,
        run_id: int,
        step: int,
        parent: bytes,
        checkpoint: bytes,
        metrics_digest: bytes,
        attestations: list[Attestation],
        replica_set: int | None = None,
    ) -> str:
        """Commit `step` with one attestation per (replica in `replica_set`, stage), in slot
        order; `replica_set` (a bitmap, `attest.replica_bitmap`) defaults to the
        attestations' replicas. Returns the transaction hash."""
        self._require_current("commitStep")
        root = contributions_root(a.contribution for a in attestations)
        if replica_set is None:
            replica_set = replica_bitmap(a.replica for a in attestations)
        fn = self.ledger.functions.commitStep(
            run_id, step, parent, checkpoint, root, metrics_digest, replica_set,
            [a.as_tuple() for a in attestations],
        )
        receipt = self.chain.transact(fn, sender, context=f"commitStep(run {run_id}, step {step})")
        return receipt["transactionHash"].to_0x_hex()

    def head(self, run_id: int) -> tuple[bytes, int]:
        head, step = call_view(self.ledger.functions.runHead(run_id), f"runHead({run_id})")
        return bytes(head), int(step)

    def block_number(self) -> int:
        """The chain's head block number (where a run about to be created will be found from)."""
        return int(self.chain.w3.eth.block_number)

    def created_block(self, run_id: int, since: int) -> int:
        """The block `run_id`'s createRun was mined in, searched from `since` (the head when
        it was sent, less a margin for reorganisations); 0 if not found."""
        from .logs import ranged_logs

        logs = ranged_logs(self.ledger.events.RunCreated(), from_block=max(0, since - 64),
                           argument_filters={"runId": run_id})
        return int(logs[0]["blockNumber"]) if logs else 0

    def _run_created_log(self, run_id: int) -> Any:
        logs = self.logs(self.ledger.events.RunCreated(), {"runId": run_id})
        if not logs:
            raise ChainError(f"run {run_id} not found on ledger {self.ledger.address}")
        return logs[0]

    def logs(self, event: Any, argument_filters: dict[str, Any]) -> list[Any]:
        """`event`'s logs matching `argument_filters`, from `from_block`, in ranges of `log_range`."""
        return ranged_logs(event, from_block=self.from_block, log_range=self.log_range,
                           argument_filters=argument_filters)

    def run_created(self, run_id: int) -> RunInfo:
        """The run's `RunCreated` event."""
        return RunInfo.from_event(self._run_created_log(run_id)["args"])

    def steps(self, run_id: int) -> list[StepRecord]:
        """The committed steps of `run_id` on its current chain, in order, read from the
        ledger's events (commits rejected by a challenge are left out; see `rejections`)."""
        # A rollback leaves rejected commits in the logs and the same step number committed
        # again: the lineage is the latest commit of each step up to the head.
        _, head_step = self.head(run_id)
        latest: dict[int, StepRecord] = {}
        for record in self._commit_records(run_id):
            latest[record.step] = record
        return [latest[n] for n in sorted(latest) if n <= head_step]

    def commits(self, run_id: int) -> list[Commit]:
        """Every commit of `run_id`, in chain order, rejected ones included, each with its
        status: `finalized`, `pending` (on the current chain, still challengeable) or
        `rejected` (by an upheld challenge against it or an ancestor)."""
        _, head_step = self.head(run_id)
        final = self.finalized_step(run_id)
        rejected_by = {(r.step, r.checkpoint): r.challenge_id for r in self.rejections(run_id)}
        records = self._commit_records(run_id)
        latest = {r.step: i for i, r in enumerate(records)}
        out = []
        for i, r in enumerate(records):
            # A step number is committed again only after a rollback rejected it, so every
            # commit but the latest of its step is rejected, and so is a latest one above the head.
            current = latest[r.step] == i and r.step <= head_step
            status = ("finalized" if r.step <= final else "pending") if current else "rejected"
            out.append(Commit(r, status, None if current else rejected_by.get((r.step, r.checkpoint))))
        return out

    def _commit_records(self, run_id: int) -> list[StepRecord]:
        """Every `StepCommitted` event of `run_id` with its attestations, oldest first."""
        committed = self.logs(self.ledger.events.StepCommitted(), {"runId": run_id})
        attested = self.logs(self.ledger.events.ContributionAttested(), {"runId": run_id})
        by_tx: dict[str, list[dict[str, Any]]] = {}
        for log in attested:
            by_tx.setdefault(log["transactionHash"].to_0x_hex(), []).append(dict(log["args"]))
        records = []
        for log in committed:
            a = log["args"]
            tx = log["transactionHash"].to_0x_hex()
            records.append(StepRecord(
                step=int(a["step"]), checkpoint=bytes(a["checkpoint"]), parent=bytes(a["parent"]),
                contributions_root=bytes(a["contributionsRoot"]),
                metrics_digest=bytes(a["metricsDigest"]), submitter=a["submitter"],
                tx=tx, block=int(log["blockNumber"]), attestations=by_tx.get(tx, []),
                shards_root=bytes(a["shardsRoot"]) if "shardsRoot" in a else None,
                replica_set=int(a["replicaSet"]) if "replicaSet" in a else None,
            ))
        return sorted(records, key=lambda r: r.block)

    def commit_calls(self, records: Iterable[StepRecord], batch: int = 100) -> dict[str, CommitCall]:
        """The decoded `commitStep` arguments (attestations with their signatures, which no
        event carries) of each record's transaction, keyed by transaction hash; fetched in
        JSON-RPC batches of `batch`, not one round trip per step."""
        hashes = list(dict.fromkeys(r.tx for r in records))
        w3: Any = self.chain.w3  # web3 types a batch's execute() as RPCResponses; each is a TxData
        out: dict[str, CommitCall] = {}
        for i in range(0, len(hashes), batch):
            chunk = hashes[i:i + batch]
            try:
                with w3.batch_requests() as requests:
                    for tx in chunk:
                        requests.add(w3.eth.get_transaction(HexStr(tx)))
                    txs = requests.execute()
            except (OSError, Web3Exception) as exc:
                raise chain_failure(f"reading {len(chunk)} commit transactions", exc, self.chain.rpc_url) from None
            for tx_hash, txn in zip(chunk, txs, strict=True):
                _, args = self.ledger.decode_function_input(txn["input"])
                out[tx_hash] = CommitCall.decode(args)
        return out

    # -- stakes, slashing, challenges, finality (issue 5) ---------------------------------

    def report_equivocation(
        self, sender: LocalAccount, *, run_id: int, step: int, parent: bytes, a: Attestation, b: Attestation
    ) -> int:
        """Prove that one node signed two contributions for one slot; returns wei slashed."""
        return self.report_equivocation_tx(sender, run_id=run_id, step=step, parent=parent, a=a, b=b)[0]

    def report_equivocation_tx(
        self, sender: LocalAccount, *, run_id: int, step: int, parent: bytes, a: Attestation, b: Attestation
    ) -> tuple[int, str]:
        """`report_equivocation`, also returning the transaction hash."""
        self._require_current("reportEquivocation")
        fn = self.ledger.functions.reportEquivocation(run_id, step, parent, a.as_tuple(), b.as_tuple())
        receipt = self.chain.transact(fn, sender, context=f"reportEquivocation(run {run_id}, step {step})")
        (event,) = self.registry.contract.events.Slashed().process_receipt(receipt, errors=DISCARD)
        return int(event["args"]["amount"]), receipt["transactionHash"].to_0x_hex()

    def report_result_equivocation(
        self, sender: LocalAccount, *, run_id: int, step: int, parent: bytes, a: Attestation, b: Attestation
    ) -> tuple[int, str]:
        """Prove that one node co-signed two shards for one stage; returns (wei slashed, tx)."""
        self._require_current("reportResultEquivocation")
        fn = self.ledger.functions.reportResultEquivocation(run_id, step, parent, a.as_tuple(), b.as_tuple())
        receipt = self.chain.transact(fn, sender, context=f"reportResultEquivocation(run {run_id}, step {step})")
        (event,) = self.registry.contract.events.Slashed().process_receipt(receipt, errors=DISCARD)
        return int(event["args"]["amount"]), receipt["transactionHash"].to_0x_hex()

    def _record(self, run_id: int, step: int) -> StepRecord:
        for record in self.steps(run_id):
            if record.step == step:
                return record
        raise ChainError(f"run {run_id} has no step {step} on its current chain")

    def signers(self, run_id: int, step: int) -> list[str]:
        """The node keys that attested `step` on the run's current chain, in slot order."""
        return [a["node"] for a in self._record(run_id, step).attestations]

    def open_challenge(
        self,
        challenger: LocalAccount,
        *,
        run_id: int,
        step: int,
        replica: int,
        stage: int,
        bond: int,
        evidence: bytes = bytes(32),
    ) -> int:
        """Open a replay challenge against slot (`replica`, `stage`) of `step`, posting
        `bond` wei; returns the challenge id."""
        return self.open_challenge_tx(challenger, run_id=run_id, step=step, replica=replica, stage=stage,
                                      bond=bond, evidence=evidence)[0]

    def open_challenge_tx(
        self, challenger: LocalAccount, *, run_id: int, step: int, replica: int, stage: int, bond: int,
        evidence: bytes = bytes(32),
    ) -> tuple[int, str]:
        """`open_challenge`, also returning the transaction hash."""
        self._require_current("openChallenge")
        record = self._record(run_id, step)
        fn = self.ledger.functions.openChallenge(
            run_id, step, replica, stage, record.replica_set, [a["node"] for a in record.attestations],
            record.shards_root, evidence,
        )
        receipt = self.chain.transact(fn, challenger, value=bond,
                                      context=f"openChallenge(run {run_id}, step {step})")
        (event,) = self.ledger.events.ChallengeOpened().process_receipt(receipt, errors=DISCARD)
        return int(event["args"]["challengeId"]), receipt["transactionHash"].to_0x_hex()

    def open_aggregate_challenge(
        self, challenger: LocalAccount, *, run_id: int, step: int, stage: int, bond: int,
        evidence: bytes = bytes(32),
    ) -> tuple[int, str]:
        """Challenge stage `stage`'s co-signed shard of `step` (not the aggregate of the
        published contributions: every co-signer answers), posting `bond` wei; returns
        (challenge id, transaction hash)."""
        self._require_current("openAggregateChallenge")
        record = self._record(run_id, step)
        stages = self.run_created(run_id).stages
        fn = self.ledger.functions.openAggregateChallenge(
            run_id, step, stage, record.replica_set, [a["node"] for a in record.attestations],
            record.shards(stages), evidence,
        )
        receipt = self.chain.transact(fn, challenger, value=bond,
                                      context=f"openAggregateChallenge(run {run_id}, step {step}, stage {stage})")
        (event,) = self.ledger.events.ChallengeOpened().process_receipt(receipt, errors=DISCARD)
        return int(event["args"]["challengeId"]), receipt["transactionHash"].to_0x_hex()

    def co_signers_of(self, challenge_id: int) -> list[str]:
        """The co-signers an aggregate challenge holds (empty for a replay challenge)."""
        if self.version == "1":  # no aggregate challenges before co-signed shards
            return []
        return [str(a) for a in call_view(self.ledger.functions.coSignersOf(challenge_id),
                                      f"coSignersOf({challenge_id})")]

    def challenge(self, challenge_id: int) -> ChallengeRecord:
        """Challenge `challenge_id` as stored, plus the evidence digest of its opening event."""
        c = call_view(self.ledger.functions.challenge(challenge_id), f"challenge({challenge_id})")
        if self.version == "1":  # no aggregate challenges before co-signed shards
            c = (*c[:6], False, *c[6:])
        run_id, step, epoch, replica, stage, resolved, aggregate, opened_at, node, challenger, bond = c
        logs = self.logs(self.ledger.events.ChallengeOpened(), {"challengeId": challenge_id})
        return ChallengeRecord(
            challenge_id=challenge_id, run_id=int(run_id), step=int(step), epoch=int(epoch), replica=int(replica),
            stage=int(stage), resolved=bool(resolved), aggregate=bool(aggregate), opened_at=int(opened_at),
            node=str(node), challenger=str(challenger), bond=int(bond),
            evidence=bytes(logs[0]["args"]["evidence"]) if logs else bytes(32))

    def challenges(self, *, run_id: int | None = None, node: str | None = None) -> list[OpenedChallenge]:
        """Opened challenges (of one run, against one node, or all), oldest first, each with
        what became of it (`OpenedChallenge`)."""
        filters = {"runId": run_id} if run_id is not None else {}
        events = self.ledger.events
        opened = self.logs(events.ChallengeOpened(), filters)
        resolved = {int(log["args"]["challengeId"]): bool(log["args"]["upheld"])
                    for log in self.logs(events.ChallengeResolved(), filters)}
        expired = {int(log["args"]["challengeId"])
                   for log in self.logs(events.ChallengeExpired(), filters)}
        out = []
        for log in opened:
            a = log["args"]
            if node is not None and a["node"].lower() != node.lower():
                continue
            cid = int(a["challengeId"])
            out.append(OpenedChallenge(
                challenge_id=cid, run_id=int(a["runId"]), step=int(a["step"]), node=str(a["node"]),
                epoch=int(a["epoch"]), replica=int(a["replica"]), stage=int(a["stage"]),
                challenger=str(a["challenger"]), bond=int(a["bond"]), evidence=bytes(a["evidence"]),
                resolved=cid in resolved or cid in expired, expired=cid in expired, upheld=resolved.get(cid),
                tx=log["transactionHash"].to_0x_hex()))
        return out

    def arbiters_of(self, run_id: int) -> tuple[list[str], int]:
        """The run's arbiter keys and the quorum of them a verdict needs."""
        arbiters, quorum = call_view(self.ledger.functions.arbitersOf(run_id), f"arbitersOf({run_id})")
        return [str(a) for a in arbiters], int(quorum)

    def run_params(self, run_id: int) -> RunParams:
        """The challenge terms `createRun` was called with (the ledger keeps `minStake`
        private; the creating transaction shows it)."""
        tx = self.chain.w3.eth.get_transaction(self._run_created_log(run_id)["transactionHash"])
        try:
            fn, args = self.ledger.decode_function_input(tx["input"])
        except ValueError:  # another contract's call, or createRun's positional ABI before issue 35
            fn, args = None, {}
        if fn is None or fn.fn_name != "createRun":  # created through another contract: fall back to views
            arbiters, quorum = self.arbiters_of(run_id)
            return RunParams(arbiters, quorum, None, int(self.ledger.functions.challengeWindowOf(run_id).call()))
        if "spec" in args:  # createRun(RunSpec), issue 35
            spec = args["spec"]
            return RunParams([str(a) for a in spec["arbiters"]], int(spec["quorum"]), int(spec["minStake"]),
                             int(spec["challengeWindow"]))
        return RunParams([str(a) for a in args["arbiters"]], int(args["quorum"]), int(args["minStake"]),
                         int(args["challengeWindow_"]))

    def verdict_signer(self, challenge_id: int, upheld: bool, signature: bytes) -> str:
        """The key that signed `signature` over `Verdict(challenge_id, upheld)`."""
        domain = Domain(self.chain.chain_id, self.ledger.address, self.version)
        try:
            return str(Verdict(challenge_id, upheld).recover(domain, signature))
        except Exception:  # eth_keys raises several types for a malformed signature
            raise ChainError(f"malformed verdict signature 0x{signature.hex()[:16]}...") from None

    def resolve_with(
        self, sender: LocalAccount, *, challenge_id: int, upheld: bool, signatures: list[bytes]
    ) -> Resolution:
        """Submit arbiters' verdict signatures (already in the contract's order, ascending by
        signer) and report what happened."""
        fn = self.ledger.functions.resolveChallenge(challenge_id, upheld, signatures)
        receipt = self.chain.transact(fn, sender, context=f"resolveChallenge({challenge_id})")
        (done,) = self.ledger.events.ChallengeResolved().process_receipt(receipt, errors=DISCARD)
        slashed = self.registry.contract.events.Slashed().process_receipt(receipt, errors=DISCARD)
        released = self.registry.contract.events.BondReleased().process_receipt(receipt, errors=DISCARD)
        rejected = self.ledger.events.StepRejected().process_receipt(receipt, errors=DISCARD)
        rolled = self.ledger.events.HeadRolledBack().process_receipt(receipt, errors=DISCARD)
        a = done["args"]
        return Resolution(
            challenge_id=challenge_id, run_id=int(a["runId"]), step=int(a["step"]), node=a["node"],
            upheld=bool(a["upheld"]),
            slashed=sum(int(e["args"]["amount"]) for e in slashed),
            reward=sum(int(e["args"]["reward"]) for e in slashed),
            bond=sum(int(e["args"]["amount"]) for e in released),
            bond_to=released[0]["args"]["to"] if released else "",
            rejected_steps=[int(e["args"]["step"]) for e in rejected],
            slashed_nodes=[e["args"]["node"] for e in slashed],
            head_step=int(rolled[0]["args"]["toStep"]) if rolled else None,
            head=bytes(rolled[0]["args"]["head"]) if rolled else None,
            tx=receipt["transactionHash"].to_0x_hex(),
        )

    def resolution_period(self) -> int:
        """Seconds an opened challenge waits for a verdict before anyone may expire it."""
        return int(self.ledger.functions.resolutionPeriod().call())

    def expire_challenge(self, sender: LocalAccount, challenge_id: int) -> tuple[int, str, str]:
        """Dismiss a challenge no quorum ruled on within the resolution period; returns
        (the bond in wei, who it was credited to: the challenger, the transaction hash)."""
        receipt = self.chain.transact(self.ledger.functions.expireChallenge(challenge_id), sender,
                                      context=f"expireChallenge({challenge_id})")
        (released,) = self.registry.contract.events.BondReleased().process_receipt(receipt, errors=DISCARD)
        return int(released["args"]["amount"]), released["args"]["to"], receipt["transactionHash"].to_0x_hex()

    def verdict_digest(self, challenge_id: int, upheld: bool) -> bytes:
        """The EIP-712 digest an arbiter signs (checked against the contract in tests)."""
        return verdict_signable_digest(
            self.chain.chain_id, self.ledger.address, challenge_id, upheld
        )

    def resolve_challenge(
        self, sender: LocalAccount, *, challenge_id: int, upheld: bool, arbiters: list[LocalAccount]
    ) -> Any:
        """Resolve a challenge with `arbiters`' verdict signatures (sorted here by address,
        as the contract requires); returns the receipt."""
        ordered = sorted(arbiters, key=lambda acct: int(acct.address, 16))
        sigs = [sign_verdict(self.chain.chain_id, self.ledger.address, challenge_id, upheld, acct.key)
                for acct in ordered]
        fn = self.ledger.functions.resolveChallenge(challenge_id, upheld, sigs)
        return self.chain.transact(fn, sender, context=f"resolveChallenge({challenge_id})")

    def finalize(self, sender: LocalAccount, run_id: int, step: int) -> Any:
        """Make `step` final (after its window, with no open challenge); returns the receipt.
        A run that pays rewards (issue 35) is finalized through `finalizeSteps`, with the
        step's witnesses, which pays its reward."""
        if self.version == DOMAIN_VERSION and self.ledger.functions.runTerms(run_id).call()[1]:
            return self.finalize_steps(sender, run_id, [self._record(run_id, step)])
        return self.chain.transact(self.ledger.functions.finalize(run_id, step), sender,
                                   context=f"finalize(run {run_id}, step {step})")

    def finalize_steps(self, sender: LocalAccount, run_id: int, records: list[StepRecord]) -> Any:
        """Make `records` (the next steps due, in order) final and pay their rewards;
        returns the receipt."""
        witnesses = [([a["node"] for a in r.attestations], r.shards_root, r.replica_set) for r in records]
        steps = f"{records[0].step}..{records[-1].step}" if records else "none"
        return self.chain.transact(self.ledger.functions.finalizeSteps(run_id, witnesses), sender,
                                   context=f"finalizeSteps(run {run_id}, steps {steps})")

    def finalized_step(self, run_id: int) -> int:
        return int(call_view(self.ledger.functions.finalizedStep(run_id), f"finalizedStep({run_id})"))

    def step_info(self, run_id: int, step: int) -> StepInfo:
        """The stored record of `step` (`StepInfo`)."""
        (checkpoint, witness_hash, committed_at, epoch, open_challenges, rejected) = call_view(
            self.ledger.functions.stepInfo(run_id, step), f"stepInfo({run_id}, {step})")
        return StepInfo(bytes(checkpoint), bytes(witness_hash), int(committed_at), int(epoch),
                        int(open_challenges), bool(rejected))

    def rejections(self, run_id: int) -> list[Rejection]:
        """Every `StepRejected` event of `run_id`, oldest first."""
        logs = self.logs(self.ledger.events.StepRejected(), {"runId": run_id})
        return [Rejection(int(a["runId"]), int(a["step"]), bytes(a["checkpoint"]), int(a["challengeId"]))
                for a in (log["args"] for log in logs)]


def ledger_version(chain: Chain, address: str) -> str:
    """The version a TrainingLedger deployment signs under (its ERC-5267 `eip712Domain()`);
    this code's own version where the address answers no such call (nothing deployed yet)."""
    abi, _ = artifact("TrainingLedger")
    probe = chain.w3.eth.contract(address=to_checksum_address(address), abi=abi)
    try:
        _, name, version, *_ = probe.functions.eip712Domain().call()
    except (OSError, Web3Exception, ValueError):
        return DOMAIN_VERSION
    if name != DOMAIN_NAME or version not in DOMAIN_VERSIONS:
        raise ChainError(f"{address} is not a DiLoCoX ledger this code reads (domain {name!r} version {version!r})")
    return str(version)
