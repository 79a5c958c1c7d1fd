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
    assert [stage.name for stage in job.stage_classes] == ["behaviour", "moments"]
    assert job.stage_names == ("behaviour", "moments")
    assert STAGE_NAMES.index("behaviour") < STAGE_NAMES.index("query-stats") < STAGE_NAMES.index("budgets")


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"max_new_tokens": -1}, r"max_new_tokens \(--max-new-tokens\) must be an integer in \[1, 1048576\], got -1"),
        ({"batch_size": -2}, r"batch_size \(--batch-size\) must be an integer in \[1, 65536\]"),
        ({"n_sink": 64, "calib_tokens": 64}, r"n_sink \(64\) must be smaller than the window \(64 tokens\)"),
        ({"query_centres": 0}, r"query_centres \(--query-centres\) must be an integer in \[1, 256\]"),
        ({"query_centres": 1000}, r"query_centres \(--query-centres\) must be an integer in \[1, 256\], got 1000"),
        ({"future_sample": -3}, r"future_sample \(--future-sample\) must be an integer in \[1, 1048576\]"),
        ({"query_centres": True}, r"query_centres \(--query-centres\) must be an integer in \[1, 256\], got True"),
        ({"beta": float("nan")}, r"beta \(--beta\) must be a finite number in \[1, inf\)"),
        ({"keep_ratios": ()}, r"keep_ratios \(--keep-ratios\) must be a non-empty list"),
        ({"curve_compression_ratios": (0.5, 0.5)}, r"curve_compression_ratios .* must be a non-empty list of distinct"),
        ({"curve_selection": "knorm"}, r"curve_selection \(--curve-selection\) must be one of keydiff, leverage"),
        ({"calib_samples": 1}, "the learned-scorer stage needs at least 2 calibration windows"),
        ({"recommend_policies": ("baseline",)}, "'baseline' is measured anyway"),
        ({"max_new_token": 3}, "unknown setting.*max_new_token; the settings are"),
    ],
)
def test_bad_settings_are_refused_before_the_model_loads(settings, message):
    every_stage = STAGE_NAMES  # future-queries is opt-in: name it so that its settings are checked
    with pytest.raises(ValueError, match=message):
        ProfileJob(JobOptions(preset="smoke", stages=every_stage, settings=settings))


# -- the sections a stage reads, checked for every stage alike before the model loads -------------------


def _run_without_a_model(tmp_path, out: Path, *stages: str, **settings):
    """``ProfileJob.run`` on a hub id that is not there: any model load would fail with ModelNotFoundError,
    so an error that names a section was raised before the model loads."""
    from common.models import ModelNotFoundError

    options = JobOptions(model="no-such-org/never-loaded", out=out, preset="smoke", stages=stages, settings=settings)
    with pytest.raises((ValueError, ModelNotFoundError)) as raised:
        ProfileJob(options).run()
    return raised.value


@pytest.fixture
def offline_hub(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _artifact_with(tmp_path, *sections: str) -> Path:
    from conftest import make_random_artifact, make_random_identity

    from artifacts import write_artifact

    artifact = make_random_artifact(make_random_identity(2, 4, 2, 16), sections=sections)
    return write_artifact(tmp_path / f"{'-'.join(sections)}.h5", artifact)


def test_recommendation_without_the_sections_it_serves_is_refused_before_the_model_loads(tmp_path, offline_hub):
    error = _run_without_a_model(tmp_path, tmp_path / "a.h5", "recommendation")
    message = str(error)
    assert isinstance(error, ValueError)
    assert message.startswith("the recommendation stage needs the sections of at least one candidate ")
    # the smallest sets that serve a candidate: inf/leverage is served by INF (behaviour or budgets),
    # global/learned by the learned weights alone, curve/keydiff+correction by the curves and the orders
    assert "from the section(s) behaviour or budgets or learned_scorer or budget_curves+moments: add the " in message
    assert "(behaviour, budget-curves, budgets, learned-scorer, moments) to --stages before recommendation" in message
    assert str(tmp_path / "a.h5") in message
    # an artifact at the output with sections that serve no candidate: refused the same way
    error = _run_without_a_model(tmp_path, _artifact_with(tmp_path, "query_stats", "moments"), "recommendation")
    assert isinstance(error, ValueError) and "the recommendation stage needs" in str(error)
    # candidates of their own choosing: curve/keydiff+correction needs budget_curves and moments
    curve = {"recommend_policies": ("curve/keydiff+correction",)}
    error = _run_without_a_model(tmp_path, _artifact_with(tmp_path, "moments"), "recommendation", **curve)
    assert "from the section(s) budget_curves+moments: add the stage(s) that build them (budget-curves, moments)" in (
        str(error)
    )
    # inf/leverage is served by the budgets section: the check passes and the load is tried
    error = _run_without_a_model(tmp_path, _artifact_with(tmp_path, "budgets"), "recommendation")
    assert "no-such-org/never-loaded" in str(error) and "needs" not in str(error)


def test_a_section_built_earlier_in_the_run_counts_a_later_one_does_not(tmp_path, offline_hub):
    from profiler.presets import PRESETS
    from profiler.stages import check_requirements, resolve_settings

    preset = PRESETS["smoke"]
    learned = resolve_settings({"moments_selection": ("keydiff", "learned")}, preset, ("moments",))
    check_requirements(("learned-scorer", "moments"), learned, set(), "out.h5")
    check_requirements(("moments",), learned, {"learned_scorer"}, "out.h5")
    with pytest.raises(ValueError, match=r"^the moments stage needs the learned scorer's weights .* learned_scorer"):
        check_requirements(("moments",), learned, {"behaviour"}, "out.h5")
    check_requirements(("moments",), resolve_settings({}, preset, ("moments",)), set(), "out.h5")  # keydiff then
    defaults = resolve_settings({}, preset, ("budgets",))
    check_requirements(("behaviour", "budgets"), defaults, set(), "out.h5")
    with pytest.raises(ValueError, match=r"^the budgets stage needs INFsc, from the section\(s\) behaviour: add"):
        check_requirements(("budgets",), defaults, {"budgets", "query_stats"}, "out.h5")
    error = _run_without_a_model(tmp_path, _artifact_with(tmp_path, "query_stats"), "budgets")
    assert isinstance(error, ValueError) and "the budgets stage needs INFsc" in str(error)
    error = _run_without_a_model(tmp_path, _artifact_with(tmp_path, "behaviour"), "budgets")
    assert "no-such-org/never-loaded" in str(error)  # the kept behaviour section serves: the load is tried


def test_every_setting_has_one_option_and_the_parser_fills_exactly_the_settings():
    from profiler.stages import settings_options

    options = settings_options()
    dests = [option.dest for option in options]
    assert len(dests) == len(set(dests)) and len({option.flag for option in options}) == len(options)
    args = build_parser().parse_args(["--stages", "budgets", "--beta", "3", "--keep-ratios", "0.5,0.25"])
    parsed = {dest: getattr(args, dest) for dest in dests}
    assert parsed["beta"] == 3.0 and parsed["keep_ratios"] == (0.5, 0.25)
    assert {dest for dest, value in parsed.items() if value is not None} == {"beta", "keep_ratios"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--curve-compression-ratios", "0.5,0.5"])  # distinct, from the same kind


def test_the_context_is_frozen_and_its_settings_are_read_only(tmp_path):
    from dataclasses import FrozenInstanceError

    from profiler.presets import PRESETS
    from profiler.stages import StageContext, resolve_settings

    preset = PRESETS["smoke"]
    notes = tmp_path / "notes.txt"  # a calibration file must exist: checked when the settings are resolved
    notes.write_text("calibration text\n")
    settings = resolve_settings({"calib_dataset": str(notes), "beta": 3}, preset, STAGE_NAMES)
    context = StageContext(
        preset_name="smoke",
        preset=preset,
        settings=settings,
        stage_names=STAGE_NAMES,
        model=None,  # not read here
        tokenizer=None,
        geometry=None,
        identity=None,
        out=Path("a.h5"),
        existing_sections=frozenset({"behaviour"}),
        info=None,
        progress=False,
    )
    with pytest.raises(FrozenInstanceError):
        context.out = Path("b.h5")
    with pytest.raises(TypeError):
        context.settings["beta"] = 4  # a stage cannot change what the others read
    assert settings["beta"] == 3 and settings["calib_samples"] == preset.calib_samples  # given / the preset's
    assert settings["max_new_tokens"] == preset.max_new_tokens and settings["query_centres"] == 4
    assert context.calibration_config() == {
        "source": str(notes),
        "split": "train",
        "num_samples": preset.calib_samples,
        "sample_tokens": preset.calib_tokens,
    }
