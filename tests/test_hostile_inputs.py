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
