"""Compression entry points around ``model.generate``.

Two places to compress:

* **question-agnostic** (the serving case: the context is cached before any question):
  ``context_columns=n`` prefills and compresses ``input_ids[:, :n]``; generate() then feeds
  the question columns through the compressed cache.
* **question-aware**: ``context_columns=None`` prefills and compresses the whole prompt but
  its last column (generate() re-feeds the prompt when the cache already holds all of it, so
  the last token is what it feeds).

Token level::

    cache, report = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=n,
                                    calibration=calibration)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32)

or ``generate(model, ids, policy, ...)`` which does both.  Text level: ``answer(model,
tokenizer, context, question, policy)`` (one pair or lists of them, batched with padding).

Batches: rows are laid out ``[pad, context, pad, question]`` (:func:`build_inputs`), so every
row's context ends at the same column and every question ends at the last column; padding
is never stored in the cache, and each row is compressed on its own real length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prompt_format import encode_prompt

from .attention import enable
from .cache import RaggedCache
from .compress import CompressionReport, compress, prefill
from .policy import CompressionPolicy


def build_inputs(contexts: list[list[int]], questions: list[list[int]], pad_token_id: int):
    """``input_ids [B, Lc + Lq]``, ``attention_mask``, ``Lc`` for rows ``[pad, ctx, pad, question]``."""
    if len(contexts) != len(questions) or not contexts:
        raise ValueError(f"need as many contexts as questions (at least one), got {len(contexts)} and {len(questions)}")
    if any(len(context) == 0 for context in contexts):
        raise ValueError("every context needs at least one token")
    if any(len(question) == 0 for question in questions):
        raise ValueError("every question needs at least one token (generation starts after it)")
    context_columns = max(len(c) for c in contexts)
    question_columns = max(len(q) for q in questions)
    ids, mask = [], []
    for context, question in zip(contexts, questions, strict=True):
        pad_c, pad_q = context_columns - len(context), question_columns - len(question)
        ids.append([pad_token_id] * pad_c + list(context) + [pad_token_id] * pad_q + list(question))
        mask.append([0] * pad_c + [1] * len(context) + [0] * pad_q + [1] * len(question))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long), context_columns


@torch.no_grad()
def compress_prompt(
    model,
    input_ids: torch.Tensor,
    policy: CompressionPolicy | None,
    *,
    attention_mask: torch.Tensor | None = None,
    context_columns: int | None = None,
    calibration=None,
    block_size: int | None = None,
) -> tuple[RaggedCache, CompressionReport | None]:
    """A :class:`RaggedCache` holding the compressed prefix of ``input_ids [B, T]``.

    ``context_columns``: question-agnostic split (see the module docstring); None =
    question-aware.  ``policy=None`` prefills without evicting (the full cache).
    ``block_size``: prefill in blocks of that many columns and evict after each (KeyDiff's
    block-wise prefill, KeyDiff arXiv 2504.15364 Eq. 6), so the cache never holds more than the budget plus
    one block; budgets are those of the whole prefix, and scorers see positions and RoPE at
    each block's true absolute position.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    total = input_ids.shape[1]
    columns = total - 1 if context_columns is None else int(context_columns)
    if not 1 <= columns <= total - 1:
        raise ValueError(
            f"the compressed prefix must leave at least one column for generate(): "
            f"context_columns={columns} with a prompt of {total} columns"
        )
    if policy is not None:
        policy.check_calibration(calibration)
    enable(model)
    cache = RaggedCache.for_model(model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if block_size is None or policy is None:
        stats = prefill(model, cache, input_ids[:, :columns], attention_mask[:, :columns], policy=policy)
        report = compress(model, cache, policy, calibration, prompt_stats=stats) if policy is not None else None
        return cache, report
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lengths = attention_mask[:, :columns].sum(-1).tolist()  # each row's real context length
    stats = None
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        stats = prefill(
            model, cache, input_ids[:, start:end], attention_mask[:, :end], policy=policy, prompt_stats=stats
        )
        report = compress(
            model, cache, policy, calibration, prompt_stats=stats, context_lengths=lengths, final=end == columns
        )
    return cache, report


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [B, T + new] as returned by model.generate
    new_tokens: torch.Tensor  # [B, new]
    cache: RaggedCache
    report: CompressionReport | None


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    policy: CompressionPolicy | None,
    *,
    attention_mask: torch.Tensor | None = None,
    context_columns: int | None = None,
    calibration=None,
    block_size: int | None = None,
    **generate_kwargs,
) -> GenerationResult:
    """:func:`compress_prompt` then ``model.generate`` (greedy unless ``do_sample=True``)."""
    cache, report = compress_prompt(
        model,
        input_ids,
        policy,
        attention_mask=attention_mask,
        context_columns=context_columns,
        calibration=calibration,
        block_size=block_size,
    )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    generate_kwargs.setdefault("do_sample", False)
    sequences = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, **generate_kwargs)
    return GenerationResult(
        sequences=sequences, new_tokens=sequences[:, input_ids.shape[1] :], cache=cache, report=report
    )


def split_prompt(tokenizer, context: str, question: str, chat: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of the prompt's question-free context part, and of the rest (question + template).

    The prompt is the one format the probes that calibrated the heads have
    (:func:`prompt_format.encode_prompt`): with ``chat`` and a chat template, one user message
    ``context + "\\n\\n" + question`` with the generation prompt; else the plain
    ``[bos]context\\n\\nquestion\\nAnswer:``.
    """
    ids, context_end = encode_prompt(tokenizer, context, question, chat=chat)
    return ids[:context_end], ids[context_end:]


def answer(
    model,
    tokenizer,
    context: str | list[str],
    question: str | list[str],
    policy: CompressionPolicy | None,
    *,
    calibration=None,
    question_aware: bool = False,
    chat: bool = True,
    max_new_tokens: int = 32,
    **generate_kwargs,
) -> str | list[str]:
    """Answer ``question`` about ``context`` with a compressed cache (lists: one batch)."""
    single = isinstance(context, str)
    contexts = [context] if single else list(context)
    questions = [question] if isinstance(question, str) else list(question)
    if len(contexts) != len(questions):
        raise ValueError(f"got {len(contexts)} contexts and {len(questions)} questions")
    pairs = [split_prompt(tokenizer, c, q, chat=chat) for c, q in zip(contexts, questions, strict=True)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask, context_columns = build_inputs([p[0] for p in pairs], [p[1] for p in pairs], pad)
    generate_kwargs.setdefault("pad_token_id", pad)
    result = generate(
        model,
        ids,
        policy,
        attention_mask=mask,
        context_columns=None if question_aware else context_columns,
        calibration=calibration,
        max_new_tokens=max_new_tokens,
        **generate_kwargs,
    )
    texts = [tokenizer.decode(row, skip_special_tokens=True).strip() for row in result.new_tokens]
    return texts[0] if single else texts
