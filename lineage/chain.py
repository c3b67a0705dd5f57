"""Typed access to the ledger contracts (NodeRegistry, TrainingLedger) over web3.

Transactions are signed locally by the sending account and waited on; a revert is
decoded against the contracts' ABIs so the error names the contract's custom error and
its arguments (`LedgerStaleParent(expected=0x.., got=0x..)`) instead of a bare selector.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from eth_abi import decode as abi_decode
from eth_account.signers.local import LocalAccount
from eth_utils import keccak, to_checksum_address
from web3 import Web3
from web3.exceptions import ContractLogicError, TimeExhausted, Web3Exception

from .anvil import PROJECT_ROOT
from .errors import ChainError, ChainRevertError


def contracts_out() -> Path:
    return Path(os.environ.get("DLX_CONTRACTS_OUT", PROJECT_ROOT / "contracts" / "out"))


@cache
def artifact(name: str) -> tuple[list[dict[str, Any]], str]:
    """(abi, creation bytecode) of contract `name` from forge's `out/` directory."""
    path = contracts_out() / f"{name}.sol" / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ChainError(f"contract artifact {path} missing: run ./scripts/setup (it builds the contracts)") from None
    return data["abi"], data["bytecode"]["object"]


@cache
def _error_table() -> dict[bytes, dict[str, Any]]:
    table: dict[bytes, dict[str, Any]] = {}
    for name in ("TrainingLedger", "NodeRegistry"):
        abi, _ = artifact(name)
        for item in abi:
            if item.get("type") == "error":
                sig = f"{item['name']}({','.join(_abi_type(i) for i in item['inputs'])})"
                table[keccak(text=sig)[:4]] = item
    return table


def _abi_type(item: dict[str, Any]) -> str:
    if item["type"].startswith("tuple"):
        return "(" + ",".join(_abi_type(c) for c in item["components"]) + ")" + item["type"][5:]
    return item["type"]


def decode_revert(data: str | bytes | None, context: str = "") -> ChainError:
    """Turn revert data into a ChainRevertError naming the custom error (or a ChainError)."""
    if isinstance(data, dict):
        data = data.get("data")
    if isinstance(data, str):
        data = bytes.fromhex(data.removeprefix("0x")) if data.startswith("0x") else None
    if not data or len(data) < 4:
        return ChainError(f"{context}: reverted without a reason" if context else "reverted without a reason")
    item = _error_table().get(bytes(data[:4]))
    if item is None:
        return ChainError(f"{context}: reverted with unknown error 0x{bytes(data[:4]).hex()}")
    values = abi_decode([_abi_type(i) for i in item["inputs"]], bytes(data[4:]))
    return ChainRevertError(item["name"], {i["name"]: v for i, v in zip(item["inputs"], values, strict=True)}, context)


@dataclass(frozen=True)
class Attestation:
    """One slot's signed claim, as `commitStep` takes it."""

    replica: int
    stage: int
    contribution: bytes
    data_shard: bytes
    code_hash: bytes
    loss_micros: int
    signature: bytes

    def as_tuple(self) -> tuple:
        return (self.replica, self.stage, self.contribution, self.data_shard,
                self.code_hash, self.loss_micros, self.signature)


class Chain:
    """A web3 connection plus a signer-side transaction helper."""

    def __init__(self, rpc_url: str, expected_chain_id: int | None = None) -> None:
        self.rpc_url = rpc_url
        self.w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={"timeout": 30}))
        try:
            self.chain_id = self.w3.eth.chain_id
        except (OSError, Web3Exception) as exc:
            raise ChainError(f"cannot reach the chain at {rpc_url}: {exc.__class__.__name__}") from None
        if expected_chain_id is not None and self.chain_id != expected_chain_id:
            raise ChainError(f"wrong chain id at {rpc_url}: expected {expected_chain_id}, got {self.chain_id}")

    def transact(self, fn: Any, sender: LocalAccount, *, value: int = 0, context: str) -> Any:
        """Sign and send a contract call (or constructor) from `sender`; return the receipt."""
        try:
            tx = fn.build_transaction({
                "from": sender.address,
                "value": value,
                "nonce": self.w3.eth.get_transaction_count(sender.address, "pending"),
                "chainId": self.chain_id,
            })
        except ContractLogicError as exc:
            raise decode_revert(exc.data, context) from None
        except (OSError, Web3Exception) as exc:
            raise ChainError(f"{context}: {exc}") from None
        signed = sender.sign_transaction(tx)
        try:
            tx_hash = self.w3.eth.send_raw_transaction(signed.raw_transaction)
            receipt = self.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=120)
        except TimeExhausted:
            raise ChainError(f"{context}: no receipt within 120 s") from None
        except (OSError, Web3Exception) as exc:
            raise ChainError(f"{context}: {exc}") from None
        if receipt["status"] != 1:
            raise ChainError(f"{context}: transaction {tx_hash.to_0x_hex()} failed")
        return receipt

    def contract(self, name: str, address: str) -> Any:
        abi, _ = artifact(name)
        return self.w3.eth.contract(address=to_checksum_address(address), abi=abi)

    def deploy(self, name: str, sender: LocalAccount, *args: Any) -> str:
        abi, bytecode = artifact(name)
        factory = self.w3.eth.contract(abi=abi, bytecode=bytecode)
        receipt = self.transact(factory.constructor(*args), sender, context=f"deploy {name}")
        return receipt["contractAddress"]


@dataclass(frozen=True)
class StepRecord:
    """One `StepCommitted` event and its `ContributionAttested` companions."""

    step: int
    checkpoint: bytes
    parent: bytes
    contributions_root: bytes
    metrics_digest: bytes
    submitter: str
    tx: str
    block: int
    attestations: list[dict[str, Any]]


class Ledger:
    """The TrainingLedger and its NodeRegistry at known addresses."""

    def __init__(self, chain: Chain, registry: str, ledger: str) -> None:
        self.chain = chain
        self.registry = chain.contract("NodeRegistry", registry)
        self.ledger = chain.contract("TrainingLedger", ledger)

    @classmethod
    def deploy(cls, chain: Chain, deployer: LocalAccount) -> Ledger:
        registry = chain.deploy("NodeRegistry", deployer)
        ledger = chain.deploy("TrainingLedger", deployer, registry)
        return cls(chain, registry, ledger)

    @property
    def addresses(self) -> dict[str, str]:
        return {"registry": self.registry.address, "ledger": self.ledger.address}

    # -- node registry --------------------------------------------------------------------

    def ensure_staked(self, node: LocalAccount, amount: int) -> None:
        """Register `node` if needed and top its stake up to at least `amount` wei."""
        fns = self.registry.functions
        if not fns.isRegistered(node.address).call():
            self.chain.transact(fns.register(), node, context=f"register {node.address}")
        have = fns.stakeOf(node.address).call()
        if have < amount:
            self.chain.transact(fns.stake(), node, value=amount - have, context=f"stake {node.address}")

    def stake_of(self, node: str) -> int:
        return self.registry.functions.stakeOf(to_checksum_address(node)).call()

    # -- runs -----------------------------------------------------------------------------

    def create_run(
        self,
        sender: LocalAccount,
        *,
        config_digest: bytes,
        genesis_digest: bytes,
        nodes: list[str],
        replicas: int,
        stages: int,
        challenge_window: int,
        min_stake: int,
        arbiters: list[str] | None = None,
        quorum: int = 0,
    ) -> int:
        fn = self.ledger.functions.createRun(
            config_digest, genesis_digest, [to_checksum_address(n) for n in nodes],
            replicas, stages, challenge_window, min_stake, arbiters or [], quorum,
        )
        receipt = self.chain.transact(fn, sender, context="createRun")
        (event,) = self.ledger.events.RunCreated().process_receipt(receipt)
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
    ) -> str:
        root = keccak(b"".join(a.contribution for a in attestations))
        fn = self.ledger.functions.commitStep(
            run_id, step, parent, checkpoint, root, metrics_digest,
            [a.as_tuple() for a in attestations],
        )
        receipt = self.chain.transact(fn, sender, context=f"commitStep(run {run_id}, step {step})")
        return receipt["transactionHash"].to_0x_hex()

    def head(self, run_id: int) -> tuple[bytes, int]:
        head, step = self.ledger.functions.runHead(run_id).call()
        return bytes(head), int(step)

    def run_created(self, run_id: int) -> dict[str, Any]:
        logs = self.ledger.events.RunCreated().get_logs(
            from_block=0, argument_filters={"runId": run_id}
        )
        if not logs:
            raise ChainError(f"run {run_id} not found on ledger {self.ledger.address}")
        return dict(logs[0]["args"])

    def steps(self, run_id: int) -> list[StepRecord]:
        """Every committed step of `run_id`, in order, read from the ledger's events."""
        committed = self.ledger.events.StepCommitted().get_logs(
            from_block=0, argument_filters={"runId": run_id}
        )
        attested = self.ledger.events.ContributionAttested().get_logs(
            from_block=0, argument_filters={"runId": run_id}
        )
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
            ))
        return sorted(records, key=lambda r: r.step)
