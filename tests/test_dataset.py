"""Datasets, formats, tokenizers and the token file (trainer/dataset.py, trainer/data.py).

    .venv/bin/pytest tests/test_dataset.py -q            # the slow train_local runs too
    .venv/bin/pytest tests/test_dataset.py -q -m "not slow"
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from trainer import dataset
from trainer.config import DataConfig, load_job
from trainer.data import Corpus, load_corpus, shard_digest, with_prepared_data
from trainer.dataset import (
    EOT,
    SPLIT_RULE,
    dataset_files,
    is_eval,
    prepare_data,
    split_files,
)
from trainer.errors import ConfigError
from trainer.launch import train_local

WORDS = ("the model trains on data whose every shard a stranger can derive again from the "
         "token file named by its content identifier while replicas exchange compressed "
         "deltas over slow links and sign what they computed").split()


def _word(rng: random.Random) -> str:
    """A word of the list, or (one time in three) a made-up one: BPE has merges to learn."""
    if rng.random() < 2 / 3:
        return rng.choice(WORDS)
    return "".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(2, 9)))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(_word(rng) for _ in range(words)) + ".\n"


def _jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _dir_cfg(root: Path, **kw: object) -> DataConfig:
    return DataConfig(source="dir", dir=str(root), **kw)


def _tokens(p: dataset.PreparedData) -> np.ndarray:
    return np.fromfile(p.token_file, dtype=np.dtype(p.dtype).newbyteorder("<"))


def _expected_bytes(docs: list[tuple[str, bytes]], fraction: float) -> bytes:
    """SPLIT_RULE written out: training documents in order, then held-out ones."""
    held = [is_eval(key, fraction) for key, _ in docs]
    if not any(held):
        held[min(range(len(docs)), key=lambda i: hashlib.sha256(docs[i][0].encode()).digest())] = True
    return (b"".join(d for (_, d), h in zip(docs, held, strict=True) if not h)
            + b"".join(d for (_, d), h in zip(docs, held, strict=True) if h))


# --- files and formats -----------------------------------------------------------------


def test_dir_source_reads_every_format_and_skips_hidden_files(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"plain \xff bytes\n")  # not UTF-8: fine for the bytes tokenizer
    _jsonl(root / "b.jsonl", ["first", "", "third \u00e9"])
    (root / "b.jsonl").write_text((root / "b.jsonl").read_text() + "\n  \n")  # blank lines skipped
    pq.write_table(pa.table({"text": ["row zero", "row one"], "n": [0, 1]}), root / "sub" / "c.parquet")
    (root / "sub" / "d.md").write_text("markdown\n")
    (root / ".hidden.txt").write_text("never read")
    (root / ".git").mkdir()
    (root / ".git" / "x.txt").write_text("never read")
    (root / "link.txt").symlink_to(root / "a.txt")
    cfg = _dir_cfg(root, eval_fraction=0.3)
    assert [rel for rel, _ in dataset_files(cfg)] == ["a.txt", "b.jsonl", "sub/c.parquet", "sub/d.md"]
    p = prepare_data(cfg, 256, tmp_path / "out")
    docs = [("a.txt", b"plain \xff bytes\n"), ("b.jsonl#0", b"first"), ("b.jsonl#1", b""),
            ("b.jsonl#2", "third \u00e9".encode()), ("sub/c.parquet#0", b"row zero"),
            ("sub/c.parquet#1", b"row one"), ("sub/d.md", b"markdown\n")]
    assert _tokens(p).astype(np.uint8).tobytes() == _expected_bytes(docs, 0.3)
    assert p.dtype == "uint16" and p.documents == 7 and p.tokenizer_file is None
    assert p.train_tokens + p.eval_tokens == sum(len(d) for _, d in docs)
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == ["tokens.bin"]


def test_a_name_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "ok.txt").write_text("fine")
    open(bytes(tmp_path / "ds") + b"/bad\xff.txt", "wb").close()
    with pytest.raises(ConfigError, match=r"^data: .*bad.*: the file's name is not UTF-8"):
        dataset_files(_dir_cfg(tmp_path / "ds"))


def test_text_field_names_the_jsonl_field_and_parquet_column(tmp_path: Path) -> None:
    _jsonl(tmp_path / "ds" / "a.jsonl", ["alpha", "beta", "gamma"], field="body")
    pq.write_table(pa.table({"body": pa.array(["delta"], pa.large_string())}), tmp_path / "ds" / "b.parquet")
    p = prepare_data(_dir_cfg(tmp_path / "ds", text_field="body"), 256, tmp_path / "out")
    assert sorted(_tokens(p).astype(np.uint8).tobytes()) == sorted(b"alphabetagammadelta")


def test_stdlib_split_and_stream_are_todays(tmp_path: Path) -> None:
    # The rule, pinned on known keys (sha256 only: the same on every machine).
    assert is_eval("__phello__/spam.py", 0.05) and is_eval("__phello__/__init__.py", 0.05)
    assert not is_eval("os.py", 0.05) and is_eval("b.jsonl#0", 0.05) and not is_eval("b.jsonl#1", 0.05)
    assert SPLIT_RULE.startswith("sha256-eval-split-v1: ")
    cfg = DataConfig(max_bytes=300_000)
    corpus = load_corpus(cfg)
    files = dataset_files(cfg)
    held = {rel for rel, _ in files if is_eval(rel, cfg.eval_fraction)}
    assert set(corpus.eval_files) == held and corpus.eval_files
    assert corpus.train_files == tuple(rel for rel, _ in files if rel not in held)
    stream = b"".join(p.read_bytes() for rel, p in files if rel not in held)
    stream += b"".join(p.read_bytes() for rel, p in files if rel in held)
    got = torch.cat([corpus.train, corpus.eval]).to(torch.int64).numpy().astype(np.uint8).tobytes()
    assert got == stream and corpus.train.dtype == torch.uint16


def test_tiny_corpus_holds_out_the_smallest_hash_and_refuses_all_eval(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"f{i}.txt").write_text(f"file {i}\n" * 40)
    cfg = DataConfig(source="files", paths=[str(tmp_path / "*.txt")], eval_fraction=1e-9)
    names = [f"f{i}.txt" for i in range(3)]  # named relative to the glob base
    smallest = min(names, key=lambda k: hashlib.sha256(k.encode()).digest())
    assert split_files(cfg)[1] == (smallest,)
    with pytest.raises(ConfigError, match="^data.eval_fraction: every document was held out"):
        prepare_data(cfg.model_copy(update={"eval_fraction": 0.999999}), 256, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- tokenizers ------------------------------------------------------------------------


def _corpus_dir(root: Path, records: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    _jsonl(root / "part-0.jsonl", [_text(rng, rng.randint(5, 60)) for _ in range(records)])
    (root / "zz-notes.txt").write_text("".join(_text(rng, 12) for _ in range(50)))
    return root


def test_bpe_is_deterministic_and_trained_on_the_training_split_only(tmp_path: Path) -> None:
    root = _corpus_dir(tmp_path / "ds")
    cfg = _dir_cfg(root, tokenizer="bpe")
    a = prepare_data(cfg, 4096, tmp_path / "a")
    b = prepare_data(cfg, 4096, tmp_path / "b")
    assert dataclasses.replace(b, token_file=a.token_file, tokenizer_file=a.tokenizer_file) == a
    for name in ("tokens.bin", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    tok = Tokenizer.from_file(a.tokenizer_file)
    assert tok.token_to_id(EOT) == 0 and tok.get_vocab_size() <= 4096
    ids = _tokens(a)
    assert int((ids == 0).sum()) == a.documents == 301  # one <|endoftext|> per document
    first = ids[: int(np.argmax(ids == 0))].tolist()
    held = [is_eval(f"part-0.jsonl#{i}", 0.05) for i in range(300)]
    text = json.loads((root / "part-0.jsonl").read_text().splitlines()[held.index(False)])["text"]
    assert tok.decode(first) == text
    # Changing a held-out document changes the token file, never the tokenizer.
    lines = (root / "part-0.jsonl").read_text().splitlines()
    lines[held.index(True)] = json.dumps({"text": "zyzzyva quixotic " * 50})
    (root / "part-0.jsonl").write_text("\n".join(lines) + "\n")
    c = prepare_data(cfg, 4096, tmp_path / "c")
    assert Path(c.tokenizer_file).read_bytes() == Path(a.tokenizer_file).read_bytes()
    assert Path(c.token_file).read_bytes() != Path(a.token_file).read_bytes()


def test_text_pieces_encode_as_the_whole_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1)
    lines = [rng.choice(["", "  indented", "x", "\u00e9t\u00e9", "\u4e2d\u6587", "a\u00a0b", "'s it"])
             + _text(rng, rng.randint(0, 8)).rstrip("\n") for _ in range(3000)]
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "t.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "ds" / "u.txt").write_text("second document\n")
    cfg = _dir_cfg(tmp_path / "ds", tokenizer="bpe", eval_fraction=0.01)
    whole = prepare_data(cfg, 600, tmp_path / "whole")
    monkeypatch.setattr(dataset, "PIECE_BYTES", 512)
    assert len(list(dataset._text_pieces("t.txt", tmp_path / "ds" / "t.txt", True))) > 20
    pieces = prepare_data(cfg, 600, tmp_path / "pieces")
    assert Path(pieces.token_file).read_bytes() == Path(whole.token_file).read_bytes()
    tok = Tokenizer.from_file(whole.tokenizer_file)
    train, held = split_files(cfg)
    want = [tok.encode((tmp_path / "ds" / rel).read_text(), add_special_tokens=False).ids + [0]
            for rel in train + held]
    assert _tokens(whole).tolist() == sum(want, [])


def test_progress_counts_bytes_read_up_to_the_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset, "PROGRESS_BYTES", 1 << 16)
    monkeypatch.setattr(dataset, "BATCH_CHARS", 1 << 16)
    root = _corpus_dir(tmp_path / "ds", records=3000)
    size = sum(p.stat().st_size for p in root.iterdir())
    for tokenizer, passes in (("bytes", 1), ("bpe", 2)):
        calls: list[tuple[int, int]] = []
        prepare_data(_dir_cfg(root, tokenizer=tokenizer), 512, tmp_path / tokenizer,
                     progress=lambda done, total: calls.append((done, total)))  # noqa: B023
        assert calls[-1] == (passes * size, passes * size) and len(calls) > passes
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_a_user_tokenizer_file_is_used_and_copied(tmp_path: Path) -> None:
    root = _corpus_dir(tmp_path / "ds", records=60)
    bpe = prepare_data(_dir_cfg(root, tokenizer="bpe"), 1000, tmp_path / "bpe")
    user = prepare_data(_dir_cfg(root, tokenizer=bpe.tokenizer_file), 1000, tmp_path / "user")
    assert Path(user.token_file).read_bytes() == Path(bpe.token_file).read_bytes()
    assert Path(user.tokenizer_file).read_bytes() == Path(bpe.tokenizer_file).read_bytes()
    # Without <|endoftext|>: no separator; a vocabulary past 65,536 ids: uint32.
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *WORDS])}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(tmp_path / "words.json"))
    p = prepare_data(_dir_cfg(root, tokenizer=str(tmp_path / "words.json")), 70_000, tmp_path / "w")
    assert p.dtype == "uint32" and int(_tokens(p).max()) <= len(WORDS)
    assert p.train_tokens + p.eval_tokens == sum(
        len(json.loads(line)["text"].split()) for line in (root / "part-0.jsonl").read_text().splitlines()
    ) + len((root / "zz-notes.txt").read_text().split())


# --- bad input -------------------------------------------------------------------------


def _bad(tmp_path: Path, files: dict[str, bytes | pa.Table], **kw: object) -> tuple[DataConfig, Path]:
    root = tmp_path / "ds"
    root.mkdir()
    for name, content in files.items():
        if isinstance(content, pa.Table):
            pq.write_table(content, root / name)
        else:
            (root / name).write_bytes(content)
    return _dir_cfg(root, **kw), root


GOOD = b'{"text": "fine"}\n' * 5
BAD_INPUTS = [
    ({"a.jsonl": GOOD + b'{"text": "cut\n'}, {}, r"^data: .*a.jsonl: line 6: not valid JSON"),
    ({"a.jsonl": GOOD + b"\n" + b'{"body": "x"}\n'}, {},
     r'^data.text_field: .*a.jsonl: line 7: no field "text"'),
    ({"a.jsonl": b'{"text": 3}\n' + GOOD}, {}, r'^data.text_field: .*a.jsonl: line 1: field "text" is a number'),
    ({"a.jsonl": GOOD + b'["text"]\n'}, {}, r"^data: .*a.jsonl: line 6: a JSON list, not an object"),
    ({"a.jsonl": GOOD + b'{"text": "\xff"}\n'}, {}, r"^data: .*a.jsonl: line 6: not valid UTF-8"),
    ({"a.jsonl": GOOD + b'{"text": "\\ud800"}\n'}, {}, r"^data: .*a.jsonl: line 6: .*lone surrogate"),
    ({"a.parquet": pa.table({"body": ["x", "y"]})}, {},
     r'^data.text_field: .*a.parquet: no column "text" \(columns: body\)'),
    ({"a.parquet": pa.table({"text": [1, 2]})}, {}, r'^data.text_field: .*a.parquet: column "text" is int64'),
    ({"a.parquet": pa.table({"text": ["x", None, "z"]})}, {},
     r'^data.text_field: .*a.parquet: row 1: column "text" is null'),
    ({"a.parquet": b"PAR1 not really"}, {}, r"^data: .*a.parquet: not a Parquet file"),
    ({"a.txt": b"ok\nok\n\xfe\n", "b.txt": b"x"}, {"tokenizer": "bpe"},
     r"^data.tokenizer: .*a.txt: line 3: not valid UTF-8 \(byte 0xfe\)"),
    ({"a.jsonl": GOOD + b'{"text": 1}\n'}, {"tokenizer": "bpe"}, r'^data.text_field: .*line 6: field "text"'),
    ({"a.jsonl": b"\n\n", "b.jsonl": b""}, {}, r"^data: the dataset has no documents \(2 files\)"),
    ({"a.txt": b"only one"}, {}, r"^data: the dataset has 1 document; it needs at least 2"),
    ({"a.txt": b"", "b.txt": b""}, {}, r"^data: the dataset's training documents hold no tokens"),
    ({"a.txt": b"x", "b.txt": b"y"}, {"tokenizer": "bpe"}, r"^model.vocab_size \(256\) is smaller .*257"),
    ({"a.txt": b"x", "b.txt": b"y", "tok.json": b"{}"}, {"tokenizer": "TOK"},
     r"^data.tokenizer: .*tok.json is not a tokenizer.json"),
    ({"a.txt": b"x", "b.txt": b"y"}, {"tokenizer": "TOK"}, r"^data.tokenizer: .*missing.json is not a tokenizer"),
]


@pytest.mark.parametrize(("files", "kw", "message"), BAD_INPUTS)
def test_bad_input_is_one_config_error_and_writes_nothing(
    tmp_path: Path, files: dict, kw: dict, message: str
) -> None:
    if kw.get("tokenizer") == "TOK":
        name = "tok.json" if "tok.json" in files else "missing.json"
        kw = {**kw, "tokenizer": str(tmp_path / "ds" / name)}
    cfg, _ = _bad(tmp_path, files, **kw)
    with pytest.raises(ConfigError, match=message) as info:
        prepare_data(cfg, 256 if "vocab_size" in message else 300, tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path: Path) -> None:
    root = _corpus_dir(tmp_path / "ds", records=40)
    bpe = prepare_data(_dir_cfg(root, tokenizer="bpe"), 700, tmp_path / "bpe")
    size = Tokenizer.from_file(bpe.tokenizer_file).get_vocab_size()
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match=rf"^model.vocab_size \(300\) is smaller than the tokenizer's vocabulary \({size}: "):
        prepare_data(_dir_cfg(root, tokenizer=bpe.tokenizer_file), 300, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # an existing directory is left as it was


@pytest.mark.parametrize(("data", "message"), [
    ({"prepared": {"token_file": "x"}}, "data: prepared is set by dlx itself"),
    ({"source": "dir"}, "data: dir must name a directory when source is 'dir'"),
    ({"dir": "x"}, "data: dir needs source = 'dir' (source is 'stdlib')"),
    ({"tokenizer": "bpe"}, r"model.vocab_size (256) is smaller than the tokenizer's vocabulary (257"),
    ({"source": "dir", "dir": "/nonexistent/dlx"}, None),
])
def test_job_file_data_section(data: dict, message: str | None) -> None:
    job = {"name": "j", "outer": {"steps": 1, "inner_steps": 1}, "data": data}
    if message is None:
        with pytest.raises(ConfigError, match="^data.dir: /nonexistent/dlx is not a directory"):
            load_corpus(load_job(job).data)
        return
    with pytest.raises(ConfigError) as info:
        load_job(job)
    assert str(info.value).startswith(message)


def test_new_fields_at_their_defaults_dump_as_before() -> None:
    job = load_job({"name": "j", "outer": {"steps": 1, "inner_steps": 1}})
    assert set(job.model_dump()["data"]) == {"source", "paths", "max_bytes", "eval_fraction",
                                             "batch_size", "eval_batches"}
    bpe = load_job({"name": "j", "model": {"vocab_size": 512}, "outer": {"steps": 1, "inner_steps": 1},
                    "data": {"tokenizer": "bpe", "text_field": "body"}})
    assert bpe.model_dump()["data"]["tokenizer"] == "bpe" and bpe.model_dump()["data"]["text_field"] == "body"
    prepared = with_prepared_data(job)
    assert prepared.data.prepared is not None and prepared.canonical_json() == job.canonical_json()
    assert "prepared" not in json.dumps(DataConfig.model_json_schema())


# --- memory and the corpus -------------------------------------------------------------


def _peak_bytes(cfg: DataConfig, out: Path) -> int:
    tracemalloc.start()
    try:
        prepare_data(cfg, 512, out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow  # not in --quick: tokenizes megabytes
def test_preparing_streams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset, "BATCH_CHARS", 1 << 15)  # small batches: a small corpus shows it
    rng = random.Random(2)
    peaks, sizes = [], []
    for records in (1_500, 6_000):  # about 0.5 MB and 2 MB of JSON Lines
        root = tmp_path / f"ds{records}"
        _jsonl(root / "a.jsonl", [_text(rng, 50) for _ in range(records)])
        sizes.append((root / "a.jsonl").stat().st_size)
        peaks.append(_peak_bytes(_dir_cfg(root, tokenizer="bpe", max_bytes=1 << 30), tmp_path / f"o{records}"))
    # Python's peak grows by well under 5% of what the corpus grows (a copy would be 100%+).
    assert peaks[1] - peaks[0] < 0.05 * (sizes[1] - sizes[0]), (peaks, sizes)


def test_corpus_from_prepared_memory_maps_and_rebuilds_shards(tmp_path: Path) -> None:
    root = _corpus_dir(tmp_path / "ds")
    cfg = _dir_cfg(root, tokenizer="bpe")
    corpus = load_corpus(cfg, 4096)
    again = Corpus.from_prepared(corpus.prepared)
    a, b = corpus.shard(5, 1, 2, 3, 4, 16), again.shard(5, 1, 2, 3, 4, 16)
    assert torch.equal(a.tokens, b.tokens) and a.digest == b.digest
    assert a.digest == hashlib.sha256(a.tokens.numpy().astype("<u2").tobytes()).digest()
    assert a.digest == shard_digest(a.tokens, "uint16") != shard_digest(a.tokens, "uint32")
    assert 255 < int(a.tokens.max()) < 4096 and a.tokens.dtype == torch.int64
    assert load_corpus(cfg, 4096) is corpus  # once per process and config
    bad = dataclasses.replace(corpus.prepared, eval_tokens=corpus.prepared.eval_tokens + 1)
    with pytest.raises(ConfigError, match="^data: token file .* bytes, not the"):
        Corpus.from_prepared(bad)


# --- training --------------------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.steps: list = []

    def on_genesis(self, genesis: object) -> None:
        pass

    def on_step(self, step: object) -> None:
        self.steps.append(step)

    def on_progress(self, progress: object) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_train_local_on_jsonl_with_a_4096_token_bpe(tmp_path: Path, family: str) -> None:
    root = _corpus_dir(tmp_path / "ds", records=400)
    job = load_job({
        "name": "bpe", "seed": 7,
        "model": {"family": family, "vocab_size": 4096, "d_model": 32, "n_layers": 2, "n_heads": 2,
                  "seq_len": 32},
        "parallel": {"replicas": 2, "stages": 1, "microbatches": 1},
        "data": {"source": "dir", "dir": str(root), "tokenizer": "bpe", "batch_size": 4,
                 "eval_batches": 2},
        "inner": {"warmup": 1},
        "outer": {"steps": 2, "inner_steps": 3},
    })
    sink = _Sink()
    assert train_local(job, sink, timeout_s=240) == "completed"
    prepared = with_prepared_data(job).data.prepared
    corpus = Corpus.from_prepared(prepared)
    assert prepared.tokenizer_file and Tokenizer.from_file(prepared.tokenizer_file).get_vocab_size() > 1000
    for step in sink.steps:
        for c in step.contributions:
            assert c.data_shard == corpus.shard(job.seed, c.replica, step.step, 3, 4, 32).digest
    assert len(sink.steps) == 2 and all(np.isfinite(s.metrics["eval_loss"]) for s in sink.steps)
