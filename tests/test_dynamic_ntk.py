"""Dynamic NTK RoPE (``rope_type: dynamic``): InternLM3-8B's checkpoints (``factor`` 6 over 32768
positions), InternVL 2.5's Qwen2 language model (``factor`` 2).

transformers rotates a forward pass whose largest position + 1 is at most ``max_position_embeddings``
(the original context) with the default RoPE.  A longer pass re-scales the base by its own length,
and the rotary module keeps that scale for later passes (transformers 5.24 until a pass shorter than
the original context, 5.2 for good), so past the original context what the model computes depends on
how the prompt was split and padded and on what ran before (docs/design.md section 6).

kvcal serves such a model inside its original context, where it is the default RoPE: a longer prompt
is refused, so is a generation that would reach past it, and nothing of kvcal calls the rotary module
past it (Expected Attention's horizon stops there: no query is decoded beyond).  Decode-time eviction
is refused for the scorers that un-rotate keys, as on longrope (a generation continued outside
kvcal's ``generate`` could pass the original context).
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_rope_check import COMMON, _assert_scored_keys_and_served, _pre_and_post_rope

from runtime import CompressionPolicy, bind, compress_prompt, generate
from runtime.math.geometry import ModelGeometry, UnsupportedModelError, check_config
from runtime.math.rope import averaged_rope, rope_cos_sin
from runtime.serve.generation import context_limit

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

ORIGINAL = 128  # max_position_embeddings: the original context
PAST = r"past the 128 positions of the model's original context"


def _dynamic_llama(given: str = "rope_parameters", layers: int = 2):
    rope = (
        {"type": "dynamic", "factor": 2.0}
        if given == "rope_scaling"
        else {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    config = T.LlamaConfig(
        **{**COMMON, "num_hidden_layers": layers, "max_position_embeddings": ORIGINAL}, **{given: rope}
    )
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _ids(length: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(3, 250, (rows, length), generator=torch.Generator().manual_seed(1))


def _assert_rotary_untouched(model) -> None:
    """The rotary module holds the original context's frequencies: no pass went past it."""
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, rotary.original_inv_freq)
    assert rotary.max_seq_len_cached == ORIGINAL


def _assert_generates_as_transformers(model, ids, mask, new_tokens) -> None:
    options = dict(max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        got = generate(model, ids, None, attention_mask=mask, **options)
        plain = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(got.sequences, plain.sequences)
    for ours, theirs in zip(got.output.logits, plain.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("given", ["rope_parameters", "rope_scaling"])
def test_served_exactly_inside_its_original_context(given):
    """Refused whole before (issue 41 item 5), whatever the length.  Nothing evicted, a prompt and a
    generation that fill the original context are transformers' own, a left-padded batch too (its
    longest real row counts, not its columns); compressed by the scorers that read RoPE."""
    model = _dynamic_llama(given)
    check_config(model.config)  # profile-model and evaluate-artifact's check before the weights load
    assert context_limit(model.config) == ORIGINAL  # not 2 x 128: transformers re-scales past it
    assert ModelGeometry.of(model).rope_limits == (ORIGINAL, ORIGINAL)
    _assert_generates_as_transformers(model, _ids(100), None, 28)
    ids, mask = _ids(120, rows=2), torch.ones(2, 120, dtype=torch.long)
    mask[0, :20], mask[1, :30] = 0, 0  # the longest row holds 100 tokens in 120 columns
    _assert_generates_as_transformers(model, ids, mask, 28)
    for options in ({"scorer": "leverage"}, {"scorer": "expected_attention", "statistics": "prompt"}):
        _, report = compress_prompt(model, _ids(124), CompressionPolicy(keep_ratio=0.25, **options))
        assert report.kv_bytes_after < report.kv_bytes_before
    _, report = compress_prompt(model, _ids(100), CompressionPolicy(keep_ratio=0.25), block_size=32)
    assert report.kv_bytes_after < report.kv_bytes_before  # every block's pass inside the original context
    _assert_rotary_untouched(model)


def test_a_prompt_or_a_generation_past_the_original_context_is_refused_before_any_pass():
    model = _dynamic_llama()
    passes = []
    model.register_forward_pre_hook(lambda *_: passes.append(1))
    with pytest.raises(ValueError, match=PAST) as refused:
        generate(model, _ids(100), CompressionPolicy(keep_ratio=0.25), max_new_tokens=29)
    assert "at most 28 new tokens" in str(refused.value) and "dynamic NTK" in str(refused.value)
    ids, mask = _ids(120, rows=2), torch.ones(2, 120, dtype=torch.long)
    mask[0, :19] = 0  # 101 real tokens
    with pytest.raises(ValueError, match=PAST):
        generate(model, ids, None, attention_mask=mask, max_length=229)  # 28 new tokens, as max_length counts
    with pytest.raises(ValueError, match=r"more than the model's context of 128 positions"):
        compress_prompt(model, _ids(129), CompressionPolicy(keep_ratio=0.25))
    assert not passes
    _assert_rotary_untouched(model)


@torch.no_grad()
def test_the_keys_are_unrotated_exactly():
    _assert_scored_keys_are_the_pre_rope_keys(_dynamic_llama(), _ids(120))


def _assert_scored_keys_are_the_pre_rope_keys(model, ids):
    """The leverage scorer's keys are every layer's pre-RoPE keys, and the compression serves."""
    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)
    pre, _ = _pre_and_post_rope(model, ids)
    _assert_scored_keys_and_served(model, plan, ids, {layer: keys for layer, (keys, _) in pre.items()})
    return plan


@pytest.mark.parametrize(
    ("start", "horizon", "first", "last"), [(10, 20, 10, 29), (120, 64, 120, 127), (128, 8, 127, 127)]
)
def test_expected_attentions_horizon_stops_at_the_original_context(start, horizon, first, last):
    """The mean of the RoPE each position's query gets decoded alone, over the positions a query can be
    decoded at (``first .. last``): no generation reaches past the original context, and the rotary
    module is never asked for a position there (it would re-scale, and keep the scale)."""
    model = _dynamic_llama()
    geometry = ModelGeometry.of(model)
    alone = [rope_cos_sin(geometry, torch.tensor([p]), 0) for p in range(first, last + 1)]
    cos, sin = averaged_rope(geometry, start, horizon, 0)
    torch.testing.assert_close(cos, torch.cat([c for c, _ in alone]).mean(0))
    torch.testing.assert_close(sin, torch.cat([s for _, s in alone]).mean(0))
    with pytest.raises(ValueError, match=r"position 129 is past the 128 positions"):
        rope_cos_sin(geometry, torch.arange(130), 0)
    _assert_rotary_untouched(model)


def test_decode_time_eviction_is_refused_for_the_scorers_that_unrotate_keys():
    model = _dynamic_llama()
    with pytest.raises(UnsupportedModelError, match=r"decode-time eviction \(evict_every=4\) un-rotates") as refused:
        bind(CompressionPolicy(keep_ratio=0.25, evict_every=4), None, model)
    assert "dynamic NTK RoPE re-scales" in str(refused.value)
    result = generate(
        model, _ids(60), CompressionPolicy(keep_ratio=0.25, scorer="keydiff", evict_every=4), max_new_tokens=40
    )
    assert result.new_tokens.shape == (1, 40)


def test_dynamic_ntk_of_one_layer_type_limits_those_layers():
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    rope = {"full_attention": dynamic, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    if not hasattr(T, "Gemma3TextConfig"):
        pytest.skip(f"transformers {T.__version__} has no Gemma3TextConfig")
    config = T.Gemma3TextConfig(
        **{**COMMON, "max_position_embeddings": ORIGINAL},
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=rope,
    )
    torch.manual_seed(0)
    model = T.Gemma3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    assert ModelGeometry.of(model).rope_limits == (None, ORIGINAL) * 2
    assert context_limit(model.config) == ORIGINAL
    _assert_generates_as_transformers(model, _ids(100), None, 28)
    with pytest.raises(ValueError, match=PAST):
        generate(model, _ids(100), None, max_new_tokens=29)


@torch.no_grad()
def test_the_embedded_weights_with_internlm3s_rope_are_served_inside_the_original_context(
    embedded_model, embedded_tokenizer
):
    """The real embedded weights with InternLM3-8B's checkpoint RoPE (dynamic, ``factor`` 6), an original
    context of 128 positions: nothing evicted is transformers' own, the leverage scorer's keys are the
    pre-RoPE keys, and a generation past the original context is refused."""
    own = {k: v for k, v in embedded_model.config.to_dict().items() if k not in ("architectures", "model_type")}
    own.update(
        max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "dynamic", "factor": 6.0, "rope_theta": 100000.0},
    )
    model = T.LlamaForCausalLM(T.LlamaConfig(**own)).eval()
    model.load_state_dict(embedded_model.state_dict())
    model.generation_config.pad_token_id = embedded_tokenizer.pad_token_id or 0
    ids = embedded_tokenizer("The passcode is 4817. " * 8 + "What is the passcode?", return_tensors="pt").input_ids
    assert ids.shape[1] < ORIGINAL - 8
    _assert_generates_as_transformers(model, ids, None, 8)
    plan = _assert_scored_keys_are_the_pre_rope_keys(model, ids)
    with pytest.raises(ValueError, match=PAST):
        generate(model, ids, plan, max_new_tokens=ORIGINAL)
    _assert_rotary_untouched(model)
