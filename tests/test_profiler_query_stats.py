"""Pre-RoPE query statistics: equal to naive numpy over the same queries; shards merge exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from runtime.compression.prompt_statistics import QueryMoments
from runtime.math.geometry import ModelGeometry


def _raw_queries(model, geometry, ids):
    """Independent capture: outputs of each layer's query module, [L, B, T, Hq, d] numpy."""
    seen = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
        for m in _model_query_modules(model)
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    b, t = ids.shape
    return np.stack([q.reshape(b, t, geometry.num_q_heads, geometry.head_dim).double().numpy() for q in seen])


def _naive(queries):
    """queries [L, N, Hq, d] -> mean [L, Hq, d], population cov [L, Hq, d, d]."""
    mean = queries.mean(axis=1)
    cov = np.stack(
        [
            [np.cov(queries[layer, :, h, :], rowvar=False, bias=True) for h in range(queries.shape[2])]
            for layer in range(queries.shape[0])
        ]
    )
    return mean, cov


def test_mean_and_cov_match_numpy_with_sink_skipped():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=1)
    geometry = ModelGeometry.of(model)
    ids = torch.randint(0, 128, (3, 25), generator=torch.Generator().manual_seed(0))
    acc = QueryMoments(2, 4, 8)
    with torch.no_grad(), acc.collect(geometry, n_sink=4):
        model(ids)
    stats = acc.finalize()
    raw = _raw_queries(model, geometry, ids)[:, :, 4:]  # skip the sink positions of every sample
    raw = raw.reshape(2, -1, 4, 8)
    mean, cov = _naive(raw)
    assert np.all(stats["n"] == 3 * 21)
    np.testing.assert_allclose(stats["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["cov"], cov, rtol=1e-4, atol=1e-6)
    assert stats["mean"].dtype == np.float32 and stats["cov"].shape == (2, 4, 8, 8)


def test_two_shards_merge_to_one_pass():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=2)
    geometry = ModelGeometry.of(model)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    whole, first, second = (QueryMoments(2, 4, 8) for _ in range(3))
    with torch.no_grad():
        with whole.collect(geometry, n_sink=2):
            model(ids)
        with first.collect(geometry, n_sink=2):
            model(ids[:1])
        with second.collect(geometry, n_sink=2):
            model(ids[1:])
    merged = QueryMoments.from_state(first.state()).merge(second)
    np.testing.assert_array_equal(merged.n, whole.n)
    np.testing.assert_allclose(merged.total, whole.total, rtol=1e-12)
    np.testing.assert_allclose(merged.outer, whole.outer, rtol=1e-12)
    a, b = merged.finalize(), whole.finalize()
    np.testing.assert_allclose(a["cov"], b["cov"], rtol=1e-6, atol=1e-7)


def test_qwen3_statistics_are_taken_after_the_query_norm():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # non-trivial norm weights so pre/post norm differ
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
    geometry = ModelGeometry.of(model)
    assert geometry.query_norm and geometry.query_projections[0].norm is model.model.layers[0].self_attn.q_norm
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    acc = QueryMoments(2, 4, 8)
    with torch.no_grad(), acc.collect(geometry, n_sink=0):
        model(ids)
    # Reference: apply q_norm by hand to q_proj outputs.
    proj = []
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda _m, _i, o: proj.append(o.detach()))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    normed = [
        model.model.layers[layer].self_attn.q_norm(proj[layer].reshape(2, 12, 4, 8)).detach().double().numpy()
        for layer in range(2)
    ]
    mean, _ = _naive(np.stack([q.reshape(-1, 4, 8) for q in normed]))
    np.testing.assert_allclose(acc.finalize()["mean"], mean, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_embedded_model_query_stats(embedded_model, embedded_tokenizer, one_thread):
    geometry = ModelGeometry.of(embedded_model)
    assert (geometry.num_layers, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim) == (30, 9, 3, 64)
    ids = embedded_tokenizer("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids
    acc = QueryMoments(30, 9, 64)
    with torch.no_grad(), acc.collect(geometry, n_sink=4):
        embedded_model.model(ids)
    stats = acc.finalize()
    raw = _raw_queries(embedded_model, geometry, ids)[:, :, 4:].reshape(30, -1, 9, 64)
    mean, cov = _naive(raw[[0, 29]])
    np.testing.assert_allclose(stats["mean"][[0, 29]], mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats["cov"][[0, 29]], cov, rtol=1e-3, atol=1e-4)


def _model_query_modules(model):
    """Each layer's module whose output is the pre-RoPE query in [B, T, ...] order, read off the model
    itself (q_norm where there is one, Llama / Qwen3), independently of runtime.math.geometry."""
    return [
        layer.self_attn.q_norm if hasattr(layer.self_attn, "q_norm") else layer.self_attn.q_proj
        for layer in model.model.layers
    ]
