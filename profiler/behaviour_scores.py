"""REAL's attention-behaviour accumulation and scores (REAL Eq. 1-3; docs/design.md section 3).

At every decode step, for every (layer, query head), the query's attention distribution over
the context (the prompt tokens) has one *dominant* token, its argmax.  The label of that token
(``W``, ``R``, ``B`` or ``D``, see :mod:`needles.probe`) is the step's dominant behaviour for
the head, and the maximum weight is added to that head's accumulator ``W_<label>``:

    W[l, h, label(argmax_i a_i)] += max_i a_i          (one step, one head)

Scores per query head, with a tiny floor on the denominators so that a head that never
pointed at an ``R``/``B``/``D`` token scores 0 rather than NaN:

    RAsc  = W_R / (W_R + W_D)        LCsc = W_R / (W_R + W_B)
    INFsc = 2 RAsc LCsc / (RAsc + LCsc)

Pure numpy / torch math: the capture module produces ``(max weight, argmax position)`` per
step and head, this module turns those into sums and scores.
"""

from __future__ import annotations

import numpy as np
import torch

from needles.probe import LABELS

NUM_LABELS = len(LABELS)  # W, R, B, D: the last axis of an accumulator, in this order
LABEL_W, LABEL_R, LABEL_B, LABEL_D = (LABELS.index(name) for name in ("W", "R", "B", "D"))
SCORE_FLOOR = 1e-30  # denominators below this count as empty


def dominant_totals(
    max_weight: torch.Tensor | np.ndarray, argmax_pos: torch.Tensor | np.ndarray, labels: np.ndarray
) -> np.ndarray:
    """Sum the dominant-behaviour weights of a set of steps.

    ``max_weight``: ``[S, L, Hq]`` float, the largest attention weight over the context.
    ``argmax_pos``: ``[S, L, Hq]`` int, the context position holding it.
    ``labels``: ``[C]`` uint8 behaviour codes of the context positions.
    Returns float64 ``[L, Hq, 4]``: per head, the weight summed per dominant label
    (axis order ``W, R, B, D``).
    """
    weights = np.asarray(torch.as_tensor(max_weight).double().cpu())
    positions = np.asarray(torch.as_tensor(argmax_pos).cpu()).astype(np.int64)
    labels = np.asarray(labels)
    if weights.shape != positions.shape or weights.ndim != 3:
        raise ValueError(f"max_weight {weights.shape} and argmax_pos {positions.shape} must both be [S, L, Hq]")
    if positions.size and (positions.min() < 0 or positions.max() >= labels.shape[0]):
        raise ValueError(f"argmax positions outside the context of {labels.shape[0]} labelled tokens")
    steps, layers, heads = weights.shape
    codes = labels[positions]  # [S, L, Hq] label of each dominant token
    totals = np.zeros((layers, heads, NUM_LABELS), dtype=np.float64)
    for code in range(NUM_LABELS):
        # Sum over steps in step order (axis 0) so the result does not depend on batching.
        totals[:, :, code] = np.where(codes == code, weights, 0.0).sum(axis=0)
    return totals


def dominant_totals_from_attention(attention: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Reference form: ``attention [S, L, Hq, C]`` distributions over the context -> ``[L, Hq, 4]``."""
    attention = np.asarray(attention, dtype=np.float64)
    if attention.ndim != 4 or attention.shape[-1] != len(labels):
        raise ValueError(f"attention must be [S, L, Hq, C] with C = {len(labels)}, got {attention.shape}")
    return dominant_totals(attention.max(axis=-1), attention.argmax(axis=-1), labels)


def behaviour_scores(w_r: np.ndarray, w_b: np.ndarray, w_d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """REAL Eq. 1-3 elementwise: ``(RAsc, LCsc, INFsc)``, each float64, 0 where undefined."""
    w_r, w_b, w_d = (np.asarray(x, dtype=np.float64) for x in (w_r, w_b, w_d))
    if np.any(w_r < 0) or np.any(w_b < 0) or np.any(w_d < 0):
        raise ValueError("behaviour weights must be non-negative")
    rasc = w_r / np.maximum(w_r + w_d, SCORE_FLOOR)
    lcsc = w_r / np.maximum(w_r + w_b, SCORE_FLOOR)
    infsc = 2.0 * rasc * lcsc / np.maximum(rasc + lcsc, SCORE_FLOOR)
    return rasc, lcsc, infsc
