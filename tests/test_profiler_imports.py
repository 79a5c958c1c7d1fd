"""profiler/ has no import cycle: the job imports the stages, never the other way round.

Every import statement counts, wherever it is (``tests/import_graph.py``).
"""

from __future__ import annotations

from pathlib import Path

from import_graph import import_cycles as cycles
from import_graph import import_graph

REPO = Path(__file__).resolve().parents[1]


def test_the_scanner_finds_a_cycle_through_a_function_local_import(tmp_path):
    """The check can fail: two modules that import each other, one of them inside a function."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import B\n")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b\n")
    (package / "sub" / "b.py").write_text("from ..a import f\nB = 1\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    (package / "sub" / "b.py").write_text("B = 1\n")  # the cycle broken
    assert cycles(import_graph(package)) == []


def test_profiler_has_no_import_cycle():
    graph = import_graph(REPO / "profiler")
    assert "profiler.job" in graph["profiler.cli"]  # the graph is read (main imports the job)
    assert "profiler.stages.context" in graph["profiler.stages.base"]
    assert cycles(graph) == []


def test_stages_never_import_the_job():
    graph = import_graph(REPO / "profiler")
    for name, targets in graph.items():
        if name.startswith("profiler.stages"):
            assert "profiler.job" not in targets and "profiler.cli" not in targets, name
