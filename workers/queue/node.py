"""A worker node's identity: its key (keystore or environment, never argv) and address.

    DLX_NODE_KEY=0x...                      a private key in the environment, or
    DLX_KEYSTORE=path DLX_KEYSTORE_PASSWORD=...   an encrypted eth-account keystore
    DLX_WORKER_ADDRESS=10.0.0.2             the address other ranks reach this node at

The key is never printed or logged; only its address is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount

from trainer.errors import ConfigError


@dataclass(frozen=True)
class NodeIdentity:
    account: LocalAccount
    host: str

    @property
    def address(self) -> str:
        return self.account.address

    @classmethod
    def from_env(cls) -> NodeIdentity:
        return cls(load_node_key(), os.environ.get("DLX_WORKER_ADDRESS", "127.0.0.1"))


def load_node_key() -> LocalAccount:
    key = os.environ.get("DLX_NODE_KEY")
    keystore = os.environ.get("DLX_KEYSTORE")
    if key:
        try:
            return Account.from_key(key)
        except (ValueError, TypeError):
            raise ConfigError("DLX_NODE_KEY is not a valid private key") from None
    if keystore:
        password = os.environ.get("DLX_KEYSTORE_PASSWORD")
        if password is None:
            raise ConfigError("DLX_KEYSTORE is set but DLX_KEYSTORE_PASSWORD is not")
        try:
            data = json.loads(Path(keystore).read_text())
            return Account.from_key(Account.decrypt(data, password))
        except FileNotFoundError:
            raise ConfigError(f"keystore not found: {keystore}") from None
        except (ValueError, KeyError, json.JSONDecodeError):
            raise ConfigError(f"cannot decrypt keystore {keystore} (wrong password or not a keystore)") from None
    raise ConfigError("no node key: set DLX_NODE_KEY, or DLX_KEYSTORE and DLX_KEYSTORE_PASSWORD")
