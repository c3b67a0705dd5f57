"""Benchmark the content-addressed store: add and get throughput of one large file, next
to `sha256sum` of the same file in the same run (the hashing floor: every byte is hashed
once on add and once on get).

    .venv/bin/python scripts/bench_cas.py               # 256 MiB in a temporary directory
    .venv/bin/python scripts/bench_cas.py --mib 64 --dir /tmp --json

Targets (issue 4): add >= 0.5x and get (with re-hash) >= 0.5x sha256sum's throughput.
Peak memory is the process's peak RSS growth over its size before the run (ru_maxrss).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lineage.store.blockstore import Blockstore  # noqa: E402
from lineage.store.unixfs import import_file, read_file  # noqa: E402


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="file size in MiB (default 256)")
    ap.add_argument("--dir", type=Path, default=None, help="where to put the file and the store")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-cas-", dir=args.dir))
    try:
        src, out = work / "src.bin", work / "out.bin"
        with open(src, "wb") as fh:  # incompressible, every chunk distinct
            for _ in range(args.mib):
                fh.write(os.urandom(1 << 20))
        size = src.stat().st_size
        mib = size / 2**20
        base = _rss_mib()

        res, t_sha = _timed(lambda: subprocess.run(["sha256sum", str(src)], check=True,
                                                   capture_output=True))
        store = Blockstore(work / "blocks")
        with open(src, "rb") as fh:
            imported, t_add = _timed(lambda: import_file(fh, store.put))
        peak_add = _rss_mib() - base
        with open(out, "wb") as fh:
            _, t_get = _timed(lambda: read_file(store, imported.cid, fh))
        peak_get = _rss_mib() - base
        if not filecmp.cmp(src, out, shallow=False):
            raise SystemExit("get returned different bytes")

        rows = {
            "sha256sum": {"seconds": t_sha, "mib_s": mib / t_sha, "ratio": 1.0},
            "add": {"seconds": t_add, "mib_s": mib / t_add, "ratio": t_sha / t_add, "peak_rss_mib": peak_add},
            "get": {"seconds": t_get, "mib_s": mib / t_get, "ratio": t_sha / t_get, "peak_rss_mib": peak_get},
        }
        report = {"file_mib": mib, "blocks": imported.blocks, "cid": str(imported.cid),
                  "cpus": os.cpu_count(), "results": rows,
                  "targets_met": rows["add"]["ratio"] >= 0.5 and rows["get"]["ratio"] >= 0.5}
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"{mib:.0f} MiB file, {imported.blocks} blocks, root {imported.cid}")
            print(f"{'':10} {'seconds':>8} {'MiB/s':>8} {'x sha256sum':>12} {'peak RSS MiB':>13}")
            for name, r in rows.items():
                peak = f"{r['peak_rss_mib']:13.1f}" if "peak_rss_mib" in r else f"{'':13}"
                print(f"{name:10} {r['seconds']:8.2f} {r['mib_s']:8.0f} {r['ratio']:12.2f} {peak}")
            print("targets (add, get >= 0.5x sha256sum):", "met" if report["targets_met"] else "NOT met")
        return 0 if report["targets_met"] else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
