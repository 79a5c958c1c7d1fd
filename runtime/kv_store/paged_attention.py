"""Attention over a packed per-layer KV buffer: every (batch row, KV head) segment in one computation.

The packed cache (:mod:`runtime.kv_store.cache`) keeps one layer's retained keys and values in one buffer
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
segments or their lengths: no Python loop over batch rows or heads.  With a bf16 / fp16 cache both
accumulate and return float32 (:func:`float32_bmm`) and the logits are scaled in float32, as flash
kernels do: a bf16 ``bmm`` would round logits of 20 to within 0.06 before the softmax, 5x plain
sdpa's error (tests/test_bf16_exactness.py).

Two variants transformers' models pass to their attention function are honoured as they compute
them: ``softcap`` (Gemma 2's logit soft-capping, ``logits = c tanh(logits / c)`` after scaling and
before the mask) and, in :func:`segment_attention`, a sliding window or attention chunks (:class:`Window`: a
query at RoPE position ``p`` sees a row at position ``k`` only when ``p - k < W``, transformers'
``sliding_window_overlay``, or when ``k // C == p // C``, its ``chunked_overlay``).  Pure torch, so it runs on
any device (on CUDA the matmuls are cuBLAS batched GEMMs).  A query with no visible row gets
``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kv_store.eager_attention import soft_cap

# Decoding reads the live rows in place with one fused kernel call per KV head (or per segment, where
# a head's budgets differ between batch rows: :func:`live_rows_attention`) up to this many calls per
# layer; past it one batched call over the pages and their merge is faster (docs/results.md
# R-decode-kernels-2026-11-27).
LIVE_ROW_CALLS = 8
# Bound on the logits materialised at once (pages x P x query rows); larger query sets are tiled.
_MAX_LOGITS = 1 << 24


def first_visible(query_positions: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """The lowest RoPE position a query at ``query_positions`` (int, any shape) sees: ``p - W + 1`` through a
    sliding window of ``W`` (transformers' ``sliding_window_overlay``: ``p - k < W``), ``C (p // C)`` inside
    attention chunks of ``C`` positions (its ``chunked_overlay``: ``k // C == p // C``, Llama 4), the larger
    of the two with both; int64.  Causality bounds it from above."""
    positions = query_positions.long()
    first = torch.full_like(positions, torch.iinfo(torch.long).min) if window is None else positions - (window - 1)
    if chunk is not None:
        first = torch.maximum(first, torch.div(positions, chunk, rounding_mode="floor") * chunk)
    return first


@dataclass(frozen=True)
class Window:
    """What a query sees of the pages, by position: ``positions [num_pages, P]`` int (RoPE position of every
    stored row), ``first [S, M]`` int64 (the lowest position each query row sees, :func:`first_visible`: a
    sliding window, attention chunks)."""

    positions: torch.Tensor
    first: torch.Tensor

    @classmethod
    def of(cls, positions: torch.Tensor, query_positions: torch.Tensor, window: int | None, chunk: int | None = None):
        """The window of queries at ``query_positions [S, M]`` through a sliding ``window`` and / or ``chunk``."""
        return cls(positions, first_visible(query_positions, window, chunk))

    def rows(self, lo: int, hi: int) -> Window:
        """The window of query rows ``lo .. hi - 1`` only (a tile)."""
        return Window(self.positions, self.first[:, lo:hi])

    def visible(self, owner: torch.Tensor) -> torch.Tensor:
        """bool ``[num_pages, P, M]``: the row lies inside the query's window."""
        first = self.first.index_select(0, owner)  # [np, M]
        return self.positions.unsqueeze(2).long() >= first.unsqueeze(1)


_OUT_DTYPE_BMM: dict[tuple[str, torch.dtype], bool] = {}  # (device type, dtype) -> bmm takes out_dtype


def float32_bmm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(left, right)`` accumulated in and returned as float32, whatever the operands'
    dtype: a bf16 / fp16 ``bmm`` returns its sums rounded to that dtype (logits of 20 to within
    0.06 in bf16), which flash kernels never do.  On CUDA ``bmm(..., out_dtype=float32)`` (one
    GEMM, float32 accumulation and output); where that is missing (the CPU), float32 copies of the
    operands."""
    if left.dtype == torch.float32 and right.dtype == torch.float32:
        return torch.bmm(left, right)
    key = (left.device.type, left.dtype)
    if _OUT_DTYPE_BMM.get(key, left.device.type == "cuda"):
        try:
            return torch.bmm(left, right, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older torch, or a device without the kernel
            _OUT_DTYPE_BMM[key] = False
    return torch.bmm(left.float(), right.float())


def segment_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    owner: torch.Tensor,
    page_start: torch.Tensor,
    limit: torch.Tensor,
    scaling: float,
    *,
    softcap: float | None = None,
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [S, M, d] float32, lse [S, M] float32)``; see the module docstring.

    ``query [S, M, d]``; ``key_pages / value_pages [num_pages, P, d]``; ``owner`` int64
    ``[num_pages]`` (segment of each page); ``page_start`` int64 ``[num_pages]`` (the segment row
    of each page's first row); ``limit`` int64 ``[S, M]``; ``softcap`` and ``window``: see the
    module docstring.
    """
    num_pages, page, _ = key_pages.shape
    rows = query.shape[1]
    tile = max(1, _MAX_LOGITS // max(num_pages * page, 1))
    if rows > tile:
        parts = [
            segment_attention(
                query[:, lo : lo + tile],
                key_pages,
                value_pages,
                owner,
                page_start,
                limit[:, lo : lo + tile],
                scaling,
                softcap=softcap,
                window=None if window is None else window.rows(lo, lo + tile),
            )
            for lo in range(0, rows, tile)
        ]
        return torch.cat([out for out, _ in parts], dim=1), torch.cat([lse for _, lse in parts], dim=1)
    row = page_start.unsqueeze(1) + torch.arange(page, device=owner.device)  # [np, P] segment row
    visible = row.unsqueeze(2) < limit.index_select(0, owner).unsqueeze(1)  # [np, P, M]
    if window is not None:
        visible &= window.visible(owner)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=owner.device).masked_fill_(~visible, float("-inf"))
    return paged_attention(query, key_pages, value_pages, owner, bias, scaling, softcap=softcap)


def paged_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    owner: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
    *,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K computation with an additive ``bias`` (0 visible, ``-inf`` hidden) broadcastable
    to ``[num_pages, P, M]``: e.g. ``[num_pages, P, 1]``, one bias per stored row, while decoding;
    logits soft-capped first when ``softcap``.  Returns ``(out [S, M, d], lse [S, M])`` float32."""
    segments, rows, _ = query.shape
    num_pages, dim = key_pages.shape[0], value_pages.shape[-1]  # the output's: the values' head dim
    device = query.device
    if num_pages == 0:
        return (
            torch.zeros(segments, rows, dim, dtype=torch.float32, device=device),
            torch.full((segments, rows), float("-inf"), dtype=torch.float32, device=device),
        )
    if key_pages.dtype == torch.float32:
        page_query = (query * scaling).to(key_pages.dtype).index_select(0, owner)  # [np, M, d]
        # [np, P, M]: keys as the left operand (contiguous rows) is the fast layout for bmm
        logits = torch.bmm(key_pages, page_query.transpose(1, 2))
    else:  # bf16 / fp16: the logits accumulated, kept and scaled in float32, as flash kernels do
        page_query = query.to(key_pages.dtype).index_select(0, owner)  # [np, M, d]
        logits = float32_bmm(key_pages, page_query.transpose(1, 2)).mul_(scaling)
    logits = soft_cap(logits, softcap).add_(bias)
    seg_max = torch.full((segments, rows), float("-inf"), dtype=torch.float32, device=device)
    seg_max.scatter_reduce_(0, owner.unsqueeze(1).expand(-1, rows), logits.amax(dim=1), "amax")
    seg_max.clamp_min_(torch.finfo(torch.float32).min)  # a segment with no visible row: exp(-inf) = 0 below
    weights = logits.sub_(seg_max.index_select(0, owner).unsqueeze(1)).exp_()  # [np, P, M]
    seg_sum = torch.zeros(segments, rows, dtype=torch.float32, device=device)
    seg_sum.index_add_(0, owner, weights.sum(dim=1))
    # the weights in the values' dtype (as flash kernels take them), their sum over a page in float32
    page_out = float32_bmm(weights.transpose(1, 2).to(value_pages.dtype), value_pages)  # [np, M, d]
    out = torch.zeros(segments, rows, dim, dtype=torch.float32, device=device)
    out.index_add_(0, owner, page_out)
    out.div_(seg_sum.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2))  # 0 where nothing is visible
    return out, seg_max + torch.log(seg_sum)


def _merge_pages(
    out_pages: torch.Tensor, lse_pages: torch.Tensor, owner: torch.Tensor, segments: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-page attention ``out [np, M, d]`` with its log-sum-exp ``lse [np, M]`` (``-inf``:
    nothing visible in the page) into per-segment ``(out [S, M, d], lse [S, M])`` float32."""
    num_pages, rows, dim = out_pages.shape
    device = out_pages.device
    seg_max = torch.full((segments, rows), float("-inf"), dtype=torch.float32, device=device)
    seg_max.scatter_reduce_(0, owner.unsqueeze(1).expand(-1, rows), lse_pages, "amax")
    seg_max.clamp_min_(torch.finfo(torch.float32).min)
    weight = torch.exp(lse_pages - seg_max.index_select(0, owner))  # [np, M]
    seg_sum = torch.zeros(segments, rows, dtype=torch.float32, device=device).index_add_(0, owner, weight)
    out = torch.zeros(segments, rows, dim, dtype=torch.float32, device=device)
    out.index_add_(0, owner, out_pages.float() * weight.unsqueeze(2))
    out.div_(seg_sum.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2))
    return out, seg_max + torch.log(seg_sum)


def decode_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    owner: torch.Tensor,
    row_bias: torch.Tensor,
    scaling: float,
    *,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query of a segment sees the same rows (decoding): ``row_bias [num_pages, P]`` in the
    keys' dtype is 0 for a stored row and ``-inf`` for free capacity, and a segment's rows fill its
    pages in order, though a sliding-window layer's decode steps may hide rows before visible ones.  With one page
    per segment (``owner`` is then ``arange(S)``), page ``s`` is segment ``s`` and nothing is merged.

    On CPU each page runs through PyTorch's fused flash-attention kernel (as one batch of
    pages, returning each page's log-sum-exp) and the pages are merged; elsewhere, or for dtypes
    that kernel does not take, or with ``softcap`` (the kernel cannot soft-cap), the two-``bmm``
    path of :func:`paged_attention`.  Returns ``(out [S, M, d], lse [S, M])`` float32.
    """
    segments, rows, dim = query.shape
    num_pages, page, _ = key_pages.shape
    fused = fused_kernel_serves(query, key_pages, softcap, value_pages)
    if num_pages == 0 or not fused:
        bias = row_bias.float().unsqueeze(2)
        return paged_attention(query, key_pages, value_pages, owner, bias, scaling, softcap=softcap)
    # [np, 1]: pages with a visible row (a page with none reports lse 0); not only the first row's, which a
    # sliding-window layer's hidden rows make -inf before visible ones (RaggedLayer.drop_outside_window)
    live = (row_bias == 0).any(dim=1, keepdim=True)
    if num_pages == segments:  # one page per segment (equal capacities): nothing to merge
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.to(key_pages.dtype).unsqueeze(1),
            key_pages.unsqueeze(1),
            value_pages.unsqueeze(1),
            attn_mask=row_bias.view(num_pages, 1, 1, page),
            scale=float(scaling),
        )  # [S, 1, M, d], [S, 1, M]
        return out[:, 0].float(), torch.where(live, lse[:, 0].float(), float("-inf"))
    page_query = query.to(key_pages.dtype).index_select(0, owner).unsqueeze(1)  # [np, 1, M, d]
    out_pages, lse_pages = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        page_query,
        key_pages.unsqueeze(1),
        value_pages.unsqueeze(1),
        attn_mask=row_bias.view(num_pages, 1, 1, page),
        scale=float(scaling),
    )  # [np, 1, M, d], [np, 1, M]
    lse_pages = torch.where(live, lse_pages[:, 0].float(), float("-inf"))
    return _merge_pages(out_pages[:, 0], lse_pages, owner, segments)


_FLASH_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def causal_chunk_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's queries over the chunk itself, causally, with the log-sum-exp: ``query [B, Hq, q,
    d]``, ``keys / values [B, Hkv, q, d]`` (their dtype is the kernel's), ``real`` bool ``[B, q]``
    (None: all real; a padding key is hidden, a padding query sees itself only).  PyTorch's fused
    CPU flash-attention kernel, one call (only where :func:`fused_kernel_serves`).  Returns ``(out
    [B, Hq, q, d], lse [B, Hq, q])`` float32."""
    batch, query_heads, q_len, _ = query.shape
    group = query_heads // keys.shape[1]
    if group > 1:  # the kernel takes as many KV heads as query heads (an int repeat: no host read)
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    query = query.to(keys.dtype)
    if real is None:
        out, lse = flash(query, keys, values, is_causal=True, scale=float(scaling))
    else:
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
        visible = (causal & real[:, None, None, :]) | torch.eye(q_len, dtype=torch.bool, device=query.device)
        mask = torch.zeros(visible.shape, dtype=keys.dtype, device=query.device).masked_fill_(~visible, float("-inf"))
        out, lse = flash(query, keys, values, attn_mask=mask, scale=float(scaling))
    return out.float(), lse.float()


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over two disjoint sets of rows from each set's ``out [..., d]`` and ``lse [...]``
    (float32; ``lse = -inf``: nothing visible in that set): ``(out, lse)`` over their union, exactly
    (the flash-decoding combination).  Nothing visible in either: ``out = 0``, ``lse = -inf``."""
    top = torch.maximum(lse_a, lse_b).clamp_min_(torch.finfo(torch.float32).min)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    out = out_a * weight_a.unsqueeze(-1) + out_b * weight_b.unsqueeze(-1)
    out.div_(total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1))
    return out, top + torch.log(total)


def fused_kernel_serves(
    query: torch.Tensor, key_buffer: torch.Tensor, softcap: float | None, value_buffer: torch.Tensor
) -> bool:
    """Whether :func:`live_rows_attention` can run: PyTorch's fused CPU flash-attention kernel takes
    the keys' dtype on this device, nothing is soft-capped (the kernel cannot cap) and the values are of the
    keys' head dim (``value_buffer``; the kernel takes one head size: not MiMo-V2-Flash's narrower values)."""
    same_dim = value_buffer.shape[-1] == key_buffer.shape[-1]
    return query.device.type == "cpu" and key_buffer.dtype in _FLASH_CPU_DTYPES and softcap is None and same_dim


def evenly_spaced_heads(length: list[list[int]], head_stride: list[int | None]) -> list[bool]:
    """Per KV head ``h``: whether every batch row's segment of ``h`` holds the same number of live
    rows (``length [B][Hkv]``, more than none) at evenly spaced offsets (``head_stride[h]`` not None,
    :attr:`runtime.kv_store.segments.SegmentStore.head_stride`), so that :func:`live_rows_attention` reads
    head ``h`` of every batch row in one kernel call."""
    first = length[0]
    return [
        stride is not None and first[h] > 0 and all(row[h] == first[h] for row in length)
        for h, stride in enumerate(head_stride)
    ]


def live_row_calls(length: list[list[int]], head_stride: list[int | None]) -> int:
    """The kernel calls :func:`live_rows_attention` makes without ``capacity``: one per evenly spaced
    head (:func:`evenly_spaced_heads`), one per segment of every other head."""
    batch = len(length)
    return sum(1 if even else batch for even in evenly_spaced_heads(length, head_stride))


def live_rows_attention(
    query: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    offset: list[list[int]],
    length: list[list[int]],
    scaling: float,
    *,
    head_stride: list[int | None] | None = None,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoding over each segment's live rows read in place, with no mask and no page merge.

    Segment ``(b, h)``'s live rows are buffer rows ``offset[b][h] .. offset[b][h] + length[b][h] -
    1`` of ``key_buffer / value_buffer [C, d]`` (:mod:`runtime.kv_store.segments`); ``query [S, M, d]``, ``S =
    B * Hkv``, segment ``s = b * Hkv + h``.  With ``capacity`` (every segment holds the same length
    in the same capacity, ``offset = s * capacity``) the buffer is viewed as ``[S, capacity, d]``
    and cut to the live rows: one kernel call.  Otherwise one call per KV head whose segments hold
    the same count at evenly spaced offsets (``head_stride``, :func:`evenly_spaced_heads`: per-head
    budgets that are equal across the batch rows, the common case) over the strided view ``[B, n,
    d]``, and one call per segment over its slice for every other head.  Faster than one batched
    call over masked pages and their merge while the calls are few (docs/results.md
    R-decode-kernels-2026-11-27).  Only where :func:`fused_kernel_serves`.  Returns ``(out [S, M,
    d], lse [S, M])`` float32; a segment with no live row gets ``out = 0``, ``lse = -inf``.
    """
    segments, rows, dim = query.shape
    batch, heads = len(length), len(length[0])
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if capacity is not None and length[0][0] > 0:
        live = length[0][0]
        keys = _head_view(key_buffer, 0, capacity, segments, live)  # [S, 1, n, d], strided: one op
        values = _head_view(value_buffer, 0, capacity, segments, live)
        out, lse = flash(query.to(key_buffer.dtype).unsqueeze(1), keys, values, scale=float(scaling))
        return out[:, 0].float(), lse[:, 0].float()  # [S, M, d], [S, M]
    query = query.to(key_buffer.dtype).view(batch, heads, 1, rows, dim)
    even = evenly_spaced_heads(length, head_stride if head_stride is not None else [None] * heads)
    if all(even):  # one call per head, the heads' results joined once (no per-head copy into an output)
        head_queries = query.unbind(1)  # one op for every head's [B, 1, M, d]
        parts = [
            flash(
                head_queries[h],
                _head_view(key_buffer, offset[0][h], head_stride[h], batch, length[0][h]),
                _head_view(value_buffer, offset[0][h], head_stride[h], batch, length[0][h]),
                scale=float(scaling),
            )  # [B, 1, M, d], [B, 1, M]
            for h in range(heads)
        ]
        out = torch.cat([part[0] for part in parts], dim=1).float()  # [B, Hkv, M, d]
        lse = torch.cat([part[1] for part in parts], dim=1).float()
        return out.view(segments, rows, dim), lse.view(segments, rows)
    out = torch.zeros(batch, heads, rows, dim, dtype=torch.float32, device=query.device)
    lse = torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32, device=query.device)
    for h in range(heads):
        if even[h]:  # head h of every batch row: one strided view [B, 1, n, d]
            keys = _head_view(key_buffer, offset[0][h], head_stride[h], batch, length[0][h])
            values = _head_view(value_buffer, offset[0][h], head_stride[h], batch, length[0][h])
            head_out, head_lse = flash(query[:, h], keys, values, scale=float(scaling))  # [B, 1, M, d], [B, 1, M]
            out[:, h], lse[:, h] = head_out[:, 0], head_lse[:, 0]
            continue
        for b in range(batch):  # one call per segment over its slice
            start, count = offset[b][h], length[b][h]
            if count == 0:  # nothing to attend: out 0, lse -inf
                continue
            keys = key_buffer[start : start + count].view(1, 1, count, dim)
            values = value_buffer[start : start + count].view(1, 1, count, dim)
            segment_out, segment_lse = flash(query[b, h : h + 1], keys, values, scale=float(scaling))
            out[b, h], lse[b, h] = segment_out[0, 0], segment_lse[0, 0]
    return out.view(segments, rows, dim), lse.view(segments, rows)


def _head_view(buffer: torch.Tensor, first: int, stride: int, batch: int, count: int) -> torch.Tensor:
    """``[B, 1, count, d]`` view of ``buffer [C, d]``: rows ``first + b * stride`` onwards for batch row ``b``."""
    row_step, column_step = buffer.stride()
    shape = (batch, 1, count, buffer.shape[1])
    strides = (stride * row_step, count * row_step, row_step, column_step)
    return buffer.as_strided(shape, strides, buffer.storage_offset() + first * row_step)
