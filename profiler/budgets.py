"""Per-KV-head budget tables for the artifact, from INFsc, through :mod:`runtime.plan.budgets`.

The allocation itself (GQA aggregation, normalisation, REAL Eq. 4-6, clipping, exact total
conservation) lives in ``runtime.plan.budgets`` so that the profiler and the serving runtime can
never disagree; this module only evaluates it on a grid:

* token budgets ``b`` (average tokens per KV head): integer tables from ``allocate_budgets``
  with ``seq_len = max_seq_len`` (the model's context limit; the job records it in the
  artifact's config as ``budgets.token_seq_len``); a runtime that knows the real sequence length
  recomputes from ``inf_kv``;
* ratios ``r``: the *unrounded* REAL budget ``r (1 - 1/beta) + r L Hkv / beta * INF_h`` as a
  fraction of the sequence length (``ideal_budgets``); the runtime rounds and clips it with
  ``allocate_budgets(inf_kv, r * seq_len, seq_len, ...)`` once ``seq_len`` is known.
"""

from __future__ import annotations

import numpy as np

DEFAULT_TOKEN_BUDGETS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_RATIOS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # kept: 40x and 20x included
DEFAULT_BETA = 2.0
DEFAULT_MIN_BUDGET = 1


def budget_tables(
    infsc: np.ndarray,
    num_kv_heads: int,
    *,
    max_seq_len: int,
    token_budgets=DEFAULT_TOKEN_BUDGETS,
    ratios=DEFAULT_RATIOS,
    beta: float = DEFAULT_BETA,
    min_budget: int = DEFAULT_MIN_BUDGET,
) -> tuple[dict[str, np.ndarray], dict[str, int | float]]:
    """The ``budgets`` section: ``(arrays, attrs)``.

    ``infsc``: query-head INF scores ``[L, Hq]``.  Arrays: ``inf_kv [L, Hkv]``,
    ``token_budgets [NT]``, ``token_tables [NT, L, Hkv]`` (int64, each summing to
    ``b L Hkv``), ``ratios [NR]``, ``ratio_tables [NR, L, Hkv]`` (float64).
    """
    token_budgets = np.asarray(sorted({int(b) for b in token_budgets}), dtype=np.int64)
    ratios = np.asarray(sorted({float(r) for r in ratios}), dtype=np.float64)
    if token_budgets.size and token_budgets.min() < 1:
        raise ValueError(f"token budgets must be >= 1, got {token_budgets.tolist()}")
    if ratios.size and (ratios.min() <= 0 or ratios.max() > 1):
        raise ValueError(f"ratios must lie in (0, 1], got {ratios.tolist()}")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    from common.formulas import ideal_budgets
    from runtime.plan.budgets import allocate_budgets, kv_head_scores  # torch: not for the parser

    inf_kv = kv_head_scores(infsc, num_kv_heads)  # [L, Hkv], sums to 1
    token_tables = (
        np.stack(
            [allocate_budgets(inf_kv, int(b), max_seq_len, beta=beta, min_budget=min_budget) for b in token_budgets]
        )
        if token_budgets.size
        else np.zeros((0, *inf_kv.shape), dtype=np.int64)
    )
    ratio_tables = (
        np.stack([ideal_budgets(inf_kv, float(r), beta) for r in ratios])
        if ratios.size
        else np.zeros((0, *inf_kv.shape), dtype=np.float64)
    )
    arrays = {
        "inf_kv": inf_kv.astype(np.float64),
        "token_budgets": token_budgets,
        "token_tables": token_tables.astype(np.int64),
        "ratios": ratios,
        "ratio_tables": ratio_tables.astype(np.float64),
    }
    attrs = {"beta": float(beta), "min_budget": int(min_budget)}
    return arrays, attrs
