"""The JSON-RPC side of the chain: a web3 connection that signs and sends transactions,
the contracts' forge artifacts, and revert data decoded into the contract's custom error.

A revert is decoded into the contract's custom error, a typed exception generated from the
contracts' ABIs (lineage/chain/reverts.py), whose message names it and its arguments
(`LedgerStaleParent(expected=0x.., got=0x..)`) instead of a bare selector; a transport failure becomes one line naming the endpoint (`chain_failure`).
Transactions are signed locally by the sending account and waited on.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

from eth_abi import decode as abi_decode
from eth_abi.exceptions import DecodingError
from eth_account.signers.local import LocalAccount
from eth_utils import to_checksum_address
from web3 import Web3
from web3.exceptions import ContractLogicError, Web3Exception

from lineage.errors import ChainError

from .anvil import PROJECT_ROOT
from .reverts import BY_SELECTOR
from .tx import PatientProvider, TxPolicy, send, why_failed


def contracts_out() -> Path:
    """Forge's `out/` directory (`$DLX_CONTRACTS_OUT` or contracts/out in the checkout)."""
    return Path(os.environ.get("DLX_CONTRACTS_OUT", PROJECT_ROOT / "contracts" / "out"))


@cache
def artifact(name: str) -> tuple[list[dict[str, Any]], str]:
    """(abi, creation bytecode) of contract `name` from forge's `out/` directory, or of a
    superseded version (`TrainingLedger-v1`) from contracts/legacy/."""
    if "-v" in name:
        path = PROJECT_ROOT / "contracts" / "legacy" / f"{name}.json"
    else:
        path = contracts_out() / f"{name}.sol" / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ChainError(f"contract artifact {path} missing: run ./scripts/setup (it builds the contracts)") from None
    return data["abi"], data["bytecode"]["object"]


def decode_revert(data: str | bytes | dict[str, str] | None, context: str = "") -> ChainError:
    """Turn revert data into the contract's custom error, the `ChainRevertError` subclass of
    its name (lineage/chain/reverts.py), or a ChainError when it names none."""
    if isinstance(data, dict):
        data = data.get("data")
    if isinstance(data, str):
        data = bytes.fromhex(data.removeprefix("0x")) if data.startswith("0x") else None
    if not data or len(data) < 4:
        return ChainError(f"{context}: reverted without a reason" if context else "reverted without a reason")
    error = BY_SELECTOR.get(bytes(data[:4]))
    if error is None:
        return ChainError(f"{context}: reverted with unknown error 0x{bytes(data[:4]).hex()}")
    try:
        values = abi_decode([t for _, t in error.inputs], bytes(data[4:]))
    except DecodingError:
        return ChainError(f"{context}: reverted with {error.__name__} and arguments that do not decode")
    return error(error.__name__, {n: v for (n, _), v in zip(error.inputs, values, strict=True)}, context)


def chain_failure(context: str, exc: BaseException, url: str | None) -> ChainError:
    """One line for a failed request: a transport failure names the endpoint (the chain was
    refused, lost or is no chain at all); a JSON-RPC error gives the node's message."""
    why = why_failed(exc)
    if isinstance(exc, OSError) and url:
        return ChainError(f"{context}: chain at {url}: {why}")
    return ChainError(f"{context}: {why}")


def endpoint_of(fn: Any) -> str | None:
    """The RPC URL a contract function is bound to (None when it has none)."""
    provider = getattr(getattr(fn, "w3", None), "provider", None)
    return getattr(provider, "endpoint_uri", None)


def call_view(fn: Any, context: str) -> Any:
    """Call a view function; a revert becomes the contract's custom error by name."""
    try:
        return fn.call()
    except ContractLogicError as exc:
        raise decode_revert(exc.data, context) from None
    except (OSError, Web3Exception) as exc:
        raise chain_failure(context, exc, endpoint_of(fn)) from None


class Chain:
    """A web3 connection plus a signer-side transaction helper."""

    def __init__(self, rpc_url: str, expected_chain_id: int | None = None, policy: TxPolicy | None = None) -> None:
        self.rpc_url = rpc_url
        self.policy = policy or TxPolicy()
        # eth_chainId is cached: web3 asks for it before every call and transaction.
        self.w3 = Web3(PatientProvider(rpc_url, self.policy, cache_allowed_requests=True,
                                       cacheable_requests={"eth_chainId"}))
        try:
            self.chain_id = self.w3.eth.chain_id
        except (OSError, Web3Exception) as exc:
            raise ChainError(f"cannot reach the chain at {rpc_url}: {why_failed(exc)}") from None
        if expected_chain_id is not None and self.chain_id != expected_chain_id:
            raise ChainError(f"wrong chain id at {rpc_url}: expected {expected_chain_id}, got {self.chain_id}")

    def transact(self, fn: Any, sender: LocalAccount, *, value: int = 0, context: str) -> Any:
        """Sign and send a contract call (or constructor) from `sender`; return the receipt
        once it has `policy.confirmations` blocks on top (`lineage.chain.tx.send`: fees,
        replacement of a stuck transaction, a lost one sent again, one nonce at a time per
        key in this process, and a nonce another process took first retried)."""
        return send(self, fn, sender, value=value, context=context)

    def revert(self, data: Any, context: str) -> ChainError:
        """`decode_revert` (the contract's custom error by name)."""
        return decode_revert(data, context)

    def failure(self, context: str, exc: BaseException) -> ChainError:
        """`chain_failure` on this chain's endpoint."""
        return chain_failure(context, exc, self.rpc_url)

    def require_funds(self, account: str, amount: int, what: str) -> None:
        """Refuse, before anything is sent, a payment `account` cannot make with gas on top
        (the node would refuse it with an "insufficient funds" error, half way through)."""
        try:
            have = self.w3.eth.get_balance(to_checksum_address(account))
        except (OSError, Web3Exception) as exc:
            raise chain_failure(f"balance of {account}", exc, self.rpc_url) from None
        if amount >= have:
            raise ChainError(f"{what} of {amount} wei ({amount / 10**18:g} ETH) is more than {account} holds on "
                             f"{self.rpc_url}: {have} wei ({have / 10**18:g} ETH), and gas is paid too")

    def contract(self, name: str, address: str) -> Any:
        abi, _ = artifact(name)
        return self.w3.eth.contract(address=to_checksum_address(address), abi=abi)

    def deploy(self, name: str, sender: LocalAccount, *args: Any) -> str:
        abi, bytecode = artifact(name)
        factory = self.w3.eth.contract(abi=abi, bytecode=bytecode)
        receipt = self.transact(factory.constructor(*args), sender, context=f"deploy {name}")
        return receipt["contractAddress"]
