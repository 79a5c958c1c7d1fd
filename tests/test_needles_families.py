"""Needle families: every template renders, its spans are sound, slots give many distinct needles."""

from __future__ import annotations

import itertools
import random

import pytest

from needles.families import FAMILIES, TemplateError, parse_markers, render_family, render_needle


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_renders_with_spans_and_answer_in_r_span(family):
    for seed in range(25):
        needle = render_needle(family, seed)
        assert needle.text and needle.question and needle.answer
        assert needle.spans, "every family marks at least its answer"
        labels = {span.label for span in needle.spans}
        assert "R" in labels
        for span in needle.spans:
            text = needle.span_text(span)
            assert text and text == text.strip(), span
        r_texts = [needle.span_text(s) for s in needle.spans if s.label == "R"]
        assert any(needle.answer in t for t in r_texts)
        # the answer is not given away by the question
        assert needle.answer.lower() not in needle.question.lower()
        # spans are ordered and disjoint
        for left, right in itertools.pairwise(needle.spans):
            assert left.end <= right.start
        assert "[[" not in needle.text and "]]" not in needle.text


def test_reasoning_families_have_bias_and_distraction():
    for family in ("comparison", "temporal", "counting", "located_attribute", "reasoning"):
        labels = {s.label for s in render_needle(family, 7).spans}
        assert labels == {"R", "B", "D"}, family
    assert {s.label for s in render_needle("multi_key", 7).spans} == {"R", "D"}


def test_comparison_answer_follows_the_prices():
    for seed in range(40):
        needle = render_needle("comparison", seed)
        a, b = needle.slots["a"], needle.slots["b"]
        cheaper = a if a["price"] < b["price"] else b
        pricier = b if cheaper is a else a
        expected = cheaper if needle.slots["ask"] == "cheaper" else pricier
        assert needle.answer == expected["os"]
        assert f"${a['price']}" in needle.text and f"${b['price']}" in needle.text


def test_temporal_and_reasoning_answers_follow_the_bias_facts():
    for seed in range(40):
        needle = render_needle("temporal", seed)
        a, b = needle.slots["a"], needle.slots["b"]
        earlier = a if a["minutes"] < b["minutes"] else b
        later = b if earlier is a else a
        assert needle.answer == (earlier if needle.slots["ask"] == "earlier" else later)["room"]
        needle = render_needle("reasoning", seed)
        p, q = needle.slots["p"], needle.slots["q"]
        younger = p if p["age"] < q["age"] else q
        older = q if younger is p else p
        assert needle.answer == (younger if needle.slots["ask"] == "younger" else older)["activity"]


def test_located_attribute_puts_the_two_cities_on_different_continents():
    for seed in range(40):
        needle = render_needle("located_attribute", seed)
        assert needle.slots["a"]["continent"] != needle.slots["b"]["continent"]
        assert needle.answer == needle.slots["a"]["export"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_seed_sweep_gives_hundreds_of_distinct_needles(family):
    texts = {render_needle(family, seed).text for seed in range(400)}
    assert len(texts) >= 300, (family, len(texts))
    assert render_needle(family, 11) == render_needle(family, 11)


def test_parse_markers_gives_character_spans():
    text, spans = parse_markers("A [[B:$5 ]] x [[R:Linux]]. [[D:The Red Box is big]].")
    assert text == "A $5  x Linux. The Red Box is big."
    assert [(s.label, text[s.start : s.end]) for s in spans] == [
        ("B", "$5"),
        ("R", "Linux"),
        ("D", "The Red Box is big"),
    ]


@pytest.mark.parametrize("bad", ["[[R:]] x", "x [[R:a [[D:b]] c]]", "x [[R:a", "x ]] y", "[[Q:a]]"])
def test_parse_markers_rejects_malformed_markers(bad):
    with pytest.raises(TemplateError):
        parse_markers(bad)


def test_missing_slot_and_unknown_family_are_errors():
    with pytest.raises(Exception, match="value"):
        render_family("retrieval", {"key": "apple"})  # StrictUndefined: 'value' is undefined
    with pytest.raises(ValueError, match="unknown needle family"):
        render_needle("nope", 0)


def test_samplers_are_pure_functions_of_the_rng():
    for family in FAMILIES.values():
        assert family.sample_slots(random.Random(5)) == family.sample_slots(random.Random(5))
