#!/usr/bin/env python
"""What building one pipeline stage costs a rank: peak memory and time of
`trainer.model.build_stage(cfg, s, S, seed)`, and of starting it from a Hugging Face
directory (`[model] init`: `build_stage` then `trainer.hf.load_init_weights`), with the
bytes of the safetensors file that start touched.

    .venv/bin/python scripts/bench_stage_build.py                      # the ~132M llama, S = 1, 2, 4
    .venv/bin/python scripts/bench_stage_build.py --stages 3 --numerics portable
    .venv/bin/python scripts/bench_stage_build.py --init               # + rows started from an HF dir

Every row is its own fresh process (one thread). Columns: `params MiB` the stage's float32
parameters; `peak MiB` the process's VmHWM after building, less its RSS just before
(torch and our modules imported); `s` the wall time of the build (and load). With --init,
`init peak` and `init s` the same for building and loading; `asked MiB` the bytes of the
tensors get_tensor returned; `read MiB` what the process read by read/pread meanwhile
(/proc/self/io rchar: safe_open's "pread" backend); `mapped MiB` the resident pages of the
process's mappings of the safetensors files as each file is closed (safe_open's default
"mmap" backend: get_tensor returns views of the mapping, whose pages count as the
process's); the directory is written once by `trainer.hf.write_hf_dir`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: d_model 1024, 11 layers, 16 heads, 4 kv heads, SwiGLU 2816, vocab 4096: ~132M parameters.
LLAMA_132M = {"family": "llama", "vocab_size": 4096, "d_model": 1024, "n_layers": 11, "n_heads": 16,
              "n_kv_heads": 4, "intermediate_size": 2816, "seq_len": 256}


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM, RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rchar() -> int:
    """Bytes this process has read by read(2)/pread(2) so far (/proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise KeyError("rchar")


def _mapped_rss(directory: str) -> int:
    """Resident bytes of this process's mappings of files under `directory` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
            inside = len(head) >= 6 and head[5].startswith(directory)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def child(model: dict[str, Any], stage: int, stages: int, numerics: str, init: str | None) -> dict[str, Any]:
    import torch

    import trainer.hf as hf
    from trainer.config import ModelConfig
    from trainer.model import build_stage

    torch.set_num_threads(1)
    cfg = ModelConfig(**model, **({"init": init} if init else {}))
    touched = {"file": 0, "read": 0}
    real_open = hf.safe_open

    class Counting:  # safe_open, counting the bytes the load asks for
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self) -> Counting:
            self.fh = self.inner.__enter__()
            return self

        def get_tensor(self, name: str) -> Any:
            t = self.fh.get_tensor(name)
            touched["read"] += t.numel() * t.element_size()
            return t

        def __exit__(self, *exc: Any) -> Any:
            touched["file"] += _mapped_rss(str(init))  # before the mapping goes
            return self.inner.__exit__(*exc)

    hf.safe_open = Counting  # type: ignore[assignment,misc]
    base, rchar = _status("VmRSS"), _rchar()
    t0 = time.perf_counter()
    module = build_stage(cfg, stage, stages, 1234, numerics)
    if init:
        hf.load_init_weights(module, init)
    seconds = time.perf_counter() - t0
    if init:
        touched["rchar"] = _rchar() - rchar
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"stage": stage, "stages": stages, "params": params, "peak": _status("VmHWM") - base,
            "seconds": seconds, **touched}


def _row(args: argparse.Namespace, stage: int, stages: int, init: str | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps([args.model, stage, stages, args.numerics, init])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _write_hf(model: dict[str, Any], out: Path) -> None:
    import torch

    from trainer.config import ModelConfig
    from trainer.hf import write_hf_dir
    from trainer.model import skeleton

    cfg = ModelConfig(**model)
    g = torch.Generator().manual_seed(0)
    params = {n: torch.randn(p.shape, generator=g) * 0.02 for n, p in skeleton(cfg).named_parameters()}
    write_hf_dir(out, cfg, params, lineage={})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=json.loads, default=LLAMA_132M, help="ModelConfig fields (JSON)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--numerics", default="native", choices=["native", "portable"])
    ap.add_argument("--init", action="store_true", help="also start each stage from an HF directory")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    print(f"model {json.dumps(args.model)}, numerics {args.numerics}")
    with tempfile.TemporaryDirectory() as tmp:
        init = None
        if args.init:
            init = str(Path(tmp) / "hf")
            _write_hf(args.model, Path(init))
            size = sum(f.stat().st_size for f in Path(init).glob("*.safetensors"))
            print(f"HF directory: {size / 2**20:.1f} MiB of safetensors")
        mib = 2**20
        print(f"{'stage':>7} {'params MiB':>10} {'peak MiB':>9} {'s':>6}"
              + (f" {'init peak':>9} {'init s':>6} {'asked MiB':>9} {'read MiB':>8} {'mapped MiB':>10}"
                 if init else ""))
        for S in args.stages:
            for s in range(S):
                r = _row(args, s, S, None)
                line = f"{s:>3} / {S:<2} {r['params'] / mib:>10.1f} {r['peak'] / mib:>9.1f} {r['seconds']:>6.2f}"
                if init:
                    q = _row(args, s, S, init)
                    line += (f" {q['peak'] / mib:>9.1f} {q['seconds']:>6.2f} {q['read'] / mib:>9.1f}"
                             f" {q['rchar'] / mib:>8.1f} {q['file'] / mib:>10.1f}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
