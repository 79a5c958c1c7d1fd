"""SnapKV (arXiv 2404.14469): the attention the prompt's last queries pay each token."""

from __future__ import annotations

import torch

from common.checks import check_integer
from runtime.scorers.base import Scorer
from runtime.scorers.helpers import masked
from runtime.scorers.inputs import LayerInputs, RecentQueries


class SnapKVScorer(Scorer):
    """SnapKV ("SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469):
    the causal attention of the last ``window`` prompt queries, summed over them, averaged over the
    GQA group, then a mean over the ``kernel`` neighbouring tokens (those that exist)."""

    name = "snapkv"

    def __init__(self, window: int = 32, kernel: int = 5):
        self.window = check_integer("snapkv observation window", window, minimum=1)
        self.kernel = check_integer("snapkv pooling kernel", kernel, minimum=1, odd=True)

    @property
    def needs(self):
        return (RecentQueries(self.window),)

    def attention(self, inputs: LayerInputs) -> torch.Tensor:
        """Mean attention of each row's observed queries, pooled over neighbours (sums to about 1)."""
        _, query_positions = inputs[RecentQueries(self.window)]  # [R, w]
        observed = (query_positions >= 0).sum(-1).clamp_min(1)  # [R]: the queries each row recorded
        return self.score(inputs) / observed.to(inputs.keys.device)[:, None, None]

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        keys = inputs.keys.float()  # [R, Hkv, n, d]
        rows, heads, n, _ = keys.shape
        queries, query_positions = inputs[RecentQueries(self.window)]  # [R, Hkv, G, w, d], [R, w]
        logits = inputs.scaling * queries @ keys.unsqueeze(2).transpose(-1, -2)  # [R, Hkv, G, w, n]
        visible = inputs.positions.unsqueeze(2).unsqueeze(3) <= query_positions[:, None, None, :, None]
        visible = visible & inputs.valid[:, :, None, None, :]  # causal, real keys only
        logits = logits.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        weights = torch.where(visible.any(-1, keepdim=True), weights, torch.zeros_like(weights))  # no query there
        weights = weights.sum(3).mean(2)  # [R, Hkv, n]
        # a mean over the kernel's neighbours that exist (count_include_pad=False at each head's own end)
        valid = inputs.valid.float()
        summed = torch.nn.functional.avg_pool1d(
            (weights * valid).reshape(rows * heads, 1, n), self.kernel, stride=1, padding=self.kernel // 2
        )
        counted = torch.nn.functional.avg_pool1d(
            valid.reshape(rows * heads, 1, n), self.kernel, stride=1, padding=self.kernel // 2
        )
        return masked((summed / counted.clamp_min(1e-12)).reshape(rows, heads, n), inputs.valid)

    def __repr__(self) -> str:
        return f"SnapKVScorer(window={self.window}, kernel={self.kernel})"
