"""Longrope RoPE (``rope_type: longrope``: Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini).

transformers rotates each forward pass with the short factors while the pass's largest position + 1
is at most ``original_max_position_embeddings`` (4096 in those checkpoints) and with the long
factors beyond (``dynamic_rope_update``): the RoPE of a key depends on the pass that computed it.
kvcal's serving runs the passes transformers runs, so nothing evicted is transformers' own; the
scorers that un-rotate keys (leverage, learned) un-rotate the keys of one pass exactly.  Keys of
passes on both sides of the switch, un-rotated together, are not: a block-wise prefill across it
(measured before the refusal, on this tiny Phi-3: the first block's keys un-rotated with the long
factors were 0.73 off the pre-RoPE keys, whose largest entry is 0.65) and decode-time eviction are
refused by name for those scorers.  Expected Attention's RoPE average takes each future position's
own factors, as a query decoded there alone gets them.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_rope_check import COMMON, _layer_inputs, _pre_and_post_rope, _provider

from runtime import CompressionPolicy, bind, compress_prompt, generate
from runtime.math.geometry import ModelGeometry, UnsupportedModelError
from runtime.math.rope import averaged_rope, rope_cos_sin
from runtime.scorers import KeyRope

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

SWITCH = 64  # original_max_position_embeddings
REFUSED = r"on both sides of 64 positions, where the model's longrope RoPE turns from its short to its long factors"


def _phi3_longrope():
    half = 8  # head_dim 16
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": SWITCH,
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [2.0 + 0.5 * i for i in range(half)],
    }
    config = T.Phi3Config(
        **{**COMMON, "num_hidden_layers": 2}, original_max_position_embeddings=SWITCH, rope_parameters=rope
    )
    torch.manual_seed(0)
    model = T.Phi3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _ids(length: int) -> torch.Tensor:
    return torch.randint(3, 250, (1, length), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_nothing_evicted_is_transformers_own_on_either_side_of_the_switch():
    model = _phi3_longrope()
    assert ModelGeometry.of(model).rope_switches == (SWITCH, SWITCH)
    ids = _ids(100)  # one pass beyond the switch: the long factors
    got = generate(model, ids, None, max_new_tokens=8, output_logits=True, return_dict_in_generate=True)
    expected = model(got.sequences).logits[0, 99:107]
    torch.testing.assert_close(torch.stack([step[0] for step in got.output.logits]), expected, rtol=0, atol=1e-4)
    ids = _ids(40)  # the prompt within it, decoding across it
    got = generate(model, ids, None, max_new_tokens=40, output_logits=True, return_dict_in_generate=True)
    plain = model.generate(ids, max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, plain.sequences)
    for ours, theirs in zip(got.output.logits, plain.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    ids, mask = _ids(100).repeat(2, 1), torch.ones(2, 100, dtype=torch.long)
    mask[1, :60] = 0  # a left-padded batch: its rows take the longest row's (long) factors, as in transformers
    got = generate(
        model, ids, None, attention_mask=mask, max_new_tokens=8, output_logits=True, return_dict_in_generate=True
    )
    plain = model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    assert torch.equal(got.sequences, plain.sequences)
    for ours, theirs in zip(got.output.logits, plain.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("length", [40, 100])
@torch.no_grad()
def test_the_keys_of_one_pass_are_unrotated_exactly_on_either_side_of_the_switch(length):
    model = _phi3_longrope()
    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)
    ids = _ids(length)
    pre, post = _pre_and_post_rope(model, ids)
    key_rope = _provider(plan, KeyRope)
    for layer in range(2):
        keys = post[layer][0].transpose(1, 2)
        unrotated = key_rope(_layer_inputs(layer, keys, length)).undo(keys)
        torch.testing.assert_close(unrotated, pre[layer][0].transpose(1, 2), rtol=1e-4, atol=1e-5)
    cache, report = compress_prompt(model, ids, plan, context_columns=length - 4)
    assert report.kv_bytes_after < report.kv_bytes_before


def test_a_blockwise_prefill_across_the_switch_is_refused_for_the_scorers_that_unrotate_keys():
    model = _phi3_longrope()
    leverage = CompressionPolicy(keep_ratio=0.25)
    with pytest.raises(UnsupportedModelError, match=REFUSED) as refused:
        compress_prompt(model, _ids(100), leverage, context_columns=96, block_size=32)
    assert "block_size=32" in str(refused.value) and "reads no RoPE (keydiff" in str(refused.value)
    for ids, columns, block, policy in (
        (_ids(100), 96, 128, leverage),  # one pass
        (_ids(64), 60, 32, leverage),  # every pass within the switch
        (_ids(100), 96, 32, CompressionPolicy(keep_ratio=0.25, scorer="keydiff")),  # reads no RoPE
    ):
        cache, report = compress_prompt(model, ids, policy, context_columns=columns, block_size=block)
        assert report.kv_bytes_after < report.kv_bytes_before


def test_decode_time_eviction_is_refused_for_the_scorers_that_unrotate_keys():
    model = _phi3_longrope()
    with pytest.raises(UnsupportedModelError, match=r"decode-time eviction \(evict_every=4\) un-rotates"):
        bind(CompressionPolicy(keep_ratio=0.25, evict_every=4), None, model)
    result = generate(
        model, _ids(40), CompressionPolicy(keep_ratio=0.25, scorer="keydiff", evict_every=4), max_new_tokens=40
    )
    assert result.new_tokens.shape == (1, 40)


@pytest.mark.parametrize(("start", "horizon"), [(40, 50), (10, 20), (70, 10)])
def test_averaged_rope_takes_each_positions_own_factors(start, horizon):
    """Across the switch (40 + 50), within it and beyond it: the mean of the RoPE each position's query
    gets decoded alone (a pass whose longest position is that one)."""
    geometry = ModelGeometry.of(_phi3_longrope())
    alone = [rope_cos_sin(geometry, torch.tensor([p]), 0) for p in range(start, start + horizon)]
    cos, sin = averaged_rope(geometry, start, horizon, 0)
    torch.testing.assert_close(cos, torch.cat([c for c, _ in alone]).mean(0))
    torch.testing.assert_close(sin, torch.cat([s for _, s in alone]).mean(0))
