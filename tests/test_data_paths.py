"""`[data]` paths (issue 34, point 1): absolute, `~` and relative to the job file; files
named relative to the glob base, so one corpus at two places is one dataset CID."""

from __future__ import annotations

import shutil
from pathlib import Path

from lineage.store.unixfs_dir import import_tree
from trainer.config import DataConfig
from trainer.dataset import dataset_files, glob_base, resolve_data_paths
from workers.run.jobfile import load_job_file

JOB_REST = "[outer]\nsteps = 1\ninner_steps = 1\n"


def _corpus(root: Path) -> Path:
    (root / "2024").mkdir(parents=True)
    (root / "web" / "archive").mkdir(parents=True)
    (root / "2024" / "chats.jsonl").write_text('{"text": "hello there"}\n' * 50)
    (root / "web" / "a.txt").write_text("alpha " * 300)
    (root / "web" / "archive" / "b.txt").write_text("beta " * 300)
    return root


def _dataset_cid(patterns: list[str]) -> tuple[list[str], str]:
    files = dataset_files(DataConfig(source="files", paths=patterns))
    return [rel for rel, _ in files], str(import_tree(files))


def test_glob_base_is_the_longest_directory_without_glob_characters() -> None:
    assert glob_base("/data/corpus/2024/*.jsonl") == "/data/corpus/2024"
    assert glob_base("/data/c[o]rpus/x/*.txt") == "/data"
    assert glob_base("/data/corpus/one.txt") == "/data/corpus"
    assert glob_base("/*.txt") == "/"


def test_one_corpus_at_two_places_is_one_dataset_cid(tmp_path: Path) -> None:
    a = _corpus(tmp_path / "a" / "corpus")
    b = tmp_path / "deeper" / "elsewhere" / "corpus"
    shutil.copytree(a, b)
    names, cid_a = _dataset_cid([f"{a}/2024/*.jsonl", f"{a}/web/**/*.txt"])
    assert names == ["2024/chats.jsonl", "web/a.txt", "web/archive/b.txt"]
    assert _dataset_cid([f"{b}/2024/*.jsonl", f"{b}/web/**/*.txt"]) == (names, cid_a)
    one_glob = _dataset_cid([f"{a}/**/*.txt"])  # the base is the corpus directory
    assert one_glob[0] == ["web/a.txt", "web/archive/b.txt"]


def test_relative_paths_are_the_job_files_and_home_is_expanded(tmp_path: Path, monkeypatch) -> None:
    corpus = _corpus(tmp_path / "project" / "corpus")
    job = tmp_path / "project" / "jobs" / "job.toml"
    job.parent.mkdir()
    job.write_text('name = "p"\n[data]\nsource = "files"\npaths = ["../corpus/web/*.txt"]\n'
                   'tokenizer = "../tok.json"\n' + JOB_REST)
    monkeypatch.chdir(tmp_path)  # anywhere but the job's directory
    data = load_job_file(job).data
    assert data.paths == [f"{corpus}/web/*.txt"] and data.tokenizer == str(tmp_path / "project" / "tok.json")
    assert [rel for rel, _ in dataset_files(data)] == ["a.txt"]
    monkeypatch.setenv("HOME", str(tmp_path / "project"))
    resolved = resolve_data_paths({"source": "dir", "dir": "~/corpus", "tokenizer": "bpe"}, Path("/else"))
    assert resolved == {"source": "dir", "dir": str(corpus), "tokenizer": "bpe"}
    weird = tmp_path / "we[i]rd"
    _corpus(weird / "corpus")
    (weird / "job.toml").write_text('name = "w"\n[data]\nsource = "files"\npaths = ["corpus/web/*.txt"]\n' + JOB_REST)
    assert [rel for rel, _ in dataset_files(load_job_file(weird / "job.toml").data)] == [
        "we[i]rd/corpus/web/a.txt"]  # matched literally; named from the first directory with no glob character


def test_dot_dot_in_a_pattern_is_normalised_before_its_base_is_taken(tmp_path: Path) -> None:
    _corpus(tmp_path / "c")
    (tmp_path / "x.txt").write_text("x" * 2000)
    assert glob_base(f"{tmp_path}/c/2*/../../x.txt") == str(tmp_path)
    assert [rel for rel, _ in dataset_files(DataConfig(source="files", paths=[f"{tmp_path}/c/2*/../../x.txt"]))] \
        == ["x.txt"]
