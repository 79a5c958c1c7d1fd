"""KNorm: keep the keys with the lowest L2 norm."""

from __future__ import annotations

import torch

from .base import Scorer
from .helpers import masked
from .inputs import LayerInputs


class KNormScorer(Scorer):
    """KNorm: keep the keys with the lowest L2 norm (score ``-||k_i||``)."""

    name = "knorm"

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return masked(-inputs.keys.float().norm(dim=-1), inputs.valid)
