#!/usr/bin/env python
"""Alias of scripts/bench_dilocox.py (same flags, same table): DiLoCoX vs AllReduce."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).with_name("bench_dilocox.py")), run_name="__main__")
