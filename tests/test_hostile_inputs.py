"""Issue 13: bad input or a fault is refused with one clear error, never a traceback or a wrong answer.

Each section lists, one test per case, what is refused; the test names read as that list.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama

REPO = Path(__file__).resolve().parents[1]


# -- models and the runtime API ------------------------------------------------------------------


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
