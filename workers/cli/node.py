"""`dlx node`: a node operator's commands against the NodeRegistry.

    dlx node register [--operator ADDR] [--stake 1.5eth]   # the node key registers itself
    dlx node stake --amount 2eth [--node ADDR]              # the operator adds stake
    dlx node unbond [--node ADDR]                           # all of it; the node stops attesting
    dlx node withdraw [--node ADDR]                         # after the unbonding delay
    dlx node claim [--operator]                             # rewards (due steps finalized first), bonds
    dlx node status [--node ADDR] [--json]                  # stake, unbonding, challenges, credit, rewards
    dlx node join RUN [--admission FILE]                    # the node key joins an open or approved run
    dlx node leave RUN                                      # it signs no later step; its stake lock ends
    dlx node admit RUN NODE [--hours 24] --out FILE         # the run's creator signs an admission

Keys come from the environment, never the command line (their values are never printed):
the node key from DLX_NODE_KEY or DLX_KEYSTORE + DLX_KEYSTORE_PASSWORD (workers/queue/node.py);
the operator's from DLX_OPERATOR_KEY or DLX_OPERATOR_KEYSTORE + DLX_OPERATOR_KEYSTORE_PASSWORD,
and the node key itself when neither is set (a node that operates itself).

Where the chain is: workers/cli/common.py (one precedence for every command). This module
also holds the keys and amounts the audit commands in `audit.py` share.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any

import typer

from .common import (
    Endpoint,
    address,
    config_error,
    user_errors,
    with_endpoint,
)

ETHER = 10**18

NodeOpt = Annotated[str | None, typer.Option("--node", help="The node's address (default: the node key's).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


# -- amounts ------------------------------------------------------------------------------

_UNITS = {"wei": 1, "gwei": 10**9, "eth": ETHER, "ether": ETHER}
_AMOUNT = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*$")


def parse_amount(text: str) -> int:
    """Wei from an amount with its unit: `1.5eth` (or `ether`), `2gwei`, `10wei`."""
    m = _AMOUNT.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise config_error(f"amount {text!r}: write a number and a unit, e.g. 1.5eth, 2gwei or 10wei")
    try:
        wei = Decimal(m.group(1)) * _UNITS[unit]
    except InvalidOperation:
        raise config_error(f"amount {text!r} is not a number") from None
    if wei != wei.to_integral_value():
        raise config_error(f"amount {text!r} is not a whole number of wei")
    if wei <= 0:
        raise config_error(f"amount {text!r} must be above zero")
    return int(wei)


def fmt_wei(wei: int) -> str:
    """`1.5 ETH (1500000000000000000 wei)`, or plain wei when below a gwei."""
    if wei and wei < 10**9:
        return f"{wei} wei"
    eth = (Decimal(wei) / ETHER).normalize()
    return f"{eth:f} ETH ({wei} wei)"


# -- keys ---------------------------------------------------------------------------------

def load_key(role: str = "node") -> Any:
    """The LocalAccount for `role`: `node` (DLX_NODE_KEY / DLX_KEYSTORE), or `operator`,
    `arbiter`, `reporter` (DLX_<ROLE>_KEY / DLX_<ROLE>_KEYSTORE + _PASSWORD), which fall
    back to the node key. Keys are read from the environment only, and never printed."""
    from workers.queue.node import load_node_key

    if role == "node":
        return load_node_key()
    prefix = f"DLX_{role.upper()}"
    key, keystore = os.environ.get(f"{prefix}_KEY"), os.environ.get(f"{prefix}_KEYSTORE")
    if not key and not keystore:
        return load_node_key()
    from eth_account import Account

    if key:
        try:
            return Account.from_key(key)
        except (ValueError, TypeError):
            raise config_error(f"{prefix}_KEY is not a valid private key") from None
    password = os.environ.get(f"{prefix}_KEYSTORE_PASSWORD")
    assert keystore is not None  # no key: the keystore (the check above)
    if password is None:
        raise config_error(f"{prefix}_KEYSTORE is set but {prefix}_KEYSTORE_PASSWORD is not")
    try:
        return Account.from_key(Account.decrypt(json.loads(Path(keystore).read_text()), password))
    except FileNotFoundError:
        raise config_error(f"keystore not found: {keystore}") from None
    except (ValueError, KeyError, json.JSONDecodeError):
        raise config_error(f"cannot decrypt keystore {keystore} (wrong password or not a keystore)") from None


def _target(node: str | None) -> str:
    """The node a command acts on: `--node ADDR`, else the node key's own address."""
    return address(node, "--node") if node else load_key("node").address


# -- the chain -----------------------------------------------------------------------------

def chain_time(ledger: Any) -> int:
    """The latest block's timestamp: the clock the contracts' delays run on."""
    return int(ledger.chain.w3.eth.get_block("latest")["timestamp"])


def tx_of(receipt: Any) -> str:
    return receipt["transactionHash"].to_0x_hex()


def _out(line: str) -> None:
    sys.stdout.write(line + "\n")


def _when(ts: int, now: int) -> str:
    """`2026-12-07 07:40:47 UTC (in 6 d 23 h 59 min)`, or `(due)` once passed (chain time)."""
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))
    left = ts - now
    if left <= 0:
        return f"{at} (due)"
    days, rest = divmod(left, 86400)
    parts = [f"{days} d"] if days else []
    parts += [f"{rest // 3600} h"] if days or rest >= 3600 else []
    parts.append(f"{rest % 3600 // 60} min" if left >= 60 else f"{left} s")
    return f"{at} (in {' '.join(parts)})"


# -- commands -----------------------------------------------------------------------------

node_app = typer.Typer(name="node", no_args_is_help=True,
                       help="A node operator's commands: register, stake, unbond, withdraw, claim, status.")


@node_app.command("register")
@user_errors
@with_endpoint
def register_(
    operator: Annotated[str | None, typer.Option("--operator", help="The operator's address (default: the operator key's, else the node itself).")] = None,
    stake: Annotated[str | None, typer.Option("--stake", help="Also stake this much from the operator key, e.g. 1.5eth.")] = None,
    *, ep: Endpoint,
) -> None:
    """Register the node key (DLX_NODE_KEY or DLX_KEYSTORE) for its operator."""
    amount = parse_amount(stake) if stake else None
    node = load_key("node")
    payer = load_key("operator")
    op = address(operator, "--operator") if operator else payer.address
    with ep.connect(writable=True) as lg:
        if amount is not None:  # refused before the node is registered, not after
            lg.chain.require_funds(payer.address, amount, "--stake")
        receipt = lg.registry.register(node, op)
        _out(f"node {node.address} registered for operator {op} (tx {tx_of(receipt)})")
        if amount is not None:
            receipt = lg.registry.stake(payer, node.address, amount)
            _out(f"staked {fmt_wei(amount)} from {payer.address}; stake now {fmt_wei(lg.registry.stake_of(node.address))} "
                 f"(tx {tx_of(receipt)})")


@node_app.command("stake")
@user_errors
@with_endpoint
def stake_(
    amount: Annotated[str, typer.Option("--amount", help="How much to add, with its unit: 1.5eth, 2gwei, 10wei.")],
    node: NodeOpt = None,
    *, ep: Endpoint,
) -> None:
    """Add stake behind a node, paid by the operator key (anyone may stake for a node)."""
    wei = parse_amount(amount)
    payer = load_key("operator")
    target = _target(node)
    with ep.connect(writable=True) as lg:
        receipt = lg.registry.stake(payer, target, wei)
        _out(f"staked {fmt_wei(wei)} behind {target} from {payer.address}; stake now "
             f"{fmt_wei(lg.registry.stake_of(target))} (tx {tx_of(receipt)})")


@node_app.command("unbond")
@user_errors
@with_endpoint
def unbond_(
    node: NodeOpt = None,
    *, ep: Endpoint,
) -> None:
    """Unbond all of a node's stake (the operator key signs); the node stops attesting."""
    operator = load_key("operator")
    target = _target(node)
    with ep.connect(writable=True) as lg:
        receipt = lg.registry.unbond(operator, target)
        amount, release_at = lg.registry.unbonding_of(target)
        _out(f"unbonding {fmt_wei(amount)} of {target}: withdrawable from "
             f"{_when(release_at, chain_time(lg))} (tx {tx_of(receipt)})")


@node_app.command("withdraw")
@user_errors
@with_endpoint
def withdraw_(
    node: NodeOpt = None,
    *, ep: Endpoint,
) -> None:
    """Pay a node's unbonded stake to its operator, once the unbonding delay has passed."""
    from web3.logs import DISCARD

    operator = load_key("operator")
    target = _target(node)
    with ep.connect(writable=True) as lg:
        receipt = lg.registry.withdraw(operator, target)
        paid = sum(int(e["args"]["amount"]) for e in
                   lg.registry.contract.events.Withdrawn().process_receipt(receipt, errors=DISCARD))
        _out(f"withdrew {fmt_wei(paid)} of {target} to {operator.address} (tx {tx_of(receipt)})")


@node_app.command("claim")
@user_errors
@with_endpoint
def claim_(
    as_operator: Annotated[bool, typer.Option("--operator", help="Claim the operator key's credit, not the node key's.")] = False,
    *, ep: Endpoint,
) -> None:
    """Claim a key's credit: rewards, refunded challenge bonds, slash shares."""
    account = load_key("operator" if as_operator else "node")
    with ep.connect(writable=True) as lg:
        from lineage.chain.rewards import finalize_member_runs

        for run_id, steps in finalize_member_runs(lg, account, account.address).items():
            _out(f"run {run_id}: steps {steps[0]}..{steps[-1]} final, their rewards credited")
        credit = lg.registry.credit_of(account.address)
        receipt = lg.registry.claim(account)
        _out(f"claimed {fmt_wei(credit)} to {account.address} (tx {tx_of(receipt)})")


@node_app.command("status")
@user_errors
@with_endpoint
def status_(
    node: NodeOpt = None,
    as_json: JsonOpt = False,
    *, ep: Endpoint,
) -> None:
    """A node's stake, unbonding stake and release time, open challenges and credit."""
    target = _target(node)
    with ep.connect() as lg:
        doc = node_status(lg, target)
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    _out(f"node        {doc['node']} on chain {doc['chain_id']}, registry {doc['registry']}")
    if not doc["registered"]:
        _out("registered  no")
        return
    _out(f"operator    {doc['operator']}")
    _out(f"stake       {fmt_wei(int(doc['stake_wei']))}")
    unb = doc["unbonding"]
    if int(unb["amount_wei"]):
        _out(f"unbonding   {fmt_wei(int(unb['amount_wei']))}, withdrawable from {_when(unb['release_at'], doc['time'])}")
    else:
        _out("unbonding   none")
    open_ids = ", ".join(f"#{c['id']} (run {c['run']}, step {c['step']})" for c in doc["challenges"] if not c["resolved"])
    _out(f"challenges  {doc['open_challenges']} open" + (f": {open_ids}" if open_ids else ""))
    _out(f"credit      node {fmt_wei(int(doc['credit_wei']['node']))}, "
         f"operator {fmt_wei(int(doc['credit_wei']['operator']))}")
    for run_id, r in doc["rewards"]["runs"].items():
        _out(f"rewards     run {run_id}: {fmt_wei(int(r['credited_wei']))} credited")
    _out(f"claimable   {fmt_wei(int(doc['rewards']['claimable_wei']))} (dlx node claim)")


@node_app.command("join")
@user_errors
@with_endpoint
def join_(
    run: Annotated[int, typer.Argument(help="The run id to join.")],
    admission: Annotated[Path | None, typer.Option("--admission", help="An admission file (dlx node admit) for an "
                                                   "approved run.")] = None,
    *, ep: Endpoint,
) -> None:
    """Join a run as the node key (an open run: staked enough; an approved one: admitted);
    the node may sign from the run's next step, and its stake is locked until it leaves."""
    from lineage.chain.rewards import join_run, read_admission

    account = load_key("node")
    signed = read_admission(admission) if admission else None
    with ep.connect(writable=True) as lg:
        tx = join_run(lg, account, run, signed)
        _, head = lg.head(run)
        _out(f"{account.address} joined run {run}: it may sign from step {head + 1} (tx {tx})")


@node_app.command("leave")
@user_errors
@with_endpoint
def leave_(
    run: Annotated[int, typer.Argument(help="The run id to leave.")],
    *, ep: Endpoint,
) -> None:
    """Leave a run: the node signs no later step, and the run's lock on its stake ends."""
    from lineage.chain.rewards import leave_run

    account = load_key("node")
    with ep.connect(writable=True) as lg:
        _out(f"{account.address} left run {run} (tx {leave_run(lg, account, run)})")


@node_app.command("admit")
@user_errors
@with_endpoint
def admit_(
    run: Annotated[int, typer.Argument(help="The approved run.")],
    node: Annotated[str, typer.Argument(help="The node key to admit.")],
    out: Annotated[Path, typer.Option("--out", help="Where to write the admission file.")],
    hours: Annotated[float, typer.Option("--hours", min=0.0, help="How long the admission is valid.")] = 24.0,
    *, ep: Endpoint,
) -> None:
    """Sign an admission to an approved run, as its creator (DLX_SUBMITTER_KEY, else the node key)."""
    from lineage.chain.rewards import sign_admission, write_admission

    creator = load_key("submitter")
    with ep.connect() as lg:
        expiry = chain_time(lg) + int(hours * 3600)
        write_admission(out, sign_admission(lg, creator, run, address(node, "NODE"), expiry))
    _out(f"admission of {address(node, 'NODE')} to run {run} until {expiry} written to {out}")


def register(app: typer.Typer) -> None:
    """Add `dlx node ...` to the `dlx` app."""
    app.add_typer(node_app, name="node")


def node_status(lg: Any, node: str) -> dict[str, Any]:
    """`dlx node status --json`: wei as strings (JSON numbers lose precision above 2**53)."""
    registered = lg.registry.is_registered(node)
    operator = lg.registry.operator_of(node) if registered else None
    amount, release_at = lg.registry.unbonding_of(node)
    challenges = []
    if lg.ledger.address != lg.registry.address:  # a registry with no ledger bound has none
        challenges = [{"id": c.challenge_id, "run": c.run_id, "step": c.step, "replica": c.replica,
                       "stage": c.stage, "challenger": c.challenger, "bond_wei": str(c.bond),
                       "resolved": c.resolved, "expired": c.expired, "upheld": c.upheld}
                      for c in lg.challenges(node=node)]
    return {
        "node": node, "chain_id": lg.chain.chain_id, "registry": lg.registry.address, "ledger": lg.ledger.address,
        "time": chain_time(lg), "registered": registered, "operator": operator,
        "stake_wei": str(lg.registry.stake_of(node)),
        "unbonding": {"amount_wei": str(amount), "release_at": release_at},
        "open_challenges": lg.registry.open_challenges_of(node), "challenges": challenges,
        "credit_wei": {"node": str(lg.registry.credit_of(node)),
                       "operator": str(lg.registry.credit_of(operator)) if operator else "0"},
        "rewards": _rewards(lg, node),
    }


def _rewards(lg: Any, node: str) -> dict[str, Any]:
    """Rewards credited to `node` per run (final steps it attested) and what it can claim
    now (its whole registry credit: rewards, bonds and slash shares are one balance)."""
    from lineage.chain.rewards import rewards_of

    runs = {} if lg.ledger.address == lg.registry.address else rewards_of(lg, node)
    return {"runs": {str(r): {"credited_wei": str(w)} for r, w in sorted(runs.items())},
            "claimable_wei": str(lg.registry.credit_of(node))}
