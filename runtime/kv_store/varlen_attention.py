"""A chunk's attention over a packed layer on a GPU: one FlashAttention varlen call, every segment at once.

FlashAttention's variable-length interface (``flash_attn_varlen_func``; PyTorch's
``aten::_flash_attention_forward``) attends a batch of sequences of different lengths in one
kernel: sequence ``i``'s queries are rows ``cu_q[i] .. cu_q[i+1] - 1`` of the packed queries, its
keys the ``seqused_k[i]`` rows from ``cu_k[i]`` of the packed keys, and with ``is_causal`` the mask
is aligned to the bottom right (query ``t`` of ``n_q`` sees key ``j`` when ``j <= t + n_k - n_q``).

A packed layer (:mod:`runtime.kv_store.segments`) is that batch already: segment ``s = b * Hkv + h``
holds its rows at buffer rows ``offset[s] .. offset[s] + length[s] - 1`` of ``key_buffer [C, d]``,
the chunk just appended at its end.  So each segment is one sequence with one KV head and the
``G`` query heads of its group (GQA in the kernel), its queries the chunk's ``q`` tokens; the
bottom-right causal mask is then exactly the chunk's rule (token ``t`` sees everything held before
the chunk and the chunk up to ``t``); the buffer is read in place (no gather, no page merge, no
logits in memory) and the log-sum-exp comes back for MomentKV's merge.  On a GPU the alternative,
:func:`~runtime.kv_store.paged_attention.segment_attention`, materialises logits over every stored
row for every query row (the block-wise prefill at 6.61x plain's prefill on an H200:
docs/results.md R-gpu-prefill-2026-11-27).

A decode step is the same call with one query per sequence (:func:`varlen_decode_attention`), its
tables on the device: the layout's first rows of this storage generation and ``seqused_k`` = the
storage's ``ends`` (advanced in place at every step) minus them, the length bound the widest
capacity; so the step reads nothing back and replays in a captured graph
(:mod:`runtime.serve.decode_graph`).

Where it serves (:func:`varlen_serves`): a CUDA device whose flash kernels run (compute capability
8.0 and up), a bf16 / fp16 buffer, a head dimension the kernel takes (a multiple of 8, at most
256), no soft-capping, no sliding window (rows are not positions once tokens are evicted), no
padding in the chunk, segments at increasing offsets.  Elsewhere the caller keeps its own path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from runtime.math.arrays import to_device

FLASH_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


def varlen_serves(query: torch.Tensor, store, softcap: float | None) -> bool:
    """Whether the flash kernel serves ``store`` (a :class:`~runtime.kv_store.segments.SegmentStore`)
    here, for a chunk (:func:`varlen_chunk_attention`) or a decode step (:func:`varlen_decode_attention`)
    (module docstring); a chunk's caller has already ruled out padding and sliding windows.  Host
    reads only."""
    keys = store.key_buffer
    if query.device.type != "cuda" or keys.dtype not in FLASH_DTYPES or not _flash_runs(query.device.index):
        return False
    return varlen_takes(store, softcap)


def varlen_takes(store, softcap: float | None) -> bool:
    """What :func:`varlen_serves` asks of ``store`` itself, whatever the device: no soft-cap, a head dim the kernel
    takes (a multiple of 8, at most :data:`MAX_HEAD_DIM`), values of that head dim (FlashAttention 2 takes one head
    size: not MiMo-V2-Flash's narrower values), rows stored in increasing position order.  Host reads only."""
    if softcap is not None or store.head_dim % 8 or store.head_dim > MAX_HEAD_DIM:
        return False
    return store.value_dim == store.head_dim and store.increasing


@functools.cache
def _flash_runs(index: int | None) -> bool:
    """This torch build has FlashAttention and CUDA device ``index`` runs it (compute capability 8.0+)."""
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index) >= (8, 0)


def flash_varlen(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling: float, seqused_k):
    """PyTorch's FlashAttention varlen forward, causal (bottom-right), no dropout: ``(out [Tq, Hq, d],
    lse float32)``, the log-sum-exp ``[Hq, Tq]`` (newer torch) or ``[sequences, Hq, max_q]``, padded
    (torch 2.6: its meta kernel says so)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=float(scaling), seqused_k=seqused_k
    )
    return out, lse


def reference_varlen(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling: float, seqused_k):
    """:func:`flash_varlen`'s semantics in plain torch, one sequence at a time, float32: the reference
    the tests and the GPU benchmark check the kernel and the packing against (any device)."""
    total, query_heads, dim = query.shape
    out = torch.zeros(total, query_heads, dim, dtype=torch.float32, device=query.device)
    lse = torch.full((query_heads, total), float("-inf"), dtype=torch.float32, device=query.device)
    group = query_heads // key.shape[1]
    starts_q, starts_k, counts = cu_q.tolist(), cu_k.tolist(), seqused_k.tolist()
    for i, count in enumerate(counts):
        lo, hi = starts_q[i], starts_q[i + 1]
        keys = key[starts_k[i] : starts_k[i] + count].float().repeat_interleave(group, dim=1)  # [n_k, Hq, d]
        values = value[starts_k[i] : starts_k[i] + count].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", query[lo:hi].float(), keys) * scaling  # [Hq, n_q, n_k]
        n_q = hi - lo
        visible = torch.arange(count, device=query.device)[None, :] <= (
            torch.arange(n_q, device=query.device)[:, None] + count - n_q
        )  # bottom-right causal
        logits = logits.masked_fill(~visible, float("-inf"))
        lse[:, lo:hi] = torch.logsumexp(logits, dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), values)
    return out, lse


def varlen_chunk_attention(
    query: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    offset: np.ndarray,
    length: np.ndarray,
    scaling: float,
    *,
    kernel: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query of the chunk ``query [B, Hq, q, d]`` (no padding) over its segment's rows, the
    chunk appended (``length [B, Hkv]`` host ints count it; ``offset [B, Hkv]`` host ints, increasing
    in ``s = b * Hkv + h``), causally within the chunk: ``(out [S, G*q, d], lse [S, G*q])`` float32 in
    :func:`~runtime.kv_store.paged_attention.segment_attention`'s layout (a segment's ``G`` heads
    times the chunk's tokens).  ``kernel``: one with :func:`flash_varlen`'s signature (default: it;
    :func:`reference_varlen` to check it)."""
    batch, query_heads, q_len, dim = query.shape
    heads = length.shape[1]
    group, segments = query_heads // heads, batch * heads
    # [B, Hkv, G, q, d] -> [S * q, G, d]: segment s's tokens, each with its group's G heads
    packed = query.view(batch, heads, group, q_len, dim).transpose(2, 3).reshape(segments * q_len, group, dim)
    flat_offset, flat_length = offset.reshape(-1), length.reshape(-1)
    cu_q = torch.arange(0, (segments + 1) * q_len, q_len, dtype=torch.int32, device=query.device)
    # sequence s's keys start at its offset; the last entry closes the buffer (seqused_k says how many)
    cu_k = to_device(np.append(flat_offset, key_buffer.shape[0]).astype(np.int32), query.device)
    used = to_device(flat_length.astype(np.int32), query.device)
    out, lse = (kernel or flash_varlen)(
        packed.to(key_buffer.dtype),
        key_buffer.view(-1, 1, dim),
        value_buffer.view(-1, 1, dim),
        cu_q,
        cu_k,
        q_len,
        int(flat_length.max()),
        scaling,
        used,
    )
    # [S * q, G, d] -> [S, G, q, d] -> [S, G*q, d]
    out = out.view(segments, q_len, group, dim).transpose(1, 2).reshape(segments, group * q_len, dim)
    if lse.dim() == 3:  # torch before 2.8 or so: [S, G, max_q], padded per sequence (here max_q = q)
        lse = lse[:, :, :q_len]
    else:  # newer: unpadded, [G, S * q]
        lse = lse.view(group, segments, q_len).transpose(0, 1)
    return out.float(), lse.reshape(segments, group * q_len).float()


def varlen_decode_attention(
    query: torch.Tensor, store, layout, scaling: float, *, kernel: Callable | None = None, need_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step, ``query [S, G, d]`` over every segment's live rows, as one varlen call:
    ``(out [S, G, d], lse [S, G])`` float32 (for MomentKV's merge); without ``need_lse``, ``(out, None)``
    with ``out`` in the buffer's dtype, as the kernel returns it (a float32 round trip would be two
    launches per layer and step for nothing).  Every table is on the device already (the layout's,
    built at the last repack, and the storage's ``ends``, advanced in place at every step), so the
    step asks the host nothing and the same calls replay in a captured graph; the kernel's upper
    bound of the lengths is the widest capacity, which only a repack (a new layout) changes."""
    dim = query.shape[-1]
    used = (store.ends - layout.segment_offset).to(torch.int32)  # [S] live rows, on the device
    out, lse = (kernel or flash_varlen)(
        query.to(store.key_buffer.dtype),
        store.key_buffer.view(-1, 1, dim),
        store.value_buffer.view(-1, 1, dim),
        layout.decode_query_starts,
        layout.varlen_starts,
        1,
        max(layout.widest, 1),
        scaling,
        used,
    )
    if not need_lse:
        return out, None
    lse = lse[:, :, 0] if lse.dim() == 3 else lse.transpose(0, 1)  # [S, G, 1] (torch 2.6) or [G, S]
    return out.float(), lse.float()
