"""What training hands to the outside world: the `StepSink` contract and its payloads.

The engine calls a `StepSink` once at genesis, once per outer step and now and then with
progress; the sink (content-addressed storage, a chain client, a test recorder) lives in
the parent process, so it need not be picklable. All tensors travel as safetensors bytes
with sorted keys and no metadata, so identical tensors give identical bytes (and CIDs).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:  # torch is imported where tensors are: a launcher handles only bytes
    import torch

__all__ = [
    "Blob",
    "Contribution",
    "GenesisArtifacts",
    "KERNELS_KEY",
    "MERGE_STEP_KEY",
    "Progress",
    "Spill",
    "StageShard",
    "StepArtifacts",
    "StepSink",
    "StoredTensors",
    "bytes_to_tensors",
    "code_hash",
    "param_tensors",
    "same_tensors",
    "spill_directory",
    "tensor_views",
    "tensors_to_bytes",
    "to_bytes",
]


@dataclass(frozen=True)
class StageShard:
    """New outer state of one pipeline stage."""

    stage: int
    # safetensors bytes: keys "param/<name>" (outer params) and "momentum/<name>" (outer
    # Nesterov buffer), sorted, float32, no metadata
    data: bytes


@dataclass(frozen=True)
class Contribution:
    """What replica r's stage s contributed to outer step t: exactly the bytes it sent.

    `data` is safetensors (sorted keys, no metadata), one key family per parameter <name>
    (with `outer.fragments` > 1, per parameter of step t's fragment only:
    `trainer.diloco.fragment_groups`) (the decoder is `trainer.compress.decode_contribution`;
    shapes come from the shard):
    - compression `none`: ``delta/<name>`` float32, theta_outer - theta_local as is;
    - otherwise ``meta/<name>`` int32 [codec, bits, rank] (codec 1 = quantised, 2 = low
      rank), plus for codec 1 ``q/<name>`` uint8 (rows, ceil(cols*bits/8)) and
      ``q_scale/<name>`` float32 (rows,), and for codec 2 ``u/<name>`` (rank, ceil(m*bits/8))
      with ``u_scale/<name>`` (rank,) and ``v/<name>`` (rank, ceil(n*bits/8)) with
      ``v_scale/<name>`` (rank,). A tensor is viewed as (shape[0], rest), a 1-D tensor as
      (1, n); b-bit values are stored offset by 2**(b-1)-1, 8/b per byte, low bits first;
      value = (stored - (2**(b-1)-1)) * scale of its row; a low-rank tensor is
      sum_k outer(u_k, v_k), summed in k order. Codec 3 (sparse) and codec 4 (2-bit values
      in the gaps layout, one ``gaps/stream`` per payload) are in docs/FORMATS.md.
    The new shard of step t is `apply_outer_step(shard of step t-1, [data of r = 0..R-1], cfg, t)`.
    With `outer.delay = 1` the round that produced step t's contribution started, under
    the restart rule, from the shard of step t-2 (genesis for t <= 2); under the eager and
    partial rules from weights derived from committed data (trainer/diloco.py; the
    verifier re-derives them). The contribution carries that round's data shard and loss. Under `parallel.sync = "allreduce"` (the baseline) `data` is an empty
    safetensors blob: there is no outer step to recompute. An adaptive payload whose byte
    budget capped it also holds ``adaptive/budget`` (float64 (1,)), which replay re-uses.

    `start_state` is what replay verification starts from: this rank's state at the start
    of the round that produced `data` (`trainer.rounds.round_state`: local weights, inner
    optimizer state, compressor state; safetensors, sorted keys; under the partial rule
    also ``round/merge_step``, int64 (1,), the inner step the round merged before, -1 for
    none). Empty for the baseline.

    `new_shard` is the digest this rank computed of its own stage's new outer shard after the
    outer step (`RankControl.shard_digest` of the `StageShard.data` bytes it would publish):
    the replicas of a stage co-sign it on the ledger, so each computes it from its own state.
    """

    replica: int
    stage: int
    data: bytes  # safetensors bytes of the payload sent (layout above)
    data_shard: bytes  # 32-byte sha256 of the round's tokens for this replica
    loss: float  # mean training loss of this replica over the round's H inner steps
    start_state: bytes = b""  # the round's start state (see above), for replay
    new_shard: bytes = b""  # 32-byte digest of this rank's own new stage shard (see above)


@dataclass(frozen=True)
class GenesisArtifacts:
    stages: list[StageShard]


@dataclass(frozen=True)
class StepArtifacts:
    step: int  # 1-based outer step
    stages: list[StageShard]  # stage order
    # slot order position*S + s over the step's present replicas (all R: r*S + s); each
    # Contribution.replica is the replica id
    contributions: list[Contribution]
    # at least eval_loss, train_loss, tokens (cumulative), inner_steps (cumulative), wall_s;
    # also (cumulative, rank 0 aggregates): bytes_sent (every rank, bytes that crossed
    # replicas), payload_bytes (this step's contributions), compute_s, rounds_wall_s,
    # compress_s, comm_wait_s, modelled_comm_s (slowest rank), peak_rss_mb (largest rank),
    # extra_memory_bytes and param_bytes (one replica), and for compressed runs rel_error,
    # rank_mean, bits_mean, residual_norm (mean over ranks, latest step); train_loss is the
    # mean over the present replicas, tokens counts what the present replicas of every step
    # trained
    metrics: dict[str, float]
    # The replica ids whose contributions this step averages, ascending: () when all R took
    # part (a full run's steps, as before elastic training), else the membership epoch's.
    replicas: tuple[int, ...] = ()
    epoch: int = 0  # the membership epoch (trainer.control.Membership) that computed the step


@dataclass(frozen=True)
class Progress:
    """One inner step of replica 0, reported by global rank 0 (every inner step; with
    pipeline stages in batches of `trainer.metrics.PROGRESS_EVERY`). Only what the step
    already computed: reporting adds no synchronisation beyond that batch's broadcast."""

    outer_step: int  # 1-based outer step being trained
    inner_step: int  # 1-based inner step within it
    loss: float  # replica 0's training loss at that inner step
    outer_steps: int  # T
    inner_steps: int  # H
    lr: float = 0.0  # the inner learning rate of that step (after warmup)
    tokens_per_s: float = 0.0  # tokens all replicas trained per second over the last report's steps
    rank0_bytes_sent: float = 0.0  # cumulative bytes rank 0 sent to other replicas (step records sum every rank)
    eta_s: float = 0.0  # seconds left at the run's average pace so far

    @property
    def global_step(self) -> int:
        """1-based inner step of the whole run."""
        return (self.outer_step - 1) * self.inner_steps + self.inner_step

    def record(self) -> dict[str, float | int | str]:
        """The line `metrics.jsonl` holds for this inner step (the keys `workers.run.sink` documents)."""
        return {"kind": "inner", "step": self.outer_step, "inner_step": self.inner_step,
                "global_step": self.global_step, "loss": self.loss, "lr": self.lr,
                "tokens_per_s": self.tokens_per_s, "rank0_bytes_sent": self.rank0_bytes_sent, "eta_s": self.eta_s}


class StepSink(Protocol):
    """Where a run's steps go. A sink may also have a `shard_digest(bytes) -> bytes`
    attribute, a picklable module-level function: the launcher hands it to every rank
    (`RankControl.shard_digest`), which then reports the digest of its own new stage shard."""

    def on_genesis(self, genesis: GenesisArtifacts) -> None: ...
    def on_step(self, step: StepArtifacts) -> None: ...
    def on_progress(self, progress: Progress) -> None: ...


MERGE_STEP_KEY = "round/merge_step"  # a partial-rule round state: the inner step it merged before
KERNELS_KEY = "round/kernels"  # a round state: the trainer's kernel fingerprint, UTF-8 (trainer/kernels.py)


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """safetensors bytes with sorted keys and no metadata: same tensors, same bytes."""
    from trainer import tensorbytes

    ordered = {k: tensors[k].detach().cpu().contiguous() for k in sorted(tensors)}
    return tensorbytes.encode(ordered)


def bytes_to_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `tensors_to_bytes`; keys come back sorted, tensors writable (they view
    one private copy of the data)."""
    from trainer import tensorbytes

    loaded = tensorbytes.decode(data)
    return {k: loaded[k] for k in sorted(loaded)}


def code_hash() -> bytes:
    """32-byte sha256 over the trainer package's .py sources (sorted relative path + bytes)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root).as_posix().encode()
        blob = path.read_bytes()
        h.update(len(rel).to_bytes(4, "big") + rel + len(blob).to_bytes(8, "big") + blob)
    return h.digest()


def param_tensors(data: bytes) -> dict[str, torch.Tensor]:
    """The ``param/`` tensors of a round state or stage shard, by parameter name: views of
    `data` where it allows (`tensor_views`; read them, do not write to them)."""
    tensors = tensor_views(data)
    return {k.removeprefix("param/"): tensors[k] for k in tensors if k.startswith("param/")}


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bits."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and bool((a[k] == b[k]).all()) for k in a)


# -- spilled bytes: what a rank hands its launcher without holding it ------------------------


class Blob:
    """Bytes a rank keeps in a file of its launcher's spill directory (`Spill`) rather than in
    its memory: a round-start state or a stage shard on its way to the launcher's sink.

    Pickled by the multiprocessing queue that carries a rank's events to its launcher (on
    the same host), a Blob arrives as plain `bytes`: the unpickler reads the file and removes
    it, so the sink sees exactly the bytes it always did (`Contribution.start_state`,
    `StageShard.data`). Pickled otherwise (`torch.distributed`'s object collectives between
    the ranks of one local run, which share the spill directory) it arrives as a Blob of the
    same file. Each pickling takes a hard link of its own, which its unpickler owns; a
    Blob's file is removed when the Blob is collected, and the launcher removes the whole
    directory at the end, with anything never unpickled."""

    __slots__ = ("__weakref__", "_finalizer", "path", "size")

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self._finalizer = weakref.finalize(self, _unlink, path)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"Blob({self.path!r}, {self.size})"

    def read(self) -> bytes:
        """The bytes (one copy, in this process)."""
        with open(self.path, "rb") as fh:
            return fh.read()

    def read_at(self, offset: int, count: int) -> bytearray:
        """`count` bytes from `offset`, into a buffer of their own."""
        out = bytearray(count)
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(offset)
            view, done = memoryview(out), 0
            while done < count:
                n = fh.readinto(view[done:])
                if not n:
                    raise ValueError(f"{self.path}: {count} bytes at {offset} run past its end")
                done += n
        return out

    def link(self) -> str:
        """A new name for this file (a hard link in the same directory), for a receiver to own."""
        new = f"{self.path}.{uuid.uuid4().hex[:12]}"
        os.link(self.path, new)
        return new

    def __reduce__(self) -> tuple:
        return _adopt, (self.link(), self.size)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _adopt(path: str, size: int) -> Blob:
    return Blob(path, size)


def _take(path: str) -> bytes:
    """The launcher's side: the bytes of a Blob's link, which is then removed."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        _unlink(path)


ForkingPickler.register(Blob, lambda blob: (_take, (blob.link(),)))


class Spill:
    """Writes a rank's large bytes into `directory` (its launcher's, shared by the ranks of
    one local run, removed by the launcher at the end) and returns them as `Blob`s."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def tensors(self, tensors: dict[str, torch.Tensor]) -> Blob:
        """`tensors_to_bytes(tensors)`, written tensor by tensor into a file."""
        from trainer import tensorbytes

        return self._written(lambda fd: tensorbytes.write(tensors, fd))

    def bytes(self, data: bytes) -> Blob:
        """`data`, written into a file."""
        from trainer import tensorbytes

        def write(fd: int) -> int:
            tensorbytes.write_all(fd, memoryview(data))
            return len(data)

        return self._written(write)

    def _written(self, write: Callable[[int], int]) -> Blob:
        path = os.path.join(self.directory, f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            size = write(fd)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return Blob(path, size)


def spill_directory(kind: str) -> tempfile.TemporaryDirectory:
    """A temporary directory for spilled bytes (`dlx-<kind>-<pid>-...`, removed when the
    context ends), after removing those of the same kind whose process has died: a
    launcher killed outright (SIGKILL) cannot remove its own."""
    root = tempfile.gettempdir()
    for old in Path(root).glob(f"dlx-{kind}-*-*"):
        pid = old.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"dlx-{kind}-{os.getpid()}-", ignore_cleanup_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def to_bytes(data: bytes | Blob) -> bytes:
    """Bytes, whether held or spilled."""
    return data.read() if isinstance(data, Blob) else data


class StoredTensors(Mapping[str, "torch.Tensor"]):
    """The tensors of `tensors_to_bytes` output (bytes, or a spilled `Blob`) whose names start
    with `prefix` (removed), by name, each read when asked for: a view of the bytes (no
    copy), or read from the file into a buffer of its own. Only for reading: a view of bytes
    must not be written to. ValueError for bytes `bytes_to_tensors` would leave to the
    safetensors library (`tensor_views` falls back to it)."""

    def __init__(self, data: bytes | Blob, prefix: str = "") -> None:
        from trainer import tensorbytes

        self.data, self.prefix = data, prefix
        head: bytes | bytearray | memoryview
        if isinstance(data, Blob):  # the length, then the header (index() judges both)
            head = data.read_at(0, min(data.size, 8))
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            if 8 + n <= min(data.size, tensorbytes.MAX_HEADER + 8):
                head = data.read_at(0, 8 + n)
        else:
            head = memoryview(data)
        self.start, index = tensorbytes.index(head, len(data))
        self.index = {k.removeprefix(prefix): v for k, v in index.items() if k.startswith(prefix)}

    def __getitem__(self, name: str) -> torch.Tensor:
        import warnings

        import torch

        dtype, shape, begin, end = self.index[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        if isinstance(self.data, Blob):
            buf: bytes | bytearray | memoryview = self.data.read_at(self.start + begin, end - begin)
        else:
            buf = memoryview(self.data)[self.start + begin: self.start + end]
        with warnings.catch_warnings():  # bytes are read-only; nothing writes to these views
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(cast(bytearray, buf), dtype=dtype).reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def tensor_views(data: bytes) -> Mapping[str, torch.Tensor]:
    """`bytes_to_tensors(data)`'s tensors without its copy of the data (`StoredTensors`, for
    reading only), or, for bytes only the safetensors library reads, its tensors."""
    try:
        return StoredTensors(data)
    except ValueError:
        return bytes_to_tensors(data)
