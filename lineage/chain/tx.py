"""Sending to a chain that behaves like a real one: outages, fees, nonces, confirmations.

A public chain or an L2 is not the local anvil that mines each transaction at once and never
goes away. This module is what `lineage.chain.client.Chain` sends and reads through:

- `PatientProvider`: every JSON-RPC request retried with exponential backoff while the
  endpoint refuses connections, times out, answers HTTP 429 or 5xx, or reports a rate limit
  (`transient`), for at most `TxPolicy.outage_s` seconds of one outage; past it a
  `ChainUnavailable` names the endpoint and the last error (exit code 1, and `--resume`
  continues). A frozen node is a timeout like any other.
- `send`: EIP-1559 fees from the node's base fee and priority fee estimate (`fees`), capped
  at `TxPolicy.max_fee_gwei` (a `ChainFeeError` when the cap is below the base fee); a
  transaction not mined within `TxPolicy.replace_after_s` is replaced with the same nonce and
  fees bumped by at least 12.5% (`bump`), as nodes require of a replacement; a transaction
  the node forgot (dropped from its pool, or mined in blocks a reorganisation removed) is
  sent again, with the next nonce the chain says is free; it returns only once the receipt
  has `TxPolicy.confirmations` blocks on top, and checks after the wait that the receipt is
  still on the chain.
- Nonces: one lock per sending key in this process (`sender_lock`): one key's transactions
  go out one at a time, and each takes the chain's pending nonce when it is built, so a
  dropped or reorganised transaction, or another process with the same key, leaves no gap.

Keys never appear in a message: errors name the context, the endpoint and the node's answer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from web3 import HTTPProvider
from web3.exceptions import ContractLogicError, TransactionNotFound, Web3Exception, Web3RPCError

from lineage.errors import ChainError, ChainFeeError, ChainUnavailable

GWEI = 10**9
#: Replacements and resends, one line each (on stderr where nothing configured logging).
log = logging.getLogger("dlx.chain")
#: Seconds the node must not know a sent transaction before it counts as lost and is sent again.
LOST_AFTER_S = 1.0
#: The least a replacement must raise both fee fields by (geth's and anvil's price bump).
MIN_BUMP = 0.125
#: The first and the longest wait between two tries of a failing request, seconds.
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.25, 8.0
#: JSON-RPC error codes and message fragments that mean "later", not "no".
_RATE_LIMIT_CODES = {-32005, -32029, 429}
_TRANSIENT_WORDS = ("rate limit", "too many requests", "limit exceeded", "header not found", "try again",
                    "timeout", "temporarily unavailable", "busy")


@dataclass(frozen=True)
class TxPolicy:
    """How patient a `Chain` is; the `[chain]` settings of the same names (docs/chain.md)."""

    #: Blocks a transaction's block needs on top before `send` returns (0: mined is enough).
    confirmations: int = 0
    #: Seconds one outage (refused, timed out, 429, 5xx) is retried before `ChainUnavailable`.
    outage_s: float = 0.0
    #: The most a transaction may pay per gas, in gwei (None: no cap).
    max_fee_gwei: float | None = None
    #: Seconds a sent transaction may wait unmined before it is replaced with bumped fees.
    replace_after_s: float = 30.0
    #: Seconds between two polls for a receipt or a new block.
    poll_s: float = 0.2
    #: Seconds one HTTP request may take before it counts as a timeout.
    request_timeout_s: float = 30.0


def transient(exc: BaseException) -> bool:
    """Whether a failed request is worth trying again: the endpoint is down, slow, frozen or
    rate-limiting, not refusing what was asked."""
    import requests

    if isinstance(exc, requests.exceptions.HTTPError):
        status = exc.response.status_code if exc.response is not None else 0
        return status == 429 or status >= 500
    if isinstance(exc, requests.exceptions.InvalidSchema | requests.exceptions.MissingSchema
                  | requests.exceptions.InvalidURL):
        return False
    if isinstance(exc, requests.exceptions.RequestException | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, Web3RPCError):
        return rpc_error_transient(exc.rpc_response.get("error") if isinstance(exc.rpc_response, dict) else None)
    return False


def rpc_error_transient(error: object) -> bool:
    """Whether a JSON-RPC error object is a rate limit or a node catching up."""
    if not isinstance(error, dict):
        return False
    message = str(error.get("message", "")).lower()
    if "range" in message or "results" in message:  # a log query too wide: narrowed, not retried
        return False
    return error.get("code") in _RATE_LIMIT_CODES or any(word in message for word in _TRANSIENT_WORDS)


def backoff(attempt: int) -> float:
    """Seconds to wait before try `attempt` + 1 (doubling from BACKOFF_FIRST_S, capped)."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** min(attempt, 16))


class Outage:
    """One run of failures of an endpoint: `retry(exc)` sleeps the next backoff, or raises
    `ChainUnavailable` once `budget_s` has passed since the first failure."""

    def __init__(self, url: str, budget_s: float, what: str = "",
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.url, self.budget_s, self.what = url, budget_s, what
        self.clock, self.sleep = clock, sleep
        self.started: float | None = None
        self.attempt = 0

    def retry(self, exc: BaseException) -> None:
        if self.budget_s <= 0:  # no patience asked for: the failure as it came
            raise exc
        now = self.clock()
        if self.started is None:
            self.started = now
        if now - self.started >= self.budget_s:
            for_what = f" ({self.what})" if self.what else ""
            raise ChainUnavailable(
                f"chain at {self.url} unavailable for {now - self.started:.0f} s{for_what}, past chain.outage_s "
                f"({self.budget_s:g} s); last error: {why_failed(exc)}") from None
        self.sleep(min(backoff(self.attempt), max(0.0, self.budget_s - (now - self.started))))
        self.attempt += 1


class PatientProvider(HTTPProvider):
    """An HTTPProvider that retries transient failures (`transient`) for `outage_s` seconds;
    web3's own retry (a few quick tries of read methods only) is off then, and kept where
    no outage is waited for (`outage_s` 0: the readers, a local anvil)."""

    def __init__(self, url: str, policy: TxPolicy, **kwargs: Any) -> None:
        if policy.outage_s > 0:
            kwargs["exception_retry_configuration"] = None
        super().__init__(url, request_kwargs={"timeout": policy.request_timeout_s}, **kwargs)
        self.policy = policy

    def make_request(self, method: Any, params: Any) -> Any:
        outage = Outage(str(self.endpoint_uri), self.policy.outage_s, method)
        while True:
            try:
                response = super().make_request(method, params)
            except (OSError, Web3Exception) as exc:
                if not transient(exc):
                    raise
                outage.retry(exc)
                continue
            if isinstance(response, dict) and rpc_error_transient(response.get("error")):
                outage.retry(Web3RPCError(str(response["error"].get("message")), rpc_response=response))
                continue
            return response

    def make_batch_request(self, batch_requests: Any) -> Any:
        outage = Outage(str(self.endpoint_uri), self.policy.outage_s, "a batch")
        while True:
            try:
                return super().make_batch_request(batch_requests)
            except (OSError, Web3Exception) as exc:
                if not transient(exc):
                    raise
                outage.retry(exc)


def why_failed(exc: BaseException) -> str:
    """What a failed chain request means, in the user's terms: not urllib3's retry chain,
    requests' adapter names or a JSON-RPC error dict."""
    import requests

    if isinstance(exc, requests.exceptions.InvalidSchema | requests.exceptions.MissingSchema
                  | requests.exceptions.InvalidURL):
        return "not an http:// or https:// URL"
    if isinstance(exc, requests.exceptions.Timeout):
        return "no answer in time"
    if isinstance(exc, requests.exceptions.ConnectionError):
        text = str(exc)
        if "refused" in text.lower():
            return "connection refused"
        if "resolve" in text or "Name or service not known" in text:
            return "unknown host"
        return "connection lost"
    if isinstance(exc, requests.exceptions.HTTPError) and exc.response is not None:
        return f"HTTP {exc.response.status_code} (not a JSON-RPC endpoint)"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, Web3RPCError) and isinstance(exc.rpc_response, dict):
        error = exc.rpc_response.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    text = str(exc).strip()
    return text.splitlines()[0] if text else exc.__class__.__name__


# -- fees -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fees:
    """EIP-1559 fee fields, wei per gas."""

    max_fee: int
    priority: int

    def fields(self) -> dict[str, int]:
        return {"maxFeePerGas": self.max_fee, "maxPriorityFeePerGas": self.priority}


def fees(base_fee: int, priority: int, max_fee_gwei: float | None, context: str = "") -> Fees:
    """Fees for a transaction: twice the base fee plus the priority fee (room for six full
    blocks of base fee rises), capped at `max_fee_gwei`; a cap below the base fee cannot be
    mined now and is a `ChainFeeError`."""
    max_fee = 2 * base_fee + priority
    if max_fee_gwei is not None:
        cap = int(max_fee_gwei * GWEI)
        if cap < base_fee:
            where = f"{context}: " if context else ""
            raise ChainFeeError(f"{where}the chain's base fee is {base_fee / GWEI:g} gwei, above chain.max_fee_gwei "
                                f"({max_fee_gwei:g}): raise the cap, or wait for fees to fall and --resume")
        max_fee = min(max_fee, cap)
        priority = min(priority, max_fee)
    return Fees(max_fee, priority)


def bump(old: Fees, fresh: Fees, max_fee_gwei: float | None = None) -> Fees:
    """Fees for a replacement of a transaction sent with `old`: at least 12.5% above both of
    its fields (rounded up), and at least what the chain asks now (`fresh`); the cap still
    holds, and a replacement the cap cannot afford is a `ChainFeeError`."""
    max_fee = max(math.ceil(old.max_fee * (1 + MIN_BUMP)), fresh.max_fee)
    priority = max(math.ceil(old.priority * (1 + MIN_BUMP)), fresh.priority)
    if max_fee_gwei is not None and max_fee > int(max_fee_gwei * GWEI):
        raise ChainFeeError(f"replacing a stuck transaction needs {max_fee / GWEI:g} gwei per gas, above "
                            f"chain.max_fee_gwei ({max_fee_gwei:g})")
    return Fees(max_fee, min(priority, max_fee))


def current_fees(w3: Any, policy: TxPolicy, context: str) -> Fees:
    """`fees` from the latest block's base fee and the node's priority fee estimate."""
    block = w3.eth.get_block("latest")
    base = int(block.get("baseFeePerGas") or 0)
    try:
        priority = int(w3.eth.max_priority_fee)
    except (Web3Exception, ValueError):  # a node without eth_maxPriorityFeePerGas
        priority = GWEI
    return fees(base, priority, policy.max_fee_gwei, context)


# -- nonces ---------------------------------------------------------------------------------

_SENDER_LOCKS: dict[str, threading.Lock] = {}
_SENDER_LOCKS_GUARD = threading.Lock()


def sender_lock(address: str) -> threading.Lock:
    """The lock one key's transactions from this process go out under, one at a time."""
    with _SENDER_LOCKS_GUARD:
        return _SENDER_LOCKS.setdefault(address.lower(), threading.Lock())


def _nonce_taken(exc: BaseException) -> bool:
    """Whether a send failed because a transaction with its nonce is already known or mined."""
    text = str(exc).lower()
    return any(m in text for m in ("nonce too low", "already known", "transaction already imported",
                                   "nonce has already been used"))


def _underpriced(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "underpriced" in text or "fee too low" in text


# -- sending --------------------------------------------------------------------------------


@dataclass
class _Attempt:
    """The transaction being sent: its fields, and every hash sent with its nonce."""

    tx: dict[str, Any]
    fees: Fees
    hashes: list[bytes]
    sent_at: float
    unknown_since: float | None = None  # when the node first said it knew none of `hashes`


def send(chain: Any, fn: Any, sender: Any, *, value: int = 0, context: str) -> Any:
    """Sign and send `fn` from `sender` on `chain` (a `lineage.chain.client.Chain`), replace
    it while it is stuck, send it again if it is lost, and return its receipt once it has
    `chain.policy.confirmations` blocks on top. A revert is the contract's custom error by
    name (`decode_revert`); a mined transaction that failed is a ChainError."""
    policy: TxPolicy = chain.policy
    with sender_lock(sender.address):
        attempt = _send_new(chain, fn, sender, value, context)
        started = time.monotonic()
        while True:
            receipt = _wait_mined(chain, attempt, fn, sender, value, context, started)
            if receipt["status"] != 1:
                raise ChainError(f"{context}: transaction {receipt['transactionHash'].to_0x_hex()} failed")
            if _confirmed(chain, receipt, policy, context):
                return receipt
            # the receipt's block left the chain while waiting: the transaction is pending
            # again, mined elsewhere, or forgotten; the wait loop finds out which


def _build(chain: Any, fn: Any, sender: Any, value: int, context: str, nonce: int, fees_: Fees) -> dict[str, Any]:
    try:
        return dict(fn.build_transaction({"from": sender.address, "value": value, "nonce": nonce,
                                          "chainId": chain.chain_id, **fees_.fields()}))
    except ContractLogicError as exc:
        raise chain.revert(exc.data, context) from None


def _send_new(chain: Any, fn: Any, sender: Any, value: int, context: str) -> _Attempt:
    """Build, sign and send with the chain's next pending nonce and current fees."""
    w3 = chain.w3
    for attempt in range(8):
        try:
            nonce = w3.eth.get_transaction_count(sender.address, "pending")
            fees_ = current_fees(w3, chain.policy, context)
        except (OSError, Web3Exception) as exc:
            raise chain.failure(context, exc) from None
        tx = _build(chain, fn, sender, value, context, nonce, fees_)
        try:
            tx_hash = _send_signed(chain, tx, sender)
        except (OSError, Web3Exception) as exc:
            if _nonce_taken(exc) and attempt < 7:  # another process with this key took it first
                time.sleep(0.05 * (attempt + 1))
                continue
            raise chain.failure(context, exc) from None
        return _Attempt(tx, fees_, [tx_hash], time.monotonic())
    raise ChainError(f"{context}: no free nonce for {sender.address}")  # unreachable: the loop raises


def _send_signed(chain: Any, tx: dict[str, Any], sender: Any) -> bytes:
    signed = sender.sign_transaction(tx)
    return bytes(chain.w3.eth.send_raw_transaction(signed.raw_transaction))


def _replace(chain: Any, attempt: _Attempt, sender: Any, context: str) -> None:
    """Send the stuck transaction again with the same nonce and bumped fees."""
    fresh = current_fees(chain.w3, chain.policy, context)
    for _ in range(4):
        new = bump(attempt.fees, fresh, chain.policy.max_fee_gwei)
        tx = {**attempt.tx, **new.fields()}
        try:
            attempt.hashes.append(_send_signed(chain, tx, sender))
        except (OSError, Web3Exception) as exc:
            if _underpriced(exc):
                attempt.fees = new  # bump again from there
                continue
            if _nonce_taken(exc):  # one of ours (or another sender's) was mined meanwhile
                attempt.sent_at = time.monotonic()
                return
            raise chain.failure(context, exc) from None
        log.warning("chain: %s not mined in %.0f s; replaced with the same nonce at %.3g gwei per gas",
                    context, time.monotonic() - attempt.sent_at, new.max_fee / GWEI)
        attempt.tx, attempt.fees, attempt.sent_at = tx, new, time.monotonic()
        return


def _receipt(w3: Any, tx_hash: bytes) -> Any:
    try:
        return w3.eth.get_transaction_receipt(tx_hash)
    except TransactionNotFound:
        return None


def _known(w3: Any, tx_hash: bytes) -> bool:
    try:
        w3.eth.get_transaction(tx_hash)
        return True
    except TransactionNotFound:
        return False


def _wait_mined(chain: Any, attempt: _Attempt, fn: Any, sender: Any, value: int, context: str,
                started: float) -> Any:
    """Poll until one of the attempt's hashes has a receipt; replace it when stuck, send it
    anew when the node forgot every hash (dropped, or removed by a reorganisation)."""
    w3, policy = chain.w3, chain.policy
    deadline = started + max(policy.outage_s, 120.0)
    while True:
        try:
            for tx_hash in attempt.hashes:
                receipt = _receipt(w3, tx_hash)
                if receipt is not None:
                    return receipt
            if any(_known(w3, h) for h in attempt.hashes):
                attempt.unknown_since = None
            else:
                # a node behind a load balancer may not know a transaction a moment after
                # another accepted it: lost only once unknown for LOST_AFTER_S
                attempt.unknown_since = attempt.unknown_since or time.monotonic()
            if attempt.unknown_since is not None and time.monotonic() - attempt.unknown_since >= LOST_AFTER_S:
                if w3.eth.get_transaction_count(sender.address, "latest") > attempt.tx["nonce"]:
                    # the nonce is used, but by none of ours that the node knows: look once
                    # more (a receipt may have arrived in between), then send anew
                    if any(_receipt(w3, h) is not None for h in attempt.hashes):
                        continue
                log.warning("chain: %s: the node lost the transaction (dropped, or in blocks a reorganisation "
                            "removed); sending it again", context)
                new = _send_new(chain, fn, sender, value, context)
                attempt.tx, attempt.fees, attempt.sent_at = new.tx, new.fees, new.sent_at
                attempt.hashes, attempt.unknown_since = new.hashes, None
            elif attempt.unknown_since is None and time.monotonic() - attempt.sent_at > policy.replace_after_s:
                _replace(chain, attempt, sender, context)
        except (OSError, Web3Exception) as exc:
            raise chain.failure(context, exc) from None
        if time.monotonic() > deadline:
            raise ChainUnavailable(f"{context}: not mined within {deadline - started:.0f} s at {chain.rpc_url}")
        time.sleep(policy.poll_s)


def _confirmed(chain: Any, receipt: Any, policy: TxPolicy, context: str) -> bool:
    """Wait until `receipt`'s block has `confirmations` blocks on top; False if the receipt
    left the chain meanwhile (a reorganisation), True if it is still there."""
    w3 = chain.w3
    deadline = time.monotonic() + max(policy.outage_s, 120.0)
    try:
        while w3.eth.block_number - receipt["blockNumber"] < policy.confirmations:
            if time.monotonic() > deadline:
                raise ChainUnavailable(f"{context}: no {policy.confirmations} blocks on top of block "
                                       f"{receipt['blockNumber']} within {max(policy.outage_s, 120.0):.0f} s "
                                       f"at {chain.rpc_url} (does the chain mine without transactions?)")
            time.sleep(policy.poll_s)
        now = _receipt(w3, receipt["transactionHash"])
    except (OSError, Web3Exception) as exc:
        raise chain.failure(context, exc) from None
    return now is not None and now["blockHash"] == receipt["blockHash"]
