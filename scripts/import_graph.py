#!/usr/bin/env python3
"""Print the import graph of trainer/, lineage/ and workers/ and check its two rules.

The graph is read statically (ast), so a lazy import inside a function counts like a
top-level one: a cycle hidden behind a function-level import is still a cycle, and so is
one behind `if TYPE_CHECKING:` (a type is a dependency too: where a type is all a module
needs, it declares a `typing.Protocol` of its own instead of importing the class). Prints
each package's edges to other packages (`lineage.audit -> lineage.chain, lineage.store`),
then each module's imports of our modules with `--modules`. Exits 1 when

- any modules of ours import each other in a cycle, or any packages do
  (`lineage.store` and `lineage.chain` importing each other is a cycle even when no two
  modules are), or
- `trainer` imports `lineage` or `workers` (the engine reports through a `StepSink` and
  knows nothing of content addressing or the chain).

    scripts/import_graph.py             # package graph and the checks (scripts/test runs it)
    scripts/import_graph.py --modules   # and every module's imports
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "lineage", "workers")
#: Top-level packages the engine may not import.
TRAINER_FORBIDS = ("lineage", "workers")

Graph = dict[str, set[str]]


def module_files() -> dict[str, Path]:
    """Our modules by dotted name (a package by its own name, from its __init__.py)."""
    found: dict[str, Path] = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name a relative import `from ..name import x` names."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterable[str]:
    """The modules of ours that one import statement loads (the deepest one it names)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        base = _absolute(module, is_package, node.level, node.module)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            yield sub if sub in known else base


def import_graph(files: dict[str, Path]) -> Graph:
    """Each module's imports of other modules of ours."""
    known = set(files)
    graph: Graph = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, is_package, known):
                while target and target not in known:  # `import lineage.store.cid as x`
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def package_of(module: str, files: dict[str, Path]) -> str:
    """The package a module belongs to (a package is its own)."""
    return module if files[module].name == "__init__.py" else module.rpartition(".")[0] or module


def package_graph(graph: Graph, files: dict[str, Path]) -> Graph:
    """The module graph collapsed onto packages, without self-edges.

    An import of an enclosing package's __init__ itself is dropped: it is how a package's
    own modules reach the names its __init__ gathers, not a dependency between packages
    (an import of a sibling module of that __init__, like `lineage.errors`, is kept).
    """
    packages: Graph = {}
    for src, targets in graph.items():
        here = package_of(src, files)
        edges = packages.setdefault(here, set())
        for target in targets:
            there = package_of(target, files)
            if there != here and not here.startswith(target + "."):
                edges.add(there)
    return packages


def cycles(graph: Graph) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def trainer_violations(graph: Graph) -> list[str]:
    """`trainer.x -> lineage.y` for every import of lineage or workers from trainer."""
    return [
        f"{src} -> {dst}"
        for src in sorted(graph) if src.split(".")[0] == "trainer"
        for dst in sorted(graph[src]) if dst.split(".")[0] in TRAINER_FORBIDS
    ]


def _print_graph(title: str, graph: Graph) -> None:
    print(title)
    for node in sorted(graph):
        print(f"  {node} -> {', '.join(sorted(graph[node])) or '(none)'}")


def main(argv: list[str]) -> int:
    """Print the graphs; 1 on a cycle or a forbidden trainer import, else 0."""
    files = module_files()
    graph = import_graph(files)
    packages = package_graph(graph, files)
    _print_graph("packages:", packages)
    if "--modules" in argv:
        _print_graph("modules:", graph)
    problems = [f"module cycle: {' <-> '.join(c)}" for c in cycles(graph)]
    problems += [f"package cycle: {' <-> '.join(c)}" for c in cycles(packages)]
    problems += [f"trainer imports {v}" for v in trainer_violations(graph)]
    for problem in problems:
        print(f"import_graph: {problem}", file=sys.stderr)
    print("import_graph: " + ("FAILED" if problems else "no cycles; trainer imports neither lineage nor workers"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
