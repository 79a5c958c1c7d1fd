"""Attention over a packed per-layer KV buffer: every (batch row, KV head) segment in one computation.

The packed cache (:mod:`runtime.cache`) keeps one layer's retained keys and values in one buffer
``[C, d]``; segment ``s`` (batch row ``b``, KV head ``h``, ``s = b * Hkv + h``) owns a run of whole
pages of ``P`` rows, so ``keys.view(C // P, P, d)`` is a stack of pages and page ``p`` belongs to
segment ``owner[p]``, holding its rows ``page_start[p] .. page_start[p] + P - 1``.

:func:`segment_attention` computes, for queries ``[S, M, d]`` (the ``M`` query rows of segment
``s``: its ``G`` query heads times the chunk's tokens) and a per-query count of visible rows
``limit [S, M]`` (query ``m`` of segment ``s`` sees the segment's rows ``0 .. limit - 1``), the
ordinary softmax attention and its log-sum-exp, split over pages and combined exactly (the
"split-K" / flash-decoding reduction):

    logits[p, m, j] = s q_{owner(p), m} . k_{p, j}         (-inf where row j is not visible)
    max_s           = max over the segment's pages of max_j logits
    out_s           = sum_p sum_j exp(logits - max_s) v_{p, j} / sum_p sum_j exp(logits - max_s)
    lse_s           = max_s + log sum_p sum_j exp(logits - max_s)

Two batched matmuls (``bmm``) and a few scatter reductions per call, whatever the number of
segments or their lengths: no Python loop over batch rows or heads.  Pure torch, so it runs on
any device (on CUDA the matmuls are cuBLAS batched GEMMs).  A query with no visible row gets
``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import torch

# Bound on the logits materialised at once (pages x P x query rows); larger query sets are tiled.
_MAX_LOGITS = 1 << 24


def segment_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    owner: torch.Tensor,
    page_start: torch.Tensor,
    limit: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [S, M, d] float32, lse [S, M] float32)``; see the module docstring.

    ``query [S, M, d]``; ``key_pages / value_pages [num_pages, P, d]``; ``owner`` int64
    ``[num_pages]`` (segment of each page); ``page_start`` int64 ``[num_pages]`` (the segment row
    of each page's first row); ``limit`` int64 ``[S, M]``.
    """
    segments, rows, dim = query.shape
    num_pages, page, _ = key_pages.shape
    if num_pages == 0:
        return (
            torch.zeros(segments, rows, dim, dtype=torch.float32, device=query.device),
            torch.full((segments, rows), float("-inf"), dtype=torch.float32, device=query.device),
        )
    tile = max(1, _MAX_LOGITS // max(num_pages * page, 1))
    if rows > tile:
        parts = [
            segment_attention(
                query[:, lo : lo + tile], key_pages, value_pages, owner, page_start, limit[:, lo : lo + tile], scaling
            )
            for lo in range(0, rows, tile)
        ]
        return torch.cat([out for out, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=1)
    page_query = query.to(key_pages.dtype).index_select(0, owner)  # [np, M, d]
    logits = torch.bmm(page_query, key_pages.transpose(1, 2)).float() * float(scaling)  # [np, M, P]
    row = page_start.unsqueeze(1) + torch.arange(page, device=owner.device)  # [np, P] segment row
    visible = row.unsqueeze(1) < limit.index_select(0, owner).unsqueeze(2)  # [np, M, P]
    logits = logits.masked_fill(~visible, float("-inf"))
    page_max = logits.amax(dim=2)  # [np, M]
    seg_max = torch.full((segments, rows), float("-inf"), dtype=torch.float32, device=query.device)
    seg_max = seg_max.scatter_reduce(0, owner.unsqueeze(1).expand(-1, rows), page_max, "amax")
    shift = torch.where(torch.isfinite(seg_max), seg_max, torch.zeros_like(seg_max))  # [S, M]
    weights = torch.exp(logits - shift.index_select(0, owner).unsqueeze(2))  # [np, M, P], 0 where hidden
    seg_sum = torch.zeros(segments, rows, dtype=torch.float32, device=query.device)
    seg_sum = seg_sum.index_add(0, owner, weights.sum(dim=2))  # [S, M]
    page_out = torch.bmm(weights.to(value_pages.dtype), value_pages)  # [np, M, d]
    out = torch.zeros(segments, rows, dim, dtype=torch.float32, device=query.device)
    out = out.index_add(0, owner, page_out.float())  # [S, M, d]
    seen = seg_sum > 0
    out = out / torch.where(seen, seg_sum, torch.ones_like(seg_sum)).unsqueeze(2)
    lse = torch.where(seen, shift + torch.log(torch.where(seen, seg_sum, torch.ones_like(seg_sum))), seg_max)
    return out, lse
