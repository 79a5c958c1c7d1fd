"""Prefill a :class:`RaggedCache` and evict per head under a :class:`CompressionPolicy`.

    cache = RaggedCache.for_model(model)
    stats = prefill(model, cache, ids[:, :n], mask[:, :n], policy=policy)   # forward only
    report = compress(model, cache, policy, calibration, prompt_stats=stats)
    report = compress(model, cache, plan, prompt_stats=stats)   # plan = bind(policy, calibration, model)

``prefill`` runs the model over a chunk with the ragged attention function, recording what
the policy's scorer needs (pre-RoPE query statistics of the prompt, a per-row
:class:`~runtime.compression.prompt_statistics.QueryMoments` filled through temporary forward hooks on
``q_proj`` / ``q_norm``, or the last queries for SnapKV).  ``compress`` then gives
every (batch element, layer, KV head) its budget (the plan's ``head_budgets`` for that element's
real token count) and keeps sinks + recent window + the best-scored tokens.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from runtime.compression.driver import DecodePlan, evicting_each_layer
from runtime.compression.eviction import HeadEvictor
from runtime.compression.keep_rule import global_budgets
from runtime.compression.prompt_statistics import QueryMoments
from runtime.compression.ragged_attention import ragged_attention
from runtime.kv_store.cache import RaggedCache
from runtime.kv_store.profiling import label
from runtime.kv_store.transformers_compat import cache_argument
from runtime.math.chunk_attention import ChunkSpec
from runtime.math.geometry import ModelGeometry
from runtime.plan.policy import CompressionPolicy
from runtime.plan.serving_plan import ServingPlan, as_plan
from runtime.scorers import chunk_specs, query_statistics, recent_query_window


@torch.no_grad()
def prefill(
    model,
    cache: RaggedCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    policy: CompressionPolicy | ServingPlan | None = None,
    prompt_stats: QueryMoments | None = None,
    record_prompt_stats: bool = False,
    observe_queries: int = 0,
    accumulate: tuple[ChunkSpec, ...] = (),
    n_sink: int | None = None,
):
    """Run ``input_ids [B, T]`` into ``cache`` and return the prompt query statistics (or None).

    ``attention_mask [B, past + T]`` (1 real, 0 padding) covers the columns already in the
    cache plus this chunk; None means no padding.  Positions follow the real tokens.
    What is recorded follows ``policy``'s scorer (``policy``: a policy or a :class:`ServingPlan`);
    ``record_prompt_stats`` / ``observe_queries`` / ``accumulate`` (chunked attentions,
    :mod:`runtime.math.chunk_attention`) record more (to compress copies of one prefilled cache under
    several policies), with the first ``n_sink`` tokens (default: the policy's, else 0) left out of
    the statistics.
    Pass the returned statistics back in (``prompt_stats=``) when prefilling in several chunks.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, length] tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    layers = ModelGeometry.of(model).num_layers
    if len(cache.attention_layers) != layers:
        raise ValueError(
            f"the cache has {len(cache.attention_layers)} layers, the model {layers}: is it another model's?"
        )
    batch, length = input_ids.shape
    past = cache.get_seq_length()
    if attention_mask is None:
        attention_mask = torch.ones(batch, past + length, dtype=torch.long, device=input_ids.device)
    if attention_mask.shape != (batch, past + length):
        raise ValueError(
            f"attention_mask must cover the {past} cached columns plus the {length} new ones: "
            f"expected shape {(batch, past + length)}, got {tuple(attention_mask.shape)}"
        )
    chunk_mask = attention_mask[:, past:].bool()
    seen = torch.tensor(
        cache.attention_layers[0].real_seen if cache.attention_layers[0].is_initialized else [0] * batch,
        device=input_ids.device,
    )
    position_ids = (seen.unsqueeze(1) + chunk_mask.long().cumsum(-1) - 1).clamp(min=0)
    # what the policy's scorer reads from the prompt, and what the caller asks to record besides
    served = policy.policy if isinstance(policy, ServingPlan) else policy  # the CompressionPolicy, or None
    scorer = None if policy is None else policy.scorer if isinstance(policy, ServingPlan) else policy.build_scorer()
    wants_stats = record_prompt_stats or (scorer is not None and query_statistics(scorer) == "prompt")
    window = max(0 if scorer is None else recent_query_window(scorer), int(observe_queries))
    specs = () if scorer is None else chunk_specs(scorer)
    if window:
        cache.observe_queries(window)
    if specs or accumulate:
        cache.accumulate_chunk_attention((*specs, *accumulate))
    collecting = contextlib.nullcontext()
    if wants_stats or prompt_stats is not None:
        geometry = ModelGeometry.of(model)
        if prompt_stats is None:
            prompt_stats = QueryMoments.for_prompt(geometry, batch)
        # only real tokens count; the first n_sink (attention sinks, outlier queries) stay out
        if n_sink is None:
            n_sink = 0 if served is None else served.n_sink
        collecting = prompt_stats.collect(geometry, real=chunk_mask & (position_ids >= n_sink))
    with collecting, ragged_attention(model):
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **cache_argument(model, cache),
        )
    return prompt_stats


def prefill_for_policies(model, cache: RaggedCache, input_ids: torch.Tensor, policies) -> QueryMoments | None:
    """Prefill ``input_ids [1, T]`` once so that copies of ``cache`` (``cache.copy()``) can each be
    compressed under one of ``policies`` (policies or plans): records the prompt query statistics, the
    last queries that any of their scorers observes and the chunked attentions they read.  Returns the
    statistics to pass to ``compress``;
    ``cache.stop_observing()`` before decoding the uncompressed cache itself."""
    scorers = [policy.scorer if isinstance(policy, ServingPlan) else policy.build_scorer() for policy in policies]
    window = max([0] + [recent_query_window(scorer) for scorer in scorers])
    specs = tuple(spec for scorer in scorers for spec in chunk_specs(scorer))
    return prefill(
        model,
        cache,
        input_ids,
        record_prompt_stats=bool(policies),
        observe_queries=window,
        accumulate=specs,
        n_sink=4,
    )


def score_layers(cache: RaggedCache, evictor: HeadEvictor, rows: list[int], next_positions: list[int]):
    """Every layer's scores ``[R, Hkv, n]`` of batch rows ``rows`` (padding ``-inf``) under
    ``evictor``'s scorer: what :func:`compress` ranks, computed before any head is cut."""
    return [
        evictor.layer_scores(layer, index, rows, next_positions) for index, layer in enumerate(cache.attention_layers)
    ]


def shared_scores(cache: RaggedCache, plans: list[ServingPlan], prompt_stats: QueryMoments | None = None):
    """:func:`score_layers` of every row of a prefilled ``cache`` under each of ``plans``, whose
    policies share one :meth:`~runtime.plan.policy.CompressionPolicy.scores_key` (their scorers' score
    parts are computed once, then each combines its own: leverage scorers that differ in their
    blend), to hand to :func:`compress` (``scores=``) for copies of ``cache``.  Returns the scores
    per plan and the seconds each plan's scoring would have taken alone (the shared parts' time
    plus its own combination)."""
    keys = {plan.policy.scores_key() for plan in plans}
    if len(keys) != 1 or None in keys:
        raise ValueError(f"shared scores need plans with one scores_key, got {sorted(map(repr, keys))}")
    first = cache.attention_layers[0]
    rows = [b for b in range(first.batch_size) if first.real_seen[b] > 0]
    positions = [first.real_seen[b] for b in rows]
    with torch.no_grad():
        started = time.perf_counter()
        evictor = HeadEvictor(plans[0], prompt_stats)
        parts = [
            evictor.layer_score_parts(layer, index, rows, positions)
            for index, layer in enumerate(cache.attention_layers)
        ]
        shared = time.perf_counter() - started
        results = []
        for plan in plans:
            started = time.perf_counter()
            evictor = HeadEvictor(plan, prompt_stats)
            scores = [
                evictor.layer_scores(layer, index, rows, positions, parts=parts[index])
                for index, layer in enumerate(cache.attention_layers)
            ]
            results.append((scores, shared + time.perf_counter() - started))
    return results


def _check_shared_scores(scores, cache: RaggedCache, rows: list[int]) -> None:
    """``scores`` must be one ``[R, Hkv, n]`` tensor per layer for the cache's real rows, as
    :func:`shared_scores` computes them (the longest row's length ``n``)."""
    if len(scores) != len(cache.attention_layers):
        raise ValueError(f"shared scores for {len(scores)} layers, the cache has {len(cache.attention_layers)}")
    for index, (layer, layer_scores) in enumerate(zip(cache.attention_layers, scores, strict=True)):
        longest = int(layer.length[rows].max()) if rows else 0
        expected = (len(rows), layer.num_heads, longest)
        if tuple(layer_scores.shape) != expected:
            raise ValueError(
                f"shared scores of layer {index} have shape {tuple(layer_scores.shape)}, the cache's rows "
                f"{expected}: were they computed on another cache?"
            )


@dataclass(repr=False)
class CompressionReport:
    """What :func:`compress` did; its ``repr`` / ``str`` is a one-line summary (the arrays stay
    attributes: hundreds of lines of them is no summary)."""

    budgets: np.ndarray  # int64 [B, L, Hkv] budget given to each head
    lengths_before: np.ndarray  # int64 [L, B, Hkv]
    lengths_after: np.ndarray  # int64 [L, B, Hkv]
    # of the L layers kvcal holds (RaggedCache.attention_layers): not a hybrid's recurrent states, nor Gemma 4's
    # sliding layers, which transformers holds (each at most its window of every row's columns)
    kv_bytes_before: int
    kv_bytes_after: int
    seconds: float
    # the most KV bytes the cache held at once while compressing: kv_bytes_before when the whole
    # prompt was prefilled first, one full layer plus the others' budgets when evicted in the prefill
    kv_bytes_peak: int | None = None

    def __repr__(self) -> str:
        layers, rows, heads = self.lengths_before.shape
        before, after = int(self.lengths_before.sum()), int(self.lengths_after.sum())
        kept = f"{100 * after / before:.1f}% kept" if before else "nothing held"
        return (
            f"CompressionReport({rows} row{'s' if rows != 1 else ''} x {layers} layers x {heads} KV heads: "
            f"{before} -> {after} tokens held, {kept}; KV {self.kv_bytes_before:,} -> {self.kv_bytes_after:,} bytes; "
            f"{self.seconds:.3f} s)"
        )

    __str__ = __repr__


@torch.no_grad()
def _start_decoding(cache: RaggedCache, plan: ServingPlan, evictor: HeadEvictor, context_lengths) -> None:
    """After the last eviction of a prompt: the plan's MomentKV correction and decode-time eviction
    switched on for every row; what only the compression read (recorded queries, chunked
    attention) dropped unless decode-time eviction reads it."""
    first = cache.attention_layers[0]
    windows = [layer.window for layer in cache.attention_layers]
    chunks = [layer.attention_chunk for layer in cache.attention_layers]
    for b in range(first.batch_size):
        if plan.corrections is not None:
            cache.set_correction(*plan.corrections, rows=[b])
        if first.real_seen[b] > 0:
            length = first.real_seen[b] if context_lengths is None else int(context_lengths[b])
            budgets = plan.decode_budgets(length, windows, chunks)
            if budgets is not None:  # held to its budgets, cut back once a head holds evict_every more
                cache.set_decode_plan(DecodePlan(evictor, budgets, int(plan.policy.evict_every), b), row=b)
    if not plan.decoding_observes:
        cache.stop_observing()


@torch.no_grad()
def prefill_and_compress(
    model, cache: RaggedCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, plan: ServingPlan
) -> CompressionReport:
    """:func:`prefill` of ``input_ids [B, T]`` into the empty ``cache`` and :func:`compress` under
    ``plan`` in one forward pass: every layer is evicted to its budgets right after its attention
    (as kvpress's forward hooks do) and repacked, so at most one layer's full cache exists at a
    time instead of the whole model's.  Keeps exactly what prefill-then-compress keeps (a layer's
    forward never reads another layer's cache; ``tests/test_prefill_eviction.py``).  ``plan``
    must satisfy :attr:`~runtime.plan.serving_plan.ServingPlan.evicts_in_prefill`.  The report's
    ``seconds`` are the evictions' own."""
    if not plan.evicts_in_prefill:
        raise ValueError(f"{plan.policy.describe()} cannot evict inside the prefill: prefill, then compress()")
    if cache.attention_layers[0].is_initialized:
        raise ValueError("prefill_and_compress needs an empty cache (a later chunk: prefill, then compress())")
    batch, num_layers = input_ids.shape[0], plan.num_layers
    budgets = np.zeros((batch, num_layers, plan.num_kv_heads), dtype=np.int64)
    lengths_before = np.zeros((num_layers, batch, plan.num_kv_heads), dtype=np.int64)
    evictor = HeadEvictor(plan)
    # (real tokens, window, attention chunk) -> [L, Hkv] budgets under them
    tables: dict[tuple[int, int | None, int | None], np.ndarray] = {}
    # the layers before this one hold their budgets (compressed), this one its whole chunk
    spent = {"seconds": 0.0, "bytes_before": 0, "compressed": 0, "peak": 0}
    observes = plan.decoding_observes

    def evict(layer) -> None:
        started = time.perf_counter()
        index = layer.layer_idx
        if plan.policy.tracks_moments:
            layer.track_moments()
        lengths_before[index] = np.asarray(layer.length)
        full = layer.kv_bytes()
        spent["bytes_before"] += full
        spent["peak"] = max(spent["peak"], spent["compressed"] + full)
        rows = [b for b in range(layer.batch_size) if layer.real_seen[b] > 0]  # an all-padding row holds nothing
        for b in rows:
            key = (layer.real_seen[b], layer.window, layer.attention_chunk)
            if key not in tables:  # a layer's budgets depend on its own window and chunk only: give every layer these
                tables[key] = plan.head_budgets(
                    layer.real_seen[b], [layer.window] * num_layers, [layer.attention_chunk] * num_layers
                )
            budgets[b, index] = tables[key][index]
        with label("kvcal.eviction"):  # the scores' NaN check read back once, after the prefill
            evictor.evict_layer(
                layer, index, rows, budgets[rows, index], [layer.real_seen[b] for b in rows], defer_check=True
            )
        if not observes:  # what only this layer's scoring read goes now, not at the end of the prefill
            layer.stop_observing()
        layer.compact()
        spent["compressed"] += layer.kv_bytes()
        spent["seconds"] += time.perf_counter() - started

    with evicting_each_layer(model, cache, evict):
        prefill(model, cache, input_ids, attention_mask, policy=plan)
    evictor.check_deferred()
    _start_decoding(cache, plan, evictor, None)
    return CompressionReport(
        budgets=budgets,
        lengths_before=lengths_before,
        lengths_after=cache.head_lengths().numpy(),
        kv_bytes_before=spent["bytes_before"],
        kv_bytes_after=cache.kv_bytes(),
        seconds=spent["seconds"],
        kv_bytes_peak=spent["peak"],
    )


def compress(
    model,
    cache: RaggedCache,
    policy: CompressionPolicy | ServingPlan,
    calibration=None,
    prompt_stats: QueryMoments | None = None,
    *,
    context_lengths: list[int] | None = None,
    final: bool = True,
    scores: list[torch.Tensor] | None = None,
) -> CompressionReport:
    """Evict every KV head of ``cache`` down to its budget (see the module docstring).

    ``policy``: a :class:`ServingPlan`, or a policy bound here to ``calibration``
    (:func:`runtime.plan.serving_plan.bind`).  Budgets are computed for each batch element's real
    token count, or for ``context_lengths[b]`` when given (block-wise prefill: the whole
    context's budget applied after every block).  ``final=False`` keeps recording the last
    queries for later blocks.  With ``final``, the policy's MomentKV correction and decode-time
    eviction are switched on for the generation that follows; while decoding, a head is held to
    its budget for a context of ``max(prompt length, policy.budget)`` tokens (a ratio policy: the
    prompt's).

    ``scores``: :func:`score_layers` of an identical cache (a copy of the same prefill) under a plan
    with the same :meth:`~runtime.plan.policy.CompressionPolicy.scores_key`, computed once for several
    policies instead of once each (the evaluation does this); the result is the same.
    """
    started = time.perf_counter()
    if policy is None:
        raise ValueError("compress() needs a policy or a ServingPlan (prefill alone keeps the full cache)")
    plan = as_plan(policy, calibration, model)
    policy = plan.policy
    evictor = HeadEvictor(plan, prompt_stats)
    first = cache.attention_layers[0]
    if not first.is_initialized:
        raise ValueError("the cache is empty: prefill it before compressing")
    if len(cache.attention_layers) != plan.num_layers:
        raise ValueError(f"cache has {len(cache.attention_layers)} layers, the model {plan.num_layers}")
    if first.num_heads != plan.num_kv_heads:
        raise ValueError(f"cache has {first.num_heads} KV heads, the model {plan.num_kv_heads}")
    if recent_query_window(plan.scorer) and any(  # a row that has seen no token yet (a padded block) has none
        row.real_seen and row.recent_queries is None for layer in cache.attention_layers for row in layer.rows
    ):
        raise ValueError(f"{plan.scorer!r} needs the last prompt queries: prefill with policy=... first")
    for spec in chunk_specs(plan.scorer):
        if any(
            row.real_seen and (row.chunk_attention is None or spec not in row.chunk_attention)
            for layer in cache.attention_layers
            for row in layer.rows
        ):
            raise ValueError(f"{plan.scorer!r} needs the prompt's chunked attention: prefill with policy=... first")
    if context_lengths is not None and len(context_lengths) != first.batch_size:
        raise ValueError(f"context_lengths has {len(context_lengths)} entries for a batch of {first.batch_size}")
    if policy.tracks_moments:
        cache.track_moments()

    lengths_before = cache.head_lengths().numpy()
    bytes_before = cache.kv_bytes()
    num_layers, num_kv_heads = plan.num_layers, plan.num_kv_heads
    all_budgets = np.zeros((first.batch_size, num_layers, num_kv_heads), dtype=np.int64)
    rows = [b for b in range(first.batch_size) if first.real_seen[b] > 0]  # an all-padding row holds nothing
    next_positions = [first.real_seen[b] for b in rows]  # each row's next absolute position
    windows = [layer.window for layer in cache.attention_layers]  # sliding-window layers: budgets of what they hold
    chunks = [layer.attention_chunk for layer in cache.attention_layers]  # chunked layers: likewise
    for b in rows:
        budget_length = first.real_seen[b] if context_lengths is None else max(int(context_lengths[b]), 1)
        all_budgets[b] = plan.head_budgets(budget_length, windows, chunks)
    if scores is not None:
        _check_shared_scores(scores, cache, rows)
    with label("kvcal.eviction"):
        if policy.allocation == "global" and rows:  # one ranking of every head's tokens shares out the total
            if scores is None:
                scores = score_layers(cache, evictor, rows, next_positions)
            for i, b in enumerate(rows):
                per_head = [
                    [layer_scores[i, h, : int(cache.attention_layers[index].length[b, h])] for h in range(num_kv_heads)]
                    for index, layer_scores in enumerate(scores)
                ]
                all_budgets[b] = global_budgets(per_head, int(all_budgets[b].sum()), policy.n_sink, policy.window)
        for index, layer in enumerate(cache.attention_layers):
            evictor.evict_layer(
                layer,
                index,
                rows,
                all_budgets[rows, index],
                next_positions,
                scores=None if scores is None else scores[index],
                defer_check=True,  # one read of every layer's NaN check, below
            )
        evictor.check_deferred()
    cache.compact()  # one repack per layer releases what eviction freed
    if final:
        _start_decoding(cache, plan, evictor, context_lengths)
    return CompressionReport(
        budgets=all_budgets,
        lengths_before=lengths_before,
        lengths_after=cache.head_lengths().numpy(),
        kv_bytes_before=bytes_before,
        kv_bytes_after=cache.kv_bytes(),
        seconds=time.perf_counter() - started,
        kv_bytes_peak=bytes_before,
    )
