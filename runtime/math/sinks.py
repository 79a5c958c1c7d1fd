"""Learned attention sinks: a logit per query head that takes part in every softmax, its value dropped.

gpt-oss ("gpt-oss-120b & gpt-oss-20b Model Card", arXiv 2508.10925) and the models built like it (Granite
SWA, Flint...) pass ``s_aux [Hq]`` to their attention function; transformers' eager attention appends it
to each query's logits as one more column and drops that column's weight after the softmax.  Over rows of
log-sum-exp ``lse`` (``Z = e^lse``) the sink-less output ``o`` becomes

    o Z / (Z + e^s) = o sigmoid(lse - s)

so an attention that gives its log-sum-exp (every kernel of the ragged cache, the MomentKV merge with the
evicted set's ``Z_E`` added to ``Z``) serves a sink by one factor per query (:func:`sink_weight`); one that
materialises the logits appends the column (:func:`softmax_with_sinks`).
"""

from __future__ import annotations

import torch


def sink_weight(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``Z / (Z + e^s) = sigmoid(lse - s)`` (float32), broadcasting ``lse`` against ``sinks`` (both on the
    layer's device: no copy in a decode step): 0 where nothing is visible (``lse = -inf``), so a query that
    sees no row keeps its zero output."""
    return torch.sigmoid(lse.float() - sinks.float())


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax`` over the last dim of ``logits [..., k]`` with the sink's logit as one more column,
    that column dropped: ``[..., k]``, each row summing to ``sigmoid(lse - s)``.  ``sinks`` broadcasts
    against ``logits[..., :1]`` (per query head: ``[Hq, 1, 1]`` for ``[Hq, q, k]``); None: a plain
    softmax."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    column = sinks.to(logits).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
