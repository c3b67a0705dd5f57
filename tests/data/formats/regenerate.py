"""Regenerate docs/FORMATS.md's example run and its worked examples (tests/data/formats/).

    .venv/bin/python tests/data/formats/regenerate.py

Trains `job.toml` (2 replicas x 2 stages, `min_replicas = 1`) in /tmp/fmt, its dataset
copied to /tmp/fmt/dataset (the `[data] dir` it names), on an embedded anvil whose state
is the run's `chain/state.json`, with `dlx train`'s keys, ledger deployment and sink
(`workers.run.sink.LedgerSink`). Its second step is committed over replica 1 alone, as an
elastic run commits a step that replica 0 dropped out of: replica 1's real contributions,
and the outer step recomputed over exactly those with `trainer.diloco.apply_outer_step`,
which replica 1 co-signs. Then it copies the blocks the examples use, writes chain.json
(what the chain recorded for step 2: the events, the `commitStep` call, the step record)
and run.json beside this file, and rewrites every `json example:NAME` block of
docs/FORMATS.md that depends on the run, computed with tests/test_formats.py's own rules.
Run tests/test_formats.py afterwards: it recomputes every example from the fixtures.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORK = Path("/tmp/fmt")
PARTIAL_STEP, PRESENT = 2, (1,)
sys.path.insert(0, str(ROOT))

from lineage.chain.anvil import Anvil, dev_accounts  # noqa: E402
from lineage.chain.client import Chain  # noqa: E402
from lineage.chain.ledger import Ledger  # noqa: E402
from lineage.chain.runrecord import RunRecord  # noqa: E402
from lineage.store.datasets import prepare_dataset  # noqa: E402
from lineage.store.manifest import get_manifest  # noqa: E402
from lineage.store.runconfig import RunConfig  # noqa: E402
from trainer.artifacts import StageShard, code_hash  # noqa: E402
from trainer.diloco import apply_outer_step  # noqa: E402
from trainer.launch import train_local  # noqa: E402
from workers.run.jobfile import load_job_file  # noqa: E402
from workers.run.sink import LedgerSink  # noqa: E402


def _rules() -> Any:
    """tests/test_formats.py as a module: the documented rules, written independently."""
    spec = importlib.util.spec_from_file_location("formats_rules", ROOT / "tests" / "test_formats.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recorder:
    """A StepSink keeping what the ranks report (they co-sign with the ledger's digest)."""

    shard_digest = staticmethod(LedgerSink.shard_digest)

    def __init__(self) -> None:
        self.genesis: Any = None
        self.steps: list[Any] = []

    def on_genesis(self, genesis: Any) -> None:
        self.genesis = genesis

    def on_step(self, step: Any) -> None:
        self.steps.append(step)

    def on_progress(self, progress: Any) -> None:
        pass


def partial(step: Any, parent_shards: list[bytes], outer: Any, stages: int) -> Any:
    """`step` as an elastic run reports it when only PRESENT finished the round."""
    contributions = [c for c in step.contributions if c.replica in PRESENT]
    shards = [StageShard(s, apply_outer_step(parent_shards[s], [c.data for c in contributions if c.stage == s], outer))
              for s in range(stages)]
    contributions = [dataclasses.replace(c, new_shard=LedgerSink.shard_digest(shards[c.stage].data))
                     for c in contributions]
    losses = [c.loss for c in contributions if c.stage == stages - 1]
    return dataclasses.replace(step, stages=shards, contributions=contributions, replicas=PRESENT,
                               metrics={**step.metrics, "train_loss": sum(losses) / len(losses)})


def train(run_dir: Path) -> tuple[Ledger, LedgerSink, Anvil]:
    """The run, committed; returns its ledger, sink and (still running) anvil."""
    job = load_job_file(WORK / "job.toml")
    anvil = Anvil(state_path=run_dir / "chain" / "state.json", accounts=job.world_size + 1)
    anvil.__enter__()
    chain = Chain(anvil.url, job.chain.chain_id)
    accounts = dev_accounts(job.world_size + 1)
    submitter, slot_keys = accounts[0], accounts[1:]
    ledger = Ledger.deploy(chain, submitter)
    for node in slot_keys:
        ledger.registry.ensure_staked(node, job.chain.stake_wei)
    record = RunRecord(name=job.name, chain_id=chain.chain_id, rpc=None, chain_state="chain/state.json",
                       registry=ledger.addresses["registry"], ledger=ledger.addresses["ledger"], blocks="blocks",
                       job_dir=str(WORK))
    store = record.open_store(run_dir)
    data, prepared = prepare_dataset(job.data, job.model.vocab_size, store.put)
    training = job.training_config().with_prepared(prepared)
    sink = LedgerSink(job=training, config=RunConfig.of_job(job, code_hash(), data).to_doc(), store=store,
                      ledger=ledger, submitter=submitter, record=record, run_dir=run_dir,
                      challenge_window=job.chain.challenge_window_s, min_stake=job.chain.min_stake_wei,
                      arbiters=job.chain.arbiters, quorum=job.chain.quorum, slot_keys=slot_keys)
    recorder = Recorder()
    train_local(training, recorder)
    sink.on_genesis(recorder.genesis)
    shards = [s.data for s in recorder.genesis.stages]
    for step in recorder.steps:
        if step.step == PARTIAL_STEP:
            step = partial(step, shards, training.outer, training.parallel.stages)
        sink.on_step(step)
        shards = [s.data for s in step.stages]
    record.status = "completed"
    record.save(run_dir)
    return ledger, sink, anvil


def _plain(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def chain_record(ledger: Ledger, run_id: int) -> dict[str, Any]:
    """What the chain recorded, in chain.json's shape."""
    w3 = ledger.chain.w3
    (record,) = [r for r in ledger.steps(run_id) if r.step == PARTIAL_STEP]
    _, call = ledger.ledger.decode_function_input(w3.eth.get_transaction(record.tx)["input"])
    receipt = w3.eth.get_transaction_receipt(record.tx)
    created = ledger.run_created(run_id)
    committed = ledger.ledger.events.StepCommitted().process_receipt(receipt)[0]["args"]
    info = ledger.step_info(run_id, PARTIAL_STEP)
    return {
        "chainId": ledger.chain.chain_id,
        "ledger": ledger.ledger.address,
        "eip712Domain": _plain(list(ledger.ledger.functions.eip712Domain().call())),
        "contributionTypehash": _plain(ledger.ledger.functions.CONTRIBUTION_TYPEHASH().call()),
        "runCreated": _plain({"runId": created.run_id, "creator": created.creator,
                              "configDigest": created.config_digest, "genesisDigest": created.genesis_digest,
                              "replicas": created.replicas, "stages": created.stages,
                              "minReplicas": created.min_replicas, "nodes": list(created.nodes),
                              "independence": created.independence}),
        "stepCommitted": _plain({
            "step": committed["step"], "checkpoint": committed["checkpoint"], "parent": committed["parent"],
            "contributions_root": committed["contributionsRoot"], "metrics_digest": committed["metricsDigest"],
            "submitter": committed["submitter"], "shards_root": committed["shardsRoot"],
            "replica_set": committed["replicaSet"], "runId": committed["runId"]}),
        "commitStepCall": _plain({**{k: call[k] for k in ("runId", "step", "parent", "checkpoint",
                                                          "contributionsRoot", "metricsDigest", "replicaSet")},
                                  "attestations": [{k: a[k] for k in ("replica", "stage", "replicaSet",
                                                                       "contribution", "dataShard", "codeHash",
                                                                       "lossMicros", "newShard", "r", "vs")}
                                                   for a in call["attestations"]]}),
        "stepInfo": _plain({"checkpoint": info.checkpoint, "witnessHash": info.witness_hash,
                            "committedAt": info.committed_at, "epoch": info.epoch,
                            "openChallenges": info.open_challenges, "rejected": info.rejected}),
        "logs": [{"address": log["address"], "topics": [t.to_0x_hex() for t in log["topics"]],
                  "data": log["data"].to_0x_hex()} for log in receipt["logs"][:2]],
    }


def cid_of(link: Any) -> str:
    return str(link) if link.version == 0 else link.encode("base32")


def copy_blocks(run_dir: Path, names: set[str]) -> None:
    out = HERE / "blocks"
    shutil.rmtree(out, ignore_errors=True)
    for name in sorted(names):
        src = run_dir / "blocks" / name[-3:-1] / name
        (out / name[-3:-1]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out / name[-3:-1] / name)
    (out / ".pins").mkdir()
    for pin in (run_dir / "blocks" / ".pins").iterdir():
        shutil.copyfile(pin, out / ".pins" / pin.name)


def examples(rules: Any, run_dir: Path, chain: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """Every example that depends on the run, recomputed from its blocks and chain.json."""
    run = json.loads((run_dir / "run.json").read_text())
    block = rules.block
    head = run["head"]
    m2 = json.loads(json.dumps(rules.dag_json(rules.dag_cbor.decode(block(head)))))
    m1_cid = m2["parent"]["/"]
    m1 = rules.dag_cbor.decode(block(m1_cid))
    shard = m2["stages"][1]["/"]
    data = rules.file_bytes(shard)
    names, tensors = rules.safetensors(data)
    S = len(m2["stages"])
    row = 0  # replica 1's row: the step's only replica
    contribution = m2["contributions"][row][1]["/"]
    _, ctensors = rules.safetensors(rules.file_bytes(contribution))
    call = chain["commitStepCall"]
    slot = row * S + 1
    att = call["attestations"][slot]
    message = {"runId": call["runId"], "step": call["step"], "replica": att["replica"], "stage": att["stage"],
               "replicaSet": att["replicaSet"], "parent": call["parent"], "contribution": att["contribution"],
               "dataShard": att["dataShard"], "codeHash": att["codeHash"], "lossMicros": att["lossMicros"],
               "newShard": att["newShard"]}
    _, name, version, chain_id, contract, *_ = chain["eip712Domain"]
    sep = rules.domain_separator(name, version, chain_id, contract)
    sh = rules.struct_hash(message)
    digest32 = rules.keccak(b"\x19\x01" + sep + sh)
    w = int(att["vs"], 16)
    signers = [chain["runCreated"]["nodes"][PRESENT[p // S] * S + p % S] for p in range(len(call["attestations"]))]
    signers_hash = rules.keccak(b"".join(rules.word(int(a, 16)) for a in signers))
    shards_root = rules.keccak(b"".join(rules.unhex(a["newShard"]) for a in call["attestations"][:S]))
    logs = chain["logs"]

    def words(log: dict[str, Any]) -> list[str]:
        raw = rules.unhex(log["data"])
        return ["0x" + raw[i:i + 32].hex() for i in range(0, len(raw), 32)]

    metrics = rules.dag_cbor.encode(rules.dag_cbor.decode(block(head))["metrics"])
    config_cid = m2["config"]["/"]
    return {
        "cid": {"cid": shard, "size": len(data), "sha256": rules.hashlib.sha256(data).hexdigest(),
                "binary": rules.cid_binary(shard).hex(), "path": rules.block_path(shard)},
        "pin": {"name": old["pin"]["name"], "lines": [head]},
        "genesis": {"cid": run["genesis"], "node": rules.dag_json(rules.dag_cbor.decode(block(run["genesis"])))},
        "manifest": {"cid": head, "node": m2},
        "config": {"cid": config_cid, "node": rules.dag_json(rules.dag_cbor.decode(block(config_cid)))},
        "metrics-digest": {"dag-cbor": metrics.hex(), "metricsDigest": "0x" + rules.hashlib.sha256(metrics).hexdigest()},
        "shard": {"cid": shard, "stage": 1, "header_bytes": rules.struct.unpack("<Q", data[:8])[0],
                  "first_keys": names[:2], "shapes": {k: list(tensors[k].shape) for k in old["shard"]["shapes"]},
                  "newShard": "0x" + rules.hashlib.sha256(data).hexdigest()},
        "contribution": {"cid": contribution, "replica": PRESENT[row], "stage": 1,
                         "meta": {k: ctensors[k].tolist() for k in old["contribution"]["meta"]},
                         "shapes": {k: list(ctensors[k].shape) for k in old["contribution"]["shapes"]},
                         "digest": rules.digest(contribution)},
        "aggregate": {"parent_shard": cid_of(m1["stages"][1]),
                      "contributions": [r[1]["/"] for r in m2["contributions"]],
                      "lr": old["aggregate"]["lr"], "momentum": old["aggregate"]["momentum"], "new_shard": shard},
        "roots": {"replicaSet": call["replicaSet"], "contributions": [a["contribution"] for a in call["attestations"]],
                  "contributionsRoot": call["contributionsRoot"],
                  "newShards": [a["newShard"] for a in call["attestations"][:S]],
                  "shardsRoot": "0x" + shards_root.hex(), "signers": signers,
                  "signersHash": "0x" + signers_hash.hex(),
                  "witnessHash": "0x" + rules.keccak(signers_hash + shards_root
                                                     + rules.word(call["replicaSet"]))[:20].hex()},
        "eip712": {"slot": slot, "domain": {"name": name, "version": version, "chainId": chain_id,
                                            "verifyingContract": contract},
                   "domainTypehash": "0x" + rules.keccak(rules.DOMAIN_TYPE).hex(),
                   "domainSeparator": "0x" + sep.hex(),
                   "contributionTypehash": "0x" + rules.keccak(rules.CONTRIBUTION_TYPE).hex(),
                   "message": message, "structHash": "0x" + sh.hex(), "digest": "0x" + digest32.hex(),
                   "r": att["r"], "vs": att["vs"], "s": hex(w & ((1 << 255) - 1)), "v": 27 + (w >> 255),
                   "signer": rules.recover(digest32, rules.unhex(att["r"]), rules.unhex(att["vs"]))},
        "events": {
            "StepCommitted": {"signature": "StepCommitted(uint256,uint64,bytes32,bytes32,bytes32,bytes32,address,"
                                           "bytes32,uint256)",
                              "topic0": logs[0]["topics"][0], "topics": logs[0]["topics"][1:], "data": words(logs[0])},
            "ContributionAttested": {"signature": old["events"]["ContributionAttested"]["signature"],
                                     "topic0": logs[1]["topics"][0], "topics": logs[1]["topics"][1:],
                                     "data": words(logs[1])},
        },
        "run-record": run,
    }


def rewrite_doc(new: dict[str, Any]) -> None:
    doc = ROOT / "docs" / "FORMATS.md"
    text = doc.read_text()
    for name, value in new.items():
        pattern = re.compile(rf"^```json example:{re.escape(name)}\n.*?^```$", flags=re.S | re.M)
        body = f"```json example:{name}\n{json.dumps(value, indent=2)}\n```"
        text, n = pattern.subn(lambda _m, body=body: body, text)
        assert n == 1, f"example {name} is not in the document exactly once"
    doc.write_text(text)


def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    shutil.copytree(HERE / "dataset", WORK / "dataset")
    shutil.copyfile(HERE / "job.toml", WORK / "job.toml")
    run_dir = WORK / "run"
    run_dir.mkdir()
    ledger, sink, anvil = train(run_dir)
    try:
        chain = chain_record(ledger, sink.record.run_id)
    finally:
        anvil.__exit__(None, None, None)
    (HERE / "chain.json").write_text(json.dumps(chain, indent=2) + "\n")
    shutil.copyfile(run_dir / "run.json", HERE / "run.json")
    head = get_manifest(sink.store, sink.record.head)
    step1 = get_manifest(sink.store, head.parent)
    rules = _rules()
    old = rules.examples()
    names = {str(sink.record.head), str(head.parent), str(step1.parent), str(head.config),
             cid_of(head.stages[1]), cid_of(step1.stages[1]), *(cid_of(row[1]) for row in head.contributions),
             *old["dataset-dir"]["blocks"]}  # the dataset's directory blocks (its files are not needed)
    copy_blocks(run_dir, names)
    rewrite_doc(examples(rules, run_dir, chain, old))
    print(f"regenerated: head {sink.record.head}; now run .venv/bin/pytest tests/test_formats.py -q")


if __name__ == "__main__":
    main()
