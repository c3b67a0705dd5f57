"""Job records, rendezvous and attestation exchange, kept in Redis.

Keys (all under `dlx:job:<id>`):

    dlx:job:<id>                  hash: the job's record (state, progress, run, error)
    dlx:job:<id>:cancel           set when the user cancels; rank 0 polls it
    dlx:job:<id>:a<k>:joined      hash rank -> node address, for attempt k
    dlx:job:<id>:a<k>:rdzv        rank 0's TCPStore address "host:port" for attempt k
    dlx:job:<id>:a<k>:claims:<t>  hash slot -> claim JSON published by rank 0 for step t
    dlx:job:<id>:a<k>:sigs:<t>    hash slot -> signature hex, written by each slot's node

An attempt is one try at running the job (the first, then one per `dlx resume`); rank
tasks of an older attempt find the attempt moved on and exit without doing anything.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from trainer.errors import DlxError

TERMINAL = ("completed", "failed", "cancelled")
KEY_TTL_S = 7 * 24 * 3600


class JobError(DlxError, RuntimeError):
    """A queued job could not run, or the job store refused an operation."""


def connect(url: str) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise JobError(f"cannot reach Redis at {redact(url)}: {exc.__class__.__name__}") from None
    return client


def redact(url: str) -> str:
    """A Redis URL without its password, for messages."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


@dataclass
class JobStore:
    r: redis.Redis

    # -- the record ------------------------------------------------------------------------

    def create(self, fields: dict[str, Any]) -> str:
        job_id = uuid.uuid4().hex[:12]
        now = time.time()
        self.r.hset(self.key(job_id), mapping=_enc({**fields, "state": "queued", "attempt": 1,
                                                    "created": now, "updated": now}))
        self.r.expire(self.key(job_id), KEY_TTL_S)
        return job_id

    def get(self, job_id: str) -> dict[str, Any]:
        raw = self.r.hgetall(self.key(job_id))
        if not raw:
            raise JobError(f"no such job: {job_id}")
        return {k.decode(): json.loads(v) for k, v in raw.items()}

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
        return bool(self.r.eval(script, 1, self.key(job_id), json.dumps(state), err, json.dumps(time.time())))

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
        return {int(k): v.decode() for k, v in raw.items()}

    def publish_store_address(self, job_id: str, attempt: int, address: str) -> None:
        self.r.set(self.key(job_id, f"a{attempt}", "rdzv"), address, ex=KEY_TTL_S)

    def store_address(self, job_id: str, attempt: int) -> str | None:
        value = self.r.get(self.key(job_id, f"a{attempt}", "rdzv"))
        return value.decode() if value else None

    # -- liveness --------------------------------------------------------------------------

    def heartbeat(self, job_id: str, attempt: int, rank: int, ttl_s: float) -> None:
        self.r.set(self.key(job_id, f"a{attempt}", "hb", rank), 1, px=int(ttl_s * 1000))

    def lost_ranks(self, job_id: str, attempt: int, world: int) -> list[int]:
        """Ranks whose heartbeat expired (their worker stopped answering)."""
        keys = [self.key(job_id, f"a{attempt}", "hb", r) for r in range(world)]
        return [r for r, alive in zip(range(world), self.r.mget(keys), strict=True) if alive is None]

    # -- attestations ----------------------------------------------------------------------

    def publish_claims(self, job_id: str, attempt: int, step: int, claims: dict[int, dict[str, Any]]) -> None:
        key = self.key(job_id, f"a{attempt}", "claims", step)
        self.r.hset(key, mapping={str(k): json.dumps(v) for k, v in claims.items()})
        self.r.expire(key, KEY_TTL_S)

    def claim(self, job_id: str, attempt: int, step: int, slot: int) -> dict[str, Any] | None:
        raw = self.r.hget(self.key(job_id, f"a{attempt}", "claims", step), str(slot))
        return json.loads(raw) if raw else None

    def put_signature(self, job_id: str, attempt: int, step: int, slot: int, signature: bytes) -> None:
        key = self.key(job_id, f"a{attempt}", "sigs", step)
        self.r.hset(key, str(slot), signature.hex())
        self.r.expire(key, KEY_TTL_S)

    def signatures(self, job_id: str, attempt: int, step: int) -> dict[int, bytes]:
        raw = self.r.hgetall(self.key(job_id, f"a{attempt}", "sigs", step))
        return {int(k): bytes.fromhex(v.decode()) for k, v in raw.items()}


def _enc(fields: dict[str, Any]) -> dict[str, str]:
    return {k: json.dumps(v) for k, v in fields.items()}
