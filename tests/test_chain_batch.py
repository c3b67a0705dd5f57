"""The verifier's batched chain reads on a real anvil: stakes at any block from the
registry's events (checked against the chain's own historical state), and the
`commitStep` calls of many steps in JSON-RPC batches (checked against one read per step)."""

from __future__ import annotations

import hashlib

from lineage.chain.attest import ContributionClaim, Domain
from lineage.chain.ledger import Attestation, CommitCall, RunSpec

ETHER = 10**18
R, S = 2, 2


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def _signed(ledger, run_id, step, parent, slot, node, tag):
    r, s = divmod(slot, S)
    claim = ContributionClaim(run_id, step, r, s, parent, h(f"{tag}{step}{slot}"), h(f"d{r}"), h("code"), 7,
                              replica_set=2**R - 1)
    sig = claim.sign(Domain(ledger.chain.chain_id, ledger.ledger.address), node.key)
    return Attestation(r, s, claim.contribution, claim.data_shard, claim.code_hash, claim.loss_micros, sig,
                       claim.new_shard, claim.replica_set)


def _story(ledger, accounts):
    """Stake, top up, commit three steps, slash one node for equivocation, unbond another."""
    nodes = accounts[1:1 + R * S]
    for n in nodes:
        ledger.registry.ensure_staked(n, ETHER)
    run_id = ledger.create_run(accounts[0], RunSpec(
        config_digest=h("config"), genesis_digest=h("genesis"),
        nodes=[n.address for n in nodes], replicas=R, stages=S,
        challenge_window=3600, min_stake=ETHER))
    parent = h("genesis")
    for step in (1, 2, 3):
        ledger.commit_step(accounts[0], run_id=run_id, step=step, parent=parent, checkpoint=h(f"ckpt{step}"),
                           metrics_digest=h("m"),
                           attestations=[_signed(ledger, run_id, step, parent, i, n, "c") for i, n in enumerate(nodes)])
        parent = h(f"ckpt{step}")
        if step == 1:
            ledger.registry.stake(nodes[0], nodes[0].address, ETHER // 2)  # a top-up between commits
    honest = _signed(ledger, run_id, 3, h("ckpt2"), 3, nodes[3], "c")
    other = _signed(ledger, run_id, 3, h("ckpt2"), 3, nodes[3], "x")
    assert ledger.report_equivocation(accounts[9], run_id=run_id, step=3, parent=h("ckpt2"), a=honest, b=other) > 0
    ledger.registry.unbond(nodes[1], nodes[1].address)
    return run_id, nodes


def test_stakes_from_events_equal_the_chains_state_at_every_block(ledger, accounts):
    start = ledger.chain.w3.eth.block_number
    run_id, nodes = _story(ledger, accounts)
    end = ledger.chain.w3.eth.block_number
    pairs = [(n.address, b) for n in nodes for b in range(start, end + 1)] + [(accounts[11].address, end)]
    got = ledger.registry.stakes_at(pairs)
    fn = ledger.registry.contract.functions.stakeOf
    want = {(node, b): fn(node).call(block_identifier=b) for node, b in pairs}
    assert got == want
    # the story moved every kind of change: a top-up, a slash and an unbonding
    assert got[(nodes[0].address, end)] == ETHER + ETHER // 2
    assert got[(nodes[3].address, end)] == 0 and got[(nodes[1].address, end)] == 0
    assert got[(nodes[2].address, end)] == ETHER and got[(accounts[11].address, end)] == 0
    assert len({v for (n, _), v in got.items() if n == nodes[3].address}) == 2  # 1 ETH, then 0


def test_commit_calls_in_batches_equal_one_read_per_step(ledger, accounts):
    run_id, _ = _story(ledger, accounts)
    steps = ledger.steps(run_id)
    assert len(steps) == 3
    w3 = ledger.chain.w3
    one_by_one = {s.tx: ledger.ledger.decode_function_input(w3.eth.get_transaction(s.tx)["input"])[1] for s in steps}
    assert ledger.commit_calls(steps) == {tx: CommitCall.decode(args) for tx, args in one_by_one.items()}
    assert ledger.commit_calls(steps, batch=2) == ledger.commit_calls(steps)  # more than one batch
    for s in steps:
        call = one_by_one[s.tx]
        assert call["step"] == s.step and len(call["attestations"]) == R * S
        assert all(len(a["r"]) == len(a["vs"]) == 32 for a in call["attestations"])  # EIP-2098 signatures
