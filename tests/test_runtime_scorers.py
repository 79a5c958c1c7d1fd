"""Scorers against direct implementations of their definitions (docs/design.md sections 1-2)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from scorer_oracles import Head, attention_one, head_from_cache, layer_inputs, oracle_score, score_one
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from runtime import CompressionPolicy, RaggedCache
from runtime.compression.keep_rule import keep_mask, select_rows
from runtime.compression.prefill import compress, prefill
from runtime.math.rope import averaged_rope, rope_cos_sin, rope_matrix
from runtime.plan.calibration import Calibration
from runtime.scorers import (
    SCORERS,
    ExpectedAttentionScorer,
    KeyDiffScorer,
    KNormScorer,
    SnapKVScorer,
    StreamingScorer,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def explicit_rope(position: int, head_dim: int, theta: float) -> torch.Tensor:
    """``R_p [d, d]`` built pair by pair: (i, i + d/2) rotated by ``p * theta^(-2i/d)`` (float64)."""
    half = head_dim // 2
    matrix = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for i in range(half):
        angle = position * theta ** (-2.0 * i / head_dim)
        c, s = math.cos(angle), math.sin(angle)
        matrix[i, i], matrix[i, i + half] = c, -s
        matrix[i + half, i], matrix[i + half, i + half] = s, c
    return matrix


def direct_expected_attention(
    keys, values, mean, cov, start, horizon, theta, scaling, epsilon=ExpectedAttentionScorer.DEFAULT_EPSILON
):
    """docs/design.md section 1 written out: explicit RoPE matrices, per-head softmax, group mean."""
    d = keys.shape[1]
    rbar = sum(explicit_rope(p, d, theta) for p in range(start, start + horizon)) / horizon
    keys, values = keys.double(), values.double()
    per_head = []
    for g in range(mean.shape[0]):
        mu = rbar @ mean[g].double()
        sigma = rbar @ cov[g].double() @ rbar.T
        z = torch.stack([scaling * mu @ k + 0.5 * scaling**2 * k @ sigma @ k for k in keys])
        per_head.append(torch.softmax(z, dim=0))
    attention = torch.stack(per_head).mean(0)
    return (attention + epsilon) * values.norm(dim=-1)


def random_stats(groups: int, d: int, generator: torch.Generator):
    mean = torch.randn(groups, d, generator=generator)
    factor = torch.randn(groups, d, d, generator=generator) / math.sqrt(d)
    return mean, factor @ factor.transpose(-1, -2)


def test_rope_matrix_matches_transformers_rotation():
    model = make_tiny_llama(head_dim=16)
    query = torch.randn(1, 1, 3, 16, dtype=torch.float32)
    positions = torch.tensor([0, 7, 123])
    cos, sin = rope_cos_sin(model, positions)
    rotated, _ = apply_rotary_pos_emb(query, query, cos[None], sin[None])
    theta = model.config.rope_parameters["rope_theta"]
    for row, position in enumerate(positions.tolist()):
        explicit = explicit_rope(position, 16, theta).float()
        torch.testing.assert_close(rotated[0, 0, row], explicit @ query[0, 0, row], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rope_matrix(cos[row], sin[row]), explicit, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("start", [0, 37, 1000])
def test_expected_attention_equals_direct_formula_with_gqa(start):
    model = make_tiny_llama(head_dim=16)
    theta = model.config.rope_parameters["rope_theta"]
    generator = torch.Generator().manual_seed(start)
    n, d, groups, horizon = 30, 16, 3, 24
    keys, values = torch.randn(n, d, generator=generator) * 2, torch.randn(n, d, generator=generator)
    mean, cov = random_stats(groups, d, generator)
    cos, sin = averaged_rope(model, start, horizon)
    scorer = ExpectedAttentionScorer(horizon=horizon, epsilon=0.01)
    head = Head(
        layer=0,
        kv_head=0,
        keys=keys,
        values=values,
        positions=torch.arange(n),
        scaling=d**-0.5,
        next_position=start,
        query_mean=mean,
        query_cov=cov,
        rope_cos=cos,
        rope_sin=sin,
    )
    expected = direct_expected_attention(keys, values, mean, cov, start, horizon, theta, d**-0.5, epsilon=0.01)
    torch.testing.assert_close(score_one(scorer, head).double(), expected, rtol=1e-4, atol=1e-7)


def test_expected_attention_pool_takes_the_neighbourhood_maximum():
    model = make_tiny_llama(head_dim=16)
    generator = torch.Generator().manual_seed(8)
    n, d = 25, 16
    keys, values = torch.randn(n, d, generator=generator) * 2, torch.randn(n, d, generator=generator)
    mean, cov = random_stats(2, d, generator)
    cos, sin = averaged_rope(model, 100, 16)
    head = Head(0, 0, keys, values, torch.arange(n), d**-0.5, 100, mean, cov, cos, sin)
    plain = attention_one(ExpectedAttentionScorer(horizon=16), head)
    pooled = attention_one(ExpectedAttentionScorer(horizon=16, pool=5), head)
    expected = torch.stack([plain[max(i - 2, 0) : i + 3].max() for i in range(n)])  # naive loop
    torch.testing.assert_close(pooled, expected)
    torch.testing.assert_close(
        score_one(ExpectedAttentionScorer(horizon=16, pool=5), head), (expected + 1e-2) * values.norm(dim=-1)
    )
    with pytest.raises(ValueError, match="pool"):
        ExpectedAttentionScorer(pool=4)


def test_expected_attention_anchors_rope_at_the_absolute_position():
    """Averaging from position 0 (the chunk-length bug) gives different scores than from t0."""
    model = make_tiny_llama(head_dim=16)
    theta = model.config.rope_parameters["rope_theta"]
    generator = torch.Generator().manual_seed(5)
    keys, values = torch.randn(40, 16, generator=generator) * 3, torch.randn(40, 16, generator=generator)
    mean, cov = random_stats(2, 16, generator)
    scorer = ExpectedAttentionScorer(horizon=8)

    def scores(start):
        cos, sin = averaged_rope(model, start, 8)
        return score_one(scorer, Head(0, 0, keys, values, torch.arange(40), 0.25, start, mean, cov, cos, sin))

    at_t0 = scores(500)
    torch.testing.assert_close(
        at_t0.double(), direct_expected_attention(keys, values, mean, cov, 500, 8, theta, 0.25), rtol=1e-4, atol=1e-7
    )
    assert not torch.allclose(at_t0, scores(0), rtol=1e-2)


def test_keydiff_knorm_streaming_match_definitions():
    generator = torch.Generator().manual_seed(1)
    keys, values = torch.randn(20, 8, generator=generator), torch.randn(20, 8, generator=generator)
    head = Head(0, 0, keys, values, torch.arange(100, 120), 8**-0.5, 120)
    unit = keys.double() / keys.double().norm(dim=-1, keepdim=True)
    anchor = unit.mean(0)
    expected = -(keys.double() @ anchor) / (keys.double().norm(dim=-1) * anchor.norm())
    torch.testing.assert_close(score_one(KeyDiffScorer(), head).double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(score_one(KNormScorer(), head), -keys.norm(dim=-1))
    rows = select_rows(score_one(StreamingScorer(), head), budget=6, n_sink=2, window=1)
    assert rows.tolist() == [0, 1, 16, 17, 18, 19]


def test_snapkv_equals_loop_reference():
    generator = torch.Generator().manual_seed(2)
    n, d, groups, window = 25, 8, 2, 4
    keys, values = torch.randn(n, d, generator=generator), torch.randn(n, d, generator=generator)
    queries = torch.randn(groups, window, d, generator=generator)
    positions = torch.arange(n)
    head = Head(0, 0, keys, values, positions, d**-0.5, n, recent_queries=queries)
    scores = score_one(SnapKVScorer(window=window, kernel=3), head)
    summed = torch.zeros(n, dtype=torch.float64)
    for g in range(groups):
        for w in range(window):
            query_position = n - window + w
            logits = torch.tensor(
                [float(queries[g, w] @ keys[i]) * d**-0.5 if i <= query_position else -math.inf for i in range(n)],
                dtype=torch.float64,
            )
            summed += torch.softmax(logits, dim=0) / groups
    pooled = torch.stack([summed[max(0, i - 1) : i + 2].mean() for i in range(n)])
    torch.testing.assert_close(scores.double(), pooled, rtol=1e-5, atol=1e-7)


def test_select_rows_keeps_sinks_then_window_then_top_scores():
    scores = torch.tensor([0.0, 0.0, 5.0, 1.0, 9.0, 2.0, 0.0, 0.0])
    assert select_rows(scores, 5, n_sink=1, window=2).tolist() == [0, 2, 4, 6, 7]
    assert select_rows(scores, 8, n_sink=1, window=2).tolist() == list(range(8))
    assert select_rows(scores, 2, n_sink=1, window=4).tolist() == [0, 7]  # sinks first, then most recent
    assert select_rows(scores, 1, n_sink=3, window=4).tolist() == [0]


def test_compress_applies_expected_attention_with_sink_and_window_rules_per_row():
    """Through the real engine: kept positions = sinks + window + top direct-EA scores, per row
    of a left-padded batch, with RoPE averaged from each row's own next position."""
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    theta = model.config.rope_parameters["rope_theta"]
    generator = torch.Generator().manual_seed(3)
    layers, heads, d = 2, 4, 16
    mean = torch.randn(layers, heads, d, generator=generator)
    factor = torch.randn(layers, heads, d, d, generator=generator) / 4
    cov = factor @ factor.transpose(-1, -2)
    calibration = Calibration(
        path=Path("memory"),
        identity=None,
        config={},
        sections=("query_stats",),
        query_mean=mean.numpy(),
        query_cov=cov.numpy(),
    )
    ids = torch.randint(0, 128, (2, 40), generator=generator)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :9] = 0  # row 0 has 31 real tokens
    horizon, budget, n_sink, window = 16, 12, 2, 3
    policy = CompressionPolicy(
        budget=budget, scorer="expected_attention", n_sink=n_sink, window=window, scorer_options={"horizon": horizon}
    )
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids, mask, policy=policy)
    before = [
        [[tensor.clone() for tensor in layer.head(b, h)] for h in range(2) for b in range(2)] for layer in cache.layers
    ]
    compress(model, cache, policy, calibration)
    for layer_idx, layer in enumerate(cache.layers):
        for b in range(2):
            real = int(mask[b].sum())
            for h in range(2):
                keys, values, positions = before[layer_idx][h * 2 + b]
                assert positions.tolist() == list(range(real))
                expected = direct_expected_attention(
                    keys,
                    values,
                    mean[layer_idx, 2 * h : 2 * h + 2],
                    cov[layer_idx, 2 * h : 2 * h + 2],
                    real,
                    horizon,
                    theta,
                    d**-0.5,
                )
                middle = expected[n_sink : real - window]
                top = (torch.topk(middle, budget - n_sink - window).indices + n_sink).tolist()
                wanted = sorted(list(range(n_sink)) + top + list(range(real - window, real)))
                assert layer.head(b, h)[2].tolist() == wanted


def test_scorer_extension_point_is_one_small_class():
    class OldestFirst(StreamingScorer):
        name = "oldest"

        def score(self, inputs):
            return (-inputs.positions.float()).masked_fill(~inputs.valid, float("-inf"))

    model = make_tiny_llama()
    cache = RaggedCache.for_model(model)
    policy = CompressionPolicy(budget=5, scorer=OldestFirst(), n_sink=0, window=1)
    prefill(model, cache, torch.arange(20).unsqueeze(0), policy=policy)
    compress(model, cache, policy)
    assert cache.layers[1].head(0, 1)[2].tolist() == [0, 1, 2, 3, 19]
    assert np.all(cache.head_lengths().numpy() == 5)


def test_a_registered_scorer_is_served_by_name(monkeypatch):
    """A new scorer is one class (one module of runtime/scorers/) plus its registration: here a
    scorer that keeps the keys of the largest norm (the opposite of knorm), registered from this
    file for the test and removed after it."""
    from runtime.scorers import Scorer, make_scorer

    class LargestKeys(Scorer):
        name = "largest_keys"

        def score(self, inputs):
            return inputs.keys.float().norm(dim=-1).masked_fill(~inputs.valid, float("-inf"))  # [R, Hkv, n]

    monkeypatch.setitem(SCORERS, LargestKeys.name, LargestKeys)
    assert isinstance(make_scorer("largest_keys"), LargestKeys)
    model = make_tiny_llama()
    cache = RaggedCache.for_model(model)
    policy = CompressionPolicy(budget=6, scorer="largest_keys", n_sink=1, window=1)
    prefill(model, cache, torch.arange(20).unsqueeze(0), policy=policy)
    before = [[layer.head(0, h) for h in range(2)] for layer in cache.layers]
    before = [[tuple(t.clone() for t in head) for head in layer] for layer in before]
    compress(model, cache, policy)
    for layer_idx, layer in enumerate(cache.layers):
        for h in range(2):
            keys, _, positions = before[layer_idx][h]
            want = select_rows(keys.float().norm(dim=-1), 6, n_sink=1, window=1)
            assert layer.head(0, h)[2].tolist() == positions[want].tolist()


@torch.no_grad()
@pytest.mark.parametrize(
    "scorer,options",
    [
        ("expected_attention", {"statistics": "prompt", "scorer_options": {"pool": 3}}),
        ("keydiff", {}),
        ("knorm", {}),
        ("streaming", {}),
        ("snapkv", {}),
        ("leverage", {}),
        ("leverage", {"scorer_options": {"chunk": 8, "blend": 0.5, "sketch": None}}),  # many chunks, exact
        ("leverage", {"scorer_options": {"blend": None}}),  # leverage alone
    ],
)
def test_layer_scores_equal_the_per_head_oracles(scorer, options):
    """One batched call per layer scores every row and head as the per-head definition
    (tests/scorer_oracles.py, its inputs taken from their sources directly) does: two left-padded
    rows of different lengths, after a first eviction left the heads ragged."""
    from runtime.compression.eviction import HeadEvictor
    from runtime.plan.serving_plan import bind

    model = make_tiny_llama(num_layers=2, num_heads=6, num_kv_heads=3)
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 128, (2, 48), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    policy = CompressionPolicy(keep_ratio=0.5, scorer=scorer, **options)
    cache = RaggedCache.for_model(model)
    stats = prefill(model, cache, ids, mask, policy=policy, record_prompt_stats=True, observe_queries=48)
    evictor = HeadEvictor(bind(policy, None, model), stats)
    positions = cache.layers[0].real_seen
    prompt = cache.copy()  # as prefilled: leverage's chunked attention is the whole prompt's
    for index, layer in enumerate(cache.layers):  # ragged heads: cut each head to its own length
        cut = torch.tensor([[40, 31, 44], [35, 39, 22]])
        evictor.evict_layer(layer, index, [0, 1], cut, positions)
    for index, layer in enumerate(cache.layers):
        assert len(set(layer.length.reshape(-1).tolist())) > 2
        batched = evictor.layer_scores(layer, index, [0, 1], positions)
        for b in range(2):
            for h in range(3):
                head = head_from_cache(
                    evictor.scorer,
                    model,
                    layer,
                    index,
                    b,
                    h,
                    positions[b],
                    prompt_stats=stats,
                    prompt_layer=prompt.layers[index],
                )
                single = oracle_score(evictor.scorer, head)
                n = single.shape[0]
                torch.testing.assert_close(batched[b, h, :n], single.float(), atol=1e-5, rtol=1e-4)
                assert bool(torch.isneginf(batched[b, h, n:]).all())  # padding never competes


def _tied_heads(generator, rows=2, heads=2, d=8, group=2):
    """Heads of different lengths (so padded) whose keys and values repeat: many tied scores.  The
    artifact's per-head inputs (learned weights, query centres) are the same in every row."""
    learned = [(torch.randn(2 * d, generator=generator), 0.5 * h) for h in range(heads)]
    centres = [torch.randn(group, 3, d, generator=generator) for _ in range(heads)]
    out = []
    for r in range(rows):
        row = []
        for h in range(heads):
            n = (9, 14, 11, 6)[(2 * r + h) % 4]
            distinct = torch.randn(4, d, generator=generator)
            pick = torch.randint(0, 4, (n,), generator=generator)
            keys, values = distinct[pick], distinct.flip(0)[pick]
            head = Head(1, h, keys, values, torch.arange(20 - n, 20), d**-0.5, 20)
            head.query_mean = torch.randn(group, d, generator=generator)
            head.query_cov = torch.eye(d).expand(group, d, d) * 0.1
            head.rope_cos, head.rope_sin = torch.ones(d), torch.zeros(d)  # RoPE at position 0: the identity
            head.recent_queries = torch.randn(group, 20, d, generator=generator)
            head.key_cos, head.key_sin = torch.ones(n, d), torch.zeros(n, d)
            head.learned_weights, head.learned_bias = learned[h]
            head.query_centres = centres[h]
            head.centre_weights = torch.full((group, 3), 1 / 3)
            row.append(head)
        out.append(row)
    return out


@pytest.mark.parametrize(
    "scorer",
    [
        ExpectedAttentionScorer(statistics="prompt", horizon=4, pool=3),
        SCORERS["prototype_attention"](centres="mean", group="mean"),
        KeyDiffScorer(),
        KNormScorer(),
        StreamingScorer(),
        SnapKVScorer(window=6, kernel=3),
        SCORERS["leverage"](exclude_first=2, exclude_last=1, chunk=4, sketch=None, ridge=1e-3),
        SCORERS["learned"](),
    ],
    ids=repr,
)
def test_batched_scores_equal_the_oracles_with_ties_and_padding(scorer):
    """Hand-made heads with repeated keys (tied scores) and different lengths (padded rows): the
    batched scores equal the per-head oracle, padding is -inf, and the selection's kept rows are
    the same from either (ties go to the newer token both ways)."""
    heads = _tied_heads(torch.Generator().manual_seed(21))
    inputs = layer_inputs(scorer, heads)
    batched = scorer.score(inputs)  # [R, Hkv, n]
    assert batched.shape == inputs.valid.shape
    budgets = torch.tensor([[5, 7], [3, 4]])
    keep = keep_mask(batched, inputs.valid, budgets, n_sink=1, window=2)
    tied = False
    for r, row in enumerate(heads):
        for h, head in enumerate(row):
            single = oracle_score(scorer, head).float()
            n = single.shape[0]
            torch.testing.assert_close(batched[r, h, :n], single, atol=1e-5, rtol=1e-4)
            assert bool(torch.isneginf(batched[r, h, n:]).all())
            tied = tied or len(set(single.tolist())) < n
            kept = select_rows(single, int(budgets[r, h]), n_sink=1, window=2)
            assert keep[r, h].nonzero().squeeze(1).tolist() == kept.tolist(), (r, h)
    assert tied or isinstance(scorer, StreamingScorer | SnapKVScorer)


def test_keep_mask_equals_select_rows_per_head():
    generator = torch.Generator().manual_seed(12)
    lengths = torch.tensor([[30, 17, 1], [0, 25, 30]])
    budgets = torch.tensor([[12, 20, 1], [3, 4, 7]])
    scores = torch.rand(2, 3, 30, generator=generator)  # distinct: no ties
    valid = torch.arange(30) < lengths.unsqueeze(-1)
    for n_sink, window in ((0, 0), (2, 3), (4, 32)):
        keep = keep_mask(scores, valid, budgets, n_sink, window)
        for b in range(2):
            for h in range(3):
                n = int(lengths[b, h])
                expected = select_rows(scores[b, h, :n], int(budgets[b, h]), n_sink, window).tolist()
                assert keep[b, h].nonzero().squeeze(1).tolist() == expected, (b, h, n_sink, window)


def test_every_scorer_is_one_small_module_and_one_registration_line():
    """runtime/scorers/: one module per registered scorer, defining it; no module over 250 lines."""
    import importlib

    from runtime.scorers import registry

    package = Path(registry.__file__).parent
    for module, klass in registry.REGISTERED:
        scorer = getattr(importlib.import_module(f"runtime.scorers.{module}"), klass)
        assert SCORERS[scorer.name] is scorer
    assert len(SCORERS) == len(registry.REGISTERED)
    for source in package.glob("*.py"):
        assert len(source.read_text().splitlines()) <= 250, source.name
