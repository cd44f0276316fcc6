"""The import graph of megalite: circles, imports that run against the layering, and the house's
vital signs.

    python tools/import_graph.py            # the table: circles, upward imports, local imports, ...
    python tools/import_graph.py --edges    # every import between megalite modules

Read from the source with ``ast`` (nothing is imported): every ``import`` statement counts, at
module level or inside a function, since a function-local import is still a dependency (hiding
a circle in a function does not remove it). ``tests/test_imports.py`` asserts on it.

The layering (``DESIGN.md`` section 1): each top-level part of megalite may import only the parts
listed for it in ``ALLOWED``; ``errors`` is open to every part.
"""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# part -> the parts it may import (besides itself and errors). A part is megalite's top-level
# module or folder (``kernels`` is megalite/kernels/, the Triton kernels).
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "kernels": set(),
    "core": {"kernels"},
    "models": {"core"},
    "data": set(),
    "checkpoint": {"core", "models"},
    "conversion": {"inference", "checkpoint", "models", "core"},
    "inference": {"checkpoint", "models", "core"},
    "training": {"checkpoint", "models", "core", "data"},
    "planning": {"training", "checkpoint", "models", "core", "data"},
    "measure": {"planning", "training", "checkpoint", "models", "core", "data"},
    "__init__": {"core", "models", "data", "checkpoint", "conversion", "inference", "training"},
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted (megalite.core.parallel_state)
    target: str  # the imported megalite module, dotted
    line: int
    local: bool  # inside a function or method


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module under megalite/."""
    out = {}
    for path in sorted((root / "megalite").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The megalite module ``name`` refers to: itself, or the longest module prefix."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


class _Collector(ast.NodeVisitor):
    def __init__(self, source: str, is_package: bool, modules: dict[str, Path]):
        self.source, self.modules, self.depth = source, modules, 0
        self.package = source if is_package else source.rpartition(".")[0]
        self.found: list[Import] = []

    def _add(self, name: str, line: int) -> None:
        target = _resolve(name, self.modules)
        if target is not None and target != self.source:
            self.found.append(Import(self.source, target, line, self.depth > 0))

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:  # `from pkg import submodule` imports the submodule
            full = f"{base}.{alias.name}"
            self._add(full if full in self.modules else base, node.lineno)


def imports(root: Path = ROOT) -> list[Import]:
    """Every import from one megalite module of another."""
    modules = module_files(root)
    out: list[Import] = []
    for name, path in modules.items():
        collector = _Collector(name, path.name == "__init__.py", modules)
        collector.visit(ast.parse(path.read_text(), str(path)))
        out += collector.found
    return out


def cycles(edges: list[Import]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (~250)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def part_of(module: str) -> str:
    """megalite.core.moe.router -> core; megalite.errors -> errors; megalite -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward(edges: list[Import]) -> list[Import]:
    """Imports that run against the layering of ``ALLOWED``."""
    out = []
    for e in edges:
        src, dst = part_of(e.source), part_of(e.target)
        if src != dst and dst != "errors" and dst not in ALLOWED[src]:
            out.append(e)
    return out


_GETATTR_DEFAULT = re.compile(r"\bgetattr\((?:[^()]|\([^()]*\))*,(?:[^()]|\([^()]*\))*,")


def vital_signs(root: Path = ROOT) -> dict[str, int]:
    """The figures a reviewer asks for first, over megalite/."""
    edges = imports(root)
    files = module_files(root).values()
    texts = [p.read_text() for p in files]
    return {
        "import circles": len(cycles(edges)),
        "upward imports": len(upward(edges)),
        "function-local imports": sum(e.local for e in edges),
        "getattr with a default": sum(len(_GETATTR_DEFAULT.findall(t)) for t in texts),
        "files over 400 lines": sum(t.count("\n") > 400 for t in texts),
        "fmt: skip markers": sum(t.count("fmt: skip") for t in texts),
        "lines": sum(t.count("\n") for t in texts),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edges", action="store_true", help="list every import between modules")
    args = p.parse_args(argv)
    edges = imports()
    if args.edges:
        for e in edges:
            print(f"{e.source} -> {e.target} (line {e.line}{', local' if e.local else ''})")
        return
    for cycle in cycles(edges):
        print("circle: " + " -> ".join(cycle))
    for e in upward(edges):
        print(f"upward: {e.source}:{e.line} -> {e.target}")
    for name, value in vital_signs().items():
        print(f"{name:24s} {value}")


if __name__ == "__main__":
    main()
