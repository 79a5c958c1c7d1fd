"""The stage registry: every stage is wired to a schema section, the format doc and --help."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.schema import SECTIONS as SCHEMA_SECTIONS
from profiler.cli import build_parser
from profiler.job import JobOptions, ProfileJob
from profiler.stages import STAGE_NAMES, STAGES

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", STAGES, ids=lambda stage: stage.name)
def test_every_stage_writes_a_documented_schema_section(stage):
    assert stage.section in SCHEMA_SECTIONS
    assert f"### `/{stage.section}`" in (REPO / "docs" / "artifact-format.md").read_text()
    assert stage.summary and stage.units


def test_help_lists_every_stage_and_its_options():
    text = build_parser().format_help()
    for stage in STAGES:
        assert f"  {stage.name} " in text
    assert "--moments-selection" in text and "--max-new-tokens" in text and "--budgets" in text
    assert "--query-centres" in text and "--future-sample" in text


def test_stages_run_in_canonical_order_whatever_the_order_asked():
    job = ProfileJob(JobOptions(stages=("moments", "behaviour"), preset="smoke"))
    assert [stage.name for stage in job.stages] == ["behaviour", "moments"]
    assert STAGE_NAMES.index("behaviour") < STAGE_NAMES.index("query-stats") < STAGE_NAMES.index("budgets")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"batch_size": -2}, "batch_size"),
        ({"n_sink": 64, "calib_tokens": 64}, "n_sink"),
        ({"query_centres": 0}, "query_centres must be a positive integer"),
        ({"future_sample": -3}, "future_sample must be a positive integer"),
    ],
)
def test_bad_settings_are_refused_before_the_model_loads(settings, message):
    every_stage = STAGE_NAMES  # future-queries is opt-in: name it so that its settings are checked
    with pytest.raises(ValueError, match=message):
        ProfileJob(JobOptions(preset="smoke", stages=every_stage, settings=settings))
