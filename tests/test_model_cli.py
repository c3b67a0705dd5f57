"""`dlx export` and `dlx generate` on a real trained run (a tiny Qwen2-style llama, one
replica x two pipeline stages, so the stage shards are merged): the export loads in
transformers with the head checkpoint's logits, generation is reproducible, and every
user error is one line, exit 2, with nothing written."""

from __future__ import annotations

import codecs
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # trains once and runs `dlx` in subprocesses

DLX = str(Path(sys.executable).parent / "dlx")
JOB = """
name = "hf-cli"
seed = 7

[model]
family = "llama"
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
qkv_bias = true
seq_len = 32

[parallel]
replicas = 1
stages = 2
microbatches = 2

[data]
max_bytes = 100000
batch_size = 4
eval_batches = 1

[inner]
lr = 3e-3
warmup = 1

[outer]
steps = 2
inner_steps = 2
"""


def dlx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One `dlx train` of the job above (about 10 s) and its run.json."""
    root = tmp_path_factory.mktemp("model-cli")
    (root / "job.toml").write_text(JOB)
    run_dir = root / "run"
    res = subprocess.run([DLX, "train", str(root / "job.toml"), "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return run_dir, json.loads((run_dir / "run.json").read_text())


def _ours(run_dir: Path, step: int | None = None):
    """The checkpoint's model, loaded in this process the way the commands load it."""
    from trainer.hf import load_params
    from trainer.model import build_model
    from workers.cli.model import load_checkpoint

    cp = load_checkpoint(None, run_dir, step)
    model = build_model(cp.job.model, cp.job.seed)
    load_params(model, cp.params)
    return cp, model.eval()


def test_export_loads_in_transformers_with_the_head_checkpoints_logits(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    run_dir, record = run
    out = tmp_path / "hf"
    res = dlx("export", "--run-dir", str(run_dir), "-o", str(out))
    assert res.returncode == 0, res.stderr
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage == {"tokenizer": "bytes", "run": record["run_id"], "name": "hf-cli", "step": 2,
                       "checkpoint": record["head"], "parent": lineage["parent"], "config": record["config"],
                       "ledger": record["ledger"], "chain_id": record["chain_id"], "data": lineage["data"]}
    assert lineage["data"]["tokenizer"] == "bytes" and lineage["data"]["tokens"].startswith("baf")
    assert not (out / "tokenizer.json").exists()  # a byte vocabulary needs no tokenizer files
    cp, ours = _ours(run_dir)
    assert str(cp.cid) == record["head"] and len(cp.manifest.stages) == 2
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)).abs().max().item() <= 1e-5


def test_export_of_an_earlier_step_and_by_cid(run, tmp_path):
    run_dir, record = run
    res = dlx("export", "--run-dir", str(run_dir), "--step", "1", "-o", str(tmp_path / "one"))
    assert res.returncode == 0, res.stderr
    one = json.loads((tmp_path / "one" / "lineage.json").read_text())
    res = dlx("export", record["head"], "--store", str(run_dir / "blocks"), "-o", str(tmp_path / "head"))
    assert res.returncode == 0, res.stderr
    head = json.loads((tmp_path / "head" / "lineage.json").read_text())
    assert one["step"] == 1 and one["checkpoint"] == head["parent"]
    assert head["run"] == record["run_id"] and head["ledger"] is None  # no run.json: no ledger known


def test_generate_is_reproducible_and_streams_the_models_bytes(run):
    run_dir, record = run
    args = ["generate", "--run-dir", str(run_dir), "--prompt", "def main(", "--max-new-tokens", "40"]
    sampled = [dlx(*args, "--seed", "3") for _ in range(2)]
    greedy = [dlx(*args, "--temperature", "0"),  # the head twice: by run directory, then by CID
              dlx("generate", record["head"], "--store", str(run_dir / "blocks"), *args[3:], "--temperature", "0")]
    for res in (*sampled, *greedy):
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith("def main(")
    assert sampled[0].stdout == sampled[1].stdout
    assert greedy[0].stdout == greedy[1].stdout
    from trainer.generate import generate

    _, model = _ours(run_dir)
    tokens = generate(model, list(b"def main("), 40, temperature=0)
    text = codecs.decode(bytes(tokens), "utf-8", errors="replace")  # what streaming must add up to
    assert greedy[0].stdout == f"def main({text}\n"


def _cids(run_dir: Path, record: dict) -> dict[str, str]:
    from lineage.chain.runrecord import RunRecord
    from lineage.store.cid import cid_for
    from lineage.store.manifest import get_manifest

    manifest = get_manifest(RunRecord.load(run_dir).open_store(run_dir), record["head"])
    return {"shard": str(manifest.stages[0]),  # a UnixFS file, not a manifest
            "config": record["config"],  # a DAG-CBOR node without stages
            "unknown": str(cid_for(b"no such block", "dag-cbor"))}


ERRORS = {
    "raw file block": (["export", "{shard}"], "is not a checkpoint manifest"),
    "dag-cbor without stages": (["export", "{config}"], "is not a checkpoint manifest"),
    "unknown cid": (["export", "{unknown}"], "block not found"),
    "no such step": (["export", "--run-dir", "{run}", "--step", "9"], "no step 9 (its head is step 2)"),
    "output not empty": (["export", "--run-dir", "{run}", "-o", "{full}"], "exists and is not empty"),
    "generate from a non-checkpoint": (["generate", "{config}", "--prompt", "x"], "is not a checkpoint manifest"),
    "empty prompt": (["generate", "--run-dir", "{run}", "--prompt", ""], "non-empty --prompt"),
    "no tokens": (["generate", "--run-dir", "{run}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
    "negative tokens": (["generate", "--run-dir", "{run}", "--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens"),
    "negative temperature": (["generate", "--run-dir", "{run}", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    "top-k zero": (["generate", "--run-dir", "{run}", "--prompt", "x", "--top-k", "0"], "--top-k"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_a_user_error_is_one_line_exit_2_and_writes_nothing(run, tmp_path, case):
    run_dir, record = run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("x")
    args, needle = ERRORS[case]
    fill = {**_cids(run_dir, record), "run": str(run_dir), "full": str(tmp_path / "full")}
    argv = [a.format(**fill) for a in args]
    if argv[0] == "export" and "-o" not in argv:
        argv += ["-o", str(tmp_path / "out")]
    if "--run-dir" not in argv:
        argv += ["--store", str(run_dir / "blocks")]
    res = dlx(*argv)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep"]
