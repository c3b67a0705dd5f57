"""Deploying the ledger contracts once, for many runs: a deployment file.

`dlx deploy --rpc URL` (workers/cli/deploy.py) deploys a NodeRegistry and a TrainingLedger
bound to it (`deploy`), waiting for the transactions' confirmations, and writes what it did
to a deployment file (`Deployment.write`: JSON, written atomically, never over an existing
file unless asked):

    {"chain_id": 11155111, "registry": "0x..", "ledger": "0x..", "block": 1234, "deployer": "0x.."}

A job file names it with `[chain] deployment = "FILE"`; `dlx train` then opens that ledger
(`open_deployment`: the endpoint's chain id and the code at both addresses checked) instead
of deploying its own. The file holds no endpoint URL (one often carries an API key) and no key.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eth_account.signers.local import LocalAccount
from eth_utils import is_address, to_checksum_address
from web3.exceptions import Web3Exception

from lineage.errors import ChainError

from .client import Chain, artifact, chain_failure
from .ledger import BURN_ADDRESS, DEFAULT_REPORTER_SHARE_BPS, DEFAULT_UNBONDING_DELAY, Ledger

#: The keys a deployment file holds, all required.
FIELDS = ("chain_id", "registry", "ledger", "block", "deployer")


@dataclass(frozen=True)
class Deployment:
    """A NodeRegistry and TrainingLedger deployed on chain `chain_id` by `deployer`, the
    registry's creation mined in block `block` (where reads of their events may start)."""

    chain_id: int
    registry: str
    ledger: str
    block: int
    deployer: str

    @classmethod
    def load(cls, path: Path) -> Deployment:
        """Read a deployment file; a missing or malformed one is one line naming it."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ChainError(f"deployment {path}: no such file (write one with `dlx deploy --rpc URL --out {path}`)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChainError(f"deployment {path}: not a deployment file ({exc})") from None
        if not isinstance(data, dict) or (missing := [k for k in FIELDS if k not in data]):
            raise ChainError(f"deployment {path}: not a deployment file (missing {', '.join(missing or FIELDS)})")
        for key in ("registry", "ledger", "deployer"):
            if not (isinstance(data[key], str) and is_address(data[key])):
                raise ChainError(f"deployment {path}: {key} is not an address: {data[key]!r}")
        for key in ("chain_id", "block"):
            if not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] < 0:
                raise ChainError(f"deployment {path}: {key} is not a whole number: {data[key]!r}")
        return cls(chain_id=data["chain_id"], registry=to_checksum_address(data["registry"]),
                   ledger=to_checksum_address(data["ledger"]), block=data["block"],
                   deployer=to_checksum_address(data["deployer"]))

    def write(self, path: Path, *, force: bool = False) -> None:
        """Write the file atomically (a temporary file beside it, then renamed over); an
        existing file is refused unless `force`."""
        path = Path(path)
        refuse_overwrite(path, force)
        text = json.dumps(asdict(self), indent=2) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or Path("."))
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def refuse_overwrite(path: Path, force: bool) -> None:
    """Refuse (before anything is deployed) a deployment file that exists, unless `force`,
    and one whose directory does not."""
    if path.exists() and not force:
        raise ChainError(f"deployment {path} already exists: pass --force to replace it")
    if path.is_dir():
        raise ChainError(f"deployment {path} is a directory")
    if not path.absolute().parent.is_dir():
        raise ChainError(f"deployment {path}: no such directory {path.absolute().parent}")


def deploy(chain: Chain, deployer: LocalAccount) -> Deployment:
    """Deploy a NodeRegistry (the burn address as treasury, the default reporter share and
    unbonding delay, as `Ledger.deploy`) and a TrainingLedger on it, and bind the two; each
    transaction waits for `chain.policy.confirmations` blocks on top."""
    registry_receipt = _create(chain, deployer, "NodeRegistry", to_checksum_address(BURN_ADDRESS),
                               DEFAULT_REPORTER_SHARE_BPS, DEFAULT_UNBONDING_DELAY)
    registry = registry_receipt["contractAddress"]
    ledger = _create(chain, deployer, "TrainingLedger", registry)["contractAddress"]
    bound = Ledger(chain, registry, ledger)
    chain.transact(bound.registry.contract.functions.bindLedger(ledger), deployer, context="bindLedger")
    return Deployment(chain_id=chain.chain_id, registry=to_checksum_address(registry),
                      ledger=to_checksum_address(ledger), block=int(registry_receipt["blockNumber"]),
                      deployer=deployer.address)


def _create(chain: Chain, sender: LocalAccount, name: str, *args: Any) -> Any:
    abi, bytecode = artifact(name)
    factory = chain.w3.eth.contract(abi=abi, bytecode=bytecode)
    return chain.transact(factory.constructor(*args), sender, context=f"deploy {name}")


def check_deployment(chain: Chain, path: Path) -> Deployment:
    """The deployment in `path`, refused (one line) when it is not on `chain`: another
    chain id, or no contract at either address (a reset chain, a wrong file)."""
    dep = Deployment.load(path)
    if dep.chain_id != chain.chain_id:
        raise ChainError(f"deployment {path}: chain id {dep.chain_id}, endpoint is {chain.chain_id}")
    for address in (dep.registry, dep.ledger):
        try:
            code = chain.w3.eth.get_code(to_checksum_address(address))
        except (OSError, Web3Exception) as exc:
            raise chain_failure(f"deployment {path}: code at {address}", exc, chain.rpc_url) from None
        if not code:
            raise ChainError(f"deployment {path}: no contract at {address}")
    return dep


def open_deployment(chain: Chain, path: Path) -> Ledger:
    """The `Ledger` of the deployment in `path` on `chain` (checked: `check_deployment`)."""
    dep = check_deployment(chain, path)
    return Ledger(chain, dep.registry, dep.ledger)
