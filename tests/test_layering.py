"""The packages in layers (issue 42): ``common`` and ``prompt_format`` at the bottom, ``artifacts``
and ``needles`` above them, ``runtime`` above ``artifacts``, ``profiler`` on top.  A package
imports only packages below it, with no exception, wherever the import statement is (inside a
function too); and no module of any of them imports itself in a circle, across packages included.

Inside ``runtime`` the same rule orders its subpackages (:data:`RUNTIME_LAYERS`): the math, the KV
store, the scorers, the plan, compression, the entry points.  So the storage imports nothing that
evicts or scores.
"""

from __future__ import annotations

from pathlib import Path

from import_graph import import_cycles, import_graph

REPO = Path(__file__).resolve().parent.parent
# package -> the packages of ours it may import
MAY_IMPORT = {
    "common": set(),
    "prompt_format": set(),
    "artifacts": {"common", "prompt_format"},
    "needles": {"common", "prompt_format"},
    "runtime": {"common", "prompt_format", "artifacts"},
    "profiler": {"common", "prompt_format", "artifacts", "needles", "runtime"},
}

# runtime's subpackages, bottom to top: each imports only those before it (and itself)
RUNTIME_LAYERS = ("math", "kv_store", "scorers", "plan", "compression", "serve")
# runtime's modules outside the subpackages: the package's exports and the integrations with other
# tools (kvpress, lm-eval), which may import any subpackage
RUNTIME_TOP = {"runtime", "runtime.kvpress_press", "runtime.lm_eval_model", "runtime.lm_eval_cli"}


def _graph() -> dict[str, set[str]]:
    return import_graph(*(REPO / package for package in MAY_IMPORT))


def layering_offences(graph: dict[str, set[str]]) -> list[str]:
    """``"module -> module"`` for every import of a package ``MAY_IMPORT`` does not allow."""
    offences = []
    for module, targets in sorted(graph.items()):
        package = module.split(".")[0]
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != package and other not in MAY_IMPORT[package]:
                offences.append(f"{module} -> {target}")
    return offences


def test_every_package_of_the_repository_is_in_a_layer():
    packages = {path.parent.name for path in REPO.glob("*/__init__.py")}
    assert packages == set(MAY_IMPORT), "a new package needs its place in MAY_IMPORT"


def test_no_package_imports_one_above_it():
    graph = _graph()
    assert "common.models" in graph and "artifacts.validation" in graph and "needles.cli" in graph
    assert layering_offences(graph) == []


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """The rule is read from the source: a function-local import of the runtime from the artifact
    reader (what ``artifacts/validation.py`` did before the vocabulary moved to ``common``) is an
    offence, and so is one from ``common``."""
    for package in ("artifacts", "common", "runtime"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "runtime" / "names.py").write_text("X = 1\n")
    (tmp_path / "artifacts" / "validation.py").write_text("def f():\n    from runtime.names import X\n    return X\n")
    (tmp_path / "common" / "log.py").write_text("import artifacts\n")
    graph = import_graph(*(tmp_path / package for package in ("artifacts", "common", "runtime")))
    assert layering_offences(graph) == ["artifacts.validation -> runtime.names", "common.log -> artifacts"]


def test_no_import_circle_across_the_packages():
    assert import_cycles(_graph()) == []


def runtime_layering_offences(graph: dict[str, set[str]]) -> list[str]:
    """``"module -> module"`` for every import of a runtime subpackage above the importer's."""
    offences = []
    for module, targets in sorted(graph.items()):
        parts = module.split(".")
        if parts[0] != "runtime" or module in RUNTIME_TOP:
            continue
        level = RUNTIME_LAYERS.index(parts[1])
        for target in sorted(targets):
            other = target.split(".")
            if other[0] == "runtime" and target not in RUNTIME_TOP and RUNTIME_LAYERS.index(other[1]) > level:
                offences.append(f"{module} -> {target}")
            elif target in RUNTIME_TOP and target != "runtime":
                offences.append(f"{module} -> {target}")
    return offences


def test_every_runtime_module_is_in_a_subpackage_of_a_layer():
    graph = _graph()
    loose = sorted(
        module
        for module in graph
        if module.startswith("runtime") and module not in RUNTIME_TOP and module.split(".")[1] not in RUNTIME_LAYERS
    )
    assert loose == [], "a runtime module belongs in one of RUNTIME_LAYERS' subpackages"


def test_no_runtime_subpackage_imports_one_above_it():
    graph = _graph()
    assert "runtime.kv_store.cache" in graph and "runtime.compression.driver" in graph
    assert runtime_layering_offences(graph) == []


def test_the_storage_imports_nothing_that_evicts_or_scores():
    """The KV store's modules import neither the scorers, the plan, compression nor the entry points
    (the layering implies it; the bar of issue 42 says it on its own)."""
    graph = _graph()
    storage = [module for module in graph if module.startswith("runtime.kv_store.")]
    assert "runtime.kv_store.cache" in storage
    reached = {target for module in storage for target in graph[module]}
    above = {target for target in reached if target.split(".")[:2] != ["runtime", "kv_store"]}
    assert all(target.startswith(("runtime.math", "common", "artifacts")) for target in above), sorted(above)


def test_the_runtime_check_sees_an_import_of_a_higher_subpackage():
    graph = {
        "runtime.kv_store.cache": {"runtime.compression.eviction", "runtime.math.arrays"},
        "runtime.math.arrays": set(),
        "runtime.compression.eviction": {"runtime.kv_store.cache"},
    }
    assert runtime_layering_offences(graph) == ["runtime.kv_store.cache -> runtime.compression.eviction"]
