"""Per-head reference scorers: the readable definitions the batched ``runtime.scorers`` are checked
against (each scorer's score of ONE KV head's live tokens, no padding, no leading axes), and the
glue that turns heads into a scorer's :class:`~runtime.scorers.LayerInputs` and back.

``head_from_cache`` builds a head's inputs straight from their sources (the cache, the model's RoPE,
the calibration or the prompt's statistics), independently of ``runtime.scorers.providers``;
``layer_inputs`` pads heads into a layer (with its needs supplied), as the providers would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from runtime.math.geometry import ModelGeometry
from runtime.math.rope import Rotation, averaged_rope, rope_cos_sin, rope_matrix
from runtime.scorers import (
    AveragedRope,
    ChunkAttentionMass,
    ExpectedAttentionScorer,
    KeyDiffScorer,
    KeyRope,
    KNormScorer,
    KVzipScorer,
    LayerInputs,
    LearnedScorer,
    LearnedWeights,
    LeverageScorer,
    PrototypeAttentionScorer,
    QueryCentres,
    QueryStatistics,
    RecentQueries,
    SnapKVScorer,
    StreamingScorer,
    max_pooled,
    unrotate,
)
from runtime.scorers.providers import ChunkAttentionMassProvider


@dataclass
class Head:
    """Everything a scorer may look at for one (batch row, layer, KV head)."""

    layer: int
    kv_head: int
    keys: torch.Tensor  # [n, d] post-RoPE
    values: torch.Tensor  # [n, d]
    positions: torch.Tensor  # int [n] absolute RoPE positions, increasing
    scaling: float
    next_position: int
    query_mean: torch.Tensor | None = None  # [G, d] pre-RoPE
    query_cov: torch.Tensor | None = None  # [G, d, d]
    rope_cos: torch.Tensor | None = None  # [d] averaged over the horizon
    rope_sin: torch.Tensor | None = None
    recent_queries: torch.Tensor | None = None  # [G, w, d] post-RoPE, the last w prompt tokens
    key_cos: torch.Tensor | None = None  # [n, d] RoPE at each key's position
    key_sin: torch.Tensor | None = None
    learned_weights: torch.Tensor | None = None  # [2d]
    learned_bias: float | None = None
    query_centres: torch.Tensor | None = None  # [G, K, d]
    centre_weights: torch.Tensor | None = None  # [G, K]
    chunk_mass: torch.Tensor | None = None  # [n] each key's chunked attention over the whole prompt


# -- heads <-> layer inputs ----------------------------------------------------------------------


def head_from_cache(
    scorer, model, layer, layer_idx, b, h, next_position, *, calibration=None, prompt_stats=None, prompt_layer=None
):
    """Head ``(b, layer_idx, h)`` of a :class:`~runtime.kv_store.cache.RaggedLayer` with what ``scorer`` needs,
    each from its source directly.  ``prompt_layer``: the layer as prefilled, before any eviction (the
    chunked attention is that of the whole prompt; default ``layer``), its rows holding every prompt query."""
    geometry = ModelGeometry.of(model)
    keys, values, positions = layer.head(b, h)
    g = slice(h * geometry.group_size, (h + 1) * geometry.group_size)
    head = Head(layer_idx, h, keys, values, positions.long(), geometry.scalings[layer_idx], int(next_position))
    for need in scorer.needs:
        if isinstance(need, QueryStatistics):
            if need.kind == "prompt":
                mean, cov = prompt_stats.mean_cov(b)
            elif need.kind == "future":
                mean, cov = (torch.from_numpy(np.asarray(a)) for a in (calibration.future_mean, calibration.future_cov))
            else:
                mean, cov = (torch.from_numpy(np.asarray(a)) for a in (calibration.query_mean, calibration.query_cov))
            head.query_mean, head.query_cov = mean[layer_idx, g], cov[layer_idx, g]
        elif isinstance(need, AveragedRope):
            head.rope_cos, head.rope_sin = averaged_rope(model, int(next_position), need.horizon)
        elif isinstance(need, RecentQueries):
            head.recent_queries = layer.rows[b].recent_queries[g, -need.window :]
        elif isinstance(need, ChunkAttentionMass):
            head.chunk_mass = prompt_chunk_mass(need.spec, layer if prompt_layer is None else prompt_layer, b, h, g)
            head.chunk_mass = head.chunk_mass[positions.long()]
        elif isinstance(need, KeyRope):
            head.key_cos, head.key_sin = rope_cos_sin(model, positions)
        elif isinstance(need, LearnedWeights):
            head.learned_weights = torch.from_numpy(np.asarray(calibration.scorer_weights[layer_idx, h], np.float32))
            head.learned_bias = float(np.float32(calibration.scorer_bias[layer_idx, h]))
        elif isinstance(need, QueryCentres):
            head.query_centres = torch.from_numpy(np.asarray(calibration.future_centres[layer_idx, g], np.float32))
            head.centre_weights = torch.from_numpy(
                np.asarray(calibration.future_centre_weights[layer_idx, g], np.float32)
            )
    return head


def prompt_chunk_mass(spec, layer, b: int, h: int, group: slice) -> torch.Tensor:
    """Compactor's chunked attention of head ``(b, h)`` of a prefilled ``layer`` (nothing evicted, every
    prompt query recorded) by position, float32 ``[n]``: chunks of ``spec.chunk`` from position
    ``spec.first``, the last ``spec.last`` positions out, keys and queries alike (0 outside)."""
    keys, _, positions = layer.head(b, h)
    queries = layer.rows[b].recent_queries[group]  # [G, n, d], every prompt query
    n = keys.shape[0]
    assert queries.shape[1] == n and positions.tolist() == list(range(n)), "a prefilled head and every query"
    first = min(spec.first, n)
    end = n - min(spec.last, n - first)
    mass = torch.zeros(n, dtype=torch.float32)
    if end > first:
        inside = torch.arange(first, end)
        assert spec.scale is not None, "these tests give the chunked attention its scale"
        mass[inside] = chunked_attention_mass(
            queries[:, inside], inside, keys[inside], inside, spec.chunk, spec.scale, origin=first
        )
    return mass


def layer_inputs(scorer, heads: list[list[Head]]) -> LayerInputs:
    """``heads[r][h]`` (one layer, ``R`` rows x ``Hkv`` heads) padded into ``scorer``'s inputs; a
    need whose field a head lacks is left out (the scorer then refuses)."""
    rows, count = len(heads), len(heads[0])
    n = max(head.keys.shape[0] for row in heads for head in row)
    d = heads[0][0].keys.shape[1]
    keys, values = torch.zeros(rows, count, n, d), torch.zeros(rows, count, n, d)
    positions = torch.zeros(rows, count, n, dtype=torch.int64)
    lengths = torch.tensor([[head.keys.shape[0] for head in row] for row in heads])
    for r, row in enumerate(heads):
        for h, head in enumerate(row):
            m = head.keys.shape[0]
            keys[r, h, :m], values[r, h, :m], positions[r, h, :m] = head.keys, head.values, head.positions
    first = heads[0][0]
    inputs = LayerInputs(
        first.layer,
        keys,
        values,
        positions,
        torch.arange(n) < lengths.unsqueeze(-1),
        lengths,
        first.scaling,
        [row[0].next_position for row in heads],
    )

    def stack(field, pad_to=None, fill=0.0):
        parts = [[getattr(head, field) for head in row] for row in heads]
        if any(part is None for row in parts for part in row):
            return None
        if pad_to is not None:
            parts = [
                [torch.nn.functional.pad(p, (0, 0, 0, pad_to - p.shape[0]), value=fill) for p in row] for row in parts
            ]
        return torch.stack([torch.stack(row) for row in parts])

    for need in scorer.needs:
        value = None
        if isinstance(need, QueryStatistics) and first.query_mean is not None:
            value = stack("query_mean"), stack("query_cov")
        elif isinstance(need, AveragedRope) and first.rope_cos is not None:
            value = Rotation(
                torch.stack([row[0].rope_cos for row in heads]), torch.stack([row[0].rope_sin for row in heads])
            )
        elif isinstance(need, RecentQueries) and first.recent_queries is not None:
            width = max(row[0].recent_queries[:, -need.window :].shape[1] for row in heads)
            group = first.recent_queries.shape[0]
            queries = torch.zeros(rows, count, group, width, d)
            query_positions = torch.full((rows, width), -1, dtype=torch.int64)
            for r, row in enumerate(heads):
                for h, head in enumerate(row):
                    recorded = head.recent_queries[:, -need.window :]
                    w = recorded.shape[1]
                    queries[r, h, :, width - w :] = recorded
                    query_positions[r, width - w :] = torch.arange(head.next_position - w, head.next_position)
            value = queries, query_positions
        elif isinstance(need, ChunkAttentionMass) and first.chunk_mass is not None:
            value = torch.zeros(rows, count, n)
            for r, row in enumerate(heads):
                for h, head in enumerate(row):
                    value[r, h, : head.chunk_mass.shape[0]] = head.chunk_mass
        elif isinstance(need, ChunkAttentionMass) and first.recent_queries is not None:
            # the mass from the recorded queries (the profiler's way; the prefill's accumulation is checked
            # against it in test_chunk_attention.py)
            recorded = [torch.cat([head.recent_queries for head in row]) for row in heads]  # [Hq, w, d]
            value = ChunkAttentionMassProvider(need, scorer, None)(inputs, queries=recorded)
        elif isinstance(need, KeyRope) and first.key_cos is not None:
            value = Rotation(stack("key_cos", n, fill=1.0), stack("key_sin", n))  # padding: the RoPE of position 0
        elif isinstance(need, LearnedWeights) and first.learned_weights is not None:
            value = torch.stack([h.learned_weights for h in heads[0]]), torch.tensor([h.learned_bias for h in heads[0]])
        elif isinstance(need, QueryCentres) and first.query_centres is not None:
            value = torch.stack([h.query_centres for h in heads[0]]), torch.stack([h.centre_weights for h in heads[0]])
        if value is not None:
            inputs.supplied[need] = value
    return inputs


def one_head(scorer, head: Head) -> LayerInputs:
    """A layer of one row and one KV head."""
    return layer_inputs(scorer, [[head]])


# -- shared per-head definitions ------------------------------------------------------------------


def leverage_scores(keys, sketch=None, generator=None, ridge=1e-6):
    """Leverage of every row of the column-centred keys ``[n, d]``, float64 ``[n]`` (optionally of
    ``X Phi``, ``Phi [d, k]`` drawn from ``generator``, entries ``N(0, 1/k)``)."""
    x = keys.double()
    x = x - x.mean(0, keepdim=True)
    if sketch is not None:
        x = x @ (torch.randn(x.shape[1], sketch, generator=generator, dtype=torch.float64) / math.sqrt(sketch))
    gram = x.T @ x
    jitter = ridge * float(gram.diagonal().mean().clamp_min(1e-30))
    factor = torch.linalg.cholesky(gram + jitter * torch.eye(gram.shape[0], dtype=gram.dtype))
    whitened = torch.linalg.solve_triangular(factor, x.T, upper=False)  # L^{-1} X^T  [k, n]
    return (whitened * whitened).sum(0)


def chunked_attention_mass(queries, query_positions, keys, key_positions, chunk, scale, origin=0):
    """Each key's attention from its own chunk's queries ``[G, w, d]`` (non-causal softmax over the
    chunk's keys), summed over the queries, averaged over ``G``: float32 ``[n]``."""
    key_chunk = torch.div(key_positions.long() - origin, chunk, rounding_mode="floor")
    query_chunk = torch.div(query_positions.long() - origin, chunk, rounding_mode="floor")
    mass = torch.zeros(keys.shape[0], dtype=torch.float32)
    for c in torch.unique(key_chunk).tolist():
        key_rows = (key_chunk == c).nonzero().squeeze(1)
        query_rows = (query_chunk == c).nonzero().squeeze(1)
        if query_rows.numel() == 0:
            continue
        logits = scale * queries.float()[:, query_rows] @ keys.float()[key_rows].T  # [G, m, r]
        mass[key_rows] = torch.softmax(logits, dim=-1).sum(1).mean(0)
    return mass


def zscore(x):
    x = x.double()
    return (x - x.mean()) / x.std(unbiased=False).clamp_min(1e-6)


# -- the scorers, one head at a time ----------------------------------------------------------------


def expected_attention_attention(scorer: ExpectedAttentionScorer, head: Head) -> torch.Tensor:
    keys = head.keys.float()  # [n, d]
    rbar = rope_matrix(head.rope_cos, head.rope_sin)  # [d, d]
    mean = head.query_mean.float() @ rbar.T  # [G, d]
    cov = rbar @ head.query_cov.float() @ rbar.T  # [G, d, d]
    s = head.scaling
    linear = s * (mean @ keys.T)  # [G, n]
    quadratic = 0.5 * s * s * ((keys @ cov) * keys).sum(-1)  # [G, n]
    return max_pooled(torch.softmax(linear + quadratic, dim=-1).mean(0), scorer.pool)  # [n]


def expected_attention(scorer: ExpectedAttentionScorer, head: Head) -> torch.Tensor:
    return (expected_attention_attention(scorer, head) + scorer.epsilon) * head.values.float().norm(dim=-1)


def prototype_attention_attention(scorer: PrototypeAttentionScorer, head: Head) -> torch.Tensor:
    keys = head.keys.float()  # [n, d]
    rbar = rope_matrix(head.rope_cos, head.rope_sin)  # [d, d]
    centres = head.query_centres.float() @ rbar.T  # [G, K, d]
    attention = torch.softmax(head.scaling * (centres @ keys.T), dim=-1)  # [G, K, n]
    if scorer.centres == "max":
        per_head = attention.amax(-2)
    else:
        per_head = (attention * head.centre_weights.float().unsqueeze(-1)).sum(-2)
    reduced = per_head.amax(0) if scorer.group == "max" else per_head.mean(0)
    return max_pooled(reduced, scorer.pool)


def prototype_attention(scorer: PrototypeAttentionScorer, head: Head) -> torch.Tensor:
    return (prototype_attention_attention(scorer, head) + scorer.epsilon) * head.values.float().norm(dim=-1)


def keydiff(scorer: KeyDiffScorer, head: Head) -> torch.Tensor:
    keys = head.keys.float()
    anchor = torch.nn.functional.normalize(keys, dim=-1).mean(0)  # [d]
    return -torch.nn.functional.cosine_similarity(keys, anchor.unsqueeze(0), dim=-1)


def knorm(scorer: KNormScorer, head: Head) -> torch.Tensor:
    return -head.keys.float().norm(dim=-1)


def streaming(scorer: StreamingScorer, head: Head) -> torch.Tensor:
    return head.positions.float()


def snapkv(scorer: SnapKVScorer, head: Head) -> torch.Tensor:
    queries = head.recent_queries[:, -scorer.window :].float()  # [G, w, d]
    keys = head.keys.float()
    w = queries.shape[1]
    query_positions = head.next_position - w + torch.arange(w)  # [w]
    logits = head.scaling * queries @ keys.T  # [G, w, n]
    future = head.positions.unsqueeze(0) > query_positions.unsqueeze(1)  # [w, n]
    weights = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1).sum(1).mean(0)  # [n]
    pooled = torch.nn.functional.avg_pool1d(
        weights[None, None], scorer.kernel, stride=1, padding=scorer.kernel // 2, count_include_pad=False
    )
    return pooled[0, 0]


def snapkv_attention(scorer: SnapKVScorer, head: Head) -> torch.Tensor:
    return snapkv(scorer, head) / head.recent_queries[:, -scorer.window :].shape[1]


def leverage(scorer: LeverageScorer, head: Head) -> torch.Tensor:
    n = head.keys.shape[0]
    first = min(scorer.exclude_first, n)
    last = min(scorer.exclude_last, n - first)
    middle = slice(first, n - last)
    if n - last - first <= 1:  # nothing to rank
        return torch.zeros(n)
    score = None
    if scorer.blend != 0:
        keys = head.keys[middle].float()
        if scorer.pre_rope:
            keys = unrotate(keys, head.key_cos[middle].float(), head.key_sin[middle].float())
        generator = None
        if scorer.sketch is not None:
            generator = torch.Generator().manual_seed(scorer.seed * 1_000_003 + head.layer * 1009 + head.kv_head)
        lev = leverage_scores(keys, scorer.sketch, generator, scorer.ridge)
        score = zscore(lev) * (1.0 if scorer.blend is None else scorer.blend)
    if scorer.blend is not None:
        keys, positions = head.keys[middle], head.positions[middle].long()
        if head.chunk_mass is not None:  # the prompt's chunked attention, read at the middle's positions
            mass = head.chunk_mass[middle].float()
        else:
            queries = head.recent_queries  # [G, w, d], the last w prompt tokens
            w = queries.shape[1]
            query_positions = head.next_position - w + torch.arange(w)
            inside = (query_positions >= positions[0]) & (query_positions <= positions[-1])  # the middle's queries
            scale = head.scaling if scorer.attention_scale is None else scorer.attention_scale
            mass = chunked_attention_mass(
                queries[:, inside], query_positions[inside], keys, positions, scorer.chunk, scale, int(positions[0])
            )
        if scorer.value_norm:
            mass = mass * head.values[middle].float().norm(dim=-1)
        if scorer.pool > 1:
            mass = torch.nn.functional.avg_pool1d(
                mass[None, None], scorer.pool, stride=1, padding=scorer.pool // 2, count_include_pad=True
            )[0, 0]
        score = zscore(mass) if score is None else score + zscore(mass)
    out = torch.empty(n, dtype=torch.float32)
    out[middle] = score.float()
    top = out[middle].max()
    out[:first] = top
    out[n - last :] = top
    return out


def kvzip(scorer: KVzipScorer, head: Head) -> torch.Tensor:
    table = scorer.table
    positions = head.positions.long()
    out = torch.full((positions.shape[0],), float("inf"))
    inside = positions < table.length
    out[inside] = table.scores[head.layer, head.kv_head, positions[inside]]
    return out


def learned(scorer: LearnedScorer, head: Head) -> torch.Tensor:
    keys = head.keys.float()
    features = torch.cat([unrotate(keys, head.key_cos.float(), head.key_sin.float()), head.values.float()], -1)
    return features @ head.learned_weights.float() + float(head.learned_bias)  # [n]


ORACLES = {
    ExpectedAttentionScorer: (expected_attention, expected_attention_attention),
    PrototypeAttentionScorer: (prototype_attention, prototype_attention_attention),
    KeyDiffScorer: (keydiff, None),
    KNormScorer: (knorm, None),
    StreamingScorer: (streaming, None),
    SnapKVScorer: (snapkv, snapkv_attention),
    LeverageScorer: (leverage, None),
    KVzipScorer: (kvzip, None),
    LearnedScorer: (learned, None),
}


def oracle_score(scorer, head: Head) -> torch.Tensor:
    """The per-head definition of ``scorer``'s scores ``[n]`` (the nearest registered base class)."""
    klass = next(k for k in type(scorer).__mro__ if k in ORACLES)
    return ORACLES[klass][0](scorer, head)


def oracle_attention(scorer, head: Head) -> torch.Tensor:
    """The per-head definition of ``scorer``'s attention estimate ``[n]``."""
    klass = next(k for k in type(scorer).__mro__ if k in ORACLES)
    return ORACLES[klass][1](scorer, head)


def score_one(scorer, head: Head) -> torch.Tensor:
    """The batched scorer's scores ``[n]`` of one head (a layer of one row and one KV head)."""
    return scorer.score(one_head(scorer, head))[0, 0]


def attention_one(scorer, head: Head) -> torch.Tensor:
    """The batched scorer's attention estimate ``[n]`` of one head."""
    return scorer.attention(one_head(scorer, head))[0, 0]
