"""The auditor's and arbiter's commands on a real anvil, with real replays:
`dlx challenge` replays a poisoned slot and opens a challenge with content-addressed
evidence, `dlx arbiter vote` signs (after its own replay), `dlx arbiter resolve` submits the
quorum and the ledger slashes, rejects the step and its descendant and rolls the head back,
which `dlx lineage` then shows; `dlx slash-equivocation` slashes a node from two signed
claims; signed claims round-trip through their JSON form.

The challenged run is the session's trained run committed again on a ledger with arbiters
(`dlx train` creates runs without any), its step 2 with slot (0, 1)'s contribution poisoned:
the manifest, the start states and the data are the honest ones, so a replay of replica 0
reproduces the honest contribution and contradicts the poisoned claim.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import dag_cbor
import numpy as np
import pytest
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from test_node_cli import one_line_error, run_dlx

from lineage.audit.evidence import Accused, AuditError, open_replay_challenge
from lineage.audit.query import ledger_lineage
from lineage.audit.replay import ReplicaReplay, StageReplay
from lineage.audit.report import render_html
from lineage.chain.anvil import rpc_call
from lineage.chain.attest import ClaimError, ContributionClaim, Domain, SignedClaim, loss_micros
from lineage.chain.client import Chain
from lineage.chain.ledger import Attestation, Ledger, RunSpec
from lineage.chain.runrecord import RunRecord
from lineage.errors import BlockNotFoundError
from lineage.store.blockstore import Blockstore
from lineage.store.cid import digest_of, parse_cid
from lineage.store.manifest import get_manifest, put_manifest
from lineage.store.unixfs import file_cid, import_bytes, read_bytes

ETHER = 10**18
WINDOW = 600
R, S = 2, 2


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def poisoned(data: bytes) -> bytes:
    """A contribution with one tensor nudged: still a well-formed payload, not the honest one."""
    tensors = dict(st_load(data))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + np.float32(1e-3)
    return bytes(st_save({k: tensors[k] for k in sorted(tensors)}))


@pytest.fixture(scope="module")
def arbitrated(trained_run, anvil, accounts, tmp_path_factory) -> dict[str, Any]:
    """The trained run on a fresh ledger with three arbiters (quorum 2), step 2 poisoned."""
    run_dir = trained_run[0]
    record = RunRecord.load(run_dir)
    root = tmp_path_factory.mktemp("arbitrated")
    blocks = Path(shutil.copytree(record.blocks_dir(run_dir), root / "blocks"))
    store = Blockstore(blocks)
    deployer, slot_keys, challenger, arbiters = accounts[0], accounts[1:5], accounts[5], accounts[8:11]
    ledger = Ledger.deploy(Chain(anvil.url), deployer)
    for key in [*slot_keys, challenger]:
        ledger.registry.ensure_staked(key, ETHER)
    genesis = get_manifest(store, record.genesis)
    run_id = ledger.create_run(deployer, RunSpec(
        config_digest=digest_of(genesis.config), genesis_digest=digest_of(parse_cid(record.genesis)),
        nodes=[k.address for k in slot_keys], replicas=R, stages=S, challenge_window=WINDOW, min_stake=ETHER,
        arbiters=[a.address for a in arbiters], quorum=2))
    honest = [parse_cid(s["checkpoint"]) for s in _lineage(run_dir)["steps"]]
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    parent, checkpoints = parse_cid(record.genesis), []
    for step, cid in enumerate(honest, start=1):
        m = get_manifest(store, cid)
        contributions = [list(row) for row in m.contributions]
        if step == 2:
            contributions[0][1] = import_bytes(poisoned(read_bytes(store, m.contributions[0][1])), store.put).cid
        m = dataclasses.replace(m, run=run_id, parent=parent, contributions=contributions)
        checkpoint = put_manifest(store, m)
        atts = []
        for slot, key in enumerate(slot_keys):
            r, s = divmod(slot, S)
            claim = ContributionClaim(run_id, step, r, s, digest_of(parent), digest_of(contributions[r][s]),
                                      m.data[r], m.code, loss_micros(m.metrics["train_loss"]), replica_set=2**R - 1)
            atts.append(Attestation(r, s, claim.contribution, claim.data_shard, claim.code_hash,
                                    claim.loss_micros, claim.sign(domain, key.key), claim.new_shard, claim.replica_set))
        ledger.commit_step(deployer, run_id=run_id, step=step, parent=digest_of(parent),
                           checkpoint=digest_of(checkpoint), metrics_digest=h("metrics"), attestations=atts)
        parent = checkpoint
        checkpoints.append(checkpoint)
    return {"ledger": ledger, "run_id": run_id, "store": store, "blocks": blocks, "honest": honest,
            "checkpoints": checkpoints, "slot_keys": slot_keys, "challenger": challenger, "arbiters": arbiters,
            "env": {"DLX_RPC": anvil.url, "DLX_LEDGER": ledger.ledger.address, "DLX_STORE": str(blocks)},
            "root": root}


def _lineage(run_dir: Path) -> dict[str, Any]:
    res = run_dlx({}, "lineage", "--run-dir", str(run_dir), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.slow  # not in --quick: reads the session's trained run
def test_a_replay_that_matches_or_failed_opens_no_challenge(arbitrated):
    """The decision itself, fed a replay that reproduced both of replica 0's stages, and
    one that could not run at all."""
    a = arbitrated
    ledger, store = a["ledger"], a["store"]
    m = get_manifest(store, a["checkpoints"][1])
    same = ReplicaReplay(step=2, replica=0, seconds=0.0, stages=[
        StageReplay(s, str(m.contributions[0][s]), str(m.contributions[0][s]), True, 0.0,
                    read_bytes(store, m.contributions[0][s])) for s in range(S)])
    for node in a["slot_keys"][:2]:
        with pytest.raises(AuditError, match="replay matches the claim; nothing to challenge"):
            open_replay_challenge(ledger, store, a["challenger"], Accused(a["run_id"], 2, node.address), [same], 0.0,
                                  None)
    broken = ReplicaReplay(step=2, replica=0, seconds=0.0, stages=[], error="the manifest links no start states")
    with pytest.raises(AuditError, match="cannot replay step 2 replica 0: the manifest links no start states"):
        open_replay_challenge(ledger, store, a["challenger"], Accused(a["run_id"], 2, a["slot_keys"][1].address),
                              [broken], 0.0, None)
    with pytest.raises(AuditError, match="attested no slot of step 2"):
        open_replay_challenge(ledger, store, a["challenger"], Accused(a["run_id"], 2, a["challenger"].address),
                              [same], 0.0, None)
    assert ledger.step_info(a["run_id"], 2).open_challenges == 0


@pytest.mark.slow
def test_challenge_vote_resolve_slashes_the_poisoned_slot_and_rolls_back(arbitrated, anvil):
    a = arbitrated
    ledger, store, run_id = a["ledger"], a["store"], a["run_id"]
    cheater, honest_node = a["slot_keys"][1], a["slot_keys"][0]  # slot (0, 1) poisoned; slot (0, 0) not
    env = {**a["env"], "DLX_NODE_KEY": a["challenger"].key.hex()}

    assert "has no step 9" in one_line_error(run_dlx(env, "challenge", "1", "9", "--node", cheater.address))
    assert "attested no slot" in one_line_error(
        run_dlx(env, "challenge", "1", "2", "--node", a["challenger"].address))

    # The challenge: a real replay of replica 0 at step 2 reproduces the honest payload.
    res = run_dlx(env, "challenge", str(run_id), "2", "--node", cheater.address, "--json", real=True)
    assert res.returncode == 0, res.stderr
    done = json.loads(res.stdout)
    assert (done["challenge"], done["replica"], done["stage"]) == (1, 0, 1)
    assert done["mismatched_slots"] == [[0, 1]] and done["rel_l2"] > 0
    assert done["bond_wei"] == str(ETHER)  # the run's minimum stake
    evidence = dag_cbor.decode(store.get(done["evidence"]))
    honest_contribution = get_manifest(store, a["honest"][1]).contributions[0][1]
    assert parse_cid(evidence["replayed"]) == honest_contribution  # bit for bit the honest work
    assert parse_cid(evidence["claimed"]) == get_manifest(store, a["checkpoints"][1]).contributions[0][1]
    assert (evidence["run"], evidence["step"], evidence["node"], evidence["replica"], evidence["stage"]) == (
        run_id, 2, cheater.address, 0, 1)
    assert parse_cid(evidence["checkpoint"]) == a["checkpoints"][1] and evidence["rel_l2"] == done["rel_l2"]
    assert file_cid(read_bytes(store, evidence["replayed"])) == parse_cid(evidence["replayed"])
    opened = ledger.challenge(1)
    assert opened.evidence == digest_of(parse_cid(done["evidence"]))
    assert (opened.node, opened.challenger, opened.resolved) == (cheater.address, a["challenger"].address, False)
    assert ledger.step_info(run_id, 2).open_challenges == 1
    status = json.loads(run_dlx({**env, "DLX_NODE_KEY": cheater.key.hex()}, "node", "status", "--json").stdout)
    assert status["open_challenges"] == 1 and status["challenges"][0]["id"] == 1

    # Verdicts: one arbiter replays before signing, one signs to a file; others cannot sign.
    arb_a, arb_b, _ = a["arbiters"]
    res = run_dlx({**env, "DLX_ARBITER_KEY": arb_a.key.hex()}, "arbiter", "vote", "1", "--uphold", "--replay")
    assert res.returncode == 0, res.stderr
    assert "differs from the claim" in res.stderr
    sig_a = res.stdout.strip()
    assert sig_a.startswith("0x") and len(sig_a) == 132
    vote_b = a["root"] / "b.json"
    res = run_dlx({**env, "DLX_ARBITER_KEY": arb_b.key.hex()}, "arbiter", "vote", "1", "--uphold", "--out", str(vote_b))
    assert res.returncode == 0, res.stderr
    assert json.loads(vote_b.read_text())["arbiter"] == arb_b.address
    assert "is not an arbiter of run 1" in one_line_error(run_dlx(env, "arbiter", "vote", "1", "--uphold"))
    assert "say --uphold or --dismiss" in one_line_error(run_dlx(env, "arbiter", "vote", "1"))

    # Resolution: a lone signature is short of the quorum; a verdict file for the other
    # ruling is refused; two in any order are sorted and upheld.
    assert "needs a quorum of 2" in one_line_error(run_dlx(env, "arbiter", "resolve", "1", "--uphold", sig_a))
    assert "upheld is True, not False" in one_line_error(
        run_dlx(env, "arbiter", "resolve", "1", "--dismiss", str(vote_b), sig_a))
    assert "not an arbiter" in one_line_error(run_dlx(env, "arbiter", "resolve", "1", "--dismiss", sig_a, sig_a))
    credit_before = ledger.registry.credit_of(a["challenger"].address)
    res = run_dlx(env, "arbiter", "resolve", "1", "--uphold", str(vote_b), sig_a, "--json", real=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["upheld"] and out["node"] == cheater.address
    assert out["slashed_wei"] == str(ETHER) and out["reward_wei"] == str(ETHER // 2)
    assert out["rejected_steps"] == [2, 3]
    assert out["head_step"] == 1 and out["head"] == str(a["checkpoints"][0])
    assert out["bond_to"] == a["challenger"].address
    assert ledger.registry.stake_of(cheater.address) == 0 and ledger.registry.stake_of(honest_node.address) == ETHER
    assert ledger.registry.credit_of(a["challenger"].address) - credit_before == ETHER + ETHER // 2
    assert ledger.head(run_id) == (digest_of(a["checkpoints"][0]), 1)
    assert "already resolved" in one_line_error(run_dlx(env, "arbiter", "resolve", "1", "--uphold", sig_a))

    # The lineage now shows the rejected branch, and finality once the window has passed.
    rpc_call(anvil.url, "evm_increaseTime", [WINDOW + 1])
    rpc_call(anvil.url, "evm_mine")
    ledger.finalize(a["challenger"], run_id, 1)
    html = a["root"] / "lineage.html"
    res = run_dlx(a["env"], "lineage", str(run_id), "--json", "--html", str(html))
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [(s["step"], s["status"], s["rejected_by"]) for s in doc["steps"]] == [
        (1, "finalized", None), (2, "rejected", 1), (3, "rejected", 1)]
    assert doc["head"] == str(a["checkpoints"][0]) and doc["finalized_step"] == 1
    page = html.read_text()
    assert page.count('class="ckpt rejected"') == 2 and page.count("<tr class='rejected'>") == 2
    assert "rejected by challenge 1" in page
    # The rejected head's own ancestry, by CID: the finalized step, then the rejected two.
    res = run_dlx(a["env"], "lineage", str(a["checkpoints"][2]), "--json")
    assert res.returncode == 0, res.stderr
    assert [s["status"] for s in json.loads(res.stdout)["steps"]] == ["finalized", "rejected", "rejected"]
    # A rejected commit whose blocks are gone still shows what the chain recorded of it;
    # a current one whose block is gone is an error.
    partial = Blockstore(shutil.copytree(a["blocks"], a["root"] / "partial"))
    partial.delete(a["checkpoints"][2])
    steps = ledger_lineage(ledger, partial, run_id).steps
    assert [(s.step, s.status, bool(s.metrics), len(s.nodes)) for s in steps] == [
        (1, "finalized", True, 4), (2, "rejected", True, 4), (3, "rejected", False, 4)]
    assert "block not in the store" in render_html(ledger_lineage(ledger, partial, run_id).as_json())
    partial.delete(a["checkpoints"][0])
    with pytest.raises(BlockNotFoundError):
        ledger_lineage(ledger, partial, run_id)


# -- slashing an equivocation -------------------------------------------------------------

@pytest.fixture()
def equivocation(ledger, accounts, tmp_path) -> dict[str, Any]:
    nodes = accounts[1:5]
    for n in nodes:
        ledger.registry.ensure_staked(n, 2 * ETHER)
    run_id = ledger.create_run(accounts[0], RunSpec(
        config_digest=h("config"), genesis_digest=h("genesis"),
        nodes=[n.address for n in nodes], replicas=R, stages=S,
        challenge_window=WINDOW, min_stake=ETHER))
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)

    def claim_file(name: str, key: Any, contribution: str, **changes: Any) -> Path:
        claim = ContributionClaim(run_id, 1, 0, 1, h("genesis"), h(contribution), h("shard"), h("code"), 1_234_567,
                                  replica_set=2**R - 1)
        path = tmp_path / f"{name}.json"
        SignedClaim.sign(dataclasses.replace(claim, **changes), domain, key.key).save(path)
        return path

    return {"run_id": run_id, "nodes": nodes, "claim_file": claim_file, "domain": domain}


def test_slash_equivocation_from_two_signed_claims(ledger, accounts, anvil, equivocation):
    e = equivocation
    node, reporter = e["nodes"][1], accounts[6]
    a = e["claim_file"]("a", node, "honest")
    b = e["claim_file"]("b", node, "other")
    env = {"DLX_RPC": anvil.url, "DLX_REPORTER_KEY": reporter.key.hex()}

    # Checked locally first: the same claim twice, another node's claim, another slot,
    # another parent, another chain.
    assert "no equivocation" in one_line_error(run_dlx(env, "slash-equivocation", str(a), str(a)))
    other_node = e["claim_file"]("c", e["nodes"][2], "other")
    assert "signed by different keys" in one_line_error(run_dlx(env, "slash-equivocation", str(a), str(other_node)))
    other_slot = e["claim_file"]("d", node, "other", stage=0)
    assert "different slots: stage 1 and 0" in one_line_error(run_dlx(env, "slash-equivocation", str(a), str(other_slot)))
    other_parent = e["claim_file"]("p", node, "other", parent=h("elsewhere"))
    assert "different parents" in one_line_error(run_dlx(env, "slash-equivocation", str(a), str(other_parent)))
    assert "wrong chain id" in one_line_error(
        run_dlx(env, "slash-equivocation", str(a), str(b), "--chain-id", "1"))
    assert "claim file not found" in one_line_error(run_dlx(env, "slash-equivocation", str(a), "missing.json"))
    assert ledger.registry.stake_of(node.address) == 2 * ETHER

    res = run_dlx(env, "slash-equivocation", str(a), str(b), real=True)
    assert res.returncode == 0, res.stderr
    assert f"slashed {node.address}: 2 ETH (2000000000000000000 wei)" in res.stdout
    assert "run 1 step 1 slot (0, 1)" in res.stdout
    tx = res.stdout.split("tx ")[1].split()[0]
    assert ledger.chain.w3.eth.get_transaction_receipt(tx)["status"] == 1
    assert ledger.registry.stake_of(node.address) == 0
    assert ledger.registry.credit_of(reporter.address) == ETHER  # the reporter's half
    assert reporter.key.hex()[2:] not in res.stdout + res.stderr
    line = one_line_error(run_dlx(env, "slash-equivocation", str(b), str(a)))
    assert "reverted with LedgerAlreadySlashed(" in line


def test_signed_claims_round_trip_and_refuse_malformed_documents(accounts):
    domain = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")
    claim = ContributionClaim(7, 3, 1, 0, h("p"), h("c"), h("d"), h("code"), -42, replica_set=0b110)
    signed = SignedClaim.sign(claim, domain, accounts[3].key)
    doc = json.loads(signed.to_json())
    assert doc["claim"]["replicaSet"] == 0b110
    assert doc["domain"] == {"name": "DiLoCoXLedger", "version": "3", "chainId": 31337,
                             "verifyingContract": domain.verifying_contract}
    assert doc["claim"]["parent"] == "0x" + h("p").hex() and doc["claim"]["lossMicros"] == -42
    back = SignedClaim.from_json(signed.to_json())
    assert back == signed and back.recover() == accounts[3].address
    # The signature covers every field: a changed loss recovers to some other key.
    doc["claim"]["lossMicros"] = -41
    assert SignedClaim.from_json(doc).recover() != accounts[3].address

    def refused(mutate: Any, needle: str) -> None:
        d = json.loads(signed.to_json())
        mutate(d)
        with pytest.raises(ClaimError, match=needle):
            SignedClaim.from_json(d)

    refused(lambda d: d["domain"].update(name="Other"), "domain is 'Other'")
    refused(lambda d: d["claim"].update(parent="0x1234"), "claim.parent has 2 bytes, not 32")
    refused(lambda d: d["claim"].pop("dataShard"), "claim.dataShard is missing")
    refused(lambda d: d["claim"].update(step="3"), "claim.step is not an integer")
    refused(lambda d: d["claim"].update(extra=1), "unknown claim field")
    refused(lambda d: d.update(signature="0xzz"), "signature is not 0x-hex")
    with pytest.raises(ClaimError, match="not JSON"):
        SignedClaim.from_json("{")
    bad_sig = dataclasses.replace(signed, signature=bytes(65))
    with pytest.raises(ClaimError, match="malformed"):
        bad_sig.recover()


def _committed_run(ledger: Ledger, accounts: list) -> tuple[int, list, Any, list]:
    """A 2x2 run with three arbiters (quorum 2) whose step 1 four staked nodes signed:
    (run id, the nodes in slot order, a staked verifier, the arbiters)."""
    nodes, verifier, arbiters = accounts[1:5], accounts[5], accounts[8:11]
    for n in [*nodes, verifier]:
        ledger.registry.ensure_staked(n, ETHER)
    run_id = ledger.create_run(accounts[0], RunSpec(
        config_digest=h("c"), genesis_digest=h("g"),
        nodes=[n.address for n in nodes], replicas=R, stages=S, challenge_window=WINDOW,
        min_stake=ETHER, arbiters=[x.address for x in arbiters], quorum=2))
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    atts = []
    for slot, n in enumerate(nodes):
        r, s = divmod(slot, S)
        c = ContributionClaim(run_id, 1, r, s, h("g"), h(f"c{slot}"), h("d"), h("code"), 0, replica_set=2**R - 1)
        atts.append(Attestation(r, s, c.contribution, c.data_shard, c.code_hash, c.loss_micros, c.sign(domain, n.key),
                                c.new_shard, c.replica_set))
    ledger.commit_step(accounts[0], run_id=run_id, step=1, parent=h("g"), checkpoint=h("k1"),
                       metrics_digest=h("m"), attestations=atts)
    return run_id, nodes, verifier, arbiters


def test_the_chain_client_reports_a_resolution_with_its_events(ledger, accounts):
    """`Ledger.resolve_with` (the arbiter CLI's call) on a dismissed challenge: the bond goes
    to the node's operator, nothing is slashed or rejected, the head stays."""
    run_id, nodes, verifier, arbiters = _committed_run(ledger, accounts)
    cid, tx = ledger.open_challenge_tx(verifier, run_id=run_id, step=1, replica=1, stage=0, bond=ETHER)
    assert ledger.challenges(run_id=run_id)[0].tx == tx
    assert ledger.run_params(run_id).min_stake == ETHER
    from lineage.chain.attest import sign_verdict

    sigs = {x.address: sign_verdict(ledger.chain.chain_id, ledger.ledger.address, cid, False, x.key) for x in arbiters[:2]}
    for addr, sig in sigs.items():
        assert ledger.verdict_signer(cid, False, sig) == addr
    res = ledger.resolve_with(accounts[0], challenge_id=cid, upheld=False,
                              signatures=[sigs[k] for k in sorted(sigs, key=lambda k: int(k, 16))])
    assert (res.upheld, res.slashed, res.rejected_steps, res.head_step) == (False, 0, [], None)
    assert (res.bond, res.bond_to, res.node) == (ETHER, nodes[2].address, nodes[2].address)
    assert ledger.registry.credit_of(nodes[2].address) == ETHER
    assert [c.status for c in ledger.commits(run_id)] == ["pending"]
    assert ledger.head(run_id) == (h("k1"), 1)


def test_a_challenge_no_quorum_rules_on_expires(ledger, accounts, anvil):
    """Arbiters who never vote must not lock the challenger's bond, the node's stake and the
    step's finality forever: after the resolution period anyone may expire the challenge.
    (Last in this module: it moves the module's chain clock forward by a week.)"""
    run_id, nodes, verifier, arbiters = _committed_run(ledger, accounts)
    cid, _ = ledger.open_challenge_tx(verifier, run_id=run_id, step=1, replica=0, stage=1, bond=ETHER)
    env = {"DLX_RPC": anvil.url, "DLX_LEDGER": ledger.ledger.address, "DLX_NODE_KEY": accounts[6].key.hex()}

    assert f"challenge {cid} awaits its arbiters until" in one_line_error(run_dlx(env, "expire-challenge", str(cid)))
    rpc_call(anvil.url, "evm_increaseTime", [ledger.resolution_period() + 1])
    rpc_call(anvil.url, "evm_mine")
    credit = ledger.registry.credit_of(verifier.address)
    res = run_dlx(env, "expire-challenge", str(cid), "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["node"], out["bond_to"], out["bond_wei"]) == (nodes[1].address, verifier.address, str(ETHER))
    assert ledger.registry.credit_of(verifier.address) - credit == ETHER and ledger.registry.stake_of(nodes[1].address) == ETHER
    assert ledger.registry.open_challenges_of(nodes[1].address) == 0 and ledger.step_info(run_id, 1).open_challenges == 0
    (listed,) = ledger.challenges(run_id=run_id)
    assert listed.resolved and listed.expired and listed.upheld is None
    ledger.finalize(accounts[0], run_id, 1)
    assert ledger.finalized_step(run_id) == 1
    assert "already resolved" in one_line_error(run_dlx(env, "expire-challenge", str(cid)))
