"""Datasets, their formats and tokenizers, and the token file the ranks train on.

    prepared = prepare_data(job.data, job.model.vocab_size, Path("out"))  # out/tokens.bin, ...
    corpus = trainer.data.Corpus.from_prepared(prepared)

A dataset is a sorted list of files (`dataset_files`): the Python standard library's `.py`
sources (`source = "stdlib"`), user globs (`"files"`), or every regular file under a
directory (`"dir"`, recursively, hidden files and directories skipped as `ipfs add -r`
skips them), each named by its relative posix path, taken whole in sorted order until
`max_bytes`.

Documents, by file extension: `.jsonl` holds one JSON object per line (blank lines
skipped) and record i (0-based) is document f"{path}#{i}", its text the string field
`text_field`; `.parquet` likewise, row i of the string column `text_field`; any other file
is one document keyed by its path, plain UTF-8 text (raw bytes for the bytes tokenizer).
A document is held out for eval by `SPLIT_RULE`, a stable hash of its key.

Tokenizers (`tokenizer`): "bytes", one token per byte; "bpe", a byte-level BPE of
`vocab_size` tokens trained with Hugging Face `tokenizers` on the training split only,
deterministically (the same files give byte-identical tokenizer.json), `<|endoftext|>`
being id 0; or the path of a local tokenizer.json, copied unchanged.

The token file (tokens.bin) is raw little-endian integers, uint16 when the vocabulary has
at most 65,536 ids, else uint32, with no header: every training document's tokens in
document order, then every held-out document's. A text tokenizer with `<|endoftext|>`
(always "bpe") follows each document with it; the bytes tokenizer has no separator. A text
file is read and encoded in pieces of about `PIECE_BYTES`, cut only after a newline between
two characters that are not whitespace, where byte-level BPE's pre-tokenizer splits anyway
(so the pieces encode as the whole file would; a user tokenizer that merges across such a
newline would differ, deterministically; a file with no such newline, CRLF line ends say,
is one piece). Everything streams: documents are read lazily, encoded in batches
(`Tokenizer.encode_batch`) and written as they come, held-out ones to a side file appended
at the end, so memory does not grow with the corpus (scripts/bench_data.py: about 110 MB
peak for 64 MB of JSON Lines, BPE included).
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import shutil
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from trainer.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "BPE_MIN_VOCAB",
    "BYTE_VOCAB",
    "EOT",
    "DataSource",
    "SPLIT_RULE",
    "TOKENIZER_FILE",
    "TOKEN_FILE",
    "PreparedData",
    "dataset_files",
    "is_eval",
    "glob_base",
    "prepare_data",
    "resolve_data_paths",
    "split_files",
    "token_dtype",
    "train_bpe",
]


class DataSource(Protocol):
    """What this module reads of a job's ``[data]`` section (`trainer.config.DataConfig`
    satisfies it): a protocol, so that neither module imports the other."""

    @property
    def source(self) -> str: ...
    @property
    def paths(self) -> list[str]: ...
    @property
    def dir(self) -> str | None: ...
    @property
    def tokenizer(self) -> str: ...
    @property
    def text_field(self) -> str: ...
    @property
    def max_bytes(self) -> int: ...
    @property
    def eval_fraction(self) -> float: ...


#: How documents are held out for eval, recorded in the run config.
SPLIT_RULE = (
    "sha256-eval-split-v1: a document is held out for eval iff "
    "int.from_bytes(sha256(b'eval-split:' + key.encode()).digest()[:8], 'big') / 2**64 "
    "< eval_fraction, its key being the file's relative path for a text file and "
    "f'{path}#{i}' for record i (0-based) of a .jsonl or .parquet file; if no document is "
    "held out, the one with the smallest sha256(key.encode()) is"
)
EOT = "<|endoftext|>"
BYTE_VOCAB = 256
BPE_MIN_VOCAB = BYTE_VOCAB + 1  # the byte alphabet and <|endoftext|>
TOKEN_FILE = "tokens.bin"
TOKENIZER_FILE = "tokenizer.json"
PIECE_BYTES = 1 << 18  # a text file is read and encoded in pieces of about this size
BATCH_CHARS = 1 << 20  # text per encode_batch call: enough pieces for every core
BATCH_DOCS = 4096
PARQUET_BATCH_ROWS = 1024
PROGRESS_BYTES = 1 << 20  # the least progress worth reporting
_UTF8_LEN = {0xC: 2, 0xD: 2, 0xE: 3, 0xF: 4}  # a UTF-8 sequence's length by its lead byte's top 4 bits
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}

Progress = Callable[[int, int], None]
Piece = tuple[str, "str | bytes", bool, int]  # (document key, data, last piece?, bytes read)


@dataclass(frozen=True)
class PreparedData:
    """A token file and what it holds: the first `train_tokens` ids are the training split,
    the next `eval_tokens` the held-out one."""

    token_file: str  # path of the token file
    dtype: str  # "uint16" | "uint32", little-endian
    train_tokens: int
    eval_tokens: int
    documents: int
    eval_documents: int
    tokenizer_file: str | None  # path of tokenizer.json (None for "bytes")


def token_dtype(vocab_size: int) -> str:
    """The token file's integer type for a vocabulary of `vocab_size` ids."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --- files -----------------------------------------------------------------------------


def dataset_files(cfg: DataSource) -> list[tuple[str, Path]]:
    """(relative posix path in the dataset, file), sorted by that path, whole files until
    `cfg.max_bytes`. ConfigError when nothing matches or not one file fits."""
    if cfg.source == "stdlib":
        files = _stdlib_files()
    elif cfg.source == "files":
        files = _glob_files(cfg.paths)
    else:
        files = _dir_files(Path(os.path.expanduser(cfg.dir or "")))
    taken: list[tuple[str, Path]] = []
    total = 0
    for rel, path in files:
        if not _encodable(rel):  # a key must be UTF-8, as a UnixFS name must
            raise ConfigError(f"data: {path!r}: the file's name is not UTF-8")
        size = path.stat().st_size
        if total + size > cfg.max_bytes:
            break  # whole files only; the cap keeps a prefix in sorted order
        taken.append((rel, path))
        total += size
    if not taken:
        raise ConfigError(
            f"data.max_bytes: not one file fits in {cfg.max_bytes} bytes (the first, "
            f"{files[0][0]}, has {files[0][1].stat().st_size})"
        )
    return taken


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def glob_base(pattern: str) -> str:
    """The longest leading directory of `pattern` with no glob character (a pattern with
    none at all: its parent directory), absolute: where its matches' names start."""
    parts = os.path.abspath(os.path.expanduser(pattern)).split("/")
    magic = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts) - 1)
    return "/".join(parts[:magic]) or "/"


def _glob_files(patterns: list[str]) -> list[tuple[str, Path]]:
    """The regular files `patterns` match, named relative to their glob base (the common
    directory of every pattern's `glob_base`), so a corpus's names, and the dataset's CID,
    do not depend on where it lies."""
    base = os.path.commonpath([glob_base(p) for p in patterns])
    found: dict[str, Path] = {}
    for pattern in patterns:
        for name in glob.glob(os.path.expanduser(pattern), recursive=True):
            path = Path(name)
            if path.is_file():
                rel = os.path.relpath(os.path.abspath(name), base)
                if rel.startswith("../") or rel == "..":
                    raise ConfigError(f"data.paths: {name} lies outside the glob base {base}")
                found[Path(rel).as_posix()] = path
    if not found:
        raise ConfigError(f"data.paths: no files match {patterns}")
    return sorted(found.items())


def resolve_data_paths(data: Any, base: Path) -> Any:
    """A job's `[data]` table (as parsed from TOML) with relative `paths`, `dir` and a
    tokenizer.json path made absolute against `base`, the job file's directory (as `[model]
    init` is), and `~` expanded; anything else is returned unchanged for validation."""
    if not isinstance(data, dict):
        return data
    root = os.path.realpath(base)  # as `[model] init` resolves: the same for dlx submit and its rank tasks

    def absolute(path: object, pattern: bool = False) -> object:
        if not isinstance(path, str) or not path:
            return path
        path = os.path.expanduser(path)
        if os.path.isabs(path):
            return os.path.normpath(path)
        return os.path.normpath(os.path.join(glob.escape(root) if pattern else root, path))

    out = dict(data)
    if isinstance(out.get("paths"), list):
        out["paths"] = [absolute(p, pattern=True) for p in out["paths"]]
    if "dir" in out:
        out["dir"] = absolute(out["dir"])
    if out.get("tokenizer") not in (None, "bytes", "bpe"):
        out["tokenizer"] = absolute(out["tokenizer"])
    return out


def _dir_files(root: Path) -> list[tuple[str, Path]]:
    """Regular files under `root` (no symlinks, nothing hidden), by relative posix path."""
    if not root.is_dir():
        raise ConfigError(f"data.dir: {root} is not a directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file() and not path.is_symlink():
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise ConfigError(f"data.dir: no files under {root}")
    return sorted(found)


# --- documents -------------------------------------------------------------------------


def _kind(rel: str) -> str:
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(Path(rel).suffix.lower(), "text")


def _pieces(files: list[tuple[str, Path]], field: str, decode: bool) -> Iterator[Piece]:
    """Every document of every file, in order, as pieces; the byte count is cumulative."""
    done = 0
    for rel, path in files:
        kind = _kind(rel)
        if kind == "text":
            stream: Iterator[Piece] = _text_pieces(rel, path, decode)
        elif kind == "jsonl":
            stream = _jsonl_records(rel, path, field)
        else:
            stream = _parquet_records(rel, path, field)
        for key, data, last, pos in stream:
            yield key, data, last, done + pos
        done += path.stat().st_size


def _safe_cut(buf: bytes, start: int) -> int:
    """Where a text piece may end: just after the last newline at or past `start` whose
    neighbours are both characters that are not whitespace (0 if none). Byte-level BPE's
    pre-tokenizer splits there anyway, so the pieces encode as the whole text would."""
    i = buf.rfind(b"\n", max(start, 1), len(buf) - 1)
    while i > 0 and i >= start:
        after = _UTF8_LEN.get(buf[i + 1] >> 4, 1)
        j = i - 1
        while j > 0 and i - j < 4 and 0x80 <= buf[j] < 0xC0:  # back over continuation bytes
            j -= 1
        if i + 1 + after <= len(buf):
            before = buf[j:i].decode("utf-8", "replace")
            if not before.isspace() and not buf[i + 1:i + 1 + after].decode("utf-8", "replace").isspace():
                return i + 1
        i = buf.rfind(b"\n", max(start, 1), i)
    return 0


def _text_pieces(rel: str, path: Path, decode: bool) -> Iterator[Piece]:
    """A text file as one document in pieces: bytes, or strict UTF-8 text if `decode`."""
    buf, pos, line, scanned = b"", 0, 1, 0
    with open(path, "rb") as f:
        while more := f.read(PIECE_BYTES):
            buf += more
            cut = _safe_cut(buf, scanned) if decode else len(buf)
            scanned = max(0, len(buf) - 5)  # no cut before here (a newline whose next
            # character is not all read yet is looked at again)
            if cut:
                pos += cut
                yield rel, _decoded(buf[:cut], path, line) if decode else buf[:cut], False, pos
                line += buf.count(b"\n", 0, cut)
                buf, scanned = buf[cut:], max(0, scanned - cut)
    yield rel, _decoded(buf, path, line) if decode else buf, True, pos + len(buf)


def _decoded(piece: bytes, path: Path, line: int) -> str:
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError as err:
        at = line + piece.count(b"\n", 0, err.start)
        raise ConfigError(
            f"data.tokenizer: {path}: line {at}: not valid UTF-8 (byte 0x{piece[err.start]:02x}); "
            "only the bytes tokenizer reads any bytes"
        ) from None


def _blank(raw: bytes) -> bool:
    return not raw.strip()


def _jsonl_records(rel: str, path: Path, field: str) -> Iterator[Piece]:
    """Record i of a JSON Lines file is document f"{rel}#{i}", its text `field`."""
    pos, i = 0, 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            pos += len(raw)
            if _blank(raw):
                continue
            yield f"{rel}#{i}", _jsonl_text(raw, path, n, field), True, pos
            i += 1


def _jsonl_text(raw: bytes, path: Path, n: int, field: str) -> str:
    where = f"{path}: line {n}"
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"data: {where}: not valid UTF-8 (byte 0x{raw[err.start]:02x})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"data: {where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"data: {where}: a JSON {type(record).__name__}, not an object")
    if field not in record:
        raise ConfigError(f'data.text_field: {where}: no field "{field}"')
    text = record[field]
    if not isinstance(text, str):
        raise ConfigError(
            f'data.text_field: {where}: field "{field}" is {_json_type(text)}, not a string'
        )
    if (b"\\ud" in raw or b"\\uD" in raw) and not _encodable(text):
        raise ConfigError(f'data: {where}: field "{field}" holds a lone surrogate (not UTF-8)')
    return text


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parquet_file(path: Path, field: str) -> Any:
    """The Parquet file at `path`, refused unless `field` is a string column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"data: {path}: not a Parquet file ({err})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise ConfigError(
            f'data.text_field: {path}: no column "{field}" (columns: {", ".join(schema.names)})'
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
        raise ConfigError(f'data.text_field: {path}: column "{field}" is {kind}, not a string')
    return pf


def _parquet_records(rel: str, path: Path, field: str) -> Iterator[Piece]:
    """Row i of a Parquet file is document f"{rel}#{i}", its text the column `field`."""
    import pyarrow as pa

    pf = _parquet_file(path, field)
    size, rows, i = path.stat().st_size, max(1, pf.metadata.num_rows), 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            texts = batch.column(0).to_pylist()
            for text in texts:
                if text is None:
                    raise ConfigError(
                        f'data.text_field: {path}: row {i}: column "{field}" is null, not a string'
                    )
                i += 1
                yield f"{rel}#{i - 1}", text, True, size * i // rows
    except pa.ArrowException as err:
        raise ConfigError(f"data: {path}: unreadable Parquet ({err})") from None


def _keys(rel: str, path: Path, field: str) -> Iterator[str]:
    """The file's document keys, without reading the documents."""
    kind = _kind(rel)
    if kind == "text":
        yield rel
        return
    if kind == "jsonl":
        with open(path, "rb") as f:
            count = sum(1 for raw in f if not _blank(raw))
    else:
        count = _parquet_file(path, field).metadata.num_rows
    for i in range(count):
        yield f"{rel}#{i}"


# --- the split -------------------------------------------------------------------------


def is_eval(key: str, fraction: float) -> bool:
    """`SPLIT_RULE`'s hash test for one document key."""
    h = int.from_bytes(hashlib.sha256(b"eval-split:" + key.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def _forced_eval(files: list[tuple[str, Path]], cfg: DataSource) -> str | None:
    """The key `SPLIT_RULE` holds out when the hash holds out nothing (a tiny corpus), else
    None; stops reading at the first document the hash holds out."""
    best: tuple[bytes, str] | None = None
    for rel, path in files:
        for key in _keys(rel, path, cfg.text_field):
            if is_eval(key, cfg.eval_fraction):
                return None
            h = hashlib.sha256(key.encode()).digest()
            best = min(best, (h, key)) if best else (h, key)
    if best is None:
        raise ConfigError(f"data: the dataset has no documents ({len(files)} files)")
    return best[1]


def _held_out(cfg: DataSource, forced: str | None) -> Callable[[str], bool]:
    return lambda key: key == forced or is_eval(key, cfg.eval_fraction)


def split_files(cfg: DataSource) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The dataset's files that hold training documents, and those that hold held-out ones
    (a JSON Lines or Parquet file may be in both)."""
    files = dataset_files(cfg)
    held = _held_out(cfg, _forced_eval(files, cfg))
    train, held_files = [], []
    for rel, path in files:
        flags = {held(key) for key in _keys(rel, path, cfg.text_field)}
        if False in flags:
            train.append(rel)
        if True in flags:
            held_files.append(rel)
    return tuple(train), tuple(held_files)


# --- tokenizers ------------------------------------------------------------------------


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` ids trained on `texts`: `<|endoftext|>` is
    id 0, the 256 byte symbols follow, then the merges. Deterministic: the same texts give
    the same tokenizer.json, whatever the thread count."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _user_tokenizer(path: Path, vocab_size: int) -> tuple[Tokenizer, bytes]:
    """The tokenizer.json at `path` and its bytes; ConfigError unless it is one that fits
    `vocab_size`."""
    from tokenizers import Tokenizer

    from trainer.bounded import JSON_LIMIT, read_bounded

    try:
        blob = read_bounded(path, JSON_LIMIT, "data.tokenizer:")
    except FileNotFoundError:
        raise ConfigError(f"data.tokenizer: {path} is not a tokenizer.json (no such file)") from None
    try:
        tok = Tokenizer.from_str(blob.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        why = " ".join(str(err).split())[:120]
        raise ConfigError(f"data.tokenizer: {path} is not a tokenizer.json ({why})") from None
    ids = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    size = max(ids, tok.get_vocab_size(with_added_tokens=True))
    if size > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({size}: {path})"
        )
    return tok, blob


def _tokenizer(cfg: DataSource, vocab_size: int, files: list[tuple[str, Path]],
               held: Callable[[str], bool], report: _Report) -> tuple[Tokenizer, bytes]:
    """The text tokenizer `cfg` names and its tokenizer.json bytes ("bpe": trained here on
    the training split, reading every file once)."""
    if cfg.tokenizer != "bpe":
        return _user_tokenizer(Path(os.path.expanduser(cfg.tokenizer)), vocab_size)
    if vocab_size < BPE_MIN_VOCAB:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({BPE_MIN_VOCAB}: data.tokenizer = 'bpe' needs the 256 bytes and {EOT})"
        )
    counts = [0, 0]

    def training_texts() -> Iterator[str]:
        for key, text, last, done in _pieces(files, cfg.text_field, decode=True):
            report(done)
            if not held(key):
                counts[0] += last
                yield str(text)
            else:
                counts[1] += last

    tok = train_bpe(training_texts(), vocab_size)
    _check_split(counts[0], counts[1])
    return tok, tok.to_str(pretty=True).encode()


def _check_split(train_docs: int, eval_docs: int) -> None:
    if train_docs + eval_docs == 1:
        raise ConfigError("data: the dataset has 1 document; it needs at least 2 (one is held "
                          "out for eval)")
    if not train_docs:
        raise ConfigError("data.eval_fraction: every document was held out for eval; lower it")


class _Report:
    """Progress for one pass over the files: `progress(offset + done, total)`, at most once
    per `PROGRESS_BYTES` read (a progress bar need not redraw for every record)."""

    def __init__(self, progress: Progress, offset: int, total: int) -> None:
        self.progress, self.offset, self.total, self.last = progress, offset, total, -PROGRESS_BYTES

    def __call__(self, done: int) -> None:
        if done - self.last >= PROGRESS_BYTES:
            self.last = done
            self.progress(self.offset + done, self.total)


# --- the token file --------------------------------------------------------------------


class _TokenSink:
    """Writes token ids as they come: training documents to the token file, held-out ones
    to a side file that is appended at the end."""

    def __init__(self, files: tuple[BinaryIO, BinaryIO], dtype: str, eot: int | None) -> None:
        import numpy as np

        self.np = np
        self.files = files
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.eot = [] if eot is None else [eot]
        self.tokens = [0, 0]
        self.documents = [0, 0]

    def write_bytes(self, parts: list[tuple[bool, bytes, bool]]) -> None:
        """The bytes tokenizer: a token per byte, no separator."""
        for side in (0, 1):
            blob = b"".join(data for held, data, _ in parts if held == side)
            self.documents[side] += sum(last for held, _, last in parts if held == side)
            self._put(side, self.np.frombuffer(blob, dtype=self.np.uint8).astype(self.dtype))

    def write_ids(self, parts: list[tuple[bool, list[int], bool]]) -> None:
        """Encoded pieces: ids, and `<|endoftext|>` after a document's last piece."""
        for side in (0, 1):
            lists = [ids + self.eot if last else ids for held, ids, last in parts if held == side]
            self.documents[side] += sum(last for held, _, last in parts if held == side)
            count = sum(map(len, lists))
            flat = itertools.chain.from_iterable(lists)
            self._put(side, self.np.fromiter(flat, dtype=self.dtype, count=count))

    def _put(self, side: int, tokens: Any) -> None:
        if tokens.size:
            self.files[side].write(tokens.tobytes())
            self.tokens[side] += int(tokens.size)


def _write_tokens(pieces: Iterator[Piece], held: Callable[[str], bool], tok: Tokenizer | None,
                  sink: _TokenSink, report: _Report) -> None:
    """Batch the pieces (text up to `BATCH_CHARS`), encode each batch, write it."""
    batch: list[tuple[bool, Any, bool]] = []
    chars = 0

    def flush() -> None:
        if tok is None:
            sink.write_bytes([(h, d if isinstance(d, bytes) else d.encode(), e) for h, d, e in batch])
        else:
            encodings = tok.encode_batch([d for _, d, _ in batch], add_special_tokens=False)
            sink.write_ids([(h, enc.ids, e) for (h, _, e), enc in zip(batch, encodings, strict=True)])
        batch.clear()

    for key, data, last, done in pieces:
        batch.append((held(key), data, last))
        chars += len(data)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            flush()
            chars = 0
            report(done)
    flush()


def prepare_data(cfg: DataSource, vocab_size: int, out_dir: Path,
                 progress: Progress | None = None) -> PreparedData:
    """Tokenize the dataset `cfg` names into out_dir/tokens.bin (and out_dir/tokenizer.json
    unless the tokenizer is "bytes"). Deterministic: the same inputs give the same bytes.
    Writes through temporary names: on any error nothing is left behind. `progress(done,
    total)` gets the bytes read so far of those to read ("bpe" reads the files twice)."""
    made = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        return _prepare(cfg, vocab_size, out_dir, progress or (lambda done, total: None))
    except BaseException:
        for name in (TOKEN_FILE, "eval", TOKENIZER_FILE):
            _temp(out_dir, name).unlink(missing_ok=True)
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _temp(out_dir: Path, name: str) -> Path:
    return out_dir / f".{name}.{os.getpid()}.tmp"


def _prepare(cfg: DataSource, vocab_size: int, out_dir: Path, progress: Progress) -> PreparedData:
    files = dataset_files(cfg)
    held = _held_out(cfg, _forced_eval(files, cfg))
    size = sum(path.stat().st_size for _, path in files)
    base = size if cfg.tokenizer == "bpe" else 0  # bytes read to train the BPE
    tok: Tokenizer | None = None
    if cfg.tokenizer == "bytes":
        if vocab_size < BYTE_VOCAB:
            raise ConfigError(f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's "
                              f"vocabulary ({BYTE_VOCAB}: byte values)")
    else:
        tok, blob = _tokenizer(cfg, vocab_size, files, held, _Report(progress, 0, base + size))
        _temp(out_dir, TOKENIZER_FILE).write_bytes(blob)
    dtype = token_dtype(vocab_size)
    tokens_tmp, eval_tmp = _temp(out_dir, TOKEN_FILE), _temp(out_dir, "eval")
    with open(tokens_tmp, "wb") as train_f, open(eval_tmp, "w+b") as eval_f:
        sink = _TokenSink((train_f, eval_f), dtype, tok.token_to_id(EOT) if tok is not None else None)
        pieces = _pieces(files, cfg.text_field, decode=tok is not None)
        _write_tokens(pieces, held, tok, sink, _Report(progress, base, base + size))
        eval_f.seek(0)
        shutil.copyfileobj(eval_f, train_f, 1 << 20)
    eval_tmp.unlink()
    _check_split(*sink.documents)
    if not sink.tokens[0] or not sink.tokens[1]:
        side = "training" if not sink.tokens[0] else "held-out"
        raise ConfigError(f"data: the dataset's {side} documents hold no tokens")
    os.replace(tokens_tmp, out_dir / TOKEN_FILE)
    if tok is not None:
        os.replace(_temp(out_dir, TOKENIZER_FILE), out_dir / TOKENIZER_FILE)
    progress(base + size, base + size)
    return PreparedData(
        token_file=str(out_dir / TOKEN_FILE),
        dtype=dtype,
        train_tokens=sink.tokens[0],
        eval_tokens=sink.tokens[1],
        documents=sum(sink.documents),
        eval_documents=sink.documents[1],
        tokenizer_file=None if tok is None else str(out_dir / TOKENIZER_FILE),
    )
