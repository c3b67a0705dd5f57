"""The one door for cross-replica traffic: exact byte counts and link shaping.

Every byte that crosses replicas goes through a `Transport` bound to a stage's
data-parallel group (stage s of every replica): DiLoCo's exchange of compressed
contributions (`all_gather` / `start_all_gather`, variable-size byte blobs) and the
AllReduce-DDP baseline's per-step gradient all-reduce (`all_reduce_mean_`).

Counting. Bytes are what a ring algorithm sends from this rank (payload, the 8-byte
length header of every blob, and so every index, scale and safetensors header inside it):
- all-gather of blobs b_0..b_{R-1}: rank i forwards every blob except b_{(i+1) mod R},
  so it sends sum_{j != i+1} (len(b_j) + 8) bytes in R - 1 hops;
- all-reduce of n float32 values in R chunks: reduce-scatter and all-gather each send
  every chunk but one, 2(R-1)/R x 4n bytes in 2(R-1) hops.
gloo moves the data over loopback (padding blobs to one length); the count is the ring's.

Shaping (`[transport] link`):
- ``none``: no delay; bytes are still counted, and `modelled_s` holds what the link model
  says the exchange would take, for analytical comparisons;
- ``simulated``: an exchange completes no earlier than hops x latency + max_i bytes_i /
  bandwidth after it starts. `start_all_gather` returns at once: a background thread runs
  the collectives and holds completion to that deadline, so compute overlaps the
  exchange for real;
- ``netns``: the ranks of each replica run in their own network namespace, joined by
  veth links that `tc` shapes (trainer/netns.py, set up by the launcher); the kernel
  delays the traffic for real, so the Transport only counts (and models) it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from trainer.config import TransportConfig

__all__ = ["LinkModel", "Pending", "Transport", "all_gather_bytes_sent", "all_reduce_bytes_sent"]

HEADER_BYTES = 8  # the int64 length sent ahead of every blob


@dataclass(frozen=True)
class LinkModel:
    """bandwidth in bytes/s, latency in s per ring hop."""

    bandwidth: float
    latency: float = 0.0

    @classmethod
    def from_config(cls, cfg: TransportConfig) -> LinkModel:
        return cls(bandwidth=cfg.bandwidth_mbps * 1e6 / 8, latency=cfg.latency_ms / 1e3)

    def seconds(self, bytes_per_rank: float, hops: int) -> float:
        return hops * self.latency + bytes_per_rank / self.bandwidth


def all_gather_bytes_sent(lengths: list[int], rank: int) -> int:
    """Bytes rank `rank` sends in a ring all-gather of blobs with these lengths."""
    R = len(lengths)
    if R == 1:
        return 0
    return sum(n + HEADER_BYTES for j, n in enumerate(lengths) if j != (rank + 1) % R)


def all_reduce_bytes_sent(numel: int, replicas: int, rank: int, itemsize: int = 4) -> int:
    """Bytes rank `rank` sends in a ring all-reduce (reduce-scatter + all-gather)."""
    R = replicas
    if R == 1:
        return 0
    chunks = [numel // R + (1 if j < numel % R else 0) for j in range(R)]
    return itemsize * (2 * numel - chunks[(rank + 1) % R] - chunks[(rank + 2) % R])


@dataclass
class Pending:
    """An exchange in flight; `wait()` returns every replica's blob, in replica order, and
    (once) books its bytes and modelled time on the Transport that started it."""

    _done: threading.Event
    _book: Callable[[list[int]], None]
    _result: list = field(default_factory=list)
    _error: list = field(default_factory=list)
    _booked: bool = False
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None  # perf_counter when the exchange completed

    @property
    def seconds(self) -> float:
        """How long the exchange took, start to finish (0 before it finishes)."""
        return 0.0 if self.finished is None else self.finished - self.started

    def wait(self) -> list[bytes]:
        self._done.wait()
        if self._error:
            raise self._error[0]
        blobs = self._result[0]
        if not self._booked:
            self._booked = True
            self._book([len(b) for b in blobs])
        return blobs


class Transport:
    """Cross-replica exchange for one stage's data-parallel group.

    Args:
        group: the group of stage s of every replica present (None = default group).
        replicas: the group's size: R, or in an elastic run the replicas present.
        replica: this rank's index in the group (its replica's position among those
            present; its replica id r when all R are).
        cfg: `[transport]`: link shaping and its model.

    Counters (cumulative, this rank): `bytes_sent`, `modelled_s` (the link model's time for
    every exchange), `wait_s` (time the caller spent blocked in waits and sync calls).
    """

    def __init__(
        self, group: dist.ProcessGroup | None, replicas: int, replica: int, cfg: TransportConfig
    ):
        self.group, self.R, self.replica, self.cfg = group, replicas, replica, cfg
        self.link = LinkModel.from_config(cfg)
        self.shaped = cfg.link == "simulated"
        self.bytes_sent = 0
        self.modelled_s = 0.0
        self.wait_s = 0.0

    # -- DiLoCo: variable-size blobs -------------------------------------------------------

    def all_gather(self, payload: bytes) -> list[bytes]:
        """Every replica's blob, in replica order (blocks, shaped like `start_all_gather`)."""
        start = time.perf_counter()
        out = self.start_all_gather(payload).wait()
        self.wait_s += time.perf_counter() - start
        return out

    def start_all_gather(self, payload: bytes) -> Pending:
        """Start exchanging `payload` in a background thread; returns at once.

        Deadlock hazards: (1) every replica must call this the same number of times, in the
        same order relative to other collectives on `group`; (2) nothing else may use
        `group` until the returned Pending has been waited on (the thread owns it).
        """
        start = time.perf_counter()
        pending = Pending(threading.Event(), self._book_all_gather)
        if self.R == 1:
            pending._result.append([payload])
            pending.finished = pending.started
            pending._done.set()
            return pending

        def exchange() -> None:
            try:
                # Lengths first (8 bytes each), so the blobs can be padded to one size.
                length = torch.tensor([len(payload)], dtype=torch.int64)
                lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.R)]
                dist.all_gather(lengths, length, group=self.group)
                sizes = [int(t.item()) for t in lengths]
                buf = torch.zeros(max(sizes), dtype=torch.uint8)
                buf.numpy()[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)  # the one copy
                bufs = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.R)]
                dist.all_gather(bufs, buf, group=self.group)
                del buf
                # Our own blob is the payload itself; each other one is copied out of its buffer,
                # which then goes (at most one extra blob is held at a time).
                blobs: list[bytes] = []
                for i, n in enumerate(sizes):
                    b = bufs[i]
                    bufs[i] = None  # type: ignore[call-overload]
                    blobs.append(payload if i == self.replica else b[:n].numpy().tobytes())
                    del b
                pending._result.append(blobs)
                if self.shaped:
                    delay = start + self._all_gather_seconds(sizes) - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
            except BaseException as exc:  # surfaced by wait() in the caller's thread
                pending._error.append(exc)
            finally:
                pending.finished = time.perf_counter()
                pending._done.set()

        threading.Thread(target=exchange, name="dlx-transport", daemon=True).start()
        return pending

    def _all_gather_seconds(self, sizes: list[int]) -> float:
        per_rank = max(all_gather_bytes_sent(sizes, i) for i in range(self.R))
        return self.link.seconds(per_rank, self.R - 1)

    def _book_all_gather(self, sizes: list[int]) -> None:
        if self.R > 1:
            self.bytes_sent += all_gather_bytes_sent(sizes, self.replica)
            self.modelled_s += self._all_gather_seconds(sizes)

    # -- AllReduce-DDP baseline ------------------------------------------------------------

    def all_reduce_mean_(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` in place across replicas (one flat float32 all-reduce)."""
        if self.R == 1:
            return
        start = time.perf_counter()
        flat = torch.cat([t.reshape(-1).float() for t in tensors])  # (N,)
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.R)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        self.bytes_sent += all_reduce_bytes_sent(flat.numel(), self.R, self.replica)
        modelled = self.link.seconds(
            max(all_reduce_bytes_sent(flat.numel(), self.R, i) for i in range(self.R)),
            2 * (self.R - 1),
        )
        self.modelled_s += modelled
        if self.shaped:
            delay = start + modelled - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        self.wait_s += time.perf_counter() - start
