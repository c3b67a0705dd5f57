#!/usr/bin/env python
"""Re-derive a portable run on this machine from its run directory's blocks alone: every
outer step's new shards recomputed from the parent shards and the published contributions
(level "aggregate"), and every (step, replica) round replayed from its published start
state (level "replay"), each compared byte for byte with what the run published; prints a
table and exits 1 on any difference. No chain, no `dlx` (so it runs where only torch and
the project's store and audit code are installed, e.g. the aarch64 environment of
scripts/arm64_env):

    python scripts/portable_arch_check.py RUN_DIR
    scripts/arm64_run python scripts/portable_arch_check.py RUN_DIR   # on aarch64 (qemu)

scripts/arm64_replay trains the pinned portable job of tests/test_pinned_cids.py on this
x86 machine and runs this check under aarch64.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    import torch

    from lineage.audit.replay import job_of, replay_many
    from lineage.chain.runrecord import RunRecord
    from lineage.store.blockstore import Blockstore
    from lineage.store.manifest import get_manifest
    from lineage.store.unixfs import file_cid, read_bytes
    from trainer.diloco import apply_outer_step
    from trainer.kernels import kernel_fingerprint

    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    record = RunRecord.load(run_dir)
    store = Blockstore(record.blocks_dir(run_dir))
    history = [get_manifest(store, record.head)]
    while history[-1].parent is not None:
        history.append(get_manifest(store, history[-1].parent))
    history.reverse()
    job = job_of(store, history[0].config, with_data=False)
    if job.parallel.numerics != "portable":
        print(f"{run_dir}: a {job.parallel.numerics} run (this check is for portable runs)", file=sys.stderr)
        return 2
    print(f"{platform.machine()}: {kernel_fingerprint()}, torch {torch.__version__}")
    bad = 0
    start = time.perf_counter()
    for parent, m in zip(history, history[1:], strict=False):
        for s, want in enumerate(m.stages):
            contributions = [read_bytes(store, row[s]) for row in m.contributions]
            got = file_cid(apply_outer_step(read_bytes(store, parent.stages[s]), contributions, job.outer, m.step))
            same = str(got) == str(want)
            bad += not same
            print(f"aggregate  step {m.step} stage {s}: {'same' if same else 'DIFFERS'}  {got}")
    aggregate_s = time.perf_counter() - start
    items = [(str(cid), r) for m, cid in zip(history[1:], _cids(record, history), strict=True)
             for r in m.replica_ids(job.parallel.replicas)]
    start = time.perf_counter()
    for res in replay_many(store, items):
        exact = all(st.exact for st in res.stages) and not res.error
        bad += not exact
        print(f"replay     step {res.step} replica {res.replica}: "
              f"{'bit for bit' if exact else 'DIFFERS ' + (res.error or str([st.rel_l2 for st in res.stages]))}")
    print(f"aggregate {aggregate_s:.1f} s, replay {time.perf_counter() - start:.1f} s (process start-up included); "
          f"{'all identical' if not bad else f'{bad} differ'}")
    return 1 if bad else 0


def _cids(record, history) -> list[str]:
    """The checkpoint CIDs of `history[1:]` (each manifest's child names it as parent; the
    head is the record's)."""
    out = [str(m.parent) for m in history[2:]]
    return [*out, str(record.head)]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
