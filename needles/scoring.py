"""Scoring a generated answer against a probe, and greedy answering (for checks and benchmarks).

:func:`answer_is_correct` is RULER's string match: the ground-truth answer must occur in the
generated text, case-insensitively, with whitespace runs collapsed on both sides.
"""

from __future__ import annotations

from needles.probe import Probe


def normalise(text: str) -> str:
    """Lower-case ``text`` and collapse whitespace runs to single spaces."""
    return " ".join(text.lower().split())


def answer_is_correct(generated_text: str, probe: Probe | str) -> bool:
    """Whether ``generated_text`` contains the probe's answer (or the given answer string)."""
    answer = probe if isinstance(probe, str) else probe.answer
    wanted = normalise(answer)
    if not wanted:
        raise ValueError("the probe has an empty answer")
    return wanted in normalise(generated_text)


def greedy_answer(model, tokenizer, probe: Probe, max_new_tokens: int = 16) -> str:
    """The model's uncompressed greedy continuation of ``probe.input_ids`` (special tokens dropped), one token
    a step through a cache whatever the checkpoint's ``use_cache`` says."""
    import torch

    device = next(model.parameters()).device
    input_ids = torch.tensor([probe.input_ids], dtype=torch.long, device=device)  # [1, T]
    with torch.no_grad():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            use_cache=True,
        )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
