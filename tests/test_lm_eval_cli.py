"""``kvcal-lm-eval`` (runtime/lm_eval_cli.py) without lm-eval: the arguments it hands lm-eval's
command line, and its message where lm-eval is not installed.  lm-eval's own run of the command is
in tests/test_lm_eval_model.py (``make test-lm-eval``); these run in the main suite too."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runtime.lm_eval_cli import MISSING, with_tokenizer_default

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = "/models/tok"
BAR = ["--model", "kvcal", "--model_args", "compression_ratio=0.75", "--tasks", "niah_single_1"]


def test_the_command_is_the_projects_console_script():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvcal-lm-eval"] == "runtime.lm_eval_cli:main"


def test_kvcal_declares_itself_as_an_lm_eval_model_plugin():
    """lm-eval's entry-point discovery (EleutherAI/lm-evaluation-harness PR #4013, after 0.4.13) resolves
    ``--model kvcal`` through the group ``lm_eval.models``; kvcal declares it (lm-eval 0.4.13 ignores it).
    tests/test_lm_eval_model.py resolves it through lm-eval's registry."""
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["lm_eval.models"]
    assert plugins == {"kvcal": "runtime.lm_eval_model:KvcalLM"}


def test_the_tokenizer_default_merges_into_the_json_metadata():
    argv = [*BAR, "--metadata", '{"max_seq_lengths":[2048]}', "--limit", "4"]
    rewritten, added = with_tokenizer_default(argv, TOKENIZER)
    assert added == TOKENIZER
    assert rewritten[:7] == argv[:7] and rewritten[8:] == argv[8:]  # only the metadata's value changed
    assert json.loads(rewritten[7]) == {"max_seq_lengths": [2048], "tokenizer": TOKENIZER}
    inline, _ = with_tokenizer_default(["--model=kvcal", '--metadata={"max_seq_lengths":[4096]}'], TOKENIZER)
    assert inline[0] == "--model=kvcal" and inline[1].startswith("--metadata=")
    assert json.loads(inline[1].partition("=")[2]) == {"max_seq_lengths": [4096], "tokenizer": TOKENIZER}


def test_without_json_metadata_the_tokenizer_is_one_metadata_more():
    """No --metadata, or key=value metadata: lm-eval merges one more --metadata occurrence into it."""
    assert with_tokenizer_default(BAR, TOKENIZER) == (
        [*BAR, "--metadata", json.dumps({"tokenizer": TOKENIZER})],
        TOKENIZER,
    )
    argv = ["-M", "kvcal", "-a", "compression_ratio=0.5", "--metadata", "max_seq_lengths=[4096,8192]"]
    rewritten, added = with_tokenizer_default(argv, TOKENIZER)
    assert added == TOKENIZER and rewritten == [*argv, "--metadata", json.dumps({"tokenizer": TOKENIZER})]


@pytest.mark.parametrize(
    "named",
    [
        ["--model_args", "compression_ratio=0.75,tokenizer=gpt2"],
        ["--model_args", "compression_ratio=0.75", "pretrained=/models/llama"],
        ["--model_args", '{"compression_ratio": 0.75, "pretrained": "/models/llama"}'],
        ["--model_args=compression_ratio=0.75,model=gpt2"],
        ["--metadata", '{"tokenizer": "gpt2", "max_seq_lengths": [2048]}'],
        ["--metadata", "max_seq_lengths=[2048,4096],tokenizer=gpt2"],
        ["--metadata", "max_seq_lengths=[2048]", "pretrained=gpt2"],
    ],
)
def test_a_named_tokenizer_is_left_as_it_is(named):
    argv = ["--model", "kvcal", "--tasks", "niah_single_1", *named, "--limit", "4"]
    assert with_tokenizer_default(argv, TOKENIZER) == (argv, None)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "hf", "--tasks", "niah_single_1"],
        ["--model", "kvcal", "--model", "hf", "--tasks", "niah_single_1"],  # the last --model counts
        ["ls", "tasks"],
    ],
)
def test_other_models_and_commands_are_left_as_they_are(argv):
    assert with_tokenizer_default(argv, TOKENIZER) == (argv, None)


def test_an_empty_tokenizer_names_none():
    rewritten, added = with_tokenizer_default([*BAR[:3], "compression_ratio=0.75,tokenizer="], TOKENIZER)
    assert added == TOKENIZER and json.loads(rewritten[-1]) == {"tokenizer": TOKENIZER}


def test_without_lm_eval_the_command_says_how_to_install_it():
    """lm-eval made unimportable: exit 2 and one line naming the extra (no traceback)."""
    probe = (
        "import sys\n"
        "sys.modules['lm_eval'] = None  # lm-eval absent\n"
        "from runtime.lm_eval_cli import main\n"
        "sys.exit(main(['--model', 'kvcal', '--model_args', 'compression_ratio=0.75', '--tasks', 'niah_single_1']))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == MISSING and "pip install 'kvcal[lm-eval]'" in MISSING
    assert result.stdout == ""
