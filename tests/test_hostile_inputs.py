"""Issue 13: bad input or a fault is refused with one clear error, never a traceback or a wrong answer.

Each section lists, one test per case, what is refused; the test names read as that list.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama

REPO = Path(__file__).resolve().parents[1]


# -- models and the runtime API ------------------------------------------------------------------


def _bad_config_dir(tmp_path: Path, **fields) -> Path:
    """A real model directory (tiny Llama + the embedded tokenizer's files) whose config.json has ``fields``."""
    from runtime.models import embedded_model_dir

    directory = tmp_path / "bad-model"
    make_tiny_llama().save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, directory / name)
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_model_directory_with_an_invalid_config_field_is_a_clear_model_error(tmp_path):
    from runtime.models import ModelError, load_model, load_tokenizer

    directory = _bad_config_dir(tmp_path, num_hidden_layers="x")
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelError) as info:
            load(directory)
        message = str(info.value)
        assert str(directory) in message and "num_hidden_layers" in message and "\n" not in message


@pytest.mark.parametrize("command", ["profile-model", "evaluate-artifact", "generate-probes"])
def test_commands_exit_2_on_a_model_directory_with_an_invalid_config(command, tmp_path, capsys, one_thread):
    directory = _bad_config_dir(tmp_path, num_hidden_layers="x")
    capsys.readouterr()  # save_pretrained's own output
    module, argv = {
        "profile-model": ("profiler.cli", [str(directory), "--out", str(tmp_path / "a.h5"), "--preset", "smoke"]),
        "evaluate-artifact": ("profiler.evaluate_cli", [str(directory), "--artifact", str(tmp_path / "a.h5")]),
        "generate-probes": (
            "needles.cli",
            ["--model", str(directory), "--preset", "smoke", "--out", str(tmp_path / "p")],
        ),
    }[command]
    assert importlib.import_module(module).main(argv) == 2  # an uncaught exception fails the test
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(directory) in lines[0] and "num_hidden_layers" in lines[0], lines


def test_evaluate_artifact_of_an_uncached_hub_id_offline_exits_2_without_a_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "profiler.evaluate_cli", "no-such-org/no-such-model", "--no-progress"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "no such model directory: no-such-org/no-such-model, and no hub id" in done.stderr


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"keep_ratio": math.nan}, "keep_ratio"),
        ({"compression_ratio": math.nan}, "compression_ratio"),
        ({"compression_ratio": math.inf}, "compression_ratio"),
        ({"budget": 2.5}, "budget"),
        ({"min_budget": math.nan}, "min_budget"),
        ({"min_budget": 1.5}, "min_budget"),
        ({"n_sink": math.nan}, "n_sink"),
        ({"n_sink": True}, "n_sink"),
        ({"window": 2.5}, "window"),
        ({"beta": math.nan}, "beta"),
        ({"beta": math.inf}, "beta"),
        ({"tau": math.nan}, "tau"),
        ({"tau": math.inf}, "tau"),
        ({"moment_rounds": 2.0}, "moment_rounds"),
        ({"evict_every": 1.5}, "evict_every"),
        ({"moment_eviction": "yes", "scorer": "snapkv"}, "moment_eviction"),
    ],
    ids=lambda value: value if isinstance(value, str) else ",".join(f"{k}={v!r}" for k, v in value.items()),
)
def test_policy_refuses_a_nan_infinite_or_fractional_field_naming_it(fields, name):
    from runtime import CompressionPolicy

    if not {"keep_ratio", "compression_ratio", "budget"} & set(fields):
        fields = {"keep_ratio": 0.5, **fields}
    with pytest.raises(ValueError, match=rf"^{name} (\([^)]*\) )?must be "):
        CompressionPolicy(**fields)


SCORER_OPTIONS = [
    ("expected_attention", "horizon", math.nan),
    ("expected_attention", "horizon", 2.5),
    ("expected_attention", "epsilon", math.nan),
    ("expected_attention", "epsilon", math.inf),
    ("expected_attention", "pool", 3.0),
    ("snapkv", "window", math.nan),
    ("snapkv", "kernel", 2.5),
    ("leverage", "blend", math.nan),
    ("leverage", "blend", math.inf),
    ("leverage", "sketch", 2.5),
    ("leverage", "sketch", math.nan),
    ("leverage", "chunk", math.nan),
    ("leverage", "pool", 1.0),
    ("leverage", "exclude_first", 0.5),
    ("leverage", "exclude_last", math.nan),
    ("leverage", "seed", 0.5),
    ("leverage", "ridge", math.nan),
    ("leverage", "ridge", math.inf),
    ("leverage", "attention_scale", math.nan),
    ("leverage", "attention_scale", 0.0),
    ("leverage", "pre_rope", "no"),
    ("leverage", "value_norm", 0),
]


@pytest.mark.parametrize(("scorer", "option", "value"), SCORER_OPTIONS, ids=lambda v: str(v))
def test_scorer_options_refuse_a_nan_infinite_fractional_or_non_boolean_value_naming_the_option(scorer, option, value):
    from runtime import CompressionPolicy
    from runtime.scorers import make_scorer

    with pytest.raises(ValueError, match=rf"{option} must be "):
        make_scorer(scorer, **{option: value})
    with pytest.raises(ValueError, match=rf"{option} must be "):
        CompressionPolicy(keep_ratio=0.5, scorer=scorer, scorer_options={option: value})


def _prompt(batch=1, length=12, vocab=128):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(4, vocab, (batch, length), generator=generator)


@pytest.mark.parametrize("block_size", [2.5, math.nan, 0, True])
def test_compress_prompt_refuses_a_block_size_that_is_not_a_positive_integer(block_size, one_thread):
    from runtime import CompressionPolicy, compress_prompt

    with pytest.raises(ValueError, match="^block_size must be "):
        compress_prompt(make_tiny_llama(), _prompt(), CompressionPolicy(keep_ratio=0.5), block_size=block_size)


@pytest.mark.parametrize("columns", [2.5, True, 0, 12, -1])
def test_compress_prompt_refuses_context_columns_that_are_not_an_integer_inside_the_prompt(columns, one_thread):
    from runtime import CompressionPolicy, compress_prompt

    with pytest.raises(ValueError, match="context_columns"):
        compress_prompt(make_tiny_llama(), _prompt(), CompressionPolicy(keep_ratio=0.5), context_columns=columns)


def test_a_prompt_longer_than_the_model_context_is_refused_before_any_compute(one_thread):
    from runtime import CompressionPolicy, compress_prompt, generate

    model = make_tiny_llama()
    model.config.max_position_embeddings = 16
    ids = _prompt(length=20)
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    for run in (compress_prompt, generate):
        with pytest.raises(ValueError, match="20 tokens.*max_position_embeddings.*16"):
            run(model, ids, CompressionPolicy(keep_ratio=0.5))
    assert not calls  # refused before the model ran
    mask = torch.ones_like(ids)
    mask[:, :4] = 0  # 16 real tokens (left padding): fits
    compress_prompt(model, ids, CompressionPolicy(keep_ratio=0.5), attention_mask=mask)


def test_answer_refuses_a_context_longer_than_the_model_context(embedded_tokenizer, one_thread):
    from runtime import CompressionPolicy, answer

    model = make_tiny_llama(vocab_size=len(embedded_tokenizer))
    model.config.max_position_embeddings = 64
    with pytest.raises(ValueError, match="max_position_embeddings"):
        answer(
            model,
            embedded_tokenizer,
            "The sky is blue. " * 40,
            "What colour is the sky?",
            CompressionPolicy(keep_ratio=0.5),
        )


def test_a_batch_row_that_is_all_padding_is_refused_naming_the_row(one_thread):
    from runtime import CompressionPolicy, compress_prompt, generate

    ids = _prompt(batch=3)
    mask = torch.ones_like(ids)
    mask[1] = 0
    for run in (compress_prompt, generate):
        for policy in (CompressionPolicy(keep_ratio=0.5), None):
            with pytest.raises(ValueError, match="row 1 .*all padding"):
                run(make_tiny_llama(), ids, policy, attention_mask=mask)


@pytest.mark.parametrize(
    ("ids", "mask", "message"),
    [
        (torch.zeros(0, 8, dtype=torch.long), None, "empty"),
        (torch.zeros(2, 0, dtype=torch.long), None, "empty|at least one column"),
        (torch.ones(2, 8, dtype=torch.long), torch.ones(2, 7, dtype=torch.long), "attention_mask.*shape"),
        (torch.ones(2, 8, dtype=torch.long), torch.full((2, 8), 2), "attention_mask must hold only 0"),
        (torch.ones(2, 8), None, "input_ids.*integer"),
    ],
    ids=["no-rows", "no-columns", "mask-shape", "mask-values", "float-ids"],
)
def test_generate_refuses_an_empty_or_malformed_input(ids, mask, message, one_thread):
    from runtime import CompressionPolicy, generate

    with pytest.raises(ValueError, match=message):
        generate(make_tiny_llama(), ids, CompressionPolicy(keep_ratio=0.5), attention_mask=mask, max_new_tokens=2)


def test_token_ids_outside_the_vocabulary_are_refused(one_thread):
    from runtime import CompressionPolicy, generate

    ids = _prompt()
    ids[0, 3] = 128  # the tiny model's vocabulary is 0..127
    with pytest.raises(ValueError, match="token id 128.*vocabulary of 128"):
        generate(make_tiny_llama(), ids, CompressionPolicy(keep_ratio=0.5), max_new_tokens=2)


def test_a_calibration_of_another_architecture_is_refused_by_compress_prompt(tmp_path, one_thread):
    from test_runtime_policy import write_tiny_artifact

    from runtime import CompressionPolicy, compress_prompt, load_calibration

    profiled = make_tiny_llama(num_layers=3)
    calibration = load_calibration(profiled, path=write_tiny_artifact(tmp_path / "a.h5", profiled))
    other = make_tiny_llama(num_layers=2)
    calls = []
    other.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="calibration.*another architecture.*num_layers"):
        compress_prompt(other, _prompt(), CompressionPolicy(keep_ratio=0.5, allocation="inf"), calibration=calibration)
    assert not calls


def _cache_copy(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the real converted embedded model in a fresh cache; the env that points at it."""
    from runtime.models import embedded_model_dir

    source = embedded_model_dir()  # the real cache, converted already (or now)
    cache = tmp_path / "cache"
    target = cache / "kvcal" / "models" / source.name
    shutil.copytree(source, target)
    return target, {**os.environ, "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1"}


LOAD_EMBEDDED = (
    "import warnings; warnings.simplefilter('always')\n"
    "from runtime.models import embedded_model_dir, load_model, load_tokenizer\n"
    "d = embedded_model_dir(); m = load_model(); t = load_tokenizer()\n"
    "assert m.config.num_hidden_layers == 30 and len(t) > 1000\n"
    "print(d)\n"
)


def _load_embedded(env: dict, count: int = 1) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_EMBEDDED], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for _ in range(count)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode()))
    return results


def _assert_healed(target: Path, reference: Path) -> None:
    from runtime.models import MANIFEST_NAME, cache_entry_problem

    assert cache_entry_problem(target, hashes=True) is None and (target / MANIFEST_NAME).is_file()
    assert (target / "model.safetensors").stat().st_size == (reference / "model.safetensors").stat().st_size
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # nothing left aside


def test_a_truncated_weights_file_in_the_embedded_model_cache_is_converted_again(tmp_path):
    from runtime.models import embedded_model_dir

    target, env = _cache_copy(tmp_path)
    weights = target / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    (done,) = _load_embedded(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(target)
    assert "is damaged (model.safetensors has" in done.stderr and "Traceback" not in done.stderr
    _assert_healed(target, embedded_model_dir())


def test_a_deleted_weights_file_in_the_embedded_model_cache_is_converted_once_by_two_processes_at_once(tmp_path):
    from runtime.models import _write_manifest, embedded_model_dir

    target, env = _cache_copy(tmp_path)
    _write_manifest(target)  # as a conversion leaves it
    (target / "model.safetensors").unlink()
    results = _load_embedded(env, count=2)
    for done in results:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(target)
    warned = [done for done in results if "model.safetensors is missing" in done.stderr]
    assert len(warned) == 1  # one converts; the other waits for it and uses its copy
    _assert_healed(target, embedded_model_dir())


def test_a_weights_file_damaged_without_changing_its_size_is_converted_again_when_the_load_fails(tmp_path):
    from runtime.models import _write_manifest, embedded_model_dir

    target, env = _cache_copy(tmp_path)
    _write_manifest(target)
    with open(target / "model.safetensors", "r+b") as fh:
        fh.write(b"\xff" * 8)  # the header length: safetensors cannot read it, the size is unchanged
    (done,) = _load_embedded(env)
    assert done.returncode == 0, done.stderr
    assert "differs from the file converted" in done.stderr
    _assert_healed(target, embedded_model_dir())
