"""Job records, rendezvous and attestation exchange, kept in Redis.

Keys (all under `dlx:job:<id>`):

    dlx:job:<id>                  hash: the job's record (state, progress, run, error)
    dlx:job:<id>:cancel           set when the user cancels; rank 0 polls it
    dlx:job:<id>:a<k>:joined      hash rank -> node address, for attempt k
    dlx:job:<id>:a<k>:rdzv        rank 0's TCPStore address "host:port" for attempt k
    dlx:job:<id>:a<k>:hb:<rank>   the rank's owner token, kept alive by its heartbeat
    dlx:job:<id>:a<k>:claims:e<n>:<t>  hash "replica,stage" -> claim JSON published by rank 0
                                  for step t in membership epoch n (workers/queue/membership.py)
    dlx:job:<id>:a<k>:sigs:e<n>:<t>    hash "replica,stage" -> signature hex, by each slot's node
    dlx:worker:<name>             a live worker's node, rank slots and queues (WorkerBeat)

An attempt is one try at running the job (the first, then one per `dlx resume`); rank
tasks of an older attempt find the attempt moved on and exit without doing anything.

A rank belongs to the first task that takes its heartbeat key (SET NX with a TTL); a
redelivered or duplicated task finds it taken by a live owner and exits, so one rank never
runs twice. Clients retry for a while when Redis goes away (a restart of a durable Redis:
appendonly), so a job survives a short outage; a longer one fails it.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from trainer.errors import DlxError

TERMINAL = ("completed", "failed", "cancelled")
KEY_TTL_S = 7 * 24 * 3600
#: How long workers keep retrying a Redis that went away (a restart) before giving up.
WORKER_PATIENCE_S = 30.0
#: A running job whose ranks all lost their leases and whose record has been still this
#: long has no task left to finish it (they died, or gave up on Redis): it is failed.
STALL_S = 2 * WORKER_PATIENCE_S
HEARTBEAT_S = 1.0      # every rank task refreshes its heartbeat this often ...
HEARTBEAT_TTL_S = 6.0  # ... and is declared lost when it has not for this long
_BACKOFF_CAP_S = 0.5


class JobError(DlxError, RuntimeError):
    """A queued job could not run, or the job store refused an operation."""


class PatientRetry(Retry):
    """redis-py's Retry that also remembers when Redis last failed a command (`trouble_at`),
    so liveness checks can tell a lost peer from a Redis outage. One object serves every
    connection of a client (redis-py deep-copies the retry into each connection)."""

    def __init__(self, patience_s: float) -> None:
        super().__init__(ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.05),
                         retries=max(1, int(patience_s / _BACKOFF_CAP_S) + 3))
        self.trouble_at = float("-inf")

    def __deepcopy__(self, memo: dict) -> PatientRetry:
        return self

    def call_with_retry(self, do: Any, fail: Any, *args: Any, **kwargs: Any) -> Any:
        failed = False

        def on_fail(*a: Any) -> Any:
            nonlocal failed
            failed = True
            self.trouble_at = time.monotonic()
            return fail(*a)

        try:
            return super().call_with_retry(do, on_fail, *args, **kwargs)
        finally:
            if failed:
                self.trouble_at = time.monotonic()  # when it came back (or we gave up)


def connect(url: str, patience_s: float = 2.0) -> redis.Redis:
    """A client that retries each command for about `patience_s` while Redis is unreachable:
    long in workers (a restart must not fail a running job), short in the CLI (a user should
    not wait half a minute to hear that Redis is down)."""
    client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5, retry=PatientRetry(patience_s),
                                  retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    try:
        client.ping()
    except redis.RedisError as exc:
        why = "connection refused" if "refused" in str(exc).lower() else exc.__class__.__name__
        raise JobError(f"cannot reach Redis at {redact(url)}: {why}") from None
    return client


def redact(url: str) -> str:
    """A Redis URL without its password, for messages."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


class ResumeFrom(TypedDict):
    """Where `dlx resume` continues a job: the step the chain's head is, and its CID."""

    step: int
    checkpoint: str


class StepSummary(TypedDict):
    """One committed step, as the sink reports it (also kept as the record's `step_N`)."""

    step: int
    head: str
    eval_loss: float | None
    bytes_sent: int
    commit_s: float


class JobRecord(TypedDict, total=False):
    """A queue job's record in Redis (`JobStore.get`; every value is stored as JSON): what
    `dlx submit` writes, then what the rank tasks, the sink and the membership add. Each
    committed step also leaves a `step_N` key holding its `StepSummary` (`JobStore.step`)."""

    # written by `dlx submit` (workers/cli/jobs.py, submit_job), and `dlx resume`
    job_toml: str
    job_dir: str
    name: str
    rpc: str
    chain_id: int
    registry: str
    ledger: str
    blocks: str
    stack: str | None  # the local stack whose own anvil holds the chain (None: a chain of the user's)
    replicas: int
    stages: int
    world: int
    min_replicas: int
    outer_steps: int
    inner_steps: int
    rendezvous_s: float
    collective_timeout_s: float
    data: dict[str, Any]  # the prepared dataset (lineage.store.datasets.DataRecord.to_json)
    run_dir: str
    resume_from: ResumeFrom  # `dlx resume`: the chain's head it continues from
    # the job's life (JobStore)
    state: str  # queued, running, completed, failed, cancelled
    attempt: int
    error: str | None
    created: float
    updated: float
    ended: float
    # the rank tasks and the sink (workers/queue/tasks.py)
    nodes: list[str]
    run_id: int
    step: int
    head: str
    eval_loss: float | None
    bytes_sent: int
    commit_s: float
    outer_step: int
    inner_step: int
    loss: float
    lr: float
    tokens_per_s: float
    eta_s: float | None
    # elastic membership (workers/queue/membership.py)
    epoch: int
    members: list[int]
    member_nodes: dict[str, list[str]]


@dataclass
class JobStore:
    r: redis.Redis

    def calm_s(self) -> float:
        """Seconds since Redis last failed one of this client's commands (inf: never)."""
        retry = self.r.get_retry()
        return time.monotonic() - retry.trouble_at if isinstance(retry, PatientRetry) else float("inf")

    # -- the record ------------------------------------------------------------------------

    def create(self, fields: dict[str, Any]) -> str:
        job_id = uuid.uuid4().hex[:12]
        now = time.time()
        self.r.hset(self.key(job_id), mapping=_enc({**fields, "state": "queued", "attempt": 1,
                                                    "created": now, "updated": now}))
        self.r.expire(self.key(job_id), KEY_TTL_S)
        return job_id

    def get(self, job_id: str) -> JobRecord:
        raw = self.r.hgetall(self.key(job_id))
        if not raw:
            raise JobError(f"no such job: {job_id}")
        return cast(JobRecord, {text(k): json.loads(v) for k, v in raw.items()})

    def step(self, job_id: str, step: int) -> StepSummary | None:
        """Step `step`'s summary, once the sink committed it."""
        raw = self.r.hget(self.key(job_id), f"step_{step}")
        return cast(StepSummary, json.loads(raw)) if raw else None

    def reconcile(self, job_id: str) -> JobRecord:
        """The job's record, after failing a running job that no live task can finish any
        more (every rank's lease lapsed and nothing was written for STALL_S)."""
        rec = self.get(job_id)
        if rec["state"] != "running" or time.time() - float(rec["updated"]) < STALL_S:
            return rec
        attempt, world = int(rec["attempt"]), int(rec["world"])
        if len(self.lost_ranks(job_id, attempt, world)) == world:
            self.finish(job_id, "failed", f"attempt {attempt} stopped: none of its {world} ranks has answered "
                        f"for {time.time() - float(rec['updated']):.0f} s (their workers, or Redis, were lost); "
                        "`dlx resume` continues from the last step committed on chain")
            rec = self.get(job_id)
        return rec

    def state(self, job_id: str) -> str:
        """The job's state alone (what polling loops need), without reading the whole record."""
        raw = self.r.hget(self.key(job_id), "state")
        if raw is None:
            raise JobError(f"no such job: {job_id}")
        return str(json.loads(raw))

    def update(self, job_id: str, **fields: Any) -> None:
        self.r.hset(self.key(job_id), mapping=_enc({**fields, "updated": time.time()}))

    def finish(self, job_id: str, state: str, error: str | None = None) -> bool:
        """Move the job to a terminal state once; the first caller's reason wins."""
        script = """
        local s = redis.call('HGET', KEYS[1], 'state')
        if s == '"completed"' or s == '"failed"' or s == '"cancelled"' then return 0 end
        redis.call('HSET', KEYS[1], 'state', ARGV[1], 'updated', ARGV[3])
        if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[2]) end
        return 1
        """
        err = json.dumps(error) if error else ""
        moved = bool(self.r.eval(script, 1, self.key(job_id), json.dumps(state), err, json.dumps(time.time())))
        if moved:
            run_dir = self.r.hget(self.key(job_id), "run_dir")
            if run_dir is not None:
                settle_run_file(json.loads(run_dir), state)
        return moved

    @staticmethod
    def key(job_id: str, *parts: object) -> str:
        return ":".join(["dlx:job", job_id, *map(str, parts)])

    # -- cancel ----------------------------------------------------------------------------

    def request_cancel(self, job_id: str) -> None:
        self.r.set(self.key(job_id, "cancel"), 1, ex=KEY_TTL_S)

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.r.exists(self.key(job_id, "cancel")))

    # -- rendezvous ------------------------------------------------------------------------

    def join(self, job_id: str, attempt: int, rank: int, node: str) -> None:
        key = self.key(job_id, f"a{attempt}", "joined")
        self.r.hset(key, str(rank), node)
        self.r.expire(key, KEY_TTL_S)

    def joined(self, job_id: str, attempt: int) -> dict[int, str]:
        raw = self.r.hgetall(self.key(job_id, f"a{attempt}", "joined"))
        return {int(k): text(v) for k, v in raw.items()}

    def publish_store_address(self, job_id: str, attempt: int, address: str) -> None:
        self.r.set(self.key(job_id, f"a{attempt}", "rdzv"), address, ex=KEY_TTL_S)

    def store_address(self, job_id: str, attempt: int) -> str | None:
        value = self.r.get(self.key(job_id, f"a{attempt}", "rdzv"))
        return text(value) if value else None

    # -- liveness --------------------------------------------------------------------------

    def take_rank(self, job_id: str, attempt: int, rank: int, token: str, ttl_s: float, beat_s: float) -> bool:
        """Become the owner of `rank` (its lease, renewed every `beat_s` by the owner's
        heartbeat). A lease whose owner renews it means a live task runs the rank: False
        within about two beats. A lease left by a dead owner (a worker that crashed after
        taking the rank, whose message was then redelivered) is taken once it lapses."""
        key = self.key(job_id, f"a{attempt}", "hb", rank)
        deadline = time.monotonic() + ttl_s + 2 * beat_s
        while True:
            self.r.set(key, token, nx=True, px=int(ttl_s * 1000))
            owner = self.r.get(key)  # a retried SET NX may say "not set" for our own first try
            if owner is None:  # lapsed just now: try again
                continue
            if text(owner) == token:
                return True
            left = self.r.pttl(key)
            time.sleep(1.5 * beat_s)
            if self.r.pttl(key) > left or time.monotonic() > deadline:  # renewed: its owner lives
                return False

    def release_rank(self, job_id: str, attempt: int, rank: int, token: str) -> None:
        """Give the lease up if `token` still holds it."""
        script = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end return 0"
        self.r.eval(script, 1, self.key(job_id, f"a{attempt}", "hb", rank), token)

    def heartbeat(self, job_id: str, attempt: int, rank: int, token: str, ttl_s: float) -> bool:
        """Extend the owner's lease; False if another task owns the rank now. A lease lost
        with a Redis restart (data not yet on disk) is taken again."""
        script = """
        local v = redis.call('GET', KEYS[1])
        if v and v ~= ARGV[1] then return 0 end
        redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
        return 1
        """
        key = self.key(job_id, f"a{attempt}", "hb", rank)
        return bool(self.r.eval(script, 1, key, token, int(ttl_s * 1000)))

    def lost_ranks(self, job_id: str, attempt: int, world: int) -> list[int]:
        """Ranks whose heartbeat expired (their worker stopped answering)."""
        keys = [self.key(job_id, f"a{attempt}", "hb", r) for r in range(world)]
        return [r for r, alive in zip(range(world), self.r.mget(keys), strict=True) if alive is None]

    # -- attestations ----------------------------------------------------------------------

    def publish_claims(self, job_id: str, attempt: int, epoch: int, step: int,
                       claims: dict[tuple[int, int], dict[str, Any]]) -> None:
        key = self.key(job_id, f"a{attempt}", "claims", f"e{epoch}", step)
        self.r.hset(key, mapping={f"{r},{s}": json.dumps(v) for (r, s), v in claims.items()})
        self.r.expire(key, KEY_TTL_S)

    def claim(self, job_id: str, attempt: int, epoch: int, step: int, slot: tuple[int, int]) -> dict[str, Any] | None:
        raw = self.r.hget(self.key(job_id, f"a{attempt}", "claims", f"e{epoch}", step), f"{slot[0]},{slot[1]}")
        return json.loads(raw) if raw else None

    def put_signature(self, job_id: str, attempt: int, epoch: int, step: int, slot: tuple[int, int],
                      signature: bytes) -> None:
        key = self.key(job_id, f"a{attempt}", "sigs", f"e{epoch}", step)
        self.r.hset(key, f"{slot[0]},{slot[1]}", signature.hex())
        self.r.expire(key, KEY_TTL_S)

    def signatures(self, job_id: str, attempt: int, epoch: int, step: int) -> dict[tuple[int, int], bytes]:
        raw = self.r.hgetall(self.key(job_id, f"a{attempt}", "sigs", f"e{epoch}", step))
        out = {}
        for k, v in raw.items():
            r, s = text(k).split(",")
            out[(int(r), int(s))] = bytes.fromhex(text(v))
        return out


def settle_run_file(run_dir: str | Path, state: str) -> bool:
    """Write a queue job's state (terminal, or `running` again on a resume) into its run.json
    as the run's `status`, so that the file tells the truth once Redis is gone (`dlx runs`
    after `dlx down`). Only where the run's directory is (the host of its sink; every host
    of the local stack); a run that never reached genesis has no run.json and is left so.
    The file is replaced atomically through a temporary file of this writer's own: the
    sink may be saving a step through its own at the same moment."""
    path = Path(run_dir) / "run.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(doc, dict) or doc.get("status") == state:
        return False
    doc["status"] = state
    tmp = path.with_name(f".run.json.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


#: A worker renews its record this often; one that stops for WORKER_TTL_S is gone.
WORKER_BEAT_S, WORKER_TTL_S = 5.0, 15.0


def live_workers(r: redis.Redis) -> list[dict[str, Any]]:
    """The records of the workers whose beat is current (node, slots, queues, pid, host)."""
    keys = list(r.scan_iter(match="dlx:worker:*", count=1000))
    return [json.loads(v) for v in r.mget(keys) if v is not None] if keys else []


class WorkerBeat:
    """Announces this worker in Redis (its node, rank slots and queues) from its own thread,
    so `dlx submit` can refuse a job that needs more rank slots than the live workers offer
    instead of letting it wait out the rendezvous timeout. The record lapses WORKER_TTL_S
    after the worker stops beating; a clean stop removes it at once."""

    def __init__(self, r: redis.Redis, info: dict[str, Any]) -> None:
        self.r, self.info = r, info
        self.key = f"dlx:worker:{info['node']}:{info['pid']}@{info['host']}"
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self.r.set(self.key, json.dumps(self.info), px=int(WORKER_TTL_S * 1000))

    def _run(self) -> None:
        while not self._stop.wait(WORKER_BEAT_S):
            try:
                self._beat()
            except redis.RedisError:  # Redis away for a while: the next beat tries again
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self.r.delete(self.key)
        except redis.RedisError:
            pass  # it lapses by itself


def text(value: bytes | str) -> str:
    """A Redis reply as text (this client answers bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def _enc(fields: dict[str, Any]) -> dict[Any, str]:
    return {k: json.dumps(v) for k, v in fields.items()}
