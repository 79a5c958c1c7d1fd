"""Conventions every command shares: import-light parsers, --version, progress bars
off when stderr is not a terminal, clear errors for a model that does not exist.

``--help`` wall time is not tested (machine-dependent); what makes it fast is: building a
parser imports neither torch nor transformers, which is deterministic and checked here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import COMMAND_MODULES

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


def test_the_command_lines_take_the_runtime_vocabulary_from_common_names_not_copies():
    """evaluate-artifact's parser, the runtime's validation and the profiler's moments stage use the
    very same torch-free objects of ``common.names``: nothing to keep in step."""
    from common import names
    from profiler import evaluate_cli, moments
    from runtime.plan import calibration, policy, policy_spec
    from runtime.scorers import SCORERS, registry

    assert evaluate_cli.ALLOCATIONS is names.ALLOCATIONS is policy.ALLOCATIONS
    assert evaluate_cli.STATISTICS is names.STATISTICS is policy.STATISTICS
    assert evaluate_cli.SCORERS is names.SCORER_NAMES and tuple(SCORERS) == names.SCORER_NAMES
    assert registry.REGISTERED is names.SCORER_CLASSES
    assert evaluate_cli.NAMED_POLICIES is names.NAMED_POLICIES
    assert set(policy_spec.NAMED_POLICIES) == set(names.NAMED_POLICIES)
    for name, text in names.NAMED_POLICIES.items():
        spelled = policy_spec.parse_policy(text)
        named = policy_spec.NAMED_POLICIES[name]
        assert (named.allocation, named.scorer, named.statistics, named.options) == (
            spelled.allocation,
            spelled.scorer,
            spelled.statistics,
            spelled.options,
        )
    assert moments.SELECTION_SCORERS is calibration.MOMENT_SELECTIONS is names.MOMENT_SELECTIONS


def test_common_names_imports_without_torch():
    import subprocess
    import sys

    code = "import sys, common.names; print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_stage_options_take_their_names_from_the_method_modules_not_copies():
    """profile-model's choices and defaults are the method modules' own objects (imported
    torch-free), so there is nothing to keep in step."""
    from common import names
    from profiler import budget_curves, moments
    from profiler.stages import settings_options

    options = {option.dest: option for option in settings_options()}
    assert moments.SELECTION_SCORERS is names.MOMENT_SELECTIONS
    assert options["moments_selection"].kind.item.values is names.MOMENT_SELECTIONS
    assert options["curve_selection"].kind.values is budget_curves.SELECTIONS
    assert options["curve_compression_ratios"].default is budget_curves.CURVE_RATIOS
    assert options["curve_floor"].default is budget_curves.CURVE_FLOOR
    assert options["curve_retention_weight"].default is budget_curves.RETENTION_WEIGHT


COMMANDS = COMMAND_MODULES


@pytest.mark.parametrize("command", COMMANDS)
def test_version_names_the_command_and_the_installed_distribution(command):
    from importlib.metadata import version

    done = _python("-m", COMMANDS[command], "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{command} {version('kvcal')}"


def test_version_from_a_source_tree_that_was_never_installed(monkeypatch):
    import importlib.metadata

    from common.version import toolkit_version

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


# -- a model that does not exist -----------------------------------------------------------------


@pytest.fixture
def offline_hub(monkeypatch):
    """No network retries: the hub is offline (only the local hub cache is looked at)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_path_that_does_not_exist_is_no_such_model_directory(tmp_path):
    from common.models import ModelNotFoundError, resolve_model

    paths = ("./no-such-model", "../no/such", str(tmp_path / "gone"), "~/no-such-model", "models/a/b", "x/", "é/x")
    for path in paths:
        with pytest.raises(ModelNotFoundError, match="^no such model directory: "):
            resolve_model(path)
    for hub_id in ("org/some-model", "gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert resolve_model(hub_id) == hub_id  # hub-id shaped: from_pretrained resolves it


def test_a_hub_id_that_is_neither_a_directory_nor_in_the_hub_cache_says_both(offline_hub):
    from common.models import ModelNotFoundError, load_model, load_tokenizer

    for load in (load_tokenizer, load_model):
        with pytest.raises(ModelNotFoundError) as info:
            load("no-such-org/no-such-model")
        message = str(info.value)
        assert message.startswith("no such model directory: no-such-org/no-such-model, and no hub id ")
        assert "in the local hub cache" in message


def _commands(model: str, tmp_path) -> dict:
    return {
        "profile-model": ("profiler.cli", [model, "--out", str(tmp_path / "a.h5"), "--preset", "smoke"]),
        "evaluate-artifact": ("profiler.evaluate_cli", [model, "--artifact", str(tmp_path / "a.h5")]),
        "generate-probes": ("needles.cli", ["--model", model, "--preset", "smoke", "--out", str(tmp_path / "p.jsonl")]),
    }


@pytest.mark.parametrize("command", ["profile-model", "evaluate-artifact", "generate-probes"])
@pytest.mark.parametrize("model", ["./no-such-model", "no-such-org/no-such-model"])
def test_commands_say_the_model_does_not_exist(command, model, tmp_path, capsys, offline_hub):
    import importlib

    module, argv = _commands(model, tmp_path)[command]
    assert importlib.import_module(module).main(argv) == 2  # an uncaught exception would fail the test
    err = capsys.readouterr().err
    assert f"no such model directory: {model}" in err
    assert ("hub id" in err) == ("/" in model and not model.startswith("."))
    assert "Traceback" not in err and "Repo id must use" not in err


# -- progress bars -------------------------------------------------------------------------------


class _Terminal:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def test_progress_bars_only_on_a_terminal_and_never_under_no_progress(monkeypatch):
    from transformers.utils import logging

    from common.models import use_progress_bars

    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)  # restored after the test
    before = logging.is_progress_bar_enabled()  # process-wide: in-process command runs may have turned it off
    logging.enable_progress_bar()
    try:
        monkeypatch.setattr(sys, "stderr", _Terminal(True))
        assert use_progress_bars(no_progress=False) and logging.is_progress_bar_enabled()
        assert not use_progress_bars(no_progress=True)
        assert not logging.is_progress_bar_enabled()  # transformers' (and huggingface_hub's) loading bars too
        assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"  # and datasets', imported later
        logging.enable_progress_bar()
        monkeypatch.setattr(sys, "stderr", _Terminal(False))  # a log file or a pipe
        assert not use_progress_bars(no_progress=False) and not logging.is_progress_bar_enabled()
    finally:
        (logging.enable_progress_bar if before else logging.disable_progress_bar)()


def _assert_no_bar(stderr: str) -> None:
    assert "%|" not in stderr and "\r" not in stderr and "it/s" not in stderr, stderr


def test_generate_probes_draws_no_bar_into_a_pipe(tmp_path):
    done = _python("-m", "needles.cli", "--preset", "smoke", "--families", "retrieval", "--out", str(tmp_path / "p"))
    assert done.returncode == 0, done.stderr
    assert "wrote 2 probes" in done.stderr
    _assert_no_bar(done.stderr)


def test_profile_model_draws_no_bar_into_a_pipe(tmp_path, embedded_tokenizer):
    from conftest import make_tiny_llama

    model = make_tiny_llama(vocab_size=len(embedded_tokenizer))
    model.save_pretrained(tmp_path)
    embedded_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "calib.txt").write_text("A heron waited by the mill pond while the barges passed. " * 40)
    args = [str(tmp_path), "--out", str(tmp_path / "a.h5"), "--preset", "smoke", "--stages", "query-stats"]
    args += ["--calib-dataset", str(tmp_path / "calib.txt"), "--calib-samples", "2", "--calib-tokens", "32"]
    done = _python("-m", "profiler.cli", *args, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "a.h5").is_file()
    _assert_no_bar(done.stderr)
