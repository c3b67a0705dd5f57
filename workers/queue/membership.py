"""Elastic membership of a queued job: which replicas train each outer step, kept in Redis.

A job with `[parallel] min_replicas` below `replicas` (R) is elastic. Its rank tasks
("tickets") each hold a *seat* (replica id, stage) for their life; a *membership epoch*
is one torch.distributed world of the replicas whose S seats are all held by live tickets.
Epoch 0 is the world the rendezvous formed. A world breaks when a rank dies (its gloo
peers see the connection drop, or a collective times out); every surviving rank process
then calls `Regroup` (trainer.control.RankControl.regroup), which

1. checks the ticket in for epoch n + 1 and raises the job's `wanted` epoch, so rank 0's
   sink stops waiting for attestations of a step the lost ranks will never sign;
2. lets one of them (the first to claim the epoch's decider key) settle the membership:
   it waits until every ticket of epoch n has checked in or stopped renewing its lease
   (`STALE_BEAT_S` of missed beats, well inside the lease's `HEARTBEAT_TTL_S`), keeps the replicas with all S seats present (ascending id),
   fails the job if fewer than `min_replicas` remain, waits for the sink to finish or drop
   the step in flight, reads the run's head from the chain and writes the epoch's record
   (members, each ticket's rank, the start step and checkpoint);
3. has the new rank 0 publish a TCPStore address, and returns the `Membership` with this
   rank's stage shard of the head checkpoint, read from the run's store by CID.

A lost replica's tickets are retired, and S new tickets for it go to the `train` queue:
the first worker with free slots to take them (a new one, or the lost one come back) waits
as a *joiner*. So does a ticket the first world formed without (an elastic job starts with
as few as min_replicas complete replicas when its other tickets are not taken within the
rendezvous timeout: workers/queue/rendezvous.py); its replica ids are the world's free ones. Rank 0 asks `GrowFlag` after each outer step it reports; when a complete
replica waits, every rank regroups at that boundary with reason "grow", the joiners take
the lowest free replica ids, and their rank processes start from the head checkpoint
fetched from the store (fresh inner and compressor state; trainer.engine).

What a loss costs: the round in flight (and, under delay 1, the exchange overlapped with
it when its step was not yet committed); never a committed step. Steps are signed per
(epoch, step, replica, stage): a step abandoned in one epoch may be signed again, for
another replica set, in the next (the ledger's equivocation rule compares signatures over
the same set).

Keys (under `dlx:job:<id>:a<attempt>`): `seats` (ticket -> "r,s"), `epoch` (the current
epoch), `wanted` (the highest epoch asked for), `e<n>` (the epoch's record, JSON),
`e<n>:in` (check-ins), `e<n>:decider`, `e<n>:addr` (rank 0's store address), `waiting`
(joiner ticket -> node), `seated` (joiners seated since: ticket -> node), `retired` (tickets of lost replicas), `tickets` (the next ticket
number), `sink` (the step the sink is committing and the ticket hosting it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .jobs import (
    HEARTBEAT_TTL_S,
    KEY_TTL_S,
    TERMINAL,
    WORKER_PATIENCE_S,
    JobError,
    JobStore,
    connect,
    text,
)

__all__ = ["EpochRecord", "GrowFlag", "Members", "Regroup", "join_epoch", "join_run_as_joiner", "run_blocks", "seat_of", "store_port"]

log = logging.getLogger(__name__)

POLL_S = 0.1
#: How long the decider waits past the heartbeat bound for a ticket to check in.
SETTLE_MARGIN_S = 2.0
#: A ticket of the old world that has not checked in and has missed this long of beats is
#: taken for lost (a slow one judged wrongly leaves, and joins again as its replica's joiner).
STALE_BEAT_S = 2.5
#: How long a rank waits for the decider's record or rank 0's address.
EPOCH_WAIT_S = 120.0


def seat_of(text: str) -> tuple[int, int]:
    r, s = text.split(",")
    return int(r), int(s)


@dataclass(frozen=True)
class EpochRecord:
    """One membership epoch: the replicas present, each ticket's global rank, and the
    committed step (and checkpoint CID, "" before genesis) the world continues from."""

    epoch: int
    members: tuple[int, ...]
    ranks: dict[int, int]  # ticket -> global rank
    seats: dict[int, tuple[int, int]]  # ticket -> (replica, stage)
    start_step: int
    head: str
    error: str = ""  # set when the job cannot go on (fewer than min_replicas)

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "members": list(self.members),
                           "ranks": {str(t): r for t, r in self.ranks.items()},
                           "seats": {str(t): f"{r},{s}" for t, (r, s) in self.seats.items()},
                           "start_step": self.start_step, "head": self.head, "error": self.error})

    @classmethod
    def from_json(cls, raw: str | bytes) -> EpochRecord:
        d = json.loads(raw)
        return cls(d["epoch"], tuple(d["members"]), {int(t): r for t, r in d["ranks"].items()},
                   {int(t): seat_of(v) for t, v in d["seats"].items()}, d["start_step"], d["head"], d.get("error", ""))


class Members:
    """The Redis side of a job attempt's membership (module docstring)."""

    def __init__(self, store: JobStore, job_id: str, attempt: int) -> None:
        self.store, self.job_id, self.attempt = store, job_id, attempt
        self.r = store.r

    def key(self, *parts: object) -> str:
        return self.store.key(self.job_id, f"a{self.attempt}", *parts)

    def _set(self, key: str, value: str) -> None:
        self.r.set(key, value, ex=KEY_TTL_S)

    # -- epochs ----------------------------------------------------------------------------

    def current(self) -> int:
        raw = self.r.get(self.key("epoch"))
        return int(raw) if raw else 0

    def record(self, epoch: int) -> EpochRecord | None:
        raw = self.r.get(self.key(f"e{epoch}"))
        return EpochRecord.from_json(raw) if raw else None

    def publish(self, rec: EpochRecord) -> None:
        self._set(self.key(f"e{rec.epoch}"), rec.to_json())
        self._set(self.key("epoch"), str(rec.epoch))
        if rec.error:
            return
        nodes = self.store.joined(self.job_id, self.attempt)
        nodes.update(self.waiting())
        nodes.update({int(t): text(v) for t, v in self.r.hgetall(self.key("seated")).items()})
        member_nodes = {str(r): [nodes.get(t, "?") for t, seat in sorted(rec.seats.items(), key=lambda x: x[1])
                                 if seat[0] == r] for r in rec.members}
        self.store.update(self.job_id, epoch=rec.epoch, members=list(rec.members), member_nodes=member_nodes)

    def want(self, epoch: int) -> None:
        """Raise the job's wanted epoch to `epoch` (never lower it)."""
        script = ("local v = tonumber(redis.call('GET', KEYS[1]) or '-1') "
                  "if tonumber(ARGV[1]) > v then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end return 0")
        self.r.eval(script, 1, self.key("wanted"), str(epoch), str(KEY_TTL_S))

    def wanted(self) -> int:
        raw = self.r.get(self.key("wanted"))
        return int(raw) if raw else 0

    def moves_on(self, epoch: int, within_s: float) -> bool:
        """Whether the world re-forms past `epoch` (or the job ends) within `within_s`: an
        elastic rank whose process failed (a joiner that could not reach its new world, a
        lost connection) is then a lost rank, not the job's failure."""
        deadline = time.monotonic() + within_s
        while self.wanted() <= epoch and self.store.state(self.job_id) not in TERMINAL:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def check_in(self, epoch: int, ticket: int, seat: tuple[int, int]) -> None:
        key = self.key(f"e{epoch}", "in")
        self.r.hset(key, str(ticket), f"{seat[0]},{seat[1]}")
        self.r.expire(key, KEY_TTL_S)

    def checked_in(self, epoch: int) -> dict[int, tuple[int, int]]:
        return {int(t): seat_of(text(v)) for t, v in self.r.hgetall(self.key(f"e{epoch}", "in")).items()}

    def claim_decider(self, epoch: int, ticket: int) -> bool:
        return bool(self.r.set(self.key(f"e{epoch}", "decider"), str(ticket), nx=True, ex=KEY_TTL_S))

    def publish_address(self, epoch: int, address: str) -> None:
        self._set(self.key(f"e{epoch}", "addr"), address)

    def address(self, epoch: int) -> str | None:
        raw = self.r.get(self.key(f"e{epoch}", "addr"))
        return text(raw) if raw else None

    # -- tickets ---------------------------------------------------------------------------

    def alive(self, tickets: list[int]) -> set[int]:
        if not tickets:
            return set()
        keys = [self.store.key(self.job_id, f"a{self.attempt}", "hb", t) for t in tickets]
        retired = self.retired()
        return {t for t, v in zip(tickets, self.r.mget(keys), strict=True) if v is not None and t not in retired}

    def beating(self, tickets: list[int], within_s: float) -> set[int]:
        """Tickets whose lease was renewed within the last `within_s` seconds (their task
        beats every HEARTBEAT_S; one that missed a few beats in a row has, most likely, died:
        its lease lapsing would take HEARTBEAT_TTL_S)."""
        if not tickets:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for t in tickets:
            pipe.pttl(self.store.key(self.job_id, f"a{self.attempt}", "hb", t))
        left = pipe.execute()
        return {t for t, ms in zip(tickets, left, strict=True) if ms > (HEARTBEAT_TTL_S - within_s) * 1000}

    def wait_as_joiner(self, ticket: int, node: str) -> None:
        key = self.key("waiting")
        self.r.hset(key, str(ticket), node)
        self.r.expire(key, KEY_TTL_S)

    def waiting(self) -> dict[int, str]:
        return {int(t): text(v) for t, v in self.r.hgetall(self.key("waiting")).items()}

    def retire(self, tickets: list[int]) -> None:
        if tickets:
            self.r.sadd(self.key("retired"), *map(str, tickets))
            self.r.expire(self.key("retired"), KEY_TTL_S)

    def retired(self) -> set[int]:
        return {int(t) for t in self.r.smembers(self.key("retired"))}

    def new_tickets(self, count: int, world: int) -> list[int]:
        """`count` fresh ticket numbers (above every ticket of the first world)."""
        key = self.key("tickets")
        self.r.setnx(key, str(world))
        last = int(self.r.incrby(key, count))
        return list(range(last - count, last))

    # -- the sink --------------------------------------------------------------------------

    def sink_busy(self, ticket: int, step: int | None) -> None:
        if step is None:
            self.r.delete(self.key("sink"))
        else:
            self._set(self.key("sink"), f"{ticket},{step}")

    def sink_idle(self) -> bool:
        raw = self.r.get(self.key("sink"))
        if raw is None:
            return True
        ticket = int(text(raw).split(",")[0])
        return not self.beating([ticket], STALE_BEAT_S)


class Regroup:
    """Picklable: a rank process's `RankControl.regroup` (module docstring), for ticket
    `ticket` holding `seat` in job `job_id`'s attempt `attempt`."""

    def __init__(self, url: str, rec: dict[str, Any], ticket: int, seat: tuple[int, int], host: str) -> None:
        self.url, self.ticket, self.seat, self.host = url, ticket, seat, host
        self.job_id, self.attempt = rec["job_id"], int(rec["attempt"])
        self.rec = rec

    def __call__(self, failed_epoch: int, reason: str) -> Any:
        from trainer.errors import TrainingError

        members = Members(JobStore(connect(self.url, patience_s=WORKER_PATIENCE_S)), self.job_id, self.attempt)
        n = failed_epoch + 1
        members.want(n)
        members.check_in(n, self.ticket, self.seat)
        if members.claim_decider(n, self.ticket):
            decide(members, self.rec, n, grow=reason == "grow", url=self.url)
        try:
            return join_epoch(members, self.rec, n, self.ticket, self.host)
        except JobError as exc:
            raise TrainingError(str(exc)) from None


class GrowFlag:
    """Picklable: rank 0's `RankControl.grow_requested`: a complete replica of joiners waits
    (at least S live joiner tickets of the run's member nodes) and the world has a free
    replica id."""

    def __init__(self, url: str, rec: dict[str, Any]) -> None:
        self.url, self.rec = url, rec
        self.job_id, self.attempt = rec["job_id"], int(rec["attempt"])
        self._members: Members | None = None
        self._member: dict[str, bool] = {}  # node -> whether it is a member of the run

    def __call__(self) -> bool:
        try:
            if self._members is None:
                self._members = Members(JobStore(connect(self.url, patience_s=5.0)), self.job_id, self.attempt)
            m = self._members
            current = m.record(m.current())
            if current is None or len(current.members) >= int(self.rec["replicas"]):
                return False
            waiting = m.waiting()
            live = m.alive(list(waiting))
            unknown = {waiting[t] for t in live} - set(self._member)
            if unknown:  # a member stays one (a leaver's tickets are not joiners); others may join
                allowed = _run_members(m, self.rec, unknown)
                self._member.update({n: True for n in allowed})
            return sum(self._member.get(waiting[t], False) for t in live) >= int(self.rec["stages"])
        except Exception:  # growth is best effort: a Redis or RPC hiccup must not break training
            return False


def decide(members: Members, rec: dict[str, Any], epoch: int, *, grow: bool, url: str) -> None:
    """Settle epoch `epoch`'s membership and publish its record (module docstring, step 2)."""
    R, S = int(rec["replicas"]), int(rec["stages"])
    least = int(rec.get("min_replicas") or R)
    old = members.record(epoch - 1)
    assert old is not None, f"epoch {epoch - 1} has no record"
    tickets = sorted(old.ranks)
    # A live rank checks in once its own collective fails, at the latest when it times out.
    deadline = time.monotonic() + float(rec.get("collective_timeout_s") or 60) + HEARTBEAT_TTL_S + SETTLE_MARGIN_S
    while True:
        ins = members.checked_in(epoch)
        pending = set(tickets) - set(ins)
        pending &= members.beating(sorted(pending), STALE_BEAT_S)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    ins = {t: seat for t, seat in members.checked_in(epoch).items() if t in old.ranks}
    seats = dict(ins)
    if grow:
        seats.update(seat_joiners(members, rec, {seat[0] for seat in ins.values()}))
    complete = sorted(r for r in range(R) if all((r, s) in seats.values() for s in range(S)))
    lost_replicas = sorted(set(old.members) - set(complete))
    members.retire([t for t, seat in old.seats.items() if seat[0] in lost_replicas])
    seats = {t: seat for t, seat in seats.items() if seat[0] in complete}
    if len(complete) < least:
        error = (f"epoch {epoch}: {len(complete)} of the job's replicas remain ({', '.join(map(str, complete)) or 'none'}),"
                 f" fewer than min_replicas = {least}; `dlx resume` continues from the last step committed on chain")
        members.publish(EpochRecord(epoch, tuple(complete), {}, {}, 0, "", error))
        members.store.finish(members.job_id, "failed", error)
        return
    step, head = _settled_head(members, rec)
    ranks = {t: complete.index(r) * S + s for t, (r, s) in seats.items()}
    members.publish(EpochRecord(epoch, tuple(complete), ranks, seats, step, head))
    if lost_replicas and not grow:
        requeue(members, url, int(rec["world"]), len(lost_replicas) * S)


def seat_joiners(members: Members, rec: dict[str, Any], taken: set[int]) -> dict[int, tuple[int, int]]:
    """Seats for live joiners: whole replicas only, a node's tickets in one replica where it
    can be, the lowest free replica ids first."""
    R, S = int(rec["replicas"]), int(rec["stages"])
    waiting = members.waiting()
    live = sorted(members.alive(list(waiting)))
    allowed = _run_members(members, rec, {waiting[t] for t in live})
    live = [t for t in live if waiting[t] in allowed]  # the ledger takes attestations from run members only
    free = [r for r in range(R) if r not in taken]
    by_node: dict[str, list[int]] = {}
    for t in live:
        by_node.setdefault(waiting[t], []).append(t)
    queue = [t for group in sorted(by_node.values(), key=lambda g: (-len(g), g[0])) for t in group]
    seats: dict[int, tuple[int, int]] = {}
    for r in free:
        if len(queue) < S:
            break
        group, queue = queue[:S], queue[S:]
        seats.update({t: (r, s) for s, t in enumerate(group)})
    if seats:  # seated: their nodes move from `waiting` to `seated` (the epoch's record names them)
        members.r.hset(members.key("seated"), mapping={str(t): waiting[t] for t in seats})
        members.r.expire(members.key("seated"), KEY_TTL_S)
        members.r.hdel(members.key("waiting"), *map(str, seats))
    return seats


def _run_members(members: Members, rec: dict[str, Any], nodes: set[str]) -> set[str]:
    """Which of `nodes` are members of the job's run on chain (others wait in vain, unless
    they join the run: `join_run_as_joiner`)."""
    run_id = members.store.get(members.job_id).get("run_id")
    if not nodes or not run_id:
        return set()
    ledger = _ledger(rec)
    return {n for n in nodes if ledger.ledger.functions.isMember(int(run_id), n).call()}


def join_run_as_joiner(members: Members, rec: dict[str, Any], account: Any, ticket: int) -> str | None:
    """A joiner ticket whose node key is not a member of the job's run joins it on chain
    (issue 35) before it waits to be seated, so that the growth boundary can seat it and the
    ledger takes its signatures from the step after: an `open` run takes any node with the
    run's minimum stake free, an `approved` one the admission file named by DLX_ADMISSION
    (`dlx node admit`); a closed run leaves it waiting in vain, as before. A refusal (too
    little free stake, an expired admission) leaves the ticket unused and the job as it is:
    returns the refusal's message, else None."""
    from lineage.errors import ChainError

    while not members.store.get(members.job_id).get("run_id"):  # a spare ticket may come before createRun
        if members.store.state(members.job_id) in TERMINAL:
            return None
        time.sleep(0.5)
    try:
        tx = _join_run(members, rec, account)
    except ChainError as exc:
        log.warning("job %s ticket %s: %s joins no run: %s", members.job_id, ticket, account.address, exc)
        return str(exc)
    if tx:
        log.info("job %s ticket %s: node %s joined run (tx %s)", members.job_id, ticket, account.address, tx)
    return None


def _join_run(members: Members, rec: dict[str, Any], account: Any) -> str | None:
    """joinRun for `account` where the run admits it and it is not a member; the tx hash."""
    from lineage.chain.rewards import join_run, read_admission, run_terms

    run_id = members.store.get(members.job_id).get("run_id")
    if not run_id:
        return None
    ledger = _ledger(rec)
    if ledger.ledger.functions.isMember(int(run_id), account.address).call():
        return None
    rule = run_terms(ledger, int(run_id)).admission
    if rule == "open":
        return join_run(ledger, account, int(run_id))
    admission = os.environ.get("DLX_ADMISSION", "").strip()
    if rule == "approved" and admission:
        return join_run(ledger, account, int(run_id), read_admission(Path(admission)))
    return None


def _ledger(rec: dict[str, Any]) -> Any:
    from lineage.chain.client import Chain
    from lineage.chain.ledger import Ledger

    return Ledger(Chain(rec["rpc"], int(rec["chain_id"])), rec["registry"], rec["ledger"])


def _settled_head(members: Members, rec: dict[str, Any]) -> tuple[int, str]:
    """The run's head once the sink has committed or dropped the step in flight: read from
    the chain (a sink that died mid-commit may have landed its transaction)."""
    deadline = time.monotonic() + EPOCH_WAIT_S
    while not members.sink_idle() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    job = members.store.get(members.job_id)
    if not job.get("run_id"):
        raise JobError("the world broke before the run was created on chain")
    from lineage.store.cid import DAG_CBOR, cid_from_digest

    digest, step = _ledger(rec).head(int(job["run_id"]))
    return step, str(cid_from_digest(digest, DAG_CBOR))


def requeue(members: Members, url: str, world: int, count: int) -> None:
    """Send `count` new tickets to the `train` queue, for whichever workers can take them."""
    from workers.queue.app import make_app

    app = make_app(url)
    for ticket in members.new_tickets(count, world):
        app.send_task("workers.queue.tasks.run_rank", args=(members.job_id, ticket, members.attempt), queue="train",
                      task_id=f"{members.job_id}-a{members.attempt}-r{ticket}")


def join_epoch(members: Members, rec: dict[str, Any], epoch: int, ticket: int, host: str) -> Any:
    """Wait for epoch `epoch`'s record; this ticket's `trainer.control.Membership` in it (rank
    0 publishes its TCPStore address first). JobError when the job cannot go on or this
    ticket was left out."""
    from trainer.control import Membership

    deadline = time.monotonic() + EPOCH_WAIT_S
    while (ep := members.record(epoch)) is None:
        if members.store.state(members.job_id) in TERMINAL or time.monotonic() > deadline:
            raise JobError(f"epoch {epoch} never formed")
        time.sleep(POLL_S)
    if ep.error:
        raise JobError(ep.error)
    if ticket not in ep.ranks:
        raise JobError(f"ticket {ticket} is not in epoch {epoch}: its replica lost a stage")
    rank = ep.ranks[ticket]
    if rank == 0:
        members.publish_address(epoch, f"{host}:{store_port(host)}")
    while (address := members.address(epoch)) is None:
        if members.store.state(members.job_id) in TERMINAL or time.monotonic() > deadline:
            raise JobError(f"epoch {epoch}: rank 0 never published its store address")
        time.sleep(POLL_S)
    return Membership(epoch=epoch, rank=rank, members=ep.members, init_method=f"tcp://{address}",
                      start_step=ep.start_step, shard=_stage_shard(rec, ep, ep.seats[ticket][1]))


def _stage_shard(rec: dict[str, Any], ep: EpochRecord, stage: int) -> bytes:
    """Stage `stage`'s shard of the epoch's start checkpoint, read from the run's store."""
    from lineage.store.blockstore import Blockstore
    from lineage.store.manifest import get_manifest
    from lineage.store.unixfs import read_bytes

    store = Blockstore(run_blocks(rec))
    return read_bytes(store, get_manifest(store, ep.head).stages[stage])


def run_blocks(rec: Mapping[str, Any]) -> Path:
    """The run's blockstore directory (the stack's, shared by its workers)."""
    return Path(rec["blocks"]) if Path(rec["blocks"]).is_absolute() else Path(rec["run_dir"]) / rec["blocks"]


def store_port(host: str) -> int:
    """A free port for rank 0's TCPStore: the first free one of DLX_STORE_PORTS ("29500-29509",
    for firewalls; `dlx worker --store-ports`), else any free port."""
    import socket

    from lineage.chain.anvil import free_port

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
