"""Fail when a function is longer than a reader can hold: every function (methods and
nested functions included) in the given packages must be at most `--max` lines, docstring
and decorators counted, blank lines too (the source span as written).

    .venv/bin/python scripts/function_lengths.py trainer          # 80 lines, as scripts/test runs it
    .venv/bin/python scripts/function_lengths.py --max 60 trainer lineage workers

Exit code 1 and one line per offender (path:line name length), longest first.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def long_functions(roots: list[str], limit: int) -> list[tuple[int, str, str]]:
    """(length, path:line, name) of every function over `limit` lines under `roots`."""
    out = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    length = (node.end_lineno or node.lineno) - first + 1
                    if length > limit:
                        out.append((length, f"{path}:{node.lineno}", node.name))
    return sorted(out, reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="package directories to scan")
    parser.add_argument("--max", type=int, default=80, help="the most lines a function may span")
    args = parser.parse_args()
    found = long_functions(args.roots, args.max)
    for length, where, name in found:
        print(f"{where} {name} {length} lines (max {args.max})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
