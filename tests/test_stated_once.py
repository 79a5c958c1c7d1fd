"""Facts the producers and the artifact's validator both need are stated once, in the shared base
(``common``), and used from there (issue 42: the Wilson interval, REAL's behaviour scores, the INF
budget formula, the flagship's name and the probe-id pattern were restated in
``artifacts/validation.py``, kept equal only by tests)."""

from __future__ import annotations

import numpy as np

from common import formulas, names, probe_ids


def test_the_validator_uses_the_base_definitions():
    from artifacts import validation

    assert validation.wilson_interval is formulas.wilson_interval
    assert validation.ideal_budgets is formulas.ideal_budgets
    assert validation.share is formulas.share and validation.harmonic_mean is formulas.harmonic_mean
    assert validation.PROBE_ID is probe_ids.PROBE_ID
    assert validation.FLAGSHIP_NAMES == (b"flagship", names.NAMED_POLICIES["flagship"].encode())


def test_the_producers_use_the_base_definitions():
    from needles import spec
    from profiler import behaviour, evaluation
    from runtime.plan import budgets

    assert spec.probe_id is probe_ids.probe_id
    assert behaviour.behaviour_scores is formulas.behaviour_scores
    assert evaluation.wilson_interval is formulas.wilson_interval
    assert budgets.ideal_budgets is formulas.ideal_budgets


def test_every_probe_id_the_generator_makes_matches_the_pattern():
    for family, length, depth, seed, replicate in [
        ("retrieval", 1024, 50.0, 7, 0),
        ("multi_key", 4096, 12.5, -3, 11),
        ("retrieval", 512, 1e-5, 0, 2),
    ]:
        made = probe_ids.probe_id(family, length, depth, seed, replicate)
        assert probe_ids.PROBE_ID.fullmatch(made), made
    assert not probe_ids.PROBE_ID.fullmatch("retrieval-L1024-D50-S7")  # no replicate


def test_the_formulas_against_direct_computations():
    low, high = formulas.wilson_interval(51, 54)
    assert (round(low, 2), round(high, 2)) == (0.85, 0.98)  # docs/results.md's uncompressed cell
    assert formulas.wilson_interval(0, 0) == (0.0, 1.0)
    w_r, w_b, w_d = np.array([3.0, 0.0]), np.array([1.0, 0.0]), np.array([1.0, 2.0])
    rasc, lcsc, infsc = formulas.behaviour_scores(w_r, w_b, w_d)
    assert np.allclose(rasc, [0.75, 0.0]) and np.allclose(lcsc, [0.75, 0.0]) and np.allclose(infsc, [0.75, 0.0])
    weights = np.array([[0.1, 0.4], [0.2, 0.3]])
    ideal = formulas.ideal_budgets(weights, 8.0, 2.0)
    assert np.allclose(ideal, 8.0 * 0.5 + 8.0 * 4 / 2.0 * weights) and np.isclose(ideal.sum(), 8.0 * 4)


def test_the_scorers_traits_are_the_vocabularys():
    """Whether a registered scorer's scores compare across heads, and whether it estimates attention,
    is stated once (``common.policy_grammar``), which the torch-free grammar checks policies with;
    the scorer classes take it from there instead of restating it."""
    from pathlib import Path

    from common.policy_grammar import ATTENTION_SCORERS, COMPARABLE_SCORERS
    from runtime.scorers import SCORERS

    assert set(SCORERS) == set(names.SCORER_NAMES)
    for name, scorer in SCORERS.items():
        assert scorer.comparable == (name in COMPARABLE_SCORERS), name
        assert scorer.yields_attention == (name in ATTENTION_SCORERS), name
    package = Path(__file__).resolve().parent.parent / "runtime" / "scorers"
    for source in package.glob("*.py"):
        if source.name != "base.py":
            text = source.read_text()
            assert "comparable = " not in text and "yields_attention = " not in text, source.name
