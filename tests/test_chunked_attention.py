"""Llama 4's chunked attention past its first chunk: a chunked layer's query at RoPE position ``p`` sees a key at
``k`` only when ``k <= p`` and both lie in one chunk of ``attention_chunk_size`` positions (``k // C == p // C``,
transformers' ``chunked_overlay``, which counts a left-padded row's positions from its first real token).

Served by the ragged cache as transformers' own sliding-window cache layer serves it: each chunk's keys
attend within their chunk (the chunk's masks), and after every forward pass a chunked layer drops what its
next query cannot see (everything before that query's chunk), so a decode step attends every row it holds.
The references are the unmodified model's own ``generate`` (nothing evicted) and, with eviction, the
two-step prefill then compress (tests/test_prefill_eviction.py)."""

from __future__ import annotations

import pytest
import torch
from test_prefill_eviction import POLICIES, assert_same_cache, greedy_logits, one_step, two_step
from test_rope_forms import PROMPT, STEPS, _llama4, _llama4_with_chunks, _prompt, assert_served_exactly

from runtime import CompressionPolicy, RaggedCache, bind, compress_prompt, generate, ragged_attention
from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

CHUNKED = (0, 1, 2)  # the tiny Llama 4's chunked layers (layer 3 attends to everything, without RoPE)


@pytest.mark.parametrize("chunk", [64, 50, PROMPT])
def test_llama4_is_served_exactly_across_its_attention_chunks(chunk):
    """Nothing evicted, a left-padded batch (rows of 300 and 260 tokens) and 20 new tokens: the unmodified
    model's tokens and every step's logits.  64: the prompts cross four chunk boundaries and the padded row's
    generation one more; 300: the unpadded row's first new token opens a chunk.  Refused past the first chunk
    before (``more than the model's attention chunk``)."""
    assert_served_exactly(_llama4_with_chunks(chunk))


@torch.no_grad()
def test_a_chunked_layer_holds_only_what_its_next_query_sees():
    """After the prompt a chunked layer holds each row's tokens of the chunk its next token falls in (its real
    tokens modulo the chunk), the full-attention layer every token."""
    model = _llama4_with_chunks(64)
    ids, mask = _prompt()
    cache, _ = compress_prompt(model, ids, None, attention_mask=mask)
    real = [int(n) for n in mask[:, :-1].sum(1)]  # compress_prompt leaves the last column to generate()
    for index, layer in enumerate(cache.attention_layers):
        expected = [n % 64 for n in real] if index in CHUNKED else real
        assert [int(n) for n in layer.length[:, 0]] == expected, index
        assert layer.real_seen == real


@pytest.mark.parametrize("name", sorted(POLICIES))  # tests/test_prefill_eviction.py's
@torch.no_grad()
def test_evicting_inside_the_prefill_keeps_what_prefill_then_compress_keeps(name):
    """A chunked layer's budgets are those of what it holds (a ratio of its current chunk), and eviction inside
    the prefill keeps what prefill then compress keeps; decoding from either gives the same tokens."""
    model = _llama4_with_chunks(64)
    ids, mask = _prompt()
    plan = bind(POLICIES[name], None, model)
    reference, expected = two_step(model, ids[:, :280], mask[:, :280], plan)
    cache, report = one_step(model, ids[:, :280], mask[:, :280], plan)
    assert_same_cache(cache, reference)
    assert (report.budgets == expected.budgets).all()
    held = [280 % 64, 240 % 64]  # real tokens of the two rows modulo the chunk
    if POLICIES[name].budget is None:
        for b, n in enumerate(held):
            assert (report.budgets[b, list(CHUNKED)] == plan.head_budgets(n)[list(CHUNKED)]).all()
    for index in CHUNKED:
        assert (cache.attention_layers[index].length <= torch.tensor(held)[:, None]).all()
    sequences, logits = greedy_logits(model, cache, ids, mask)
    expected_sequences, expected_logits = greedy_logits(model, reference, ids, mask)
    assert torch.equal(sequences, expected_sequences)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("block_size", [40, 64])
@torch.no_grad()
def test_the_blockwise_prefill_is_exact_across_chunks(block_size):
    """Blocks that straddle chunk boundaries (40) or meet them (64) attend over the rows held before them within
    each query's chunk: nothing evicted, the unmodified model's logits."""
    model = _llama4_with_chunks(64)
    ids, mask = _prompt()
    options = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, attention_mask=mask, **options)
    got = generate(model, ids, None, attention_mask=mask, block_size=block_size, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.output.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@torch.no_grad()
def test_a_question_crossing_a_chunk_boundary_sees_only_its_chunk():
    """Question-agnostic compression (the context compressed alone, the question a later chunk of the prefill
    that crosses a chunk boundary): nothing evicted, the unmodified model's logits."""
    model = _llama4_with_chunks(64)
    ids, mask = _prompt()
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, attention_mask=mask, **options)
    got = generate(model, ids, None, attention_mask=mask, context_columns=250, **options)  # 250..299 cross 256
    for a, b in zip(got.output.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("policy", [None, CompressionPolicy(compression_ratio=0.75, scorer="keydiff")], ids=repr)
def test_decode_steps_across_a_chunk_boundary_are_replayed(policy, monkeypatch):
    """With the page kernel a GPU runs, decode steps replay from a graph (tests/step_replay.py's recorder on the
    CPU) but the one after which a chunked layer drops its chunk, which runs eagerly: the tokens and logits of
    eager steps."""
    from step_replay import RecordedStep

    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    model = _llama4_with_chunks(64)
    ids, mask = _prompt()  # the rows' next positions 300 and 260: boundaries at 320 (step 20) and 320 (step 60)
    runs = []
    for graphs in (False, RecordedStep):
        with ragged_attention(model):
            result = generate(
                model,
                ids,
                policy,
                attention_mask=mask,
                decode_graphs=graphs,
                max_new_tokens=STEPS + 4,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        runs.append(result)
    eager, replayed = runs
    assert torch.equal(eager.sequences, replayed.sequences)
    # equal up to the step whose chunked layers drop; after it the two stores hold the rows in pages of other
    # capacities (a replayed generation reserves room for all its steps), so the page kernel sums in another
    # order: float32 rounding (1.7e-5 at most here)
    for a, b in zip(eager.output.logits, replayed.output.logits, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    assert replayed.graphs.replayed >= STEPS - 4  # all but the first steps and the one before the drop


@torch.no_grad()
def test_a_padded_row_is_compressed_as_it_is_alone():
    """Llama 4's layers are not handed their position ids: the ragged attention numbers a chunk's real tokens
    from those seen, padding not counted (it counted padding columns before, so a left-padded row's keys were
    stored 40 positions late: its RoPE scorer un-rotated them wrongly and its chunks were cut elsewhere).  The
    padded row keeps, head by head, the positions it keeps alone."""
    for chunk in (64, None):
        model = _llama4_with_chunks(64) if chunk else _llama4(attention_chunk_size=None)
        if chunk is None and "chunked_attention" in model.config.layer_types:
            continue  # transformers 5.2 types it chunked without a chunk size (tests/test_rope_forms.py)
        ids, mask = _prompt()
        policy = CompressionPolicy(keep_ratio=0.25)  # leverage: reads the stored keys' RoPE
        batch, _ = compress_prompt(model, ids, policy, attention_mask=mask)
        alone, _ = compress_prompt(model, ids[1:, 40:], policy)
        for index, (mine, theirs) in enumerate(zip(batch.attention_layers, alone.attention_layers, strict=True)):
            for h in range(mine.num_heads):
                assert torch.equal(mine.head(1, h)[2], theirs.head(0, h)[2]), (chunk, index, h)


def test_kvzip_past_the_first_chunk_is_refused_by_name():
    """KVzip scores a context by the attention of its reconstruction, fed after it: past the first chunk a chunked
    layer's reconstruction queries see only their own chunk, not the context.  Refused, naming the chunk; inside
    it, scored."""
    from test_runtime_leverage_kvzip import ToyTokenizer

    from runtime.compression.kvzip import kvzip_scores
    from runtime.compression.prefill import prefill

    context = [1] + list(range(3, 60))
    for chunk, refused in ((64, True), (1000, False)):
        model = _llama4_with_chunks(chunk)
        cache = RaggedCache.for_model(model)
        prefill(model, cache, torch.tensor([context]))
        if refused:
            with pytest.raises(ValueError, match=r"past the model's first attention chunk of 64 positions"):
                kvzip_scores(model, ToyTokenizer(), cache, context)
        else:
            assert kvzip_scores(model, ToyTokenizer(), cache, context).scores.shape == (4, 2, 58)


@torch.no_grad()
def test_beams_across_a_chunk_boundary_are_transformers_own():
    """Beam search (two beams, both returned) over a generation that opens a chunk in both rows (prompts of 60 and 40
    real tokens, chunks of 64): beams reorder the cache's rows, each keeping its chunk; nothing evicted, the
    unmodified model's sequences and scores."""
    model = _llama4_with_chunks(64)
    ids, mask = _prompt()
    ids, mask = ids[:, -60:].clone(), mask[:, -60:].clone()
    mask[1, :20], ids[1, :20] = 0, 0
    beams = dict(
        num_beams=2, num_return_sequences=2, max_new_tokens=30, do_sample=False, output_scores=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    expected = model.generate(ids, attention_mask=mask, **beams)
    got = generate(model, ids, None, attention_mask=mask, **beams)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.output.scores, expected.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@torch.no_grad()
def test_several_questions_about_one_context_are_answered_as_each_alone():
    """One context of 120 tokens compressed once and copied to every question's row (``answer``'s path), the
    questions of 12 tokens crossing the chunk boundary at 128: each answer is that of the question asked alone."""
    from test_hybrid_models import assert_questions_answered_as_each_alone

    assert_questions_answered_as_each_alone(_llama4_with_chunks(64), 256, 120, 12)
