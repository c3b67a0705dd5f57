#!/usr/bin/env python
"""Preparing a dataset against its floors: tokenizing it, and importing its directory.

    .venv/bin/python scripts/bench_data.py               # ~64 MB of JSON Lines, 3 repeats
    .venv/bin/python scripts/bench_data.py --mb 16 --repeat 5

One generated corpus (JSON Lines files of made-up English-like records, 1 MB each, in a
temporary directory) and, measured side by side on it in one run:

  tokenize  `trainer.dataset.prepare_data` with a 4,096-token byte-level BPE, given as a
            tokenizer.json path (trained beforehand on part of the corpus), so the row is
            reading, parsing, batching, encoding and writing the token file; against the
            floor, `tokenizers`' own `Tokenizer.encode_batch` over the same documents
            already in memory, in batches of the same size (target: at least 0.8x).
  bytes     `prepare_data` with the bytes tokenizer (no floor; for scale).
  import    `lineage.store.unixfs_dir.import_directory(root, put=None)`, the root CID `ipfs add -r
            --cid-version=1` gives, against `sha256sum` over the same files (target: at
            least 0.5x).

Every measurement is a fresh process (peak RSS is its VmHWM); the repeats alternate ours
and the floor, and the table shows medians. Files are read once first so every row reads
from the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = "@@bench "
FILE_MB = 1
VOCAB = 4096


def _corpus(root: Path, mb: int) -> None:
    """`mb` JSON Lines files of about 1 MB: records of 20 to 300 words drawn from 5,000
    made-up words with a Zipf-like frequency."""
    rng = random.Random(0)
    words = ["".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(rng.randint(1, 10)))
             for _ in range(5000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]
    root.mkdir(parents=True)
    for i in range(mb):
        lines, size = [], 0
        while size < FILE_MB << 20:
            text = " ".join(rng.choices(words, weights, k=rng.randint(20, 300))) + "."
            line = json.dumps({"id": len(lines), "text": text}) + "\n"
            lines.append(line)
            size += len(line)
        (root / f"part-{i:04d}.jsonl").write_text("".join(lines))


def _tokenizer(root: Path, out: Path) -> None:
    from trainer.dataset import train_bpe

    texts = (json.loads(line)["text"] for f in sorted(root.glob("*.jsonl"))[:8]
             for line in f.read_text().splitlines())
    out.write_text(train_bpe(texts, VOCAB).to_str(pretty=True))


def _peak_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _work(kind: str, root: Path, tokenizer: Path, out: Path) -> dict:
    """One measurement in this (fresh) process."""
    size = sum(p.stat().st_size for p in root.iterdir())
    for p in sorted(root.iterdir()):
        p.read_bytes()  # page cache
    if kind == "sha256sum":
        files = [str(p) for p in sorted(root.iterdir())]
        start = time.perf_counter()
        subprocess.run(["sha256sum", *files], check=True, stdout=subprocess.DEVNULL)
        return {"s": time.perf_counter() - start, "bytes": size}
    if kind == "import":
        from lineage.store.unixfs_dir import import_directory

        start = time.perf_counter()
        import_directory(root, None)
        return {"s": time.perf_counter() - start, "bytes": size, "rss": _peak_mb()}
    if kind == "floor":
        return _floor(root, tokenizer, size)
    from trainer.config import DataConfig
    from trainer.dataset import prepare_data

    cfg = DataConfig(source="dir", dir=str(root), max_bytes=1 << 40,
                     tokenizer="bytes" if kind == "bytes" else str(tokenizer))
    start = time.perf_counter()
    p = prepare_data(cfg, VOCAB, out)
    return {"s": time.perf_counter() - start, "bytes": size, "rss": _peak_mb(),
            "tokens": p.train_tokens + p.eval_tokens - (0 if kind == "bytes" else p.documents)}


def _floor(root: Path, tokenizer: Path, size: int) -> dict:
    """tokenizers' encode_batch over the documents, in memory, batched as prepare_data is."""
    from tokenizers import Tokenizer

    from trainer.dataset import BATCH_CHARS, BATCH_DOCS

    tok = Tokenizer.from_file(str(tokenizer))
    batches, batch, chars = [], [], 0
    for f in sorted(root.iterdir()):
        for line in f.read_text().splitlines():
            batch.append(json.loads(line)["text"])
            chars += len(batch[-1])
            if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                batches.append(batch)
                batch, chars = [], 0
    batches.append(batch)
    start = time.perf_counter()
    tokens = 0
    for batch in batches:
        tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
    return {"s": time.perf_counter() - start, "bytes": size, "rss": _peak_mb(), "tokens": tokens}


def _run(kind: str, root: Path, tokenizer: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, str(root), str(tokenizer), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise SystemExit(f"{kind} failed:\n{proc.stderr[-2000:]}")


def _row(name: str, ours: list[dict], floor: list[dict] | None, floor_name: str, target: float) -> str:
    s = statistics.median(r["s"] for r in ours)
    mb = ours[0]["bytes"] / 2**20
    tok = f"{ours[0]['tokens'] / s / 1e6:7.2f}" if "tokens" in ours[0] else "      -"
    rss = f"{max(r.get('rss', 0) for r in ours):7.0f}"
    line = f"{name:<22} {mb / s:8.1f} {tok} {rss}"
    if floor is None:
        return line
    fs = statistics.median(r["s"] for r in floor)
    ftok = f"{floor[0]['tokens'] / fs / 1e6:7.2f}" if "tokens" in floor[0] else "      -"
    frss = f"{max(r.get('rss', 0) for r in floor):7.0f}" if "rss" in floor[0] else "      -"
    ratio = fs / s
    verdict = "ok" if ratio >= target else "BELOW"
    return (f"{line}\n{floor_name:<22} {mb / fs:8.1f} {ftok} {frss}\n"
            f"{'':<22} ours / floor = {ratio:.2f}x (target >= {target}x: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="corpus size in MB (default 64)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per row (default 3)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, root, tokenizer, out = args.worker
        print(TAG + json.dumps(_work(kind, Path(root), Path(tokenizer), Path(out))), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="dlx-bench-data-") as tmp:
        root, tokenizer = Path(tmp) / "dataset", Path(tmp) / "tokenizer.json"
        start = time.perf_counter()
        _corpus(root, args.mb)
        _tokenizer(root, tokenizer)
        print(f"corpus: {args.mb} files of {FILE_MB} MB of JSON Lines, BPE of {VOCAB} tokens "
              f"({time.perf_counter() - start:.0f} s to make); {os.cpu_count()} CPUs; "
              f"medians of {args.repeat}\n")
        results: dict[str, list[dict]] = {k: [] for k in ("tokenize", "floor", "bytes", "import", "sha256sum")}
        for i in range(args.repeat):
            order = ["tokenize", "floor", "import", "sha256sum", "bytes"]
            if i % 2:
                order = ["floor", "tokenize", "sha256sum", "import", "bytes"]
            for kind in order:
                results[kind].append(_run(kind, root, tokenizer, Path(tmp) / f"out-{kind}"))
        print(f"{'row':<22} {'MB/s':>8} {'Mtok/s':>7} {'RSS MB':>7}")
        print(_row("prepare_data (BPE)", results["tokenize"], results["floor"], "encode_batch (floor)", 0.8))
        print(_row("prepare_data (bytes)", results["bytes"], None, "", 0))
        print(_row("import_directory", results["import"], results["sha256sum"], "sha256sum (floor)", 0.5))


if __name__ == "__main__":
    main()
