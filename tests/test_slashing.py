"""The whole slashing story on a real anvil, driven through `lineage.chain` as a client would:
nodes stake and commit steps; an equivocation proof slashes one node at once; a verifier
challenges a step, an arbiter quorum upholds it, the head rolls back and the challenger is
paid; a frivolous challenge costs its bond; steps become final; and in the end withdrawals
and claims pay out exactly what the registry still held, down to zero. Then the co-signed
shards: a result equivocation slashes at once, and an upheld aggregate challenge slashes
every co-signer of the stage's shard."""

from __future__ import annotations

import hashlib

import pytest
from eth_utils import keccak

from lineage.chain.anvil import rpc_call
from lineage.chain.attest import ContributionClaim, sign_verdict
from lineage.chain.client import Chain
from lineage.chain.ledger import Attestation, Ledger, RunSpec
from lineage.chain.rewards import end_run, withdraw_pool
from lineage.errors import ChainRevertError

ETHER = 10**18
R, S = 2, 2
WINDOW = 600
DELAY = 3600


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def _claim(run_id: int, step: int, slot: int, parent: bytes, contribution: bytes,
           new_shard: bytes | None = None) -> ContributionClaim:
    r, s = divmod(slot, S)
    return ContributionClaim(run_id, step, r, s, parent, contribution, h(f"shard{step}{r}"), h("code"), -7 + slot,
                             new_shard or h(f"new{step}{s}{parent.hex()}"), 2**R - 1)


def _signed(ledger: Ledger, claim: ContributionClaim, key) -> Attestation:
    return Attestation(claim.replica, claim.stage, claim.contribution, claim.data_shard,
                       claim.code_hash, claim.loss_micros, claim.sign(ledger.domain, key), claim.new_shard,
                       claim.replica_set)


def _commit(ledger: Ledger, sender, run_id: int, step: int, parent: bytes, signers, tag: str) -> bytes:
    attestations = [
        _signed(ledger, _claim(run_id, step, slot, parent, h(f"{tag}-c{step}-{slot}")), node.key)
        for slot, node in enumerate(signers)
    ]
    checkpoint = h(f"{tag}-ckpt{step}")
    ledger.commit_step(sender, run_id=run_id, step=step, parent=parent, checkpoint=checkpoint,
                       metrics_digest=h("metrics"), attestations=attestations)
    return checkpoint


def _advance(chain: Chain, seconds: int) -> None:
    rpc_call(chain.rpc_url, "evm_increaseTime", [seconds])
    rpc_call(chain.rpc_url, "evm_mine")


def _paid(chain: Chain, receipt, account: str, before: int) -> int:
    """What `account` received in `receipt`'s transaction, net of the gas it paid."""
    gas = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    return chain.w3.eth.get_balance(account) - before + gas


@pytest.fixture()
def story(anvil, accounts):
    chain = Chain(anvil.url)
    deployer, *nodes = accounts[0:5]
    verifier, reporter, treasury = accounts[5], accounts[6], accounts[7]
    arbiters = accounts[8:11]
    ledger = Ledger.deploy(chain, deployer, treasury=treasury.address, reporter_share_bps=5_000,
                           unbonding_delay=DELAY)
    for node in nodes:
        ledger.registry.ensure_staked(node, 2 * ETHER)
    ledger.registry.ensure_staked(verifier, ETHER)
    run_id = ledger.create_run(deployer, RunSpec(
        config_digest=h("config"), genesis_digest=h("genesis"),
        nodes=[n.address for n in nodes], replicas=R, stages=S, challenge_window=WINDOW,
        min_stake=ETHER, arbiters=[a.address for a in arbiters], quorum=2))
    return chain, ledger, run_id, deployer, nodes, verifier, reporter, treasury, arbiters


def test_the_whole_slashing_story(story):
    chain, ledger, run_id, deployer, nodes, verifier, reporter, treasury, arbiters = story
    registry_address = ledger.registry.address
    assert chain.w3.eth.get_balance(registry_address) == 9 * ETHER

    # Three honest-looking steps.
    genesis = h("genesis")
    ckpt1 = _commit(ledger, deployer, run_id, 1, genesis, nodes, "a")
    ckpt2 = _commit(ledger, deployer, run_id, 2, ckpt1, nodes, "a")
    ckpt3 = _commit(ledger, deployer, run_id, 3, ckpt2, nodes, "a")
    assert ledger.head(run_id) == (ckpt3, 3)

    # Equivocation: node 3 (slot 3) also signed a different contribution for step 3.
    honest = _signed(ledger, _claim(run_id, 3, 3, ckpt2, h("a-c3-3")), nodes[3].key)
    other = _signed(ledger, _claim(run_id, 3, 3, ckpt2, h("forged")), nodes[3].key)
    slashed = ledger.report_equivocation(reporter, run_id=run_id, step=3, parent=ckpt2, a=honest, b=other)
    assert slashed == 2 * ETHER
    assert ledger.registry.stake_of(nodes[3].address) == 0
    assert ledger.registry.credit_of(reporter.address) == ETHER
    # The rest of a slash goes to the run's pool (issue 35), not the treasury.
    assert ledger.registry.credit_of(treasury.address) == 0
    assert ledger.registry.contract.functions.poolOf(run_id).call()[0] == ETHER
    with pytest.raises(ChainRevertError, match="LedgerAlreadySlashed"):
        ledger.report_equivocation(reporter, run_id=run_id, step=3, parent=ckpt2, a=other, b=honest)

    # Replay challenge: the verifier disputes node 1's work in step 2; two of three arbiters
    # uphold it. Steps 2 and 3 are rejected and the head rolls back to step 1.
    challenge = ledger.open_challenge(verifier, run_id=run_id, step=2, replica=0, stage=1, bond=ETHER,
                                      evidence=h("replay report"))
    assert ledger.step_info(run_id, 2).open_challenges == 1
    with pytest.raises(ChainRevertError, match="LedgerQuorumNotReached"):
        ledger.resolve_challenge(deployer, challenge_id=challenge, upheld=True, arbiters=arbiters[:1])
    onchain = ledger.ledger.functions.verdictDigest(challenge, True).call()
    assert bytes(onchain) == ledger.verdict_digest(challenge, True)
    ledger.resolve_challenge(deployer, challenge_id=challenge, upheld=True, arbiters=arbiters[1:])
    assert ledger.head(run_id) == (ckpt1, 1)
    assert [(r.step, r.checkpoint) for r in ledger.rejections(run_id)] == [
        (2, ckpt2), (3, ckpt3)]
    assert ledger.step_info(run_id, 2).rejected and ledger.step_info(run_id, 3).rejected
    assert ledger.registry.stake_of(nodes[1].address) == 0
    assert ledger.registry.credit_of(verifier.address) == 2 * ETHER  # bond back + half of 2 ETH
    assert ledger.registry.contract.functions.poolOf(run_id).call()[0] == 2 * ETHER
    assert [s.step for s in ledger.steps(run_id)] == [1]

    # The run goes on from step 1; the two honest nodes each take a whole replica (both of its
    # stages): one node may not sign for two replicas, the independent witnesses of a step.
    signers = [nodes[0], nodes[0], nodes[2], nodes[2]]
    with pytest.raises(ChainRevertError, match="LedgerInsufficientStake"):
        _commit(ledger, deployer, run_id, 2, ckpt1, nodes, "b")
    new2 = _commit(ledger, deployer, run_id, 2, ckpt1, signers, "b")
    assert ledger.head(run_id) == (new2, 2)
    assert [s.checkpoint for s in ledger.steps(run_id)] == [ckpt1, new2]
    assert ledger.signers(run_id, 2) == [n.address for n in signers]

    # A frivolous challenge of step 1 is not upheld: its bond goes to node 0's operator.
    frivolous = ledger.open_challenge(verifier, run_id=run_id, step=1, replica=0, stage=0, bond=ETHER)
    _advance(chain, WINDOW + 1)
    with pytest.raises(ChainRevertError, match="LedgerStepChallenged"):
        ledger.finalize(deployer, run_id, 1)
    ledger.resolve_challenge(deployer, challenge_id=frivolous, upheld=False, arbiters=arbiters)
    assert ledger.registry.credit_of(nodes[0].address) == ETHER

    # Finality, in order, once the windows have passed and nothing is disputed.
    with pytest.raises(ChainRevertError, match="LedgerParentNotFinal"):
        ledger.finalize(deployer, run_id, 2)
    ledger.finalize(deployer, run_id, 1)
    ledger.finalize(deployer, run_id, 2)
    assert ledger.finalized_step(run_id) == 2

    # Everyone leaves. What the registry holds is exactly the remaining stakes and credits.
    stakes = {n.address: ledger.registry.stake_of(n.address) for n in [*nodes, verifier]}
    assert stakes == {nodes[0].address: 2 * ETHER, nodes[1].address: 0, nodes[2].address: 2 * ETHER,
                      nodes[3].address: 0, verifier.address: ETHER}
    payees = [reporter, verifier, nodes[0]]
    credits = {p.address: ledger.registry.credit_of(p.address) for p in payees}
    assert credits == {reporter.address: ETHER, verifier.address: 2 * ETHER, nodes[0].address: ETHER}
    pool = 2 * ETHER
    assert chain.w3.eth.get_balance(registry_address) == sum(stakes.values()) + sum(credits.values()) + pool
    # The run ends; after the unbonding delay its creator withdraws the pool (the slashes'
    # rest counts as the creator's funding) as credit, claimed below with the others.
    end_run(ledger, deployer, run_id)

    staked = [n for n in [*nodes, verifier] if stakes[n.address]]
    for node in staked:
        ledger.registry.unbond(node, node.address)
    with pytest.raises(ChainRevertError, match="RegistryUnbondingNotDue"):
        ledger.registry.withdraw(staked[0], staked[0].address)
    _advance(chain, DELAY)
    withdraw_pool(ledger, deployer, run_id)
    payees.append(deployer)
    credits[deployer.address] = pool
    for node in staked:
        before = chain.w3.eth.get_balance(node.address)
        receipt = ledger.registry.withdraw(node, node.address)
        assert _paid(chain, receipt, node.address, before) == stakes[node.address]
    for payee in payees:
        before = chain.w3.eth.get_balance(payee.address)
        receipt = ledger.registry.claim(payee)
        assert _paid(chain, receipt, payee.address, before) == credits[payee.address]
    assert chain.w3.eth.get_balance(registry_address) == 0
    for fn in ("totalStaked", "totalBonds", "totalCredits", "totalPools"):
        assert getattr(ledger.registry.contract.functions, fn)().call() == 0


def test_a_window_at_the_unbonding_delay_is_refused(story):
    _, ledger, _, deployer, nodes, *_ = story
    with pytest.raises(ChainRevertError, match=r"LedgerWindowTooLong\(window=3600, maximum=3599\)"):
        ledger.create_run(deployer, RunSpec(
            config_digest=h("c"), genesis_digest=h("g"),
            nodes=[n.address for n in nodes], replicas=R, stages=S,
            challenge_window=DELAY, min_stake=ETHER))


def test_witness_hash_matches_the_events(story):
    _, ledger, run_id, deployer, nodes, *_ = story
    _commit(ledger, deployer, run_id, 1, h("genesis"), nodes, "x")
    (record,) = ledger.steps(run_id)
    packed = b"".join(bytes(12) + bytes.fromhex(a[2:]) for a in ledger.signers(run_id, 1))
    assert record.shards_root == keccak(b"".join(record.shards(S)))
    replica_set = record.replica_set.to_bytes(32, "big")
    assert ledger.step_info(run_id, 1).witness_hash == keccak(keccak(packed) + record.shards_root + replica_set)[:20]


def test_a_result_equivocation_and_an_aggregate_challenge_slash(story):
    chain, ledger, run_id, deployer, nodes, verifier, reporter, treasury, arbiters = story
    genesis = h("genesis")
    ckpt1 = _commit(ledger, deployer, run_id, 1, genesis, nodes, "a")
    # Node 0 co-signed stage 0's shard of step 1, and also signed another shard for it.
    honest = _signed(ledger, _claim(run_id, 1, 0, genesis, h("a-c1-0")), nodes[0].key)
    other = _signed(ledger, _claim(run_id, 1, 0, genesis, h("a-c1-0"), h("another shard")), nodes[0].key)
    slashed, _ = ledger.report_result_equivocation(reporter, run_id=run_id, step=1, parent=genesis, a=honest, b=other)
    assert slashed == 2 * ETHER and ledger.registry.stake_of(nodes[0].address) == 0
    with pytest.raises(ChainRevertError, match="LedgerAlreadySlashed"):
        ledger.report_result_equivocation(reporter, run_id=run_id, step=1, parent=genesis, a=other, b=honest)
    # Stage 1's co-signed shard of step 1 is disputed: both its co-signers answer for it.
    challenge, _ = ledger.open_aggregate_challenge(verifier, run_id=run_id, step=1, stage=1, bond=ETHER)
    assert ledger.challenge(challenge).aggregate
    assert ledger.co_signers_of(challenge) == [nodes[1].address, nodes[3].address]
    assert [ledger.registry.open_challenges_of(n.address) for n in nodes] == [0, 1, 0, 1]
    signatures = [sign_verdict(chain.chain_id, ledger.ledger.address, challenge, True, a.key)
                  for a in sorted(arbiters[:2], key=lambda a: int(a.address, 16))]
    done = ledger.resolve_with(deployer, challenge_id=challenge, upheld=True, signatures=signatures)
    assert sorted(done.slashed_nodes) == sorted([nodes[1].address, nodes[3].address])
    assert done.slashed == 4 * ETHER and done.rejected_steps == [1]
    assert ledger.head(run_id) == (genesis, 0) and ckpt1 != genesis
    assert [ledger.registry.open_challenges_of(n.address) for n in nodes] == [0, 0, 0, 0]
