"""Expected attention of a few future-query centres per query head, reduced by a max."""

from __future__ import annotations

import torch

from common.checks import check_integer, check_number
from runtime.scorers.base import Scorer
from runtime.scorers.helpers import empty_heads_to_zero, max_pooled, value_weighted
from runtime.scorers.inputs import AveragedRope, LayerInputs, QueryCentres


class PrototypeAttentionScorer(Scorer):
    """Expected attention of a few query directions, reduced by a max: each query head's K pre-RoPE
    future-query centres (the artifact's ``future_queries`` section: k-means of the queries after
    the context of needle probes) stand in for one mean query.

    Per query head ``g`` and centre ``c_gk``: ``a_gki = softmax_i(s (Rbar c_gk) . k_i)`` with ``Rbar``
    RoPE averaged over the ``horizon`` positions from the next token (as Expected Attention, arXiv
    2510.00636, Eq. 5-9, without the covariance term); ``centres="max"`` takes ``max_k a_gki`` (a key
    is kept when any likely question direction would read it: DefensiveKV's worst-case aggregation,
    arXiv 2510.13334; one direction per head as Q-Filters, arXiv 2503.02812; pre-RoPE query centres
    as TriAttention, arXiv 2604.04921), ``centres="mean"`` the mixture's ``sum_k w_gk a_gki``.  Over
    the GQA group ``group="mean"`` (as EA) or ``"max"``.  Score ``(a_i + epsilon) * ||v_i||``;
    ``pool`` as in :class:`~runtime.scorers.ExpectedAttentionScorer`.
    """

    name = "prototype_attention"
    REDUCTIONS = ("max", "mean")

    # Defaults (horizon 64: the ~40 tokens a question and answer span; max over the group and the
    # centres; epsilon 0) chosen on the tuning probes: docs/results.md R-prototype-defaults-2026-11-22,
    # and for the number of centres R-future-centres-2026-11-22.
    def __init__(
        self, horizon: int = 64, epsilon: float = 0.0, centres: str = "max", group: str = "max", pool: int = 1
    ):
        self.horizon = check_integer("prototype_attention horizon", horizon, minimum=1)
        self.epsilon = check_number("prototype_attention epsilon", epsilon, minimum=0.0)
        if centres not in self.REDUCTIONS or group not in self.REDUCTIONS:
            raise ValueError(
                f"prototype_attention reduces centres and the group by 'max' or 'mean', got centres={centres!r}, "
                f"group={group!r}"
            )
        self.centres, self.group = centres, group
        self.pool = check_integer("prototype_attention pool", pool, minimum=1, odd=True)

    @property
    def needs(self):
        return (QueryCentres(), AveragedRope(self.horizon))

    def _reduce(self, attention: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``attention [..., G, K, n]``, ``weights [..., G, K]`` -> ``[..., n]``."""
        if self.centres == "max":
            per_head = attention.amax(-2)
        else:
            per_head = (attention * weights.unsqueeze(-1)).sum(-2)
        return per_head.amax(-2) if self.group == "max" else per_head.mean(-2)

    def attention(self, inputs: LayerInputs) -> torch.Tensor:
        if QueryCentres() not in inputs.supplied:
            raise ValueError(
                "prototype_attention needs the artifact's future-query centres (section 'future_queries'): "
                "re-run profile-model with the future-queries stage"
            )
        keys = inputs.keys.float()  # [R, Hkv, n, d]
        rbar = inputs[AveragedRope(self.horizon)].matrices().to(keys.device)  # [R, d, d]
        centres, weights = inputs[QueryCentres()]  # [Hkv, G, K, d], [Hkv, G, K]
        rotated = torch.einsum("hgkd,red->rhgke", centres.float().to(keys.device), rbar)  # [R, Hkv, G, K, d]
        logits = inputs.scaling * torch.einsum("rhgke,rhne->rhgkn", rotated, keys)  # [R, Hkv, G, K, n]
        logits = logits.masked_fill(~inputs.valid[:, :, None, None], float("-inf"))
        weights = weights.float().to(keys.device).unsqueeze(0)  # [1, Hkv, G, K]
        attention = self._reduce(torch.softmax(logits, dim=-1), weights)  # [R, Hkv, n]
        return max_pooled(empty_heads_to_zero(attention, inputs.valid), self.pool)

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return value_weighted(self.attention(inputs), inputs, self.epsilon)

    def __repr__(self) -> str:
        return (
            f"PrototypeAttentionScorer(horizon={self.horizon}, epsilon={self.epsilon}, centres={self.centres!r}, "
            f"group={self.group!r}, pool={self.pool})"
        )
