"""Celery tasks: one task per rank of a training job.

A job of R x S ranks is R x S `run_rank` tasks on the `train` queue. Each task is one
rank on one worker node:

1. it joins the job's rendezvous record in Redis with its node address; rank 0 also
   publishes its TCPStore address; all wait until the world is complete or the deadline
   passes (then the job fails saying how many slots were needed and how many came); the
   task's rank is then its ticket, and each task trains the slot `replica_aligned` gives it,
   so that a node's slots lie in one replica (the ledger's independence rule; ticket 0 stays
   rank 0, the rendezvous host);
2. it runs the rank in a child process (torch.distributed over gloo), relaying events;
3. every rank attests its own work: when rank 0 publishes the claim for its slot, the
   rank checks the claimed contribution, data shard and loss against what it computed
   itself and only then signs the EIP-712 `Contribution` with its node key;
4. rank 0 also hosts the step sink: blocks, manifest, signatures collected from Redis,
   `commitStep`; progress goes to the job record, which `dlx status` reads.

Tasks are idempotent: a task of a finished job or of an older attempt exits at once, and
the sink never commits a step the ledger already holds. A rank whose peer dies fails
within the collective timeout, naming the lost rank; `dlx resume` starts a new attempt
from the last checkpoint committed on chain.
"""

from __future__ import annotations

import os
import threading
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

from celery.utils.log import get_task_logger

from lineage.chain.anvil import free_port
from lineage.chain.attest import ContributionClaim, Domain, loss_micros, shard_digest

from .celery_app import app, redis_url
from .jobs import TERMINAL, WORKER_PATIENCE_S, JobError, JobStore, connect
from .node import NodeIdentity

log = get_task_logger(__name__)
POLL_S = 0.1
SIGNATURE_TIMEOUT_S = 300.0
HEARTBEAT_S = 1.0      # every rank task refreshes its heartbeat this often ...
HEARTBEAT_TTL_S = 6.0  # ... and is declared lost when it has not for this long


def _store() -> JobStore:
    return JobStore(connect(redis_url(), patience_s=WORKER_PATIENCE_S))


class StopFlag:
    """Picklable: polled by rank 0's training process at inner-step boundaries."""

    def __init__(self, url: str, job_id: str) -> None:
        self.url, self.job_id = url, job_id
        self._r: Any = None

    def __call__(self) -> bool:
        if self._r is None:
            import redis

            self._r = redis.Redis.from_url(self.url, socket_timeout=5)
        try:
            return bool(self._r.exists(JobStore.key(self.job_id, "cancel")))
        except Exception:  # a Redis hiccup must not kill training; cancel is best effort
            return False


class RedisSigner:
    """Rank 0's side of attestation: publish claims, sign its own slot, collect the rest."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, me: NodeIdentity, domain: Domain) -> None:
        self.store, self.job_id, self.attempt, self.me, self.domain = store, job_id, attempt, me, domain

    def __call__(self, step: int, claims: list[ContributionClaim]) -> list[bytes]:
        self.store.publish_claims(self.job_id, self.attempt, step, {i: c.as_doc() for i, c in enumerate(claims)})
        self.store.put_signature(self.job_id, self.attempt, step, 0, claims[0].sign(self.domain, self.me.account.key))
        deadline = time.monotonic() + SIGNATURE_TIMEOUT_S
        while True:
            sigs = self.store.signatures(self.job_id, self.attempt, step)
            if len(sigs) == len(claims):
                return [sigs[i] for i in range(len(claims))]
            if self.store.state(self.job_id) in TERMINAL:
                raise JobError(f"job ended while step {step} waited for attestations")
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(claims))) - set(sigs))
                raise JobError(f"step {step}: no attestation from slots {missing} within {SIGNATURE_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)


def replica_aligned(joined: dict[int, str], replicas: int, stages: int) -> list[int]:
    """The tickets (the rank each task was queued as) in the order of the ranks they train.

    The ledger lets a node sign slots of one replica per step only, and a worker with several
    slots takes several tickets, whichever the queue hands it; so each node's tickets are
    packed into replicas together, largest groups first (ticket 0's node first, keeping
    ticket 0 at rank 0: it hosts the rendezvous store). Every task computes the same order
    from the same complete `joined` map (ticket -> node). A node holding more tickets than
    a replica has stages, or whose group fits no replica's room, spills into the next room
    (and the ledger refuses its steps, naming it)."""
    groups: dict[str, list[int]] = {}
    for ticket in sorted(joined):
        groups.setdefault(joined[ticket], []).append(ticket)
    first, *rest = sorted(groups.values(), key=lambda g: (g[0] != 0, -len(g), g[0]))
    rooms: list[list[int]] = [first[:stages], *([] for _ in range(replicas - 1))]
    spill = first[stages:]
    for group in rest:
        room = next((r for r in rooms if len(r) + len(group) <= stages), None)
        if room is None:
            spill.extend(group)
        else:
            room.extend(group)
    for ticket in spill:
        next(r for r in rooms if len(r) < stages).append(ticket)
    return [t for room in rooms for t in room]


@app.task(bind=True, name="workers.tasks.run_rank", acks_late=True)
def run_rank(self: Any, job_id: str, rank: int, attempt: int) -> dict[str, Any]:
    """Run `rank` of job `job_id` (attempt `attempt`) on this worker node."""
    store = _store()
    rec = store.get(job_id)
    if rec["state"] in TERMINAL or rec["attempt"] != attempt:
        return {"rank": rank, "skipped": True}
    # Idempotence under redelivery (acks_late): the first task to take the rank's lease runs
    # it; a duplicate finds a live owner, or a world formed without it, and leaves.
    if rec["state"] != "queued":  # the world formed before this delivery
        return {"rank": rank, "skipped": True, "duplicate": True}
    token = f"{self.request.hostname}/{uuid.uuid4().hex[:8]}"
    if not store.take_rank(job_id, attempt, rank, token, HEARTBEAT_TTL_S, HEARTBEAT_S):
        log.info("job %s rank %s already runs in another task: duplicate delivery skipped", job_id, rank)
        return {"rank": rank, "skipped": True, "duplicate": True}
    if store.state(job_id) != "queued":
        store.release_rank(job_id, attempt, rank, token)
        return {"rank": rank, "skipped": True, "duplicate": True}
    me = NodeIdentity.from_env()
    beat = Heartbeat(store, job_id, attempt, rank, token)
    try:
        return _run(store, job_id, rank, attempt, rec, me, beat)
    except BaseException as exc:
        text = " ".join(str(exc).split()) or exc.__class__.__name__
        known = text.startswith(("rank ", "lost rank")) or "rendezvous" in text
        store.finish(job_id, "failed", text if known else f"rank {rank} ({me.address}) failed: {text}")
        raise
    finally:
        beat.stop()


class Heartbeat:
    """Keeps this rank's lease alive, from its own thread: the task's thread may block
    for long (importing torch, rank 0's sink waiting for attestations), which is not a
    sign of a lost worker; a dead worker process is.

    After Redis was unreachable (a restart), peers' leases may have lapsed although their
    workers live: they renew them within a beat or two, so a rank judges its peers only
    once Redis has answered without trouble for a whole TTL (`trusted`)."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, rank: int, token: str) -> None:
        self.store, self.job_id, self.attempt, self.rank, self.token = store, job_id, attempt, rank, token
        self.usurped = False  # another task holds this rank's lease: we must stop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _beat(self, ttl_s: float) -> None:
        if not self.store.heartbeat(self.job_id, self.attempt, self.rank, self.token, ttl_s):
            self.usurped = True

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat(HEARTBEAT_TTL_S)
            except Exception:  # Redis away longer than the client's patience: keep trying
                log.warning("heartbeat for job %s rank %s failed", self.job_id, self.rank)

    @property
    def trusted(self) -> bool:
        """Whether a missing peer lease means a lost peer (and not a recent Redis outage)."""
        return self.store.calm_s() >= HEARTBEAT_TTL_S

    def stop(self, final_ttl_s: float | None = None) -> None:
        """Stop beating; `final_ttl_s` leaves one long beat (a finished rank is never lost)."""
        self._stop.set()
        self._thread.join(5)
        if final_ttl_s is not None:
            self._beat(final_ttl_s)


def _rendezvous(store: JobStore, job_id: str, rank: int, attempt: int, rec: dict[str, Any], me: NodeIdentity,
                world: int) -> tuple[dict[int, str], str] | None:
    """Join the job's rendezvous and wait for all `world` rank slots and rank 0's store
    address; returns (ticket -> node address, the store's host:port), or None when the
    job ended meanwhile. Rank 0 publishes the address of the TCPStore it will host."""
    store.join(job_id, attempt, rank, me.address)
    if rank == 0:
        store.publish_store_address(job_id, attempt, f"{me.host}:{_store_port(me.host)}")
    deadline = time.monotonic() + float(rec.get("rendezvous_s", 60))
    while True:
        joined = store.joined(job_id, attempt)
        address = store.store_address(job_id, attempt)
        if len(joined) >= world and address:
            return joined, address
        if store.state(job_id) in TERMINAL:
            return None
        if time.monotonic() > deadline:
            raise JobError(f"rendezvous timed out: the job needs {world} rank slots, "
                           f"{len(joined)} joined within {rec.get('rendezvous_s', 60)} s")
        time.sleep(POLL_S)


def _run(store: JobStore, job_id: str, rank: int, attempt: int, rec: dict[str, Any], me: NodeIdentity,
         beat: Heartbeat) -> dict[str, Any]:
    from trainer.config import load_job
    from workers.jobfile import JobFile, with_init_model
    from workers.local import refuse_cheat_off_local_chain

    job = load_job(with_init_model(tomllib.loads(rec["job_toml"]), Path(rec.get("job_dir", "."))), JobFile)
    refuse_cheat_off_local_chain(job, rec["rpc"], int(rec["chain_id"]), queue=True)  # before anything starts
    world = job.world_size
    met = _rendezvous(store, job_id, rank, attempt, rec, me, world)
    if met is None:
        return {"rank": rank, "skipped": True}
    joined, address = met
    by_ticket = [joined[i] for i in range(world)]  # liveness is kept per task (ticket)
    order = replica_aligned(joined, job.parallel.replicas, job.parallel.stages)
    slot = order.index(rank)  # the rank this task trains and attests
    nodes = [joined[t] for t in order]
    if rank == 0:
        store.update(job_id, state="running", nodes=nodes, world=world)

    training = _training_config(rec, job)  # the token file fetched by CID from the run's store
    sink = _rank0_sink(store, job_id, attempt, rec, job, training, me, nodes) if rank == 0 else None
    start = _resume_point(rec, job, slot) if rec.get("resume_from") else None
    from trainer import cheat
    from trainer.engine import RankControl, RankHooks
    from trainer.launch import train_rank
    from trainer.supervisor import ChildOptions, Supervisor

    gpu = _GPUS.take()
    control = RankControl(stop_requested=StopFlag(redis_url(), job_id) if rank == 0 else None,
                          cancellable=True, start=start, emit_contributions=True, shard_digest=shard_digest,
                          timeout_s=float(rec.get("collective_timeout_s", 60)), gpu=gpu,
                          hooks=cheat.hooks(job.cheat, job) or RankHooks())  # a test's cheats, injected
    sup = Supervisor()
    try:
        proc = sup.start(slot, train_rank, (slot, world, f"tcp://{address}", training, control),
                         name=f"dlx-rank-{slot}", daemon=False,
                         options=ChildOptions(log=str(rank_log(rec["run_dir"], slot, attempt)), ignore_sigint=True))
    except BaseException:
        _GPUS.give(gpu)
        sup.close(kill=True)
        raise
    pending: dict[int, Any] = {}  # step -> my Contribution, awaiting rank 0's claim
    last_check = last_state = 0.0
    try:
        while True:
            if time.monotonic() - last_check > HEARTBEAT_S:
                last_check = time.monotonic()
                _check_peers(store, job_id, attempt, rank, me, beat, order, by_ticket)
            event = sup.next_event(POLL_S)
            if event is None:
                _attest_pending(store, job_id, attempt, slot, me, pending, rec)
                if proc.is_alive():
                    if time.monotonic() - last_state > HEARTBEAT_S:
                        last_state = time.monotonic()
                        state = store.state(job_id)
                        if state in TERMINAL:
                            return {"rank": rank, "state": state}
                    continue
                # Its last events ("done" among them) may have landed after the wait gave up.
                event = sup.next_event(POLL_S)
                if event is None:
                    raise JobError(_blame(store, job_id, attempt, world, by_ticket, rank, me,
                                          f"training process exited with code {proc.exitcode}"))
            kind, _, payload = event
            if kind == "contribution":
                step, contribution = payload
                pending[step] = contribution
                _attest_pending(store, job_id, attempt, slot, me, pending, rec)
            elif kind in ("genesis", "step", "progress") and sink is not None:
                _report(store, job_id, sink, kind, payload)
            elif kind == "error":
                raise JobError(_blame(store, job_id, attempt, world, by_ticket, rank, me, str(payload)))
            elif kind in ("cancelled", "done"):
                return _finish(store, job_id, attempt, rank, slot, me, pending, rec, beat,
                               "cancelled" if kind == "cancelled" else "completed")
    finally:
        sup.close(kill=True)
        _GPUS.give(gpu)


def _check_peers(store: JobStore, job_id: str, attempt: int, rank: int, me: NodeIdentity, beat: Heartbeat,
                 order: list[int], by_ticket: list[str]) -> None:
    """Fail the round when another task took this rank's lease or a peer rank stopped
    answering (once Redis has been reachable long enough to trust a missing lease)."""
    if beat.usurped:
        raise JobError(f"rank {rank} ({me.address}): another task took over this rank's lease")
    lost = [r for r in store.lost_ranks(job_id, attempt, len(by_ticket)) if r != rank]
    if lost and beat.trusted:  # asked after the read: it may have waited out an outage
        who = ", ".join(f"rank {order.index(r)} ({by_ticket[r]})" for r in lost)
        raise JobError(f"lost {who}: its worker stopped answering; the round failed")


def _report(store: JobStore, job_id: str, sink: Any, kind: str, payload: Any) -> None:
    """Rank 0: hand a genesis, step or progress event to the sink, and the job's record."""
    if kind == "genesis":
        sink.on_genesis(payload)
    elif kind == "step":
        sink.on_step(payload)
        summary = {"step": payload.step, "head": sink.record.head, "eval_loss": payload.metrics.get("eval_loss"),
                   "bytes_sent": payload.metrics.get("bytes_sent", 0)}
        # step_N: each step's summary stays, so `dlx status --follow` misses none.
        store.update(job_id, run_id=sink.record.run_id, **summary, **{f"step_{payload.step}": summary})
    else:
        sink.on_progress(payload)  # metrics.jsonl, trackers, divergence
        store.update(job_id, outer_step=payload.outer_step, inner_step=payload.inner_step,
                     loss=payload.loss, outer_steps=payload.outer_steps, inner_steps=payload.inner_steps,
                     lr=payload.lr, tokens_per_s=payload.tokens_per_s, eta_s=payload.eta_s)


def _finish(store: JobStore, job_id: str, attempt: int, rank: int, slot: int, me: NodeIdentity,
            pending: dict[int, Any], rec: dict[str, Any], beat: Heartbeat, state: str) -> dict[str, Any]:
    """The rank's training process ended (`completed`) or stopped on a cancel (`cancelled`):
    stop beating, leaving one long beat (ended, not lost: peers may still be finishing the
    step), attest the steps gathered before the end so they still get committed, and let
    rank 0 record the job's end."""
    beat.stop(final_ttl_s=3600)
    while pending:
        _attest_pending(store, job_id, attempt, slot, me, pending, rec, wait=True)
    if rank == 0:
        store.finish(job_id, state)
    return {"rank": rank, "state": state}


class GpuPool:
    """This worker's GPUs, one per concurrent rank task (a rank with none runs on the CPU,
    or fails a `device = "cuda"` job naming itself: trainer.engine.agree_device)."""

    def __init__(self) -> None:
        self._free: list[int] | None = None
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            if self._free is None:
                self._free = list(range(gpu_count()))
            return self._free.pop(0) if self._free else None

    def give(self, gpu: int | None) -> None:
        if gpu is not None:
            with self._lock:
                assert self._free is not None
                self._free.append(gpu)
                self._free.sort()


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_GPUS = GpuPool()


def rank_log(run_dir: str | Path, rank: int, attempt: int) -> Path:
    """Where a rank's training process writes its output, on the worker that ran it
    (`dlx logs JOB` reads these; on the local stack every worker shares the run directory)."""
    return Path(run_dir) / "logs" / f"rank-{rank}-attempt-{attempt}.log"


def _store_port(host: str) -> int:
    """A free port for rank 0's TCPStore: the first free one of DLX_STORE_PORTS ("29500-29509",
    for firewalls; `dlx worker --store-ports`), else any free port."""
    import socket

    spec = os.environ.get("DLX_STORE_PORTS", "").strip()
    if not spec:
        return free_port(host)
    first, _, last = spec.partition("-")
    for port in range(int(first), int(last or first) + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise JobError(f"rank 0: no free TCPStore port in DLX_STORE_PORTS={spec} on {host}")


def _blame(store: JobStore, job_id: str, attempt: int, world: int, nodes: list[str], rank: int,
           me: NodeIdentity, error: str) -> str:
    """Name the lost rank when a peer vanished (its heartbeat expires), else this rank's error."""
    deadline = time.monotonic() + HEARTBEAT_TTL_S + 1
    while time.monotonic() < deadline:
        lost = [r for r in store.lost_ranks(job_id, attempt, world) if r != rank]
        if lost:
            who = ", ".join(f"rank {r} ({nodes[r]})" for r in lost)
            return f"lost {who}: its worker stopped answering; the round failed"
        if store.state(job_id) in TERMINAL:
            break
        time.sleep(0.5)
    return f"rank {rank} ({me.address}) failed: {error}"


def _attest_pending(store: JobStore, job_id: str, attempt: int, rank: int, me: NodeIdentity,
                    pending: dict[int, Any], rec: dict[str, Any], wait: bool = False) -> None:
    """Sign rank 0's claim for my slot once it is published, if it matches my own work."""
    if rank == 0:
        pending.clear()  # rank 0 signs its own slot inside the sink
        return
    from workers.sink import content_digest

    domain = Domain(int(rec["chain_id"]), rec["ledger"])
    deadline = time.monotonic() + SIGNATURE_TIMEOUT_S
    for step in sorted(pending):
        while True:
            claim_d = store.claim(job_id, attempt, step, rank)
            if claim_d is not None or not wait or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        if claim_d is None:
            if wait:
                raise JobError(f"rank {rank}: rank 0 never published the claim for step {step}")
            return
        mine = pending.pop(step)
        claim = ContributionClaim.from_doc(claim_d)
        # The shard digest too: this rank co-signs only the new stage shard it computed itself.
        expected = (content_digest(mine.data), mine.data_shard, loss_micros(mine.loss), mine.new_shard,
                    divmod(rank, int(rec["stages"])))
        got = (claim.contribution, claim.data_shard, claim.loss_micros, claim.new_shard, (claim.replica, claim.stage))
        if expected != got:
            raise JobError(f"rank {rank} refuses to attest step {step}: rank 0's claim differs from its own work")
        store.put_signature(job_id, attempt, step, rank, claim.sign(domain, me.account.key))


def _blocks(rec: dict[str, Any]) -> Path:
    """The run's blockstore directory (the stack's, shared by its workers)."""
    return Path(rec["blocks"]) if Path(rec["blocks"]).is_absolute() else Path(rec["run_dir"]) / rec["blocks"]


def _training_config(rec: dict[str, Any], job: Any) -> Any:
    """The job's training config, reading the token file the job record names, fetched by
    CID from the run's store into this worker's data cache (re-hashed: a node trains on the
    data named on chain or not at all). A job queued before data records: as configured."""
    from lineage.store.blockstore import Blockstore
    from lineage.store.datasets import DataRecord, fetch_prepared

    training = job.training_config()
    if "data" not in rec:
        return training
    return training.with_prepared(fetch_prepared(Blockstore(_blocks(rec)), DataRecord.from_doc(rec["data"])))


def _rank0_sink(store: JobStore, job_id: str, attempt: int, rec: dict[str, Any], job: Any, training: Any,
                me: NodeIdentity, nodes: list[str]) -> Any:
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from lineage.chain.runrecord import RunRecord
    from lineage.store.blockstore import Blockstore
    from lineage.store.datasets import DataRecord
    from lineage.store.retention import Retention
    from lineage.store.runconfig import RunConfig
    from trainer import cheat
    from trainer.artifacts import code_hash
    from workers.sink import HONEST, LedgerSink

    chain = Chain(rec["rpc"], int(rec["chain_id"]))
    ledger = Ledger(chain, rec["registry"], rec["ledger"])
    run_dir = Path(rec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        record = RunRecord.load(run_dir)
    except Exception:
        record = RunRecord(name=job.name, chain_id=chain.chain_id, rpc=rec["rpc"], chain_state=None,
                           registry=rec["registry"], ledger=rec["ledger"], blocks=rec["blocks"],
                           stack=rec.get("stack"))
    data = DataRecord.from_doc(rec["data"]) if "data" in rec else None
    config = RunConfig.of_job(job, code_hash(), data).to_doc()
    domain = Domain(chain.chain_id, ledger.ledger.address)
    sink = LedgerSink(
        job=training, config=config, store=Blockstore(record.blocks_dir(run_dir)), ledger=ledger,
        submitter=me.account, slot_nodes=nodes, signer=RedisSigner(store, job_id, attempt, me, domain),
        record=record, run_dir=run_dir, challenge_window=job.chain.challenge_window_s,
        min_stake=job.chain.min_stake_wei, arbiters=job.chain.arbiters, quorum=job.chain.quorum,
        independence=job.chain.independence, tracking=job.tracking,
        on_committed=Retention.for_job(job, Blockstore(record.blocks_dir(run_dir)), ledger, record),
        hooks=cheat.hooks(job.cheat, job) or HONEST,  # a test's coordinator cheats, injected
    )
    if rec.get("resume_from"):
        sink.resume_from(rec["resume_from"]["checkpoint"])
    return sink


def _resume_point(rec: dict[str, Any], job: Any, rank: int) -> Any:
    from lineage.store.blockstore import Blockstore
    from lineage.store.manifest import get_manifest
    from workers.local import resume_point

    store = Blockstore(_blocks(rec))
    return resume_point(store, get_manifest(store, rec["resume_from"]["checkpoint"]), job, rank)


@app.task(name="workers.tasks.replay", acks_late=True)
def replay(store_spec: str, items: list[list[Any]], tolerance: float) -> list[dict[str, Any]]:
    """Replay (checkpoint, replica) items on this worker (the `verify` queue); read-only, so
    a redelivery only replays again. See workers.verifyq."""
    from .verifyq import replay_chunk

    return replay_chunk(store_spec, [(c, r) for c, r in items], tolerance)


__all__ = ["RedisSigner", "StopFlag", "replay", "replica_aligned", "run_rank"]
