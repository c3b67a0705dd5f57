"""Open membership and reward pools on the ledger (issue 35): admissions, joining and leaving
a run, funding its pool, finalizing what is due (which pays each final step's reward to the
nodes that attested it), and reading what a node was credited.

A run's admission rule is fixed at creation (`RunSpec.admission`): `closed` (the members
named at creation only), `open` (any registered node with the run's minimum stake free) or
`approved` (a node holding an `Admission(runId, node, expiry)` signed by the run's creator,
kept in an admission file, `write_admission` / `read_admission`). Rewards go through the
registry's credits and `claim`, as challenge bonds and reporter shares do.

    ledger = Ledger(chain, registry, address)
    finalize_due(ledger, sender, run_id)          # steps whose window closed, paid
    rewards_of(ledger, node)                      # {run id: wei credited}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eth_account.signers.local import LocalAccount
from eth_utils import to_checksum_address

from lineage.chain.attest import Domain, TypedMessage
from lineage.chain.client import call_view
from lineage.chain.ledger import ADMISSION, Ledger, StepRecord
from lineage.errors import ChainError

#: The `format` of an admission file.
ADMISSION_FORMAT = "dlx-admission/1"
_ADMISSION_TYPE = [{"name": "runId", "type": "uint256"}, {"name": "node", "type": "address"},
                   {"name": "expiry", "type": "uint64"}]
_ADMISSION_NAMES = {v: k for k, v in ADMISSION.items()}


@dataclass(frozen=True)
class Admission(TypedMessage):
    """A run creator's permission for `node` to join run `run_id` until `expiry` (unix seconds)."""

    PRIMARY_TYPE = "Admission"

    run_id: int
    node: str
    expiry: int

    def struct(self, version: str) -> tuple[list[dict[str, str]], dict[str, Any]]:
        return _ADMISSION_TYPE, {"runId": self.run_id, "node": to_checksum_address(self.node),
                                 "expiry": self.expiry}


@dataclass(frozen=True)
class SignedAdmission:
    """An `Admission` with the creator's 65-byte signature, as an admission file holds it."""

    admission: Admission
    signature: bytes
    ledger: str
    chain_id: int


@dataclass(frozen=True)
class RunTerms:
    """A run's admission rule, reward per final step, pool (wei) and end time (0: running)."""

    admission: str
    reward_per_step: int
    pool: int
    ended_at: int


@dataclass(frozen=True)
class StepReward:
    """One `StepRewarded` event: `share` wei to each of `paid` (slot order; "" forfeited)."""

    run_id: int
    step: int
    share: int
    paid: tuple[str, ...]


def sign_admission(ledger: Ledger, creator: LocalAccount, run_id: int, node: str, expiry: int) -> SignedAdmission:
    """The run creator's admission of `node` to `run_id` until `expiry`."""
    admission = Admission(run_id, to_checksum_address(node), expiry)
    return SignedAdmission(admission, admission.sign(ledger.domain, creator.key), ledger.ledger.address,
                           ledger.chain.chain_id)


def write_admission(path: Path, signed: SignedAdmission) -> None:
    """Write `signed` as an admission file (JSON, `ADMISSION_FORMAT`)."""
    a = signed.admission
    path.write_text(json.dumps({
        "format": ADMISSION_FORMAT, "chain_id": signed.chain_id, "ledger": signed.ledger,
        "run_id": a.run_id, "node": a.node, "expiry": a.expiry, "signature": "0x" + signed.signature.hex(),
    }, indent=2) + "\n")


def read_admission(path: Path) -> SignedAdmission:
    """Read an admission file; raises ChainError when it is not one."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != ADMISSION_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {ADMISSION_FORMAT!r}")
        return SignedAdmission(Admission(int(doc["run_id"]), to_checksum_address(doc["node"]), int(doc["expiry"])),
                               bytes.fromhex(str(doc["signature"]).removeprefix("0x")),
                               to_checksum_address(doc["ledger"]), int(doc["chain_id"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ChainError(f"{path} is not an admission file: {exc}") from None


def admission_signer(ledger: Ledger, signed: SignedAdmission) -> str:
    """Who signed `signed` in `ledger`'s domain (the run's creator, for a valid one)."""
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address, ledger.version)
    return str(signed.admission.recover(domain, signed.signature))


def join_run(ledger: Ledger, node: LocalAccount, run_id: int, admission: SignedAdmission | None = None) -> str:
    """Make `node` (its key sends the transaction) a member of `run_id` from the next step;
    returns the transaction hash. An approved run needs `admission`."""
    expiry, signature = (admission.admission.expiry, admission.signature) if admission else (0, b"")
    receipt = ledger.chain.transact(ledger.ledger.functions.joinRun(run_id, expiry, signature), node,
                                    context=f"joinRun(run {run_id})")
    return str(receipt["transactionHash"].to_0x_hex())


def leave_run(ledger: Ledger, node: LocalAccount, run_id: int) -> str:
    """End `node`'s membership of `run_id` (it signs no later step); returns the tx hash."""
    receipt = ledger.chain.transact(ledger.ledger.functions.leaveRun(run_id), node,
                                    context=f"leaveRun(run {run_id})")
    return str(receipt["transactionHash"].to_0x_hex())


def fund_run(ledger: Ledger, sender: LocalAccount, run_id: int, wei: int) -> str:
    """Add `wei` to `run_id`'s reward pool; returns the transaction hash."""
    receipt = ledger.chain.transact(ledger.ledger.functions.fundRun(run_id), sender, value=wei,
                                    context=f"fundRun(run {run_id})")
    return str(receipt["transactionHash"].to_0x_hex())


def end_run(ledger: Ledger, creator: LocalAccount, run_id: int) -> str:
    """End `run_id` (its creator only): no more joins or commits."""
    receipt = ledger.chain.transact(ledger.ledger.functions.endRun(run_id), creator, context=f"endRun(run {run_id})")
    return str(receipt["transactionHash"].to_0x_hex())


def withdraw_pool(ledger: Ledger, funder: LocalAccount, run_id: int) -> str:
    """Credit `funder` its part of `run_id`'s remaining pool (then `claim` it)."""
    receipt = ledger.chain.transact(ledger.ledger.functions.withdrawPool(run_id), funder,
                                    context=f"withdrawPool(run {run_id})")
    return str(receipt["transactionHash"].to_0x_hex())


def run_terms(ledger: Ledger, run_id: int) -> RunTerms:
    """`run_id`'s admission rule, reward per step, pool and end time."""
    admission, reward, ended_at = call_view(ledger.ledger.functions.runTerms(run_id), f"runTerms({run_id})")
    pool, _ = call_view(ledger.registry.contract.functions.poolOf(run_id), f"poolOf({run_id})")
    return RunTerms(_ADMISSION_NAMES.get(int(admission), str(admission)), int(reward), int(pool), int(ended_at))


def due_steps(ledger: Ledger, run_id: int) -> list[StepRecord]:
    """The steps of `run_id` that may be made final now, in order: from the one after the
    final step up to the first still in its window or under challenge."""
    final = ledger.finalized_step(run_id)
    window = int(call_view(ledger.ledger.functions.challengeWindowOf(run_id), f"challengeWindowOf({run_id})"))
    now = int(ledger.chain.w3.eth.get_block("latest")["timestamp"])
    due = []
    for record in ledger.steps(run_id):
        if record.step <= final:
            continue
        info = ledger.step_info(run_id, record.step)
        if info.open_challenges or now <= info.committed_at + window:
            break
        due.append(record)
    return due


def finalize_due(ledger: Ledger, sender: LocalAccount, run_id: int, *, batch: int = 32) -> list[int]:
    """Make every due step of `run_id` final (paying its reward), `batch` steps a
    transaction; returns the steps made final. Anyone may; the sink and `dlx node claim` do."""
    done: list[int] = []
    due = due_steps(ledger, run_id)
    for i in range(0, len(due), batch):
        chunk = due[i:i + batch]
        ledger.finalize_steps(sender, run_id, chunk)
        done += [r.step for r in chunk]
    return done


def step_rewards(ledger: Ledger, run_id: int | None = None) -> list[StepReward]:
    """Every `StepRewarded` event (of `run_id`, or of all runs), oldest first."""
    filters = {} if run_id is None else {"runId": run_id}
    logs = ledger.registry.contract.events.StepRewarded().get_logs(from_block=0, argument_filters=filters)
    return [StepReward(int(a["runId"]), int(a["step"]), int(a["share"]),
                       tuple("" if int(p, 16) == 0 else to_checksum_address(p) for p in a["paid"]))
            for a in (log["args"] for log in logs)]


def rewards_of(ledger: Ledger, node: str) -> dict[int, int]:
    """Wei credited to `node` per run for the final steps it attested (a share per slot)."""
    node = to_checksum_address(node)
    out: dict[int, int] = {}
    for r in step_rewards(ledger):
        slots = sum(1 for p in r.paid if p == node)
        if slots:
            out[r.run_id] = out.get(r.run_id, 0) + slots * r.share
    return out


def member_runs(ledger: Ledger, node: str) -> list[int]:
    """The runs `node` was named in at creation or joined, ascending."""
    node = to_checksum_address(node)
    runs = {int(log["args"]["runId"]) for log in ledger.ledger.events.RunCreated().get_logs(from_block=0)
            if node in {to_checksum_address(n) for n in log["args"]["nodes"]}}
    joined = ledger.ledger.events.MemberJoined().get_logs(from_block=0, argument_filters={"node": node})
    runs |= {int(log["args"]["runId"]) for log in joined}
    return sorted(runs)


def finalize_member_runs(ledger: Ledger, sender: LocalAccount, node: str) -> dict[int, list[int]]:
    """Finalize (and so pay) what is due in every rewarding run `node` is in; returns the
    steps made final per run. `dlx node claim` calls it before claiming."""
    out: dict[int, list[int]] = {}
    for run_id in member_runs(ledger, node):
        if run_terms(ledger, run_id).reward_per_step:
            done = finalize_due(ledger, sender, run_id)
            if done:
                out[run_id] = done
    return out
