"""Issue 30: the runtime's public calls with bad arguments each raise a named error with a clear
one-line message (the campaign in tests/runtime_misuse_cases.py), and the misuses found there."""

from __future__ import annotations

import pytest
import torch
from runtime_misuse_cases import cases, ids, policy, run_case, tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

CASES = cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_call_is_refused_with_a_named_error(case):
    outcome = run_case(case)
    assert outcome.handled, outcome.what


@torch.no_grad()
def test_a_cache_a_generation_consumed_is_refused_before_any_forward():
    """A second generate() through the same compressed cache appended the whole prompt again
    (sequence length 296 -> 587 on the embedded model) and answered from a doubled context."""
    from runtime import CacheConsumedError, compress_prompt
    from runtime.serve.generation import generate_from_cache

    model, prompt = tiny(), ids()
    cache, report = compress_prompt(model, prompt, policy(), context_columns=20)
    mask = torch.ones_like(prompt)
    first = generate_from_cache(model, prompt, mask, cache, report, max_new_tokens=3, pad_token_id=0)
    seen = cache.get_seq_length()
    assert seen == prompt.shape[1] + 2  # the prompt, then two of the three new tokens fed back
    calls = []
    hook = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(CacheConsumedError, match=f"already holds {seen} columns.*prompt has 24"):
            generate_from_cache(model, prompt, mask, cache, report, max_new_tokens=3, pad_token_id=0)
    finally:
        hook.remove()
    assert not calls and cache.get_seq_length() == seen  # refused before the model ran, the cache untouched
    # continuing the first generation's own sequences through its cache stays allowed
    again = generate_from_cache(
        model, first.sequences, torch.ones_like(first.sequences), cache, report, max_new_tokens=2, pad_token_id=0
    )
    assert again.sequences.shape[1] == first.sequences.shape[1] + 2


@torch.no_grad()
def test_model_generate_with_beams_through_an_unexpanded_cache_says_what_is_unsupported():
    from runtime import cache_argument, compress_prompt, ragged_attention

    model, prompt = tiny(), ids()
    cache, _ = compress_prompt(model, prompt, policy(), context_columns=20)
    with ragged_attention(model), pytest.raises(ValueError) as info:
        model.generate(prompt, **cache_argument(model, cache), max_new_tokens=3, num_beams=3, pad_token_id=0)
    message = str(info.value)
    assert "1 batch row" in message and "3 rows" in message and "num_beams" in message
    assert "runtime.generate" in message and "batch_repeat_interleave(3)" in message


@torch.no_grad()
def test_a_right_padded_batch_is_refused_before_any_forward_pass():
    """Many tokenizers pad on the right by default.  A row ending with padding was answered after its padding,
    silently otherwise than alone (transformers' generate() only warns); now refused by name, in generate()
    and compress_prompt(), before the prefill.  The layouts kvcal builds (left padding, and padding between
    a context and its question) end every row with a token and are served."""
    from runtime import compress_prompt, generate
    from runtime.serve.generation import build_inputs

    model = tiny()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 128, (2, 30), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 22:] = 0  # the second row right-padded
    calls = []
    hook = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"batch row 1 ends with padding.*padding_side = 'left'"):
            generate(model, ids, policy(), attention_mask=mask, context_columns=20, max_new_tokens=3, pad_token_id=0)
        with pytest.raises(ValueError, match="batch row 1 ends with padding"):
            compress_prompt(model, ids, policy(), attention_mask=mask)
    finally:
        hook.remove()
    assert calls == []
    left, left_mask, columns = build_inputs([ids[0, :20].tolist(), ids[1, :12].tolist()], [[5, 6], [7]], 0)
    served = generate(model, left, policy(), attention_mask=left_mask, context_columns=columns, max_new_tokens=3)
    assert served.sequences.shape == (2, left.shape[1] + 3)
