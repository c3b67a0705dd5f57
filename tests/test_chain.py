"""The Python chain client against the real contracts on a real anvil: deployment,
staking, runs, EIP-712 attestations checked on chain (with co-signed stage shards,
independent replicas and partial steps over a replica set), decoded reverts, and version 1
and 2 ledgers still read and verified."""

from __future__ import annotations

import hashlib

import pytest
from eth_utils import keccak

from lineage.audit.verify import ChainFacts, verify_commit
from lineage.chain import reverts
from lineage.chain.attest import ContributionClaim, replica_bitmap
from lineage.chain.client import Chain
from lineage.chain.ledger import Attestation, Ledger, RunSpec
from lineage.errors import ChainError, ChainRevertError
from lineage.store.cid import DAG_CBOR, cid_from_digest

ETHER = 10**18
R, S = 2, 2


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def _run(ledger, accounts, min_stake=ETHER, independence="keys", min_replicas=None):
    nodes = accounts[1:1 + R * S]
    for n in nodes:
        ledger.registry.ensure_staked(n, ETHER)
    run_id = ledger.create_run(accounts[0], RunSpec(
        config_digest=h("config"), genesis_digest=h("genesis"),
        nodes=[n.address for n in nodes], replicas=R, stages=S, challenge_window=3600,
        min_stake=min_stake, independence=independence, min_replicas=min_replicas))
    return run_id, nodes


def _attest(ledger, run_id, step, parent, nodes, signers=None, shards=None, replicas=None):
    """One attestation per slot of `replicas` (default all R), slot i signed by node i of the
    full step; every replica co-signs stage s's shard `shards[s]`."""
    domain = ledger.domain
    shards = shards or {}
    replicas = tuple(range(R)) if replicas is None else replicas
    replica_set = replica_bitmap(replicas)
    out = []
    for r in replicas:
        for s in range(S):
            slot = r * S + s
            node = (signers or nodes)[slot]
            claim = ContributionClaim(run_id, step, r, s, parent, h(f"c{step}{slot}"), h(f"d{r}"),
                                      h("code"), -1_500_000 + slot, shards.get(slot, h(f"shard{step}{s}")),
                                      replica_set)
            out.append(Attestation(r, s, claim.contribution, claim.data_shard, claim.code_hash,
                                   claim.loss_micros, claim.sign(domain, node.key), claim.new_shard, replica_set))
    return out


def test_python_digest_equals_the_contracts_eip712_digest(ledger, accounts):
    domain = ledger.domain
    assert domain.version == "3"
    claim = ContributionClaim(3, 9, 1, 0, h("p"), h("c"), h("d"), h("code"), -42, h("shard"), 0b110)
    sig = claim.sign(domain, accounts[3].key)
    att = Attestation(1, 0, h("c"), h("d"), h("code"), -42, sig, h("shard"), 0b110)
    onchain = ledger.ledger.functions.contributionDigest(3, 9, h("p"), att.as_tuple()).call()
    assert bytes(onchain) == claim.digest(domain)
    assert claim.recover(domain, sig) == accounts[3].address


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
    assert steps[0].shards(S) == [h("shard10"), h("shard11")]
    assert steps[0].shards_root == keccak(h("shard10") + h("shard11"))


def test_a_partial_step_commits_over_its_replica_set_and_reads_back_with_it(ledger, accounts):
    run_id, nodes = _run(ledger, accounts, min_replicas=1)
    assert ledger.run_created(run_id).min_replicas == 1
    atts = _attest(ledger, run_id, 1, h("genesis"), nodes, replicas=(1,))
    ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("ckpt1"),
                       metrics_digest=h("m"), attestations=atts, replica_set=0b10)
    (record,) = ledger.steps(run_id)
    assert record.replica_set == 0b10 and record.replicas(R) == (1,)
    assert [(a["replica"], a["stage"]) for a in record.attestations] == [(1, 0), (1, 1)]
    assert [a["node"] for a in record.attestations] == [n.address for n in nodes[2:]]
    assert record.shards(S) == [h("shard10"), h("shard11")]
    call = ledger.commit_calls([record])[record.tx]
    stakes = ledger.registry.stakes_at((a["node"], record.block) for a in record.attestations)
    verify_commit(record, 1, cid_from_digest(h("genesis"), DAG_CBOR), call,
                  ChainFacts(ledger.domain, run_id, {n.address for n in nodes}, stakes, R, S))


@pytest.mark.parametrize(("replicas", "replica_set", "error", "args"), [
    ((0,), 0b01, "LedgerTooFewReplicas", {"present": 1, "minReplicas": 2}),
    ((0, 1), 0b111, "LedgerReplicaSetOutOfRange", {"replicaSet": 7, "replicas": 2}),
    ((0, 1), 0b01, "LedgerReplicaSetMismatch", {"index": 0, "expected": 1, "got": 3}),
])
def test_a_bad_replica_set_is_refused_with_its_named_error(ledger, accounts, replicas, replica_set, error, args):
    run_id, nodes = _run(ledger, accounts, min_replicas=2 if error == "LedgerTooFewReplicas" else 1)
    atts = _attest(ledger, run_id, 1, h("genesis"), nodes, replicas=replicas)
    if error == "LedgerReplicaSetMismatch":
        atts = atts[:S]  # replica 0's slots, signed over {0, 1}, sent as {0}
    with pytest.raises(ChainRevertError, match=error) as exc:
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=atts, replica_set=replica_set)
    assert exc.value.name == error and exc.value.error_args == args
    assert type(exc.value) is getattr(reverts, error)  # the typed class of its name


def test_a_present_replica_missing_a_stage_is_refused_naming_the_slot(ledger, accounts):
    run_id, nodes = _run(ledger, accounts)
    atts = _attest(ledger, run_id, 1, h("genesis"), nodes)
    with pytest.raises(ChainRevertError, match=r"LedgerMissingStage\(replica=1, stage=1\)"):
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=atts[:-1], replica_set=0b11)


def test_a_replica_co_signing_another_shard_is_refused_naming_stage_and_replica(ledger, accounts):
    run_id, nodes = _run(ledger, accounts)
    atts = _attest(ledger, run_id, 1, h("genesis"), nodes, shards={3: h("wrong")})
    with pytest.raises(ChainRevertError, match="LedgerShardMismatch") as exc:
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=atts)
    assert exc.value.error_args == {"stage": 1, "replica": 1, "expected": h("shard11"), "got": h("wrong")}


def test_one_node_in_two_replicas_is_refused_naming_it_and_both_replicas(ledger, accounts):
    run_id, nodes = _run(ledger, accounts)
    signers = [nodes[0], nodes[1], nodes[2], nodes[0]]  # node 0 signs (0, 0) and (1, 1)
    with pytest.raises(ChainRevertError, match="LedgerNotIndependent") as exc:
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=_attest(ledger, run_id, 1, h("genesis"), nodes, signers))
    assert exc.value.error_args == {"node": nodes[0].address.lower(), "replicaA": 0, "replicaB": 1}


def test_an_operators_run_refuses_one_operators_nodes_in_two_replicas(ledger, accounts):
    operator = accounts[11]
    nodes = accounts[1:1 + R * S]
    for n in nodes:
        ledger.registry.ensure_staked(n, ETHER, operator if n in (nodes[0], nodes[3]) else None)
    run_id = ledger.create_run(accounts[0], RunSpec(
        config_digest=h("config"), genesis_digest=h("genesis"),
        nodes=[n.address for n in nodes], replicas=R, stages=S, challenge_window=3600,
        min_stake=ETHER, independence="operators"))
    assert ledger.ledger.functions.independenceOf(run_id).call() == 1
    with pytest.raises(ChainRevertError, match="LedgerNotIndependent") as exc:
        ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("genesis"), checkpoint=h("x"),
                           metrics_digest=h("m"), attestations=_attest(ledger, run_id, 1, h("genesis"), nodes))
    assert exc.value.error_args == {"node": nodes[3].address.lower(), "replicaA": 0, "replicaB": 1}


def test_a_version_1_ledger_is_read_and_its_steps_verify_under_their_own_typed_data(ledger, accounts):
    """A run committed before co-signed shards: its ledger says version 1 and keeps verifying."""
    chain = ledger.chain
    old = Ledger(chain, ledger.registry.address, chain.deploy("TrainingLedger-v1", accounts[0], ledger.registry.address))
    assert old.version == "1" and old.domain.version == "1"
    nodes = accounts[1:1 + R * S]
    for n in nodes:
        ledger.registry.ensure_staked(n, ETHER)
    fn = old.ledger.functions.createRun(h("config"), h("genesis"), [n.address for n in nodes], R, S, 3600, ETHER, [], 0)
    chain.transact(fn, accounts[0], context="createRun v1")
    claims = [ContributionClaim(1, 1, r, s, h("genesis"), h(f"c{r}{s}"), h(f"d{r}"), h("code"), 7)
              for r in range(R) for s in range(S)]
    atts = [(c.replica, c.stage, c.contribution, c.data_shard, c.code_hash, c.loss_micros, c.sign(old.domain, n.key))
            for c, n in zip(claims, nodes, strict=True)]
    root = keccak(b"".join(c.contribution for c in claims))
    chain.transact(old.ledger.functions.commitStep(1, 1, h("genesis"), h("ckpt1"), root, h("m"), atts),
                   accounts[0], context="commitStep v1")
    (record,) = old.steps(1)
    assert record.shards_root is None and len(record.attestations) == R * S
    call = old.commit_calls([record])[record.tx]
    stakes = old.registry.stakes_at((a["node"], record.block) for a in record.attestations)
    members = set(old.run_created(1).nodes)
    verify_commit(record, 1, cid_from_digest(h("genesis"), DAG_CBOR), call,
                  ChainFacts(old.domain, 1, members, stakes, R, S))
    with pytest.raises(ChainError, match="needs a version 3 ledger"):
        old.commit_step(accounts[0], run_id=1, step=2, parent=h("ckpt1"), checkpoint=h("x"),
                        metrics_digest=h("m"), attestations=[])


def test_a_version_2_ledger_is_read_and_its_steps_verify_under_their_own_typed_data(ledger, accounts):
    """A run committed before replica sets: its ledger says version 2, every step has every
    replica (the set reads as all R), and it keeps verifying."""
    chain = ledger.chain
    old = Ledger(chain, ledger.registry.address, chain.deploy("TrainingLedger-v2", accounts[0], ledger.registry.address))
    assert old.version == "2" and old.domain.version == "2"
    nodes = accounts[1:1 + R * S]
    for n in nodes:
        ledger.registry.ensure_staked(n, ETHER)
    fn = old.ledger.functions.createRun(h("config"), h("genesis"), [n.address for n in nodes], R, S, 3600, ETHER,
                                        [], 0, 0)
    chain.transact(fn, accounts[0], context="createRun v2")
    assert old.run_created(1).min_replicas == R
    claims = [ContributionClaim(1, 1, r, s, h("genesis"), h(f"c{r}{s}"), h(f"d{r}"), h("code"), 7, h(f"shard{s}"))
              for r in range(R) for s in range(S)]
    atts = [(c.replica, c.stage, c.contribution, c.data_shard, c.code_hash, c.loss_micros, c.new_shard,
             *Attestation(0, 0, b"", b"", b"", 0, c.sign(old.domain, n.key)).as_tuple()[-2:])
            for c, n in zip(claims, nodes, strict=True)]
    root = keccak(b"".join(c.contribution for c in claims))
    chain.transact(old.ledger.functions.commitStep(1, 1, h("genesis"), h("ckpt1"), root, h("m"), atts),
                   accounts[0], context="commitStep v2")
    (record,) = old.steps(1)
    assert record.replica_set is None and record.replicas(R) == tuple(range(R))
    assert record.shards(S) == [h("shard0"), h("shard1")]
    call = old.commit_calls([record])[record.tx]
    stakes = old.registry.stakes_at((a["node"], record.block) for a in record.attestations)
    members = set(old.run_created(1).nodes)
    verify_commit(record, 1, cid_from_digest(h("genesis"), DAG_CBOR), call,
                  ChainFacts(old.domain, 1, members, stakes, R, S))
    assert old.step_info(1, 1).witness_hash.strip(b"\0")  # version 2 stores a witness hash
    with pytest.raises(ChainError, match="needs a version 3 ledger"):
        old.commit_step(accounts[0], run_id=1, step=2, parent=h("ckpt1"), checkpoint=h("x"),
                        metrics_digest=h("m"), attestations=[])


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
    ledger.registry.ensure_staked(outsider, ETHER)
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
