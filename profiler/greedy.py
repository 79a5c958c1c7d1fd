"""Greedy decoding as every profiler pass and benchmark runs it: one ``model.generate`` call."""

from __future__ import annotations

import torch


def greedy_generate(model, tokenizer, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """``model.generate`` on ``ids [B, T]`` (no padding), greedy, for ``max_new_tokens`` tokens at most:
    the sampling settings of the checkpoint's generation config are overridden (no temperature,
    top-p or top-k warnings), the pad token is the tokenizer's, else its EOS, and a step feeds one token
    through a cache even where the checkpoint says ``use_cache: false`` (as training with gradient
    checkpointing saves it; without, every step is a forward pass over the whole sequence).  ``kwargs`` go
    to ``generate`` (e.g. the cache: ``runtime.cache_argument``).  Returns the prompt and the answer
    ``[B, T + n]``."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=pad,
        use_cache=True,
        **kwargs,
    )
