"""profiler/ has no import cycle: the job imports the stages, never the other way round.

Every import statement counts, wherever it is (module level, inside a function, under
``TYPE_CHECKING``): a function-local import hides a cycle from Python at import time, not from
a reader.  The graph is read from the source (``ast``), module by module; ``from package import
name`` counts as an import of the package and, when ``name`` is a module, of that module.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def import_graph(package: str, root: Path = REPO) -> dict[str, set[str]]:
    """Module name -> the modules of ``package`` (a directory under ``root``) it imports (itself left out)."""
    paths = {}
    for path in (root / package).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        paths[name] = path

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package_name.split(".")[: len(package_name.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(target for target in map(known, targets) if target and target != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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


def test_the_scanner_finds_a_cycle_through_a_function_local_import(tmp_path):
    """The check can fail: two modules that import each other, one of them inside a function."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import B\n")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b\n")
    (package / "sub" / "b.py").write_text("from ..a import f\nB = 1\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph("pkg", root=tmp_path)
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]
    (package / "sub" / "b.py").write_text("B = 1\n")  # the cycle broken
    assert cycles(import_graph("pkg", root=tmp_path)) == []


def test_profiler_has_no_import_cycle():
    graph = import_graph("profiler")
    assert "profiler.job" in graph["profiler.cli"]  # the graph is read (main imports the job)
    assert "profiler.stages.context" in graph["profiler.stages.base"]
    assert cycles(graph) == []


def test_stages_never_import_the_job():
    graph = import_graph("profiler")
    for name, targets in graph.items():
        if name.startswith("profiler.stages"):
            assert "profiler.job" not in targets and "profiler.cli" not in targets, name
