"""needles/ knows nothing of eviction: it takes a tokenizer object and never imports the runtime
(nor the profiler), with no exception: the generate-probes command turns ``--model`` into a
tokenizer with the model loader every kvcal command shares, ``common.models`` (the shared base,
tests/test_layering.py)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

NEEDLES_DIR = Path(__file__).resolve().parent.parent / "needles"
NEEDLES_MODULES = ["needles"] + sorted(
    f"needles.{path.stem}" for path in NEEDLES_DIR.glob("*.py") if path.stem != "__init__"
)

# Import every module, then build a probe (with a tokenizer that needs no model files).
PROBE = """
import importlib, json, sys
for name in __MODULES__:
    importlib.import_module(name)
from transformers import ByT5Tokenizer
from needles import make_probe
make_probe(ByT5Tokenizer(), "retrieval", 512, 50.0)
print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))
""".replace("__MODULES__", repr(NEEDLES_MODULES))


def test_importing_and_using_needles_imports_neither_runtime_nor_profiler():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert "needles" in loaded
    assert not loaded & {"runtime", "profiler"}, f"importing needles loaded {sorted(loaded & {'runtime', 'profiler'})}"


def test_needles_sources_do_not_import_runtime_or_profiler():
    """Static check of every import statement in needles/*.py, function bodies included."""
    offenders = []
    for source in sorted(NEEDLES_DIR.glob("*.py")):
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.split(".")[0] not in ("runtime", "profiler"):
                    continue
                offenders.append(f"{source.name}: {name}")
    assert not offenders, offenders
