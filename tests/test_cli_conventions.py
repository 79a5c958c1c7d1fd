"""Conventions every command shares (issue 12): import-light parsers, --version, progress bars
off when stderr is not a terminal, clear errors for a model that does not exist.

``--help`` wall time is not tested (machine-dependent); what makes it fast is: building a
parser imports neither torch nor transformers, which is deterministic and checked here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLI_MODULES = ("profiler.cli", "profiler.evaluate_cli", "artifacts.cli", "needles.cli")
HEAVY = ("torch", "transformers", "tqdm", "datasets", "accelerate")


def _python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=300, **kwargs)


PROBE = """
import contextlib, io, sys
import {module} as cli
cli.build_parser()
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    cli.main(["--help"])
print(",".join(name for name in {heavy!r} if name in sys.modules))
"""


@pytest.mark.parametrize("module", CLI_MODULES)
def test_parsing_and_help_import_no_torch(module):
    done = _python("-c", PROBE.format(module=module, heavy=HEAVY))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{module}'s parser or --help imported {done.stdout.strip()}"


def test_torch_free_copies_of_runtime_names_agree_with_the_runtime():
    """The parsers spell out a few runtime names so that they need no torch; they must not drift."""
    from profiler import evaluate_cli, moments_calibration
    from profiler.stages import moments
    from runtime.policy import ALLOCATIONS
    from runtime.scorers import SCORERS

    assert evaluate_cli.ALLOCATIONS == ALLOCATIONS
    assert evaluate_cli.SCORERS == tuple(SCORERS)
    assert moments.SELECTION_SCORERS == moments_calibration.SELECTION_SCORERS


COMMANDS = {
    "profile-model": "profiler.cli",
    "evaluate-artifact": "profiler.evaluate_cli",
    "inspect-artifact": "artifacts.cli",
    "generate-probes": "needles.cli",
}


@pytest.mark.parametrize("command", COMMANDS)
def test_version_names_the_command_and_the_installed_distribution(command):
    from importlib.metadata import version

    done = _python("-m", COMMANDS[command], "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{command} {version('kvcal')}"


def test_version_from_a_source_tree_that_was_never_installed(monkeypatch):
    import importlib.metadata

    from artifacts.version import toolkit_version

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert toolkit_version() == "0+unknown"


def test_inspect_artifact_json_reports_an_invalid_file_as_json(tmp_path, capsys):
    import json

    from artifacts.cli import main

    broken = tmp_path / "kv_calibration.h5"
    broken.write_bytes(b"not an HDF5 file")
    for path in (broken, tmp_path / "missing.h5"):
        assert main([str(path), "--json"]) == 2
        captured = capsys.readouterr()
        report = json.loads(captured.out)
        assert report["valid"] is False and report["error"] and str(path) in report["error"]
        assert captured.err.startswith("inspect-artifact: invalid artifact: ")  # the message stays on stderr too
    assert main([str(broken)]) == 2
    captured = capsys.readouterr()
    assert not captured.out and "invalid artifact" in captured.err  # without --json: stderr only, as before
