"""Celery tasks: one task per rank of a training job.

A job of R x S ranks is R x S `run_rank` tasks on the `train` queue. Each task is one
rank on one worker node:

1. it joins the job's rendezvous record in Redis with its node address; rank 0 also
   publishes its TCPStore address; all wait until the world is complete or the deadline
   passes (then the job fails saying how many slots were needed and how many came, or an
   elastic job starts with the complete replicas that came: workers/queue/rendezvous.py); each
   task trains the slot `replica_aligned` gives it, so that a node's slots lie in one
   replica (the ledger's independence rule; ticket 0 stays rank 0, the rendezvous host);
2. it runs the rank in a child process (torch.distributed over gloo), relaying events;
3. every rank attests its own work: when rank 0 publishes the claim for its slot, the
   rank checks the claimed contribution, data shard and loss against what it computed
   itself and only then signs the EIP-712 `Contribution` with its node key;
4. rank 0 also hosts the step sink: blocks, manifest, signatures collected from Redis,
   `commitStep`; progress goes to the job record, which `dlx status` reads.

Tasks are idempotent: a task of a finished job or of an older attempt exits at once, and
the sink never commits a step the ledger already holds. A rank whose peer dies fails
within the collective timeout, naming the lost rank; `dlx resume` starts a new attempt
from the last checkpoint committed on chain. An elastic job (`[parallel] min_replicas`
below `replicas`) instead re-forms its world around the lost replica and goes on, and
queues new tickets a returning or new worker takes to grow it back (workers/queue/membership.py).
"""

from __future__ import annotations

import functools
import threading
import time
import tomllib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery.utils.log import get_task_logger

from lineage.chain.attest import (
    ContributionClaim,
    Domain,
    loss_micros,
    replica_bitmap,
    shard_digest,
)
from trainer.control import RENDEZVOUS_S
from trainer.launch import gpu_count

from .app import app, redis_url
from .jobs import (
    HEARTBEAT_S,
    HEARTBEAT_TTL_S,
    TERMINAL,
    WORKER_PATIENCE_S,
    JobError,
    JobRecord,
    JobStore,
    connect,
    settle_run_file,
)
from .membership import EpochRecord, GrowFlag, Members, Regroup, join_epoch, run_blocks
from .node import NodeIdentity
from .rendezvous import elastic_rendezvous, rendezvous, replica_aligned, spare_ticket

log = get_task_logger(__name__)
POLL_S = 0.1
SIGNATURE_TIMEOUT_S = 300.0


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
    """Rank 0's side of attestation: publish claims, sign its own slot, collect the rest.
    Claims and signatures are keyed by (epoch, step, replica, stage); an elastic job's
    world re-forming (`members.wanted()` past `epoch`) abandons the step (`StepAbandoned`)."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, me: NodeIdentity, domain: Domain,
                 members: Members | None = None) -> None:
        self.store, self.job_id, self.attempt, self.me, self.domain = store, job_id, attempt, me, domain
        self.members = members
        self.epoch = 0

    def __call__(self, step: int, claims: list[ContributionClaim]) -> list[bytes]:
        slots = [(c.replica, c.stage) for c in claims]
        e = self.epoch
        self.store.publish_claims(self.job_id, self.attempt, e, step, {slot: c.as_doc() for slot, c in zip(slots, claims, strict=True)})
        self.store.put_signature(self.job_id, self.attempt, e, step, slots[0],
                                 claims[0].sign(self.domain, self.me.account.key))
        deadline = time.monotonic() + SIGNATURE_TIMEOUT_S
        while True:
            sigs = self.store.signatures(self.job_id, self.attempt, e, step)
            if all(slot in sigs for slot in slots):
                return [sigs[slot] for slot in slots]
            if self.store.state(self.job_id) in TERMINAL:
                raise JobError(f"job ended while step {step} waited for attestations")
            if self.members is not None and self.members.wanted() > e:
                raise StepAbandoned(f"step {step} of epoch {e} dropped: the world re-forms without a lost replica")
            if time.monotonic() > deadline:
                missing = [f"{r},{st}" for r, st in slots if (r, st) not in sigs]
                raise JobError(f"step {step}: no attestation from slots {missing} within {SIGNATURE_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)


@app.task(bind=True, name="workers.queue.tasks.run_rank", acks_late=True)
def run_rank(self: Any, job_id: str, rank: int, attempt: int) -> dict[str, Any]:
    """Run `rank` of job `job_id` (attempt `attempt`) on this worker node."""
    store = _store()
    rec = store.get(job_id)
    if rec["state"] in TERMINAL or rec["attempt"] != attempt:
        return {"rank": rank, "skipped": True}
    # Idempotence under redelivery (acks_late): the first task to take the rank's lease runs
    # it; a duplicate finds a live owner, or a world formed without it, and leaves.
    # An elastic job's ticket for a lost replica, or one its first world formed without, joins a running world.
    joiner = rank >= int(rec["world"]) or spare_ticket(store, job_id, attempt, rank)
    if rec["state"] != "queued" and not joiner:  # the world formed before this delivery
        return {"rank": rank, "skipped": True, "duplicate": True}
    token = f"{self.request.hostname}/{uuid.uuid4().hex[:8]}"
    if not store.take_rank(job_id, attempt, rank, token, HEARTBEAT_TTL_S, HEARTBEAT_S):
        log.info("job %s rank %s already runs in another task: duplicate delivery skipped", job_id, rank)
        return {"rank": rank, "skipped": True, "duplicate": True}
    if store.state(job_id) != "queued" and not joiner:
        store.release_rank(job_id, attempt, rank, token)
        return {"rank": rank, "skipped": True, "duplicate": True}
    me = NodeIdentity.from_env()
    beat = Heartbeat(store, job_id, attempt, rank, token)
    try:
        return _run(store, job_id, rank, attempt, rec, me, beat, joiner)
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


def _run(store: JobStore, job_id: str, rank: int, attempt: int, rec: JobRecord, me: NodeIdentity,
         beat: Heartbeat, joiner: bool) -> dict[str, Any]:
    from trainer.config import load_job
    from workers.run.jobfile import job_file_class, with_init_model
    from workers.run.local import refuse_cheat_off_local_chain

    job = load_job(with_init_model(tomllib.loads(rec["job_toml"]), Path(rec.get("job_dir", "."))), job_file_class())
    refuse_cheat_off_local_chain(job, rec["rpc"], int(rec["chain_id"]), queue=True)  # before anything starts
    world = job.world_size
    task = RankTask(store, job_id, attempt, rank, rec, me, beat, job)
    if joiner:  # a ticket queued for a lost replica, or left out of the first world: wait to be seated
        return task.join()
    met = _first_world(task, world)
    if met is None:
        return {"rank": rank, "skipped": True}
    if not met[0]:  # an elastic job's first world formed without this ticket: it joins later
        return task.join()
    order, nodes, address, by_ticket = met
    slot = order.index(rank)  # the rank this task trains and attests
    if slot == 0:
        store.update(job_id, state="running", nodes=nodes, world=world)
    S = job.parallel.stages
    task.seat = divmod(slot, S)
    present = tuple(range(len(order) // S))  # an elastic job may start with fewer than R replicas
    if task.elastic and slot == 0:
        resume: dict[str, Any] = dict(rec.get("resume_from") or {})
        task.members.publish(EpochRecord(0, present, {t: order.index(t) for t in order},
                                         {t: divmod(order.index(t), S) for t in order},
                                         int(resume.get("step", 0)), str(resume.get("checkpoint", ""))))
    start = _resume_point(rec, job, slot) if rec.get("resume_from") else None
    return task.run(slot, len(order), f"tcp://{address}", start, members=present if task.elastic else None,
                    order=order, by_ticket=by_ticket)


def _first_world(task: RankTask, world: int) -> tuple[list[int], list[str], str, list[str]] | None:
    """The rendezvous (workers/queue/rendezvous.py): (the tickets in slot order, each slot's node,
    rank 0's store address, each ticket's node for liveness, none when the world formed
    without some), an empty order when an elastic job's world formed without this ticket,
    or None when the job ended meanwhile."""
    store, job_id, attempt, job = task.store, task.job_id, task.attempt, task.job
    R, S = job.parallel.replicas, job.parallel.stages
    if not task.elastic:
        met = rendezvous(store, job_id, task.ticket, attempt, task.rec, task.me, world)
        if met is None:
            return None
        joined, address = met
        order = replica_aligned(joined, R, S)
        return order, [joined[t] for t in order], address, [joined[i] for i in range(world)]
    formed = elastic_rendezvous(store, job_id, task.ticket, attempt, task.rec, task.me,
                                (R, S, job.parallel.min_present))
    if formed is None:
        return None
    first, at = formed
    if at is None:
        return [], [], "", []
    by_ticket = [first.nodes[first.order.index(i)] for i in range(world)] if len(first.order) == world else []
    return first.order, first.nodes, at, by_ticket


class RankTask:
    """One rank task's training process and the loop that relays its events: attestations
    of its own slot, and, while its process is global rank 0 of the world, the step sink.

    An elastic job's world may re-form around a lost replica (workers/queue/membership.py): the
    process then reports ("epoch", ...) with its new rank, rank 0's role (and the sink)
    moves to whichever task holds the first present replica's first stage, and a ticket
    whose replica lost a stage leaves quietly (its replica's new tickets are queued)."""

    def __init__(self, store: JobStore, job_id: str, attempt: int, ticket: int, rec: JobRecord,
                 me: NodeIdentity, beat: Heartbeat, job: Any) -> None:
        self.store, self.job_id, self.attempt, self.ticket = store, job_id, attempt, ticket
        self.rec, self.me, self.beat, self.job = rec, me, beat, job
        R = job.parallel.replicas
        self.elastic = (job.parallel.min_replicas or R) < R and job.parallel.sync == "diloco"
        self.members = Members(store, job_id, attempt)
        self.seat = (0, 0)
        self.rank = -1  # the process's global rank in the current epoch
        self.epoch = 0
        self.sink: Any = None
        self.pending: dict[tuple[int, int], Any] = {}  # (epoch, step) -> (my Contribution, replica bitmap)
        self.replica_set = replica_bitmap(range(R))  # the current world's replicas

    def brief(self) -> dict[str, Any]:
        """What a rank process needs to regroup (picklable)."""
        keys = ("attempt", "replicas", "stages", "world", "min_replicas", "rpc", "chain_id", "registry", "ledger",
                "blocks", "run_dir", "collective_timeout_s")
        rec = {**self.rec, "min_replicas": self.job.parallel.min_replicas or self.job.parallel.replicas,
               "world": self.job.world_size}
        return {"job_id": self.job_id, **{k: rec.get(k) for k in keys}}

    def control(self, start: Any, members: tuple[int, ...] | None = None, epoch: int = 0) -> Any:
        from trainer.control import RankControl
        from trainer.hooks import RankHooks

        elastic: dict[str, Any] = {}
        if self.elastic:
            elastic = {"members": members, "epoch": epoch,
                       "regroup": Regroup(redis_url(), self.brief(), self.ticket, self.seat, self.me.host),
                       "grow_requested": GrowFlag(redis_url(), self.brief())}
        first = self.ticket == 0 or self.elastic  # who may be rank 0 polls the cancel flag
        return RankControl(stop_requested=StopFlag(redis_url(), self.job_id) if first else None,
                           cancellable=True, start=start, emit_contributions=True, shard_digest=shard_digest,
                           timeout_s=float(self.rec.get("collective_timeout_s", 60)),
                           hooks=self.job.test_hooks() or RankHooks(),  # a test's cheats, injected
                           **elastic)

    def join(self) -> dict[str, Any]:
        """A joiner ticket: wait for a growth epoch that seats it, then train from its head."""
        from trainer.control import ResumePoint

        if not self.elastic or self.ticket in self.members.retired():
            return {"rank": self.ticket, "skipped": True}
        from .membership import join_run_as_joiner

        if refused := join_run_as_joiner(self.members, self.brief(), self.me.account, self.ticket):
            return {"rank": self.ticket, "skipped": True, "error": refused}
        self.members.wait_as_joiner(self.ticket, self.me.address)
        while True:
            if self.store.state(self.job_id) in TERMINAL:
                return {"rank": self.ticket, "skipped": True}
            ep = self.members.record(self.members.current())
            if ep is not None and self.ticket in ep.ranks:
                break
            time.sleep(POLL_S)
        self.seat = ep.seats[self.ticket]
        m = join_epoch(self.members, self.brief(), ep.epoch, self.ticket, self.me.host)
        start = ResumePoint(step=m.start_step, shard=m.shard)
        world = len(m.members) * self.job.parallel.stages
        return self.run(m.rank, world, m.init_method, start, members=m.members, epoch=m.epoch)

    def run(self, rank: int, world: int, init_method: str, start: Any, *, members: tuple[int, ...] | None = None,
            epoch: int = 0, order: list[int] | None = None, by_ticket: list[str] | None = None) -> dict[str, Any]:
        """Start the training process as global rank `rank` and relay its events until it ends."""
        from trainer.launch import train_rank
        from trainer.supervisor import ChildOptions, Supervisor

        self.rank, self.epoch = rank, epoch
        control = self.control(start, members, epoch)
        control.gpu = gpu = _GPUS.take()
        log_path = rank_log(self.rec["run_dir"], self.ticket if self.elastic else rank, self.attempt)
        if start is not None:
            _log_line(log_path, f"attempt {self.attempt} {'joins' if epoch else 'resumes'} from step {start.step}")
        sup = Supervisor()
        try:
            proc = sup.start(rank, train_rank, (rank, world, init_method, self.training, control),
                             name=f"dlx-rank-{rank}", daemon=False,
                             options=ChildOptions(log=str(log_path), ignore_sigint=True))
        except BaseException:
            _GPUS.give(gpu)
            sup.close(kill=True)
            raise
        try:
            return self._relay(sup, proc, world, order or [], by_ticket or [])
        finally:
            sup.close(kill=True)
            _GPUS.give(gpu)
            self._settle_run_file()

    def _settle_run_file(self) -> None:
        """The sink's task, once its relay ended: the job's final state into run.json again
        (`JobStore.finish` wrote it, but a step the sink saved afterwards says `running`)."""
        if self.sink is None:
            return
        try:
            state = self.store.state(self.job_id)
        except Exception:  # Redis gone: `finish` wrote what it could
            return
        if state in TERMINAL:
            settle_run_file(self.rec["run_dir"], state)

    @functools.cached_property
    def training(self) -> Any:
        """The job's training config, once per task: the rank process and the sink share it
        (the token file is fetched by CID from the run's store and re-hashed only once)."""
        return _training_config(self.rec, self.job)

    def _relay(self, sup: Any, proc: Any, world: int, order: list[int], by_ticket: list[str]) -> dict[str, Any]:
        last_check = last_state = 0.0
        while True:
            if time.monotonic() - last_check > HEARTBEAT_S:
                last_check = time.monotonic()
                self._check_peers(order, by_ticket)
            event = sup.next_event(POLL_S)
            if event is None:
                self._attest()
                if proc.is_alive():
                    if time.monotonic() - last_state > HEARTBEAT_S:
                        last_state = time.monotonic()
                        state = self.store.state(self.job_id)
                        if state in TERMINAL:
                            return {"rank": self.ticket, "state": state}
                    continue
                # Its last events ("done" among them) may have landed after the wait gave up.
                event = sup.next_event(POLL_S)
                if event is None:
                    raise JobError(self._blame(world, by_ticket, f"training process exited with code {proc.exitcode}"))
            done = self._on_event(event, world, by_ticket)
            if done is not None:
                return done

    def _on_event(self, event: Any, world: int, by_ticket: list[str]) -> dict[str, Any] | None:
        kind, _, payload = event
        if kind == "epoch":
            self.epoch, self.rank = int(payload["epoch"]), int(payload["rank"])
            self.replica_set = replica_bitmap(payload["members"])
            self.pending = {k: v for k, v in self.pending.items() if k[0] >= self.epoch}
        elif kind == "contribution":
            step, contribution = payload
            self.pending[(self.epoch, step)] = (contribution, self.replica_set)
            self._attest()
        elif kind in ("genesis", "step", "progress"):
            self._report(kind, payload)
        elif kind == "error":
            if self.elastic and self.store.state(self.job_id) in TERMINAL:  # the decider failed the job
                return {"rank": self.ticket, "state": self.store.state(self.job_id)}
            if self.elastic and "is not in epoch" in str(payload):  # my replica lost a stage
                return {"rank": self.ticket, "state": "left"}
            within = max(float(self.rec.get("collective_timeout_s") or 60), RENDEZVOUS_S) + HEARTBEAT_TTL_S
            if self.elastic and self.members.moves_on(self.epoch, within):  # the others re-form without me
                log.warning("job %s ticket %s left its world: %s", self.job_id, self.ticket, payload)
                return {"rank": self.ticket, "state": "left"}
            raise JobError(self._blame(world, by_ticket, str(payload)))
        elif kind in ("cancelled", "done"):
            return self._finish("cancelled" if kind == "cancelled" else "completed")
        return None

    def _check_peers(self, order: list[int], by_ticket: list[str]) -> None:
        """Fail the round when another task took this rank's lease or (a job that cannot
        re-form its world) a peer rank stopped answering, once Redis has been reachable long
        enough to trust a missing lease."""
        if self.beat.usurped:
            raise JobError(f"rank {self.ticket} ({self.me.address}): another task took over this rank's lease")
        if self.elastic or not by_ticket:  # the world re-forms without the lost peer
            return
        lost = [r for r in self.store.lost_ranks(self.job_id, self.attempt, len(by_ticket)) if r != self.ticket]
        if lost and self.beat.trusted:  # asked after the read: it may have waited out an outage
            who = ", ".join(f"rank {order.index(r)} ({by_ticket[r]})" for r in lost)
            raise JobError(f"lost {who}: its worker stopped answering; the round failed")

    def _blame(self, world: int, by_ticket: list[str], error: str) -> str:
        if not by_ticket:
            return f"rank {self.ticket} ({self.me.address}) failed: {error}"
        return _blame(self.store, self.job_id, self.attempt, world, by_ticket, self.ticket, self.me, error)

    def _report(self, kind: str, payload: Any) -> None:
        """Rank 0 of the world: a genesis, step or progress event to the sink (made here the
        first time this task's process is rank 0), and the job's record."""
        if self.sink is None:
            head = None
            if self.epoch > 0:
                ep = self.members.record(self.epoch)
                head = ep.head if ep is not None else None
            self.sink = _rank0_sink(self, self.store.get(self.job_id).get("nodes") or [], head)
        if kind != "step":
            _report(self.store, self.job_id, self.sink, kind, payload)
            return
        self.sink.signer.epoch = getattr(payload, "epoch", self.epoch)
        self.members.sink_busy(self.ticket, payload.step)
        try:
            _report(self.store, self.job_id, self.sink, kind, payload)
        except StepAbandoned as exc:
            log.warning("job %s: %s", self.job_id, exc)
        finally:
            self.members.sink_busy(self.ticket, None)

    def _attest(self, wait: bool = False) -> None:
        if self.rank == 0:
            self.pending.clear()  # rank 0 signs its own slot inside the sink
            return
        _attest_pending(self.store, self.job_id, self.attempt, self.seat, self.me, self.pending, self.rec, wait)

    def _finish(self, state: str) -> dict[str, Any]:
        """The training process ended (`completed`) or stopped on a cancel (`cancelled`):
        stop beating, leaving one long beat (ended, not lost: peers may still be finishing
        the step), attest the steps gathered before the end so they still get committed, and
        let rank 0 record the job's end."""
        self.beat.stop(final_ttl_s=3600)
        while self.pending:
            self._attest(wait=True)
        if self.rank == 0:
            self.store.finish(self.job_id, state)
        return {"rank": self.ticket, "state": state}


class StepAbandoned(JobError):
    """The world re-formed while a step waited for attestations its lost ranks never give."""


def _report(store: JobStore, job_id: str, sink: Any, kind: str, payload: Any) -> None:
    """Rank 0: hand a genesis, step or progress event to the sink, and the job's record."""
    if kind == "genesis":
        sink.on_genesis(payload)
        store.update(job_id, run_id=sink.record.run_id)
    elif kind == "step":
        t0 = time.monotonic()
        sink.on_step(payload)  # stored, committed and confirmed: commit_s is the step's wait for the chain
        summary = {"step": payload.step, "head": sink.record.head, "eval_loss": payload.metrics.get("eval_loss"),
                   "bytes_sent": payload.metrics.get("bytes_sent", 0), "commit_s": round(time.monotonic() - t0, 3)}
        # step_N: each step's summary stays, so `dlx status --follow` misses none.
        store.update(job_id, run_id=sink.record.run_id, **summary, **{f"step_{payload.step}": summary})
    else:
        sink.on_progress(payload)  # metrics.jsonl, trackers, divergence
        store.update(job_id, outer_step=payload.outer_step, inner_step=payload.inner_step,
                     loss=payload.loss, outer_steps=payload.outer_steps, inner_steps=payload.inner_steps,
                     lr=payload.lr, tokens_per_s=payload.tokens_per_s, eta_s=payload.eta_s)


class GpuPool:
    """This worker's GPUs, one per concurrent rank task (a rank with none runs on the CPU,
    or fails a `device = "cuda"` job naming itself: trainer.world.agree_device)."""

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


_GPUS = GpuPool()


def rank_log(run_dir: str | Path, rank: int, attempt: int) -> Path:
    """Where a rank's training process writes its output, on the worker that ran it
    (`dlx logs JOB` reads these; on the local stack every worker shares the run directory)."""
    return Path(run_dir) / "logs" / f"rank-{rank}-attempt-{attempt}.log"


def _log_line(path: Path, text: str) -> None:
    """A line of the task's own in its rank's log (the rank process appends after it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {text}\n")
    except OSError:  # not writable on this host: the rank's output stays with the worker's
        pass


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


def _attest_pending(store: JobStore, job_id: str, attempt: int, seat: tuple[int, int], me: NodeIdentity,
                    pending: dict[tuple[int, int], Any], rec: Mapping[str, Any], wait: bool = False) -> None:
    """Sign rank 0's claim for my slot (`seat`: replica, stage) once it is published, if it
    matches my own work and the world I trained in; `pending` maps (epoch, step) to my
    contribution and that epoch's replica bitmap."""
    from workers.run.sink import content_digest

    domain = Domain(int(rec["chain_id"]), rec["ledger"])
    deadline = time.monotonic() + SIGNATURE_TIMEOUT_S
    for epoch, step in sorted(pending):
        while True:
            claim_d = store.claim(job_id, attempt, epoch, step, seat)
            if claim_d is not None or not wait or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        if claim_d is None:
            if wait:
                raise JobError(f"slot {seat}: rank 0 never published the claim for step {step}")
            return
        mine, replica_set = pending.pop((epoch, step))
        claim = ContributionClaim.from_doc(claim_d)
        # The shard digest too: this rank co-signs only the new stage shard it computed itself.
        expected = (content_digest(mine.data), mine.data_shard, loss_micros(mine.loss), mine.new_shard, seat,
                    replica_set)
        got = (claim.contribution, claim.data_shard, claim.loss_micros, claim.new_shard, (claim.replica, claim.stage),
               claim.replica_set)
        if expected != got:
            raise JobError(f"slot {seat} refuses to attest step {step}: rank 0's claim differs from its own work")
        store.put_signature(job_id, attempt, epoch, step, seat, claim.sign(domain, me.account.key))


def _training_config(rec: Mapping[str, Any], job: Any) -> Any:
    """The job's training config, reading the token file the job record names, fetched by
    CID from the run's store into this worker's data cache (re-hashed: a node trains on the
    data named on chain or not at all). A job queued before data records: as configured."""
    from lineage.store.blockstore import Blockstore
    from lineage.store.datasets import DataRecord, fetch_prepared

    training = job.training_config()
    if "data" not in rec:
        return training
    return training.with_prepared(fetch_prepared(Blockstore(run_blocks(rec)), DataRecord.from_doc(rec["data"])))


def _rank0_sink(task: RankTask, nodes: list[str], head: str | None = None) -> Any:
    """The step sink, in the task whose process is global rank 0: from genesis, from the job's
    resume point, or (`head`) from the checkpoint an elastic world re-formed at."""
    store, job_id, attempt, rec, job, me, members = (task.store, task.job_id, task.attempt, task.rec, task.job,
                                                     task.me, task.members)
    training = task.training
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger
    from lineage.chain.runrecord import RunRecord
    from lineage.store.blockstore import Blockstore
    from lineage.store.datasets import DataRecord
    from lineage.store.retention import Retention
    from lineage.store.runconfig import RunConfig
    from trainer.artifacts import code_hash
    from workers.run.sink import HONEST, LedgerSink

    # A stack's own anvil is recorded as `stack`; a chain of the user's (dlx up --deployment) has none.
    chain = Chain(rec["rpc"], int(rec["chain_id"]), job.chain.policy(embedded=bool(rec.get("stack"))))
    ledger = Ledger(chain, rec["registry"], rec["ledger"])
    run_dir = Path(rec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        record = RunRecord.load(run_dir)
        record.status = "running"  # a resumed job's record said how its last attempt ended
    except Exception:
        record = RunRecord(name=job.name, chain_id=chain.chain_id, rpc=rec["rpc"], chain_state=None,
                           registry=rec["registry"], ledger=rec["ledger"], blocks=rec["blocks"],
                           stack=rec.get("stack"))
    if not head:
        _note_resume(rec)
    data = DataRecord.from_doc(rec["data"]) if "data" in rec else None
    config = RunConfig.of_job(job, code_hash(), data).to_doc()
    domain = Domain(chain.chain_id, ledger.ledger.address)
    # The run's first members (createRun names each once): an elastic job's first world may
    # hold fewer than R replicas, whose free slots repeat its first node (joiners use joinRun).
    nodes = nodes + nodes[:1] * (job.world_size - len(nodes))
    sink = LedgerSink(
        job=training, config=config, store=Blockstore(record.blocks_dir(run_dir)), ledger=ledger,
        submitter=me.account, slot_nodes=nodes, signer=RedisSigner(store, job_id, attempt, me, domain, members),
        record=record, run_dir=run_dir, challenge_window=job.chain.challenge_window_s,
        min_stake=job.chain.min_stake_wei, arbiters=job.chain.arbiters, quorum=job.chain.quorum,
        independence=job.chain.independence, tracking=job.tracking,
        on_committed=Retention.for_job(job, Blockstore(record.blocks_dir(run_dir)), ledger, record),
        hooks=job.test_hooks() or HONEST,  # a test's coordinator cheats, injected
    )
    if head:
        sink.resume_from(head)
    elif rec.get("resume_from"):
        sink.resume_from(rec["resume_from"]["checkpoint"])
    return sink


def _note_resume(rec: Mapping[str, Any]) -> None:
    """A resumed attempt's sink, before it writes: mark the earlier attempt's inner-step
    metrics past the head (`workers.run.tracking.mark_resume`), once per attempt."""
    from workers.run.tracking import mark_resume

    resume = rec.get("resume_from")
    if resume:
        mark_resume(Path(rec["run_dir"]), int(resume["step"]))


def _resume_point(rec: JobRecord, job: Any, rank: int) -> Any:
    from lineage.store.blockstore import Blockstore
    from lineage.store.manifest import get_manifest
    from workers.run.local import resume_point

    store = Blockstore(run_blocks(rec))
    return resume_point(store, get_manifest(store, rec["resume_from"]["checkpoint"]), job, rank)


@app.task(name="workers.queue.tasks.replay", acks_late=True)
def replay(store_spec: str, items: list[list[Any]], tolerance: float) -> list[dict[str, Any]]:
    """Replay (checkpoint, replica) items on this worker (the `verify` queue); read-only, so
    a redelivery only replays again. See workers.queue.verifyq."""
    from .verifyq import replay_chunk

    return replay_chunk(store_spec, [(c, r) for c, r in items], tolerance)


__all__ = ["RedisSigner", "StopFlag", "replay", "replica_aligned", "run_rank"]
