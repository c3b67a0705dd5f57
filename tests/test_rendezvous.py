"""A world's ranks meet with the rendezvous timeout, not the collective one: a rank that
starts late (an elastic joiner importing torch and building its stage on a loaded machine)
is waited for, while a collective afterwards still fails after the short collective
timeout. A rank that never comes fails the rendezvous as a broken world (a regroup)."""

from __future__ import annotations

import multiprocessing as mp
import time
from datetime import timedelta

import pytest

from trainer.launch import free_port


def _rank(rank: int, init_method: str, late_s: float, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    from trainer.world import init_world

    time.sleep(late_s)
    t0 = time.monotonic()
    init_world(init_method, rank, 2, timeout_s=2.0)
    joined_after = time.monotonic() - t0
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    summed = float(x[0])
    try:
        if rank == 1:
            time.sleep(6)  # rank 0's next collective waits for it: past the 2 s collective timeout
        dist.all_reduce(x)
        failed = None
    except Exception as exc:  # noqa: BLE001 - what failed is what the test reads
        failed = type(exc).__name__
    out.put((rank, joined_after, summed, failed))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_late_rank_is_waited_for_and_a_later_collective_still_times_out():
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, init_method, 8.0 * r, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, joined_after, value, failed = out.get(timeout=120)
        results[rank] = (joined_after, value, failed)
    for p in procs:
        p.join(timeout=30)
    assert results[0][0] > 5.0, results  # rank 0 waited for the late rank, well past the 2 s collective timeout
    assert results[0][1] == results[1][1] == 3.0, results  # the first collective summed 1 + 2 on both
    assert results[0][2] is not None, results  # the collective rank 1 came late to timed out on rank 0


def test_a_rank_that_never_comes_fails_the_rendezvous_as_a_broken_world():
    from trainer.world import rendezvous, world_failure

    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        rendezvous(f"tcp://127.0.0.1:{free_port()}", 0, 2, timedelta(seconds=1.5))
    assert time.monotonic() - t0 < 30
    assert world_failure(err.value), repr(err.value)
