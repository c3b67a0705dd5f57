"""`dlx train`: one job, run as local processes, recorded on a chain and in a blockstore.

With no RPC URL the chain is an anvil started here, with its state file inside the run
directory so the chain outlives the run; node keys are then anvil's public development
keys (local chain only). With an RPC URL, keys come from the environment:
`DLX_SUBMITTER_KEY` (pays for run creation and commits) and `DLX_NODE_KEYS` (one
comma-separated private key per rank, in rank order), never from the command line. A run
deploys its own registry and ledger, or uses those of a deployment file the job names
(`[chain] deployment`, written by `dlx deploy`: lineage/chain/deploy.py).

The embedded anvil's state file is rewritten after every transaction (`PersistedChain`),
before run.json names the step, so a killed chain keeps every committed step. SIGINT and
SIGTERM stop every rank at the next inner-step boundary (the job queue's cancel); the
steps committed stay, anvil is stopped and run.json says `stopped` at the chain's head.
`resume_job` (`dlx train --resume RUN_DIR`) continues a stopped, failed or crashed run
from the last step committed on chain, as `dlx resume JOB` does for the queue.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from eth_account import Account
from eth_account.signers.local import LocalAccount

from lineage.chain.anvil import ANVIL_BALANCE_WEI, ANVIL_CHAIN_ID, Anvil, dev_accounts, tool_path
from lineage.chain.attest import Domain
from lineage.chain.client import Chain, artifact
from lineage.chain.commits import guard
from lineage.chain.deploy import check_deployment, open_deployment
from lineage.chain.ledger import Ledger
from lineage.chain.runrecord import RunRecord
from lineage.chain.tx import TxPolicy
from lineage.store.cid import DAG_CBOR, cid_from_digest
from lineage.store.datasets import prepare_dataset
from lineage.store.manifest import get_manifest
from lineage.store.retention import Retention
from lineage.store.runconfig import RunConfig
from trainer.artifacts import Progress, StepArtifacts, code_hash
from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.launch import check_local, stop_event, train_local

from .jobfile import ETHER, JobFile, load_job_file
from .sink import HONEST, LedgerSink, local_signer
from .tracking import mark_resume

CHAIN_STATE = "chain/state.json"


@dataclass
class Callbacks:
    """How a run talks to its user (the CLI draws these; tests may record them)."""

    warn: Callable[[str], None] = lambda msg: None
    progress: Callable[[Progress], None] = lambda p: None
    committed: Callable[[int, object, StepArtifacts], None] = lambda step, cid, art: None
    stopping: Callable[[str], None] = lambda signal_name: None  # a stop was asked for
    resuming: Callable[[int, object], None] = lambda step, checkpoint: None  # resume: the head it starts from


class PersistedChain(Chain):
    """A `Chain` on the embedded anvil that saves anvil's state file after every transaction
    it sends, before the caller learns it went through: what the caller records next
    (run.json's head) is already in the file, even if anvil is killed a moment later."""

    def __init__(self, anvil: Anvil, expected_chain_id: int | None = None, policy: TxPolicy | None = None) -> None:
        super().__init__(anvil.url, expected_chain_id, policy)
        self.anvil = anvil

    def transact(self, fn: Any, sender: LocalAccount, *, value: int = 0, context: str) -> Any:
        receipt = super().transact(fn, sender, value=value, context=context)
        self.anvil.save_state()
        return receipt


@contextmanager
def stop_on_signals(cb: Callbacks) -> Iterator[Any]:
    """SIGINT and SIGTERM set the event yielded (ranks stop at the next inner-step boundary;
    `train_local(stop=...)`); a second signal interrupts at once. Handlers can be set only
    from the main thread: elsewhere the event is simply never set by a signal."""
    stop = stop_event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        cb.stopping(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def default_run_dir(job: JobFile) -> Path:
    return Path("runs") / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_run_dir(run_dir: Path) -> None:
    """A run directory must be new or empty, and creatable: its nearest existing ancestor
    a directory this process may write in (checked before anything is started)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory is a file: {run_dir}")
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"run directory already exists and is not empty: {run_dir}")
    ancestor = next(p for p in run_dir.absolute().parents if p.exists())
    if not run_dir.exists() and not (ancestor.is_dir() and os.access(ancestor, os.W_OK | os.X_OK)):
        raise ConfigError(f"cannot create run directory {run_dir}: {ancestor} is not a writable directory")


def _keys_for(job: JobFile, chain_id: int, embedded: bool, warn: Callable[[str], None]) -> tuple[LocalAccount, list[LocalAccount]]:
    world = job.world_size
    submitter_key = os.environ.get("DLX_SUBMITTER_KEY")
    node_keys = os.environ.get("DLX_NODE_KEYS")
    if submitter_key and node_keys and not embedded:
        try:
            submitter = Account.from_key(submitter_key)
            nodes = [Account.from_key(k.strip()) for k in node_keys.split(",") if k.strip()]
        except (ValueError, TypeError):
            raise ConfigError("DLX_SUBMITTER_KEY / DLX_NODE_KEYS hold a malformed private key") from None
        if len(nodes) != world:
            raise ConfigError(f"DLX_NODE_KEYS holds {len(nodes)} keys; the job has {world} ranks")
        return submitter, nodes
    if chain_id != ANVIL_CHAIN_ID:
        raise ConfigError(f"chain {chain_id} is not a local anvil chain: set DLX_SUBMITTER_KEY and DLX_NODE_KEYS")
    warn("using anvil's public development keys: they are for a local chain only")
    accounts = dev_accounts(world + 1)
    return accounts[0], accounts[1:]


def refuse_cheat_off_local_chain(job: JobFile, rpc: str | None, chain_id: int | None = None,
                                 *, queue: bool = False) -> None:
    """A job with test-only misbehaviour (`JobFile.test_hooks`: a `[cheat]` section, read
    only under a test extension) runs only on a local chain: the embedded anvil (no RPC URL),
    or chain id 31337 on a loopback host. `chain_id` is asked of the chain when not given.
    The job queue (`queue`) also refuses what the hooks say only `dlx train` can act out."""
    hooks = job.test_hooks()
    if hooks is None:
        return
    if queue and (why := hooks.queue_refusal()):
        raise ConfigError(why)
    if rpc is None:
        return
    refusal = f"cheat: refused on {rpc}: cheating nodes run only on a local chain " \
              f"(the embedded anvil, or chain id {ANVIL_CHAIN_ID} on a loopback host)"
    host = urlparse(rpc).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ConfigError(refusal)
    if (chain_id if chain_id is not None else Chain(rpc).chain_id) != ANVIL_CHAIN_ID:
        raise ConfigError(refusal)


def check_chain(job: JobFile, rpc: str | None) -> None:
    """Refuse, before anything is created (`dlx train`), a chain that does not answer or is
    not the job's (`chain.chain_id`), and a `chain.stake_wei` the node keys cannot pay: each
    one stakes it from its own balance, and a larger stake would fail half way through
    setting the run up. With an RPC URL (`rpc`, else the job's) the chain is asked; the
    embedded anvil gives each of its accounts ANVIL_BALANCE_WEI."""
    url = rpc or job.chain.rpc
    stake = job.chain.stake_wei
    if url is None and job.chain.deployment:
        raise ConfigError(f"chain.deployment names {job.chain.deployment}, but with no chain.rpc (or --rpc) the chain "
                          "is an embedded anvil that starts empty: give the deployment's endpoint")
    if url is None:
        if job.chain.chain_id not in (None, ANVIL_CHAIN_ID):
            raise ConfigError(f"chain.chain_id is {job.chain.chain_id}, but with no chain.rpc the chain is an "
                              f"embedded anvil (chain id {ANVIL_CHAIN_ID})")
        if stake >= ANVIL_BALANCE_WEI:
            raise ConfigError(f"chain.stake_wei ({stake} wei) is more than the embedded chain gives each node key "
                              f"({ANVIL_BALANCE_WEI // ETHER} ETH, gas included)")
        return
    chain = Chain(url, job.chain.chain_id)
    if job.chain.deployment:
        check_deployment(chain, Path(job.chain.deployment))
    _, nodes = _keys_for(job, chain.chain_id, embedded=False, warn=lambda message: None)
    for address in dict.fromkeys(k.address for k in nodes):
        chain.require_funds(address, stake, "chain.stake_wei: a stake")


def preflight(job: JobFile, run_dir: Path, rpc: str | None,
              data_progress: Callable[[str, int, int], None] | None = None) -> str:
    """Check everything that can fail cheaply, before anything is created or started, and
    tokenize the data (once per machine: lineage.store.datasets); returns the device the ranks
    will use, with why (`trainer.launch.check_local`)."""
    check_run_dir(run_dir)
    device = check_local(job)
    prepare_dataset(job.data, job.model.vocab_size, progress=data_progress)  # bad data: nothing written
    refuse_cheat_off_local_chain(job, rpc or job.chain.rpc, job.chain.chain_id)
    check_chain(job, rpc)  # it answers, has the job's chain id, and the node keys can pay
    if (rpc or job.chain.rpc) is None:
        tool_path("anvil")
    artifact("TrainingLedger")
    artifact("NodeRegistry")
    if job.storage.backend == "ipfs":  # the daemon must answer before anything starts
        from lineage.store.ipfs import open_store

        open_store(api=job.storage.api)
    return device


def run_job(job: JobFile, job_path: Path, run_dir: Path, rpc: str | None, cb: Callbacks) -> RunRecord:
    """Train `job`, recording every outer step; returns the final run record (status
    `completed`, or `stopped` after SIGINT/SIGTERM)."""
    preflight(job, run_dir, rpc)
    rpc = rpc or job.chain.rpc
    embedded = rpc is None

    created = not run_dir.exists()
    record: RunRecord | None = None
    with ExitStack() as stack:
        try:
            stop = stack.enter_context(stop_on_signals(cb))
            run_dir.mkdir(parents=True, exist_ok=True)
            chain = _open_chain(stack, run_dir / CHAIN_STATE if embedded else None, rpc,
                                job.chain.chain_id, job.world_size, job.chain.policy(embedded))
            submitter, slot_keys = _keys_for(job, chain.chain_id, embedded, cb.warn)
            shutil.copyfile(job_path, run_dir / "job.toml")
            ledger = guard(lambda: _deploy_and_stake(chain, submitter, slot_keys, job.chain.stake_wei,
                                                     job.chain.deployment), "deploying the ledger")
            blocks = Path(job.storage.path) if job.storage.path else Path("blocks")
            record = RunRecord(
                name=job.name, chain_id=chain.chain_id, rpc=None if embedded else rpc,
                chain_state=CHAIN_STATE if embedded else None, registry=ledger.addresses["registry"],
                ledger=ledger.addresses["ledger"], blocks=str(blocks), ipfs_api=job.storage.api,
                job_dir=str(job_path.resolve().parent),
            )
            sink = _sink(job, record, run_dir, ledger, submitter, slot_keys, cb)
            return _train(sink, job, record, run_dir, stop)
        except BaseException as exc:
            if record is not None and record.run_id:
                _record_end(record, run_dir, exc)
            elif created:
                stack.close()  # stop anvil before removing its state
                shutil.rmtree(run_dir, ignore_errors=True)
            raise


def resume_job(run_dir: Path, rpc: str | None, cb: Callbacks) -> RunRecord:
    """Continue the run in `run_dir` (stopped, failed or crashed) from the last step committed
    on its chain, with the job file it was started with; as `dlx resume JOB` does for the
    queue, the ranks restart from that checkpoint's committed state."""
    record, job = resumable(run_dir)
    check_local(job)
    refuse_cheat_off_local_chain(job, rpc or record.rpc, record.chain_id)
    embedded = not (rpc or record.rpc)
    with ExitStack() as stack:
        stop = stack.enter_context(stop_on_signals(cb))
        state = run_dir / (record.chain_state or CHAIN_STATE)
        if embedded and not state.is_file():
            raise ConfigError(f"the run's chain state file is missing: {state}")
        chain = _open_chain(stack, state if embedded else None, rpc or record.rpc, record.chain_id,
                            job.world_size, job.chain.policy(embedded))
        submitter, slot_keys = _keys_for(job, chain.chain_id, embedded, cb.warn)
        ledger = Ledger(chain, record.registry, record.ledger)
        head, step = guard(lambda: ledger.head(record.run_id), f"runHead({record.run_id})")
        checkpoint = cid_from_digest(head, DAG_CBOR)
        record.head, record.steps = str(checkpoint), step  # the chain's head, whatever run.json said
        if step >= job.outer.steps:  # it crashed after its last commit: only run.json lagged
            record.status = "completed"
            record.save(run_dir)
            return record
        cb.resuming(step, checkpoint)
        mark_resume(run_dir, step)  # the stopped attempt's rounds past the head: kept, marked
        sink = _sink(job, record, run_dir, ledger, submitter, slot_keys, cb)
        sink.resume_from(checkpoint)
        manifest = get_manifest(sink.store, checkpoint)
        start = [resume_point(sink.store, manifest, job, rank) for rank in range(job.world_size)]
        record.status = "running"
        record.save(run_dir)
        try:
            return _train(sink, job, record, run_dir, stop, start)
        except BaseException as exc:
            _record_end(record, run_dir, exc)
            raise


def _deploy_and_stake(chain: Chain, submitter: LocalAccount, slot_keys: list[LocalAccount], stake: int,
                      deployment: str | None = None) -> Ledger:
    """A registry and ledger of the run's own, or the deployment file's (`[chain] deployment`,
    `dlx deploy`), each slot's node staked on it."""
    ledger = open_deployment(chain, Path(deployment)) if deployment else Ledger.deploy(chain, submitter)
    for node in {k.address: k for k in slot_keys}.values():
        ledger.registry.ensure_staked(node, stake)
    return ledger


def resumable(run_dir: Path) -> tuple[RunRecord, JobFile]:
    """The record and job file of a run that can resume (ConfigError otherwise), checked
    before anything starts."""
    record = RunRecord.load(run_dir)
    job = load_job_file(run_dir / "job.toml", Path(record.job_dir) if record.job_dir else None)
    if not record.run_id:
        raise ConfigError(f"run directory {run_dir} committed nothing on chain: train the job again")
    if record.status == "completed":
        raise ConfigError(f"run {record.run_id} in {run_dir} already completed all {record.steps} steps")
    return record, job


def resume_point(store: Any, manifest: Any, job: JobConfig, rank: int) -> Any:
    """Where `rank` restarts from a committed checkpoint (its `lineage.store.manifest.Manifest`):
    its stage's outer shard and, where the round can be re-run (synchronous rules with
    round-start states), its own start state and claimed contribution
    (`trainer.control.ResumePoint`). The job queue's rank tasks resume from the same."""
    from lineage.store.roundstate import read_start_state
    from lineage.store.unixfs import read_bytes
    from trainer.control import ResumePoint, carried

    replica, stage = divmod(rank, job.parallel.stages)
    shard = read_bytes(store, manifest.stages[stage])
    counters = carried(manifest.metrics, rank)  # bytes sent, modelled comm time, tokens count on
    if not manifest.replay or job.outer.delay != 0:  # no start states to re-run the round from
        return ResumePoint(step=manifest.step, shard=shard, counters=counters)
    if replica not in manifest.replica_ids(job.parallel.replicas):  # absent from that step: fresh state
        return ResumePoint(step=manifest.step, shard=shard, counters=counters)
    row = manifest.row(replica)
    return ResumePoint(step=manifest.step, shard=shard, state=read_start_state(store, manifest, row, stage),
                       claimed=read_bytes(store, manifest.contributions[row][stage]), counters=counters)


def _open_chain(stack: ExitStack, state: Path | None, rpc: str | None, chain_id: int | None,
                world: int, policy: TxPolicy | None = None) -> Chain:
    """The run's chain: the embedded anvil on `state` (in its own process group, dying with
    this process; stopped when `stack` closes), or the chain at `rpc`; sending with `policy`
    (the job's `[chain]` confirmations, outage budget and fee cap)."""
    if state is None:
        return Chain(rpc, chain_id, policy)  # type: ignore[arg-type]
    anvil = stack.enter_context(Anvil(state_path=state, accounts=world + 1, own_group=True))
    return PersistedChain(anvil, chain_id, policy)


def _sink(job: JobFile, record: RunRecord, run_dir: Path, ledger: Ledger, submitter: LocalAccount,
          slot_keys: list[LocalAccount], cb: Callbacks) -> LedgerSink:
    store = record.open_store(run_dir)
    data, prepared = prepare_dataset(job.data, job.model.vocab_size, store.put)  # tokenized in preflight
    training = job.training_config().with_prepared(prepared)
    config = RunConfig.of_job(job, code_hash(), data).to_doc()
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    cheats = job.test_hooks()  # test-only misbehaviour, injected; None when honest
    signer = local_signer(slot_keys, domain, cheats or HONEST, job.parallel.stages)
    if cheats is not None:
        signer = cheats.signer(signer, slot_keys, domain, run_dir)
    return LedgerSink(
        job=training, config=config, store=store, ledger=ledger,
        submitter=submitter, slot_nodes=[k.address for k in slot_keys], signer=signer, record=record,
        run_dir=run_dir, challenge_window=job.chain.challenge_window_s,
        min_stake=job.chain.min_stake_wei, arbiters=job.chain.arbiters, quorum=job.chain.quorum,
        independence=job.chain.independence, on_progress=cb.progress,
        on_committed=Retention.for_job(job, record.open_store(run_dir), ledger, record, cb.committed),
        tracking=job.tracking, hooks=cheats or HONEST, max_pending=job.chain.max_pending,
    )


def _train(sink: LedgerSink, job: JobFile, record: RunRecord, run_dir: Path, stop: Any,
           start: list[Any] | None = None) -> RunRecord:
    """Run the ranks to the end or to a requested stop; record how the run ended."""
    outcome = train_local(sink.job, sink, stop=stop, start=start, hooks=job.test_hooks())
    sink.finish()  # the chain's head is still the last step committed (a reorganisation repaired)
    record.status = outcome
    record.save(run_dir)
    return record


def _record_end(record: RunRecord, run_dir: Path, exc: BaseException) -> None:
    """A run that ended early on `exc`: `stopped` when interrupted (a second Ctrl-C), else
    `failed`. run.json already names the last step the chain accepted (the sink saves it
    after each commit); either way the run can resume from there."""
    record.status = "stopped" if isinstance(exc, KeyboardInterrupt) else "failed"
    record.save(run_dir)
