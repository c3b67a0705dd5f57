"""The corpus and its deterministic shards.

The default corpus is the Python standard library's `.py` sources (found through
`sysconfig`, so every machine has it with no download); `source = "files"` takes user
globs instead. Files are sorted by relative path and taken whole until `max_bytes`; each
file goes to the held-out eval set or the training set by a stable hash of its relative
path. Tokens are bytes (vocabulary 256).

Replica r at outer step t trains on `Corpus.shard(seed, r, t, ...)`: H x B windows of
T + 1 tokens drawn with a generator seeded from sha256(seed, r, t). The shard's sha256
is the data-shard hash that goes into the attestation.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config import DataConfig
from trainer.errors import ConfigError

__all__ = ["Corpus", "ShardData", "corpus_digest", "derive_seed", "load_corpus", "shard_digest"]

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from sha256 over the parts (stable across processes, unlike hash())."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1


def shard_digest(tokens: torch.Tensor) -> bytes:
    """32-byte sha256 over a token tensor's bytes, as uint8 in C order."""
    return hashlib.sha256(tokens.to(torch.uint8).contiguous().numpy().tobytes()).digest()


@dataclass(frozen=True)
class ShardData:
    """One replica's tokens for one round: (H, B, T + 1) int64, and their sha256."""

    tokens: torch.Tensor
    digest: bytes


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # (N_train,) uint8, training files concatenated
    eval: torch.Tensor  # (N_eval,) uint8, held-out files concatenated
    train_files: tuple[str, ...]
    eval_files: tuple[str, ...]
    digest: str  # sha256 hex over (relative path, bytes) of every file taken

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
        return ShardData(tokens=tokens.long(), digest=shard_digest(tokens))

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
    return tokens[starts[:, None] + torch.arange(length)]  # (n, length)


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


def _glob_files(patterns: list[str]) -> list[tuple[str, Path]]:
    found: dict[str, Path] = {}
    for pattern in patterns:
        for name in glob.glob(os.path.expanduser(pattern), recursive=True):
            path = Path(name)
            if path.is_file():
                found[path.as_posix()] = path
    if not found:
        raise ConfigError(f"data.paths: no files match {patterns}")
    return sorted(found.items())


def _is_eval(rel: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(b"eval-split:" + rel.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


@functools.lru_cache(maxsize=4)
def _load(source: str, paths: tuple[str, ...], max_bytes: int, eval_fraction: float) -> Corpus:
    files = _stdlib_files() if source == "stdlib" else _glob_files(list(paths))
    taken: list[tuple[str, bytes]] = []
    total = 0
    for rel, path in files:
        size = path.stat().st_size
        if total + size > max_bytes:
            break  # whole files only; the cap keeps a prefix in sorted order
        taken.append((rel, path.read_bytes()))
        total += size
    if len(taken) < 2:
        raise ConfigError(
            f"data.max_bytes: the corpus needs at least 2 files, {len(taken)} fit in {max_bytes} bytes"
        )
    digest = hashlib.sha256()
    for rel, blob in taken:
        digest.update(rel.encode() + b"\0" + len(blob).to_bytes(8, "big") + blob)
    is_eval = [_is_eval(rel, eval_fraction) for rel, _ in taken]
    if not any(is_eval):  # a tiny corpus: hold out the file the hash likes best
        is_eval[
            min(range(len(taken)), key=lambda i: hashlib.sha256(taken[i][0].encode()).digest())
        ] = True
    if all(is_eval):
        raise ConfigError("data.eval_fraction: every file was held out for eval; lower it")

    def cat(parts: list[bytes]) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(b"".join(parts), dtype=np.uint8).copy())

    return Corpus(
        train=cat([b for (_, b), e in zip(taken, is_eval, strict=True) if not e]),
        eval=cat([b for (_, b), e in zip(taken, is_eval, strict=True) if e]),
        train_files=tuple(r for (r, _), e in zip(taken, is_eval, strict=True) if not e),
        eval_files=tuple(r for (r, _), e in zip(taken, is_eval, strict=True) if e),
        digest=digest.hexdigest(),
    )


def load_corpus(cfg: DataConfig) -> Corpus:
    """The corpus `cfg` describes (read once per process, then cached)."""
    return _load(cfg.source, tuple(cfg.paths), cfg.max_bytes, cfg.eval_fraction)


def corpus_digest(cfg: DataConfig) -> str:
    """sha256 hex over the relative paths and bytes of the corpus files, for the config record."""
    return load_corpus(cfg).digest
