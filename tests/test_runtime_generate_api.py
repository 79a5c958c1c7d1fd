"""``runtime.generate`` and ``runtime.answer`` as users call ``generate()``: beam search and several
sequences per prompt (the compressed cache expanded and reordered with generate()'s rows),
``return_dict_in_generate``, and one context answering many questions (compressed once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from runtime import CompressionPolicy, RaggedCache, answer, generate, ragged_attention
from runtime.compression.prefill import compress, prefill
from runtime.kv_store.transformers_compat import cache_argument
from runtime.serve.generation import build_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def prompts(kind: str):
    """``input_ids [B, T]``, ``attention_mask`` (None: no padding) and the context columns."""
    generator = torch.Generator().manual_seed(11)
    if kind == "one row":
        return torch.randint(3, 128, (1, 40), generator=generator), None, 25
    contexts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (30, 22)]
    questions = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (4, 7)]
    ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)  # rows [pad, ctx, pad, question]
    return ids, mask, columns


def assert_scores_close(ours, theirs, atol=1e-4):
    assert len(ours) == len(theirs)
    for step, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.shape == reference.shape, step
        torch.testing.assert_close(mine, reference, atol=atol, rtol=0, msg=f"step {step}")


# -- full budget: transformers' own generate() ---------------------------------------------------


@pytest.mark.parametrize("kind", ["one row", "two left-padded rows"])
@torch.no_grad()
def test_beam_search_at_full_budget_is_transformers_own(kind):
    """Nothing evicted: beams and num_return_sequences give the unmodified model's sequences,
    scores, sequence scores and beam indices (the cache is expanded to the beams and reordered
    with them)."""
    model = make_tiny_llama(num_layers=2)
    ids, mask, columns = prompts(kind)
    options = dict(
        num_beams=2,
        num_return_sequences=2,
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    reference = model.generate(ids, attention_mask=mask, **options)
    result = generate(model, ids, None, attention_mask=mask, context_columns=columns, **options)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert result.sequences.shape[0] == 2 * ids.shape[0]
    assert torch.equal(result.sequences, reference.sequences)
    assert torch.equal(result.new_tokens, reference.sequences[:, ids.shape[1] :])
    assert_scores_close(result.scores, reference.scores)
    torch.testing.assert_close(result.output.sequences_scores, reference.sequences_scores, atol=1e-4, rtol=0)
    assert torch.equal(result.output.beam_indices, reference.beam_indices)
    assert result.cache.layers[0].batch_size == 2 * ids.shape[0]
    # without the dict: the same sequences
    plain = {k: v for k, v in options.items() if k not in ("return_dict_in_generate", "output_scores")}
    assert torch.equal(
        generate(model, ids, None, attention_mask=mask, context_columns=columns, **plain).sequences, reference.sequences
    )


@pytest.mark.parametrize("kind", ["one row", "two left-padded rows"])
@torch.no_grad()
def test_sampling_several_sequences_at_full_budget_is_transformers_own(kind):
    model = make_tiny_llama(num_layers=2)
    ids, mask, columns = prompts(kind)
    options = dict(num_return_sequences=3, max_new_tokens=8, do_sample=True, temperature=1.5, top_k=0, pad_token_id=0)
    torch.manual_seed(5)
    reference = model.generate(ids, attention_mask=mask, **options)
    torch.manual_seed(5)
    result = generate(model, ids, None, attention_mask=mask, context_columns=columns, **options)
    assert result.sequences.shape[0] == 3 * ids.shape[0]
    assert torch.equal(result.sequences, reference)


@torch.no_grad()
def test_rows_per_prompt_follow_the_generation_config_generate_resolves():
    """The expansion is generate()'s own: from its arguments, an explicit ``generation_config``, or
    defaults set in the model's ``generation_config``."""
    from transformers import GenerationConfig

    from runtime.serve.generation import rows_per_prompt

    model = make_tiny_llama(num_layers=2)
    ids, mask, columns = prompts("one row")
    assert rows_per_prompt(model, {}) == 1
    assert rows_per_prompt(model, {"num_beams": 3, "num_return_sequences": 2}) == 3
    assert rows_per_prompt(model, {"do_sample": True, "num_return_sequences": 4}) == 4
    config = GenerationConfig(num_beams=2, num_return_sequences=2, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert rows_per_prompt(model, {"generation_config": config}) == 2
    reference = model.generate(ids, generation_config=config)
    assert torch.equal(
        generate(model, ids, None, context_columns=columns, generation_config=config).sequences, reference
    )
    sampling = GenerationConfig(do_sample=True, num_return_sequences=2, max_new_tokens=5, top_k=0, pad_token_id=0)
    torch.manual_seed(2)
    reference = model.generate(ids, generation_config=sampling)
    torch.manual_seed(2)
    result = generate(model, ids, None, context_columns=columns, generation_config=sampling)  # sampled, as asked
    assert torch.equal(result.sequences, reference)
    model.generation_config.num_beams = 2  # a model default, as a checkpoint's generation_config.json sets it
    model.generation_config.num_return_sequences = 2
    reference = model.generate(ids, max_new_tokens=5, pad_token_id=0)
    result = generate(model, ids, None, context_columns=columns, max_new_tokens=5, pad_token_id=0)
    assert result.sequences.shape[0] == 2 and torch.equal(result.sequences, reference)


@torch.no_grad()
def test_return_dict_in_generate_keeps_transformers_output():
    """``return_dict_in_generate`` with scores and logits: the result carries transformers' output
    (``output``, ``scores``, ``logits``) besides ``sequences`` / ``new_tokens``."""
    model = make_tiny_llama(num_layers=2)
    ids, mask, columns = prompts("two left-padded rows")
    options = dict(
        max_new_tokens=6,
        min_new_tokens=6,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    reference = model.generate(ids, attention_mask=mask, do_sample=False, **options)
    result = generate(model, ids, None, attention_mask=mask, context_columns=columns, **options)
    assert type(result.output) is type(reference)
    assert torch.equal(result.sequences, reference.sequences) and result.sequences is result.output.sequences
    assert result.new_tokens.shape == (2, 6)
    assert_scores_close(result.scores, reference.scores)
    assert_scores_close(result.logits, reference.logits)
    plain = generate(model, ids, None, attention_mask=mask, context_columns=columns, max_new_tokens=6, pad_token_id=0)
    assert plain.output is None and plain.scores is None and plain.logits is None
    assert torch.equal(plain.sequences, reference.sequences)


# -- evicting policies ---------------------------------------------------------------------------

EVICTING = {
    "half": CompressionPolicy(compression_ratio=0.5),
    "decode-time eviction with moments": CompressionPolicy(
        compression_ratio=0.5, scorer="keydiff", n_sink=1, window=2, evict_every=2, correction="order1"
    ),
}


@pytest.mark.parametrize("name", list(EVICTING))
@pytest.mark.parametrize("kind", ["one row", "two left-padded rows"])
@torch.no_grad()
def test_beams_and_samples_run_under_eviction(name, kind):
    policy = EVICTING[name]
    model = make_tiny_llama(num_layers=2)
    ids, mask, columns = prompts(kind)
    batch, length = ids.shape
    common = dict(attention_mask=mask, context_columns=columns, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    beams = generate(model, ids, policy, num_beams=3, num_return_sequences=2, **common)
    torch.manual_seed(3)
    sampled = generate(model, ids, policy, do_sample=True, num_return_sequences=2, **common)
    for result, rows in ((beams, 3 * batch), (sampled, 2 * batch)):
        assert result.sequences.shape == (2 * batch, length + 8)
        assert result.new_tokens.shape == (2 * batch, 8)
        assert torch.equal(result.sequences[:, :length], ids.repeat_interleave(2, dim=0))  # prompts kept, in order
        assert result.cache.layers[0].batch_size == rows  # every beam / sample has its own compressed rows
        assert (result.report.lengths_after < columns).all()  # the context was compressed ...
        assert result.report.lengths_after.shape[1] == batch  # ... once per prompt, before the expansion
        if policy.evict_every is not None:  # ... and decoding went on evicting in every expanded row
            held = result.cache.head_lengths()  # [L, rows, Hkv]
            budgets = np.repeat(result.report.budgets, rows // batch, axis=0)  # [rows, L, Hkv]
            grown = held - torch.as_tensor(budgets).permute(1, 0, 2)
            assert (grown < policy.evict_every).all()
    torch.manual_seed(3)
    again = generate(model, ids, policy, do_sample=True, num_return_sequences=2, **common)
    assert torch.equal(again.sequences, sampled.sequences)


@torch.no_grad()
def test_reordering_carries_every_row_state():
    """``reorder_cache`` / ``batch_repeat_interleave`` / ``batch_select_indices`` give each new row
    the tokens, moment sums, correction and decode plan of its source row: decoding the reordered
    cache, with decode-time eviction and MomentKV correction on, gives the logits of caches
    compressed from each source row alone and stacked in that order."""
    model = make_tiny_llama(num_layers=2)
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 128, (2, 30), generator=generator)
    steps = torch.randint(3, 128, (6, 1), generator=generator)
    policy = CompressionPolicy(
        compression_ratio=0.5, scorer="keydiff", n_sink=1, window=2, evict_every=1, correction="order1"
    )

    def compressed(rows: torch.Tensor) -> RaggedCache:
        cache = RaggedCache.for_model(model)
        stats = prefill(model, cache, rows, policy=policy)
        compress(model, cache, policy, prompt_stats=stats)
        return cache

    with ragged_attention(model):
        both = compressed(ids)
        singles = [compressed(ids[b : b + 1]) for b in range(2)]
        cases = {
            "reorder_cache": (lambda cache: cache.reorder_cache(torch.tensor([1, 1, 0])), [1, 1, 0]),
            "batch_repeat_interleave": (lambda cache: cache.batch_repeat_interleave(2), [0, 0, 1, 1]),
            "batch_select_indices": (lambda cache: cache.batch_select_indices(torch.tensor([1])), [1]),
        }
        for name, (reindex, order) in cases.items():
            ours = both.copy()
            reindex(ours)
            reference = RaggedCache.stack([singles[b] for b in order])
            rows = len(order)
            for step in steps:
                token = step.expand(rows, 1)
                mine = model(token, **cache_argument(model, ours)).logits
                theirs = model(token, **cache_argument(model, reference)).logits
                torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0, msg=name)
            assert torch.equal(ours.head_lengths(), reference.head_lengths()), name
            for layer, expected in zip(ours.layers, reference.layers, strict=True):
                for mine_row, their_row in zip(layer.rows, expected.rows, strict=True):
                    torch.testing.assert_close(mine_row.moments.n, their_row.moments.n, atol=0, rtol=0)
                    torch.testing.assert_close(mine_row.moments.S_vk, their_row.moments.S_vk, atol=1e-5, rtol=0)
                    assert mine_row.decode_plan is not None and mine_row.correction is not None
            # rows copied from one source are independent: evicting one leaves its twin alone
            if name == "reorder_cache":
                first, second = ours.layers[0].rows[0].moments, ours.layers[0].rows[1].moments
                assert first is not second
        assert (both.head_lengths() == singles[0].head_lengths()[:, :1].expand(-1, 2, -1)).any()  # source untouched


# -- one context, many questions -----------------------------------------------------------------

CONTEXT = "The grass is green. The sky is blue. The passcode is 4821. Here we go. There and back again. " * 3
QUESTIONS = ["What is the passcode?", "What colour is the sky?", "Which colour does the grass have, and why is it so?"]


class ContextPasses:
    """Records the batch size of every forward pass of ``model`` that feeds at least ``columns``
    token columns (a pass over the context: questions and decode steps are shorter)."""

    def __init__(self, model, columns: int):
        self.model, self.columns, self.rows = model, columns, []

    def _record(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] >= self.columns:
            self.rows.append(int(ids.shape[0]))

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture(scope="module")
def tiny_chat_model(embedded_tokenizer):
    """A tiny random Llama over the embedded tokenizer's vocabulary (answer() builds chat prompts)."""
    return make_tiny_llama(num_layers=2, vocab_size=len(embedded_tokenizer), seed=1)


@pytest.mark.parametrize("name", ["half keydiff", "decode-time eviction with moments"])
@torch.no_grad()
def test_one_context_many_questions_compresses_once_and_answers_as_one_by_one(
    name, tiny_chat_model, embedded_tokenizer
):
    """``answer(model, tokenizer, context, [q1, q2, q3], policy)``: the context is prefilled and
    compressed once (one forward pass over it, batch 1), each question answered from its own copy
    in one batch, and the answers are those of asking each question on its own."""
    from runtime.serve.generation import split_prompt

    model, tokenizer = tiny_chat_model, embedded_tokenizer
    policy = {
        "half keydiff": CompressionPolicy(compression_ratio=0.5, scorer="keydiff"),
        "decode-time eviction with moments": EVICTING["decode-time eviction with moments"],
    }[name]
    columns = len(split_prompt(tokenizer, CONTEXT, QUESTIONS[0])[0])
    with ContextPasses(model, columns) as batched:
        texts = answer(model, tokenizer, CONTEXT, QUESTIONS, policy, max_new_tokens=6)
    with ContextPasses(model, columns) as separate:
        singles = [answer(model, tokenizer, CONTEXT, question, policy, max_new_tokens=6) for question in QUESTIONS]
    assert batched.rows == [1] and separate.rows == [1, 1, 1]
    assert isinstance(texts, list) and texts == singles
    assert len(set(texts)) > 1  # the questions get different answers: rows mixed up would show
    # question-aware: each prompt is compressed with its own question (one pass, one row each)
    with ContextPasses(model, columns) as aware:
        texts = answer(model, tokenizer, CONTEXT, QUESTIONS, policy, question_aware=True, max_new_tokens=6)
    singles = [
        answer(model, tokenizer, CONTEXT, question, policy, question_aware=True, max_new_tokens=6)
        for question in QUESTIONS
    ]
    assert aware.rows == [3] and texts == singles


@torch.no_grad()
def test_answer_groups_several_sequences_per_question(tiny_chat_model, embedded_tokenizer):
    """``num_return_sequences=n``: each question's answer is a list of its n texts (beams: the best first)."""
    model, tokenizer = tiny_chat_model, embedded_tokenizer
    policy = CompressionPolicy(compression_ratio=0.5, scorer="keydiff")
    options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=5)
    many = answer(model, tokenizer, CONTEXT, QUESTIONS[:2], policy, **options)
    one = answer(model, tokenizer, CONTEXT, QUESTIONS[1], policy, **options)
    assert [len(texts) for texts in many] == [2, 2] and isinstance(one, list) and len(one) == 2
    assert many[1] == one
    pairs = answer(model, tokenizer, [CONTEXT, CONTEXT[:150]], QUESTIONS[:2], policy, **options)
    assert [len(texts) for texts in pairs] == [2, 2] and pairs[0] == many[0]


@pytest.mark.parametrize(
    ("context", "question", "error", "match"),
    [
        ([CONTEXT, CONTEXT], QUESTIONS[0], ValueError, "one question per context"),
        ([CONTEXT, CONTEXT], QUESTIONS, ValueError, "got 2 contexts and 3 questions"),
        (CONTEXT, [], ValueError, "at least one question"),
        ([], [], ValueError, "at least one context"),
        (CONTEXT, [QUESTIONS[0], 7], TypeError, "question 1 is int"),
        ([CONTEXT, b"bytes"], QUESTIONS[:2], TypeError, "context 1 is bytes"),
        (None, QUESTIONS[0], TypeError, "context must be a str or a list of str"),
        (CONTEXT, {"a", "b"}, TypeError, "question must be a str or a list of str"),
    ],
)
def test_answer_refuses_mismatched_contexts_and_questions_before_any_pass(
    context, question, error, match, tiny_chat_model, embedded_tokenizer
):
    with ContextPasses(tiny_chat_model, 1) as passes, pytest.raises(error, match=match):
        answer(tiny_chat_model, embedded_tokenizer, context, question, CompressionPolicy(compression_ratio=0.5))
    assert passes.rows == []


@pytest.mark.slow
@torch.no_grad()
def test_embedded_model_beams_and_many_questions(embedded_model, embedded_tokenizer):
    """The real model: beams with several sequences at full budget are transformers' own (sequences,
    scores within 1e-4); under eviction they run; one context answers three questions compressed
    once, as asking each on its own does."""
    from runtime.serve.generation import split_prompt

    model, tokenizer = embedded_model, embedded_tokenizer
    context_ids, question_ids = split_prompt(tokenizer, CONTEXT, QUESTIONS[0])
    ids = torch.tensor([context_ids + question_ids])
    options = dict(
        num_beams=2,
        num_return_sequences=2,
        max_new_tokens=8,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    reference = model.generate(ids, **options)
    result = generate(model, ids, None, context_columns=len(context_ids), **options)
    assert torch.equal(result.sequences, reference.sequences)
    assert_scores_close(result.scores, reference.scores)
    evicted = generate(
        model, ids, EVICTING["decode-time eviction with moments"], context_columns=len(context_ids), **options
    )
    assert evicted.sequences.shape[0] == 2 and len(evicted.scores) == evicted.new_tokens.shape[1]
    policy = CompressionPolicy(compression_ratio=0.5, scorer="keydiff")
    with ContextPasses(model, len(context_ids)) as passes:
        texts = answer(model, tokenizer, CONTEXT, QUESTIONS, policy, max_new_tokens=12)
    assert passes.rows == [1]
    assert texts == [answer(model, tokenizer, CONTEXT, question, policy, max_new_tokens=12) for question in QUESTIONS]
