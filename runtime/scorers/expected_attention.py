"""Expected Attention (arXiv 2510.00636, Eq. 5-9; docs/design.md section 1)."""

from __future__ import annotations

import torch

from common.checks import check_integer, check_number
from runtime.scorers.base import Scorer
from runtime.scorers.helpers import empty_heads_to_zero, max_pooled, value_weighted
from runtime.scorers.inputs import AveragedRope, LayerInputs, QueryStatistics


class ExpectedAttentionScorer(Scorer):
    """Expected Attention (arXiv 2510.00636, Eq. 5-9; docs/design.md section 1).

    ``z_i = s mu'.k_i + (s^2/2) k_i^T Sigma' k_i`` with ``mu' = Rbar mu``,
    ``Sigma' = Rbar Sigma Rbar^T``; ``a = softmax(z)`` per query head, averaged over the GQA
    group; score ``(a_i + epsilon) * ||v_i||``.  ``pool > 1`` (odd) replaces ``a_i`` by its maximum
    over the ``pool`` neighbouring rows, so a span (e.g. a number's digit tokens) is kept whole
    when one of its tokens is attended.  ``statistics``: whose ``mu, Sigma``
    (:class:`~runtime.scorers.inputs.QueryStatistics`); ``horizon``: the positions ``Rbar``
    averages RoPE over, from the next token.
    """

    name = "expected_attention"
    # kvpress's ExpectedAttentionPress adds 1e-2: a token whose expected attention is below it is then
    # ranked by its value norm, instead of by an estimate of attention no query will pay.  With 0 it
    # kept no probe at any ratio (docs/results.md R-ea-epsilon-2026-11-22).
    DEFAULT_EPSILON = 1e-2

    def __init__(
        self, statistics: str = "calibrated", horizon: int = 512, epsilon: float = DEFAULT_EPSILON, pool: int = 1
    ):
        if statistics not in QueryStatistics.KINDS:
            raise ValueError(
                f"expected_attention statistics must be 'calibrated', 'future' or 'prompt', got {statistics!r}"
            )
        self.statistics = statistics
        self.horizon = check_integer("expected_attention horizon", horizon, minimum=1)
        self.epsilon = check_number("expected_attention epsilon", epsilon, minimum=0.0)
        self.pool = check_integer("expected_attention pool", pool, minimum=1, odd=True)

    @property
    def needs(self):
        return (QueryStatistics(self.statistics), AveragedRope(self.horizon))

    def attention(self, inputs: LayerInputs) -> torch.Tensor:
        keys = inputs.keys.float()  # [R, Hkv, n, d]
        mean, cov = inputs[QueryStatistics(self.statistics)]  # [R, Hkv, G, d], [R, Hkv, G, d, d]
        rbar = inputs[AveragedRope(self.horizon)].matrices().to(keys.device)[:, None, None]
        # rbar [R, 1, 1, d, d]; the per-head formula with leading [R, Hkv] axes
        mean = mean.float().to(keys.device).unsqueeze(-2) @ rbar.transpose(-1, -2)  # [R, Hkv, G, 1, d]
        cov = rbar @ cov.float().to(keys.device) @ rbar.transpose(-1, -2)  # [R, Hkv, G, d, d]
        s = inputs.scaling
        linear = s * (mean @ keys.unsqueeze(2).transpose(-1, -2)).squeeze(-2)  # [R, Hkv, G, n]
        quadratic = 0.5 * s * s * ((keys.unsqueeze(2) @ cov) * keys.unsqueeze(2)).sum(-1)  # [R, Hkv, G, n]
        logits = (linear + quadratic).masked_fill(~inputs.valid.unsqueeze(2), float("-inf"))
        attention = torch.softmax(logits, dim=-1).mean(2)  # [R, Hkv, n]
        return max_pooled(empty_heads_to_zero(attention, inputs.valid), self.pool)

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return value_weighted(self.attention(inputs), inputs, self.epsilon)

    def __repr__(self) -> str:
        return (
            f"ExpectedAttentionScorer(statistics={self.statistics!r}, horizon={self.horizon}, "
            f"epsilon={self.epsilon}, pool={self.pool})"
        )
