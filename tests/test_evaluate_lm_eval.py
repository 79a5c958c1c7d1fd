"""``evaluate-artifact --lm-eval-tasks`` on the embedded model (profiler/lm_eval_tasks.py, issue 43):
an lm-eval task uncompressed (lm-eval's own ``hf`` model: the reference) and at the artifact's
ratios through kvcal, next to the needle tasks, paired document by document.

Needs lm-eval (``make test-lm-eval``; KVCAL_REQUIRE_LM_EVAL turns the skip into a failure).  The
options' checks without lm-eval and the pairing arithmetic: tests/test_lm_eval_tasks.py.
"""

from __future__ import annotations

import json
import os

import pytest

if os.environ.get("KVCAL_REQUIRE_LM_EVAL"):
    import lm_eval  # noqa: F401  (make test-lm-eval: a missing lm-eval fails, never skips)
pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed: pip install -e '.[lm-eval]' (make test-lm-eval runs these tests)"
)

from profiler.evaluate_cli import main  # noqa: E402

NEEDLES = ["--preset", "smoke", "--tasks", "retrieval", "--haystacks", "simple", "--policies", "flagship"]


@pytest.mark.slow
def test_an_lm_eval_task_runs_beside_the_needles_paired_with_the_unmodified_model(
    smoke_artifact, tmp_path, capsys, one_thread, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "evaluation.json"
    arguments = [
        "--artifact",
        str(smoke_artifact),
        *NEEDLES,
        "--compression-ratios",
        "0.75",
        "--lm-eval-tasks",
        "niah_single_1",
        "--lm-eval-limit",
        "2",
        "--lm-eval-metadata",
        '{"max_seq_lengths":[1024]}',
        "--json",
        str(out),
        "--no-progress",
    ]
    assert main(arguments) == 0
    printed = capsys.readouterr().out
    section = json.loads(out.read_text())["lm_eval"]
    assert section["tasks"] == ["niah_single_1"] and section["limit"] == 2
    assert section["metadata"]["max_seq_lengths"] == [1024] and section["metadata"]["tokenizer"]
    runs = {run["ratio"]: run for run in section["runs"]}
    assert set(runs) == {None, 0.75} and runs[0.75]["policy"] == "flagship"  # the smoke artifact serves it
    # the RULER prompts were split at their question: compressed without seeing it
    assert runs[0.75]["question_counts"]["question_agnostic_prompts"] == 2
    rows = {row["ratio"]: row for row in section["rows"]}
    # RULER scores the length it built (1024); its -1 for the lengths it did not build is no score
    assert {row["metric"] for row in section["rows"]} == {"1024"}
    assert rows[None]["n"] == rows[0.75]["n"] == 2 and rows[None]["wins"] is None
    assert rows[0.75]["paired"] == 2 and rows[0.75]["wins"] + rows[0.75]["losses"] <= 2
    for row in rows.values():  # lm-eval's own aggregate is the same mean
        results = runs[row["ratio"]]["results"]["niah_single_1"]
        assert results["1024,none"] == pytest.approx(row["mean"]) and row["low"] <= row["mean"] <= row["high"]
    assert "| niah_single_1 | 1024 | 0 (uncompressed) | - (hf) | 2 |" in printed
    assert "| niah_single_1 | 1024 | 0.75 | flagship | 2 |" in printed
    assert "| flagship | 0.75 |" in printed  # the needle table is still there, before


def test_an_unknown_lm_eval_task_is_refused_before_the_model_loads(smoke_artifact, capsys):
    assert main(["--artifact", str(smoke_artifact), *NEEDLES, "--lm-eval-tasks", "niah_single_1,no_such_task"]) == 2
    assert "lm-eval knows no task no_such_task" in capsys.readouterr().err


def test_kvcal_serves_a_loaded_model_and_calibration(smoke_artifact, one_thread):
    """What evaluate-artifact hands lm-eval: kvcal's model around the loaded model, tokenizer and
    Calibration (no second load), serving calibration.policy(ratio); dtype is then refused."""
    from common.models import load_model, load_tokenizer
    from runtime import load_calibration
    from runtime.lm_eval_model import KvcalLM

    model, tokenizer = load_model(None), load_tokenizer(None)
    calibration = load_calibration(model, tokenizer, path=smoke_artifact)
    lm = KvcalLM(pretrained=model, tokenizer=tokenizer, artifact=calibration, compression_ratio=0.75)
    assert lm.model is model and lm.tokenizer is tokenizer and lm.calibration is calibration
    assert lm.policy == calibration.policy(0.75) and lm.artifact == str(smoke_artifact.resolve())
    with pytest.raises(ValueError, match="a loaded model is used as it is"):
        KvcalLM(pretrained=model, tokenizer=tokenizer, compression_ratio=0.75, dtype="bfloat16")
