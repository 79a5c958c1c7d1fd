"""evaluate-artifact's pure logic: policy grammar, intervals, the recommendation."""

from __future__ import annotations

import pytest

from profiler.evaluation_results import (
    best_per_ratio,
    markdown_table,
    recommend,
    wilson_interval,
)
from runtime.policy_spec import parse_policy


def _row(policy, ratio, accuracy, kv_bytes=1000):
    return {
        "policy": policy,
        "compression_ratio": ratio,
        "n": 12,
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


def test_recommendation_picks_the_highest_ratio_within_tolerance():
    results = [
        _row("uniform/keydiff", 0.5, 0.80),
        _row("uniform/keydiff", 0.75, 0.70),
        _row("inf/expected_attention:calibrated", 0.5, 0.81),
        _row("inf/expected_attention:calibrated", 0.75, 0.79),
        _row("inf/expected_attention:calibrated", 0.9, 0.60),
    ]
    chosen = recommend(0.80, results, tolerance=0.02)
    assert (chosen["policy"], chosen["compression_ratio"]) == ("inf/expected_attention:calibrated", 0.75)
    assert "0.75" in chosen["text"]
    # A looser tolerance admits the 0.9 row.
    assert recommend(0.80, results, tolerance=0.25)["compression_ratio"] == 0.9


def test_recommendation_ties_go_to_accuracy_then_bytes_then_name():
    results = [_row("b", 0.75, 0.79, 900), _row("a", 0.75, 0.80, 1000), _row("c", 0.75, 0.80, 800)]
    assert recommend(0.80, results)["policy"] == "c"
    results = [_row("b", 0.75, 0.80, 800), _row("a", 0.75, 0.80, 800)]
    assert recommend(0.80, results)["policy"] == "a"


def test_recommendation_when_nothing_is_good_enough():
    chosen = recommend(0.80, [_row("uniform/streaming", 0.5, 0.3), _row("uniform/keydiff", 0.5, 0.6)])
    assert chosen["policy"] is None and "uniform/keydiff" in chosen["text"]


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


def test_markdown_table_lists_baseline_first():
    evaluation = {
        "baseline": _row("baseline", None, 0.8),
        "results": [_row("uniform/keydiff", 0.5, 0.7)],
        "recommendation": recommend(0.8, [_row("uniform/keydiff", 0.5, 0.7)]),
    }
    table = markdown_table(evaluation).splitlines()
    assert table[2].startswith("| baseline | - | 0.80") and table[3].startswith("| uniform/keydiff | 0.5 | 0.70")


def test_best_per_ratio_takes_the_most_accurate_and_breaks_ties_by_preference():
    results = [
        _row("inf/keydiff+correction", 0.5, 0.80),
        _row("inf/keydiff+correction", 0.9, 0.40),
        _row("inf/leverage", 0.5, 0.80),
        _row("inf/leverage", 0.9, 0.60),
    ]
    best = best_per_ratio(results, ["inf/keydiff+correction", "inf/leverage"])
    assert [(row["compression_ratio"], row["policy"], row["accuracy"]) for row in best] == [
        (0.5, "inf/keydiff+correction", 0.80),  # a tie: the first in preference order
        (0.9, "inf/leverage", 0.60),
    ]
    assert best_per_ratio(results, ["inf/leverage", "inf/keydiff+correction"])[0]["policy"] == "inf/leverage"
    assert set(best[0]) == {"policy", "compression_ratio", "accuracy", "ci_low", "ci_high", "n"}


def test_the_grammar_lives_in_the_runtime_and_evaluate_artifacts_help_names_its_policies():
    import runtime.policy_spec as grammar
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
    from runtime.policy_spec import MOMENT_SUFFIXES

    text = f"{spec.allocation}/{spec.scorer}" + (f":{spec.statistics}" if spec.statistics else "")
    return text + "".join(
        f"+{name}" for name, fields in MOMENT_SUFFIXES.items() if fields.items() <= spec.options.items()
    )
