"""No test, benchmark, make target or CI step names a file that exists on one machine only.

The suite, the benchmarks' usage lines, the Makefile and ``.ci/`` run on a fresh clone of the
repository on any machine (issue 38: two test modules read a smoke artifact under ``work/art``, a
file left on the machine where they were written, and every one of their cases errored everywhere
else).  What they
may name: paths inside the repository (relative ones), the test's own temporary directory
(``tmp_path``), the user's caches through ``~`` or an environment variable (``~/.cache/kvcal``,
``$XDG_CACHE_HOME``: a test redirects them), and the operating system's interfaces.

The rule, applied to every text file under ``tests/`` and ``benchmarks/``, the ``Makefile`` and every
file under ``.ci/``: an absolute path is a path to a machine's files when its first component is one
of ``MACHINE_ROOTS`` (the homes, the work, scratch and temporary areas, mounted and installed
software: where a machine keeps its own files, different from one machine to the next).  An
absolute path starts at a ``/`` that no name, ``.``, ``~``, ``/``, ``$``, ``)``, ``}`` or ``]`` stands
before (so ``$(VENV)/bin``, ``{tmp}/out.h5``, ``tmp_path / "x"`` and URLs' paths are not one), or
right after ``file://`` (a file URL is a path).  Not counted:

* ``/dev``, ``/proc``, ``/sys``: the kernel's interfaces (``/dev/null``, ``/dev/full``,
  ``/proc/self/status``), the same on every Linux machine;
* ``#!/usr/bin/env``, a shebang: the portable way to find an interpreter;
* any other first component (``/model``, ``/behaviour/RAsc``: paths inside an HDF5 file; a made-up
  ``/abs/missing/dir`` that a test passes to show it is refused): no machine keeps files there.

Nothing else is allowed (no list of exceptions per file): a path a test genuinely needs from the
machine, a browser's binary say, is found on ``PATH`` (``shutil.which``), not named.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# First components of absolute paths where a machine keeps its own files.
MACHINE_ROOTS = (
    "work", "home", "root", "Users", "tmp", "var", "scratch", "data", "mnt", "media", "srv", "opt",
    "usr", "etc", "lib", "lib64", "bin", "sbin", "nix", "snap", "private", "Volumes", "nfs", "net", "afs",
)  # fmt: skip
SHEBANG = re.compile(r"#!/usr/bin/env\b")
MACHINE_PATH = re.compile(
    r"(?:(?<![\w.~/$)}\]])|(?<=file://))/(?:" + "|".join(MACHINE_ROOTS) + r")(?![\w.-])(?:/[^\s'\"`)\]},;:]*)?"
)


def machine_paths(text: str) -> list[tuple[int, str]]:
    """Every absolute path to a machine's files in ``text`` (a file's text; see the module's
    docstring), with the number of its line."""
    text = SHEBANG.sub(lambda shebang: " " * len(shebang.group(0)), text)
    return [(text.count("\n", 0, match.start()) + 1, match.group(0)) for match in MACHINE_PATH.finditer(text)]


def checked_files() -> list[Path]:
    files = [ROOT / "Makefile"]
    for folder in ("tests", "benchmarks", ".ci"):
        files += [path for path in sorted((ROOT / folder).rglob("*")) if path.is_file()]
    return [path for path in files if "__pycache__" not in path.parts]


def test_no_file_names_a_path_to_a_machines_files():
    found = []
    checked = 0
    for path in checked_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file holds no path a person wrote
            continue
        checked += 1
        found += [f"{path.relative_to(ROOT)}:{number}: {named}" for number, named in machine_paths(text)]
    assert checked > 50, f"only {checked} files read: the folders moved?"
    assert not found, "paths that exist on one machine only:\n" + "\n".join(found)


# The rule itself, on the forms it must catch and those it must let through.  The paths to catch are
# put together from MACHINE_ROOTS so that this file holds none itself.
@pytest.mark.parametrize("root", MACHINE_ROOTS)
@pytest.mark.parametrize(
    "form",
    [
        'SMOKE = Path(os.environ.get("KVCAL_SMOKE_ARTIFACT", "/{root}/art/smoke.h5"))',
        "    python benchmarks/x.py --artifact /{root}/artifacts/quick12.h5 --out-prefix /{root}",
        "find-links = file:///{root}/wheels",
        "pip install /{root}/wheels/torch.whl",
        "cp out.h5 '/{root}/x'",
        "VENV=/{root}/venv make test",
    ],
)
def test_the_rule_catches_a_machine_path(form, root):
    line = form.format(root=root)
    assert machine_paths(line), line


@pytest.mark.parametrize(
    "line",
    [
        "#!/usr/bin/env bash",
        "command -v chromedriver >/dev/null 2>&1",
        'target = {"device": "/dev/full"}',
        'Path("/proc/self/status").read_text()',
        "test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)",
        'args = ("--out", "{tmp}/out.h5")',
        'out = tmp_path / "work" / "home"',
        'group = handle["/behaviour/RAsc"]',
        'for bad in ("../escape", "a/b/c", "/abs/missing/dir"):',
        "see https://example.org/home/tmp/work and runtime/work/tmp.py",
        "the cache is ~/.cache/kvcal or $XDG_CACHE_HOME/kvcal",
        "rates in tokens/s, 3/4 of the heads",
    ],
)
def test_the_rule_lets_through_what_is_no_machine_path(line):
    assert machine_paths(line) == [], line
