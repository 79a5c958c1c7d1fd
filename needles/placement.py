"""Placing a needle in a haystack at a token length and depth, and labelling its tokens.

The prompt is the one format profiling and serving share (:mod:`prompt_format`): one user
message ``context + "\\n\\n" + question`` through the tokenizer's chat template with the
generation prompt, or ``[bos]context\\n\\nquestion\\nAnswer:`` without a chat template.  The
context is haystack sentences with the needle inserted between two of them (a sentence
boundary) so that ``depth`` percent of the haystack's tokens come before it.  The number of
haystack words is adjusted until the whole tokenized prompt is within ``tolerance`` (default
2%) of the asked length, preferring prompts no longer than asked (a model's context limit
stays safe); if it cannot be, that is an error.

``context_end`` is the first token of the question part (:func:`prompt_format.context_boundary`):
tokenizing the prompt text up to there gives exactly ``input_ids[:context_end]``, which is
checked, so question-agnostic runs can prefill the context alone.

Labels: the needle's character spans are moved into prompt coordinates and mapped to tokens
with the tokenizer's offset mapping (fast tokenizers).  Tokenizers without offsets support
(Python "slow" tokenizers, which either raise or silently omit ``offset_mapping``) use a
documented fallback: a span boundary at character ``c`` maps to ``len(tokenize(text[:c]))``,
valid only if that tokenization is a prefix of the full one (checked).  Either way a span
that does not survive tokenization - no token, a token shared with text outside the span, two
spans on one token, decoded tokens not containing the span text - raises :class:`SpanError`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from needles.families import CharSpan, RenderedNeedle
from needles.haystacks import join_units
from needles.probe import Span
from prompt_format import context_boundary, encode, encode_with_offsets, render_prompt


class SpanError(ValueError):
    """A labelled span does not survive tokenization (lost, merged or split across text)."""


class LengthError(ValueError):
    """The asked prompt length cannot be reached within tolerance."""


# ---------------------------------------------------------------------------------------
# Span mapping
# ---------------------------------------------------------------------------------------


def _visible_start(text: str, start: int, end: int) -> int:
    """First non-whitespace character of ``text[start:end]`` (``end`` if none)."""
    while start < end and text[start].isspace():
        start += 1
    return start


def _candidate_window(offsets: list[tuple[int, int]], start: int, end: int) -> range:
    """Token indices that may overlap characters ``[start, end)``: found by bisection when the
    offsets are monotone (they are for a left-to-right tokenization), else all of them."""
    ends = [e for _, e in offsets]
    if any(a > b for a, b in itertools.pairwise(ends)):
        return range(len(offsets))
    first = bisect.bisect_right(ends, start)
    last = bisect.bisect_left(ends, end, lo=first)
    return range(first, min(len(offsets), last + 1))


def _tokens_by_offsets(text: str, offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """Token range covering characters ``[start, end)`` by offsets (whitespace ignored)."""
    hits = [
        i
        for i in _candidate_window(offsets, start, end)
        if offsets[i][1] > offsets[i][0] and max(_visible_start(text, *offsets[i]), start) < min(offsets[i][1], end)
    ]
    if not hits:
        raise SpanError(f"span {text[start:end]!r} has no token")
    first, last = hits[0], hits[-1]
    lead = text[offsets[first][0] : start]
    trail = text[end : offsets[last][1]]
    if lead.strip() or trail.strip():
        raise SpanError(
            f"span {text[start:end]!r} shares a token with neighbouring text "
            f"({text[offsets[first][0] : offsets[last][1]]!r})"
        )
    return first, last + 1


def _token_boundary_by_prefix(tokenizer, text: str, ids: list[int], char: int, back_over_space: bool) -> int:
    """Token index where character ``char`` starts, by tokenizing the prefix ``text[:char]``.

    The prefix's tokens must equal the first tokens of the whole text.  Byte-level BPEs attach a
    space to the following word, so a span start is tried before its preceding whitespace too.
    """
    candidates = [char]
    if back_over_space:
        stripped = char
        while stripped > 0 and text[stripped - 1].isspace():
            stripped -= 1
        if stripped != char:
            candidates.append(stripped)
    for cut in candidates:
        prefix = encode(tokenizer, text[:cut])
        if ids[: len(prefix)] == prefix:
            return len(prefix)
    raise SpanError(
        f"no token boundary at character {char} ({text[max(0, char - 20) : char]!r}|"
        f"{text[char : char + 20]!r}): the tokenizer merges across it"
    )


def _normalised(text: str) -> str:
    return " ".join(text.split())


def map_spans(
    tokenizer, text: str, ids: list[int], offsets: list[tuple[int, int]] | None, char_spans: list[CharSpan]
) -> list[Span]:
    """Token spans of ``char_spans`` (characters of ``text``, whose tokens are ``ids``)."""
    spans = []
    for span in char_spans:
        if offsets is not None:
            first, end = _tokens_by_offsets(text, offsets, span.start, span.end)
        else:
            first = _token_boundary_by_prefix(tokenizer, text, ids, span.start, back_over_space=True)
            end = _token_boundary_by_prefix(tokenizer, text, ids, span.end, back_over_space=False)
        if end <= first:
            raise SpanError(f"span {text[span.start : span.end]!r} has no token")
        decoded = _normalised(tokenizer.decode(ids[first:end]))
        wanted = _normalised(text[span.start : span.end])
        if wanted not in decoded:
            raise SpanError(f"span {wanted!r} decodes as {decoded!r} after tokenization")
        spans.append(Span(span.label, first, end))
    ordered = sorted(spans, key=lambda s: (s.start, s.end))
    for left, right in itertools.pairwise(ordered):
        if right.start < left.end:
            raise SpanError(f"spans {left} and {right} share tokens")
    return spans


# ---------------------------------------------------------------------------------------
# Fitting a needle into a haystack at a length and depth
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlacedNeedle:
    input_ids: list[int]
    spans: list[Span]
    context_end: int
    context_start_token: int  # first token of the context
    needle_start: int  # first token of the needle
    needle_end: int  # last token of the needle + 1
    depth_actual: float  # percent of the context's tokens before the needle


class _UnitPool:
    """Haystack units drawn on demand, with their word and (standalone) token counts."""

    def __init__(self, tokenizer, stream: Iterator[str]):
        self.tokenizer, self.stream = tokenizer, stream
        self.units: list[str] = []
        self.words: list[int] = []
        self.tokens: list[int] = []

    def ensure_words(self, total_words: int) -> None:
        while sum(self.words) < total_words:
            batch = list(itertools.islice(self.stream, 256))
            if not batch:
                raise LengthError("the haystack ran out of text")
            self.units.extend(batch)
            self.words.extend(len(u.split()) for u in batch)
            encoded = self.tokenizer([" " + u for u in batch], add_special_tokens=False)["input_ids"]
            self.tokens.extend(max(1, len(ids)) for ids in encoded)

    def tokens_per_word(self) -> float:
        return sum(self.tokens) / max(1, sum(self.words))

    def first_words(self, total_words: int) -> tuple[list[str], list[int]]:
        """The units covering the first ``total_words`` words (the last one possibly cut at a
        word boundary) and their estimated token counts."""
        self.ensure_words(total_words + 1)
        units, tokens, used = [], [], 0
        for unit, words, count in zip(self.units, self.words, self.tokens, strict=True):
            if used >= total_words:
                break
            if used + words <= total_words:
                units.append(unit)
                tokens.append(count)
            else:
                keep = total_words - used
                units.append(" ".join(unit.split()[:keep]))
                tokens.append(max(1, round(count * keep / words)))
            used += words
        return units, tokens


def _insertion_index(tokens: list[int], depth: float) -> int:
    """Unit boundary (0..len) whose share of preceding tokens is closest to ``depth`` percent."""
    total = sum(tokens)
    if total == 0:
        return 0
    best, best_error, running = 0, float("inf"), 0
    for index in range(len(tokens) + 1):
        error = abs(running / total - depth / 100.0)
        if error < best_error:
            best, best_error = index, error
        if index < len(tokens):
            running += tokens[index]
    return best


def place_needle(
    tokenizer,
    needle: RenderedNeedle,
    haystack_stream: Iterator[str],
    length: int,
    depth: float,
    *,
    tolerance: float = 0.02,
    max_iterations: int = 12,
) -> PlacedNeedle:
    """Hide ``needle`` in haystack units so the whole prompt is ``length`` tokens (within
    ``tolerance``) with the needle at ``depth`` percent of the context; label its tokens."""
    if not 0.0 <= depth <= 100.0:
        raise ValueError(f"depth is a percentage in [0, 100], got {depth}")
    if length < 1:
        raise ValueError(f"length must be positive, got {length}")
    pool = _UnitPool(tokenizer, haystack_stream)
    pool.ensure_words(64)
    allowed = tolerance * length
    stop_within = max(1.0, length * 0.004)

    def build(total_words: int):
        units, tokens = pool.first_words(total_words)
        index = _insertion_index(tokens, depth)
        before, after = join_units(units[:index]), join_units(units[index:])
        prefix = before + (" " if before and not before.endswith("\n") else "")
        context = (prefix + needle.text + (" " + after if after else "")).rstrip()
        prompt = render_prompt(tokenizer, context, needle.question)
        ids, offsets = encode_with_offsets(tokenizer, prompt.text)
        return prompt, ids, offsets, prompt.context_start + len(prefix)

    overhead = len(encode(tokenizer, render_prompt(tokenizer, needle.text, needle.question).text))
    if overhead > length + allowed:
        raise LengthError(f"the needle and question alone take {overhead} tokens, more than the asked {length}")
    words = max(0, round((length - overhead) / pool.tokens_per_word()))
    best = None
    seen: set[int] = set()

    def preference(error: int) -> tuple:  # within tolerance, then not longer than asked, then closest
        return (abs(error) > allowed, error < 0, abs(error))

    for _ in range(max_iterations):
        seen.add(words)
        built = build(words)
        error = length - len(built[1])
        if best is None or preference(error) < preference(best[1]):
            best = (built, error)
        if 0 <= error <= stop_within:
            break
        step = round(error / pool.tokens_per_word()) or (1 if error > 0 else -1)
        words = max(0, words + step)
        if words in seen:  # oscillating between two word counts: keep the best of them
            break
    (prompt, ids, offsets, needle_char), error = best
    if abs(error) > allowed:
        raise LengthError(f"could not fit the prompt to {length} tokens (closest: {len(ids)}; tolerance {allowed:.0f})")

    shifted = [CharSpan(s.label, needle_char + s.start, needle_char + s.end) for s in needle.spans]
    needle_span = CharSpan("W", needle_char, needle_char + len(needle.text))
    spans = map_spans(tokenizer, prompt.text, ids, offsets, shifted)
    context_end = context_boundary(tokenizer, prompt.text, ids, offsets, prompt.question_start)
    if offsets is not None:
        needle_start, needle_end = _tokens_by_offsets(prompt.text, offsets, needle_span.start, needle_span.end)
        context_start = next(i for i, (s, e) in enumerate(offsets) if e > s and e > prompt.context_start)
    else:
        needle_start = _token_boundary_by_prefix(tokenizer, prompt.text, ids, needle_span.start, True)
        needle_end = _token_boundary_by_prefix(tokenizer, prompt.text, ids, needle_span.end, False)
        context_start = _token_boundary_by_prefix(tokenizer, prompt.text, ids, prompt.context_start, False)
    haystack_tokens = max(1, (context_end - context_start) - (needle_end - needle_start))
    depth_actual = 100.0 * (needle_start - context_start) / haystack_tokens
    return PlacedNeedle(
        ids, spans, context_end, context_start, needle_start, needle_end, round(min(100.0, max(0.0, depth_actual)), 3)
    )
