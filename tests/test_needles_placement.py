"""Needle placement: token lengths, depths, context split and R/B/D labels on the right tokens,
for the SmolLM2 tokenizer (offset mapping) and for tokenizers without offsets (fallback)."""

from __future__ import annotations

import pytest
from transformers import ByT5Tokenizer

from needles.families import FAMILIES, render_family, render_needle
from needles.haystacks import make_haystack
from needles.placement import LengthError, SpanError, place_needle
from prompt_format import encode_with_offsets


class OffsetlessTokenizer:
    """The real tokenizer, minus offsets support: asking for offsets raises, like the slow
    (Python) tokenizers of transformers 4 did."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, text, **kwargs):
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self.inner(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _place(tokenizer, family, length=512, depth=50.0, seed=3, haystack="simple", **kw):
    needle = render_needle(family, seed)
    placed = place_needle(tokenizer, needle, make_haystack(haystack).sentences(seed), length, depth, **kw)
    return needle, placed


def _assert_labels_on_the_right_tokens(tokenizer, needle, placed):
    ids = placed.input_ids
    assert len(placed.spans) == len(needle.spans)
    for char_span, span in zip(needle.spans, placed.spans, strict=True):
        assert span.label == char_span.label
        expected = needle.span_text(char_span)
        assert tokenizer.decode(ids[span.start : span.end]).strip() == expected
        # dropping a token at either end loses part of the span
        if span.end - span.start > 1:
            assert tokenizer.decode(ids[span.start + 1 : span.end]).strip() != expected
            assert tokenizer.decode(ids[span.start : span.end - 1]).strip() != expected
    r_text = " ".join(tokenizer.decode(ids[s.start : s.end]) for s in placed.spans if s.label == "R")
    assert needle.answer in r_text
    assert placed.needle_start <= min(s.start for s in placed.spans)
    assert max(s.end for s in placed.spans) <= placed.needle_end <= placed.context_end


@pytest.mark.parametrize("family", list(FAMILIES))
def test_labels_land_on_the_right_tokens_smollm2(embedded_tokenizer, family):
    needle, placed = _place(embedded_tokenizer, family)
    _assert_labels_on_the_right_tokens(embedded_tokenizer, needle, placed)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_offsetless_fallback_gives_the_same_labels(embedded_tokenizer, family):
    wrapped = OffsetlessTokenizer(embedded_tokenizer)
    assert encode_with_offsets(wrapped, "a b")[1] is None
    for haystack in ("simple", "prose"):
        _, with_offsets = _place(embedded_tokenizer, family, haystack=haystack)
        needle, fallback = _place(wrapped, family, haystack=haystack)
        assert fallback == with_offsets
        _assert_labels_on_the_right_tokens(embedded_tokenizer, needle, fallback)


@pytest.mark.parametrize("family", ["retrieval", "comparison", "located_attribute"])
def test_slow_tokenizer_without_offsets_or_chat_template(family):
    tokenizer = ByT5Tokenizer()  # Python tokenizer: silently returns no offset_mapping
    assert not tokenizer.is_fast and encode_with_offsets(tokenizer, "abc")[1] is None
    needle, placed = _place(tokenizer, family, length=2048)
    assert abs(len(placed.input_ids) - 2048) <= 0.02 * 2048
    _assert_labels_on_the_right_tokens(tokenizer, needle, placed)
    assert tokenizer.decode(placed.input_ids[placed.context_end :]).lstrip().startswith(needle.question)


def test_prompt_is_the_chat_template_and_context_prefix_is_stable(embedded_tokenizer):
    tokenizer = embedded_tokenizer
    for family in FAMILIES:
        needle, placed = _place(tokenizer, family, length=1024, depth=30.0)
        text = tokenizer.decode(placed.input_ids)
        content = text[text.index("<|im_start|>user\n") + len("<|im_start|>user\n") : text.rindex("<|im_end|>")]
        direct = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert list(direct) == placed.input_ids
        assert text.endswith("<|im_start|>assistant\n")
        # the question comes after the context, and the context prefix tokenizes on its own
        question_part = tokenizer.decode(placed.input_ids[placed.context_end :])
        assert question_part.strip().startswith(needle.question)
        prefix_text = tokenizer.decode(placed.input_ids[: placed.context_end])
        assert tokenizer(prefix_text, add_special_tokens=False)["input_ids"] == placed.input_ids[: placed.context_end]
        assert needle.question not in prefix_text


@pytest.mark.parametrize("haystack", ["simple", "prose"])
def test_lengths_within_tolerance_from_512_to_8192(embedded_tokenizer, haystack):
    for family in ("retrieval", "comparison", "located_attribute", "reasoning"):
        for length in (512, 777, 1024, 2048, 4096, 8192):
            _, placed = _place(embedded_tokenizer, family, length=length, depth=40.0, haystack=haystack)
            assert abs(len(placed.input_ids) - length) <= 0.02 * length, (family, length, len(placed.input_ids))
            assert len(placed.input_ids) <= length  # never past the asked length (context limits)


def test_depths_are_monotone_and_close_to_asked(embedded_tokenizer):
    for length in (512, 4096):
        starts = []
        for depth in range(0, 101, 10):
            _, placed = _place(embedded_tokenizer, "multi_key", length=length, depth=float(depth))
            starts.append(placed.needle_start)
            assert abs(placed.depth_actual - depth) <= 3.0, (length, depth, placed.depth_actual)
        assert starts == sorted(starts) and len(set(starts)) == len(starts), starts


def test_needle_sits_at_a_sentence_boundary(embedded_tokenizer):
    for depth in (5.0, 37.0, 81.0):
        needle, placed = _place(embedded_tokenizer, "retrieval", length=1024, depth=depth)
        before = embedded_tokenizer.decode(placed.input_ids[: placed.needle_start]).rstrip()
        after = embedded_tokenizer.decode(placed.input_ids[placed.needle_end : placed.context_end]).lstrip()
        assert before.endswith("."), before[-40:]
        assert after[:1].isupper(), after[:40]
        assert (
            embedded_tokenizer.decode(placed.input_ids[placed.needle_start : placed.needle_end]).strip() == needle.text
        )


def test_span_that_does_not_survive_tokenization_raises(embedded_tokenizer):
    # "Lin" is only part of the token " Linux": the label cannot be placed on whole tokens.
    slots = {"key": "apple", "value": "7"}
    needle = render_family("retrieval", slots)
    broken = type(needle)(
        needle.family, "The apple runs Linux.", (type(needle.spans[0])("R", 15, 18),), needle.question, "Lin", slots
    )
    with pytest.raises(SpanError):
        place_needle(embedded_tokenizer, broken, make_haystack("simple").sentences(0), 512, 50.0)
    with pytest.raises(SpanError):
        place_needle(OffsetlessTokenizer(embedded_tokenizer), broken, make_haystack("simple").sentences(0), 512, 50.0)


def test_impossible_lengths_raise(embedded_tokenizer):
    needle = render_needle("located_attribute", 0)
    with pytest.raises(LengthError):
        place_needle(embedded_tokenizer, needle, make_haystack("simple").sentences(0), 64, 50.0)
    with pytest.raises(ValueError, match="depth"):
        place_needle(embedded_tokenizer, needle, make_haystack("simple").sentences(0), 512, 120.0)
