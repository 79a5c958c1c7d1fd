"""Compactor's chunked attention accumulated inside the prefill (runtime.math.chunk_attention) against the
reference computed from every recorded prompt query (the way the profiler and the scorer did before)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from test_decode_sync import SyncCounter

from runtime import RaggedCache
from runtime.compression.prefill import prefill
from runtime.math.chunk_attention import ChunkAttention, ChunkSpec, chunk_mass
from runtime.math.geometry import ModelGeometry
from runtime.scorers import ALL_QUERIES, ChunkAttentionMass, LeverageScorer, ScorerInputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _both_ways(model, cache: RaggedCache, spec: ChunkSpec):
    """Per layer, ``(accumulated, from recorded queries)`` masses ``[R, Hkv, n]`` of every row."""
    scorer = LeverageScorer(
        chunk=spec.chunk, exclude_first=spec.first, exclude_last=spec.last, attention_scale=spec.scale
    )
    need = ChunkAttentionMass(scorer.chunk_spec)
    inputs = ScorerInputs(scorer, ModelGeometry.of(model))
    out = []
    for index, layer in enumerate(cache.layers):
        rows = list(range(layer.batch_size))
        keys, values, positions, valid = layer.padded_rows(rows)
        base = (index, keys, values, positions, valid, layer.length[rows], layer.real_seen)
        accumulated = inputs.layer(*base, chunk_attention=[row.chunk_attention for row in layer.rows])[need]
        recorded = inputs.layer(*base, queries=layer.recent_queries)[need]
        out.append((accumulated, recorded))
    return out


@pytest.mark.parametrize(
    "blocks,chunk",
    [
        ((40,), 16),  # one prefill: two whole chunks and an open one cut 4 from the end
        ((13, 27, 1, 6), 4),  # blocks of every size, many small chunks, ends inside chunks
        ((5,), 16),  # shorter than the protected first rows: no chunk
        ((13,), 16),  # first + last + 1: a middle of one token
        ((28,), 16),  # the first chunk closes exactly at seen - last
        ((29, 1, 1, 1), 8),  # one token at a time after the prompt, as decode steps add them
    ],
)
@pytest.mark.parametrize("scale", [1.0, None])
def test_accumulated_chunk_attention_equals_the_recorded_queries_reference(blocks, chunk, scale):
    """Two rows, the second left-padded (its positions and chunks differ from the first's), prefilled in
    ``blocks``: the mass of every key equals the one computed from every recorded query."""
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=3)
    total = sum(blocks)
    ids = torch.randint(1, 128, (2, total), generator=torch.Generator().manual_seed(total + chunk))
    mask = torch.ones_like(ids)
    mask[1, : min(3, total - 1)] = 0
    spec = ChunkSpec(chunk, 8, 4, scale)
    cache = RaggedCache.for_model(model)
    start = 0
    for size in blocks:
        end = start + size
        prefill(model, cache, ids[:, start:end], mask[:, :end], observe_queries=ALL_QUERIES, accumulate=(spec,))
        start = end
    for accumulated, recorded in _both_ways(model, cache, spec):
        torch.testing.assert_close(accumulated, recorded, rtol=1e-5, atol=1e-6)
        if total > 12:
            assert bool((accumulated > 0).any())
    for layer in cache.layers:
        for row in layer.rows:  # only the open chunk's tokens are held back
            attention = row.chunk_attention[spec]
            held = 0 if attention.queries is None else attention.queries.shape[1]
            assert held < chunk + 4 and attention.seen == row.real_seen


@pytest.mark.parametrize("spread", [0.5, 6.0])
def test_chunk_mass_equals_softmax_then_sum_even_where_exp_underflows(spread):
    """``chunk_mass`` against its definition (each query's softmax over its chunk's keys, summed over the
    chunk's queries, averaged over the group), with logits of std ~0.25 and ~290: at the second most
    weights underflow float32, the range the clamp before the exp covers."""
    generator = torch.Generator().manual_seed(11)
    queries = torch.randn(2, 3, 4, 16, 8, generator=generator) * spread  # [Hkv, G, K, c, d]
    keys = torch.randn(2, 4, 16, 8, generator=generator) * spread  # [Hkv, K, c, d]
    logits = torch.einsum("hgkqd,hkcd->hgkqc", queries.double(), keys.double())
    reference = torch.softmax(logits, dim=-1).sum(3).mean(1)  # [Hkv, K, c]
    mass = chunk_mass(queries, keys, 1.0)
    assert mass.dtype == torch.float32
    torch.testing.assert_close(mass.double(), reference, rtol=1e-5, atol=1e-6)
    if spread > 1:
        assert float((torch.softmax(logits, dim=-1) < 1e-38).double().mean()) > 0.5


def test_token_by_token_equals_one_pass_and_copies_are_independent():
    generator = torch.Generator().manual_seed(4)
    queries, keys = torch.randn(6, 57, 8, generator=generator), torch.randn(3, 57, 8, generator=generator)
    spec = ChunkSpec(7, 3, 2, 0.5)
    whole, stepwise = ChunkAttention(spec), ChunkAttention(spec)
    whole.add(queries, keys, 1.0)
    for t in range(57):
        stepwise.add(queries[:, t : t + 1], keys[:, t : t + 1], 1.0)
        if t == 30:
            snapshot = stepwise.copy()
            frozen = snapshot.masses(1.0).clone()
    torch.testing.assert_close(stepwise.masses(1.0), whole.masses(1.0), rtol=1e-6, atol=1e-7)
    assert whole.masses(1.0).shape == (3, 57) and bool((whole.masses(1.0)[:, :3] == 0).all())
    assert bool((whole.masses(1.0)[:, -2:] == 0).all())  # the last two take no part
    torch.testing.assert_close(snapshot.masses(1.0), frozen)  # the copy did not move with the original
    # each closed chunk's queries spread a mass of one per query over its keys: G queries x c averaged
    closed = whole.masses(1.0)[:, 3 : 3 + 7 * 7].reshape(3, 7, 7).sum(-1)
    torch.testing.assert_close(closed, torch.full((3, 7), 7.0), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_embedded_model_accumulates_what_its_recorded_queries_give(embedded_model, embedded_tokenizer):
    """The real model, a 700-token prompt in two blocks, Compactor's default chunks."""
    model, tokenizer = embedded_model, embedded_tokenizer
    text = " ".join(f"Item {i} is stored in drawer {i * 7 % 13}." for i in range(120))
    ids = torch.tensor([tokenizer(text)["input_ids"][:700]])
    spec = LeverageScorer().chunk_spec
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids[:, :300], observe_queries=ALL_QUERIES, accumulate=(spec,))
    prefill(model, cache, ids[:, 300:], torch.ones_like(ids), observe_queries=ALL_QUERIES, accumulate=(spec,))
    for accumulated, recorded in _both_ways(model, cache, spec):
        torch.testing.assert_close(accumulated, recorded, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device,most", [("cpu", None), ("meta", 8)])
def test_an_accelerator_scores_many_chunks_per_product(device, most):
    """One row of a 32K-token prompt on Llama-3.1-8B's geometry (8 KV heads x 4 query heads, d = 128,
    chunks of 256): a CPU scores 2 chunks per product (the logits stay near its caches,
    R-chunk-mass-underflow-2026-11-27); any other device scores at most ``Hq x 2^21`` logits at once,
    so the 128 chunks take a few products, not 64 per row and layer of about 30 ops each (on a GPU
    every op is a kernel launch the host pays for: ~15,000 per layer at 32K x 8 before,
    docs/results.md R-prefill-host-ops-2026-11-28).  The meta
    device stands for the GPU: ``chunk_mass`` decides by the device type, and its shapes are real."""
    heads, group, chunks, size, dim = 8, 4, 128, 256, 128
    make = torch.empty if device == "meta" else torch.zeros
    queries = make(heads, group, chunks, size, dim, dtype=torch.bfloat16, device=device)
    keys = make(heads, chunks, size, dim, dtype=torch.bfloat16, device=device)
    counter = SyncCounter()  # tests/test_decode_sync.py: every op dispatched, by name
    with counter:
        mass = chunk_mass(queries, keys, 1.0)
    assert mass.shape == (heads, chunks, size) and mass.dtype == torch.float32
    if most is None:
        assert counter.names["bmm"] == 2 * chunks // 2  # 2 chunks per product, 2 products each
    else:
        assert counter.names["bmm"] <= most
