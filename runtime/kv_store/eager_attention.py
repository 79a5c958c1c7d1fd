"""A small reference attention that soft-caps, for the profiler's own attention functions.

transformers' fused ``sdpa`` function refuses a ``softcap`` (Gemma 2's
``attn_logit_softcapping``; "Gemma 2: Improving Open Language Models at a Practical Size",
arXiv 2408.00118), so the profiler's capture functions (:mod:`profiler.attention_capture`,
:mod:`profiler.moments`, :mod:`profiler.budget_curves`, :mod:`profiler.learned_scorer`) call
:func:`attention_forward`: ``sdpa`` unchanged when the layer does not soft-cap, else
:func:`eager_attention_forward`, which computes, per query head ``h`` of KV head ``h // G``:

    logits = s q k^T                       [B, Hq, q, k]   (float32)
    logits = c tanh(logits / c)            when softcap c is set
    logits = logits + mask                 the mask transformers passes (bool: float32 min where False)
    out    = softmax(logits) v             softmax in float32, out in the query's dtype

With learned attention sinks (``s_aux [Hq]``, gpt-oss's ``self_attn.sinks``, "gpt-oss-120b & gpt-oss-20b
Model Card", arXiv 2508.10925) the sink is one more logit of every query's softmax whose value is
dropped: ``out = softmax([logits, s_h])[:k] v``, as transformers' gpt-oss eager attention computes it
(:mod:`runtime.math.sinks`).

A sliding window needs nothing here: transformers builds it into the mask it passes (and a
sliding layer's cache hands over only the keys the window can reach).  ``sliding_window`` is
accepted and ignored, as transformers' own eager function does.

When the mask builder skipped the mask (``attention_mask=None``, no padding, the query and key
lengths equal or one query), the causal pattern is applied as ``sdpa``'s ``is_causal`` does.
"""

from __future__ import annotations

import torch

from runtime.math.sinks import softmax_with_sinks


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``c tanh(logits / c)`` (``logits`` itself when ``softcap`` is None)."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def masked(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``logits [B, H, q, k]`` (float32) with transformers' mask applied: a bool mask (True: attend)
    puts the lowest float32 where False (as transformers' float masks do: a fully masked padding
    row stays finite, so no NaN reaches the real tokens through its values), a float mask is
    added; ``[.., k']`` masks wider than ``k`` are cut to their first ``k`` columns, as
    transformers' eager attention does."""
    if attention_mask is None:
        return logits
    mask = attention_mask[..., : logits.shape[-1]]
    if mask.dtype == torch.bool:
        return logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
    return logits + mask.float()


# Logits held at once by the reference attention (float32 numbers): 256 MiB.  The whole [B, Hq, q, k]
# matrix of a 32K-token prefill with 32 query heads is 128 GiB (docs/results.md R-profiler-scale-2026-11-27).
MAX_LOGITS = 2**26


def eager_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    max_logits: int = MAX_LOGITS,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` function (see the module docstring): ``query [B, Hq, q, d]``,
    ``key / value [B, Hkv, k, d]``, learned sinks ``s_aux [Hq]`` (None: none) -> ``(out [B, q, Hq, d],
    None)``.  The queries are taken in blocks whose logits ``[B, Hq, rows, k]`` hold at most
    ``max_logits`` numbers (one query at least): each query's softmax is over its own row, so the
    blocks change nothing."""
    if dropout:
        raise ValueError("the reference attention does not implement attention dropout (use model.eval())")
    batch, num_q_heads, q_len, dim = query.shape
    num_kv_heads = key.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    scale = float(scaling) if scaling is not None else dim**-0.5
    causal = attention_mask is None and q_len > 1 and getattr(module, "is_causal", True)
    if causal:
        key, value = key[:, :, :q_len], value[:, :, :q_len]  # sdpa's is_causal: upper-left aligned
    keys, values = key.float(), value.float()  # [B, Hkv, k, d]
    k_len = keys.shape[2]
    rows = max(1, max_logits // max(1, batch * num_q_heads * k_len))
    sinks = None if s_aux is None else s_aux.float().reshape(1, num_q_heads, 1, 1)
    outputs = []
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        block = stop - start
        mask = attention_mask
        if causal:  # [1, 1, rows, k]: query i sees keys 0..i
            index = torch.arange(k_len, device=query.device)
            mask = (index[None, :] <= torch.arange(start, stop, device=query.device)[:, None])[None, None]
        elif mask is not None and mask.shape[-2] > 1:
            mask = mask[..., start:stop, :]  # [B or 1, 1 or Hq, rows, k']
        grouped = query[:, :, start:stop].float().reshape(batch, num_kv_heads, group * block, dim)  # [B, Hkv, G r, d]
        logits = torch.matmul(grouped, keys.transpose(-1, -2)) * scale  # [B, Hkv, G r, k]
        logits = soft_cap(logits.reshape(batch, num_q_heads, block, -1), softcap)  # [B, Hq, r, k]
        weights = softmax_with_sinks(masked(logits, mask), sinks)  # [B, Hq, r, k] float32
        weights = weights.reshape(batch, num_kv_heads, group * block, -1)
        outputs.append(torch.matmul(weights, values).reshape(batch, num_q_heads, block, -1))  # [B, Hq, r, dv]
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [B, Hq, q, d]
    return output.transpose(1, 2).contiguous().to(query.dtype), None  # [B, q, Hq, d]


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' ``sdpa`` function, or :func:`eager_attention_forward` when ``softcap`` or learned
    sinks ``s_aux`` are set (which ``sdpa`` cannot compute): ``(out [B, q, Hq, d], None)``."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return eager_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
