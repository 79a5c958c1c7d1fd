"""evaluate-artifact end to end on the embedded model (smoke-sized): its JSON with every task's
answers, a run killed mid-way and resumed, and its input errors."""

from __future__ import annotations

import json

import pytest
from conftest import kill_evaluation_after_its_first_task

from profiler.evaluate_cli import main
from profiler.evaluation_journal import journal_path, read_journal

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
    "per_task",
}
TIMING = ("prefill_seconds", "decode_seconds", "created")


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
            "--haystacks",
            "simple",
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
    assert set(evaluation) == TOP_KEYS and evaluation["schema"] == "kvcal-evaluation/3"
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
    for index, task in enumerate(evaluation["per_task"]):  # every task's answers, in the order of task_ids
        assert task["id"] == evaluation["task_ids"][index] and task["family"] == "retrieval"
        assert task["length"] == 512 and task["haystack"] and task["depth"] in (25.0, 75.0)
        assert task["baseline"]["correct"] == baseline["outcomes"][index] and task["baseline"]["text"]
        for cell, result in zip(task["cells"], evaluation["results"], strict=True):
            assert (cell["policy"], cell["compression_ratio"]) == (result["policy"], result["compression_ratio"])
            assert cell["correct"] == result["outcomes"][index] and 0 < cell["attention_error"] < 2
    # the decision the artifact's rule takes, on 2 tasks: the flagship, and too few tasks to say more
    recommendation = evaluation["recommendation"]
    assert recommendation["reference"] == "flagship" and recommendation["candidates"] == ["uniform/keydiff", "flagship"]
    assert [entry["served"] for entry in recommendation["per_ratio"]] == ["flagship", "flagship"]
    assert all(entry["n"] == 2 and entry["too_few_tasks"] for entry in recommendation["per_ratio"])
    assert "2 tasks are too few for any candidate to replace the flagship" in table
    assert "| 0.5 | flagship |" in table and "**served**" in table
    page = html_out.read_text()
    assert page.count('class="curve"') == 2 and 'class="baseline"' in page


def test_bad_input_is_reported_before_any_model_work(smoke_artifact, capsys):
    assert main(["--artifact", str(smoke_artifact), "--policies", "uniform/nonsense"]) == 2
    assert "unknown scorer 'nonsense'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # a usage error: one line, exit 2
        main(["--artifact", str(smoke_artifact), "--compression-ratios", "1.5"])
    assert exited.value.code == 2 and "expected a number in [0, 1), got '1.5'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # the old spelling names the new one
        main(["--artifact", str(smoke_artifact), "--ratios", "0.5"])
    assert exited.value.code == 2 and "--ratios was renamed --compression-ratios" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["--artifact", str(smoke_artifact), "--tasks", "sudoku"])
    assert exited.value.code == 2 and "unknown task family 'sudoku'" in capsys.readouterr().err


def test_a_killed_run_resumes_to_the_json_of_an_uninterrupted_one(smoke_artifact, tmp_path, capsys, one_thread):
    """Killed (SIGKILL) after its first task, refused when resumed with another setting, then
    resumed: the JSON equals a straight run's but for wall times; the journal is gone at the end."""
    arguments = [
        "--artifact",
        str(smoke_artifact),
        "--preset",
        "smoke",
        "--tasks",
        "retrieval",
        "--haystacks",
        "simple",
        "--count",
        "2",
    ]
    arguments += ["--compression-ratios", "0.5", "--policies", "uniform/keydiff,flagship", "--no-progress"]
    killed, straight = tmp_path / "killed.json", tmp_path / "straight.json"
    journal = journal_path(killed)
    kill_evaluation_after_its_first_task([*arguments, "--max-new-tokens", "12", "--json", str(killed)], journal)
    assert not killed.exists()
    kept = len(read_journal(journal).rows)
    assert 1 <= kept < 4
    before = journal.read_bytes()

    assert main([*arguments, "--max-new-tokens", "10", "--json", str(killed), "--resume"]) == 2
    assert "max_new_tokens: 12 in the journal, 10 now" in capsys.readouterr().err
    assert journal.read_bytes() == before and not killed.exists()

    assert main([*arguments, "--max-new-tokens", "12", "--json", str(killed), "--resume"]) == 0
    assert f"{kept} of 4 tasks recorded" in capsys.readouterr().err
    assert main([*arguments, "--max-new-tokens", "12", "--json", str(straight)]) == 0
    assert not journal.exists() and not journal_path(straight).exists()
    resumed, uninterrupted = (json.loads(path.read_text()) for path in (killed, straight))
    assert resumed["per_task"][0]["baseline"]["text"] and len(resumed["per_task"]) == 4
    assert without(resumed, TIMING) == without(uninterrupted, TIMING)


def without(value, keys):
    """``value`` with the entries named ``keys`` dropped at every depth."""
    if isinstance(value, dict):
        return {key: without(item, keys) for key, item in value.items() if key not in keys}
    if isinstance(value, list):
        return [without(item, keys) for item in value]
    return value
