"""The artifact's learned scorer: a per-head linear map of a token's pre-RoPE key and value."""

from __future__ import annotations

import torch

from runtime.scorers.base import Scorer
from runtime.scorers.helpers import masked
from runtime.scorers.inputs import KeyRope, LayerInputs, LearnedWeights


class LearnedScorer(Scorer):
    """The artifact's learned scorer: a per-head linear map from a token's pre-RoPE key and value
    to the log of its KVzip reconstruction importance (fitted by ``profile-model``'s
    ``learned-scorer`` stage; "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction", arXiv 2505.23416, distilled as in "KVzap", arXiv 2601.07891).

    ``score = [unrotate(k), v] . w + b``: one small matmul per head, no extra forward pass.
    Scores predict log attention weights, so they are comparable across heads.
    """

    name = "learned"

    @property
    def needs(self):
        return (KeyRope(), LearnedWeights())

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        keys = inputs.keys.float()  # [R, Hkv, n, d]
        weights, bias = inputs[LearnedWeights()]  # [Hkv, 2d], [Hkv]
        pre_rope = inputs[KeyRope()].undo(keys)  # cos, sin [R, Hkv, n, d] in the layer's form
        features = torch.cat([pre_rope, inputs.values.float()], dim=-1)  # [R, Hkv, n, 2d]
        scores = torch.einsum("rhnf,hf->rhn", features, weights.float().to(keys.device))
        return masked(scores + bias.float().to(keys.device)[:, None], inputs.valid)
