"""StreamingLLM: the attention sinks and the most recent tokens."""

from __future__ import annotations

import torch

from runtime.scorers.base import Scorer
from runtime.scorers.helpers import masked
from runtime.scorers.inputs import LayerInputs


class StreamingScorer(Scorer):
    """StreamingLLM: sinks + the most recent tokens (score = position; the sinks are the selection's)."""

    name = "streaming"

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        return masked(inputs.positions.float(), inputs.valid)
