"""The corpus and its deterministic shards.

The corpus is a token file (trainer/dataset.py prepares it from the dataset `[data]`
names): the training split's tokens, then the held-out split's, memory-mapped here, never
read whole. `load_corpus` reads `cfg.prepared` when the launcher set it, else prepares into
a temporary directory of this process, once per config (`with_prepared_data` prepares once
in a launcher, so that spawned ranks share one token file rather than each making one).

Replica r at outer step t trains on `Corpus.shard(seed, r, t, ...)`: H x B windows of
T + 1 tokens drawn from the training split with a generator seeded from sha256(seed, r, t).
The shard's digest, the `dataShard` of the attestation, is sha256 over those (H, B, T + 1)
tokens in the token file's dtype (uint16 or uint32), little-endian, C order
(`shard_digest`): anyone holding the token file can re-derive it (`Corpus.from_prepared`).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import shutil
import tempfile
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from trainer.config import DataConfig, JobConfig
from trainer.dataset import BYTE_VOCAB, PreparedData, prepare_data, split_files, token_dtype
from trainer.errors import ConfigError

__all__ = [
    "Corpus",
    "ShardData",
    "derive_seed",
    "load_corpus",
    "shard_digest",
    "with_prepared_data",
]

CACHED_CORPORA = 4  # prepared corpora a process keeps (each a token file in its temp dir)


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from sha256 over the parts (stable across processes, unlike hash())."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def shard_digest(tokens: torch.Tensor, dtype: str) -> bytes:
    """32-byte sha256 over token ids as `dtype` ("uint16" | "uint32"), little-endian, C order."""
    arr = tokens.to(torch.int64).contiguous().numpy().astype(np.dtype(dtype).newbyteorder("<"))
    return hashlib.sha256(arr.tobytes()).digest()


@dataclass(frozen=True)
class ShardData:
    """One replica's tokens for one round: (H, B, T + 1) int64, and their sha256."""

    tokens: torch.Tensor
    digest: bytes


@dataclass(frozen=True)
class Corpus:
    """A token file's two splits, memory-mapped (copy-on-write: nothing is read until used)."""

    train: torch.Tensor  # (N_train,) token ids in the token file's dtype
    eval: torch.Tensor  # (N_eval,) held-out token ids
    prepared: PreparedData
    train_files: tuple[str, ...] = ()  # files holding training documents, when known
    eval_files: tuple[str, ...] = ()  # files holding held-out documents, when known

    @classmethod
    def from_prepared(cls, p: PreparedData) -> Corpus:
        """The corpus in `p.token_file`; ConfigError if the file does not hold p's tokens."""
        dtype = np.dtype(p.dtype).newbyteorder("<")
        path = Path(p.token_file)
        want = (p.train_tokens + p.eval_tokens) * dtype.itemsize
        have = path.stat().st_size if path.is_file() else None
        if have != want or not p.train_tokens or not p.eval_tokens:
            raise ConfigError(
                f"data: token file {path} has {have} bytes, not the {want} of "
                f"{p.train_tokens} + {p.eval_tokens} {p.dtype} tokens"
            )
        mm = np.memmap(path, dtype=dtype, mode="c")
        split = p.train_tokens
        return cls(train=torch.from_numpy(mm[:split]), eval=torch.from_numpy(mm[split:]), prepared=p)

    @functools.cached_property
    def digest(self) -> str:
        """sha256 hex of the token file."""
        h = hashlib.sha256()
        with open(self.prepared.token_file, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    def shard(
        self,
        seed: int,
        replica: int,
        outer_step: int,
        inner_steps: int,
        batch_size: int,
        seq_len: int,
    ) -> ShardData:
        """The tokens replica `replica` trains on in the round that produces `outer_step`."""
        g = torch.Generator().manual_seed(derive_seed("shard", seed, replica, outer_step))
        tokens = _windows(self.train, g, inner_steps * batch_size, seq_len + 1)
        tokens = tokens.view(inner_steps, batch_size, seq_len + 1)
        return ShardData(tokens=tokens.long(), digest=shard_digest(tokens, self.prepared.dtype))

    def eval_batches(
        self, n_batches: int, batch_size: int, seq_len: int, seed: int = 0
    ) -> torch.Tensor:
        """Fixed held-out batches, (n_batches, B, T + 1) int64."""
        g = torch.Generator().manual_seed(derive_seed("eval", seed))
        tokens = _windows(self.eval, g, n_batches * batch_size, seq_len + 1)
        return tokens.view(n_batches, batch_size, seq_len + 1).long()


def _windows(tokens: torch.Tensor, g: torch.Generator, n: int, length: int) -> torch.Tensor:
    if tokens.numel() < length:
        raise ConfigError(
            f"data: corpus part has {tokens.numel()} tokens, fewer than one window ({length})"
        )
    starts = torch.randint(0, tokens.numel() - length + 1, (n,), generator=g)  # (n,)
    return tokens[starts[:, None] + torch.arange(length)]  # (n, length), the file's dtype


_cache: OrderedDict[tuple, Corpus] = OrderedDict()


@functools.cache
def _cache_root() -> Path:
    """This process's temporary directory of prepared corpora, removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="dlx-data-"))
    atexit.register(shutil.rmtree, root, True)
    return root


def load_corpus(cfg: DataConfig, vocab_size: int | None = None) -> Corpus:
    """The corpus `cfg` describes for a model of `vocab_size` ids (needed unless the
    tokenizer is "bytes"): `cfg.prepared`'s token file, memory-mapped, or one prepared in
    this process's temporary directory once per config."""
    if cfg.prepared is not None:
        return Corpus.from_prepared(cfg.prepared)
    if vocab_size is None and cfg.tokenizer != "bytes":
        raise ValueError(f"load_corpus: data.tokenizer = {cfg.tokenizer!r} needs the vocab_size")
    vocab = BYTE_VOCAB if vocab_size is None else vocab_size
    key = (cfg.source, tuple(cfg.paths), cfg.dir, cfg.max_bytes, cfg.eval_fraction,
           cfg.tokenizer, cfg.text_field, token_dtype(vocab) if cfg.tokenizer == "bytes" else vocab)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    out = _cache_root() / hashlib.sha256(repr(key).encode()).hexdigest()[:16]
    train_files, eval_files = split_files(cfg)
    corpus = replace(Corpus.from_prepared(prepare_data(cfg, vocab, out)),
                     train_files=train_files, eval_files=eval_files)
    _cache[key] = corpus
    if len(_cache) > CACHED_CORPORA:
        _, old = _cache.popitem(last=False)
        shutil.rmtree(Path(old.prepared.token_file).parent, ignore_errors=True)
    return corpus


J = TypeVar("J", bound=JobConfig)


def with_prepared_data(job: J) -> J:
    """`job` with `data.prepared` set (prepared here once if it was not), for a launcher to
    pass to the ranks it spawns: they then memory-map one token file and never race."""
    if job.data.prepared is not None:
        return job
    corpus = load_corpus(job.data, job.model.vocab_size)
    return job.with_prepared(corpus.prepared)
