"""A run's data on the audit trail: a JSON Lines dataset with a trained 4,096-token BPE goes
through `dlx train`; the run's config names the dataset, tokenizer and token file by CID;
`dlx verify` re-derives every attested shard from the stored token file (level "data"),
`--data-full` re-tokenizes the dataset; a changed byte in any of the three fails naming
its CID; the same job twice gives the same CIDs; bad data is one line, exit 2, nothing
written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from dlx_testing.here import dlx_here

from lineage.chain.runrecord import RunRecord
from lineage.store.blockstore import Blockstore
from lineage.store.cid import parse_cid
from lineage.store.dagpb import PBNode
from lineage.store.unixfs_dir import list_tree

DLX = str(Path(sys.executable).parent / "dlx")


def _jsonl_dataset(root: Path) -> Path:
    """Two JSON Lines files of stdlib sources, one record per module (about 2 MB)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.glob("*.py"))[:120]
    root.mkdir(parents=True)
    for i, part in enumerate((sources[::2], sources[1::2])):
        with open(root / f"part-{i}.jsonl", "w") as fh:
            for p in part:
                fh.write(json.dumps({"id": p.name, "text": p.read_text(errors="replace")}) + "\n")
    return root


def _job(name: str, data_dir: Path, *, extra_data: str = "", vocab: int = 4096) -> str:
    return f"""
name = "{name}"
seed = 3

[model]
vocab_size = {vocab}
d_model = 32
n_layers = 2
n_heads = 2
seq_len = 32

[parallel]
replicas = 2
stages = 1

[data]
source = "dir"
dir = "{data_dir}"
tokenizer = "bpe"
batch_size = 4
eval_batches = 2
{extra_data}

[inner]
lr = 3e-3
warmup = 2

[outer]
steps = 2
inner_steps = 3
"""


def _dlx(*args: str, cache: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`dlx ARGS` with the data cache `cache`: `train` as a process of its own, the other
    commands in this one (tests/dlx_testing/here.py: what they report is the point here)."""
    env = {"DLX_CACHE": str(cache), "COLUMNS": "400"}
    if args[0] != "train":
        return dlx_here(*args, env=env)
    return subprocess.run([DLX, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    data = _jsonl_dataset(root / "dataset")
    job = root / "job.toml"
    job.write_text(_job("bpe", data))
    run_dir = root / "run"
    res = _dlx("train", str(job), "--run-dir", str(run_dir), cache=root / "cache")
    assert res.returncode == 0, res.stderr[-3000:]
    return root, job, run_dir


def _data_record(run_dir: Path, cache: Path) -> dict:
    res = _dlx("lineage", "--run-dir", str(run_dir), "--json", cache=cache)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["config"]["data"]


@pytest.mark.slow
def test_the_lineage_names_the_dataset_tokenizer_and_token_file(bpe_run):
    root, _, run_dir = bpe_run
    data = _data_record(run_dir, root / "cache")
    store = Blockstore(run_dir / "blocks")
    for key in ("dataset", "tokenizer", "tokens"):
        assert store.has(parse_cid(data[key])), key
    assert data["dtype"] == "uint16" and data["train_tokens"] > 0 and data["eval_tokens"] > 0
    assert [p for p, _, _ in list_tree(store, data["dataset"])] == ["part-0.jsonl", "part-1.jsonl"]
    # what `dlx cas cid -r` (== `ipfs add -r --cid-version=1`) gives the same directory
    res = _dlx("cas", "cid", "-r", str(root / "dataset"), cache=root / "cache")
    assert res.returncode == 0 and res.stdout.strip() == data["dataset"], res.stderr
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(b"".join(_file_bytes(store, data["tokenizer"])).decode())
    assert tok.get_vocab_size(with_added_tokens=True) == 4096 and tok.token_to_id("<|endoftext|>") == 0


def _file_bytes(store: Blockstore, cid: str) -> list[bytes]:
    from lineage.store.unixfs import cat

    return list(cat(store, cid))


@pytest.mark.slow
def test_verify_checks_every_shard_against_the_token_file(bpe_run):
    root, _, run_dir = bpe_run
    res = _dlx("verify", "--run-dir", str(run_dir), "--json", "--data-full", cache=root / "fresh-cache")
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] and [s["passed"] for s in report["steps"]] == [["chain", "content", "aggregate", "data"]] * 2


def _leaf_blocks(store: Blockstore, cid: str) -> list:
    """The raw leaf blocks of a UnixFS file, in order."""
    root = parse_cid(cid)
    if root.codec.name == "raw":
        return [root]
    node = PBNode.decode(store.get(root))
    return [leaf for link in node.links for leaf in _leaf_blocks(store, str(parse_cid(link.cid)))]


def _flip_one_byte(run_dir: Path, block) -> None:
    path = Blockstore(run_dir / "blocks")._path(block)
    os.chmod(path, 0o644)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.slow
@pytest.mark.parametrize("what", ["tokens", "dataset", "tokenizer"])
def test_one_changed_byte_in_the_data_fails_naming_its_cid(bpe_run, tmp_path, what):
    root, _, run_dir = bpe_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    data = _data_record(copy, root / "cache")
    store = Blockstore(copy / "blocks")
    target = list_tree(store, data["dataset"])[1][1] if what == "dataset" else parse_cid(data[what])
    block = _leaf_blocks(store, str(target))[0]
    _flip_one_byte(copy, block)
    res = _dlx("verify", "--run-dir", str(copy), "--json", cache=tmp_path / "cache")
    assert res.returncode == 1, res.stdout + res.stderr
    report = json.loads(res.stdout)
    reasons = [s["failures"].get("data", "") for s in report["steps"]]
    assert all(data[what] in r and str(block) in r for r in reasons), reasons


@pytest.mark.slow
def test_the_same_job_twice_gives_the_same_cids(bpe_run, tmp_path):
    root, job, run_dir = bpe_run
    again = tmp_path / "again"
    res = _dlx("train", str(job), "--run-dir", str(again), cache=tmp_path / "cache")  # tokenized afresh
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = _data_record(run_dir, root / "cache"), _data_record(again, tmp_path / "cache")
    assert first == second
    assert RunRecord.load(again).head == RunRecord.load(run_dir).head


def _refused(tmp_path: Path, job_text: str, *needles: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(job_text)
    for args in (["data", "prepare", str(job), "--store", str(tmp_path / "store")],
                 ["train", str(job), "--run-dir", str(tmp_path / "run")]):
        res = _dlx(*args, cache=tmp_path / "cache")
        assert res.returncode == 2, res.stderr
        line = res.stderr.strip()
        assert "\n" not in line and "Traceback" not in line, line
        for needle in needles:
            assert needle in line, line
        assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()
        cached = tmp_path / "cache" / "prepared"
        assert not cached.exists() or not any(p for p in cached.iterdir() if not p.name.startswith(".")), \
            list(cached.iterdir())


@pytest.mark.slow  # not in --quick: `dlx` runs
def test_an_empty_dataset_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "empty.jsonl").write_text("")
    _refused(tmp_path, _job("e", tmp_path / "d"), "data")


@pytest.mark.slow  # not in --quick: `dlx` runs
def test_a_bad_json_lines_line_is_refused_naming_file_and_line(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": oops\n')
    _refused(tmp_path, _job("j", d), "a.jsonl", "3")


@pytest.mark.slow  # not in --quick: `dlx` runs
def test_a_parquet_file_without_the_column_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(pa.table({"body": ["x" * 100, "y" * 100]}), d / "a.parquet")
    _refused(tmp_path, _job("p", d), "a.parquet", "text")


@pytest.mark.slow  # not in --quick: `dlx` runs
def test_a_tokenizer_path_that_is_not_a_tokenizer_is_refused(tmp_path):
    d = _jsonl_dataset(tmp_path / "d")
    bogus = tmp_path / "tokenizer.json"
    bogus.write_text('{"not": "a tokenizer"}')
    _refused(tmp_path, _job("t", d).replace('tokenizer = "bpe"', f'tokenizer = "{bogus}"'),
             "data.tokenizer", str(bogus))


@pytest.mark.slow  # not in --quick: trains a tokenizer, `dlx` runs
def test_a_vocab_smaller_than_the_tokenizers_is_refused(tmp_path, bpe_run_tokenizer):
    d = _jsonl_dataset(tmp_path / "d")
    job = _job("v", d, vocab=1024).replace('tokenizer = "bpe"', f'tokenizer = "{bpe_run_tokenizer}"')
    _refused(tmp_path, job, "model.vocab_size")


@pytest.fixture(scope="module")
def bpe_run_tokenizer(tmp_path_factory):
    """A 4,096-token tokenizer.json trained by `dlx data prepare`."""
    root = tmp_path_factory.mktemp("tok")
    d = _jsonl_dataset(root / "d")
    job = root / "job.toml"
    job.write_text(_job("tok", d))
    res = _dlx("data", "prepare", str(job), "--json", cache=root / "cache")
    assert res.returncode == 0, res.stderr
    return Path(json.loads(res.stdout)["token_file"]).parent / "tokenizer.json"


@pytest.mark.slow
def test_export_carries_the_runs_tokenizer_and_generate_uses_it(bpe_run, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    root, _, run_dir = bpe_run
    out = tmp_path / "hf"
    res = _dlx("export", "--run-dir", str(run_dir), "-o", str(out), cache=root / "cache")
    assert res.returncode == 0, res.stderr
    data = _data_record(run_dir, root / "cache")
    stored = b"".join(_file_bytes(Blockstore(run_dir / "blocks"), data["tokenizer"]))
    assert (out / "tokenizer.json").read_bytes() == stored
    lineage = json.loads((out / "lineage.json").read_text())
    assert lineage["data"]["tokens"] == data["tokens"] and lineage["tokenizer"] == "tokenizer.json"
    text = "def main(argv):\n    return 0\n"
    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf(text)["input_ids"] == Tokenizer.from_str(stored.decode()).encode(text).ids
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    res = _dlx("generate", "--run-dir", str(run_dir), "--prompt", "def ", "--max-new-tokens", "20",
               cache=root / "cache")
    assert res.returncode == 0 and res.stdout.startswith("def ") and len(res.stdout) > len("def \n"), res.stderr
