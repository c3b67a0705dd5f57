"""The attack catalogue (issue 6; docs/audit.md, "Attack catalogue"): each attack on a real anvil
with real training processes, caught by the layer named, ending in a slash where the
contracts allow it.

Runs trained for it: the session's honest 2x2 run (`trained_run`; tampering happens on
copies), one 2x2 run whose nodes cheat where the ledger cannot see it (a poisoned
contribution, skipped work, an equivocating signature), one 2x1 run whose coordinator
cheats (a manifest linking a shard nobody co-signed, then a stale parent), one 2x1 run whose
replicas collude on a wrong shard (and one of them equivocates on it), and two short 2x1
runs the ledger stops (one node signing for both replicas; a replica co-signing another
shard than its peer). The cheats come from the test-only `[cheat]` job section
(tests/dlx_testing/cheat.py, the suite's extension: conftest names it in DLX_TEST_EXTENSION).
The runs are real `dlx train` processes; the verifications that catch them run `dlx verify`
in this process (tests/dlx_testing/here.py), the commands a challenger or reporter types run
the installed `dlx`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dag_cbor
import pytest
from dlx_testing.cheat import CheatingJobFile
from dlx_testing.here import dlx_here
from eth_utils import to_checksum_address

from lineage.chain.anvil import ANVIL_CHAIN_ID, dev_accounts, free_port, rpc_call, tool_path
from lineage.chain.attest import (
    ContributionClaim,
    Domain,
    SignedClaim,
    expand_signature,
    sign_verdict,
)
from lineage.chain.ledger import Attestation, Ledger, RunSpec
from lineage.chain.runrecord import RunRecord
from lineage.errors import ChainRevertError
from lineage.store.blockstore import Blockstore
from lineage.store.cid import DAG_CBOR, digest_of, parse_cid
from lineage.store.manifest import get_manifest
from trainer.config import load_job
from trainer.errors import ConfigError
from workers.run.local import refuse_cheat_off_local_chain

DLX = str(Path(sys.executable).parent / "dlx")
ETHER = 10**18

# Node cheats, 2x2: replica 1 stage 1 poisons from step 2; replica 0 skips its work at
# step 3; the node of slot (0, 1) signs two claims for steps 2 and 3.
NODE_CHEATS = """
[[cheat]]
mode = "poison"
replica = 1
stage = 1
from_step = 2

[[cheat]]
mode = "skip_work"
replica = 0
from_step = 3

[[cheat]]
mode = "equivocate"
replica = 0
stage = 1
from_step = 2
"""

# Coordinator cheats, 2x1: step 2's stored shard is not the aggregate (the replicas co-signed
# the true one); step 3 forks from step 1.
COORDINATOR_CHEATS = """
[[cheat]]
mode = "bad_aggregate"
from_step = 2

[[cheat]]
mode = "stale_parent"
from_step = 3
"""


#: The arbiters (quorum 2) of the collusion run: dev accounts past the 2x1 world's keys.
ARBITERS = dev_accounts(10)[6:9]

# Replica collusion, 2x1 with arbiters: from step 2 both replicas co-sign the shard the
# coordinator stores off the aggregate; replica 1 also signs a second claim with another shard.
COSIGN_CHEATS = f"""
[chain]
arbiters = {json.dumps([a.address for a in ARBITERS])}
quorum = 2

[[cheat]]
mode = "collude_shard"
stage = 0
from_step = 2

[[cheat]]
mode = "equivocate_result"
replica = 1
stage = 0
from_step = 2
"""


def dlx(*args: Any, timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)


def dlx_at_once(calls: list[tuple[Any, ...]], envs: list[dict[str, str]],
                timeout: float = 600) -> list[subprocess.CompletedProcess[str]]:
    """`dlx ARGS` for each of `calls` (with its environment of `envs`), all started at once:
    their finished processes, in order."""
    procs = [subprocess.Popen([DLX, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for args, env in zip(calls, envs, strict=True)]
    try:
        done = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return done
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def verify(run_dir: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """`dlx verify --json` in this process (the real command, without an interpreter's start-up)."""
    res = dlx_here("verify", "--run-dir", run_dir, "--json", *extra)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return res.returncode, json.loads(res.stdout)


def by_step(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {s["step"]: s for s in report["steps"]}


def train(root: Path, toml: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    job = root / "job.toml"
    job.write_text(toml)
    run_dir = root / "run"
    return run_dir, dlx("train", job, "--run-dir", run_dir)


def copy_run(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


def store_of(run_dir: Path) -> Blockstore:
    return Blockstore(RunRecord.load(run_dir).blocks_dir(run_dir))


def manifest_cid(run_dir: Path, step: int) -> Any:
    """The checkpoint CID of `step`, walking parents back from run.json's head."""
    store = store_of(run_dir)
    cid = parse_cid(RunRecord.load(run_dir).head)
    while (m := get_manifest(store, cid)).step != step:
        cid = m.parent
    return cid


def flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def node_keys(world: int) -> list[Any]:
    """`dlx train` on its embedded anvil: the submitter is dev account 0, slot i's node dev
    account i + 1."""
    return dev_accounts(world + 1)[1:]


def fund(ledger: Ledger, address: str) -> None:
    rpc_call(ledger.chain.rpc_url, "anvil_setBalance", [address, hex(100 * ETHER)])


def commit_args(ledger: Ledger, tx: str) -> dict[str, Any]:
    """The arguments of a `commitStep` transaction, signatures included."""
    _, args = ledger.ledger.decode_function_input(ledger.chain.w3.eth.get_transaction(tx)["input"])
    return args


def as_attestation(a: dict[str, Any]) -> Attestation:
    return Attestation(a["replica"], a["stage"], bytes(a["contribution"]), bytes(a["dataShard"]),
                       bytes(a["codeHash"]), int(a["lossMicros"]), expand_signature(a["r"], a["vs"]),
                       bytes(a["newShard"]), int(a["replicaSet"]))


def signed(claim: ContributionClaim, domain: Domain, account: Any) -> Attestation:
    return Attestation(claim.replica, claim.stage, claim.contribution, claim.data_shard,
                       claim.code_hash, claim.loss_micros, claim.sign(domain, account.key), claim.new_shard,
                       claim.replica_set)


# -- the runs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node_cheats(tmp_path_factory, small_job) -> Path:
    run_dir, res = train(tmp_path_factory.mktemp("node-cheats"), small_job("cheats", extra=NODE_CHEATS))
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def coordinator_cheats(tmp_path_factory, small_job) -> tuple[Path, subprocess.CompletedProcess[str]]:
    return train(tmp_path_factory.mktemp("coordinator-cheats"),
                 small_job("forks", stages=1, extra=COORDINATOR_CHEATS))


@pytest.fixture(scope="module")
def cosign_cheats(tmp_path_factory, small_job) -> Path:
    run_dir, res = train(tmp_path_factory.mktemp("cosign-cheats"),
                         small_job("collude", stages=1, steps=2, extra=COSIGN_CHEATS))
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir


def stopped_by_the_ledger(root: Path, small_job: Any, cheat: str) -> tuple[Path, str]:
    """A 2x1 run whose slot (1, 0) cheats from step 2, which the ledger refuses: (run dir,
    dlx train's last stderr line)."""
    run_dir, res = train(root, small_job("stopped", stages=1, steps=2,
                                         extra=f'[cheat]\nmode = "{cheat}"\nreplica = 1\nfrom_step = 2\n'))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    record = RunRecord.load(run_dir)
    assert (record.steps, record.status) == (1, "failed")
    return run_dir, res.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def honest_chain(trained_run, tmp_path_factory) -> Iterator[tuple[Ledger, RunRecord]]:
    """A live anvil on a copy of the honest run's chain state."""
    run_dir = copy_run(trained_run[0], tmp_path_factory.mktemp("honest-chain") / "run")
    record = RunRecord.load(run_dir)
    with record.open_ledger(run_dir) as ledger:
        yield ledger, record


@pytest.fixture()
def chain(honest_chain) -> Iterator[tuple[Ledger, RunRecord]]:
    """The honest run's live chain, reverted to its snapshot after each test."""
    ledger, record = honest_chain
    snapshot = rpc_call(ledger.chain.rpc_url, "evm_snapshot")
    try:
        yield ledger, record
    finally:
        assert rpc_call(ledger.chain.rpc_url, "evm_revert", [snapshot]) is True


def next_step(ledger: Ledger, run_id: int) -> tuple[int, bytes, list[ContributionClaim]]:
    """Claims for the step after the head, re-using the head step's attested fields."""
    head, n = ledger.head(run_id)
    last = ledger.steps(run_id)[-1]
    claims = [
        ContributionClaim(run_id, n + 1, a["replica"], a["stage"], head, bytes(a["contribution"]),
                          bytes(a["dataShard"]), bytes(a["codeHash"]), int(a["lossMicros"]), bytes(a["newShard"]),
                          int(a["replicaSet"]))
        for a in commit_args(ledger, last.tx)["attestations"]
    ]
    return n + 1, head, claims


def commit(ledger: Ledger, run_id: int, step: int, parent: bytes, atts: list[Attestation]) -> str:
    return ledger.commit_step(dev_accounts(1)[0], run_id=run_id, step=step, parent=parent,
                              checkpoint=hashlib.sha256(b"next checkpoint").digest(),
                              metrics_digest=hashlib.sha256(b"metrics").digest(), attestations=atts)


# -- an honest run --------------------------------------------------------------------------
# It passes every layer, replay included, bit for bit: tests/test_replay.py
# (test_an_honest_run_replays_bit_for_bit_through_dlx_verify), on the same `trained_run`.


# -- the ledger: signatures, stakes, parents ------------------------------------------------


@pytest.mark.slow
def test_a_forged_signature_is_refused_by_the_ledger(chain):
    ledger, record = chain
    run_id, keys = record.run_id, node_keys(4)
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    assert [a["node"] for a in ledger.steps(run_id)[-1].attestations] == [k.address for k in keys]
    step, parent, claims = next_step(ledger, run_id)
    honest = [signed(c, domain, k) for c, k in zip(claims, keys, strict=True)]
    # A staked, registered key that is not slot 2's node (nor a member of the run) signs for it.
    forger = dev_accounts(12)[11]
    fund(ledger, forger.address)
    ledger.registry.ensure_staked(forger, ETHER)
    forged = [*honest[:2], signed(claims[2], domain, forger), *honest[3:]]
    with pytest.raises(ChainRevertError) as err:
        commit(ledger, run_id, step, parent, forged)
    assert err.value.name == "LedgerNotMember"
    assert err.value.error_args["runId"] == run_id
    assert to_checksum_address(err.value.error_args["node"]) == forger.address
    assert ledger.head(run_id) == (parent, step - 1)
    commit(ledger, run_id, step, parent, honest)  # the control: the same step, every slot its own node
    assert ledger.head(run_id)[1] == step


@pytest.mark.slow
def test_an_unstaked_node_cannot_attest(chain):
    ledger, record = chain
    run_id, keys = record.run_id, node_keys(4)
    domain = Domain(ledger.chain.chain_id, ledger.ledger.address)
    step, parent, claims = next_step(ledger, run_id)
    atts = [signed(c, domain, k) for c, k in zip(claims, keys, strict=True)]
    quitter = keys[1]
    ledger.registry.unbond(quitter, quitter.address)  # `dlx train` nodes are their own operators
    assert ledger.registry.stake_of(quitter.address) == 0
    with pytest.raises(ChainRevertError) as err:
        commit(ledger, run_id, step, parent, atts)
    assert err.value.name == "LedgerInsufficientStake"
    assert to_checksum_address(err.value.error_args["node"]) == quitter.address
    assert err.value.error_args["stake"] == 0
    assert ledger.head(run_id) == (parent, step - 1)


@pytest.mark.slow
def test_signatures_replayed_from_another_run_ledger_or_chain_are_refused(chain):
    ledger, record = chain
    run_id, keys = record.run_id, node_keys(4)
    submitter = dev_accounts(1)[0]
    created = ledger.run_created(run_id)
    members = set(created.nodes)
    step1 = ledger.steps(run_id)[0]
    real = [as_attestation(a) for a in commit_args(ledger, step1.tx)["attestations"]]
    shape = dict(config_digest=created.config_digest, genesis_digest=created.genesis_digest,
                 nodes=list(created.nodes), replicas=2, stages=2, challenge_window=3600, min_stake=ETHER)

    def refused(lg: Ledger, rid: int, step: int, parent: bytes, atts: list[Attestation]) -> None:
        with pytest.raises(ChainRevertError) as err:
            commit(lg, rid, step, parent, atts)
        # Signed for another domain or run, a signature recovers to some unrelated address.
        assert err.value.name == "LedgerNotMember"
        assert to_checksum_address(err.value.error_args["node"]) not in members
        assert lg.head(rid)[1] == step - 1

    # Another run on the same ledger, same nodes and genesis: only runId differs.
    other_run = ledger.create_run(submitter, RunSpec(**shape))
    refused(ledger, other_run, 1, step1.parent, real)
    # Another deployment of the ledger on the same chain (same run id 1): the verifying contract differs.
    other_ledger = Ledger.deploy(ledger.chain, submitter)
    for k in keys:
        other_ledger.registry.ensure_staked(k, ETHER)
    assert other_ledger.create_run(submitter, RunSpec(**shape)) == run_id
    refused(other_ledger, run_id, 1, step1.parent, real)
    # The run's own nodes sign the next step, but for another chain id.
    step, parent, claims = next_step(ledger, run_id)
    elsewhere = Domain(1, ledger.ledger.address)
    refused(ledger, run_id, step, parent, [signed(c, elsewhere, k) for c, k in zip(claims, keys, strict=True)])


@pytest.mark.slow
def test_a_stale_parent_reverts_the_commit_and_nothing_is_half_written(coordinator_cheats):
    run_dir, res = coordinator_cheats
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("dlx: error: commitStep(run 1, step 3): reverted with LedgerStaleParent(")
    assert "Traceback" not in res.stderr
    record = RunRecord.load(run_dir)
    assert (record.steps, record.status) == (2, "failed")
    store = store_of(run_dir)
    step2 = get_manifest(store, record.head)
    assert step2.step == 2
    with record.open_ledger(run_dir) as ledger:
        assert ledger.head(record.run_id) == (digest_of(parse_cid(record.head)), 2)
        assert [s.step for s in ledger.steps(record.run_id)] == [1, 2]
    # The ledger expected step 2's checkpoint and was offered step 1's.
    assert f"expected=0x{digest_of(parse_cid(record.head)).hex()}" in last
    assert f"got=0x{digest_of(step2.parent).hex()}" in last


# -- storage: blocks and manifests ----------------------------------------------------------


@pytest.mark.slow
def test_a_tampered_checkpoint_block_fails_content_naming_the_cid(trained_run, tmp_path):
    run_dir = copy_run(trained_run[0], tmp_path / "run")
    store = store_of(run_dir)
    shard = get_manifest(store, manifest_cid(run_dir, 2)).stages[1]
    flip_byte(store._path(shard))  # a single-block file: the shard is under 256 KiB
    code, report = verify(run_dir)
    steps = by_step(report)
    assert code == 1 and steps[1]["ok"]
    assert "content" in steps[2]["failures"] and str(shard) in steps[2]["failures"]["content"]
    assert "chain" in steps[2]["passed"]
    # Step 3's own blocks are intact, but its round-start states refer to step 2's shard for
    # their weights (docs/FORMATS.md section 7): its content level fails on that block alone.
    assert str(shard) in steps[3]["failures"]["content"] and "chain" in steps[3]["passed"]


@pytest.mark.slow
def test_a_tampered_manifest_fails_content_and_a_substituted_head_is_not_the_chains(trained_run, tmp_path):
    run_dir = copy_run(trained_run[0], tmp_path / "run")
    record = RunRecord.load(run_dir)
    store = store_of(run_dir)
    # Step 2's manifest rewritten in place, claiming a better loss than was reached.
    cid = manifest_cid(run_dir, 2)
    node = dag_cbor.decode(store.get(cid))
    node["metrics"]["eval_loss"] = node["metrics"]["eval_loss"] / 2
    store._path(cid).write_bytes(dag_cbor.encode(node))
    # The head's manifest rewritten and stored under its own (new) CID, named in run.json.
    head = dag_cbor.decode(store.get(record.head))
    head["metrics"]["eval_loss"] = head["metrics"]["eval_loss"] / 2
    record.head = str(store.put(dag_cbor.encode(head), DAG_CBOR))
    record.save(run_dir)
    code, report = verify(run_dir)
    steps = by_step(report)
    assert code == 1 and steps[1]["ok"]
    failure = steps[2]["failures"]["content"]
    assert failure == f"corrupt block {cid}: content does not match its CID"
    assert "chain" in steps[2]["passed"]
    # The chain names the true head, whose own blocks are intact; its round-start states take
    # their weights from the parent's shard, found through step 2's manifest: that one block fails.
    assert steps[3]["failures"]["content"] == failure and "chain" in steps[3]["passed"]
    assert report["run_failures"] == [f"run.json head {record.head} is not the chain's head at step 3"]


# -- the coordinator: a checkpoint that is not the aggregate --------------------------------


@pytest.mark.slow
def test_a_manifest_linking_a_shard_nobody_co_signed_fails_the_chain_level(coordinator_cheats):
    run_dir, _ = coordinator_cheats
    code, report = verify(run_dir)
    steps = by_step(report)
    assert code == 1 and sorted(steps) == [1, 2]
    assert steps[1]["ok"]
    shard = get_manifest(store_of(run_dir), manifest_cid(run_dir, 2)).stages[0]
    record = RunRecord.load(run_dir)
    with record.open_ledger(run_dir) as ledger:
        (cosigned,) = ledger.steps(record.run_id)[1].shards(1)  # what both replicas computed
    assert digest_of(shard) != cosigned
    assert steps[2]["failures"]["chain"] == (
        f"stage 0: the manifest links shard {shard}, not the one its replicas co-signed (0x{cosigned.hex()[:16]}..)")
    assert "content" in steps[2]["passed"]  # every node signed what it sent
    assert steps[2]["failures"]["aggregate"] == f"stage 0: recomputed shard differs from {shard}"


# -- replicas: independent witnesses who co-sign the aggregate ----------------------------


@pytest.mark.slow
def test_one_node_signing_slots_of_two_replicas_is_refused_by_the_ledger(tmp_path, small_job):
    run_dir, last = stopped_by_the_ledger(tmp_path, small_job, "shared_key")
    node = node_keys(2)[0]  # slot (0, 0)'s key also signed slot (1, 0)
    assert last == (f"dlx: error: commitStep(run 1, step 2): reverted with LedgerNotIndependent("
                    f"node={node.address.lower()}, replicaA=0, replicaB=1)")
    code, report = verify(run_dir)
    assert code == 0 and [s["step"] for s in report["steps"]] == [1]  # the chain holds step 1 only


@pytest.mark.slow
def test_a_replica_co_signing_another_shard_than_its_peer_is_refused_by_the_ledger(tmp_path, small_job):
    run_dir, last = stopped_by_the_ledger(tmp_path, small_job, "wrong_shard")
    assert last.startswith("dlx: error: commitStep(run 1, step 2): reverted with LedgerShardMismatch("
                           "stage=0, replica=1, expected=0x")
    record = RunRecord.load(run_dir)
    with record.open_ledger(run_dir) as ledger:
        assert ledger.head(record.run_id)[1] == 1


@pytest.mark.slow
def test_replicas_colluding_on_a_wrong_shard_fail_the_aggregate_and_are_all_slashed(cosign_cheats):
    run_dir = cosign_cheats
    code, report = verify(run_dir)
    steps = by_step(report)
    assert code == 1 and steps[1]["ok"]
    # The manifest links what both replicas co-signed: only recomputing the outer step shows it.
    assert {"chain", "content"} <= set(steps[2]["passed"]) and list(steps[2]["failures"]) == ["aggregate"]
    shard = get_manifest(store_of(run_dir), manifest_cid(run_dir, 2)).stages[0]
    assert steps[2]["failures"]["aggregate"] == f"stage 0: recomputed shard differs from {shard}"
    record = RunRecord.load(run_dir)
    nodes = node_keys(2)
    verifier = dev_accounts(10)[9]
    with record.open_ledger(run_dir) as ledger:
        fund(ledger, verifier.address)
        ledger.registry.ensure_staked(verifier, ETHER)
        stakes = [ledger.registry.stake_of(n.address) for n in nodes]
        assert min(stakes) >= ETHER
        challenge, _ = ledger.open_aggregate_challenge(verifier, run_id=record.run_id, step=2, stage=0, bond=ETHER,
                                                       evidence=hashlib.sha256(b"level 3 report").digest())
        assert ledger.co_signers_of(challenge) == [n.address for n in nodes]
        # The arbiters recompute level 3 themselves, as the verifier did, and uphold it.
        signatures = [sign_verdict(ledger.chain.chain_id, ledger.ledger.address, challenge, True, a.key)
                      for a in sorted(ARBITERS[:2], key=lambda a: int(a.address, 16))]
        done = ledger.resolve_with(verifier, challenge_id=challenge, upheld=True, signatures=signatures)
        assert sorted(done.slashed_nodes) == sorted(n.address for n in nodes)
        assert done.slashed == sum(stakes) and done.rejected_steps == [2]
        assert [ledger.registry.stake_of(n.address) for n in nodes] == [0, 0]
        assert ledger.head(record.run_id)[1] == 1


def key_env(**keys: Any) -> dict[str, str]:
    """The environment of a `dlx` command signing with `keys` (role -> account)."""
    return {**os.environ, **{f"DLX_{role.upper()}_KEY": "0x" + bytes(acct.key).hex() for role, acct in keys.items()}}


@pytest.mark.slow
def test_the_challenge_path_for_a_wrong_co_signed_shard_through_the_cli(cosign_cheats, tmp_path):
    """`dlx challenge-aggregate`, arbiters' `dlx arbiter vote --recompute`, `dlx arbiter resolve`."""
    run_dir = copy_run(cosign_cheats, tmp_path / "run")
    record = RunRecord.load(run_dir)
    verifier = dev_accounts(10)[9]
    with record.open_ledger(run_dir, writable=True) as ledger:  # kept in the run's chain
        fund(ledger, verifier.address)
        ledger.registry.ensure_staked(verifier, ETHER)
    env = key_env(node=verifier)
    res = dlx("challenge-aggregate", 1, "--stage", 0, "--run-dir", run_dir, env=env)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == (
        "dlx: error: step 1: the recomputed outer step gives every committed shard; nothing to challenge")
    res = dlx("challenge-aggregate", 2, "--stage", 0, "--run-dir", run_dir, "--json", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    done = json.loads(res.stdout)
    nodes = node_keys(2)
    assert done["co_signers"] == [n.address for n in nodes] and done["stage"] == 0
    assert done["failure"].startswith("stage 0: recomputed shard differs from ")
    challenge = str(done["challenge"])
    first, second = sorted(ARBITERS[:2], key=lambda a: int(a.address, 16))
    # The three votes only read the run and its chain: at once.
    res, *upholds = dlx_at_once(
        [("arbiter", "vote", challenge, "--dismiss", "--recompute", "--run-dir", run_dir)]
        + [("arbiter", "vote", challenge, "--uphold", "--recompute", "--run-dir", run_dir)] * 2,
        [key_env(arbiter=first), key_env(arbiter=first), key_env(arbiter=second)])
    assert res.returncode == 2 and "the recomputed outer step contradicts dismissing" in res.stderr, res.stderr
    sigs = []
    for res in upholds:
        assert res.returncode == 0, res.stderr[-2000:]
        sigs.append(res.stdout.strip())
    res = dlx("arbiter", "resolve", challenge, "--uphold", *sigs, "--run-dir", run_dir, "--json", env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["upheld"] and out["rejected_steps"] == [2] and out["head_step"] == 1
    with record.open_ledger(run_dir) as ledger:
        assert [ledger.registry.stake_of(n.address) for n in nodes] == [0, 0]
        assert sorted(log["args"]["node"] for log in ledger.registry.contract.events.Slashed().get_logs(from_block=0)) == \
            sorted(n.address for n in nodes)


@pytest.mark.slow
def test_a_result_equivocation_is_slashed_from_its_two_signed_claims(cosign_cheats, tmp_path):
    record = RunRecord.load(cosign_cheats)
    paths = [cosign_cheats / "equivocation" / f"step-2-{x}.json" for x in "ab"]
    a, b = (SignedClaim.load(p) for p in paths)
    node = node_keys(2)[1]  # slot (1, 0)
    assert a.recover() == b.recover() == node.address
    assert a.claim.contribution == b.claim.contribution and a.claim.new_shard != b.claim.new_shard
    reporter = dev_accounts(10)[5]
    env = {**os.environ, "DLX_REPORTER_KEY": "0x" + bytes(reporter.key).hex()}
    with record.open_ledger(cosign_cheats) as ledger:
        (rec,) = [s for s in ledger.steps(record.run_id) if s.step == 2]
        assert rec.shards(1) == [a.claim.new_shard]  # claim a is the committed one
        stake = ledger.registry.stake_of(node.address)
        fund(ledger, reporter.address)
        url = ledger.chain.rpc_url
        res = dlx("slash-equivocation", *paths, "--rpc", url, env=env, cwd=tmp_path, timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"slashed {node.address}: ") and "stage 0's new shard" in res.stdout
        assert ledger.registry.stake_of(node.address) == 0 and stake >= ETHER
        (log,) = ledger.ledger.events.ResultEquivocationSlashed().get_logs(
            from_block=0, argument_filters={"runId": record.run_id})
        assert (log["args"]["node"], log["args"]["stage"], log["args"]["step"]) == (node.address, 0, 2)
        assert (bytes(log["args"]["shardA"]), bytes(log["args"]["shardB"])) == (a.claim.new_shard, b.claim.new_shard)
        again = dlx("slash-equivocation", *paths, "--rpc", url, env=env, cwd=tmp_path, timeout=120)
        assert again.returncode == 2 and "LedgerAlreadySlashed" in again.stderr.strip().splitlines()[-1]


# -- nodes: poisoned contributions and skipped work, caught by replay only ------------------


@pytest.mark.slow
def test_a_poisoned_contribution_and_skipped_work_pass_levels_1_to_3_and_fail_replay(node_cheats):
    # The cheat is not in the run's recorded configuration: a replay runs the honest code.
    record = RunRecord.load(node_cheats)
    assert "cheat" not in dag_cbor.decode(store_of(node_cheats).get(record.config))["job"]
    code, report = verify(node_cheats, "--replay", "1.0")
    steps = by_step(report)
    assert code == 1 and sorted(steps) == [1, 2, 3]
    for n in (1, 2, 3):  # every node signed what it sent, and the aggregate is what they sent
        assert steps[n]["passed"][:3] == ["chain", "content", "aggregate"], steps[n]
    assert steps[1]["ok"]

    def stages(step: int, replica: int) -> list[tuple[bool, float | None]]:
        (rr,) = [r for r in report["replay"] if (r["step"], r["replica"]) == (step, replica)]
        return [(st["exact"], st["rel_l2"]) for st in rr["stages"]]

    assert stages(1, 0) == stages(1, 1) == [(True, 0.0), (True, 0.0)]
    # Step 2: only replica 1 stage 1 (poisoned) differs; noise of the delta's own size.
    assert stages(2, 0) == [(True, 0.0), (True, 0.0)]
    assert stages(2, 1)[0] == (True, 0.0)
    exact, rel = stages(2, 1)[1]
    assert not exact and rel is not None and 0.3 < rel < 1.5
    assert steps[2]["failures"]["replay"].startswith("step 2 replica 1 stage 1: replayed contribution ")
    # Step 3: replica 0 claimed a round it never trained (a zero delta: rel_l2 has no finite value).
    assert all(not exact and (rel is None or rel > 0.9) for exact, rel in stages(3, 0))
    assert not stages(3, 1)[1][0]
    assert steps[3]["failures"]["replay"].startswith("step 3 replica 0 stage 0: ")
    assert "step 3 replica 1 stage 1: " in steps[3]["failures"]["replay"]


# -- nodes: equivocation, slashed at once ---------------------------------------------------


@pytest.mark.slow
def test_an_equivocating_node_is_slashed_from_its_two_signed_claims(node_cheats, tmp_path):
    record = RunRecord.load(node_cheats)
    paths = [node_cheats / "equivocation" / f"step-2-{x}.json" for x in "ab"]
    a, b = (SignedClaim.load(p) for p in paths)
    node = node_keys(4)[0 * 2 + 1]  # slot (0, 1)
    assert a.recover() == b.recover() == node.address
    assert (a.claim.run_id, a.claim.step, a.claim.replica, a.claim.stage) == (record.run_id, 2, 0, 1)
    assert a.claim.contribution != b.claim.contribution and a.claim.parent == b.claim.parent
    assert a.domain == b.domain and a.domain.chain_id == ANVIL_CHAIN_ID
    reporter = dev_accounts(10)[9]
    env = {**os.environ, "DLX_REPORTER_KEY": "0x" + bytes(reporter.key).hex()}
    with record.open_ledger(node_cheats) as ledger:  # a live copy of the run's chain
        (rec,) = [s for s in ledger.steps(record.run_id) if s.step == 2]
        (event,) = [x for x in rec.attestations if (x["replica"], x["stage"]) == (0, 1)]
        assert bytes(event["contribution"]) == a.claim.contribution  # claim a is the committed one
        stake = ledger.registry.stake_of(node.address)
        assert stake >= ETHER
        fund(ledger, reporter.address)
        url = ledger.chain.rpc_url
        res = dlx("slash-equivocation", *paths, "--rpc", url, env=env, cwd=tmp_path, timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(f"slashed {node.address}: ")
        assert ledger.registry.stake_of(node.address) == 0
        (log,) = ledger.ledger.events.EquivocationSlashed().get_logs(
            from_block=0, argument_filters={"runId": record.run_id})
        assert {k: log["args"][k] for k in ("step", "node", "replica", "stage", "reporter")} == {
            "step": 2, "node": node.address, "replica": 0, "stage": 1, "reporter": reporter.address}
        assert bytes(log["args"]["contributionA"]) == a.claim.contribution
        assert bytes(log["args"]["contributionB"]) == b.claim.contribution
        (slash,) = ledger.registry.contract.events.Slashed().get_logs(from_block=0, argument_filters={"node": node.address})
        assert slash["args"]["amount"] == stake
        again = dlx("slash-equivocation", *paths, "--rpc", url, env=env, cwd=tmp_path, timeout=120)
        assert again.returncode == 2 and "LedgerAlreadySlashed" in again.stderr.strip().splitlines()[-1]


# -- the cheat option itself: off by default, local chains only ----------------------------


def _job(small_job, extra: str = "", **kw: Any) -> CheatingJobFile:
    return load_job(tomllib.loads(small_job("job", **kw, extra=extra)), CheatingJobFile)


def test_an_honest_job_dumps_as_before_and_cheats_are_validated(small_job):
    honest = _job(small_job)
    assert honest.cheat == [] and "cheat" not in honest.model_dump() and b"cheat" not in honest.canonical_json()
    one = _job(small_job, '[cheat]\nmode = "poison"\nreplica = 1\n')
    assert [(c.mode, c.replica, c.stage, c.from_step) for c in one.cheat] == [("poison", 1, 0, 1)]
    for extra, message in [
        ('[cheat]\nmode = "poison"\nstrength = 3\n', "cheat.0.strength: unknown key"),
        ('[cheat]\nmode = "lie"\n', "cheat.0.mode: Input should be"),
        ('[cheat]\nmode = "poison"\nreplica = 2\n', "cheat: slot (2, 0) is outside the 2 x 2 world"),
        ('[cheat]\nmode = "stale_parent"\n', "cheat: stale_parent needs from_step >= 2"),
        ('[cheat]\nmode = "poison"\nfrom_step = 4\n', "cheat: from_step (4) is past outer.steps (3)"),
    ]:
        with pytest.raises(ConfigError) as err:
            _job(small_job, extra)
        assert str(err.value).startswith(message)


@pytest.fixture(scope="module")
def other_anvil() -> Iterator[str]:
    """An anvil on loopback whose chain id is not anvil's default 31337."""
    port = free_port()
    proc = subprocess.Popen([str(tool_path("anvil")), "--host", "127.0.0.1", "--port", str(port),
                             "--chain-id", "1337", "--silent"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                rpc_call(url, "eth_chainId", timeout=0.5)
                break
            except Exception:
                assert proc.poll() is None, "anvil exited at start"
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_cheat_is_refused_off_a_local_chain_before_anything_starts(small_job, other_anvil, anvil, tmp_path):
    cheat = '[cheat]\nmode = "poison"\n'
    job_file = tmp_path / "job.toml"
    job_file.write_text(small_job("job", extra=cheat))
    run_dir = tmp_path / "run"
    res = dlx("train", job_file, "--run-dir", run_dir, "--rpc", other_anvil, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"dlx: error: cheat: refused on {other_anvil}: cheating nodes run only on a local chain "
        f"(the embedded anvil, or chain id {ANVIL_CHAIN_ID} on a loopback host)")
    assert not run_dir.exists()
    job = _job(small_job, cheat)
    for rpc in ("http://10.11.12.13:8545", "https://rpc.example.org", "http://[::2]:8545"):
        with pytest.raises(ConfigError, match=f"^cheat: refused on {re.escape(rpc)}:"):
            refuse_cheat_off_local_chain(job, rpc, ANVIL_CHAIN_ID)  # even claiming anvil's chain id
    refuse_cheat_off_local_chain(job, None)  # the embedded anvil
    refuse_cheat_off_local_chain(job, anvil.url)  # chain id 31337 on 127.0.0.1
    refuse_cheat_off_local_chain(_job(small_job), "http://10.11.12.13:8545")  # an honest job anywhere
    # The job queue: the same rule, and no equivocation (each node signs in its own worker).
    with pytest.raises(ConfigError, match="refused on http://10.11.12.13"):
        refuse_cheat_off_local_chain(job, "http://10.11.12.13:8545", ANVIL_CHAIN_ID, queue=True)
    for mode in ("equivocate", "equivocate_result", "shared_key"):
        with pytest.raises(ConfigError, match=f"'{mode}' runs only under `dlx train`"):
            refuse_cheat_off_local_chain(_job(small_job, f'[cheat]\nmode = "{mode}"\n'), anvil.url, queue=True)
    # `dlx submit` refuses such a job before it touches the stack's Redis (which is not even
    # running here): one line, exit code 2, nothing queued.
    from workers.queue.stack import Stack

    stack_dir = tmp_path / "stack"
    stack_dir.mkdir()
    Stack(dir=str(stack_dir), redis_url="redis://127.0.0.1:1/0", redis_pid=0, rpc="http://10.11.12.13:8545",
          anvil_pid=0, chain_id=ANVIL_CHAIN_ID, registry="0x" + "11" * 20, ledger="0x" + "22" * 20).save()
    job_file = tmp_path / "cheat.toml"
    job_file.write_text(small_job("cheat", extra=cheat))
    res = dlx("submit", job_file, "--stack", stack_dir, timeout=120)
    assert res.returncode == 2 and res.stderr.strip() == (
        "dlx: error: cheat: refused on http://10.11.12.13:8545: cheating nodes run only on a local chain "
        f"(the embedded anvil, or chain id {ANVIL_CHAIN_ID} on a loopback host)"), res.stderr

