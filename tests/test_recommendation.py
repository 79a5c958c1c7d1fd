"""The measured recommendation: written by profile-model / evaluate-artifact, served by the runtime."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import warnings
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from conftest import make_tiny_llama
from test_runtime_policy import write_tiny_artifact

from artifacts import open_artifact
from artifacts.report import render_report
from artifacts.summary import format_summary, summarize
from runtime import load_calibration
from runtime.plan.policy_spec import ARTIFACT_FREE, FLAGSHIP, INF_LEVERAGE, parse_policy
from runtime.plan.recommendation import Recommendation, recommended_policy, recommended_spec

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread
README = Path(__file__).parent.parent / "README.md"


def _recommendation(ratios=(0.5, 0.75, 0.9), policies=("uniform/keydiff", "inf/leverage", "uniform/knorm")):
    n = len(ratios)
    return Recommendation.from_section(
        {
            "compression_ratios": np.array(ratios),
            "policy": np.array([p.encode() for p in policies], dtype="S128"),
            "accuracy": np.full(n, 0.75),
            "ci_low": np.full(n, 0.5),
            "ci_high": np.full(n, 0.9),
        },
        {"tasks": 12, "baseline_accuracy": 0.8},
    )


def test_the_nearest_grid_ratio_at_or_above_decides_and_none_beyond_the_grid():
    recommendation = _recommendation()
    asked = (0.0, 0.5, 0.5 + 1e-12, 0.6, 0.75, 0.76, 0.9, 0.9 + 1e-12, 0.9001, 0.95, 0.975)
    assert [recommendation.deciding_index(r) for r in asked] == [0, 0, 0, 1, 1, 2, 2, 2, None, None, None]
    shuffled = _recommendation(ratios=(0.9, 0.5, 0.75), policies=("c", "a", "b"))
    assert shuffled.compression_ratios == (0.5, 0.75, 0.9) and shuffled.policies == ("a", "b", "c")


def test_a_request_beyond_the_grid_is_never_served_a_smaller_ratios_decision(tmp_path):
    """A 97.5% request from an artifact whose grid ends at 90% gets the flagship (the rule's reference,
    served without evidence against it), not the 90% decision; within the grid the decision of the
    nearest grid ratio at or above the request is served (measured at least as strictly)."""
    model = make_tiny_llama()
    calibration = load_calibration(model, path=write_tiny_artifact(tmp_path / "f.h5", model, ("budgets", "moments")))
    calibration.recommendation = _recommendation(policies=("uniform/keydiff", "inf/keydiff", "uniform/knorm"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert recommended_spec(calibration, 0.9).name == "uniform/knorm"
        assert recommended_spec(calibration, 0.8).name == "uniform/knorm"  # 0.9 decides, not the nearer 0.75
        assert recommended_spec(calibration, 0.3).name == "uniform/keydiff"
        for beyond in (0.95, 0.975):
            assert recommended_spec(calibration, beyond) is FLAGSHIP
            assert calibration.policy(compression_ratio=beyond) == FLAGSHIP.policy(beyond)


def test_numpy_integer_and_float_ratios_are_served_as_python_floats_are(tmp_path):
    """Issue 41: calibration.policy(compression_ratio=np.float32(0.5) or np.int64(0)) is a number."""
    model = make_tiny_llama()
    calibration = load_calibration(model, path=write_tiny_artifact(tmp_path / "f.h5", model, ("budgets", "moments")))
    calibration.recommendation = _recommendation(policies=("uniform/keydiff", "inf/keydiff", "uniform/knorm"))
    for value in (np.float32(0.5), np.int64(0), np.float16(0.75)):
        assert recommended_spec(calibration, value) == recommended_spec(calibration, float(value))
        assert calibration.policy(compression_ratio=value) == calibration.policy(compression_ratio=float(value))
    for value in (True, np.bool_(False), "0.5"):
        with pytest.raises(ValueError, match="compression_ratio must be a number"):
            recommended_spec(calibration, value)


def test_without_a_recommendation_the_first_servable_of_flagship_inf_leverage_artifact_free_is_served(tmp_path):
    model = make_tiny_llama()
    full = load_calibration(model, path=write_tiny_artifact(tmp_path / "f.h5", model, ("budgets", "moments")))
    moments_only = load_calibration(model, path=write_tiny_artifact(tmp_path / "n.h5", model, ("moments",)))
    with_budgets = load_calibration(model, path=write_tiny_artifact(tmp_path / "b.h5", model, ("budgets",)))
    stats_only = load_calibration(model, path=write_tiny_artifact(tmp_path / "q.h5", model, ("query_stats",)))
    assert FLAGSHIP.name == "flagship" and FLAGSHIP.policy(0.75) == parse_policy("inf/leverage+correction").policy(0.75)
    assert recommended_spec(full, 0.75) is FLAGSHIP
    assert recommended_spec(with_budgets, 0.75) is INF_LEVERAGE  # the flagship's correction needs the orders
    assert recommended_spec(moments_only, 0.75) is ARTIFACT_FREE  # INF budgets are needed by both
    assert recommended_spec(stats_only, 0.75) is ARTIFACT_FREE
    assert recommended_spec(None, 0.75) is ARTIFACT_FREE
    assert full.policy(compression_ratio=0.75) == FLAGSHIP.policy(0.75)
    policy = with_budgets.policy(compression_ratio=0.75)
    assert policy == INF_LEVERAGE.policy(0.75) and policy.kept_fraction == pytest.approx(0.25)
    assert recommended_policy(with_budgets, compression_ratio=0.75) == policy
    for bad in (1.0, -0.1, "0.75", True):
        with pytest.raises(ValueError, match="compression_ratio"):
            with_budgets.policy(compression_ratio=bad)


def test_a_recorded_policy_the_artifact_cannot_serve_falls_back_with_a_warning(tmp_path):
    model = make_tiny_llama()
    calibration = load_calibration(model, path=write_tiny_artifact(tmp_path / "b.h5", model, ("budgets",)))
    calibration.recommendation = _recommendation(policies=("uniform/keydiff", "global/learned", "inf/leverage"))
    assert calibration.policy(compression_ratio=0.5) == parse_policy("uniform/keydiff").policy(0.5)
    with pytest.warns(UserWarning, match="'global/learned' cannot be served.*using inf/leverage"):
        assert calibration.policy(compression_ratio=0.7) == INF_LEVERAGE.policy(0.7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert calibration.policy(compression_ratio=0.9) == parse_policy("inf/leverage").policy(0.9)


def test_a_recommendation_of_baseline_falls_back_with_a_warning_not_an_attribute_error(tmp_path):
    """Issue 30 D3: 'baseline' recommended raised AttributeError in calibration.policy(0.75); a reader
    refuses such a file, and a recommendation set by hand falls back like any policy it cannot serve."""
    model = make_tiny_llama()
    calibration = load_calibration(model, path=write_tiny_artifact(tmp_path / "b.h5", model, ("budgets",)))
    calibration.recommendation = _recommendation(policies=("uniform/keydiff", "baseline", "inf/leverage"))
    with pytest.warns(UserWarning, match="'baseline' cannot be served.*compresses nothing.*using inf/leverage"):
        assert calibration.policy(compression_ratio=0.75) == INF_LEVERAGE.policy(0.75)


@pytest.fixture(scope="module")
def recommended_artifact(smoke_artifact, tmp_path_factory):
    """The smoke artifact plus a recommendation section written by `profile-model --stages recommendation`."""
    from conftest import single_thread

    from profiler.cli import main

    out = tmp_path_factory.mktemp("recommended") / "kv_calibration.h5"
    shutil.copyfile(smoke_artifact, out)
    printed = io.StringIO()
    arguments = [
        "--preset",
        "smoke",
        "--stages",
        "recommendation",
        "--recommend-policies",
        "inf/keydiff+correction,inf/leverage",
        "--recommend-compression-ratios",
        "0.5,0.75",
        "--recommend-families",  # the defaults (every family on two haystacks: 42 tasks on smoke) take minutes
        "retrieval,multi_key",
        "--recommend-haystacks",
        "simple",
        "--out",
        str(out),
        "--no-progress",
    ]
    with single_thread(), redirect_stdout(printed):
        assert main(arguments) == 0
    return out, printed.getvalue()


def test_profile_model_records_the_recommendation_and_the_runtime_serves_the_same_policy(
    recommended_artifact, embedded_model, embedded_tokenizer
):
    path, printed = recommended_artifact
    # no flagship among these candidates: the most accurate is served, and the stage says so
    assert "the flagship is not among the candidates served; rule most-accurate/1" in printed
    assert re.search(
        r"recommendation: 6 held-out tasks, baseline \d\.\d\d, rule most-accurate/1; 0\.5: \S+ \d\.\d\d; 0\.75: ",
        printed,
    )
    with open_artifact(path) as reader:
        assert {"behaviour", "budgets", "moments", "recommendation"} <= set(reader.sections)  # others kept
        section = reader.section("recommendation")
        config = reader.config["recommendation"]
        text, page = format_summary(summarize(reader)), render_report(reader)
    assert "recommendation  measured on 6 held-out tasks" in text and "compression ratio 0.75: " in text
    assert 'id="served-policies"' in page and "How to serve this model" in page
    recorded = [name.decode() for name in section["policy"]]
    candidates = [name.decode() for name in section["candidates"]]
    assert candidates == ["inf/keydiff+correction", "inf/leverage"] == config["candidates"]
    assert list(section["compression_ratios"]) == [0.5, 0.75] and set(recorded) <= set(candidates)
    assert section.attrs["tasks"] == 6 and section.attrs["families"] == "retrieval,multi_key"
    assert section.attrs["task_seed"] != 0 and config["tasks"]["specs"][0]["seed"] == section.attrs["task_seed"]
    assert section["rule"][0].decode() == "most-accurate/1" and list(section["reference"]) == [-1, -1]
    assert section["outcomes"].shape == (2, 2, 6) and len(set(section["task_ids"].tolist())) == 6
    for column, name in enumerate(recorded):  # the recorded policy is the most accurate, ties to the first
        accuracy = section["candidate_accuracy"][:, column]
        assert name == candidates[int(np.argmax(accuracy))] and section["accuracy"][column] == accuracy.max()
        assert section["ci_low"][column] <= section["accuracy"][column] <= section["ci_high"][column]
    calibration = load_calibration(embedded_model, embedded_tokenizer, path=path)
    try:
        for ratio, name in zip((0.5, 0.75), recorded, strict=True):
            assert calibration.policy(compression_ratio=ratio) == parse_policy(name).policy(ratio)
        assert calibration.recommendation.baseline_accuracy == section.attrs["baseline_accuracy"]
    finally:
        calibration.close()


def test_the_recommendation_is_off_by_default_for_smoke_and_on_from_quick(smoke_run):
    from profiler.presets import PRESETS
    from profiler.stages import default_stages

    assert "recommendation" not in default_stages(PRESETS["smoke"])
    assert all("recommendation" in default_stages(PRESETS[name]) for name in ("quick", "standard", "paper"))
    assert "recommendation" not in smoke_run[1]


def test_evaluate_artifact_writes_its_recommendation_into_the_artifact(smoke_artifact, tmp_path, capsys):
    from profiler.evaluate_cli import main

    path = tmp_path / "kv_calibration.h5"
    shutil.copyfile(smoke_artifact, path)
    arguments = [
        "--artifact",
        str(path),
        "--preset",
        "smoke",
        "--tasks",
        "retrieval",
        "--haystacks",
        "simple",
        "--no-progress",
    ]
    arguments += ["--compression-ratios", "0.75", "--policies", "uniform/keydiff,inf/leverage", "--json"]
    arguments += [str(tmp_path / "ev.json"), "--write-recommendation", "--max-new-tokens", "12"]
    arguments += ["--paired-tolerance", "5", "--paired-confidence", "0.9"]
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "Policy to serve per compression ratio" in out and "wrote the recommendation section" in out
    evaluation = json.loads((tmp_path / "ev.json").read_text())
    (decided,) = evaluation["recommendation"]["per_ratio"]  # what the table printed
    served = next(row for row in decided["candidates"] if row["policy"] == decided["served"])
    with open_artifact(path) as reader:
        section = reader.section("recommendation")
        assert [n.decode() for n in section["policy"]] == [decided["served"]]
        assert section["accuracy"][0] == served["accuracy"] and section.attrs["tasks"] == decided["n"] == 2
        # the paired rule's parameters given reach the section (they were parsed and dropped)
        assert (section["tolerance"][0], section["confidence"][0]) == (0.05, 0.9)
        assert (evaluation["recommendation"]["tolerance"], evaluation["recommendation"]["confidence"]) == (0.05, 0.9)
        assert reader.config["recommendation"]["source"] == "evaluate-artifact"
        assert set(reader.sections) >= {"behaviour", "budgets", "query_stats", "moments"}


def test_evaluate_artifact_measures_kvzip_but_never_records_it(smoke_artifact, tmp_path, capsys):
    """kvzip runs its reconstruction pass per task (timed in its cells' prefill) and is compared
    side by side; the recommendation written into the artifact is chosen among the others, since
    calibration.policy() cannot serve a policy that needs a forward pass of its own."""
    from profiler.evaluate_cli import main

    path = tmp_path / "kv_calibration.h5"
    shutil.copyfile(smoke_artifact, path)
    arguments = [
        "--artifact",
        str(path),
        "--preset",
        "smoke",
        "--tasks",
        "retrieval",
        "--haystacks",
        "simple",
        "--no-progress",
    ]
    arguments += ["--compression-ratios", "0.5", "--policies", "global/kvzip,uniform/kvzip,uniform/knorm"]
    arguments += ["--json", str(tmp_path / "ev.json"), "--write-recommendation", "--max-new-tokens", "12"]
    assert main(arguments) == 0
    evaluation = json.loads((tmp_path / "ev.json").read_text())
    rows = {r["policy"]: r for r in evaluation["results"]}
    assert set(rows) == {"global/kvzip", "uniform/kvzip", "uniform/knorm"}
    assert all(rows[name]["n"] == 2 and rows[name]["kv_fraction"] < 0.6 for name in rows)
    # the reconstruction pass (about one more prefill) is in the kvzip cells' prefill time
    assert min(rows["global/kvzip"]["prefill_seconds"], rows["uniform/kvzip"]["prefill_seconds"]) > (
        1.3 * rows["uniform/knorm"]["prefill_seconds"]
    )
    assert evaluation["recommendation"]["candidates"] == ["uniform/knorm"]
    assert [entry["served"] for entry in evaluation["recommendation"]["per_ratio"]] == ["uniform/knorm"]
    with open_artifact(path) as reader:
        section = reader.section("recommendation")
        assert [n.decode() for n in section["policy"]] == ["uniform/knorm"]
        assert [n.decode() for n in section["candidates"]] == ["uniform/knorm"]


def test_kvzip_is_refused_as_a_recommendation_candidate_or_a_recorded_recommendation(tmp_path):
    from profiler.job import JobOptions, ProfileJob

    options = JobOptions(
        model=str(tmp_path / "no-such-model"), preset="quick", settings={"recommend_policies": ("global/kvzip",)}
    )
    with pytest.raises(ValueError, match="reconstruction pass"):
        ProfileJob(options)
    model = make_tiny_llama()
    calibration = load_calibration(model, path=write_tiny_artifact(tmp_path / "b.h5", model, ("budgets",)))
    calibration.recommendation = _recommendation(policies=("global/kvzip", "inf/leverage", "inf/leverage"))
    with pytest.warns(UserWarning, match="reconstruction pass"):
        assert recommended_spec(calibration, 0.5) is INF_LEVERAGE
    assert recommended_spec(calibration, 0.75).name == "inf/leverage"


def _readme_serving_snippet() -> str:
    """The serving section's runnable example: its python block that loads `make profile`'s artifact
    (the section opens with a six-line usage block that names no artifact path)."""
    text = README.read_text()
    start = text.index("## Serving with an artifact")
    section = text[start : text.index("\n## ", start + 1)]
    blocks = [block for block in re.findall(r"```python\n(.*?)```", section, re.S) if "out/kv_calibration.h5" in block]
    assert len(blocks) == 1, f"README's serving section has {len(blocks)} runnable snippets, not one"
    return blocks[0]


def test_the_readme_serving_snippet_runs_verbatim_and_answers_at_75_percent_compression(recommended_artifact, tmp_path):
    """CI runs README.md's serving snippet as written, where `make profile` leaves the artifact."""
    snippet = _readme_serving_snippet()
    assert "compression_ratio=0.75" in snippet and "out/kv_calibration.h5" in snippet
    (tmp_path / "out").mkdir()
    shutil.copyfile(recommended_artifact[0], tmp_path / "out" / "kv_calibration.h5")
    script = "import torch\ntorch.set_num_threads(1)\n" + snippet
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **__import__("os").environ,
            "PYTHONPATH": str(README.parent),
            "PYTHONWARNINGS": "default::FutureWarning,default::DeprecationWarning,default::UserWarning",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4821" in done.stdout, done.stdout
    # every warning is shown once (PYTHONWARNINGS below): none may say the code calls a deprecated API,
    # and none is ours (issue 26: the served policy's correction orders are its own scorer's)
    assert not re.search(r"FutureWarning|DeprecationWarning", done.stderr), done.stderr[-3000:]
    assert not re.search(r"UserWarning: [^\n]*kv_calibration\.h5", done.stderr), done.stderr[-3000:]


def test_profile_model_help_lists_the_default_candidates():
    """The --recommend-policies help names exactly the candidates the stage measures by default."""
    from profiler.cli import build_parser
    from profiler.evaluation_results import RECOMMENDATION_CANDIDATES
    from profiler.presets import PRESETS

    text = " ".join(build_parser().format_help().split()).replace("- ", "-")
    assert "quick: the flagship alone" in text and PRESETS["quick"].recommendation_candidates == ("flagship",)
    assert "else " + ", ".join(RECOMMENDATION_CANDIDATES) in text
    assert all(not PRESETS[name].recommendation_candidates for name in ("standard", "paper"))
