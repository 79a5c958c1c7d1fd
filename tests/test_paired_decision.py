"""The paired decision rule (profiler.paired_decision) against direct computations: exact
binomial sums in rational arithmetic, and the bound's coverage by enumerating every outcome."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from profiler.paired_decision import (
    DEFAULT_CONFIDENCE,
    DEFAULT_TOLERANCE,
    binomial_cdf,
    clopper_pearson_lower,
    clopper_pearson_upper,
    decide,
    loss_bound,
)


def exact_cdf(successes: int, trials: int, p: Fraction) -> Fraction:
    return sum((math.comb(trials, k) * p**k * (1 - p) ** (trials - k) for k in range(successes + 1)), start=Fraction(0))


@pytest.mark.parametrize("trials", [0, 1, 5, 12])
def test_binomial_cdf_is_the_exact_sum(trials):
    for p in (Fraction(1, 10), Fraction(1, 2), Fraction(7, 9)):
        for successes in range(-1, trials + 1):
            want = float(exact_cdf(successes, trials, p)) if successes >= 0 else 0.0
            assert binomial_cdf(successes, trials, float(p)) == pytest.approx(want, abs=1e-13)


@pytest.mark.parametrize("trials", [1, 4, 10, 24])
def test_clopper_pearson_bounds_solve_their_tail_equations(trials):
    alpha = 0.05
    for successes in range(trials + 1):
        upper = clopper_pearson_upper(successes, trials, alpha)
        lower = clopper_pearson_lower(successes, trials, alpha)
        if successes < trials:  # P(X <= x; upper) = alpha, by the exact sum
            assert float(exact_cdf(successes, trials, Fraction(upper))) == pytest.approx(alpha, abs=1e-9)
        else:
            assert upper == 1.0
        if successes > 0:  # P(X >= x; lower) = alpha
            assert 1 - float(exact_cdf(successes - 1, trials, Fraction(lower))) == pytest.approx(alpha, abs=1e-9)
        else:
            assert lower == 0.0
        assert lower <= successes / trials <= upper


def test_no_trials_bound_nothing():
    assert clopper_pearson_upper(0, 0, 0.05) == 1.0 and clopper_pearson_lower(0, 0, 0.05) == 0.0
    assert loss_bound(0, 0, 0) == 1.0


@pytest.mark.parametrize("confidence", [0.95, 0.7])
@pytest.mark.parametrize("n", [1, 3, 6])
def test_loss_bound_covers_theta_for_every_win_and_loss_probability(n, confidence):
    """P(p_L - p_W <= U(W, L, n)) >= confidence, summed over every trinomial outcome."""
    bounds = {(w, loss): loss_bound(w, loss, n, confidence) for w in range(n + 1) for loss in range(n + 1 - w)}
    grid = [i / 10 for i in range(11)]
    worst = 1.0
    for p_win, p_loss in itertools.product(grid, grid):
        if p_win + p_loss > 1.0 + 1e-12:
            continue
        theta = p_loss - p_win
        p_tie = max(0.0, 1.0 - p_win - p_loss)
        covered = sum(
            math.factorial(n)
            / (math.factorial(w) * math.factorial(loss) * math.factorial(n - w - loss))
            * p_win**w
            * p_loss**loss
            * p_tie ** (n - w - loss)
            for (w, loss), bound in bounds.items()
            if theta <= bound + 1e-12
        )
        worst = min(worst, covered)
    assert worst >= confidence - 1e-9


def test_loss_bound_follows_the_evidence():
    # more losses raise it, more wins lower it; a candidate that wins almost everywhere is shown better
    assert loss_bound(0, 2, 24) > loss_bound(0, 1, 24) > loss_bound(0, 0, 24) > loss_bound(1, 0, 24)
    assert loss_bound(30, 5, 40) < 0.0
    # identical outcomes: the bound on a proportion never observed, 1 - (alpha / 2) ** (1 / n)
    assert loss_bound(0, 0, 24) == pytest.approx(1 - (0.05 / 2) ** (1 / 24), abs=1e-12)
    assert loss_bound(0, 0, 121) > DEFAULT_TOLERANCE >= loss_bound(0, 0, 122)
    # every loss raises it and every win lowers it, at any n
    for n in (5, 24, 100):
        for w in range(n // 2):
            assert loss_bound(w + 1, 1, n) < loss_bound(w, 1, n) < loss_bound(w, 2, n)
    with pytest.raises(ValueError):
        loss_bound(3, 3, 5)


ORDER = ["cheap", "cheaper_twin", "flagship", "dear"]  # cheapest to serve first


def outcomes(n: int, **losses_and_wins) -> dict[str, list[bool]]:
    """The flagship right on every even task; each other policy equal to it but for the given
    (wins, losses): it also answers the first ``wins`` odd tasks and misses the first ``losses`` even ones."""
    flagship = [i % 2 == 0 for i in range(n)]
    table = {"flagship": flagship}
    for name in ORDER:
        if name == "flagship":
            continue
        wins, losses = losses_and_wins.get(name, (0, 0))
        row = list(flagship)
        odd, even = [i for i in range(n) if i % 2], [i for i in range(n) if i % 2 == 0]
        for i in odd[:wins]:
            row[i] = True
        for i in even[:losses]:
            row[i] = False
        table[name] = row
    return table


def test_no_tasks_keep_the_flagship():
    decision = decide("flagship", {name: [] for name in ORDER}, ORDER)
    assert decision.served == "flagship" and decision.n == 0
    assert all(c.bound == 1.0 and not c.passes for c in decision.comparisons)


def test_identical_outcomes_on_few_tasks_keep_the_flagship_and_on_many_go_to_the_cheapest():
    few = decide("flagship", outcomes(24), ORDER)
    assert few.served == "flagship"
    assert [(c.wins, c.losses, c.ties) for c in few.comparisons] == [(0, 0, 24)] * 4
    many = decide("flagship", outcomes(300), ORDER)
    # both cheaper policies pass (a tie under the rule): cost decides; the dear one is not better
    assert [c.passes for c in many.comparisons] == [True, True, False, False]
    assert many.served == "cheap"
    assert many.tolerance == DEFAULT_TOLERANCE and many.confidence == DEFAULT_CONFIDENCE


def test_a_dearer_candidate_replaces_the_flagship_only_when_better():
    better = decide("flagship", outcomes(40, dear=(15, 0)), ORDER)
    assert better.served == "dear"
    dear = better.comparisons[3]
    assert (dear.wins, dear.losses, dear.ties) == (15, 0, 25) and dear.bound < 0
    # one task better is no evidence
    assert decide("flagship", outcomes(40, dear=(1, 0)), ORDER).served == "flagship"


def test_a_candidate_worse_by_one_task():
    # on 24 tasks one loss (or none) decides nothing
    assert decide("flagship", outcomes(24, cheap=(0, 1)), ORDER).served == "flagship"
    # on 300 it is within 3 points at 95% (bound 0.018) and the cheapest passes
    decision = decide("flagship", outcomes(300, cheap=(0, 1), cheaper_twin=(0, 1)), ORDER)
    assert decision.comparisons[0].losses == 1 and decision.comparisons[0].bound == pytest.approx(loss_bound(0, 1, 300))
    assert decision.served == "cheap"
    # with a tolerance of 1 point it is not, and the flagship stays
    assert decide("flagship", outcomes(300, cheap=(0, 1), cheaper_twin=(0, 1)), ORDER, tolerance=0.01).served == (
        "flagship"
    )


def test_cost_breaks_ties_only_among_passing_candidates():
    # the cheapest loses too often; its twin passes and is served
    decision = decide("flagship", outcomes(300, cheap=(0, 20)), ORDER)
    assert [c.passes for c in decision.comparisons] == [False, True, False, False]
    assert decision.served == "cheaper_twin"


def test_tasks_must_be_shared():
    table = outcomes(10)
    table["cheap"] = table["cheap"][:9]
    with pytest.raises(ValueError, match="share the tasks"):
        decide("flagship", table, ORDER)
    with pytest.raises(ValueError, match="not among"):
        decide("other", outcomes(10), ORDER)
