"""evaluate-artifact end to end on the embedded model (smoke-sized), and its input errors."""

from __future__ import annotations

import json

import pytest

from profiler.evaluate_cli import main

RESULT_KEYS = {
    "policy",
    "compression_ratio",
    "n",
    "correct",
    "accuracy",
    "ci_low",
    "ci_high",
    "attention_error",
    "kv_bytes",
    "kv_fraction",
    "prefill_seconds",
    "decode_seconds",
    "per_family",
    "outcomes",
}
TOP_KEYS = {
    "schema",
    "created",
    "model",
    "artifact",
    "question_aware",
    "tasks",
    "task_summary",
    "task_ids",
    "baseline",
    "results",
    "recommendation",
    "best_per_ratio",
}


def test_smoke_run_on_the_embedded_model(smoke_artifact, tmp_path, capsys, one_thread):
    json_out, html_out = tmp_path / "ev.json", tmp_path / "ev.html"
    code = main(
        [
            "--artifact",
            str(smoke_artifact),
            "--preset",
            "smoke",
            "--tasks",
            "retrieval",
            "--compression-ratios",
            "0.5,0.9",
            "--policies",
            "uniform/keydiff,flagship",
            "--max-new-tokens",
            "20",
            "--json",
            str(json_out),
            "--html",
            str(html_out),
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert table.startswith("| policy | compression ratio | accuracy [95% CI]") and "| baseline | - |" in table
    evaluation = json.loads(json_out.read_text())
    assert set(evaluation) == TOP_KEYS and evaluation["schema"] == "kvcal-evaluation/2"
    assert evaluation["tasks"]["seed"] != evaluation["tasks"]["profiler_seed"] == 0
    assert [(r["policy"], r["compression_ratio"]) for r in evaluation["results"]] == [
        ("uniform/keydiff", 0.5),
        ("uniform/keydiff", 0.9),
        ("flagship", 0.5),
        ("flagship", 0.9),
    ]
    baseline = evaluation["baseline"]
    assert set(baseline) == RESULT_KEYS and baseline["n"] == 2 and baseline["attention_error"] is None
    assert baseline["accuracy"] == 1.0  # the embedded model answers 512-token retrieval uncompressed
    assert len(set(evaluation["task_ids"])) == 2  # the tasks every result's outcomes are listed in
    for result in [baseline, *evaluation["results"]]:
        assert len(result["outcomes"]) == 2 and sum(result["outcomes"]) == result["correct"]
    for result in evaluation["results"]:
        assert set(result) == RESULT_KEYS and result["n"] == 2
        assert 0 < result["attention_error"] < 2
        kept = 1 - result["compression_ratio"]
        assert result["kv_fraction"] == pytest.approx(kept, abs=0.03)  # memory follows the budget
    assert "recommendation" in evaluation and evaluation["recommendation"]["text"]
    page = html_out.read_text()
    assert page.count('class="curve"') == 2 and 'class="baseline"' in page


def test_bad_input_is_reported_before_any_model_work(smoke_artifact, capsys):
    assert main(["--artifact", str(smoke_artifact), "--policies", "uniform/nonsense"]) == 2
    assert "unknown scorer 'nonsense'" in capsys.readouterr().err
    assert main(["--artifact", str(smoke_artifact), "--compression-ratios", "1.5"]) == 2
    assert "compression ratios must be in [0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # the old spelling names the new one
        main(["--artifact", str(smoke_artifact), "--ratios", "0.5"])
    assert exited.value.code == 2 and "--ratios was renamed --compression-ratios" in capsys.readouterr().err
    assert main(["--artifact", str(smoke_artifact), "--tasks", "sudoku"]) == 2
    assert "unknown task families ['sudoku']" in capsys.readouterr().err
