"""runtime.compression.prompt_statistics.QueryMoments: one accumulator for a prompt's query statistics (per row)
and the calibration's (batch-summed), each bit-identical to its documented summation order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from runtime.compression.prompt_statistics import QueryMoments
from runtime.math.geometry import ModelGeometry


def _query_outputs(model, ids, attention_mask=None):
    """The query modules' outputs per layer, [B, T, Hq, d] float32 (independent hooks)."""
    geometry = ModelGeometry.of(model)
    seen = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().clone()))
        for m in _model_query_modules(model)
    ]
    try:
        with torch.no_grad():
            model(ids, attention_mask=attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    b, t = ids.shape
    return [q.reshape(b, t, geometry.num_q_heads, geometry.head_dim) for q in seen]


def test_per_row_sums_follow_real_tokens_only_in_float32_products():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=3)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding of row 0
    real = mask.bool()
    real[1, :2] = False  # e.g. sink positions left out of row 1
    moments = QueryMoments.for_prompt(model, 2)
    with torch.no_grad(), moments.collect(model, real=real):
        model(ids, attention_mask=mask)
    outputs = _query_outputs(model, ids, mask)
    for b in range(2):
        mean, cov = moments.mean_cov(b)
        assert moments.n[b].tolist() == [[int(real[b].sum())] * 4] * 2
        for layer, q in enumerate(outputs):
            rows = q[b][real[b]]  # the documented order: float32 sum and q^T q, then float64
            total = rows.sum(0).double()
            outer = torch.einsum("thd,the->hde", rows, rows).double()
            assert np.array_equal(moments.total[b, layer], total.numpy())
            assert torch.equal(torch.from_numpy(moments.outer[b, layer]), outer)
            n = int(real[b].sum())
            assert torch.equal(mean[layer], total / n)
            assert torch.equal(cov[layer], outer / n - (total / n).unsqueeze(-1) * (total / n).unsqueeze(-2))


def test_batch_summed_sums_are_float64_products_added_per_forward_pass():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, seed=4)
    batches = [torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    moments = QueryMoments.for_model(model)
    with torch.no_grad(), moments.collect(model, n_sink=3):
        for ids in batches:
            model(ids)
    expected_total = [torch.zeros(4, 8, dtype=torch.float64) for _ in range(2)]
    expected_outer = [torch.zeros(4, 8, 8, dtype=torch.float64) for _ in range(2)]
    for ids in batches:
        for layer, q in enumerate(_query_outputs(model, ids)):
            per_head = q[:, 3:].reshape(-1, 4, 8).double().transpose(0, 1)  # [Hq, N, d]
            expected_total[layer] += per_head.sum(1)
            expected_outer[layer] += torch.bmm(per_head.transpose(1, 2), per_head)
    assert np.array_equal(moments.total, np.stack([t.numpy() for t in expected_total]))
    assert np.array_equal(moments.outer, np.stack([t.numpy() for t in expected_outer]))
    assert np.all(moments.n == 2 * 2 * 7)


def test_state_round_trip_merge_and_misuse():
    per_row = QueryMoments(2, 3, 4, rows=2)
    per_row.add(0, torch.randn(5, 3, 4), row=1)
    per_row.add(1, torch.randn(5, 3, 4), row=1)
    again = QueryMoments.from_state(per_row.state())
    assert again.rows == 2 and np.array_equal(again.outer, per_row.outer) and np.array_equal(again.n, per_row.n)
    doubled = QueryMoments.from_state(per_row.state()).merge(again)
    assert np.array_equal(doubled.total, 2 * per_row.total)
    with pytest.raises(ValueError, match="no prompt queries were recorded for batch element 0"):
        per_row.mean_cov(0)
    with pytest.raises(ValueError, match="finalize"):
        per_row.finalize()
    with pytest.raises(ValueError, match="row="):
        per_row.add(0, torch.randn(1, 3, 4))
    summed = QueryMoments(2, 3, 4)
    with pytest.raises(ValueError, match="cannot merge"):
        summed.merge(per_row)
    with pytest.raises(ValueError, match="mean_cov"):
        summed.mean_cov(0)
    with pytest.raises(ValueError, match=r"queries must be \[N, 3, 4\]"):
        summed.add(0, torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="no queries were accumulated"):
        summed.finalize()


def _model_query_modules(model):
    """Each layer's module whose output is the pre-RoPE query in [B, T, ...] order, read off the model
    itself (q_norm where there is one, Llama / Qwen3), independently of runtime.math.geometry."""
    return [
        layer.self_attn.q_norm if hasattr(layer.self_attn, "q_norm") else layer.self_attn.q_proj
        for layer in model.model.layers
    ]
