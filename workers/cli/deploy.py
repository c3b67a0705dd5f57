"""`dlx deploy`: the ledger contracts deployed once on a chain, for job files to name.

    dlx deploy --rpc URL [--out deployment.json] [--confirmations 2] [--chain-id N] [--force]

The deployer is the submitter's key, read from the environment as every command reads
keys (never the command line, never printed): DLX_SUBMITTER_KEY, or DLX_SUBMITTER_KEYSTORE
+ DLX_SUBMITTER_KEYSTORE_PASSWORD, else the node key (DLX_NODE_KEY, or DLX_KEYSTORE +
DLX_KEYSTORE_PASSWORD). It pays for a NodeRegistry, a TrainingLedger and the transaction
binding them; each waits for `--confirmations` blocks on top. The deployment file
(lineage/chain/deploy.py) is what `[chain] deployment = "FILE"` names in a job file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from .common import config_error, user_errors

#: Environment variables any of which gives `dlx deploy` a key (workers/cli/node.load_key).
KEY_ENV = ("DLX_SUBMITTER_KEY", "DLX_SUBMITTER_KEYSTORE", "DLX_NODE_KEY", "DLX_KEYSTORE")


@user_errors
def deploy(
    rpc: Annotated[str, typer.Option("--rpc", help="JSON-RPC URL of the chain to deploy on.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the deployment file.")] = Path("deployment.json"),
    confirmations: Annotated[int, typer.Option("--confirmations", min=0, max=64, help="Blocks on top of each transaction before it counts.")] = 2,
    chain_id: Annotated[int | None, typer.Option("--chain-id", min=1, help="Refuse a chain with another id.")] = None,
    max_fee_gwei: Annotated[float | None, typer.Option("--max-fee-gwei", help="The most a transaction pays per gas, in gwei (default: no cap).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing deployment file.")] = False,
) -> None:
    """Deploy a NodeRegistry and a TrainingLedger with the submitter's key (from the
    environment) and write a deployment file that job files name with [chain] deployment."""
    from lineage.chain.client import Chain
    from lineage.chain.deploy import deploy as deploy_contracts
    from lineage.chain.deploy import refuse_overwrite
    from lineage.chain.tx import TxPolicy

    from .node import load_key

    if not rpc.startswith(("http://", "https://")):
        raise config_error(f"--rpc must be an http:// or https:// JSON-RPC URL (got {rpc!r})")
    if max_fee_gwei is not None and not max_fee_gwei > 0:
        raise config_error(f"--max-fee-gwei must be above 0 (got {max_fee_gwei:g})")
    refuse_overwrite(out, force)
    if not any(os.environ.get(name) for name in KEY_ENV):
        raise config_error("no deployer key: set DLX_SUBMITTER_KEY, or DLX_SUBMITTER_KEYSTORE and "
                           "DLX_SUBMITTER_KEYSTORE_PASSWORD")
    deployer = load_key("submitter")
    checked = Chain(rpc, chain_id)  # checks before anything is sent do not wait out an outage: exit 2 at once
    if not checked.w3.eth.get_balance(deployer.address):
        raise config_error(f"the deployer {deployer.address} holds no ETH on chain {checked.chain_id} to pay for gas")
    chain = Chain(rpc, checked.chain_id, TxPolicy(confirmations=confirmations, outage_s=120.0,
                                                  max_fee_gwei=max_fee_gwei))
    sys.stderr.write(f"deploying the registry and ledger on chain {chain.chain_id} from {deployer.address}, "
                     f"{confirmations} confirmations each\n")
    dep = deploy_contracts(chain, deployer)
    dep.write(out, force=force)
    sys.stdout.write(f"registry {dep.registry}, ledger {dep.ledger} on chain {dep.chain_id} "
                     f"(block {dep.block}, deployer {dep.deployer}): wrote {out}\n")


def register(app: typer.Typer) -> None:
    """Add `dlx deploy` to the `dlx` app."""
    app.command(name="deploy")(deploy)
