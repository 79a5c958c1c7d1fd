"""The formulas that both a producer (the profiler, the runtime) and the artifact's validator
compute, stated once (issue 42: they were restated in ``artifacts/validation.py``).  numpy and
the standard library only.

* :func:`wilson_interval`: the 95% Wilson score interval of an accuracy (every interval the
  evaluation, the recommendation and docs/results.md report);
* :func:`behaviour_scores`: REAL's attention-behaviour scores from the dominant-weight sums
  ("REtrieval-reAsoning and Logic-constructed Attention Behaviors for Long-Context KV Cache
  Compression", Eq. 1-3; docs/design.md section 3), with :func:`share` and
  :func:`harmonic_mean`, its two parts;
* :func:`ideal_budgets`: REAL's unrounded per-KV-head budgets ``b (1 - 1/beta) + (b L Hkv / beta)
  INF_h`` (docs/design.md section 3), which the runtime rounds (:func:`runtime.plan.budgets.allocate_budgets`)
  and the artifact's ``/budgets/ratio_tables`` store.
"""

from __future__ import annotations

import math

import numpy as np

WILSON_Z = 1.959964  # the standard normal's 97.5% quantile: a two-sided 95% interval
SCORE_FLOOR = 1e-30  # a behaviour score's denominator below this counts as empty (the score is 0)


def wilson_interval(correct: int, total: int, z: float = WILSON_Z) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion ``correct / total`` (``(0, 1)`` when
    ``total`` is 0)."""
    if total <= 0:
        return 0.0, 1.0
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def share(w_r: np.ndarray, w_other: np.ndarray) -> np.ndarray:
    """``W_R / (W_R + W_other)`` elementwise, 0 where the denominator is empty: RAsc with ``W_D``,
    LCsc with ``W_B``."""
    return w_r / np.maximum(w_r + w_other, SCORE_FLOOR)


def harmonic_mean(rasc: np.ndarray, lcsc: np.ndarray) -> np.ndarray:
    """INFsc ``= 2 RAsc LCsc / (RAsc + LCsc)`` elementwise, 0 where both are 0."""
    return 2.0 * rasc * lcsc / np.maximum(rasc + lcsc, SCORE_FLOOR)


def behaviour_scores(w_r: np.ndarray, w_b: np.ndarray, w_d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """REAL Eq. 1-3 elementwise: ``(RAsc, LCsc, INFsc)``, each float64, 0 where undefined."""
    w_r, w_b, w_d = (np.asarray(x, dtype=np.float64) for x in (w_r, w_b, w_d))
    if np.any(w_r < 0) or np.any(w_b < 0) or np.any(w_d < 0):
        raise ValueError("behaviour weights must be non-negative")
    rasc, lcsc = share(w_r, w_d), share(w_r, w_b)
    return rasc, lcsc, harmonic_mean(rasc, lcsc)


def ideal_budgets(weights: np.ndarray, avg_budget: float, beta: float) -> np.ndarray:
    """Unrounded REAL budgets ``b_base + B_pool * INF_h`` for normalised weights ``[L, Hkv]``:
    ``b_base = b (1 - 1/beta)``, ``B_pool = b L Hkv / beta``, ``b`` = ``avg_budget``."""
    if beta < 1:
        raise ValueError(f"beta must be >= 1, got {beta}")
    if avg_budget <= 0:
        raise ValueError(f"the average budget must be positive, got {avg_budget}")
    weights = np.asarray(weights, dtype=np.float64)
    base = avg_budget * (1.0 - 1.0 / beta)
    pool = avg_budget * weights.size / beta
    return base + pool * weights
