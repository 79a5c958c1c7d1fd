"""evaluate-artifact's pure logic: policy grammar, intervals, the paired decision it prints."""

from __future__ import annotations

import pytest

from profiler.evaluation_results import (
    markdown_table,
    paired_recommendation,
    tasks_for_identical_answers,
    wilson_interval,
)
from profiler.paired_decision import loss_bound
from runtime.plan.policy_spec import parse_policy


def _row(policy, ratio, accuracy, kv_bytes=1000):
    return {
        "policy": policy,
        "compression_ratio": ratio,
        "n": 12,
        "correct": round(accuracy * 12),
        "accuracy": accuracy,
        "kv_bytes": kv_bytes,
        "kv_fraction": 1 - (ratio or 0),
        "ci_low": 0.0,
        "ci_high": 1.0,
        "attention_error": 0.1,
        "prefill_seconds": 1.0,
        "decode_seconds": 0.5,
    }


def test_wilson_interval_matches_reference_values():
    low, high = wilson_interval(8, 10)  # reference: statsmodels proportion_confint(8, 10, method="wilson")
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    assert wilson_interval(0, 20)[0] == 0.0 and wilson_interval(20, 20)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_policy_grammar_and_errors():
    spec = parse_policy("inf/expected_attention:calibrated")
    assert (spec.allocation, spec.scorer, spec.statistics) == ("inf", "expected_attention", "calibrated")
    policy = spec.policy(0.75)
    assert policy.compression_ratio == pytest.approx(0.75) and policy.kept_fraction == pytest.approx(0.25)
    assert policy.allocation == "inf"
    assert parse_policy("baseline").policy(0.5) is None
    with pytest.raises(ValueError, match="unknown scorer 'keydif'"):
        parse_policy("uniform/keydif")
    with pytest.raises(ValueError, match="ALLOCATION/SCORER"):
        parse_policy("keydiff")
    with pytest.raises(ValueError, match="unknown allocation"):
        parse_policy("greedy/keydiff")
    moments = parse_policy("inf/snapkv+moments+correction").policy(0.5)
    assert (moments.scorer, moments.moment_eviction, moments.correction) == ("snapkv", True, "calibrated")
    assert parse_policy("uniform/keydiff+correction1").policy(0.9).correction == "order1"
    with pytest.raises(ValueError, match=r"unknown suffix \+momentz"):
        parse_policy("inf/snapkv+momentz")
    with pytest.raises(ValueError, match="estimates attention"):
        parse_policy("inf/keydiff+moments")


CHEAP, FLAGSHIP, DEAR = "inf/keydiff+correction", "inf/leverage+correction", "curve/leverage+correction"


def _evaluation(outcomes: dict, n: int) -> dict:
    """An evaluation as profiler.evaluation.evaluate returns it (the fields the decision reads):
    ``outcomes`` maps (policy, ratio) to per-task booleans."""
    results = []
    for (policy, ratio), row in outcomes.items():
        low, high = wilson_interval(sum(row), n)
        results.append({**_row(policy, ratio, sum(row) / n), "n": n, "outcomes": list(row), "ci_low": low})
        results[-1]["ci_high"] = high
    return {
        "task_ids": [f"retrieval-L1024-D50-S7-R{i}" for i in range(n)],
        "baseline": {**_row("baseline", None, 1.0), "n": n, "outcomes": [True] * n},
        "results": results,
        "tasks": {
            "seed": 7,
            "families": ["retrieval"],
            "haystacks": ["simple"],
            "specs": [{"families": ["retrieval"], "seed": 7}],
        },
        "question_aware": False,
    }


def _pattern(n: int, wrong: set[int]) -> list[bool]:
    return [i not in wrong for i in range(n)]


def test_the_printed_decision_is_the_one_the_artifact_records():
    """paired_recommendation decides exactly as recommendation_section (what --write-recommendation
    records): the same policy served, wins, losses and bounds, on a case where a cheaper candidate
    passes (0.5), one where none does (0.75), and ties between equal candidates (0.9)."""
    from profiler.recommendation import recommendation_section

    n = 200
    flagship = _pattern(n, set(range(0, n, 10)))  # 180 of 200
    outcomes = {
        (CHEAP, 0.5): _pattern(n, set(range(0, n, 10)) - {0, 10, 20, 30, 40, 50}),  # 6 wins, no loss
        (FLAGSHIP, 0.5): flagship,
        (DEAR, 0.5): flagship,
        (CHEAP, 0.75): _pattern(n, set(range(0, n, 5))),  # 20 losses
        (FLAGSHIP, 0.75): flagship,
        (DEAR, 0.75): _pattern(n, set(range(0, n, 20))),  # 10 wins: better
        (CHEAP, 0.9): flagship,
        (FLAGSHIP, 0.9): flagship,
        (DEAR, 0.9): flagship,
    }
    evaluation = _evaluation(outcomes, n)
    candidates = [CHEAP, FLAGSHIP, DEAR]
    decision = paired_recommendation(evaluation, candidates, tolerance=0.03, confidence=0.95)
    section = recommendation_section(evaluation, candidates, 7, "retrieval", tolerance=0.03, confidence=0.95)
    assert [entry["served"] for entry in decision["per_ratio"]] == [name.decode() for name in section["policy"]]
    assert [entry["served"] for entry in decision["per_ratio"]] == [CHEAP, DEAR, CHEAP]
    for index, entry in enumerate(decision["per_ratio"]):
        assert [row["wins"] for row in entry["candidates"]] == section["wins"][index].tolist()
        assert [row["losses"] for row in entry["candidates"]] == section["losses"][index].tolist()
        assert [row["bound"] for row in entry["candidates"]] == section["bound"][index].tolist()
        assert entry["n"] == n and entry["too_few_tasks"] is False
    assert decision["rule"] == section["rule"][0].decode() and decision["reference"] == FLAGSHIP
    rows = {row["policy"]: row for row in decision["per_ratio"][1]["candidates"]}
    assert (rows[DEAR]["wins"], rows[DEAR]["losses"], rows[DEAR]["ties"]) == (10, 0, 190)
    assert rows[DEAR]["passes"] and not rows[CHEAP]["passes"]
    assert (rows[CHEAP]["accuracy"], rows[CHEAP]["ci_low"]) == (0.8, wilson_interval(160, n)[0])
    # without the flagship among the candidates: the most accurate, ties to the cheaper, as the section
    fallback = paired_recommendation(evaluation, [CHEAP, DEAR])
    section = recommendation_section(evaluation, [CHEAP, DEAR], 7, "retrieval")
    assert fallback["rule"] == section["rule"][0].decode() and fallback["reference"] is None
    assert [entry["served"] for entry in fallback["per_ratio"]] == [name.decode() for name in section["policy"]]
    assert [entry["served"] for entry in fallback["per_ratio"]] == [CHEAP, DEAR, CHEAP]


def test_too_few_tasks_and_overlapping_intervals_are_said():
    n = 4
    outcomes = {
        (CHEAP, 0.5): _pattern(n, {0}),
        (FLAGSHIP, 0.5): _pattern(n, {1, 2}),
    }
    decision = paired_recommendation(_evaluation(outcomes, n), [CHEAP, FLAGSHIP])
    (entry,) = decision["per_ratio"]
    # the cheap one answered 3 of 4 and the flagship 2: still the flagship, and no answers could change that
    assert entry["served"] == FLAGSHIP and entry["too_few_tasks"] is True
    assert entry["best_possible_bound"] == loss_bound(2, 0, n) > 0.03
    assert entry["overlapping"] == [CHEAP]
    assert decision["tasks_for_identical_answers"] == 122
    assert "4 tasks are too few for any candidate to replace the flagship" in decision["text"]
    assert "it takes 122 tasks" in decision["text"] and "overlap" in decision["text"]


def test_tasks_for_identical_answers_is_the_first_n_whose_bound_is_within_the_tolerance():
    for tolerance, confidence in ((0.03, 0.95), (0.05, 0.9), (0.1, 0.99), (0.2, 0.5)):
        n = tasks_for_identical_answers(tolerance, confidence)
        assert loss_bound(0, 0, n, confidence) <= tolerance + 1e-12 < loss_bound(0, 0, n - 1, confidence)
    assert tasks_for_identical_answers(0.0, 0.95) is None


def test_markdown_table_lists_baseline_first_with_n_then_the_decision():
    n = 4
    evaluation = _evaluation({(CHEAP, 0.5): _pattern(n, {0}), (FLAGSHIP, 0.5): _pattern(n, {1, 2})}, n)
    evaluation["recommendation"] = paired_recommendation(evaluation, [CHEAP, FLAGSHIP])
    table = markdown_table(evaluation).splitlines()
    assert table[0].startswith("| policy | compression ratio | accuracy [95% CI] | n |")
    assert table[2].startswith("| baseline | - | 1.00 [") and table[2].split(" | ")[3] == "4"
    assert table[3].startswith(f"| {CHEAP} | 0.5 | 0.75 [")
    low, high = wilson_interval(3, 4)
    cheap = next(line for line in table if line.startswith(f"| 0.5 | {CHEAP} |"))
    assert f"0.75 [{low:.2f}, {high:.2f}] | 4 | 2 / 1 | +" in cheap and cheap.endswith("|  |")
    assert next(line for line in table if line.startswith(f"| 0.5 | {FLAGSHIP} |")).endswith(
        "| reference | - | **served** |"
    )
    assert any("too few for any candidate to replace the flagship" in line for line in table)
    assert any("overlap" in line for line in table)


def test_the_grammar_lives_in_the_runtime_and_evaluate_artifacts_help_names_its_policies():
    import runtime.plan.policy_spec as grammar
    from profiler import evaluate_cli

    assert evaluate_cli.NAMED_POLICIES == {name: spec_text(spec) for name, spec in grammar.NAMED_POLICIES.items()}
    for name in evaluate_cli.DEFAULT_POLICIES:
        grammar.parse_policy(name)  # every default parses
    flagship = grammar.parse_policy("flagship")
    assert flagship is grammar.FLAGSHIP and (flagship.allocation, flagship.scorer) == ("inf", "leverage")
    assert flagship.policy(0.75).correction == "calibrated"
    assert grammar.parse_policy("inf/keydiff+correction").policy(0.75).correction == "calibrated"


def spec_text(spec) -> str:
    """A PolicySpec written back in the grammar (allocation/scorer[:statistics][+suffix...])."""
    from runtime.plan.policy_spec import MOMENT_SUFFIXES

    text = f"{spec.allocation}/{spec.scorer}" + (f":{spec.statistics}" if spec.statistics else "")
    return text + "".join(
        f"+{name}" for name, fields in MOMENT_SUFFIXES.items() if fields.items() <= spec.options.items()
    )
