"""Small providers: each supplies one kind of :class:`~runtime.scorers.inputs.Need`, for the runtime
(:mod:`runtime.compression.eviction`, from the cache, the calibration and the prompt's statistics) and the
profiler's stages (from a captured forward pass) alike.

:class:`ScorerInputs` is built once per scorer and source (it checks and loads what the needs
read, e.g. the artifact's arrays); :meth:`ScorerInputs.layer` then builds each call's
:class:`~runtime.scorers.inputs.LayerInputs`.  A new kind of input is a need class in
:mod:`runtime.scorers.inputs`, a provider here, and its line in :data:`PROVIDERS`.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.math.chunk_attention import masses_at_positions
from runtime.math.rope import ROTATE_HALF, averaged_rope, rope_cos_sin, rotation
from runtime.scorers.helpers import middle_chunk_attention
from runtime.scorers.inputs import (
    ALL_QUERIES,
    AveragedRope,
    ChunkAttentionMass,
    KeyRope,
    LayerInputs,
    LearnedWeights,
    QueryCentres,
    QueryStatistics,
    RecentQueries,
)


def _given(value, what: str):
    if value is None:
        raise ValueError(f"{what}: no calibration artifact holds them (load one with runtime.load_calibration)")
    return value


class QueryStatisticsProvider:
    """``(mean [R, Hkv, G, d], cov [R, Hkv, G, d, d])``: the artifact's (``calibrated``: ``query_stats``,
    ``future``: ``future_queries``; loaded and checked by :func:`runtime.plan.serving_plan.bind`, given as
    ``query_stats``) or the prompt's own, per statistics row (``stats_rows``)."""

    def __init__(self, need: QueryStatistics, scorer, geometry, prompt_stats=None, query_stats=None, **_):
        self.geometry, self.prompt_stats, self.per_row, self.artifact = geometry, prompt_stats, {}, None
        if need.kind == "prompt":
            if prompt_stats is None:
                raise ValueError(f"{scorer!r} needs the prompt's query statistics: prefill with policy=... first")
            return
        self.artifact = _given(query_stats, f"{scorer!r} needs {need.describe()}")  # [L, Hq, d], [L, Hq, d, d]

    def _of_row(self, row: int):
        if self.artifact is not None:
            return self.artifact
        if row not in self.per_row:
            self.per_row[row] = self.prompt_stats.mean_cov(row)
        return self.per_row[row]

    def __call__(self, inputs: LayerInputs, *, stats_rows, **_):
        stats = [self._of_row(r) for r in stats_rows]
        shape = (self.geometry.num_kv_heads, self.geometry.group_size)
        mean = torch.stack([mean[inputs.layer].reshape(*shape, -1) for mean, _ in stats])
        cov = torch.stack([cov[inputs.layer].reshape(*shape, *cov.shape[-2:]) for _, cov in stats])
        return mean, cov


class AveragedRopeProvider:
    """:class:`~runtime.math.rope.Rotation` ``cos, sin [R, d]``: the layer's RoPE in its form (``rope_forms``) averaged
    over the horizon from each row's next position (the last call's positions are remembered per RoPE of the
    model, one per layer type for Gemma 3: decoding asks for the same ones layer after layer)."""

    def __init__(self, need: AveragedRope, scorer, geometry, rope_forms=None, **_):
        self.horizon, self.geometry, self.memo, self.forms = need.horizon, geometry, {}, rope_forms

    def __call__(self, inputs: LayerInputs, **_):
        form = self.forms.queries[inputs.layer] if self.forms else ROTATE_HALF  # it rotates query statistics
        rope = (self.geometry.rope_layer_types[inputs.layer], form)
        known = self.memo.get(rope, {})
        memo = {
            p: known.get(p) or averaged_rope(self.geometry, p, self.horizon, inputs.layer, form=form)
            for p in inputs.next_positions
        }
        self.memo[rope] = memo
        cos, sin = (torch.stack(parts) for parts in zip(*(memo[p] for p in inputs.next_positions), strict=True))
        return rotation(self.geometry, inputs.layer, form, cos, sin, keys=False)


class RecentQueriesProvider:
    """``(queries [R, Hkv, G, w, d] float32, positions int64 [R, w])`` from each row's recorded
    post-RoPE prompt queries ``queries[r] [Hq, w_r, d]`` (the last ``w_r`` before its next position),
    the last ``window`` of them right-aligned to the longest (``-1``: no query there)."""

    def __init__(self, need: RecentQueries, scorer, geometry, **_):
        self.need, self.scorer = need, scorer

    def __call__(self, inputs: LayerInputs, *, queries, **_):
        rows, heads, _, dim = inputs.keys.shape
        window = self.need.window
        for recorded, position in zip(queries, inputs.next_positions, strict=True):
            if recorded is None or recorded.shape[1] < min(window, int(position)):
                have = 0 if recorded is None else recorded.shape[1]
                raise ValueError(
                    f"{self.scorer!r} needs {self.need.describe()}, only {have} were recorded: prefill with "
                    "policy=... (or observe_queries=...) for this scorer"
                )
        kept = [recorded[:, -window:] for recorded in queries]  # [Hq, w_r, d]
        device = inputs.keys.device
        width = max(q.shape[1] for q in kept)
        group = kept[0].shape[0] // heads
        padded = torch.zeros(rows, heads, group, width, dim, device=device)
        positions = torch.full((rows, width), -1, dtype=torch.int64, device=device)
        for r, recorded in enumerate(kept):
            w = recorded.shape[1]
            padded[r, :, :, width - w :] = recorded.float().to(device).reshape(heads, group, w, dim)
            positions[r, width - w :] = int(inputs.next_positions[r]) - w + torch.arange(w, device=device)
        return padded, positions


class ChunkAttentionMassProvider:
    """float32 ``[R, Hkv, n]``: each key's chunked attention mass (Compactor's): in the runtime, from the rows'
    ``{ChunkSpec: ChunkAttention}`` accumulated during the prefill (``chunk_attention``); in the profiler,
    from the captured queries (``queries``: each row's ``[Hq, w, d]``), the accumulation's reference."""

    def __init__(self, need, scorer, geometry, **_):
        self.need, self.scorer = need, scorer
        self.recent = RecentQueriesProvider(RecentQueries(ALL_QUERIES), scorer, geometry)

    def __call__(self, inputs: LayerInputs, *, chunk_attention=None, queries=None, **_):
        if chunk_attention is not None:
            return masses_at_positions(chunk_attention, self.need.spec, inputs.positions, inputs.valid, inputs.scaling)
        if queries is None:
            raise ValueError(f"{self.scorer!r} needs {self.need.describe()}: prefill with policy=... first")
        recorded, query_positions = self.recent(inputs, queries=queries)  # [R, Hkv, G, W, d], [R, W]
        return middle_chunk_attention(inputs, recorded, query_positions, self.need.spec)


class KeyRopeProvider:
    """:class:`~runtime.math.rope.Rotation` ``cos, sin [R, Hkv, n, d]``: the layer's RoPE in its form (``rope_forms``)
    at each key's position.  On a CPU the last result is reused while the positions and the layer's RoPE are the
    same (a fresh prompt's heads share them); elsewhere ``torch.equal`` would synchronise the host per tile."""

    def __init__(self, need: KeyRope, scorer, geometry, rope_forms=None, **_):
        self.geometry, self.memo, self.forms = geometry, {}, rope_forms

    def __call__(self, inputs: LayerInputs, **_):
        positions = inputs.positions.reshape(-1)
        form = self.forms.keys[inputs.layer] if self.forms else ROTATE_HALF
        rope = (self.geometry.rope_layer_types[inputs.layer], form)
        memo = self.memo.get(rope) if positions.device.type == "cpu" else None
        if memo is None or memo[0].shape != positions.shape or not torch.equal(memo[0], positions):
            memo = (positions.clone(), *rope_cos_sin(self.geometry, positions, inputs.layer, form=form))
            self.memo[rope] = memo if positions.device.type == "cpu" else None
        cos, sin = (part.reshape(*inputs.positions.shape, -1).to(inputs.keys.device) for part in memo[1:])
        return rotation(self.geometry, inputs.layer, form, cos, sin, keys=True)


class LearnedWeightsProvider:
    """``(weights [Hkv, 2d], bias [Hkv])`` float32 of the layer, from ``learned`` (``(weights [L, Hkv,
    2d], bias [L, Hkv])``: the artifact's ``learned_scorer`` section as ``bind`` loaded it, or the
    profiler's fit)."""

    def __init__(self, need: LearnedWeights, scorer, geometry, learned=None, **_):
        learned = _given(learned, f"{scorer!r} needs the artifact's learned_scorer weights")
        weights, bias = (torch.as_tensor(np.asarray(part), dtype=torch.float32) for part in learned)
        shape = (geometry.num_layers, geometry.num_kv_heads)
        if tuple(weights.shape) != (*shape, geometry.head_dim + geometry.value_head_dim) or tuple(bias.shape) != shape:
            raise ValueError(  # the features: [pre-RoPE key, value]
                f"learned scorer weights of shape {tuple(weights.shape)} (bias {tuple(bias.shape)}) do not fit the "
                f"model ({shape[0]} layers, {shape[1]} KV heads, d={geometry.head_dim}, dv={geometry.value_head_dim})"
            )
        self.weights, self.bias = weights, bias

    def __call__(self, inputs: LayerInputs, **_):
        return self.weights[inputs.layer], self.bias[inputs.layer]


class QueryCentresProvider:
    """``(centres [Hkv, G, K, d], weights [Hkv, G, K])``: the artifact's future-query centres of the layer
    (``query_centres``: ``[L, Hkv, G, K, d]``, ``[L, Hkv, G, K]``, as ``bind`` loaded and checked them)."""

    def __init__(self, need: QueryCentres, scorer, geometry, query_centres=None, **_):
        self.centres, self.weights = _given(query_centres, f"{scorer!r} needs {need.describe()}")

    def __call__(self, inputs: LayerInputs, **_):
        return self.centres[inputs.layer], self.weights[inputs.layer]


PROVIDERS = {
    QueryStatistics: QueryStatisticsProvider,
    AveragedRope: AveragedRopeProvider,
    RecentQueries: RecentQueriesProvider,
    ChunkAttentionMass: ChunkAttentionMassProvider,
    KeyRope: KeyRopeProvider,
    LearnedWeights: LearnedWeightsProvider,
    QueryCentres: QueryCentresProvider,
}


class ScorerInputs:
    """Builds ``scorer``'s :class:`LayerInputs`: the base every scorer sees, plus what its needs ask,
    each from its provider.  Sources: the model's ``geometry``, and, as the needs require, the
    prompt's statistics ``prompt_stats`` (:class:`~runtime.compression.prompt_statistics.QueryMoments`) and the
    artifact's tensors as :func:`runtime.plan.serving_plan.bind` loaded them (``query_stats``,
    ``query_centres``, ``learned``: the :class:`~runtime.plan.serving_plan.ServingPlan`'s fields of
    those names) or the profiler computed them; ``rope_forms``: each layer's (None: all rotate_half)."""

    def __init__(
        self,
        scorer,
        geometry,
        *,
        prompt_stats=None,
        query_stats=None,
        query_centres=None,
        learned=None,
        rope_forms=None,
    ):
        self.scorer, self.geometry = scorer, geometry
        sources = dict(prompt_stats=prompt_stats, query_stats=query_stats, query_centres=query_centres, learned=learned)
        sources["rope_forms"] = rope_forms
        self.providers = [(need, PROVIDERS[type(need)](need, scorer, geometry, **sources)) for need in scorer.needs]

    def layer(
        self,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        lengths: torch.Tensor,
        next_positions,
        *,
        queries=None,
        chunk_attention=None,
        stats_rows=None,
        scaling: float | None = None,
    ) -> LayerInputs:
        """The inputs of ``R`` rows of layer ``layer``: ``keys, values [R, Hkv, n, d]`` (post-RoPE,
        padding zero), ``positions`` int64 / ``valid`` bool ``[R, Hkv, n]``, ``lengths [R, Hkv]``,
        ``next_positions [R]``; ``queries [R]``: each row's recorded prompt queries ``[Hq, w, d]``
        (for :class:`RecentQueries`); ``chunk_attention [R]``: each row's accumulated chunked
        attentions ``{ChunkSpec: ChunkAttention}`` (for :class:`ChunkAttentionMass`; None: computed
        from ``queries``); ``stats_rows [R]``: each row's row in the prompt statistics;
        ``scaling``: the attention scale (default: the model's for the layer)."""
        scaling = self.geometry.scalings[layer] if scaling is None else scaling
        inputs = LayerInputs(layer, keys, values, positions, valid, lengths, scaling, [int(p) for p in next_positions])
        for need, provider in self.providers:
            inputs.supplied[need] = provider(
                inputs, queries=queries, chunk_attention=chunk_attention, stats_rows=stats_rows
            )
        return inputs
