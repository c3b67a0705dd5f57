"""Open membership and rewards (issue 35) on a real anvil, through `lineage.chain` as a node,
a submitter and a funder would use it: a new node joins an open run and is paid for the final
steps it attested; the attack rows (join a closed run; join an approved run without, with an
expired or with a foreign admission; join without enough free stake; claim twice; claim for a
step whose challenge was upheld; a slashed node's pending rewards) each fail by name."""

from __future__ import annotations

import hashlib

import pytest

from lineage.chain.anvil import rpc_call
from lineage.chain.attest import ContributionClaim
from lineage.chain.client import Chain
from lineage.chain.ledger import Attestation, Ledger, RunSpec
from lineage.chain.rewards import (
    finalize_due,
    join_run,
    leave_run,
    rewards_of,
    run_terms,
    sign_admission,
)
from lineage.errors import ChainRevertError

ETHER = 10**18
R, S = 2, 2
WINDOW = 600
REWARD = 4 * 10**17  # 0.4 ETH a step: 0.1 ETH a slot


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def _commit(ledger: Ledger, sender, run_id: int, step: int, parent: bytes, signers, tag: str = "a") -> bytes:
    attestations = []
    for slot, node in enumerate(signers):
        r, s = divmod(slot, S)
        claim = ContributionClaim(run_id, step, r, s, parent, h(f"{tag}-c{step}-{slot}"), h(f"d{r}"), h("code"),
                                  -7, h(f"new{step}{s}{parent.hex()}"), 2**R - 1)
        attestations.append(Attestation(r, s, claim.contribution, claim.data_shard, claim.code_hash,
                                        claim.loss_micros, claim.sign(ledger.domain, node.key), claim.new_shard,
                                        claim.replica_set))
    checkpoint = h(f"{tag}-ckpt{step}")
    ledger.commit_step(sender, run_id=run_id, step=step, parent=parent, checkpoint=checkpoint,
                       metrics_digest=h("metrics"), attestations=attestations)
    return checkpoint


def _advance(chain: Chain, seconds: int) -> None:
    rpc_call(chain.rpc_url, "evm_increaseTime", [seconds])
    rpc_call(chain.rpc_url, "evm_mine")


@pytest.fixture()
def world(anvil, accounts):
    """A fresh deployment, four staked founding nodes, a staked newcomer and a verifier."""
    chain = Chain(anvil.url)
    submitter, *nodes = accounts[0:5]
    newcomer, verifier, arbiters = accounts[5], accounts[6], accounts[7:10]
    ledger = Ledger.deploy(chain, submitter, reporter_share_bps=5_000, unbonding_delay=3600)
    for n in [*nodes, newcomer, verifier]:
        ledger.registry.ensure_staked(n, ETHER)

    def create(admission: str = "open", fund: int = 2 * ETHER) -> int:
        return ledger.create_run(submitter, RunSpec(
            config_digest=h("config"), genesis_digest=h("genesis"), nodes=[n.address for n in nodes],
            replicas=R, stages=S, challenge_window=WINDOW, min_stake=ETHER,
            arbiters=[a.address for a in arbiters], quorum=2,
            admission=admission, reward_per_step=REWARD, fund_wei=fund))

    return chain, ledger, submitter, nodes, newcomer, verifier, arbiters, create


def test_a_new_node_joins_an_open_run_and_is_paid_for_its_final_steps(world):
    chain, ledger, submitter, nodes, newcomer, _, _, create = world
    run_id = create("open")
    assert run_terms(ledger, run_id).pool == 2 * ETHER
    ckpt1 = _commit(ledger, submitter, run_id, 1, h("genesis"), nodes)
    join_run(ledger, newcomer, run_id)
    # From the next step it signs replica 1's stage 1 in place of node 3.
    ckpt2 = _commit(ledger, submitter, run_id, 2, ckpt1, [*nodes[:3], newcomer])
    assert ledger.signers(run_id, 2)[3] == newcomer.address
    _advance(chain, WINDOW + 1)
    assert finalize_due(ledger, submitter, run_id) == [1, 2]
    assert ledger.finalized_step(run_id) == 2
    assert rewards_of(ledger, newcomer.address) == {run_id: REWARD // 4}
    assert rewards_of(ledger, nodes[0].address) == {run_id: 2 * REWARD // 4}
    assert ledger.registry.credit_of(newcomer.address) == REWARD // 4
    assert run_terms(ledger, run_id).pool == 2 * ETHER - 2 * REWARD

    before = chain.w3.eth.get_balance(newcomer.address)
    receipt = ledger.registry.claim(newcomer)
    gas = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    assert chain.w3.eth.get_balance(newcomer.address) == before + REWARD // 4 - gas
    assert receipt["gasUsed"] <= 60_000
    # Claim twice: nothing left.
    with pytest.raises(ChainRevertError, match="RegistryNothingToClaim"):
        ledger.registry.claim(newcomer)
    # Leaving ends the stake lock; it signs no more.
    leave_run(ledger, newcomer, run_id)
    with pytest.raises(ChainRevertError, match="LedgerNotMember"):
        _commit(ledger, submitter, run_id, 3, ckpt2, [*nodes[:3], newcomer])


def test_joining_a_closed_run_is_refused(world):
    _, ledger, _, _, newcomer, _, _, create = world
    run_id = create("closed")
    with pytest.raises(ChainRevertError, match="LedgerRunClosed"):
        join_run(ledger, newcomer, run_id)


def test_an_approved_run_needs_a_current_admission_from_its_creator(world):
    chain, ledger, submitter, nodes, newcomer, verifier, _, create = world
    run_id = create("approved")
    now = int(chain.w3.eth.get_block("latest")["timestamp"])
    with pytest.raises(ChainRevertError, match="LedgerAdmissionRequired"):
        join_run(ledger, newcomer, run_id)
    foreign = sign_admission(ledger, submitter, run_id, verifier.address, now + 3600)  # for another node
    with pytest.raises(ChainRevertError, match="LedgerAdmissionNotByCreator"):
        join_run(ledger, newcomer, run_id, foreign)
    forged = sign_admission(ledger, nodes[0], run_id, newcomer.address, now + 3600)  # not by the creator
    with pytest.raises(ChainRevertError, match="LedgerAdmissionNotByCreator"):
        join_run(ledger, newcomer, run_id, forged)
    expired = sign_admission(ledger, submitter, run_id, newcomer.address, now + 60)
    _advance(chain, 120)
    with pytest.raises(ChainRevertError, match="LedgerAdmissionExpired"):
        join_run(ledger, newcomer, run_id, expired)
    valid = sign_admission(ledger, submitter, run_id, newcomer.address, now + 3600)
    join_run(ledger, newcomer, run_id, valid)
    assert ledger.ledger.functions.isMember(run_id, newcomer.address).call()


def test_joining_without_enough_free_stake_is_refused(world, accounts):
    _, ledger, _, _, newcomer, _, _, create = world
    first, second = create("open"), create("open")
    join_run(ledger, newcomer, first)
    # Its one ether is locked by the first run.
    with pytest.raises(ChainRevertError, match="RegistryInsufficientFreeStake"):
        join_run(ledger, newcomer, second)
    with pytest.raises(ChainRevertError, match="RegistryStakeLocked"):
        ledger.registry.unbond(newcomer, newcomer.address)
    poor = accounts[10]
    ledger.registry.ensure_staked(poor, ETHER // 2)
    with pytest.raises(ChainRevertError, match="RegistryInsufficientFreeStake"):
        join_run(ledger, poor, first)


def test_an_upheld_challenge_pays_nothing_and_a_slashed_node_forfeits_its_pending_shares(world):
    chain, ledger, submitter, nodes, _, verifier, arbiters, create = world
    run_id = create("open")
    ckpt1 = _commit(ledger, submitter, run_id, 1, h("genesis"), nodes)
    _commit(ledger, submitter, run_id, 2, ckpt1, nodes)
    # Step 2's replica 1 stage 0 (node 2) is challenged and the challenge upheld: step 2 is
    # rejected, node 2 slashed (half to the challenger, half to the run's pool).
    cid = ledger.open_challenge(verifier, run_id=run_id, step=2, replica=1, stage=0, bond=ETHER)
    ledger.resolve_challenge(submitter, challenge_id=cid, upheld=True, arbiters=arbiters[:2])
    assert run_terms(ledger, run_id).pool == 2 * ETHER + ETHER // 2
    _advance(chain, WINDOW + 1)
    # Only step 1 is due; step 2 is no longer on the chain, so nothing pays it.
    assert finalize_due(ledger, submitter, run_id) == [1]
    rejected = [c.record for c in ledger.commits(run_id) if c.status == "rejected"]
    with pytest.raises(ChainRevertError, match="LedgerStepRejected"):
        ledger.finalize_steps(submitter, run_id, rejected)
    # Node 2 was slashed after committing step 1: its share of step 1 stays in the pool.
    assert ledger.registry.credit_of(nodes[2].address) == 0
    assert ledger.registry.credit_of(nodes[0].address) == REWARD // 4
    assert run_terms(ledger, run_id).pool == 2 * ETHER + ETHER // 2 - 3 * (REWARD // 4)
    with pytest.raises(ChainRevertError, match="RegistryNothingToClaim"):
        ledger.registry.claim(nodes[2])


@pytest.mark.slow  # not in --quick: a training through the sink
def test_a_rewarding_job_is_created_funded_and_paid_through_the_sink(tmp_path, small_job, accounts):
    """A real `dlx train` of an open job with a reward per step: the sink creates the run
    with its terms and pool, and finalizes what is due after each commit; what is left due
    at the end anyone can finalize. Every final step paid `reward_wei_per_step`."""
    import shutil

    from conftest import train_small

    from lineage.chain.anvil import Anvil
    from lineage.chain.runrecord import RunRecord

    extra = ("\n[chain]\nadmission = \"open\"\nchallenge_window_s = 0\n"
             f"reward_wei_per_step = {REWARD}\nfund_wei = {10 * REWARD}\n")
    run_dir, _ = train_small(tmp_path, job=small_job("rewards", steps=3, extra=extra))
    record = RunRecord.load(run_dir)
    state = tmp_path / "state.json"
    shutil.copyfile(run_dir / str(record.chain_state), state)
    with Anvil(state_path=state) as node:
        chain = Chain(node.url)
        ledger = Ledger(chain, record.registry, record.ledger)
        terms = run_terms(ledger, record.run_id)
        assert (terms.admission, terms.reward_per_step) == ("open", REWARD)
        _advance(chain, 1)
        finalize_due(ledger, accounts[0], record.run_id)
        assert ledger.finalized_step(record.run_id) == 3
        credited = sum(rewards_of(ledger, n).get(record.run_id, 0) for n in set(record.nodes))
        assert credited == 3 * REWARD
        assert run_terms(ledger, record.run_id).pool == 7 * REWARD
    # `dlx lineage` shows what each final step paid, and to whom (the run directory's own
    # chain: the steps the sink finalized during the run).
    import json

    from test_node_cli import dlx

    res = dlx({}, "lineage", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    for step, reward in doc["rewards"].items():
        assert int(step) <= doc["finalized_step"]
        assert reward["share_wei"] == str(REWARD // 4) and len(reward["paid"]) == 4
    text = dlx({}, "lineage", str(run_dir))
    assert text.returncode == 0, text.stderr


def test_the_cli_admits_joins_shows_and_claims_rewards(world, anvil, tmp_path):
    """`dlx node admit` (the creator), `dlx node join --admission`, `dlx node status --json`
    and `dlx node claim`, which finalizes what is due before claiming."""
    import json

    from test_node_cli import dlx

    chain, ledger, submitter, nodes, newcomer, _, _, create = world
    run_id = create("approved")
    env = {"DLX_RPC": anvil.url, "DLX_LEDGER": ledger.ledger.address, "DLX_NODE_KEY": newcomer.key.hex(),
           "DLX_SUBMITTER_KEY": submitter.key.hex()}
    admission = tmp_path / "admission.json"
    res = dlx(env, "node", "admit", str(run_id), newcomer.address, "--out", str(admission))
    assert res.returncode == 0, res.stderr
    res = dlx(env, "node", "join", str(run_id), "--admission", str(admission))
    assert res.returncode == 0, res.stderr
    assert f"joined run {run_id}: it may sign from step 1" in res.stdout
    _commit(ledger, submitter, run_id, 1, h("genesis"), [*nodes[:3], newcomer])
    _advance(chain, WINDOW + 1)
    res = dlx(env, "node", "claim")
    assert res.returncode == 0, res.stderr
    assert f"run {run_id}: steps 1..1 final" in res.stdout
    doc = json.loads(dlx(env, "node", "status", "--json").stdout)
    assert doc["rewards"]["runs"] == {str(run_id): {"credited_wei": str(REWARD // 4)}}
    assert doc["rewards"]["claimable_wei"] == "0"
