"""KV sharing (Gemma 3n, Gemma 4 E2B / E4B: ``config.num_kv_shared_layers``): the model's last layers compute no keys
and values; each attends with its own queries to the cache of the last earlier layer of its type
(``artifacts.fingerprint.kv_shared_layers``).

kvcal profiles and evicts the layers that own a cache; a layer reading one attends over exactly what that layer
holds, evictions included (``RaggedLayer.attend_shared``), so an eviction in a source is an eviction in each of its
readers, as the model itself would see it.  Here, on tiny Gemma 3n and Gemma 4 of six layers (sliding and full
alternating) whose last two read layers 2 and 3: the layout and the fingerprint, nothing evicted exact, compressed
attention as full attention with each head's evicted positions masked in the source and its readers alike, eviction
inside the prefill, several questions, KVzip's reconstruction, replayed decode steps, transformers' own generate()
over the cache (Gemma 4 runs only the last prompt column through the readers there), and a whole profile served
back.
"""

from __future__ import annotations

import pytest
import torch
from test_hybrid_models import (
    assert_decode_steps_replayed,
    assert_profile_served_back,
    assert_questions_answered_as_each_alone,
)
from test_prefill_eviction import PARTIAL_LAYER_POLICIES, assert_prefill_eviction_is_prefill_then_compress
from test_runtime_cache import evicted_context, masked_reference_logits
from test_runtime_leverage_kvzip import ToyTokenizer, naive_kvzip

from artifacts.fingerprint import attention_variant, kv_shared_layers
from runtime import CompressionPolicy, RaggedCache, ragged_attention
from runtime.compression.kvzip import kvzip_scores, reconstruction_chunks
from runtime.compression.prefill import prefill
from runtime.kv_store.transformers_compat import cache_argument
from runtime.math.geometry import ModelGeometry, UnsupportedModelError, check_config
from runtime.serve.generation import compress_prompt, generate

# conftest: one torch thread
pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_TYPES = ["sliding_attention", "full_attention"] * 3
READERS = {4: 2, 5: 3}  # the last two layers read the last sliding and the last full layer before them
MODEL_TYPES = ["gemma3n_text", "gemma4_text"]


def sharing(model_type: str, vocab_size: int = 512, **options):
    """A tiny ``model_type`` of six layers whose last two read layers 2 and 3's caches; a window of 32; random
    weights of seed 0, float32."""
    from test_architecture_matrix import tiny_model

    size = dict(vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size)
    return tiny_model(
        model_type, num_hidden_layers=6, layer_types=LAYER_TYPES, num_kv_shared_layers=2, **size, **options
    )


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_layers_reading_another_layers_cache_hold_none(model_type):
    model = sharing(model_type)
    config = model.config
    assert kv_shared_layers(config) == READERS
    modes = getattr(config, "kv_sharing_modes", None)  # transformers' own account (5.2 reads it per module)
    if modes is not None:
        assert [index for index, mode in enumerate(modes) if mode == "reuse"] == [4, 5]
        assert {index for index, mode in enumerate(modes) if mode == "store"} == {2, 3}
    geometry = ModelGeometry.of(model)
    cache = RaggedCache.for_model(model)
    assert len(cache.layers) == 4  # as transformers' own DynamicCache: none for the readers
    if model_type == "gemma3n_text":  # sliding and full layers of one geometry: the artifact's L is both
        assert geometry.layer_indices == (0, 1, 2, 3)
    else:  # Gemma 4: its full layers alone, the sliding ones held apart
        assert geometry.layer_indices == (1, 3) and cache.window_layers.keys() == {0, 2}
    assert [layer.shared_by for layer in cache.layers] == [0, 0, 1, 1]
    assert [geometry.layer_of(model.model.layers[i].self_attn) for i in (4, 5)] == [None, None]
    assert attention_variant(config)["kv_shared_layers"] == [[4, 2], [5, 3]]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@torch.no_grad()
def test_nothing_evicted_is_the_models_own(model_type):
    from test_architecture_matrix import nothing_evicted_difference

    model = sharing(model_type)
    assert nothing_evicted_difference(model) < 1e-4
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(2))
    beams = dict(num_beams=2, num_return_sequences=2, max_new_tokens=5, do_sample=False)
    assert torch.equal(generate(model, ids, None, **beams).sequences, model.generate(ids, **beams))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@torch.no_grad()
def test_compressed_attention_is_full_attention_masked_in_the_source_and_its_readers(model_type):
    """A prompt compressed to a quarter (keydiff, INF-free uniform budgets), then decode steps fed one by one: every
    row's logits are full attention where each KV head of a layer that owns a cache, and of the layers reading it,
    cannot see the context positions the source evicted."""
    model = sharing(model_type)
    context, steps = 80, 4
    ids = torch.randint(3, 500, (2, context + steps), generator=torch.Generator().manual_seed(5))
    policy = CompressionPolicy(keep_ratio=0.25, scorer="keydiff", n_sink=2, window=4)
    with ragged_attention(model):
        cache, report = compress_prompt(model, ids, policy, context_columns=context)
        # what each head holds of the context before decoding (a sliding layer drops more as it decodes)
        evicted = [evicted_context(cache, row, context) for row in range(2)]
        logits = torch.cat(
            [model(ids[:, t : t + 1], **cache_argument(model, cache)).logits for t in range(context, context + steps)],
            dim=1,
        )
    assert report.kv_bytes_after < report.kv_bytes_before / 2
    for row in range(2):
        hidden = {**evicted[row], **{reader: evicted[row][source] for reader, source in READERS.items()}}
        assert all(hidden[reader].any() for reader in READERS)
        reference = masked_reference_logits(model, ids[row : row + 1], hidden, context)
        torch.testing.assert_close(logits[row], reference[0, context:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("policy", PARTIAL_LAYER_POLICIES, ids=repr)
@torch.no_grad()
def test_evicting_inside_the_prefill_keeps_what_prefill_then_compress_keeps(model_type, policy):
    model = sharing(model_type)
    assert_prefill_eviction_is_prefill_then_compress(model, policy, len(ModelGeometry.of(model).layer_indices))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@torch.no_grad()
def test_several_questions_about_one_context_are_answered_as_each_alone(model_type):
    assert_questions_answered_as_each_alone(sharing(model_type), 500, 100, 6)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_kvzip_scores_equal_the_models_attention_over_the_reconstruction(model_type):
    """The readers attend in each reconstruction chunk's forward pass, scoring nothing (they follow every layer
    scored): the scores are those of one forward pass of context and chunk."""
    model = sharing(model_type)
    tokenizer = ToyTokenizer()
    context = [1] + torch.randint(3, 120, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, torch.tensor([context]))
    scores = kvzip_scores(model, tokenizer, cache, context, chunk_size=23, overlap=4)
    assert scores.scores.shape[0] == len(ModelGeometry.of(model).layer_indices)
    chunks = reconstruction_chunks(tokenizer, context, 1, tokenizer("\n", add_special_tokens=False)["input_ids"], 23, 4)
    want = naive_kvzip(model, context, chunks, sink=1)
    torch.testing.assert_close(scores.scores.double(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@torch.no_grad()
def test_transformers_generate_over_the_cache_is_the_models_own(model_type):
    """transformers' generate() given an empty RaggedCache (its prefill keeps one column of logits, so Gemma 4 runs
    only the prompt's last column through the readers) answers as the model without it."""
    model = sharing(model_type)
    ids = torch.randint(3, 500, (1, 50), generator=torch.Generator().manual_seed(6))
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, **options)
    with ragged_attention(model):
        got = model.generate(ids, **options, **cache_argument(model, RaggedCache.for_model(model)))
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_gemma4s_readers_attend_only_the_columns_it_runs_through_them(monkeypatch):
    """transformers' Gemma 4 runs a prefill's readers over the columns whose logits it keeps alone (kvcal's prefill
    keeps one): each reader attends those queries over the chunk (``chunk_only_attention``: ``t q`` logits), not
    the whole chunk's ``q^2``, and the answer is the model's own."""
    import runtime.kv_store.layer_attention as layer_attention

    model = sharing("gemma4_text")
    calls = []
    own = layer_attention._chunk_tail_attention
    monkeypatch.setattr(
        layer_attention, "_chunk_tail_attention", lambda query, *a: calls.append(query.shape[2]) or own(query, *a)
    )
    ids = torch.randint(3, 500, (1, 90), generator=torch.Generator().manual_seed(7))
    result = generate(model, ids, None, max_new_tokens=3)
    # the prompt's forward pass: readers 4 and 5, one query each (transformers before 5.24, 5.17 checked, runs every
    # column through them: their whole chunk, no fewer queries)
    assert calls == ([1, 1] if hasattr(model.model, "_maybe_slice_kv_shared_inputs") else [])
    assert torch.equal(result.sequences, model.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("policy", [None, CompressionPolicy(compression_ratio=0.75, scorer="keydiff")], ids=repr)
def test_decode_steps_are_replayed(model_type, policy, monkeypatch):
    """With the page kernel a GPU runs, decode steps (the readers attending in the captured step) replay from a graph
    (tests/step_replay.py's recorder on the CPU) and generate what eager steps generate."""
    import transformers as T
    from packaging.version import Version

    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

    if Version(T.__version__) < Version("5.24") and model_type == "gemma3n_text":
        pytest.skip(
            "transformers' Gemma 3n before 5.24 (5.2 and 5.17 checked) makes a scalar tensor in every step outside "
            "torch's dispatcher (with or without KV sharing), which tests/step_replay.py's recorder refuses"
        )
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    assert_decode_steps_replayed(sharing(model_type), policy, new_tokens=12)


def test_a_model_whose_layers_all_read_another_models_cache_is_refused_by_name():
    from test_architecture_matrix import tiny_config

    config = tiny_config("gemma3n_text", layer_types=["sliding_attention", "full_attention"] * 2)
    config.num_kv_shared_layers = 4
    with pytest.raises(UnsupportedModelError, match=r"layer 0 \(sliding_attention\) would attend to the cache of no"):
        check_config(config)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_profile_is_served_back(model_type, tmp_path, embedded_tokenizer, capsys):
    """Every stage of a smoke profile on the tiny model saved with the embedded tokenizer: the sections' layer axis
    is its layers that own a cache; ``evaluate-artifact`` runs on it; the flagship served from the artifact evicts
    and generates."""
    model = sharing(model_type, vocab_size=len(embedded_tokenizer))
    layers = len(ModelGeometry.of(model).layer_indices)
    assert_profile_served_back(model, tmp_path, embedded_tokenizer, capsys, layers=layers)


@torch.no_grad()
def test_gemma4_e2b_e4b_as_checkpoints_ship_are_served_as_their_language_model_alone():
    """Gemma 4 E2B / E4B are multimodal checkpoints whose language model shares KV: the wrapper (vision tower beside
    it) gives the language model's text logits, nothing evicted is exact, and a compressed cache holds, head by
    head, what the language model's own holds."""
    import transformers as T
    from test_architecture_matrix import TOLERANCE, built, nothing_evicted_difference
    from test_multimodal_checkpoints import GEMMA4_TEXT, _gemma4, language_model_alone
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {T.__version__} has no Gemma 4")
    text = dict(GEMMA4_TEXT, num_hidden_layers=6, layer_types=LAYER_TYPES, num_kv_shared_layers=2)
    wrapper = built(T.Gemma4ForConditionalGeneration, CONFIG_MAPPING["gemma4"](**_gemma4(text)))
    alone = language_model_alone(wrapper)
    ids = torch.randint(3, 250, (1, 80), generator=torch.Generator().manual_seed(3))
    assert (wrapper(ids).logits - alone(ids).logits).abs().max() < 1e-5
    assert nothing_evicted_difference(wrapper) < TOLERANCE
    policy = CompressionPolicy(keep_ratio=0.25)  # leverage
    (cache, report), (own, _) = (compress_prompt(model, ids, policy, context_columns=70) for model in (wrapper, alone))
    assert report.lengths_after.sum() < report.lengths_before.sum() / 2
    for served, expected in zip(cache.attention_layers, own.attention_layers, strict=True):
        for head in range(served.store.num_heads):
            for got, want in zip(served.head(0, head), expected.head(0, head), strict=True):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    results = [generate(model, ids, policy, context_columns=70, max_new_tokens=6) for model in (wrapper, alone)]
    assert torch.equal(results[0].sequences, results[1].sequences)


@pytest.mark.slow
def test_a_gemma4_e2b_e4b_checkpoint_profiles_and_serves(tmp_path, embedded_tokenizer, capsys):
    """Every stage of a smoke profile on a saved multimodal Gemma 4 whose language model shares KV (as E2B / E4B
    ship), loaded whole as ``profile-model`` loads it: the artifact covers its full layers that own a cache, records
    which layer reads which, ``evaluate-artifact`` runs on it, and the flagship served from it evicts and generates."""
    import transformers as T
    from test_architecture_matrix import built
    from test_multimodal_checkpoints import GEMMA4_TEXT, VOCABULARY, _gemma4
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "gemma4" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {T.__version__} has no Gemma 4")
    vocabulary = len(embedded_tokenizer)
    # the probes' tasks need more than the multimodal tests' 512 positions
    shape = dict(num_hidden_layers=6, layer_types=LAYER_TYPES, vocab_size=vocabulary, max_position_embeddings=1024)
    text = {**GEMMA4_TEXT, **shape, "num_kv_shared_layers": 2}
    arguments = _gemma4(text)
    for name in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id"):  # at the vocabulary's end
        arguments[name] += vocabulary - VOCABULARY
    wrapper = built(T.Gemma4ForConditionalGeneration, CONFIG_MAPPING["gemma4"](**arguments))

    def check(reader):  # which layer reads which, in the fingerprint
        assert '"kv_shared_layers":[[4,2],[5,3]]' in reader.model.attention_variant.replace(" ", "")

    assert_profile_served_back(wrapper, tmp_path, embedded_tokenizer, capsys, layers=2, check=check)
