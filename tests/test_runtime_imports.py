"""runtime/ stays lightweight: it never imports the profiler, the probe generator or their deps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from import_graph import import_cycles, import_graph

FORBIDDEN = ("profiler", "needles", "datasets", "accelerate", "jinja2", "tqdm")

RUNTIME_DIR = Path(__file__).resolve().parent.parent / "runtime"
RUNTIME_SOURCES = sorted(RUNTIME_DIR.rglob("*.py"))  # runtime/*.py and its packages' (runtime/scorers/)
# Modules of an optional extra: each may import its extra's package (and only that one more); the
# core never imports them (test_the_core_leaves_the_optional_integrations_out), so the probe skips them.
OPTIONAL_MODULES = {"runtime.kvpress_press": "kvpress", "runtime.lm_eval_model": "lm_eval"}
# ...and what else one may import: lm-eval's models draw lm-eval's progress bars, tqdm's (a kvcal
# dependency the core runtime leaves out).
OPTIONAL_MODULES_ALSO = {"runtime.lm_eval_model": {"tqdm"}}
# Core modules that import an extra's package inside a function only (kvcal-lm-eval's main): the
# probe imports them without the extra, and the static check refuses the package at their top level.
LAZY_OPTIONAL_MODULES = {"runtime.lm_eval_cli": "lm_eval"}
RUNTIME_MODULES = ["runtime"] + sorted(
    name
    for path in RUNTIME_SOURCES
    if path != RUNTIME_DIR / "__init__.py"
    and (name := ".".join(("runtime", *path.relative_to(RUNTIME_DIR).with_suffix("").parts)).removesuffix(".__init__"))
    not in OPTIONAL_MODULES
)

# One interpreter: first what transformers' cache/mask modules load by themselves (they import
# jinja2 for chat templates as soon as transformers.utils loads: transformers' dependency, not
# ours, so it is measured and discounted), then what importing every runtime module adds.
PROBE = """
import importlib, json, sys
tops = lambda: sorted({name.split('.')[0] for name in sys.modules})
import transformers.cache_utils, transformers.masking_utils
baseline = tops()
for name in __MODULES__:
    importlib.import_module(name)
print(json.dumps([baseline, tops()]))
""".replace("__MODULES__", repr(RUNTIME_MODULES))


def test_importing_runtime_pulls_in_no_calibration_machinery():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    baseline, loaded = (set(names) for names in json.loads(result.stdout.strip().splitlines()[-1]))
    pulled_by_runtime = {name for name in FORBIDDEN if name in loaded and name not in baseline}
    assert not pulled_by_runtime, f"importing runtime loaded {sorted(pulled_by_runtime)}"
    for package in ("profiler", "needles", "datasets", "accelerate"):
        assert package not in loaded, f"importing runtime loaded {package}"
    assert {"runtime", "artifacts", "torch", "transformers", "numpy", "h5py"} <= loaded


def test_runtime_sources_import_only_allowed_packages():
    """Static check of every import statement in runtime/ (its packages included)."""
    import ast

    allowed = {"common", "artifacts", "prompt_format", "torch", "transformers", "numpy", "h5py", "runtime"}
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    assert "runtime.scorers.registry" in RUNTIME_MODULES and "runtime.scorers" in RUNTIME_MODULES
    for source in RUNTIME_SOURCES:
        tree = ast.parse(source.read_text())
        in_functions = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            module = ".".join(("runtime", *source.relative_to(RUNTIME_DIR).with_suffix("").parts))
            for name in names:
                top = name.split(".")[0]
                optional = {OPTIONAL_MODULES.get(module), *OPTIONAL_MODULES_ALSO.get(module, ())}
                if id(node) in in_functions:
                    optional.add(LAZY_OPTIONAL_MODULES.get(module))
                if top not in allowed and top not in stdlib and top not in optional:
                    offenders.append(f"{source.relative_to(RUNTIME_DIR)}: {name}")
    assert not offenders, offenders


def test_the_core_leaves_the_optional_integrations_out():
    """``import runtime, artifacts, profiler, needles`` (and every core runtime module) loads neither
    kvpress nor the module that wraps it: ``pip install -e .`` without the ``kvpress`` extra works."""
    probe = (
        "import importlib, json, sys\n"
        "import runtime, artifacts, profiler, needles, prompt_format\n"
        f"for name in {RUNTIME_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert "runtime.scorers.leverage" in loaded  # the probe did import the core
    assert set(LAZY_OPTIONAL_MODULES) <= loaded  # ...and the modules whose extra only main() imports
    for name in (*OPTIONAL_MODULES, *OPTIONAL_MODULES.values()):
        assert name not in loaded, f"the core imports {name}"


def runtime_import_graph(root: Path = RUNTIME_DIR) -> dict[str, set[str]]:
    """Every import of every module of the ``runtime`` package at ``root`` (function-local and
    ``TYPE_CHECKING`` imports included) as edges between its modules (``tests/import_graph.py``)."""
    return import_graph(root)


def test_the_scan_finds_a_cycle_closed_by_a_function_local_import(tmp_path):
    package = tmp_path / "runtime"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import f\n")
    (package / "a.py").write_text("def f():\n    from .sub.c import g\n    return g\n")
    (package / "b.py").write_text("import runtime.a\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "c.py").write_text("from .. import b\n\ng = 1\n")
    graph = runtime_import_graph(package)
    assert graph == {
        "runtime": {"runtime.a"},
        "runtime.a": {"runtime.sub.c"},
        "runtime.b": {"runtime.a"},
        "runtime.sub": set(),
        "runtime.sub.c": {"runtime.b"},
    }
    assert import_cycles(graph) == [["runtime.a", "runtime.b", "runtime.sub.c"]]
    (package / "a.py").write_text("def f():\n    return 1\n")
    assert import_cycles(runtime_import_graph(package)) == []


def test_runtime_modules_import_each_other_without_a_cycle():
    """No runtime module imports, even inside a function, one that imports it back (the
    ``runtime/__init__.py`` re-exports included); the policy value (runtime.plan.policy) imports
    neither the recommendation, the policy grammar nor the serving plan."""
    graph = runtime_import_graph()
    assert (
        "runtime.plan.policy" in graph["runtime.plan.policy_spec"]
        and "runtime.plan.serving_plan" in graph["runtime.compression.prefill"]
    )
    assert not graph["runtime.plan.policy"] & {
        "runtime.plan.recommendation",
        "runtime.plan.policy_spec",
        "runtime.plan.serving_plan",
    }
    assert import_cycles(graph) == []
