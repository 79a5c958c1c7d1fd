"""MiMo-V2-Flash: values narrower than the keys (``v_head_dim`` 128 to ``head_dim`` 192 in its checkpoints), scaled
before they are cached (``attention_value_scale``), and sliding-window layers of twice the full layers' KV heads with
learned attention sinks.  kvcal holds values of their own head dim (``runtime.kv_store.segments.SegmentStore``,
``runtime.math.momentkv.MomentSums``), the sliding layers apart from the evicted full-attention ones
(``artifacts.fingerprint.sliding_layers_apart``).  A tiny random-weight model here (values of 24 to keys of 16)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_architecture_matrix import TOLERANCE, nothing_evicted_difference, tiny_model
from test_hybrid_models import assert_profile_served_back

from artifacts.fingerprint import architecture_numbers, attention_variant, value_head_dim
from runtime import CompressionPolicy, RaggedCache, generate
from runtime.compression.prefill import prefill
from runtime.math.geometry import ModelGeometry
from runtime.math.momentkv import MomentSums, PreparedMoments, attention_with_lse, merge_outputs

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not hasattr(T, "MiMoV2FlashForCausalLM"), reason="this transformers has no MiMo-V2-Flash"),
]

LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def mimo(vocab_size: int = 256, **options):
    """A tiny MiMo-V2-Flash (tests/test_architecture_matrix.py's shapes): full-attention layers 0 and 3 of 2 KV heads,
    sliding layers 1 and 2 of 4 with learned sinks, keys of 16 and values of 24 scaled by 0.707; random weights."""
    options = {"layer_types": LAYER_TYPES, "v_head_dim": 24, **options}
    return tiny_model("mimo_v2_flash", vocab_size=vocab_size, **options)


def padded_prompt():
    ids = torch.randint(3, 250, (2, 80), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    return ids, mask


def test_the_cache_holds_values_of_their_own_head_dim_and_the_sliding_layers_apart():
    model = mimo()
    geometry = ModelGeometry.of(model)
    assert (geometry.layer_indices, geometry.num_kv_heads, geometry.head_dim, geometry.value_head_dim) == (
        (0, 3),
        2,
        16,
        24,
    )
    assert geometry.value_projections[0].scale == pytest.approx(0.707)  # the values as cached
    assert value_head_dim(model.config) == 24 and attention_variant(model.config)["value_head_dim"] == 24
    # the values' head dim is part of the fingerprint: the same model with values of the keys' dim is another
    assert architecture_numbers(mimo(v_head_dim=16).config) != architecture_numbers(model.config)
    ids, mask = padded_prompt()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids, attention_mask=mask)
    full, sliding = cache.layers[0], cache.layers[1]
    assert cache.attention_layers == [cache.layers[0], cache.layers[3]]
    assert (full.num_heads, full.head_dim, full.value_dim) == (2, 16, 24)
    assert (sliding.num_heads, sliding.head_dim, sliding.value_dim) == (4, 16, 24)
    assert tuple(full.value_buffer.shape[1:]) == (24,) and tuple(full.key_buffer.shape[1:]) == (16,)
    assert cache.bytes_per_token() == (16 + 24) * 4


@torch.no_grad()
def test_nothing_evicted_is_the_unmodified_models_and_beams_too():
    model = mimo()
    assert nothing_evicted_difference(model) < TOLERANCE
    ids, mask = padded_prompt()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=3)
    got = generate(model, ids, None, attention_mask=mask, max_new_tokens=6, num_beams=3)
    assert torch.equal(got.sequences, expected)


def test_the_correction_of_narrower_values_is_the_direct_sum():
    """The order-1 MomentKV estimate with values of another head dim than the keys, against its definition
    computed directly: ``o_E = vbar + s C_vk q``, ``lse_E = log n + s q.kbar``; merged with the retained
    attention, whose kernel falls back from the fused one (it takes one head size)."""
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(40, 16, generator=generator), torch.randn(40, 24, generator=generator)
    query = torch.randn(3, 5, 16, generator=generator)  # [G, q, d]
    sums = MomentSums(1, 16, value_dim=24)
    sums.add(0, keys[:30], values[:30])
    prepared = PreparedMoments(sums, [1])
    out_E, lse_E = prepared.estimates(query[None], 0.25)
    k, v = keys[:30].double(), values[:30].double()
    kbar, vbar = k.mean(0), v.mean(0)
    cross = (v - vbar).T @ (k - kbar) / 30  # [24, 16]
    q = query.double()
    assert torch.allclose(out_E[0].double(), vbar + 0.25 * q @ cross.T, atol=1e-5)
    assert torch.allclose(lse_E[0].double(), torch.log(torch.tensor(30.0, dtype=torch.float64)) + 0.25 * q @ kbar)
    out_R, lse_R = attention_with_lse(query, keys[30:], values[30:], 0.25)
    logits = 0.25 * q @ keys[30:].double().T
    assert torch.allclose(out_R.double(), torch.softmax(logits, -1) @ values[30:].double(), atol=1e-5)
    assert merge_outputs(out_R, lse_R, out_E[0], lse_E[0]).shape == (3, 5, 24)


@pytest.mark.parametrize(
    "policy",
    [
        CompressionPolicy(compression_ratio=0.75, scorer="keydiff", correction="order1"),
        CompressionPolicy(compression_ratio=0.75, scorer="leverage", evict_every=2, correction="order1"),
        CompressionPolicy(compression_ratio=0.5, scorer="snapkv", correction="order1", moment_eviction=True),
    ],
    ids=["keydiff+correction", "leverage-while-decoding", "moment-eviction"],
)
@pytest.mark.parametrize("kernel", ["default", "pages"])
@torch.no_grad()
def test_compressed_serving_evicts_the_full_layers_alone(policy, kernel, monkeypatch):
    if kernel != "default":
        monkeypatch.setenv("KVCAL_DECODE_KERNEL", kernel)
    model = mimo()
    ids, mask = padded_prompt()
    result = generate(model, ids, policy, attention_mask=mask, max_new_tokens=5)
    assert result.new_tokens.shape == (2, 5)
    assert result.report.kv_bytes_after < 0.8 * result.report.kv_bytes_before
    assert torch.isfinite(torch.tensor(result.report.kv_bytes_after, dtype=torch.float64))


def test_a_profile_of_mimo_v2_flash_is_served_back(tmp_path, embedded_tokenizer, capsys):
    """Every stage of a smoke profile on the tiny MiMo-V2-Flash saved with the embedded tokenizer: the sections'
    layer axis is its two full-attention layers; ``evaluate-artifact`` runs on it; the flagship served from the
    artifact evicts and generates."""

    def check(reader):
        assert reader.model.head_dim == 16 and reader.section("budgets")["inf_kv"].shape == (2, 2)

    model = mimo(vocab_size=len(embedded_tokenizer))
    assert_profile_served_back(model, tmp_path, embedded_tokenizer, capsys, layers=2, check=check)
    from artifacts.cli import main as inspect_artifact

    capsys.readouterr()
    assert inspect_artifact([str(tmp_path / "kv_calibration.h5")]) == 0
    assert "2 KV heads, head dim 16 (values 24)," in capsys.readouterr().out


def test_kvzip_scores_equal_the_models_attention_over_the_reconstruction():
    """KVzip's reconstruction pass attends with values of their own head dim, and the sliding layers of other KV
    heads (and sinks) run as the model's: the scores of the full-attention layers are those of one forward pass of
    context and chunk (the model's own eager attention)."""
    from test_runtime_leverage_kvzip import ToyTokenizer, naive_kvzip

    from runtime.compression.kvzip import kvzip_scores, reconstruction_chunks

    model, tokenizer = mimo(), ToyTokenizer()
    context = [1] + torch.randint(3, 120, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, torch.tensor([context]))
    scores = kvzip_scores(model, tokenizer, cache, context, chunk_size=23, overlap=4)
    assert scores.scores.shape == (2, 2, 51)
    chunks = reconstruction_chunks(tokenizer, context, 1, tokenizer("\n", add_special_tokens=False)["input_ids"], 23, 4)
    want = naive_kvzip(model, context, chunks, sink=1)
    torch.testing.assert_close(scores.scores.double(), want, rtol=1e-4, atol=1e-6)


@torch.no_grad()
def test_a_block_wise_prefill_with_nothing_evicted_answers_as_the_unmodified_model():
    """Blocks of 16 columns: each block attends the rows stored before it and itself (values of their own head dim
    through the page kernel, the fused CPU kernel taking one head size), as one forward pass would."""
    model = mimo()
    ids, mask = padded_prompt()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    got = generate(model, ids, None, attention_mask=mask, max_new_tokens=5, block_size=16)
    assert torch.equal(got.sequences, expected)


@torch.no_grad()
def test_the_value_read_is_what_the_cache_holds():
    """The profiler's read of a layer's values (``v_proj``'s output times ``v_scale``, as the model scales them before
    caching) equals what the cache holds, for every head."""
    model = mimo()
    geometry = ModelGeometry.of(model)
    read = {}
    projection = geometry.value_projections[1]
    handle = projection.module.register_forward_hook(
        lambda _m, _i, output: read.update(v=projection.take(output))  # the last pass: the prefill
    )
    ids = torch.randint(3, 250, (1, 30), generator=torch.Generator().manual_seed(6))
    cache = RaggedCache.for_model(model)
    try:
        prefill(model, cache, ids)
    finally:
        handle.remove()
    layer = cache.attention_layers[1]
    for h in range(2):
        _, values, _ = layer.head(0, h)
        torch.testing.assert_close(values, read["v"][0, :, h], rtol=0, atol=1e-6)


def test_the_checkpoints_geometry_is_read_from_their_config():
    """transformers' MiMo-V2-Flash config (its checkpoints' numbers) built on the meta device, no weights: kvcal
    evicts its 9 full-attention layers of 4 KV heads (keys of 192, values of 128 scaled by 0.707, RoPE on 64 dims) and
    holds the 39 sliding layers apart."""
    config = T.MiMoV2FlashConfig()
    with torch.device("meta"):
        model = T.MiMoV2FlashForCausalLM(config)
    geometry = ModelGeometry.of(model)
    assert geometry.layer_indices == (0, 5, 11, 17, 23, 29, 35, 41, 47)
    assert (geometry.num_kv_heads, geometry.head_dim, geometry.value_head_dim) == (4, 192, 128)
    assert set(geometry.rotary_dims) == {64} and geometry.value_projections[0].scale == pytest.approx(0.707)
    assert attention_variant(config)["value_head_dim"] == 128
