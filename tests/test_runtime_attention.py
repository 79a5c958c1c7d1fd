"""runtime.kv_store.attention_interface.attention_implementation: the one way an attention function is
swapped in for a scope."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from runtime.kv_store.attention_interface import attention_implementation


def _spy(calls: list, tag: str):
    """An attention function that notes (tag, layer, mask given?) and computes sdpa."""

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append((tag, module.layer_idx, attention_mask is not None))
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )

    return forward


def test_scope_switches_registers_the_mask_and_restores_everything():
    model = make_tiny_llama(num_layers=2)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the function must receive the mask
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    outer_calls, inner_calls = [], []
    with torch.no_grad(), attention_implementation(model, "kvcal_test_scope", _spy(outer_calls, "outer")):
        assert model.config._attn_implementation == "kvcal_test_scope"
        logits = model(ids, attention_mask=mask).logits
        with attention_implementation(model, "kvcal_test_scope", _spy(inner_calls, "inner")):
            model(ids, attention_mask=mask)
        model(ids, attention_mask=mask)  # the outer function is back under the name
    torch.testing.assert_close(logits, expected)
    assert outer_calls == [("outer", 0, True), ("outer", 1, True)] * 2
    assert inner_calls == [("inner", 0, True), ("inner", 1, True)]
    assert model.config._attn_implementation == "sdpa"
    assert ALL_ATTENTION_FUNCTIONS["kvcal_test_scope"].__qualname__.startswith("_spy")


def test_scope_restores_after_an_exception_and_refuses_models_outside_the_interface(monkeypatch):
    model = make_tiny_llama(num_layers=1)
    with pytest.raises(RuntimeError, match="boom"):
        with attention_implementation(model, "kvcal_test_raise", _spy([], "x")):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    outer = _spy([], "outer")
    with attention_implementation(model, "kvcal_test_refused", outer):
        with monkeypatch.context() as patch:
            patch.setattr(type(model), "_can_set_attn_implementation", classmethod(lambda cls: False))
            with pytest.raises(ValueError, match="does not route attention through transformers' AttentionInterface"):
                with attention_implementation(model, "kvcal_test_refused", _spy([], "inner")):
                    pass
        assert ALL_ATTENTION_FUNCTIONS["kvcal_test_refused"] is outer  # the refused scope left nothing behind
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("capturing", [False, True])
def test_a_one_token_chunk_without_padding_gets_no_mask_even_while_a_graph_is_captured(capturing, monkeypatch):
    """The ragged attention's mask builder: a one-token chunk without a padding mask is None whatever
    the step's position (transformers 5.2's ``sdpa_mask`` builds it while a CUDA graph is captured,
    and the ragged attention would read it back to the host); with a padding mask, or a longer
    chunk, it is transformers' own mask."""
    import inspect

    from transformers.masking_utils import sdpa_mask

    from runtime.kv_store.attention_interface import chunk_mask

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    legacy = "cache_position" in inspect.signature(sdpa_mask).parameters  # transformers 5.2

    def arguments(q: int, padding=None) -> dict:
        position = torch.arange(40, 40 + q)
        query = {"cache_position": position} if legacy else {"q_length": q, "q_offset": position[0]}
        return {"batch_size": 2, **query, "kv_length": q, "kv_offset": 40, "attention_mask": padding}

    assert chunk_mask(**arguments(1)) is None
    padding = torch.tensor([[True], [False]])
    built = chunk_mask(**arguments(1, padding))
    expected = sdpa_mask(**arguments(1, padding))
    assert built is not None and torch.equal(built, expected)
    four = chunk_mask(**arguments(4, torch.ones(2, 4, dtype=torch.bool)))
    reference = sdpa_mask(**arguments(4, torch.ones(2, 4, dtype=torch.bool)))
    assert (four is None and reference is None) or torch.equal(four, reference)
