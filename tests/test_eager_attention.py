"""runtime.kv_store.eager_attention: the soft-capping reference attention equals the models' own eager
attention (Gemma 2's soft-capping and sliding windows, GQA, padding) and a direct computation."""

from __future__ import annotations

import pytest
import torch
from tiny_architectures import WINDOW, build

from runtime.kv_store.attention_interface import attention_implementation
from runtime.kv_store.eager_attention import attention_forward, eager_attention_forward, soft_cap


def _direct(query, key, value, mask, scale, cap):
    """One head at a time, loops over heads: ``query [Hq, q, d]``, ``key/value [Hkv, k, d]``."""
    heads, group = query.shape[0], query.shape[0] // key.shape[0]
    out = []
    for h in range(heads):
        logits = query[h] @ key[h // group].T * scale  # [q, k]
        logits = cap * torch.tanh(logits / cap)
        logits = logits.masked_fill(~mask, float("-inf"))
        out.append(torch.softmax(logits, dim=-1) @ value[h // group])  # [q, d]
    return torch.stack(out, dim=1)  # [q, Hq, d]


def test_reference_attention_matches_a_direct_computation_with_gqa_softcap_and_a_bool_mask():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 5, 8, generator=generator) * 4  # [B, Hq, q, d]: large logits, the cap bites
    key, value = (torch.randn(1, 2, 9, 8, generator=generator) for _ in range(2))  # [B, Hkv, k, d]
    mask = torch.rand(1, 1, 5, 9, generator=generator) > 0.3
    mask[..., 0] = True  # every query sees a key
    out, _ = eager_attention_forward(None, query, key, value, mask, scaling=0.5, softcap=3.0)
    expected = _direct(query[0], key[0], value[0], mask[0, 0], 0.5, 3.0)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(soft_cap(torch.tensor([1.0, -2.0]), None), torch.tensor([1.0, -2.0]))


def test_without_softcap_it_is_sdpa_unchanged():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 7, 8, generator=generator)
    key, value = (torch.randn(1, 4, 7, 8, generator=generator) for _ in range(2))
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    expected, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    got, _ = attention_forward(module, query, key, value, None, scaling=0.3, softcap=None)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("padded", [False, True])
def test_gemma2_through_the_reference_attention_equals_its_own_eager_attention(padded):
    """Soft-capping on every layer, a 64-token window on every other layer, a prompt past the window
    (and, padded, a left-padded batch): the logits agree with the model's eager attention."""
    model = build("gemma2", attn_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:  # logits of several units, and a cap they reach
            layer.self_attn.q_proj.weight.mul_(40)
            layer.self_attn.attn_logit_softcapping = 2.0
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 512, (2, 3 * WINDOW), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :17] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        with attention_implementation(model, "kvcal_test_reference", attention_forward):
            got = model(ids, attention_mask=mask).logits
        with attention_implementation(model, "kvcal_test_uncapped", _uncapped):
            uncapped = model(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "eager"
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-4)
    assert (uncapped[real] - expected[real]).abs().max() > 1e-2  # the cap matters at this size


def _uncapped(module, query, key, value, attention_mask, softcap=None, **kwargs):
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
