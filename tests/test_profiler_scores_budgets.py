"""Dominant-behaviour accumulation and REAL scores on hand-built patterns; budget tables."""

from __future__ import annotations

import numpy as np
import pytest

from common.formulas import behaviour_scores
from profiler.behaviour import dominant_totals, dominant_totals_from_attention
from profiler.budgets import budget_tables

# Context of 6 tokens: W R R B D W
LABELS = np.array([0, 1, 1, 2, 3, 0], dtype=np.uint8)


def _pattern():
    """attention [S=3, L=1, Hq=3, C=6] with hand-chosen maxima."""
    a = np.full((3, 1, 3, 6), 0.01)
    # head 0: R (0.6), R (0.5), D (0.4)  -> W_R = 1.1, W_D = 0.4
    a[0, 0, 0, 1], a[1, 0, 0, 2], a[2, 0, 0, 4] = 0.6, 0.5, 0.4
    # head 1: B (0.7), W (0.3 at pos 0), R (0.2)  -> W_B = 0.7, W_W = 0.3, W_R = 0.2
    a[0, 0, 1, 3], a[1, 0, 1, 0], a[2, 0, 1, 1] = 0.7, 0.3, 0.2
    # head 2: only widespread -> W_W = 0.9 + 0.8 + 0.5, empty R/B/D
    a[0, 0, 2, 5], a[1, 0, 2, 0], a[2, 0, 2, 5] = 0.9, 0.8, 0.5
    return a


def test_hand_built_pattern_gives_hand_computed_totals_and_scores():
    totals = dominant_totals_from_attention(_pattern(), LABELS)  # [1, 3, 4] (W, R, B, D)
    expected = np.array([[[0.0, 1.1, 0.0, 0.4], [0.3, 0.2, 0.7, 0.0], [2.2, 0.0, 0.0, 0.0]]])
    np.testing.assert_allclose(totals, expected, rtol=1e-12)
    rasc, lcsc, infsc = behaviour_scores(totals[..., 1], totals[..., 2], totals[..., 3])
    np.testing.assert_allclose(rasc[0], [1.1 / 1.5, 1.0, 0.0])
    np.testing.assert_allclose(lcsc[0], [1.0, 0.2 / 0.9, 0.0])
    f0 = 2 * (1.1 / 1.5) / (1.1 / 1.5 + 1.0)
    f1 = 2 * (0.2 / 0.9) / (1.0 + 0.2 / 0.9)
    np.testing.assert_allclose(infsc[0], [f0, f1, 0.0])
    assert np.all(np.isfinite(infsc))


def test_empty_heads_score_zero_not_nan():
    zeros = np.zeros((2, 3))
    for score in behaviour_scores(zeros, zeros, zeros):
        assert np.array_equal(score, zeros)
    rasc, lcsc, infsc = behaviour_scores(np.zeros(1), np.ones(1), np.zeros(1))  # bias only
    assert rasc[0] == 0 and lcsc[0] == 0 and infsc[0] == 0


def test_totals_from_max_and_argmax_match_and_validate():
    a = _pattern()
    direct = dominant_totals(a.max(-1), a.argmax(-1), LABELS)
    np.testing.assert_array_equal(direct, dominant_totals_from_attention(a, LABELS))
    with pytest.raises(ValueError, match="outside the context"):
        dominant_totals(np.ones((1, 1, 1)), np.full((1, 1, 1), 6), LABELS)
    with pytest.raises(ValueError, match="non-negative"):
        behaviour_scores(-np.ones(1), np.ones(1), np.ones(1))


def _tables(infsc, **kw):
    return budget_tables(infsc, 2, max_seq_len=kw.pop("max_seq_len", 4096), **kw)


def test_budget_tables_conserve_bounds_and_monotone():
    rng = np.random.default_rng(0)
    infsc = rng.random((4, 6))  # L=4, Hq=6, Hkv=2 (groups of 3)
    arrays, attrs = _tables(infsc, token_budgets=(64, 256, 2048), beta=2.0, min_budget=3, max_seq_len=3000)
    assert attrs == {"beta": 2.0, "min_budget": 3}
    inf_kv = arrays["inf_kv"]
    np.testing.assert_allclose(inf_kv, infsc.reshape(4, 2, 3).mean(-1) / infsc.reshape(4, 2, 3).mean(-1).sum())
    for b, table in zip(arrays["token_budgets"], arrays["token_tables"], strict=True):
        assert table.dtype == np.int64 and table.shape == (4, 2)
        assert table.sum() == b * 8  # conserved exactly
        assert table.min() >= 3 and table.max() <= 3000
        order = np.argsort(inf_kv.ravel(), kind="stable")
        assert np.all(np.diff(table.ravel()[order]) >= 0)  # monotone in INF
    # A budget that saturates the clip bound still conserves and respects the maximum.
    arrays, _ = _tables(np.eye(4, 6) * 10, token_budgets=(900,), beta=8.0, max_seq_len=1000)
    assert arrays["token_tables"][0].max() <= 1000 and arrays["token_tables"][0].sum() == 900 * 8
    ratio = arrays["ratio_tables"]
    np.testing.assert_allclose(ratio.mean(axis=(1, 2)), arrays["ratios"])  # fractions average to r


def test_budget_tables_uniform_when_all_scores_zero():
    arrays, _ = _tables(np.zeros((3, 4)), token_budgets=(100, 128))
    np.testing.assert_allclose(arrays["inf_kv"], 1.0 / 6)
    assert np.all(arrays["token_tables"][0] == 100) and np.all(arrays["token_tables"][1] == 128)
    np.testing.assert_allclose(arrays["ratio_tables"], arrays["ratios"][:, None, None] * np.ones((1, 3, 2)))


def test_budget_tables_reject_bad_grids():
    with pytest.raises(ValueError, match="ratios"):
        _tables(np.ones((1, 2)), ratios=(0.0,))
    with pytest.raises(ValueError, match="token budgets"):
        _tables(np.ones((1, 2)), token_budgets=(0,))
