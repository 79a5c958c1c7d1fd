"""The keep rule (runtime.compression.keep_rule) against a per-head Python loop, on scores WITH ties, and the
calibration stages (moments, budget curves) selecting exactly what serving selects on tied scores."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from runtime import CompressionPolicy, RaggedCache
from runtime.compression.keep_rule import (
    global_budgets,
    global_counts,
    keep_mask,
    priority_ranks,
    protected_mask,
    select_rows,
)
from runtime.compression.prefill import compress, prefill
from runtime.math.momentkv import MomentSums
from runtime.scorers import LayerInputs, Scorer, ScorerInputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

INF = float("inf")
SINK_WINDOWS = [(0, 0), (0, 3), (2, 0), (3, 4), (25, 2), (2, 25)]


# -- the reference: one head at a time, in plain Python -----------------------------------------


def reference_order(scores: list[float], n_sink: int, window: int) -> list[int]:
    """A head's rows, first kept first: sinks (oldest first), window (newest first), then the rest
    by (score descending, later row first)."""
    n = len(scores)
    sinks = min(n_sink, n)
    recent = min(window, n - sinks)
    middle = sorted(range(sinks, n - recent), key=lambda i: (-scores[i], -i))
    return list(range(sinks)) + list(range(n - 1, n - recent - 1, -1)) + middle


def reference_fixed(n: int, n_sink: int, window: int) -> int:
    """How many of a head's rows are sinks or window rows."""
    sinks = min(n_sink, n)
    return sinks + min(window, n - sinks)


def tied_scores(generator: torch.Generator, shape, kind: str) -> torch.Tensor:
    if kind == "small-integers":
        return torch.randint(0, 3, shape, generator=generator).float()
    if kind == "all-equal":
        return torch.full(shape, 0.5)
    if kind == "underflow":  # exp of very negative logits: exact zeros (both signs) and -inf
        choice = torch.randint(0, 5, shape, generator=generator)
        values = torch.tensor([0.0, -0.0, -INF, 1e-30, 2.0])
        return values[choice]
    if kind == "distinct":
        return torch.rand(shape, generator=generator)
    raise ValueError(kind)


KINDS = ["small-integers", "all-equal", "underflow", "distinct"]


def seed(*parameters) -> int:
    """A generator seed from a test's parameters (hash() of a str changes between runs)."""
    return zlib.crc32(repr(parameters).encode())


def ragged(generator: torch.Generator, rows: int, heads: int, size: int):
    lengths = torch.randint(0, size + 1, (rows, heads), generator=generator)
    lengths[0, 0], lengths[-1, -1] = 0, size  # an empty head and a full one
    valid = torch.arange(size) < lengths.unsqueeze(-1)  # [R, Hkv, T]
    return lengths, valid


# -- the rule itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_sink, window", SINK_WINDOWS)
def test_priority_ranks_equal_the_per_head_loop_on_tied_scores(kind, n_sink, window):
    generator = torch.Generator().manual_seed(seed(kind, n_sink, window))
    rows, heads, size = 3, 4, 20
    lengths, valid = ragged(generator, rows, heads, size)
    scores = tied_scores(generator, (rows, heads, size), kind)
    ranks = priority_ranks(scores, valid, n_sink, window)
    assert ranks.dtype == torch.int64 and ranks.shape == (rows, heads, size)
    for r, h in itertools.product(range(rows), range(heads)):
        n = int(lengths[r, h])
        order = reference_order(scores[r, h, :n].tolist(), n_sink, window)
        want = list(range(size))  # padding: its own row index (>= n, never kept)
        for place, row in enumerate(order):
            want[row] = place
        assert ranks[r, h].tolist() == want, (r, h, n)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_sink, window", SINK_WINDOWS)
def test_keep_mask_select_rows_and_protected_mask_equal_the_loop_at_every_kind_of_budget(kind, n_sink, window):
    generator = torch.Generator().manual_seed(seed(kind, n_sink, window, 1))
    rows, heads, size = 2, 5, 24
    lengths, valid = ragged(generator, rows, heads, size)
    scores = tied_scores(generator, (rows, heads, size), kind)
    fixed = [[reference_fixed(int(lengths[r, h]), n_sink, window) for h in range(heads)] for r in range(rows)]
    cases = {  # budget per head: 0, below the sinks, among the fixed rows, in the middle, == n, > n, < 0
        "zero": lambda n, f: 0,
        "below-sinks": lambda n, f: min(n_sink, n) // 2,
        "inside-fixed": lambda n, f: (min(n_sink, n) + f + 1) // 2,
        "middle": lambda n, f: (f + n + 1) // 2,
        "length": lambda n, f: n,
        "above": lambda n, f: n + 3,
        "negative": lambda n, f: -2,
    }
    for name, rule in cases.items():
        budgets = torch.tensor(
            [[rule(int(lengths[r, h]), fixed[r][h]) for h in range(heads)] for r in range(rows)], dtype=torch.int64
        )
        keep = keep_mask(scores, valid, budgets, n_sink, window)
        protected = protected_mask(valid, budgets, n_sink, window)
        for r, h in itertools.product(range(rows), range(heads)):
            n, budget = int(lengths[r, h]), int(budgets[r, h])
            order = reference_order(scores[r, h, :n].tolist(), n_sink, window)
            kept = sorted(order[: max(budget, 0)])
            assert keep[r, h].nonzero().reshape(-1).tolist() == kept, (name, r, h)
            assert select_rows(scores[r, h, :n], budget, n_sink, window).tolist() == kept, (name, r, h)
            protected_rows = sorted(order[: max(min(budget, fixed[r][h]), 0)])
            assert protected[r, h].nonzero().reshape(-1).tolist() == protected_rows, (name, r, h)


def test_one_head_shapes_and_empty_inputs():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert priority_ranks(scores, None, 1, 2).tolist() == [0, 5, 4, 3, 2, 1]  # the later row first
    assert select_rows(scores, 4, 1, 2).tolist() == [0, 3, 4, 5]
    assert select_rows(torch.zeros(0), 3, 4, 32).tolist() == []
    assert protected_mask(torch.ones(6, dtype=torch.bool), 2, 1, 2).tolist() == [True] + [False] * 4 + [True]
    assert keep_mask(torch.zeros(2, 3, 0), torch.zeros(2, 3, 0, dtype=torch.bool), torch.ones(2, 3), 4, 32).shape == (
        2,
        3,
        0,
    )


def test_priority_ranks_are_nested_keep_sets():
    """``rank < b`` for every b: each budget keeps what the previous kept plus one row."""
    generator = torch.Generator().manual_seed(5)
    scores = tied_scores(generator, (40,), "small-integers")
    ranks = priority_ranks(scores, None, 3, 5)
    assert sorted(ranks.tolist()) == list(range(40))
    for budget in range(41):
        assert select_rows(scores, budget, 3, 5).tolist() == torch.nonzero(ranks < budget).reshape(-1).tolist()


# -- global allocation ---------------------------------------------------------------------------


def reference_global(scores: list[list[list[float]]], total: int, n_sink: int, window: int) -> np.ndarray:
    """One order over every head's rows: fixed rows by (rank in head, newest, head), then the rest
    by (score descending, newest row, head)."""
    entries = []
    heads = len(scores[0])
    for layer, row in enumerate(scores):
        for h, values in enumerate(row):
            flat = layer * heads + h
            n = len(values)
            order = reference_order(values, n_sink, window)
            fixed = reference_fixed(n, n_sink, window)
            for place, i in enumerate(order):
                if place < fixed:
                    entries.append(((0, place, 0.0, -i, flat), layer, h))
                else:
                    entries.append(((1, 0, -values[i], -i, flat), layer, h))
    entries.sort(key=lambda entry: entry[0])
    table = np.zeros((len(scores), heads), dtype=np.int64)
    for _, layer, h in entries[:total]:
        table[layer, h] += 1
    return table


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_sink, window", [(0, 0), (2, 3), (4, 32)])
def test_global_budgets_equal_one_ranking_over_all_heads_with_ties(kind, n_sink, window):
    generator = torch.Generator().manual_seed(seed(kind, n_sink, window, 2))
    lengths = [[30, 12, 0], [25, 40, 7]]
    scores = [[tied_scores(generator, (n,), kind) for n in row] for row in lengths]
    as_lists = [[head.tolist() for head in row] for row in scores]
    for total in (0, 3, 9, 50, 113, 114, 200):
        got = global_budgets(scores, total, n_sink, window)
        np.testing.assert_array_equal(got, reference_global(as_lists, total, n_sink, window), err_msg=str(total))
        assert got.sum() == min(total, 114)


def test_global_counts_keep_exactly_the_globally_best_rows_under_keep_mask():
    """The budgets of the global order, served per head by keep_mask, keep every row that the
    order chose and no other (the order restricted to a head is the head's own order)."""
    generator = torch.Generator().manual_seed(9)
    layers, heads, size, n_sink, window = 3, 2, 16, 2, 3
    lengths, valid = ragged(generator, layers, heads, size)
    scores = tied_scores(generator, (layers, heads, size), "small-integers")
    for total in (0, 5, 20, 40, int(lengths.sum())):
        counts = global_counts(scores, valid, total, n_sink, window)
        assert int(counts.sum()) == min(total, int(lengths.sum()))
        keep = keep_mask(scores, valid, counts, n_sink, window)
        as_lists = [[scores[i, h, : int(lengths[i, h])].tolist() for h in range(heads)] for i in range(layers)]
        np.testing.assert_array_equal(counts.numpy(), reference_global(as_lists, total, n_sink, window))
        assert torch.equal(keep.sum(-1), counts)


# -- calibration stages select what serving selects ----------------------------------------------


class TiedScorer(Scorer):
    """Scores in {-inf, -1, 0, 1} (many ties), different per head; attention() for moment eviction."""

    name = "tied"
    yields_attention = True

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        scores = torch.round(inputs.keys[..., 0].float() * 2).clamp(-1, 1)  # [R, Hkv, n]
        return scores.masked_fill(inputs.positions % 5 == 4, -INF).masked_fill(~inputs.valid, -INF)

    def attention(self, inputs: LayerInputs) -> torch.Tensor:
        return (torch.round(inputs.keys[..., 0].float() * 2).clamp(-1, 1) + 2) / 10


def _served(budget: int, n_sink: int, window: int, moment_eviction: bool = False):
    """The engine on a tiny Llama: per (layer, KV head) the post-RoPE keys / values of the prompt
    before compression and the rows the engine kept."""
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=3)
    ids = torch.randint(3, 120, (1, 30), generator=torch.Generator().manual_seed(4))
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids)
    if moment_eviction:
        cache.track_moments()
    before = [[[t.clone() for t in layer.head(0, h)] for h in range(2)] for layer in cache.layers]
    policy = CompressionPolicy(
        budget=budget, scorer=TiedScorer(), n_sink=n_sink, window=window, moment_eviction=moment_eviction
    )
    compress(model, cache, policy)
    kept = [[layer.head(0, h)[2].tolist() for h in range(2)] for layer in cache.layers]
    return model, before, kept


@pytest.mark.parametrize("budget", [1, 3, 7, 12, 20, 29])
def test_moments_and_budget_curves_stages_select_what_serving_selects_on_tied_scores(budget):
    from profiler.budget_curves import _CurveMeasurer
    from profiler.moments import _CorrectionErrorMeasurer
    from runtime.math.geometry import ModelGeometry

    n_sink, window = 2, 3
    model, before, served = _served(budget, n_sink, window)
    geometry = ModelGeometry.of(model)
    scorer = TiedScorer()
    moments = _CorrectionErrorMeasurer(2, 2, [0.5], 4, [ScorerInputs(scorer, geometry)], n_sink, window, False, 4, 0.0)
    curves = _CurveMeasurer(geometry, [0.5], scorer, n_sink, window)
    tied = False
    for layer in range(2):
        key = torch.stack([before[layer][h][0] for h in range(2)]).unsqueeze(0)  # [1, Hkv, T, d]
        value = torch.stack([before[layer][h][1] for h in range(2)]).unsqueeze(0)
        query = torch.zeros(1, 4, 30, 16)
        scale = geometry.scalings[layer]
        _, estimates = moments._heads(
            layer,
            torch.zeros(1, 4, 34, 16),
            torch.cat([key, key[:, :, :4]], 2),
            torch.cat([value, value[:, :, :4]], 2),
            scale,
        )  # the 30-token prefix's scores
        ranks = curves.layer_ranks(layer, query, key, value, 30, scale)  # [Hkv, 30]
        for h in range(2):
            keys, values, _ = before[layer][h]
            scores = estimates[0][h]  # the one keep ratio's scores [30]
            tied = tied or len(set(scores.tolist())) < len(scores)
            sums = MomentSums(2, 16)
            assert moments.kept_rows(h, keys, values, scale, scores, budget, sums).tolist() == served[layer][h], (
                layer,
                h,
            )
            assert torch.nonzero(ranks[h] < budget).reshape(-1).tolist() == served[layer][h], (layer, h)
    assert tied


@pytest.mark.parametrize("budget", [3, 6, 12])
def test_moment_eviction_in_calibration_protects_what_serving_protects(budget):
    """Moment-informed eviction: the sinks and window it never evicts depend on the budget in
    serving (a budget below sinks + window keeps fewer of them); calibration must protect the same."""
    from profiler.moments import _CorrectionErrorMeasurer
    from runtime.math.geometry import ModelGeometry

    n_sink, window = 4, 5
    model, before, served = _served(budget, n_sink, window, moment_eviction=True)
    geometry = ModelGeometry.of(model)
    scorer = TiedScorer()
    moments = _CorrectionErrorMeasurer(2, 2, [0.5], 4, [ScorerInputs(scorer, geometry)], n_sink, window, True, 4, 0.0)
    for layer in range(2):
        key = torch.stack([before[layer][h][0] for h in range(2)]).unsqueeze(0)  # [1, Hkv, 30, d]
        value = torch.stack([before[layer][h][1] for h in range(2)]).unsqueeze(0)
        scale = geometry.scalings[layer]
        _, estimates = moments._heads(
            layer,
            torch.zeros(1, 4, 34, 16),
            torch.cat([key, key[:, :, :4]], 2),
            torch.cat([value, value[:, :, :4]], 2),
            scale,
        )  # the prefix's attention
        for h in range(2):
            keys, values, _ = before[layer][h]
            kept = moments.kept_rows(h, keys, values, scale, estimates[0][h], budget, MomentSums(2, 16))
            assert kept.tolist() == served[layer][h], (layer, h)
            assert len(served[layer][h]) == budget
