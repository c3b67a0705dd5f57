"""The Python chain client against the real contracts on a real anvil: deployment,
staking, runs, EIP-712 attestations checked on chain, and decoded reverts."""

from __future__ import annotations

import hashlib

import pytest
from eth_utils import keccak

from lineage.attest import ContributionClaim, Domain
from lineage.chain import Attestation, Chain
from lineage.errors import ChainError, ChainRevertError

ETHER = 10**18
R, S = 2, 2


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def _run(ledger, accounts, min_stake=ETHER):
    nodes = accounts[1:1 + R * S]
    for n in nodes:
        ledger.ensure_staked(n, ETHER)
    run_id = ledger.create_run(
        accounts[0], config_digest=h("config"), genesis_digest=h("genesis"),
        nodes=[n.address for n in nodes], replicas=R, stages=S, challenge_window=3600,
        min_stake=min_stake,
    )
    return run_id, nodes


def _attest(ledger, run_id, step, parent, nodes, signers=None, tag="c"):
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    out = []
    for slot, node in enumerate(signers or nodes):
        r, s = divmod(slot, S)
        claim = ContributionClaim(run_id, step, r, s, parent, h(f"{tag}{step}{slot}"), h(f"d{r}"),
                                  h("code"), -1_500_000 + slot)
        out.append(Attestation(r, s, claim.contribution, claim.data_shard, claim.code_hash,
                               claim.loss_micros, claim.sign(domain, node.key)))
    return out


def test_python_digest_equals_the_contracts_eip712_digest(ledger, accounts):
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    claim = ContributionClaim(3, 9, 1, 0, h("p"), h("c"), h("d"), h("code"), -42)
    onchain = ledger.ledger.functions.contributionDigest(
        3, 9, 1, 0, h("p"), h("c"), h("d"), h("code"), -42).call()
    assert bytes(onchain) == claim.digest(domain)
    assert claim.recover(domain, claim.sign(domain, accounts[3].key)) == accounts[3].address


def test_steps_commit_in_a_chain_and_read_back_from_events(ledger, accounts):
    run_id, nodes = _run(ledger, accounts)
    assert ledger.head(run_id) == (h("genesis"), 0)
    parent = h("genesis")
    for step in (1, 2):
        ckpt = h(f"ckpt{step}")
        ledger.commit_step(accounts[0], run_id=run_id, step=step, parent=parent, checkpoint=ckpt,
                           metrics_digest=h("m"), attestations=_attest(ledger, run_id, step, parent, nodes))
        parent = ckpt
    assert ledger.head(run_id) == (h("ckpt2"), 2)
    steps = ledger.steps(run_id)
    assert [s.step for s in steps] == [1, 2]
    assert steps[1].parent == h("ckpt1") and steps[1].checkpoint == h("ckpt2")
    assert [a["node"] for a in steps[0].attestations] == [n.address for n in nodes]
    assert steps[0].contributions_root == keccak(b"".join(h(f"c1{i}") for i in range(R * S)))


def test_a_stale_parent_is_refused_with_the_decoded_custom_error(ledger, accounts):
    run_id, nodes = _run(ledger, accounts)
    with pytest.raises(ChainRevertError, match=r"LedgerStaleParent\(expected=0x") as exc:
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("other"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=_attest(ledger, run_id, 1, h("other"), nodes))
    assert exc.value.name == "LedgerStaleParent"
    assert exc.value.error_args == {"expected": h("genesis"), "got": h("other")}
    assert ledger.head(run_id) == (h("genesis"), 0)


def test_a_signature_by_a_non_member_is_refused(ledger, accounts):
    run_id, nodes = _run(ledger, accounts)
    outsider = accounts[10]
    ledger.ensure_staked(outsider, ETHER)
    signers = [*nodes[:-1], outsider]
    with pytest.raises(ChainRevertError, match="LedgerNotMember"):
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=_attest(ledger, run_id, 1, h("genesis"), nodes, signers))


def test_an_understaked_member_cannot_attest(ledger, accounts):
    run_id, nodes = _run(ledger, accounts, min_stake=2 * ETHER)
    with pytest.raises(ChainRevertError, match="LedgerInsufficientStake"):
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=_attest(ledger, run_id, 1, h("genesis"), nodes))


def test_a_signature_for_another_run_does_not_verify(ledger, accounts):
    run_id, nodes = _run(ledger, accounts)
    other = _attest(ledger, run_id + 1, 1, h("genesis"), nodes)  # signed for run_id + 1
    with pytest.raises(ChainRevertError, match="LedgerNotMember"):
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=other)


def test_a_wrong_chain_id_is_refused(anvil):
    with pytest.raises(ChainError, match="wrong chain id"):
        Chain(anvil.url, expected_chain_id=1)


def test_an_unreachable_rpc_is_one_clear_error():
    with pytest.raises(ChainError, match="cannot reach the chain"):
        Chain("http://127.0.0.1:9")
