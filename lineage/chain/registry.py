"""Typed access to the NodeRegistry contract: node keys, their operators and stakes,
unbonding, withdrawals and claimable credit.

A `Registry` wraps the web3 contract (`contract`) and its `Chain`; `Ledger.registry` is the
one a ledger deployment is bound to. Transactions go through `lineage.chain.client.Chain`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from eth_account.signers.local import LocalAccount
from eth_utils import to_checksum_address
from web3.exceptions import Web3Exception

from .client import Chain, chain_failure


class Registry:
    """The NodeRegistry at a known address."""

    def __init__(self, chain: Chain, address: str) -> None:
        self.chain = chain
        self.contract = chain.contract("NodeRegistry", address)

    @property
    def address(self) -> str:
        return str(self.contract.address)

    def ensure_staked(self, node: LocalAccount, amount: int, operator: LocalAccount | None = None) -> None:
        """Register `node` for `operator` (itself by default) if needed, and have the
        operator top its active stake up to at least `amount` wei."""
        fns = self.contract.functions
        payer = operator or node
        if not fns.isRegistered(node.address).call():
            self.chain.transact(fns.register(payer.address), node, context=f"register {node.address}")
        have = fns.stakeOf(node.address).call()
        if have < amount:
            self.chain.require_funds(payer.address, amount - have, f"stake for {node.address}")
            self.chain.transact(fns.stake(node.address), payer, value=amount - have,
                                context=f"stake {node.address}")

    def stake_of(self, node: str) -> int:
        return int(self.contract.functions.stakeOf(to_checksum_address(node)).call())

    def stakes_at(self, pairs: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int]:
        """The active stake of each (node, block) pair once that block was applied, from
        the registry's events: three log queries for any number of pairs, and right on a
        chain that keeps no state history (anvil reloaded from a state file). A stake only
        rises through `Staked` (whose `total` is the new stake) and only falls, to zero,
        through `UnbondingStarted` or `Slashed`; the last of them by the block decides."""
        pairs = list(pairs)
        nodes = sorted({to_checksum_address(n) for n, _ in pairs})
        history: dict[str, list[tuple[int, int, int]]] = {n: [] for n in nodes}  # (block, index, stake)
        events = self.contract.events
        for event in (events.Staked, events.UnbondingStarted, events.Slashed):
            if not nodes:
                break
            try:
                logs = event().get_logs(from_block=0, argument_filters={"node": nodes})
            except (OSError, Web3Exception) as exc:
                raise chain_failure(f"reading the registry's {event.event_name} events", exc,
                                    self.chain.rpc_url) from None
            for log in logs:
                stake = int(log["args"]["total"]) if event is events.Staked else 0
                history[log["args"]["node"]].append((int(log["blockNumber"]), int(log["logIndex"]), stake))
        for changes in history.values():
            changes.sort()
        out = {}
        for node, block in pairs:
            changes = history[to_checksum_address(node)]
            i = bisect.bisect_right(changes, (block, float("inf"), 0))
            out[(node, block)] = changes[i - 1][2] if i else 0
        return out

    def register(self, node: LocalAccount, operator: str) -> Any:
        """Register `node`'s key (it sends the transaction, proving possession) for
        `operator`; returns the receipt."""
        fn = self.contract.functions.register(to_checksum_address(operator))
        return self.chain.transact(fn, node, context=f"register {node.address}")

    def stake(self, payer: LocalAccount, node: str, amount: int) -> Any:
        """Add `amount` wei from `payer` to `node`'s active stake; returns the receipt."""
        fn = self.contract.functions.stake(to_checksum_address(node))
        self.chain.require_funds(payer.address, amount, f"stake for {node}")
        return self.chain.transact(fn, payer, value=amount, context=f"stake {node}")

    def is_registered(self, node: str) -> bool:
        return bool(self.contract.functions.isRegistered(to_checksum_address(node)).call())

    def operator_of(self, node: str) -> str:
        """The operator of `node` (the zero address for an unknown node)."""
        return str(self.contract.functions.operatorOf(to_checksum_address(node)).call())

    def open_challenges_of(self, node: str) -> int:
        return int(self.contract.functions.openChallengesOf(to_checksum_address(node)).call())

    def unbonding_of(self, node: str) -> tuple[int, int]:
        """(wei unbonding, release timestamp) of `node`; (0, 0) when it is not unbonding."""
        amount, release_at = self.contract.functions.unbondingOf(to_checksum_address(node)).call()
        return int(amount), int(release_at)

    def credit_of(self, account: str) -> int:
        """Wei `account` can claim: rewards, refunded bonds, the treasury's share."""
        return int(self.contract.functions.creditOf(to_checksum_address(account)).call())

    def unbond(self, operator: LocalAccount, node: str) -> Any:
        """Start unbonding all of `node`'s stake (it stops attesting); returns the receipt."""
        fn = self.contract.functions.unbond(to_checksum_address(node))
        return self.chain.transact(fn, operator, context=f"unbond {node}")

    def withdraw(self, operator: LocalAccount, node: str) -> Any:
        """Pay `node`'s unbonded stake to its operator; returns the receipt."""
        fn = self.contract.functions.withdraw(to_checksum_address(node))
        return self.chain.transact(fn, operator, context=f"withdraw {node}")

    def claim(self, account: LocalAccount) -> Any:
        """Pay `account` its credit; returns the receipt."""
        return self.chain.transact(self.contract.functions.claim(), account, context=f"claim {account.address}")
