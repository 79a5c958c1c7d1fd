"""KVzip (arXiv 2505.23416): scores precomputed by a reconstruction pass, looked up by position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.scorers.base import Scorer
from runtime.scorers.helpers import masked
from runtime.scorers.inputs import LayerInputs


@dataclass
class KVzipScores:
    """KVzip reconstruction scores of one prompt (:func:`runtime.compression.kvzip.kvzip_scores`):
    ``scores[layer, kv_head, position]`` (float32
    ``[L, Hkv, T]``, ``T`` = the context's real tokens); ``last_keys [L, Hkv, d]`` is the key
    at position ``T - 1`` of every head (to recognise the cache the scores belong to)."""

    scores: torch.Tensor
    last_keys: torch.Tensor
    prefix_length: int
    chunks: int
    reconstruction_tokens: int
    seconds: float

    @property
    def length(self) -> int:
        return int(self.scores.shape[-1])


class KVzipScorer(Scorer):
    """Scores precomputed by :func:`runtime.compression.kvzip.kvzip_scores` (KVzip, arXiv 2505.23416),
    looked up by position.

    One instance belongs to one prompt (one batch row): build it with
    :func:`runtime.compression.kvzip.with_kvzip_scores`.  Rows past the scored context (tokens decoded later) score
    ``+inf``: they are never evicted before a context token.  The scores are attention weights, on
    one scale for every head, so ``allocation="global"`` ranks all heads' tokens together: KVzip's
    own allocation (one top-k over every layer and KV head, :func:`runtime.compression.kvzip.kvzip_budgets`).
    """

    name = "kvzip"

    def __init__(self, scores: KVzipScores | None = None):
        if scores is not None and not isinstance(scores, KVzipScores):
            raise ValueError(
                f"kvzip scores must come from runtime.compression.kvzip.kvzip_scores, got {type(scores).__name__}"
            )
        self.table = scores

    def _checked_table(self, layer: int, heads: int, next_positions) -> KVzipScores:
        if self.table is None:
            raise ValueError(
                "the kvzip scorer needs a reconstruction pass over the prefilled cache: "
                "scores = runtime.compression.kvzip.kvzip_scores(model, tokenizer, cache, context_ids), then "
                "compress with runtime.compression.kvzip.with_kvzip_scores(policy, scores)"
            )
        table = self.table
        if layer >= table.scores.shape[0]:
            raise ValueError(f"kvzip scores cover {table.scores.shape[0]} layers, asked for layer {layer}")
        if heads != table.scores.shape[1]:
            raise ValueError(f"kvzip scores cover {table.scores.shape[1]} KV heads, the layer has {heads}")
        if min(next_positions) < table.length:
            raise ValueError(
                f"kvzip scores are for a {table.length}-token context, the cache has only seen "
                f"{min(next_positions)} tokens: they belong to another prompt"
            )
        return table

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        rows, heads = inputs.lengths.shape
        table = self._checked_table(inputs.layer, heads, inputs.next_positions)
        device = inputs.keys.device
        positions = inputs.positions.to(device)  # [R, Hkv, n]
        # the key at the last scored position must be the one the scores were computed with
        last = (positions == table.length - 1) & inputs.valid  # [R, Hkv, n]
        found = last.any(-1).cpu()  # [R, Hkv]
        keys_there = (inputs.keys.float() * last.unsqueeze(-1)).sum(2).cpu()  # [R, Hkv, d]
        wanted = table.last_keys[inputs.layer].unsqueeze(0).expand(rows, -1, -1)
        if found.any() and not torch.allclose(keys_there[found], wanted[found], rtol=1e-4, atol=1e-5):
            raise ValueError("kvzip scores belong to another prompt (the keys differ): compute them on this cache")
        scores = table.scores[inputs.layer].to(device).unsqueeze(0).expand(rows, -1, -1)  # [R, Hkv, T]
        inside = (positions < table.length) & inputs.valid
        looked_up = torch.gather(scores, 2, positions.clamp(0, table.length - 1))  # [R, Hkv, n]
        return masked(torch.where(inside, looked_up, torch.full_like(looked_up, float("inf"))), inputs.valid)

    def __repr__(self) -> str:
        return f"KVzipScorer({'no scores' if self.table is None else f'{self.table.length} tokens'})"
