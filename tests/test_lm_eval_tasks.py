"""``evaluate-artifact --lm-eval-tasks`` without lm-eval (profiler/lm_eval_tasks.py, issue 43): its
options are checked before any model work, a missing lm-eval is named with its install line, and
the pairing of lm-eval's per-document samples against the uncompressed reference.  The run on the
embedded model with lm-eval installed: tests/test_evaluate_lm_eval.py (make test-lm-eval)."""

from __future__ import annotations

import importlib.util

import pytest

from common.formulas import wilson_interval
from profiler.evaluate_cli import main
from profiler.lm_eval_tasks import REFERENCE, markdown_table, summarise


def sample(doc_id, prompt="p", **metrics):
    return {"doc_id": doc_id, "prompt_hash": f"{prompt}{doc_id}", "filter": "none", "metrics": list(metrics), **metrics}


def ruler(*scores):
    """RULER's shape: the score under the length the document was built for, -1 under the others."""
    return [sample(doc, **{"4096": score, "8192": -1}) for doc, score in enumerate(scores)]


def test_the_runs_pair_document_by_document_against_the_uncompressed_one():
    # the -1s are no scores; the run at 0.9 has one document fewer
    runs = {REFERENCE: ruler(1.0, 0.5, 0.0), 0.5: ruler(0.0, 1.0, 0.0), 0.9: ruler(0.0, 0.0)}
    rows = summarise({key: {"t": documents} for key, documents in runs.items()})
    by_ratio = {row["ratio"]: row for row in rows}
    assert [row["metric"] for row in rows] == ["4096"] * 3
    low, high = wilson_interval(1.5, 3)
    assert by_ratio[None] == {
        **{"task": "t", "metric": "4096", "ratio": None, "n": 3, "mean": 0.5, "low": low, "high": high},
        **{"wins": None, "losses": None, "paired": 0},
    }
    counts = [(by_ratio[r]["n"], by_ratio[r]["wins"], by_ratio[r]["losses"], by_ratio[r]["paired"]) for r in (0.5, 0.9)]
    assert counts == [(3, 1, 1, 3), (2, 0, 2, 2)]
    section = {"tasks": ["t"], "limit": 3, "question": "auto", "reference": "hf", "rows": rows}
    section["runs"] = [{"ratio": None, "policy": None}, *({"ratio": r, "policy": "flagship"} for r in (0.5, 0.9))]
    table = markdown_table(section).splitlines()
    assert table[-3:] == [
        "| t | 4096 | 0 (uncompressed) | - (hf) | 3 | 0.500 | 0.125-0.875 |  |",
        "| t | 4096 | 0.5 | flagship | 3 | 0.333 | 0.061-0.792 | 1/1 of 3 |",
        "| t | 4096 | 0.9 | flagship | 2 | 0.000 | 0.000-0.658 | 0/2 of 2 |",
    ]


def test_a_metric_that_is_no_proportion_is_left_to_lm_evals_aggregate_and_filters_are_kept_apart():
    reference = [{**sample(0, perplexity=12.5, exact_match=1.0)}, {**sample(0, exact_match=0.0), "filter": "strict"}]
    rows = summarise({REFERENCE: {"t": reference}})
    assert sorted(row["metric"] for row in rows) == ["exact_match", "exact_match,strict"]


def test_documents_built_differently_are_refused_not_paired():
    reference = [sample(0, prompt="a", acc=1.0)]
    other = [sample(0, prompt="b", acc=1.0)]
    with pytest.raises(ValueError, match="other prompts at ratio 0.5 .*task t, doc 0.*cannot be paired"):
        summarise({REFERENCE: {"t": reference}, 0.5: {"t": other}})


def test_the_lm_eval_options_are_checked_before_any_model_work(smoke_artifact, capsys):
    artifact = ["--artifact", str(smoke_artifact)]
    assert main([*artifact, "--lm-eval-limit", "3"]) == 2
    assert "--lm-eval-limit say how --lm-eval-tasks runs; add --lm-eval-tasks" in capsys.readouterr().err
    assert main([*artifact, "--lm-eval-tasks", "niah_single_1", "--lm-eval-metadata", "[4096]"]) == 2
    assert "--lm-eval-metadata '[4096]' is not a JSON object" in capsys.readouterr().err
    assert main([*artifact, "--lm-eval-tasks", "niah_single_1", "--lm-eval-metadata", "{max_seq_lengths"]) == 2
    assert "is not JSON" in capsys.readouterr().err
    if importlib.util.find_spec("lm_eval") is None:  # the main environment: lm-eval is an extra
        assert main([*artifact, "--lm-eval-tasks", "niah_single_1"]) == 2
        missing = "needs lm-evaluation-harness, which is not installed: pip install 'kvcal[lm-eval]'"
        assert missing in capsys.readouterr().err
