"""MomentKV in the runtime: moment sums in the cache, corrected attention, moment-informed,
decode-time and chunked eviction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from runtime import CompressionPolicy, RaggedCache, compress_prompt, generate, ragged_attention
from runtime.kv_store.cache import RaggedLayer
from runtime.kv_store.transformers_compat import cache_argument
from runtime.math.momentkv import corrected_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _layer_with_tokens(generator, batch=2, kv_heads=2, groups=3, n=40, d=8):
    layer = RaggedLayer(0)
    keys = torch.randn(batch, kv_heads, n, d, generator=generator)
    values = torch.randn(batch, kv_heads, n, d, generator=generator)
    query = torch.randn(batch, kv_heads * groups, n, d, generator=generator)
    layer.update(keys, values)
    layer.attend(query, None, torch.arange(n).expand(batch, n), d**-0.5)
    return layer


@torch.no_grad()
def test_attend_with_correction_equals_reference_and_plain_when_nothing_evicted():
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, d, n = 2, 2, 3, 8, 40
    scale = d**-0.5
    layer = _layer_with_tokens(generator, batch, kv_heads, groups, n, d)
    layer.track_moments()
    orders = torch.tensor([1, 0])
    for b in range(batch):
        layer.rows[b].correction = (orders, torch.zeros(kv_heads))

    def step(q_len):
        keys = torch.randn(batch, kv_heads, q_len, d, generator=generator)
        values = torch.randn(batch, kv_heads, q_len, d, generator=generator)
        query = torch.randn(batch, kv_heads * groups, q_len, d, generator=generator)
        before = [[layer.head(b, h) for h in range(kv_heads)] for b in range(batch)]
        positions = torch.tensor(layer.real_seen).unsqueeze(1) + torch.arange(q_len)
        out = layer.attend(query, None, positions, scale) if layer.update(keys, values) else None
        return out, query, keys, values, before

    # nothing evicted yet: correction switched on, but plain attention
    out, query, keys, values, before = step(1)
    for b in range(batch):
        for h in range(kv_heads):
            k = torch.cat([before[b][h][0], keys[b, h]])
            v = torch.cat([before[b][h][1], values[b, h]])
            q = query[b, h * groups : (h + 1) * groups]  # [G, 1, d]
            plain = torch.nn.functional.scaled_dot_product_attention(
                q, k.expand(groups, -1, -1), v.expand(groups, -1, -1), scale=scale
            )
            torch.testing.assert_close(
                out[b, :, h * groups : (h + 1) * groups], plain.transpose(0, 1), atol=1e-6, rtol=1e-6
            )

    # evict half of every head, then a decode step (1 query) and a 5-token chunk
    for b in range(batch):
        for h in range(kv_heads):
            layer.keep(b, h, torch.arange(0, layer.lengths[b][h], 2))
    for q_len in (1, 5):
        out, query, keys, values, before = step(q_len)
        for b in range(batch):
            for h in range(kv_heads):
                k_old, v_old, _ = before[b][h]
                k = torch.cat([k_old, keys[b, h]])
                v = torch.cat([v_old, values[b, h]])
                mask = torch.ones(q_len, k.shape[0], dtype=torch.bool)
                mask[:, k_old.shape[0] :] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
                q = query[b, h * groups : (h + 1) * groups]
                expected = corrected_attention(q, k, v, layer.moments[b], h, scale, int(orders[h]), mask=mask)
                torch.testing.assert_close(
                    out[b, :, h * groups : (h + 1) * groups], expected.transpose(0, 1), atol=2e-6, rtol=2e-5
                )
                uncorrected = corrected_attention(q, k, v, layer.moments[b], h, scale, -1, mask=mask)
                assert (out[b, :, h * groups : (h + 1) * groups] - uncorrected.transpose(0, 1)).abs().max() > 1e-3


class EvictionLog:
    """Records, per (layer, batch row, KV head), every key/value row that ``keep`` / ``keep_rows`` removes."""

    def __init__(self, monkeypatch):
        self.evicted: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        original = RaggedLayer.keep
        log = self

        def keep(layer, b, h, rows, **kwargs):
            keys, values, positions = (t.clone() for t in layer.head(b, h))
            gone = torch.ones(keys.shape[0], dtype=torch.bool)
            gone[rows] = False
            log.evicted.setdefault((layer.layer_idx, b, h), []).append((keys[gone], values[gone]))
            return original(layer, b, h, rows, **kwargs)

        original_rows = RaggedLayer.keep_rows

        def keep_rows(layer, rows, keep, **kwargs):  # the batched eviction of a whole layer
            for i, b in enumerate(rows):
                for h in range(layer.num_heads):
                    keys, values, _ = (t.clone() for t in layer.head(b, h))
                    gone = ~keep[i, h, : keys.shape[0]].cpu()
                    if bool(gone.any()):
                        log.evicted.setdefault((layer.layer_idx, b, h), []).append((keys[gone], values[gone]))
            return original_rows(layer, rows, keep, **kwargs)

        monkeypatch.setattr(RaggedLayer, "keep", keep)
        monkeypatch.setattr(RaggedLayer, "keep_rows", keep_rows)

    def check(self, cache: RaggedCache) -> int:
        """Compare the cache's sums with a float64 recomputation; returns the tokens checked."""
        checked = 0
        for layer in cache.layers:
            for b, sums in enumerate(layer.moments):
                for h in range(layer.num_heads):
                    parts = self.evicted.get((layer.layer_idx, b, h), [])
                    k = torch.cat([p[0] for p in parts]).double() if parts else torch.zeros(0, layer.head_dim)
                    v = torch.cat([p[1] for p in parts]).double() if parts else torch.zeros(0, layer.head_dim)
                    assert int(sums.n[h]) == k.shape[0]
                    torch.testing.assert_close(sums.s_k[h].double(), k.sum(0), atol=1e-4, rtol=1e-5)
                    torch.testing.assert_close(sums.s_v[h].double(), v.sum(0), atol=1e-4, rtol=1e-5)
                    torch.testing.assert_close(sums.S_vk[h].double(), v.T @ k, atol=1e-3, rtol=1e-5)
                    checked += k.shape[0]
        return checked


@pytest.mark.parametrize("moment_eviction", [False, True], ids=["select-rows", "moment-rounds"])
@torch.no_grad()
def test_moment_sums_equal_recomputation_after_chunked_prefill_and_decode(monkeypatch, moment_eviction):
    model = make_tiny_llama(num_layers=2)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 70), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding in row 1
    policy = CompressionPolicy(
        budget=16,
        scorer="expected_attention",
        statistics="prompt",
        n_sink=2,
        window=4,
        correction="order1",
        moment_eviction=moment_eviction,
        evict_every=3,
    )
    log = EvictionLog(monkeypatch)
    result = generate(
        model, ids, policy, attention_mask=mask, context_columns=60, block_size=12, max_new_tokens=12, pad_token_id=0
    )
    calls = {key: len(parts) for key, parts in log.evicted.items()}
    assert min(calls.values()) >= 6  # five prefill blocks + question/decode evictions, every head
    checked = log.check(result.cache)
    # every token fed beyond the budget was evicted once: prompt + question + generated - kept
    kept = int(result.cache.head_lengths().sum())
    fed = (int(mask.sum()) + 2 * (result.new_tokens.shape[1] - 1)) * 2 * 2  # rows' tokens x layers x heads
    assert checked + kept == fed


@torch.no_grad()
def test_decode_eviction_keeps_every_head_at_or_under_budget(monkeypatch):
    model = make_tiny_llama(num_layers=2)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    for every in (1, 4):
        policy = CompressionPolicy(budget=20, scorer="keydiff", n_sink=2, window=4, evict_every=every)
        seen = []
        original = RaggedLayer.drop_outside_window  # the end of a layer's chunk (after its evictions)

        def drop_outside_window(layer, original=original, seen=seen):
            original(layer)
            if layer.decode_plans[0] is not None:  # after the prompt's compression
                seen.append(max(max(row) for row in layer.lengths))

        monkeypatch.setattr(RaggedLayer, "drop_outside_window", drop_outside_window)
        try:
            result = generate(model, ids, policy, context_columns=30, max_new_tokens=25)
        finally:
            monkeypatch.setattr(RaggedLayer, "drop_outside_window", original)
        assert result.new_tokens.shape[1] == 25 and len(seen) == 2 * 25  # question chunk + 24 steps, 2 layers
        assert max(seen) <= 20 + every - 1, (every, max(seen))
        assert int(result.cache.head_lengths().max()) <= 20 + every - 1
        # the newest tokens are kept (recent window) and positions stay increasing
        positions = result.cache.layers[1].head(0, 1)[2].tolist()
        assert positions == sorted(set(positions)) and positions[-1] == 40 + 25 - 2


@torch.no_grad()
def test_decode_eviction_with_budget_above_length_is_the_unmodified_model():
    model = make_tiny_llama(num_layers=2)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(5))
    expected = model.generate(ids, max_new_tokens=15, do_sample=False, pad_token_id=0)
    policy = CompressionPolicy(
        budget=64,
        allocation="uniform",
        scorer="expected_attention",
        statistics="prompt",
        correction="order1",
        evict_every=1,
    )
    result = generate(model, ids, policy, context_columns=24, max_new_tokens=15, pad_token_id=0)
    assert result.sequences.tolist() == expected.tolist()
    assert int(result.cache.head_lengths().min()) == 30 + 15 - 1  # nothing was evicted
    assert all(int(sums.n.sum()) == 0 for layer in result.cache.layers for sums in layer.moments)


def test_policy_refuses_moment_options_it_cannot_serve():
    with pytest.raises(ValueError, match="estimates attention"):
        CompressionPolicy(keep_ratio=0.5, scorer="keydiff", moment_eviction=True)
    with pytest.raises(ValueError, match="unknown correction"):
        CompressionPolicy(keep_ratio=0.5, correction="second")
    with pytest.raises(ValueError, match="evict_every"):
        CompressionPolicy(keep_ratio=0.5, evict_every=0)
    (reason,) = CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="calibrated").missing(
        type("C", (), {"moment_orders": None, "path": "x.h5", "sections": ("behaviour",), "inf_weights": None})()
    )
    assert "'moments' section" in reason
    cache = RaggedCache(1)
    layer = cache.layers[0]
    layer.update(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))
    layer.attend(torch.randn(1, 1, 5, 4), None, torch.arange(5).unsqueeze(0), 0.5)
    layer.keep(0, 0, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="already evicted"):
        cache.track_moments()


@torch.no_grad()
def test_embedded_model_correction_lowers_attention_output_error_at_75_percent(embedded_model, embedded_tokenizer):
    """Question-agnostic compression of a ~1K-token retrieval prompt to 25% of its cache: the
    attention outputs on the question tokens, compared with the full cache, layer by layer."""
    from needles.spec import make_probe
    from profiler.evaluation import AttentionOutputRecorder

    probe = make_probe(embedded_tokenizer, "retrieval", 1024, 50.0, seed=77)
    ids = torch.tensor([probe.input_ids])
    recorder = AttentionOutputRecorder(embedded_model)
    outputs = {}
    try:
        for name, correction in (("full", None), ("none", "none"), ("order1", "order1"), ("order0", "order0")):
            policy = (
                None
                if correction is None
                else CompressionPolicy(keep_ratio=0.25, scorer="snapkv", correction=correction)
            )
            cache, _ = compress_prompt(embedded_model, ids, policy, context_columns=probe.context_end)
            recorder.arm()
            with ragged_attention(embedded_model):
                embedded_model(
                    input_ids=ids[:, probe.context_end :], **cache_argument(embedded_model, cache), use_cache=True
                )
            outputs[name] = recorder.take()
    finally:
        recorder.remove()
    errors = {
        name: np.array([float((a - e).norm() / e.norm()) for a, e in zip(outputs[name], outputs["full"], strict=True)])
        for name in ("none", "order0", "order1")
    }
    print({name: round(float(e.mean()), 4) for name, e in errors.items()})
    assert errors["order1"].mean() < errors["none"].mean()
    assert (errors["order1"] < errors["none"]).mean() > 0.5  # most layers, not one outlier
