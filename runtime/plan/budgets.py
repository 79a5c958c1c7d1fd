"""Per-KV-head cache budgets from REAL's INF scores (REAL; docs/design.md section 3).

Budgets are per KV head because the cache is.  Query-head INFsc values are averaged over
each GQA group, normalised over all ``L x Hkv`` heads to sum to one (uniform when all are
zero), and a per-head average budget ``b`` is split as

    b_base = b (1 - 1/beta)          B_pool = b L Hkv / beta
    b_h    = b_base + B_pool * INF_h

then clipped to ``[min_budget, seq_len]`` and rounded so that the total is conserved
exactly: ``sum_h b_h == round(b L Hkv)`` (the total itself is clamped to what the bounds
allow, ``[L Hkv min_budget, L Hkv seq_len]``).  The redistribution after clipping is an
additive shift found by bisection, followed by largest-remainder rounding, so the result is
monotone in INF and never violates the bounds.

numpy only: the serving runtime and the profiler both call this.
"""

from __future__ import annotations

import numpy as np

from common.formulas import ideal_budgets


def kv_head_scores(inf_scores: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Query-head scores ``[L, Hq]`` -> normalised KV-head weights ``[L, Hkv]`` summing to 1."""
    scores = np.asarray(inf_scores, dtype=np.float64)
    if scores.ndim != 2:
        raise ValueError(f"expected INF scores of shape [layers, query_heads], got {scores.shape}")
    num_layers, num_q_heads = scores.shape
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads cannot be grouped into {num_kv_heads} KV heads")
    if not np.all(np.isfinite(scores)) or np.any(scores < 0):
        raise ValueError("INF scores must be finite and non-negative")
    group = num_q_heads // num_kv_heads
    per_kv = scores.reshape(num_layers, num_kv_heads, group).mean(axis=2)  # [L, Hkv]
    total = per_kv.sum()
    if total <= 0:
        return np.full_like(per_kv, 1.0 / per_kv.size)
    return per_kv / total


def allocate_budgets(
    weights: np.ndarray, avg_budget: float, seq_len: int, *, beta: float = 2.0, min_budget: int = 1
) -> np.ndarray:
    """Integer per-KV-head budgets ``[L, Hkv]`` with the total conserved exactly.

    ``weights``: normalised KV-head weights from :func:`kv_head_scores` (sum 1).
    ``avg_budget``: tokens per KV head on average (``ratio * seq_len`` for a ratio budget).
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if min_budget < 0:
        raise ValueError(f"min_budget must be >= 0, got {min_budget}")
    ideal = ideal_budgets(weights, avg_budget, beta)
    lo, hi = float(min(min_budget, seq_len)), float(seq_len)
    count = ideal.size
    total = int(np.clip(round(avg_budget * count), lo * count, hi * count))

    # Continuous allocation clip(ideal + c, lo, hi) summing to `total`: bisection on c.
    def placed(shift: float) -> float:
        return float(np.clip(ideal + shift, lo, hi).sum())

    low, high = lo - ideal.max() - 1.0, hi - ideal.min() + 1.0
    for _ in range(200):
        mid = 0.5 * (low + high)
        if placed(mid) < total:
            low = mid
        else:
            high = mid
    continuous = np.clip(ideal + high, lo, hi)

    # Largest-remainder rounding within the bounds.
    budgets = np.floor(continuous + 1e-9).astype(np.int64)
    budgets = np.clip(budgets, int(lo), int(hi))
    missing = total - int(budgets.sum())
    flat, frac = budgets.reshape(-1), (continuous - budgets).reshape(-1)
    if missing > 0:
        order = np.lexsort((-ideal.reshape(-1), -frac))  # largest fraction first, then largest INF
        for index in order:
            if missing == 0:
                break
            if flat[index] < hi:
                flat[index] += 1
                missing -= 1
    elif missing < 0:
        order = np.lexsort((ideal.reshape(-1), frac))
        for index in order:
            if missing == 0:
                break
            if flat[index] > lo:
                flat[index] -= 1
                missing += 1
    return flat.reshape(ideal.shape)


def curve_row(compression_ratios: np.ndarray, fractions: np.ndarray, keep: float) -> np.ndarray:
    """Kept fraction per KV head ``[L, Hkv]`` at the kept fraction ``keep`` from a budget curve
    (the artifact's ``budget_curves`` section): ``fractions[r]`` is the allocation at compression
    ratio ``compression_ratios[r]`` (increasing) and sums to ``(1 - ratio) L Hkv``.

    Between two grid ratios the rows are interpolated linearly in the kept fraction, so the row
    sums to ``keep L Hkv`` exactly; outside the grid the nearest row is scaled to that sum (a head
    may then pass 1: :func:`allocate_budgets` clips it and hands the excess to the others).
    """
    ratios = np.asarray(compression_ratios, dtype=np.float64).reshape(-1)
    table = np.asarray(fractions, dtype=np.float64)
    if table.ndim != 3 or table.shape[0] != ratios.size or ratios.size == 0:
        raise ValueError(f"a budget curve needs fractions [NR, L, Hkv] for ratios [NR], got {table.shape}")
    if np.any(np.diff(ratios) <= 0):
        raise ValueError("the budget curve's compression ratios must be strictly increasing")
    if not 0.0 < keep <= 1.0 or not np.isfinite(keep):
        raise ValueError(f"the kept fraction must lie in (0, 1], got {keep}")
    keeps = 1.0 - ratios[::-1]  # increasing
    rows = table[::-1]
    if keep <= keeps[0]:
        return rows[0] * (keep / keeps[0])
    if keep >= keeps[-1]:
        return rows[-1] * (keep / keeps[-1])
    upper = int(np.searchsorted(keeps, keep))  # keeps[upper - 1] < keep <= keeps[upper]
    t = (keep - keeps[upper - 1]) / (keeps[upper] - keeps[upper - 1])
    return (1.0 - t) * rows[upper - 1] + t * rows[upper]
