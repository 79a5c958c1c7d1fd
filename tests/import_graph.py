"""The import graph of a package read from its source, and its cycles: shared by the tests that keep
``runtime/`` and ``profiler/`` free of import cycles and the packages in their layers
(tests/test_layering.py).

Every import statement counts, wherever it is (module level, inside a function, under
``TYPE_CHECKING``): a function-local import hides a cycle from Python at import time, not from a
reader.  ``from x import y`` is an edge to ``x.y`` when that is a module of the package, else to
``x``; ``import x.y.z`` an edge to the deepest module of the package it names.
"""

from __future__ import annotations

import ast
from pathlib import Path


def import_graph(*package_dirs: Path) -> dict[str, set[str]]:
    """Module name -> the modules of the packages at ``package_dirs`` it imports (itself left out)."""
    modules = {}
    for package_dir in package_dirs:
        for path in sorted(package_dir.rglob("*.py")):
            parts = path.relative_to(package_dir.parent).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                targets = [
                    f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module for alias in node.names
                ]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
