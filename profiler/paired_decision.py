"""Paired evidence decides: which policy to serve at one compression ratio, from per-task outcomes.

The reference (the flagship, ``runtime.plan.policy_spec.FLAGSHIP``) is served unless a candidate,
measured on the **same** tasks, is shown not to be worse than it by more than ``tolerance``
with ``confidence``.  Pure arithmetic: no torch, no numpy.

The statistic.  Per task the pair (reference correct?, candidate correct?) is a *win* (only
the candidate correct), a *loss* (only the reference correct) or a *tie*.  With ``p_W``,
``p_L`` the probabilities of a win and a loss on a random task, the accuracy the candidate
gives up is ``theta = p_L - p_W``.  :func:`loss_bound` is an exact one-sided upper confidence
bound on ``theta`` from the counts ``W`` wins and ``L`` losses of ``n`` tasks:

    U = CP_upper(L of n, alpha / 2) - CP_lower(W of n, alpha / 2),    alpha = 1 - confidence,

``CP_upper`` / ``CP_lower`` the one-sided Clopper-Pearson bounds (the exact binomial tails,
solved by bisection).  ``p_L <= CP_upper`` and ``p_W >= CP_lower`` each fail with probability
at most ``alpha / 2``, so ``P(theta <= U) >= confidence`` whatever ``p_W`` and ``p_L`` are,
exactly rather than asymptotically (tests/test_paired_decision.py enumerates every outcome
for small ``n`` and checks it).  ``U`` only depends on the discordant counts and ``n``, rises
with every loss and falls with every win.  It is conservative (the union bound,
Clopper-Pearson's discreteness), which is the side the rule wants: without evidence the
flagship stays.  ``n = 0`` gives ``U = 1``; identical outcomes on ``n`` tasks give
``U = 1 - (alpha / 2) ** (1 / n)``, within a tolerance of 0.03 at confidence 0.95 only from
``n = 122`` on.  Alternatives considered: a paired bootstrap (needs a seed, not exact); the
conditional exact McNemar bound on the loss share of the discordant tasks, scaled by a bound
on the discordant rate, which is tighter when there are many discordant tasks but can rise
with a win (one win and no losses bounded higher than no discordant task at all).

The rule (:func:`decide`).  A candidate cheaper than the reference passes when
``U <= tolerance`` (not worse by more than the tolerance); one dearer passes only when
``U < 0`` (better, with the confidence): a dearer policy that is merely as good is not worth
its cost.  The cheapest passing candidate is served (cost breaks only ties among those that
pass); with none, the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.names import NAMED_POLICIES

RULE = "paired-exact-noninferiority/1"  # the rule's name, recorded in the artifact with its parameters
REFERENCE_NAMES = ("flagship", NAMED_POLICIES["flagship"])  # the reference: the flagship, by name or by its policy
FALLBACK_RULE = "most-accurate/1"  # no flagship among the candidates: the most accurate, ties to the cheaper
# The accuracy a cheaper policy may give up against the flagship, as a fraction: 3 points
# (issue #26's example); below one task in 24, so a single lost task cannot hide in it.
DEFAULT_TOLERANCE = 0.03
# One-sided confidence that the candidate is not worse than that: the usual 95%.
DEFAULT_CONFIDENCE = 0.95
_BISECTIONS = 200  # halvings of [0, 1]: far below float resolution, always the same answer


def binomial_cdf(successes: int, trials: int, p: float) -> float:
    """``P(X <= successes)`` for ``X ~ Binomial(trials, p)`` (summed in log space)."""
    if successes < 0:
        return 0.0
    if successes >= trials or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n = math.lgamma(trials + 1)
    total = 0.0
    for k in range(successes + 1):
        total += math.exp(log_n - math.lgamma(k + 1) - math.lgamma(trials - k + 1) + k * log_p + (trials - k) * log_q)
    return min(1.0, total)


def clopper_pearson_upper(successes: int, trials: int, alpha: float) -> float:
    """The one-sided exact upper bound on a binomial proportion: the ``p`` with
    ``P(X <= successes; p) = alpha`` (1 when every trial succeeded, or there were none)."""
    if successes >= trials:
        return 1.0
    low, high = 0.0, 1.0  # the cdf falls as p grows
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if binomial_cdf(successes, trials, middle) > alpha:
            low = middle
        else:
            high = middle
    return high


def clopper_pearson_lower(successes: int, trials: int, alpha: float) -> float:
    """The one-sided exact lower bound: the ``p`` with ``P(X >= successes; p) = alpha`` (0 when
    no trial succeeded)."""
    if successes <= 0:
        return 0.0
    return 1.0 - clopper_pearson_upper(trials - successes, trials, alpha)


def loss_bound(wins: int, losses: int, n: int, confidence: float = DEFAULT_CONFIDENCE) -> float:
    """Upper ``confidence`` bound on the accuracy a candidate gives up, ``p_L - p_W`` (see the
    module docstring); in [-1, 1]."""
    if not (0 <= wins and 0 <= losses and wins + losses <= n):
        raise ValueError(f"need 0 <= wins, losses and wins + losses <= n, got {wins}, {losses}, {n}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    alpha = 1.0 - confidence
    return clopper_pearson_upper(losses, n, alpha / 2) - clopper_pearson_lower(wins, n, alpha / 2)


@dataclass(frozen=True)
class PairedComparison:
    """One candidate against the reference on the same ``n`` tasks."""

    policy: str
    wins: int  # tasks only the candidate answered
    losses: int  # tasks only the reference answered
    ties: int  # both right or both wrong
    bound: float  # loss_bound(wins, losses, n, confidence): accuracy given up, upper bound
    passes: bool  # may replace the reference under the rule


@dataclass(frozen=True)
class PairedDecision:
    served: str
    reference: str
    n: int
    tolerance: float
    confidence: float
    comparisons: tuple[PairedComparison, ...]  # every policy of cost_order, the reference included


def decide(
    reference: str,
    outcomes: Mapping[str, Sequence[bool]],
    cost_order: Sequence[str],
    tolerance: float = DEFAULT_TOLERANCE,
    confidence: float = DEFAULT_CONFIDENCE,
) -> PairedDecision:
    """The policy to serve: ``reference`` unless a candidate passes (module docstring).

    ``outcomes``: per policy of ``cost_order`` (cheapest to serve first; ``reference`` among
    them), whether it answered each task correctly, the tasks in the same order for all.
    """
    if reference not in cost_order:
        raise ValueError(f"the reference {reference!r} is not among the policies {list(cost_order)}")
    if len(set(cost_order)) != len(cost_order) or set(outcomes) != set(cost_order):
        raise ValueError("outcomes must hold exactly the policies of cost_order, each once")
    if not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"tolerance must be in [0, 1], got {tolerance}")
    base = [bool(x) for x in outcomes[reference]]
    n = len(base)
    rank = cost_order.index(reference)
    comparisons = []
    for index, name in enumerate(cost_order):
        mine = [bool(x) for x in outcomes[name]]
        if len(mine) != n:
            raise ValueError(f"{name} has {len(mine)} task outcomes, the reference {n}: they must share the tasks")
        wins = sum(m and not b for m, b in zip(mine, base, strict=True))
        losses = sum(b and not m for m, b in zip(mine, base, strict=True))
        bound = loss_bound(wins, losses, n, confidence)
        passes = index != rank and (bound <= tolerance if index < rank else bound < 0.0)
        comparisons.append(PairedComparison(name, wins, losses, n - wins - losses, bound, passes))
    passing = [c.policy for c in comparisons if c.passes]
    return PairedDecision(
        served=passing[0] if passing else reference,
        reference=reference,
        n=n,
        tolerance=tolerance,
        confidence=confidence,
        comparisons=tuple(comparisons),
    )
