"""MomentKV math (runtime/math/momentkv.py) against direct reference computations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from runtime.math.momentkv import (
    MomentSums,
    attention_with_lse,
    corrected_attention,
    evict_in_rounds,
    evicted_estimate,
    evicted_estimates,
    merge_outputs,
    moment_scores,
)

D = 16
S = 1 / math.sqrt(D)


def _exact(query, keys, values):
    """Softmax attention and log-sum-exp in float64: out [G, q, d], lse [G, q]."""
    logits = S * query.double() @ keys.double().T
    return torch.softmax(logits, -1) @ values.double(), torch.logsumexp(logits, -1)


def test_attention_with_lse_kernel_and_fallback_agree_with_naive():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 5, D, generator=g), torch.randn(40, D, generator=g), torch.randn(40, D, generator=g)
    ref_out, ref_lse = _exact(q, k, v)
    for use_kernel in (True, False):
        out, lse = attention_with_lse(q, k, v, S, use_kernel=use_kernel)
        assert out.shape == (3, 5, D) and lse.shape == (3, 5) and lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # a bool mask and the equivalent additive mask; a fully masked row -> out 0, lse -inf
    mask = torch.rand(3, 5, 40, generator=g) > 0.3
    mask[0, 0] = False
    out_b, lse_b = attention_with_lse(q, k, v, S, mask=mask)
    out_f, lse_f = attention_with_lse(q, k, v, S, mask=torch.zeros(mask.shape).masked_fill(~mask, float("-inf")))
    torch.testing.assert_close(out_b, out_f)
    torch.testing.assert_close(lse_b, lse_f)
    assert lse_b[0, 0] == float("-inf") and out_b[0, 0].abs().max() == 0
    logits = (S * q.double() @ k.double().T).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse_b[1:].double(), torch.logsumexp(logits, -1)[1:], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="kernel"):
        attention_with_lse(q, k, v, S, mask=mask, use_kernel=True)
    # strided (non-contiguous) query and keys, e.g. slices of a [B, H, T, d] tensor, on both paths
    q_strided = torch.randn(5, 3, D, generator=g).transpose(0, 1)  # [3, 5, d], non-contiguous
    k_strided = torch.randn(D, 40, generator=g).T  # [40, d], non-contiguous
    ref_out, ref_lse = _exact(q_strided, k_strided, v)
    for use_kernel in (True, False):
        out, lse = attention_with_lse(q_strided, k_strided, v, S, use_kernel=use_kernel)
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_moment_sums_equal_direct_recomputation_after_many_adds():
    g = torch.Generator().manual_seed(1)
    sums = MomentSums(num_kv_heads=2, head_dim=D)
    evicted = {0: [], 1: []}
    for step in range(60):
        head = step % 2
        m = int(torch.randint(0, 5, (1,), generator=g))
        k, v = torch.randn(m, D, generator=g) + 1.0, torch.randn(m, D, generator=g) - 0.5
        sums.add(head, k, v)
        evicted[head].append((k, v))
    for head in (0, 1):
        k = torch.cat([p[0] for p in evicted[head]]).double()
        v = torch.cat([p[1] for p in evicted[head]]).double()
        assert sums.count(head) == k.shape[0]
        torch.testing.assert_close(sums.mean_key(head).double(), k.mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sums.mean_value(head).double(), v.mean(0), atol=1e-5, rtol=1e-5)
        cov = (v - v.mean(0)).T @ (k - k.mean(0)) / k.shape[0]  # population cross-covariance
        torch.testing.assert_close(sums.cross_cov(head).double(), cov, atol=1e-4, rtol=1e-4)
        clamped = sums.cross_cov(head, tau=0.05)
        assert torch.all((clamped == 0) | (clamped.abs() >= 0.05))
    assert sums.nbytes() == 2 * 8 + 2 * 2 * D * 4 + 2 * D * D * 4  # O(d^2), independent of tokens seen
    with pytest.raises(ValueError, match=rf"add expects keys \[m, {D}\] and values \[m, {D}\]"):
        sums.add(0, torch.zeros(3, D), torch.zeros(2, D))
    with pytest.raises(ValueError, match=rf"add expects keys \[m, {D}\] and values \[m, {D}\]"):
        sums.add(0, torch.zeros(3, D), torch.zeros(3, D + 8))  # values of another head dim than the sums'
    narrower = MomentSums(2, D, value_dim=D - 8)  # values narrower than the keys (MiMo-V2-Flash)
    narrower.add(1, torch.ones(3, D), torch.ones(3, D - 8))
    assert narrower.S_vk.shape == (2, D - 8, D) and narrower.count(1) == 3


def test_nothing_evicted_corrected_equals_plain_attention():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 4, D, generator=g), torch.randn(30, D, generator=g), torch.randn(30, D, generator=g)
    sums = MomentSums(2, D)
    plain, _ = attention_with_lse(q, k, v, S)
    for order in (-1, 0, 1):
        assert torch.equal(corrected_attention(q, k, v, sums, 1, S, order), plain)
    sums.add(0, k[:3], v[:3])  # order -1 ignores the moments
    assert torch.equal(corrected_attention(q, k, v, sums, 0, S, -1), plain)
    with pytest.raises(ValueError, match="order"):
        corrected_attention(q, k, v, sums, 0, S, 2)


def test_repeated_evicted_token_gives_full_attention_exactly():
    """Evicted set = one token repeated m times: softmax over it is uniform, o_E = v and
    log Z_E = log m + s q.k exactly, so the merge equals full attention (orders 0 and 1)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 6, D, generator=g) * 2
    k_R, v_R = torch.randn(20, D, generator=g), torch.randn(20, D, generator=g)
    k_e, v_e = torch.randn(D, generator=g), torch.randn(D, generator=g)
    m = 37
    sums = MomentSums(1, D)
    sums.add(0, k_e.expand(m, D), v_e.expand(m, D))
    full, _ = _exact(q, torch.cat([k_R, k_e.expand(m, D)]), torch.cat([v_R, v_e.expand(m, D)]))
    plain, _ = attention_with_lse(q, k_R, v_R, S)
    assert (plain.double() - full).norm() > 0.1  # the evicted token matters
    for order in (0, 1):
        out = corrected_attention(q, k_R, v_R, sums, 0, S, order)
        torch.testing.assert_close(out.double(), full, atol=1e-5, rtol=1e-5)


def test_first_order_error_shrinks_as_evicted_keys_concentrate():
    """Evicted keys k_i = c + eps z_i with values linear in the key, v_i = M k_i: the exact
    evicted output is vbar + O(eps^2) (query-dependent); order 0 misses that O(eps^2) term,
    order 1 captures it and leaves O(eps^3)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 8, D, generator=g)
    center, z = torch.randn(D, generator=g), torch.randn(200, D, generator=g)
    mixing = torch.randn(D, D, generator=g)
    errors = {0: [], 1: []}
    for eps in (1.0, 0.5, 0.25, 0.125):
        keys = center + eps * z
        values = keys @ mixing.T
        sums = MomentSums(1, D)
        sums.add(0, keys, values)
        exact_out, exact_lse = _exact(q, keys, values)
        for order in (0, 1):
            out, lse = evicted_estimate(q, sums, 0, S, order)
            errors[order].append(float((out.double() - exact_out).norm() / exact_out.norm()))
            assert torch.all(lse.double() <= exact_lse + 1e-4)  # Jensen: a lower bound
    for order in (0, 1):
        assert all(a > b for a, b in itertools.pairwise(errors[order])), errors
    assert all(e1 < e0 for e0, e1 in zip(errors[0], errors[1], strict=True)), errors
    assert errors[0][-1] / errors[0][0] < 1 / 30  # ~eps^2: 8x tighter -> ~1/64
    assert errors[1][-1] / errors[1][0] < 1 / 200  # ~eps^3: 8x tighter -> ~1/512


def test_moment_scores_reduce_to_attention_times_value_norm_and_residual_formula():
    g = torch.Generator().manual_seed(5)
    a = torch.rand(25, generator=g)
    k, v = torch.randn(25, D, generator=g), torch.randn(25, D, generator=g)
    sums = MomentSums(1, D)
    torch.testing.assert_close(moment_scores(a, k, v, sums, 0, S), a * v.norm(dim=-1))
    ek, ev = torch.randn(10, D, generator=g), torch.randn(10, D, generator=g)
    sums.add(0, ek, ev)
    cov = (ev - ev.mean(0)).T @ (ek - ek.mean(0)) / 10
    residual = v - (ev.mean(0) + S * k @ cov.T)
    torch.testing.assert_close(moment_scores(a, k, v, sums, 0, S), a * residual.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_evict_in_rounds_budget_protection_and_sums():
    g = torch.Generator().manual_seed(6)
    n, budget = 50, 12
    a = torch.rand(n, generator=g)
    k, v = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:2] = True
    protected[-4:] = True
    sums = MomentSums(1, D)
    kept = evict_in_rounds(a, k, v, sums, 0, S, budget, rounds=3, protected=protected)
    assert kept.shape == (budget,) and torch.all(kept[1:] > kept[:-1])
    assert set(range(2)) | set(range(n - 4, n)) <= set(kept.tolist())
    evicted = torch.tensor(sorted(set(range(n)) - set(kept.tolist())))
    assert sums.count(0) == n - budget
    torch.testing.assert_close(sums.s_k[0], k[evicted].sum(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums.S_vk[0], v[evicted].T @ k[evicted], atol=1e-4, rtol=1e-4)
    # one round with empty moments = evicting the lowest a ||v|| directly
    sums1 = MomentSums(1, D)
    kept1 = evict_in_rounds(a, k, v, sums1, 0, S, budget, rounds=1)
    expected = torch.sort(torch.topk(a * v.norm(dim=-1), budget).indices).values
    assert torch.equal(kept1, expected)
    assert torch.equal(evict_in_rounds(a, k, v, MomentSums(1, D), 0, S, n + 5), torch.arange(n))


def test_batched_estimates_equal_per_head_estimates():
    g = torch.Generator().manual_seed(7)
    heads, groups = 4, 3
    sums = MomentSums(heads, D)
    for head in (0, 1, 3):  # head 2 stays empty
        sums.add(head, torch.randn(9, D, generator=g), torch.randn(9, D, generator=g))
    query = torch.randn(heads, groups, 2, D, generator=g)
    orders, tau = [1, 0, 1, -1], torch.tensor([0.0, 0.0, 0.0, 0.02])
    out, lse = evicted_estimates(query, sums, S, orders, tau=tau)
    assert out.shape == (heads, groups, 2, D) and lse.shape == (heads, groups, 2)
    for head in (0, 1):
        ref_out, ref_lse = evicted_estimate(query[head], sums, head, S, orders[head], tau=float(tau[head]))
        torch.testing.assert_close(out[head], ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[head], ref_lse, atol=1e-5, rtol=1e-5)
    for head in (2, 3):  # empty, and order -1: no correction
        assert torch.all(lse[head] == float("-inf")) and torch.all(out[head] == 0)
    # merged with per-head retained attention: equals corrected_attention head by head
    keys, values = torch.randn(heads, 11, D, generator=g), torch.randn(heads, 11, D, generator=g)
    retained = [attention_with_lse(query[h], keys[h], values[h], S) for h in range(heads)]
    merged = merge_outputs(torch.stack([r[0] for r in retained]), torch.stack([r[1] for r in retained]), out, lse)
    for head in range(heads):
        expected = corrected_attention(
            query[head], keys[head], values[head], sums, head, S, orders[head], tau=float(tau[head])
        )
        torch.testing.assert_close(merged[head], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(merged[2], retained[2][0]) and torch.equal(merged[3], retained[3][0])
    with pytest.raises(ValueError, match="orders"):
        evicted_estimates(query, sums, S, [1, 0, 2, 0])
