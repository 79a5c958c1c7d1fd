"""Batched computations several scorers share (leading axes ``[R, Hkv]``: batch rows x KV heads).

Every function works over any leading axes, so one head (no leading axes) is the same call.
"""

from __future__ import annotations

import torch

from runtime.math.arrays import to_device


def masked(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``scores [..., n]`` with the padding (``~valid``) at ``-inf``: it never competes for a budget."""
    return scores.masked_fill(~valid, float("-inf"))


def max_pooled(attention: torch.Tensor, pool: int) -> torch.Tensor:
    """``attention [..., n]`` with each token worth its most-attended neighbour within ``pool``
    (odd) positions, which keeps multi-token spans whole (kvpress's EA / SnapKV pooling)."""
    if pool <= 1:
        return attention
    shape = attention.shape
    pooled = torch.nn.functional.max_pool1d(attention.reshape(-1, 1, shape[-1]), pool, stride=1, padding=pool // 2)
    return pooled.reshape(shape)


def value_weighted(attention: torch.Tensor, inputs, epsilon: float) -> torch.Tensor:
    """Expected Attention's score ``(a_i + epsilon) * ||v_i||`` (arXiv 2510.00636, Eq. 9) of
    ``attention [R, Hkv, n]``, padding ``-inf``; shared by the scorers that estimate attention."""
    return masked((attention + epsilon) * inputs.values.float().norm(dim=-1), inputs.valid)


def empty_heads_to_zero(attention: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``attention [..., n]`` of a softmax over each head's valid rows, 0 for a head with none
    (softmax over nothing); NaN from overflow elsewhere stays NaN (the engine refuses it)."""
    return torch.where(valid.any(-1, keepdim=True), attention, torch.zeros_like(attention))


def masked_zscore(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` (population std, at least 1e-6) over the ``mask``ed entries of the
    last axis, per leading index, float64 (0 where not ``mask``ed)."""
    x, weight = x.double(), mask.double()
    count = weight.sum(-1, keepdim=True).clamp_min(1)
    mean = (x * weight).sum(-1, keepdim=True) / count
    std = (((x - mean) ** 2 * weight).sum(-1, keepdim=True) / count).sqrt().clamp_min(1e-6)
    return (x - mean) / std * weight


def leverage_scores(
    keys: torch.Tensor, mask: torch.Tensor | None = None, sketch: torch.Tensor | None = None, ridge: float = 1e-6
) -> torch.Tensor:
    """Statistical leverage of the ``mask``ed rows of ``keys [..., n, d]``, float64 ``[..., n]``
    (0 for the other rows; ``mask`` None: every row).

    ``l_i = x_i^T (X^T X + lambda I)^{-1} x_i`` with ``X`` the masked rows centred on their mean
    (``lambda = ridge * mean diag(X^T X)``, only to keep the Cholesky factorisation defined for
    rank-deficient ``X``); the scores lie in ``[0, 1]`` and sum to about ``rank(X)``.  With
    ``sketch`` ``Phi [..., d, k]`` (entries ``N(0, 1/k)``), ``X <- X Phi`` first: the
    approximation of "Compactor: Calibrated Query-Agnostic KV Cache Compression with
    Approximate Leverage Scores" (arXiv 2507.08143), meant for large ``d``.
    """
    x = keys.double()
    if sketch is not None:  # sketched before centring: (X - 1 mu) Phi = X Phi - 1 (mu Phi), fewer columns
        x = x @ sketch.double().to(x.device)  # [..., n, k]
    weight = torch.ones_like(x[..., :1]) if mask is None else mask.unsqueeze(-1).double()  # [..., n, 1]
    count = weight.sum(-2, keepdim=True).clamp_min(1)
    x = (x - (x * weight).sum(-2, keepdim=True) / count).mul_(weight)  # centred masked rows, 0 elsewhere
    gram = x.transpose(-1, -2) @ x  # [..., k, k]
    jitter = ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)  # [...]
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    factor = torch.linalg.cholesky(gram + jitter[..., None, None] * eye)
    # the rows whitened by one product with L^{-1} (a k x k solve), not n triangular solves:
    # 0.77-0.84x the time, with the sketch before centring (R-compression-cost-2026-11-27)
    inverse = torch.linalg.solve_triangular(factor, eye.expand_as(factor), upper=False)  # L^{-1} [..., k, k]
    return (x @ inverse.transpose(-1, -2)).square_().sum(-1)


def chunked_attention_mass(
    queries: torch.Tensor, query_chunk: torch.Tensor, keys: torch.Tensor, key_chunk: torch.Tensor, scale: float
) -> torch.Tensor:
    """Non-causal chunked attention: the attention each key receives from its own chunk's queries.

    ``queries [R, Hkv, G, W, d]`` (a KV head's group of query heads), ``keys [R, Hkv, n, d]``;
    ``query_chunk`` int ``[R, Hkv, W]`` and ``key_chunk`` int ``[R, Hkv, n]`` number each query's
    and key's chunk (``-1``: takes no part).  The queries of chunk ``c`` attend (softmax over
    the keys of chunk ``c``, logits ``scale * q.k``, no causal mask) to those keys only; a key's
    mass is the sum over its chunk's queries, averaged over the ``G`` query heads.  Returns
    float32 ``[R, Hkv, n]`` (0 for a key whose chunk has no query).  One masked softmax per
    chunk for every row and head.
    """
    rows, heads, n, dim = keys.shape
    group = queries.shape[2]
    mass = torch.zeros(rows, heads, n, dtype=torch.float32, device=keys.device)
    for c in range(int(key_chunk.max()) + 1 if key_chunk.numel() else 0):
        in_keys, in_queries = key_chunk == c, query_chunk == c  # [R, Hkv, n], [R, Hkv, W]
        key_rows = in_keys.any(0).any(0).nonzero().squeeze(1)  # the rows any head has in chunk c
        query_rows = in_queries.any(0).any(0).nonzero().squeeze(1)
        if key_rows.numel() == 0 or query_rows.numel() == 0:
            continue
        lo_k, hi_k = int(key_rows[0]), int(key_rows[-1]) + 1
        lo_q, hi_q = int(query_rows[0]), int(query_rows[-1]) + 1
        span_q, span_k = hi_q - lo_q, hi_k - lo_k
        grouped = queries[:, :, :, lo_q:hi_q].reshape(rows, heads, group * span_q, dim)
        logits = grouped @ keys[:, :, lo_k:hi_k].transpose(-1, -2)  # [R, Hkv, G*q, k]
        if scale != 1.0:
            logits.mul_(scale)
        chunk_keys = in_keys[:, :, lo_k:hi_k]
        ragged = not bool(chunk_keys.all())  # after evictions the heads' chunks differ: mask
        if ragged:
            logits.masked_fill_(~chunk_keys.unsqueeze(2), float("-inf"))
        weights = torch.softmax(logits, dim=-1).view(rows, heads, group, span_q, span_k)
        if ragged:  # a head with no key in this chunk: softmax over nothing, no mass
            has_keys = chunk_keys.any(-1)[:, :, None, None, None]
            weights = torch.where(has_keys, weights, torch.zeros_like(weights))
        chunk_queries = in_queries[:, :, lo_q:hi_q]
        if not bool(chunk_queries.all()):
            weights = weights * chunk_queries[:, :, None, :, None]
        mass[:, :, lo_k:hi_k] += weights.sum(3).mean(2)
    return mass


def middle_chunk_attention(inputs, queries: torch.Tensor, query_positions: torch.Tensor, spec) -> torch.Tensor:
    """:func:`chunked_attention_mass` of every head's middle rows (all but its first ``spec.first`` and
    last ``spec.last``), the chunks starting at its first middle row and only the queries of positions
    from its first to its last middle row taking part: float32 ``[R, Hkv, n]``.

    ``inputs``: the layer's :class:`~runtime.scorers.inputs.LayerInputs`; ``queries [R, Hkv, G, W, d]``
    post-RoPE at ``query_positions [R, W]`` (``-1``: none); ``spec`` a
    :class:`~runtime.math.chunk_attention.ChunkSpec` (logits ``spec.scale * q.k``, None: the layer's scale).
    """
    keys, positions, lengths = inputs.keys.float(), inputs.positions, to_device(inputs.lengths, inputs.keys.device)
    n = keys.shape[2]
    first = lengths.clamp(max=spec.first)  # [R, Hkv]
    end = lengths - (lengths - first).clamp(max=spec.last)
    index = torch.arange(n, device=keys.device)
    middle = (index >= first.unsqueeze(-1)) & (index < end.unsqueeze(-1))  # [R, Hkv, n]
    origin = positions.gather(-1, first.clamp(max=n - 1).unsqueeze(-1)).squeeze(-1)  # [R, Hkv]
    stop = positions.gather(-1, (end - 1).clamp(min=0, max=n - 1).unsqueeze(-1)).squeeze(-1)
    query_positions = query_positions.unsqueeze(1)  # [R, 1, W]
    inside = (query_positions >= origin.unsqueeze(-1)) & (query_positions <= stop.unsqueeze(-1))  # [R, Hkv, W]
    key_chunk = torch.div(positions - origin.unsqueeze(-1), spec.chunk, rounding_mode="floor")
    query_chunk = torch.div(query_positions - origin.unsqueeze(-1), spec.chunk, rounding_mode="floor")
    scale = inputs.scaling if spec.scale is None else spec.scale
    return chunked_attention_mass(
        queries, query_chunk.masked_fill(~inside, -1), keys, key_chunk.masked_fill(~middle, -1), scale
    )
