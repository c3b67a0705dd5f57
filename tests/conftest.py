"""Shared fixtures: a real anvil per test module, contracts from contracts/out."""

from __future__ import annotations

import pytest

from lineage.anvil import Anvil, dev_accounts
from lineage.chain import Chain, Ledger


@pytest.fixture(scope="module")
def anvil():
    with Anvil(accounts=12) as node:
        yield node


@pytest.fixture(scope="module")
def accounts():
    return dev_accounts(12)


@pytest.fixture()
def ledger(anvil, accounts):
    """A freshly deployed registry + ledger (each test gets its own deployment)."""
    return Ledger.deploy(Chain(anvil.url), accounts[0])
