"""KeyDiff (arXiv 2504.15364): keep the keys least like the head's average key direction."""

from __future__ import annotations

import torch

from runtime.math.arrays import to_device
from runtime.scorers.base import Scorer
from runtime.scorers.helpers import masked
from runtime.scorers.inputs import LayerInputs


class KeyDiffScorer(Scorer):
    """KeyDiff (arXiv 2504.15364, Eq. 8): ``-cos(k_i, mean_j k_j/||k_j||)``; no attention needed."""

    name = "keydiff"

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        keys = inputs.keys.float()  # [R, Hkv, n, d], padding rows zero
        unit = keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-8)  # as torch.nn.functional.normalize
        anchor = unit.sum(2) / to_device(inputs.lengths, keys.device).clamp_min(1).unsqueeze(-1)  # [R, Hkv, d]
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        scores = -(unit @ anchor.unsqueeze(-1)).squeeze(-1)  # -cos(k_i, anchor) [R, Hkv, n]
        return masked(scores, inputs.valid)
