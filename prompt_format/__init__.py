"""The prompt format: how a context and a question become the token ids a model sees.

Profiling and serving must see prompts of one format: the heads are profiled on needles probes
and served on the runtime's ``answer()`` prompts.  Both build them here.  This package imports
nothing (it takes a transformers tokenizer object), so the runtime may use it without the
probe generator and needles without the runtime.

The prompt is one user message ``context + "\\n\\n" + question`` put through the tokenizer's
chat template with the generation prompt.  A tokenizer without a chat template (or
``chat=False``) gets the plain ``[bos]context\\n\\nquestion\\nAnswer:``, where ``[bos]`` is the
beginning-of-sequence token only if the tokenizer adds one itself (Llama's ``<s>``; not
SmolLM2's or GPT-2's, whose ``bos_token`` is never added) and ``Answer:`` cues a base model to
answer.

Token ids are those of the whole prompt text tokenized at once (special-token text inside it
honoured, none added).  ``context_end`` splits them into the question-free context part and
the question part: ``ids[:context_end]`` is exactly what the context part's text tokenizes to
on its own, so question-agnostic runs can prefill the context alone (see
:func:`context_boundary`).

    ids, context_end = encode_prompt(tokenizer, context, question)
    prompt = render_prompt(tokenizer, context, question)   # text and character positions
"""

from __future__ import annotations

from dataclasses import dataclass

SEPARATOR = "\n\n"  # between the context and the question
ANSWER_CUE = "\nAnswer:"  # ends a prompt without a chat template


class PromptSplitError(ValueError):
    """The prompt has no context/question split that tokenizes alone as inside the prompt."""


@dataclass(frozen=True)
class PromptText:
    text: str
    context_start: int  # character where the context starts
    question_start: int  # character where the question part starts (after the separator)


def _leading_bos(tokenizer) -> str:
    """The beginning-of-sequence token's text when the tokenizer adds it by itself, else ``""``."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    with_specials = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if with_specials and with_specials[0] == bos_id else ""


def render_prompt(tokenizer, context: str, question: str, *, chat: bool = True) -> PromptText:
    """The prompt text for ``context`` and ``question`` (see the module docstring)."""
    content = context + SEPARATOR + question
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        start = text.find(content)
        if start < 0 or text.find(content, start + 1) >= 0:
            raise ValueError(
                "the chat template does not reproduce the user message verbatim exactly once, so "
                "the context cannot be located in the prompt; pass chat=False, or token ids"
            )
    else:
        bos = _leading_bos(tokenizer)
        text = bos + content + ANSWER_CUE
        start = len(bos)
    return PromptText(text, start, start + len(context) + len(SEPARATOR))


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids of ``text`` (special-token text inside it is honoured, none are added) and the
    offset mapping, or ``None`` when the tokenizer cannot give offsets."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return encode(tokenizer, text), None
    offsets = encoded.get("offset_mapping") if hasattr(encoded, "get") else None
    if offsets is None:
        return list(encoded["input_ids"]), None
    return list(encoded["input_ids"]), [tuple(pair) for pair in offsets]


def context_boundary(tokenizer, text: str, ids: list[int], offsets, question_start: int) -> int:
    """``context_end``: the first token of the question part.

    The split goes at the context/question separator, at the first of these character
    positions where the prompt's prefix tokenizes alone exactly as inside the whole prompt:
    after the separator, between its two newlines, before it.  (Byte-level BPEs such as
    SmolLM2's turn a trailing ``"\\n\\n"`` into one token but split it before a word, so there the
    question part starts with the separator.)
    """
    candidates = [question_start, question_start - len(SEPARATOR) + 1, question_start - len(SEPARATOR)]
    for cut in candidates:
        prefix = encode(tokenizer, text[:cut])
        if ids[: len(prefix)] != prefix:
            continue
        if offsets is not None and len(prefix) < len(ids):
            start, end = offsets[len(prefix)]
            if start < cut and text[start:cut].strip():
                continue  # the next token starts inside the prefix
        return len(prefix)
    raise PromptSplitError(
        "no context/question split of the prompt tokenizes identically alone and inside "
        "the whole prompt; the tokenizer merges across the separator"
    )


def encode_prompt(tokenizer, context: str, question: str, *, chat: bool = True) -> tuple[list[int], int]:
    """The prompt's token ids and ``context_end`` (``ids[:context_end]`` holds no question)."""
    prompt = render_prompt(tokenizer, context, question, chat=chat)
    ids, offsets = encode_with_offsets(tokenizer, prompt.text)
    return ids, context_boundary(tokenizer, prompt.text, ids, offsets, prompt.question_start)
