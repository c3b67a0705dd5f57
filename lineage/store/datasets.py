"""A run's data in the content-addressed store: the dataset, the tokenizer, the token file.

    record, prepared = prepare_dataset(job.data, job.model.vocab_size, store.put)
    config["data"] = record.to_doc()             # the three CIDs, in the run's config block
    prepared = fetch_prepared(store, record)     # a node, a verifier: the token file by CID

The dataset is the job's files as a UnixFS directory (`ipfs add -r --cid-version=1` of the
same tree gives the same root CID); the tokenizer is its `tokenizer.json` as a UnixFS file
(none for the byte tokenizer); the token file is the tokenized stream as a UnixFS file
(trainer.dataset: raw little-endian uint16/uint32, training documents then held-out ones).
The run's config block names all three as CID links, with the token file's numbers and
the split rule, so the run's DAG reaches its data and a stranger can fetch exactly what it
trained on.

Tokenizing happens once per (dataset, tokenizer, vocabulary, split) on a machine: the
result is kept in the data cache ($DLX_CACHE, else $XDG_CACHE_HOME/dlx, else ~/.cache/dlx),
under a key over those inputs. A token file fetched by CID is kept there by its CID, and
re-hashed before each use, so a changed cache file is fetched again, never trained on.

`check_shards` re-derives each committed (step, replica) shard from the token file and
compares its digest with the attested `dataShard` (`dlx verify`, level "data");
`check_tokenization` re-tokenizes the stored dataset with the recorded tokenizer and
checks that it gives the token file's CID (`dlx verify --data-full`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multiformats import CID

from lineage.errors import DlxError
from trainer.errors import ConfigError

from .cid import parse_cid
from .unixfs import PutFn, import_bytes, import_file, read_file
from .unixfs_dir import import_tree, read_tree

__all__ = ["DataRecord", "check_shards", "check_stored", "check_tokenization", "data_cache", "fetch_prepared",
           "prepare_dataset"]

#: Bumped when the prepared cache's layout or the tokenization changes meaning.
_CACHE_VERSION = 1
Progress = Callable[[str, int, int], None]  # (phase, done, total)


def data_cache() -> Path:
    """Where prepared token files and fetched ones are kept on this machine."""
    if os.environ.get("DLX_CACHE"):
        return Path(os.environ["DLX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dlx"


@dataclass(frozen=True)
class DataRecord:
    """What a run's config block says about its data (`config["data"]`)."""

    dataset: CID  # the dataset directory's root
    tokenizer: CID | None  # tokenizer.json; None: the byte tokenizer
    tokens: CID  # the token file
    dtype: str  # "uint16" | "uint32", little-endian
    train_tokens: int  # the token file's first train_tokens are the training split
    eval_tokens: int  # the rest are the held-out documents
    documents: int
    eval_documents: int
    split: str  # the train/eval split rule (trainer.dataset.SPLIT_RULE)

    def to_doc(self) -> dict[str, Any]:
        """The DAG-CBOR document: CIDs as links, so the run's DAG reaches its data."""
        return {"dataset": self.dataset, "tokenizer": self.tokenizer if self.tokenizer else "bytes",
                "tokens": self.tokens, "dtype": self.dtype, "train_tokens": self.train_tokens,
                "eval_tokens": self.eval_tokens, "documents": self.documents,
                "eval_documents": self.eval_documents, "split": self.split}

    def to_json(self) -> dict[str, Any]:
        """The same with CIDs as text (a job record, `--json` output)."""
        return {k: str(v) if isinstance(v, CID) else v for k, v in self.to_doc().items()}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> DataRecord:
        """From `to_doc` or `to_json` output; a malformed record is a DlxError."""
        try:
            tokenizer = doc["tokenizer"]
            return cls(
                dataset=parse_cid(doc["dataset"]), tokens=parse_cid(doc["tokens"]),
                tokenizer=None if tokenizer == "bytes" else parse_cid(tokenizer),
                dtype=_dtype(doc["dtype"]), train_tokens=int(doc["train_tokens"]),
                eval_tokens=int(doc["eval_tokens"]), documents=int(doc["documents"]),
                eval_documents=int(doc["eval_documents"]), split=str(doc["split"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise DlxError(f"the run's data record is malformed: {exc}") from None

    def prepared(self, token_file: Path, tokenizer_file: Path | None) -> Any:
        """The trainer's view of this record, reading `token_file`."""
        from trainer.dataset import PreparedData

        return PreparedData(token_file=str(token_file), dtype=self.dtype, train_tokens=self.train_tokens,
                            eval_tokens=self.eval_tokens, documents=self.documents,
                            eval_documents=self.eval_documents,
                            tokenizer_file=str(tokenizer_file) if tokenizer_file else None)


def _dtype(name: Any) -> str:
    if name not in ("uint16", "uint32"):
        raise ValueError(f"token dtype {name!r} is not uint16 or uint32")
    return str(name)


# -- preparing ------------------------------------------------------------------------------

def _tokenizer_key(cfg: Any) -> str:
    """The tokenizer as the cache key sees it: its kind, or a user file's CID."""
    if cfg.tokenizer in ("bytes", "bpe"):
        return cfg.tokenizer
    from trainer.bounded import JSON_LIMIT, read_bounded

    path = Path(cfg.tokenizer)
    try:  # a regular file of bounded size (a FIFO is refused, not waited on)
        return str(import_bytes(read_bounded(path, JSON_LIMIT, "data.tokenizer:")).cid)
    except FileNotFoundError:
        raise ConfigError(f"data.tokenizer: {path} is not a tokenizer.json (no such file)") from None


def _cache_key(cfg: Any, vocab_size: int, dataset: CID) -> str:
    from trainer.dataset import SPLIT_RULE

    inputs = {"v": _CACHE_VERSION, "dataset": str(dataset), "tokenizer": _tokenizer_key(cfg),
              "vocab_size": vocab_size, "text_field": cfg.text_field,
              "eval_fraction": cfg.eval_fraction, "split": SPLIT_RULE}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _prepared_in(cache: Path, cfg: Any, vocab_size: int, progress: Progress | None) -> Any:
    """The prepared data for `cfg` in `cache`, tokenizing first when it is not there yet.
    The directory appears whole (renamed into place) or not at all."""
    from trainer.dataset import PreparedData, prepare_data

    meta = cache / "meta.json"
    if not meta.is_file():
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=cache.parent))
        try:
            p = prepare_data(cfg, vocab_size, tmp,
                             progress=(lambda done, total: progress("tokenize", done, total)) if progress else None)
            fields = {"dtype": p.dtype, "train_tokens": p.train_tokens, "eval_tokens": p.eval_tokens,
                      "documents": p.documents, "eval_documents": p.eval_documents,
                      "token_file": Path(p.token_file).name,
                      "tokenizer_file": Path(p.tokenizer_file).name if p.tokenizer_file else None}
            (tmp / "meta.json").write_text(json.dumps(fields, indent=1) + "\n")
            try:
                os.rename(tmp, cache)
            except OSError:  # another process prepared the same data meanwhile: keep theirs
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    fields = json.loads(meta.read_text())
    tok = fields.pop("tokenizer_file")
    return PreparedData(**{**fields, "token_file": str(cache / fields["token_file"]),
                           "tokenizer_file": str(cache / tok) if tok else None})


def _import_path(path: str | Path, put: PutFn | None) -> CID:
    with open(path, "rb") as fh:
        return import_file(fh, put).cid


def prepare_dataset(cfg: Any, vocab_size: int, put: PutFn | None = None, *,
                    cache: Path | None = None, progress: Progress | None = None) -> tuple[DataRecord, Any]:
    """The data record of `cfg` (a trainer DataConfig) and the prepared token file to train
    on, tokenizing once per machine; with `put`, the dataset, tokenizer and token file are
    stored (else only their CIDs are computed). Bad data is a ConfigError raised before
    anything is written to the store."""
    from trainer.dataset import SPLIT_RULE, dataset_files

    files = dataset_files(cfg)
    if progress:
        progress("dataset", 0, len(files))
    dataset = import_tree(files)  # CIDs only: nothing is stored before the data tokenize cleanly
    key = _cache_key(cfg, vocab_size, dataset)
    p = _prepared_in((cache or data_cache()) / "prepared" / key, cfg, vocab_size, progress)
    if put is not None:
        import_tree(files, put)
    tokens = _import_path(p.token_file, put)
    tokenizer = _import_path(p.tokenizer_file, put) if p.tokenizer_file else None
    record = DataRecord(dataset=dataset, tokenizer=tokenizer, tokens=tokens, dtype=p.dtype,
                        train_tokens=p.train_tokens, eval_tokens=p.eval_tokens, documents=p.documents,
                        eval_documents=p.eval_documents, split=SPLIT_RULE)
    return record, p


# -- fetching -------------------------------------------------------------------------------

def _fetched(store: Any, cid: CID, path: Path) -> Path:
    """The file `cid` at `path`: kept from an earlier fetch when it still hashes to `cid`,
    else read from `store` (every block re-hashed) and renamed into place."""
    if path.is_file() and _import_path(path, None) == cid:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            read_file(store, cid, fh)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def fetch_prepared(store: Any, record: DataRecord, *, cache: Path | None = None) -> Any:
    """The token file (and tokenizer) `record` names, fetched by CID from `store` into this
    machine's data cache; what the trainer reads (trainer.dataset.PreparedData)."""
    root = (cache or data_cache()) / "cids"
    try:
        tokens = _fetched(store, record.tokens, root / f"{record.tokens}.tokens")
        tokenizer = _fetched(store, record.tokenizer, root / f"{record.tokenizer}.json") if record.tokenizer else None
    except DlxError as exc:
        raise DlxError(f"the run's token file {record.tokens}: {exc}") from None
    return record.prepared(tokens, tokenizer)


# -- verifying ------------------------------------------------------------------------------

def check_shards(prepared: Any, job: Any, attested: Iterable[tuple[int, int, bytes]]) -> dict[int, str]:
    """Re-derive each (step, replica) shard from the token file and compare its digest with
    the attested one; returns step -> the first mismatch (no entry: every replica matched)."""
    from trainer.data import Corpus

    corpus = Corpus.from_prepared(prepared)
    H, B, L = job.outer.inner_steps, job.data.batch_size, job.model.seq_len
    failures: dict[int, str] = {}
    for step, replica, digest in attested:
        if step in failures:
            continue
        derived = corpus.shard(job.seed, replica, step, H, B, L).digest
        if derived != digest:
            failures[step] = (f"replica {replica}: the shard re-derived from token file {prepared.token_file} "
                              f"has digest 0x{derived.hex()}, the attested dataShard is 0x{digest.hex()}")
    return failures


def check_tokenization(store: Any, record: DataRecord, job: Any, *, progress: Progress | None = None) -> list[str]:
    """Re-tokenize the stored dataset with the recorded tokenizer (`dlx verify --data-full`):
    the problems found, each naming the CID that does not hold (empty: the token file is
    exactly the dataset under the tokenizer)."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dlx-data-") as tmp:
        tree = Path(tmp) / "dataset"
        try:
            read_tree(store, record.dataset, tree)
        except DlxError as exc:
            return [f"dataset {record.dataset}: {exc}"]
        tokenizer = job.data.tokenizer if job.data.tokenizer in ("bytes", "bpe") else None
        if tokenizer is None:
            if record.tokenizer is None:
                return [f"the run names tokenizer file {job.data.tokenizer} but records no tokenizer CID"]
            try:
                tokenizer = str(_fetched(store, record.tokenizer, Path(tmp) / "tokenizer.json"))
            except DlxError as exc:
                return [f"tokenizer {record.tokenizer}: {exc}"]
        cfg = job.data.model_copy(update={"source": "dir", "dir": str(tree), "paths": [], "tokenizer": tokenizer,
                                          "prepared": None})
        again, _ = prepare_dataset(cfg, job.model.vocab_size, cache=Path(tmp) / "cache", progress=progress)
    if again.dataset != record.dataset:
        problems.append(f"dataset {record.dataset}: re-read as {again.dataset}")
    if again.tokenizer != record.tokenizer:
        problems.append(f"tokenizer {record.tokenizer}: retraining it on the dataset gives {again.tokenizer}")
    if again.tokens != record.tokens:
        problems.append(f"token file {record.tokens}: re-tokenizing dataset {record.dataset} gives {again.tokens}")
    return problems


def check_stored(store: Any, record: DataRecord) -> list[str]:
    """Every block of the dataset, tokenizer and token file is in `store` and hashes to its
    CID (the data level's reading of the data; a changed byte is named by its block)."""
    from .unixfs import check_file
    from .unixfs_dir import list_tree

    problems = []
    try:
        for _, cid, _ in list_tree(store, record.dataset):
            check_file(store, cid)
    except DlxError as exc:
        problems.append(f"dataset {record.dataset}: {exc}")
    for name, file_cid in (("tokenizer", record.tokenizer), ("token file", record.tokens)):
        if file_cid is None:
            continue
        try:
            check_file(store, file_cid)
        except DlxError as exc:
            problems.append(f"{name} {file_cid}: {exc}")
    return problems
