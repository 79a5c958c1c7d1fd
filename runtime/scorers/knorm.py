"""KNorm: keep the keys with the lowest L2 norm."""

from __future__ import annotations

import torch

from runtime.scorers.base import Scorer
from runtime.scorers.helpers import masked
from runtime.scorers.inputs import LayerInputs


class KNormScorer(Scorer):
    """KNorm: keep the keys with the lowest L2 norm (score ``-||k_i||``)."""

    name = "knorm"

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return masked(-inputs.keys.float().norm(dim=-1), inputs.valid)
