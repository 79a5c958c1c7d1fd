"""Gemma 4: full-attention layers of one geometry (by transformers' defaults a head dim of 512, against 256; fewer
KV heads under ``attention_k_eq_v``, whose values are the keys; proportional RoPE over a quarter of the head)
beside sliding-window layers of another, in one heterogeneous config (transformers' ``per_layer_config``).

kvcal profiles and evicts the full-attention layers, whose caches grow with the context; the sliding layers,
bounded by their window, are held apart in ``RaggedLayer``s of their own geometry inside the same ``RaggedCache``
(``RaggedCache.window_layers``; ``artifacts.fingerprint.sliding_layers_apart``), each row's window of real tokens,
never evicted.  tests/test_architecture_matrix.py checks nothing evicted is exact, beams are transformers' own and
the flagship serves.  Here, on a tiny Gemma 4 whose full-attention layers are decoder layers 1 and 3 and whose
prompts run past the sliding window: the layout and the artifact's numbers, the values read as the model caches
them, eviction inside the prefill, copies, stacks and several questions, KVzip's reconstruction, padding inside
rows, the block-wise prefill of a padded batch, replayed decode steps, and a whole profile served back.
"""

from __future__ import annotations

import pytest
import torch
from test_hybrid_models import (
    assert_decode_steps_replayed,
    assert_profile_served_back,
    assert_questions_answered_as_each_alone,
    decode_from_cache,
    padded_prompt,
)
from test_prefill_eviction import PARTIAL_LAYER_POLICIES, assert_prefill_eviction_is_prefill_then_compress
from test_runtime_leverage_kvzip import ToyTokenizer, naive_kvzip

from artifacts.fingerprint import architecture_numbers, attention_variant
from runtime import CompressionPolicy, RaggedCache
from runtime.compression.kvzip import kvzip_scores, reconstruction_chunks
from runtime.compression.prefill import prefill
from runtime.math.geometry import ModelGeometry, UnsupportedModelError, check_config
from runtime.serve.generation import compress_prompt, generate

# conftest: one torch thread; each test skips where transformers has no Gemma 4 (5.2: gemma4() skips)
pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
WINDOW = 32


def gemma4(vocab_size: int = 512, **options):
    """A tiny Gemma 4 (text): sliding layers 0 and 2 of 2 KV heads x 16, full-attention layers 1 and 3 of 1 KV
    head x 32 whose values are their keys, a window of 32, per-layer inputs; random weights of seed 0, float32."""
    from test_architecture_matrix import tiny_model

    size = dict(vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size)
    return tiny_model("gemma4_text", sliding_window=WINDOW, **size, **options)


def test_kvcal_holds_the_full_attention_layers_and_transformers_the_sliding_ones():
    model = gemma4()
    geometry = ModelGeometry.of(model)
    assert (geometry.num_layers, geometry.layer_indices, geometry.num_kv_heads, geometry.head_dim) == (2, (1, 3), 1, 32)
    assert geometry.sliding_windows == (None, None)
    cache = RaggedCache.for_model(model)
    assert cache.window_layers.keys() == {0, 2} and cache.attention_layers == [cache.layers[1], cache.layers[3]]
    assert cache.ragged_layers == cache.layers and not cache.recurrent_layers and not cache.holds_recurrent_states
    ids, mask = padded_prompt()
    compressed, _ = compress_prompt(model, ids, CompressionPolicy(keep_ratio=0.25), attention_mask=mask)
    sliding = compressed.layers[0]  # each row's window of real tokens (W - 1 between forward passes), 2 x 16 wide
    assert (sliding.window, sliding.num_heads, sliding.head_dim) == (WINDOW, 2, 16)
    assert sliding.length.tolist() == [[WINDOW - 1] * 2] * 2
    full = compressed.layers[1]  # a quarter of each row's real tokens, 1 x 32 wide
    assert (full.num_heads, full.head_dim) == (1, 32) and full.length.sum() < (119 + 102) / 2
    # the artifact: L counts the full-attention layers, of their geometry; which they are is in the fingerprint
    numbers = architecture_numbers(model.config)
    assert (numbers["num_layers"], numbers["num_kv_heads"], numbers["head_dim"]) == (2, 1, 32)
    assert attention_variant(model.config)["attention_layers"] == [1, 3]
    wider = gemma4(global_head_dim=64).config
    assert architecture_numbers(wider)["head_dim"] == 64 and architecture_numbers(wider) != numbers


@pytest.mark.parametrize("variant", ["attention_k_eq_v", "v_proj", "gemma3n"])
@torch.no_grad()
def test_the_values_read_are_the_values_the_model_caches(variant):
    """The profiler reads each layer's values off a projection (``geometry.value_projections``; the learned
    scorer's features, which the runtime computes from the cached values): under ``attention_k_eq_v`` the key
    projection's output, through ``v_norm`` (a norm without a weight); with a ``v_proj``, its output through
    ``v_norm`` too, Gemma 3n's as well (read before its ``v_norm`` until now).  Each equals what the model's own
    cache holds."""
    from test_architecture_matrix import tiny_model

    if variant == "gemma3n":
        model = tiny_model("gemma3n_text", vocab_size=512, vocab_size_per_layer_input=512)
    else:
        model = gemma4(attention_k_eq_v=variant == "attention_k_eq_v")
    geometry = ModelGeometry.of(model)
    ids = torch.randint(3, 500, (1, 20), generator=torch.Generator().manual_seed(5))
    taken = {}

    def read(layer, projection):
        def hook(_module, _args, output):
            taken[layer] = projection.take(output)

        return hook

    hooks = [
        projection.module.register_forward_hook(read(layer, projection))
        for layer, projection in enumerate(geometry.value_projections)
    ]
    try:
        cache = model(ids, use_cache=True).past_key_values
    finally:
        for hook in hooks:
            hook.remove()
    for layer, index in enumerate(geometry.layer_indices):
        cached = cache.layers[index].values  # [1, Hkv, T, d]
        torch.testing.assert_close(taken[layer].transpose(1, 2), cached, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", PARTIAL_LAYER_POLICIES, ids=repr)
@torch.no_grad()
def test_evicting_inside_the_prefill_keeps_what_prefill_then_compress_keeps(policy):
    assert_prefill_eviction_is_prefill_then_compress(gemma4(), policy, layers=2)


@torch.no_grad()
def test_copies_and_stacks_answer_as_each_cache_alone():
    """A stack of two caches compressed under two policies answers, row by row, as each alone: the sliding
    layers' keys and values are stacked with the rows (before this, a stack kept the first cache's sliding
    layers alone); decoding a copy leaves the original's sliding layers as they were."""
    model = gemma4()
    ids, mask = padded_prompt()
    cache, report = compress_prompt(
        model, ids, CompressionPolicy(keep_ratio=0.25), attention_mask=mask, context_columns=110
    )
    sliding = {index: (layer.keys.clone(), layer.values.clone()) for index, layer in cache.recurrent_layers.items()}
    first = decode_from_cache(model, ids, mask, cache.copy(), report)
    second = decode_from_cache(model, ids, mask, cache.copy(), report)
    assert torch.equal(first.sequences, second.sequences)
    for index, layer in cache.recurrent_layers.items():
        assert torch.equal(layer.keys, sliding[index][0]) and torch.equal(layer.values, sliding[index][1])
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    other, other_report = compress_prompt(model, ids.flip(0), policy, attention_mask=mask.flip(0), context_columns=110)
    alone = decode_from_cache(model, ids.flip(0), mask.flip(0), other.copy(), other_report)
    stacked = RaggedCache.stack([cache, other])
    rows = decode_from_cache(model, torch.cat([ids, ids.flip(0)]), torch.cat([mask, mask.flip(0)]), stacked, report)
    assert torch.equal(rows.sequences[:2], first.sequences) and torch.equal(rows.sequences[2:], alone.sequences)


@torch.no_grad()
def test_several_questions_about_one_context_are_answered_as_each_alone(embedded_tokenizer):
    """The sliding layers are repeated with the cache's rows; questions of several lengths are answered together,
    padded between the context and the question, and each as alone."""
    from runtime import answer

    assert_questions_answered_as_each_alone(gemma4(), 500, 100, 6)
    model = gemma4(vocab_size=len(embedded_tokenizer))
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    context = "The harbour master logged every ship that came in, and the pilot boats too. " * 3
    questions = ["Who logged ships?", "What did the harbour master log, and since when did he keep it?", "Who?"]
    alone = [answer(model, embedded_tokenizer, context, question, policy, max_new_tokens=5) for question in questions]
    assert answer(model, embedded_tokenizer, context, questions, policy, max_new_tokens=5) == alone


@pytest.mark.parametrize("chunk_size", [64, 23])
def test_kvzip_scores_equal_the_models_attention_over_the_reconstruction(chunk_size):
    """Each reconstruction chunk follows the context in the sliding layers too (their window of the context,
    restored before every chunk): the scores are those of one forward pass of context and chunk."""
    model = gemma4()
    tokenizer = ToyTokenizer()
    context = [1] + torch.randint(3, 120, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, torch.tensor([context]))
    sliding = {index: layer.keys.clone() for index, layer in cache.recurrent_layers.items()}
    scores = kvzip_scores(model, tokenizer, cache, context, chunk_size=chunk_size, overlap=4)
    assert scores.scores.shape == (2, 1, 51)
    assert all(torch.equal(cache.layers[index].keys, keys) for index, keys in sliding.items())  # untouched
    chunks = reconstruction_chunks(
        tokenizer, context, 1, tokenizer("\n", add_special_tokens=False)["input_ids"], chunk_size, 4
    )
    want = naive_kvzip(model, context, chunks, sink=1)
    torch.testing.assert_close(scores.scores.double(), want, rtol=1e-4, atol=1e-6)


@torch.no_grad()
def test_the_block_wise_prefill_of_a_padded_batch_answers_each_row_as_alone():
    """The block-wise prefill lays out each row's own blocks (runtime.serve.generation.row_blocks), padding
    between them, which the sliding layers never store: with nothing evicted each row's answer is the unmodified
    model's on that row alone, and with tokens evicted the row's own in blocks alone."""
    model = gemma4()
    ids, mask = padded_prompt()
    keep_all = CompressionPolicy(keep_ratio=1.0, scorer="keydiff")
    blocks = generate(model, ids, keep_all, attention_mask=mask, context_columns=110, block_size=40, max_new_tokens=6)
    policy = CompressionPolicy(keep_ratio=0.25, scorer="keydiff")
    evicted = generate(model, ids, policy, attention_mask=mask, context_columns=110, block_size=40, max_new_tokens=6)
    for row in range(2):
        real = ids[row : row + 1, int((mask[row] == 0).sum()) :]
        plain = model.generate(real, max_new_tokens=6, do_sample=False)
        assert blocks.new_tokens[row].tolist() == plain[0, real.shape[1] :].tolist()
        columns = 110 - (ids.shape[1] - real.shape[1])
        alone = generate(model, real, policy, context_columns=columns, block_size=40, max_new_tokens=6)
        assert evicted.new_tokens[row].tolist() == alone.new_tokens[0].tolist()


def test_full_attention_layers_of_two_geometries_are_refused_by_name():
    """A per-layer config may give full-attention layers geometries of their own (transformers' Gemma 4 then
    fails to build its rotary embedding): kvcal's artifact has one, and its config check, which the commands run
    on config.json before any weight loads, says so."""
    config = gemma4(meta=True).config
    overrides = {1: {"head_dim": 32}, 3: {"head_dim": 64}}
    other = type(config)(**{**config.to_dict(), "per_layer_config": overrides})
    with pytest.raises(UnsupportedModelError, match=r"its full-attention layers differ in head_dim"):
        check_config(other)
    # and more than the geometry varying (a window per layer, here): refused as before
    overrides = {0: {"sliding_window": 16}, 1: {"head_dim": 32}, 3: {"head_dim": 32}}
    other = type(config)(**{**config.to_dict(), "per_layer_config": overrides})
    with pytest.raises(UnsupportedModelError, match=r"a heterogeneous config \(attributes that vary per layer: head_d"):
        check_config(other)


def test_a_profile_of_gemma4_is_served_back(tmp_path, embedded_tokenizer, capsys):
    """Every stage of a smoke profile on the tiny Gemma 4 saved with the embedded tokenizer: the sections' layer
    axis is its two full-attention layers; ``evaluate-artifact`` runs on it; the flagship served from the artifact
    evicts in both and generates."""

    def check(reader):
        assert reader.model.head_dim == 32 and reader.section("budgets")["inf_kv"].shape == (2, 1)

    model = gemma4(vocab_size=len(embedded_tokenizer))
    assert_profile_served_back(model, tmp_path, embedded_tokenizer, capsys, layers=2, check=check)


@torch.no_grad()
def test_padding_between_a_rows_tokens_is_served_as_each_row_alone():
    """Each sliding layer's window counts a row's real tokens, padding never stored: a question-agnostic batch
    whose questions differ in length (``[pad, context, pad, question]``) answers each row as alone (transformers'
    own sliding layers would count the padding in the window)."""
    from runtime.serve.generation import build_inputs

    model = gemma4()
    generator = torch.Generator().manual_seed(4)
    contexts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (60, 45)]
    questions = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (6, 19)]
    ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)
    assert mask[0].tolist().count(0) == 13 and mask[0, -1] == 1  # padded between its context and question
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    options = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    together = generate(model, ids, policy, attention_mask=mask, context_columns=columns, **options)
    for row, (context, question) in enumerate(zip(contexts, questions, strict=True)):
        alone_ids, alone_mask, alone_columns = build_inputs([context], [question], pad_token_id=0)
        alone = generate(model, alone_ids, policy, attention_mask=alone_mask, context_columns=alone_columns, **options)
        assert together.new_tokens[row].tolist() == alone.new_tokens[0].tolist()
        for step, logits in enumerate(together.logits):
            torch.testing.assert_close(logits[row], alone.logits[step][0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", [None, CompressionPolicy(compression_ratio=0.75, scorer="keydiff")], ids=repr)
def test_decode_steps_are_replayed(policy, monkeypatch):
    """With the page kernel a GPU runs, Gemma 4's decode steps (the sliding layers hiding what leaves their window,
    as Gemma 3's) replay from a graph (tests/step_replay.py's recorder on the CPU) and generate what eager steps
    generate."""
    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    assert_decode_steps_replayed(gemma4(), policy, new_tokens=12)
