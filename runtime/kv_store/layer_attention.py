"""One layer's attention over its packed segments: every batch row and query head in one computation.

The cache layer (:class:`runtime.kv_store.cache.RaggedLayer`) calls these after storing the new chunk; the
kernels themselves are in :mod:`runtime.kv_store.paged_attention`.  Shapes: ``B`` batch rows, ``Hq`` query
heads, ``Hkv`` KV heads, ``G = Hq / Hkv``, ``q`` chunk tokens, ``d`` head dim, segments
``S = B * Hkv``; a segment's query rows are its ``G`` heads times the chunk's tokens (``M = G q``).

* :func:`chunk_only_attention`: nothing was retained before the chunk (a first prefill): causal
  SDPA of the chunk over itself;
* :func:`segment_layer_attention`: every query over its head's retained rows, the chunk's own
  rows causally (a chunk: :func:`~runtime.kv_store.paged_attention.segment_attention` over the layer's
  pages; a decode step: :func:`~runtime.kv_store.paged_attention.decode_attention` over the
  :class:`~runtime.kv_store.layout.PageLayout`'s decode pages), then, with a correction set, the MomentKV
  merge with the evicted set's estimate (:func:`corrected_merge`, docs/design.md section 4).

Both take the layer's learned attention ``sinks`` (gpt-oss's ``s_aux [Hq]``: one more logit in every query's
softmax, whose value is dropped: :mod:`runtime.math.sinks`).  Attention over rows with log-sum-exp ``lse``
and a sink ``s`` is the sink-less output times ``sigmoid(lse - s)`` (:func:`with_sinks`), so every kernel
that gives ``lse`` serves it; the chunk-only prefill then runs the reference eager attention with the
sink's logit.

Both take the layer's ``window`` (a sliding-window layer's W: a query at RoPE position ``p`` sees a
token at ``k`` only when ``p - k < W``, transformers' ``sliding_window_overlay``) and ``softcap``
(Gemma 2's ``c tanh(logits / c)``), as transformers passes them to the attention function, and its
``attention_chunk`` (Llama 4's chunked layers: ``k // C == p // C``, transformers' ``chunked_overlay``).  A
decode step needs no window mask: the cache layer drops, after every step, the tokens the next
query cannot see (:meth:`runtime.kv_store.cache.RaggedLayer.attend`), so every stored row is visible.  The
MomentKV estimate of the evicted set (:func:`corrected_merge`) uses uncapped logits: it estimates
``sum exp(s q.k)``, and with Gemma 2's cap (50) the capped logit differs from ``s q.k`` by under
1% while ``|s q.k| < 5``; sliding-window layers keep no moment sums (a token leaving the window
would have to leave the sums), so they are never corrected.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.kv_store.eager_attention import eager_attention_forward
from runtime.kv_store.flex_decode import flex_decode_attention, flex_serves, selected_decode_kernel
from runtime.kv_store.layout import PageLayout
from runtime.kv_store.paged_attention import (
    LIVE_ROW_CALLS,
    Window,
    causal_chunk_attention,
    decode_attention,
    first_visible,
    fused_kernel_serves,
    live_row_calls,
    live_rows_attention,
    merge_attention,
    segment_attention,
)
from runtime.kv_store.profiling import label
from runtime.kv_store.segments import SegmentStore
from runtime.kv_store.varlen_attention import varlen_chunk_attention, varlen_decode_attention, varlen_serves
from runtime.math.momentkv import PreparedMoments
from runtime.math.sinks import sink_weight


def chunk_only_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    real: torch.Tensor | None,
    scaling: float,
    *,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of the chunk over itself, padding keys hidden: ``query [B, Hq, q, d]``,
    ``keys / values [B, Hkv, q, d]``, ``real`` bool ``[B, q]`` (None: all real); ``positions`` int
    ``[B, q]`` (needed with a ``window`` or an ``attention_chunk``); learned ``sinks [Hq]`` (None: none).
    Returns ``[B, q, Hq, d]``; rows of padding queries are zero.

    ``query`` may hold the chunk's last ``t < q`` columns alone (``[B, Hq, t, d]``; ``real`` and ``positions`` still
    the chunk's): then ``[B, t, Hq, d]``, those columns' rows, at ``t q`` logits (a layer reading another's cache,
    which Gemma 4 runs only where generate() keeps logits)."""
    q_len = query.shape[2]
    if q_len < keys.shape[2]:
        return _chunk_tail_attention(
            query, keys, values, real, scaling, positions, window, softcap, sinks, attention_chunk
        )
    if window is not None or softcap is not None or sinks is not None or attention_chunk is not None:
        return _masked_chunk_attention(
            query, keys, values, real, scaling, positions, window, softcap, sinks, attention_chunk
        )
    if real is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2)
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
    eye = torch.eye(q_len, dtype=torch.bool, device=query.device)
    mask = (causal & real[:, None, None, :]) | eye  # padding queries see themselves (zeroed below)
    out = masked_sdpa(query, keys, values, mask, scaling).transpose(1, 2)  # [B, q, Hq, d]
    return out * real[:, :, None, None].to(out.dtype)


def at_the_chunks_columns(attend, query: torch.Tensor, columns: int) -> torch.Tensor:
    """``attend(query)`` (``[B, t, Hq, d]``) for a ``query [B, Hq, t, d]`` at a chunk's ``columns`` columns or at
    its last ``t``: zero queries then fill the columns before, their rows dropped, for an attention that takes the
    whole chunk's queries (a layer reading another's cache, run only where its model keeps logits)."""
    tail = query.shape[2]
    if tail == columns:  # no op dispatched for a whole chunk
        return attend(query)
    batch, heads, _, dim = query.shape
    return attend(torch.cat([query.new_zeros(batch, heads, columns - tail, dim), query], dim=2))[:, columns - tail :]


def _chunk_tail_attention(query, keys, values, real, scaling, positions, window, softcap, sinks, attention_chunk):
    """:func:`chunk_only_attention` of the chunk's last ``t`` columns alone (``query [B, Hq, t, d]``, ``t`` fewer
    than the chunk's ``q``): one block of queries over the keys their window or chunk reaches (the whole chunk
    without one), ``t q`` logits.  ``[B, t, Hq, d]``."""
    tail, total = query.shape[2], keys.shape[2]
    start = total - tail
    reach = min(span for span in (window, attention_chunk, total) if span is not None)
    if reach < total and positions is None:
        raise ValueError("a sliding window or attention chunks need the chunk's positions")
    first_seen = None if reach == total else first_visible(positions, window, attention_chunk)  # [B, q]
    first = max(0, start - reach + 1) if reach < total and _columns_bound_positions(real, positions) else 0
    visible = _visible(real, positions, first_seen, start, total, first, query.device)  # [B, t, keys]
    out = _block_attention(query, keys[:, :, first:], values[:, :, first:], visible, scaling, softcap, sinks)
    if real is not None:
        out = out * real[:, start:, None, None].to(out.dtype)
    return out


def masked_sdpa(query, keys, values, mask, scaling: float) -> torch.Tensor:
    """sdpa of ``query [B, Hq, q, d]`` over ``keys / values [B, Hkv, k, d]`` where ``mask`` (bool, broadcast to
    ``[B, Hq, q, k]``), each KV head repeated for its query heads: with a mask, sdpa's ``enable_gqa`` falls back
    to its math kernel on CUDA, which materialises every logit in float32 (a left-padded 32K-token prefill of 8 rows
    and 32 heads: 1 TB); repeated heads keep its memory-efficient kernel, as transformers' own sdpa attention does
    with a mask (``use_gqa_in_sdpa``).  Returns ``[B, Hq, q, d]``."""
    group = query.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)


# The fewest queries per block of a sliding layer's first chunk (:func:`_masked_chunk_attention`; a block
# takes the window's ``W`` where that is more): each block's logits cover its own columns and the ``W - 1``
# before them, at most ``2 q max(W, 256)`` logits over the chunk (gpt-oss-20b's window of 128 at 4096 tokens:
# 0.18x the time of every pair, docs/results.md R-window-prefill-2026-11-29).
WINDOW_BLOCK_QUERIES = 256


def _masked_chunk_attention(
    query, keys, values, real, scaling, positions, window, softcap, sinks, attention_chunk=None
) -> torch.Tensor:
    """:func:`chunk_only_attention` with a sliding window, attention chunks, soft-capping and / or learned
    sinks: the causal, padding and window mask through the reference eager attention (float32 scores, as
    transformers' eager attention), or sdpa with that mask where there is neither soft-capping nor a sink.
    With a window ``W`` (attention chunks of ``C``: a query sees at most ``C`` positions back), in blocks of
    ``b`` queries (``W``, at least :data:`WINDOW_BLOCK_QUERIES`), each over the ``W - 1`` columns before the
    block and the block itself, where columns bound positions (:func:`_columns_bound_positions`):
    ``q (W + b)`` logits, not ``q^2``."""
    q_len = query.shape[2]
    reach = min(span for span in (window, attention_chunk, q_len) if span is not None)
    if reach < q_len and positions is None:
        raise ValueError("a sliding window or attention chunks need the chunk's positions")
    step = max(WINDOW_BLOCK_QUERIES, reach)
    blocked = q_len > reach + step and _columns_bound_positions(real, positions)
    starts = range(0, q_len, step) if blocked else (0,)
    first_seen = None if reach == q_len else first_visible(positions, window, attention_chunk)  # [B, q]
    outs = []
    for start in starts:
        stop = min(start + step, q_len) if blocked else q_len
        first = max(0, start - reach + 1) if blocked else 0  # the first column the block's window reaches
        visible = _visible(real, positions, first_seen, start, stop, first, query.device)  # [B, rows, keys]
        keys_seen, values_seen = keys[:, :, first:stop], values[:, :, first:stop]
        outs.append(_block_attention(query[:, :, start:stop], keys_seen, values_seen, visible, scaling, softcap, sinks))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if real is not None:
        out = out * real[:, :, None, None].to(out.dtype)
    return out  # [B, q, Hq, d]


def _block_attention(query, keys, values, visible, scaling, softcap, sinks) -> torch.Tensor:
    """One block of :func:`_masked_chunk_attention`: ``query [B, Hq, b, d]`` over ``keys / values [B, Hkv, k, d]``
    where ``visible`` (bool ``[B, b, k]``); ``[B, b, Hq, d]``.  sdpa with the mask (:func:`masked_sdpa`), but for
    soft-capping or learned sinks: the reference eager attention (float32 scores)."""
    if softcap is None and sinks is None:
        return masked_sdpa(query, keys, values, visible[:, None], scaling).transpose(1, 2)
    out, _ = eager_attention_forward(
        None, query, keys, values, visible[:, None], scaling=scaling, softcap=softcap, s_aux=sinks
    )
    return out


def _visible(real, positions, first_seen, start: int, stop: int, first: int, device) -> torch.Tensor:
    """Which keys of columns ``first .. stop - 1`` the queries of columns ``start .. stop - 1`` see: bool
    ``[B or 1, rows, keys]``: causal by column, real keys, ``p_k >= first_seen_q`` (the lowest position each
    query sees, :func:`~runtime.kv_store.paged_attention.first_visible`; None: every earlier one); a padding
    query itself."""
    query_column = torch.arange(start, stop, device=device)[:, None]
    key_column = torch.arange(first, stop, device=device)[None, :]
    visible = (key_column <= query_column)[None]  # [1, rows, keys]
    if real is not None:
        visible = visible & real[:, None, first:stop]
    if first_seen is not None:
        visible = visible & (positions[:, None, first:stop].long() >= first_seen[:, start:stop, None])
    return visible | (key_column == query_column)[None]  # padding queries see themselves


def _columns_bound_positions(real: torch.Tensor | None, positions: torch.Tensor) -> bool:
    """Whether in every row a real key more columns back than a real query is at least as many positions
    back (``p - c`` never falls along a row's real tokens: left padding, consecutive positions), so the keys
    ``W`` or more columns back are outside a window of ``W``.  One read of the device (a prefill's)."""
    offset = positions.long() - torch.arange(positions.shape[1], device=positions.device)  # [B, q]
    if real is not None:
        offset = offset.masked_fill(~real, torch.iinfo(torch.long).min)
    holds = offset >= offset.cummax(dim=1).values
    if real is not None:
        holds = holds | ~real
    return bool(holds.all())


def segment_layer_attention(
    query: torch.Tensor,
    store: SegmentStore,
    layout: PageLayout,
    real: torch.Tensor | None,
    scaling: float,
    prepared: PreparedMoments | None,
    *,
    positions: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Every query of ``query [B, Hq, q, d]`` (post-RoPE) over its KV head's rows in ``store`` (the
    chunk already appended: its token ``t`` sees everything before the chunk and the chunk's real
    tokens up to ``t``, inside the ``window`` or the ``attention_chunk`` from its position ``positions [B, q]``
    when there is one), merged with the evicted set's estimate when ``prepared``, then with the learned ``sinks
    [Hq]`` when given (:func:`with_sinks`).  ``real`` bool ``[B, q]`` (None: all real).  Returns
    ``[B, q, Hq, d]`` in the query's dtype; rows of padding queries are zero.

    ``chunk``: the chunk's own ``keys / values [B, Hkv, q, d]`` and the rows each head held before
    it (``[B, Hkv]`` int, host).  With it, where the fused CPU kernel serves and there is no window
    nor soft-capping, a chunk is attended in two parts merged by their log-sum-exp
    (:func:`_chunk_split_attention`): cost linear in the chunk's length over the rows before it,
    and a causal flash kernel over the chunk itself, instead of logits materialised over every row
    for every query (a question of 1,086 tokens: docs/results.md R-long-question-2026-11-27).  On a
    GPU, a chunk without padding, window or soft-capping is one FlashAttention varlen call over the
    buffer in place (:mod:`runtime.kv_store.varlen_attention`)."""
    batch, num_q_heads, q_len, dim = query.shape
    heads = store.num_heads
    group = num_q_heads // heads
    segments = batch * heads
    grouped = query.reshape(segments, group * q_len, dim)  # [S, G*q, d]
    if q_len == 1 and real is None:  # decoding: every query of a head sees all its stored rows
        with label("kvcal.attention"):
            need_lse = prepared is not None or sinks is not None
            out, lse = _decode_step_attention(
                grouped, store, layout, scaling, softcap, need_lse=need_lse, window=window
            )
    elif (
        q_len > 1
        and real is None
        and window is None
        and attention_chunk is None
        and varlen_serves(query, store, softcap)
    ):
        with label("kvcal.attention"):  # a GPU: one FlashAttention varlen call over the buffer in place
            out, lse = varlen_chunk_attention(
                query, store.key_buffer, store.value_buffer, store.host_offset, store.host_length, scaling
            )
    elif (
        chunk is not None
        and window is None
        and attention_chunk is None
        and fused_kernel_serves(query, store.key_buffer, softcap, store.value_buffer)
    ):
        with label("kvcal.attention"):
            out, lse = _chunk_split_attention(query, grouped, chunk, real, store, scaling)
    else:  # a chunk: rows visible to its token t = everything before the chunk + t's rank + 1
        device = query.device
        length = store.length.to(device)  # [B, Hkv], the chunk already appended
        if real is None:
            visible = length.unsqueeze(2) - q_len + 1 + torch.arange(q_len, device=device)  # [B, Hkv, q]
        else:
            counts = real.long().sum(1, keepdim=True)  # [B, 1]
            rank = real.long().cumsum(1) - 1  # [B, q]
            visible = length.unsqueeze(2) - counts.unsqueeze(1) + 1 + rank.unsqueeze(1)
            visible = torch.where(real.unsqueeze(1), visible, torch.zeros_like(visible))
        limit = visible.unsqueeze(2).expand(batch, heads, group, q_len).reshape(segments, group * q_len)  # [S, G*q]
        page = layout.page_size
        key_pages = store.key_buffer.view(-1, page, dim)
        value_pages = store.value_buffer.view(-1, page, store.value_dim)
        owner, page_start = layout.owner, layout.page_start
        span = None
        if window is not None or attention_chunk is not None:
            if positions is None:
                raise ValueError("a sliding window or attention chunks need the chunk's positions")
            query_positions = positions.to(device).long()[:, None, None, :].expand(batch, heads, group, q_len)
            span = Window.of(
                store.position_buffer.view(-1, page),
                query_positions.reshape(segments, group * q_len),
                window,
                attention_chunk,
            )
        with label("kvcal.attention"):
            out, lse = segment_attention(
                grouped, key_pages, value_pages, owner, page_start, limit, scaling, softcap=softcap, window=span
            )
    if prepared is not None:
        with label("kvcal.correction"):
            # a decode step has just appended a row to every segment: no retained set is empty
            nonempty = q_len == 1 and real is None
            if sinks is None:
                out = corrected_merge(grouped, out, lse, prepared, scaling, retained_nonempty=nonempty)
            else:  # the sinks need the log-sum-exp of both sets
                out, lse = corrected_merge(
                    grouped, out, lse, prepared, scaling, retained_nonempty=nonempty, with_lse=True
                )
    if sinks is not None:
        out = with_sinks(out, lse, sinks, batch, q_len)
    value_dim = store.value_dim  # the output's head dim: the values' (d but for MiMo-V2-Flash)
    if q_len == 1:  # [S, G, d] is already [B, 1, Hq, d]'s order
        output = out.view(batch, 1, num_q_heads, value_dim).to(query.dtype)
    else:
        output = out.view(batch, heads, group, q_len, value_dim).permute(0, 3, 1, 2, 4)
        output = output.reshape(batch, q_len, num_q_heads, value_dim).to(query.dtype)
    if real is not None:
        output = output * real[:, :, None, None].to(output.dtype)
    return output


def lse_kernel_serves(
    query: torch.Tensor,
    store: SegmentStore,
    real: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
    attention_chunk: int | None = None,
) -> bool:
    """Whether :func:`segment_layer_attention` attends a chunk by a fused kernel that gives each query's
    log-sum-exp: a GPU's FlashAttention varlen call (no padding), the CPU's flash kernel in two parts; no
    window nor soft-capping.  There a first chunk with learned sinks goes, rather than to
    :func:`chunk_only_attention`'s eager reference (a 4096-token prefill of gpt-oss-20b's attention on the CPU
    in 0.23x the time: docs/results.md R-sink-prefill-2026-11-29)."""
    if window is not None or softcap is not None or attention_chunk is not None:
        return False
    return (real is None and varlen_serves(query, store, softcap)) or fused_kernel_serves(
        query, store.key_buffer, softcap, store.value_buffer
    )


def _chunk_split_attention(
    query: torch.Tensor,
    grouped: torch.Tensor,
    chunk: tuple[torch.Tensor, torch.Tensor, np.ndarray],
    real: torch.Tensor | None,
    store: SegmentStore,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's attention as two parts merged exactly (:func:`~runtime.kv_store.paged_attention.merge_attention`):
    every query over the rows its head held before the chunk (all visible: the live rows read in
    place, :func:`~runtime.kv_store.paged_attention.live_rows_attention`) and over the chunk itself, causally
    (:func:`~runtime.kv_store.paged_attention.causal_chunk_attention`).  ``query [B, Hq, q, d]``, ``grouped``
    the same as ``[S, G*q, d]``; returns ``(out [S, G*q, d], lse [S, G*q])`` float32."""
    keys, values, before = chunk
    segments, rows, _ = grouped.shape
    dim = store.value_dim
    dtype = store.key_buffer.dtype
    prefix = live_rows_attention(
        grouped,
        store.key_buffer,
        store.value_buffer,
        store.host_offset.tolist(),
        before.tolist(),
        scaling,
        head_stride=store.head_stride,
    )
    own_out, own_lse = causal_chunk_attention(query, keys.to(dtype), values.to(dtype), real, scaling)
    return merge_attention(*prefix, own_out.reshape(segments, rows, dim), own_lse.reshape(segments, rows))


def decode_kernel(store: SegmentStore, softcap: float | None, need_lse: bool, window: int | None = None) -> str:
    """Which kernel a decode step over ``store`` runs (its queries on the store's device):

    * ``"flex"``: with ``KVCAL_DECODE_KERNEL=flex``, where :func:`~runtime.kv_store.flex_decode.flex_serves`:
      one compiled ``flex_attention`` call over the whole buffer (opt-in, for GPUs: docs/results.md
      R-flex-decode-2026-11-27);
    * ``"live_rows"``: where the fused CPU kernel serves, the live rows read in place without a mask
      when every segment holds the same number (one call), or when that takes few calls: one per KV
      head whose budget is the same in every batch row, one per segment of the other heads
      (:func:`~runtime.kv_store.paged_attention.live_rows_attention`).  Its calls are sized by the host's
      lengths, so no two steps run the same calls;
    * ``"varlen"``: on a GPU where FlashAttention's varlen kernel serves
      (:func:`~runtime.kv_store.varlen_attention.varlen_serves`): one call over the buffer in place,
      its tables on the device (:func:`~runtime.kv_store.varlen_attention.varlen_decode_attention`),
      so a step replays in a captured graph;
    * ``"pages"``: otherwise, or with ``KVCAL_DECODE_KERNEL=pages``: the layout's pages
      (:meth:`~runtime.kv_store.layout.PageLayout.decode_pages`), one batched call and a merge.  Its calls
      read the lengths from the device (``row_bias``), so every step of one storage generation runs
      the same calls on the same buffers: a step that can be captured once and replayed
      (:mod:`runtime.serve.decode_graph`).

    A sliding-window layer (``window``) off the CPU takes the page kernel unless another is asked for: its
    step then hides what leaves the window instead of dropping it, which reads the device once per layer
    and step (:meth:`runtime.kv_store.cache.RaggedLayer.drop_outside_window`), and replays from a graph.

    Which is faster where: docs/results.md R-decode-kernels-2026-11-27."""
    chosen, keys = selected_decode_kernel(), store.key_buffer
    if window is not None and chosen not in ("flex", "pages") and keys.device.type != "cpu":
        return "pages"
    if chosen == "flex" and flex_serves(keys, keys, store.head_dim, need_lse):
        return "flex"
    if chosen != "pages" and varlen_serves(keys, store, softcap):
        return "varlen"
    if chosen != "pages" and fused_kernel_serves(keys, keys, softcap, store.value_buffer):
        length = store.host_length.tolist()
        if (store.uniform and length[0][0] > 0) or live_row_calls(length, store.head_stride) <= LIVE_ROW_CALLS:
            return "live_rows"
    return "pages"


def _decode_step_attention(
    query: torch.Tensor,
    store: SegmentStore,
    layout: PageLayout,
    scaling: float,
    softcap: float | None,
    *,
    need_lse: bool = True,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decode step, ``query [S, G, d]`` over every segment's live rows: ``(out [S, G, d], lse [S, G])``
    float32 by the kernel :func:`decode_kernel` chooses (for a sliding-window layer: ``window``); unless
    ``need_lse``, ``lse`` may be None and ``out`` in the buffer's dtype."""
    kernel = decode_kernel(store, softcap, need_lse, window=window)
    if kernel == "flex":
        return flex_decode_attention(query, store, scaling, softcap=softcap, need_lse=need_lse)
    if kernel == "varlen":  # a GPU: one FlashAttention varlen call, every table on the device
        return varlen_decode_attention(query, store, layout, scaling, need_lse=need_lse)
    if kernel == "live_rows":  # the CPU: sizes from the host mirror
        length = store.host_length.tolist()
        if store.uniform and length[0][0] > 0:
            capacity = int(store.host_capacity[0, 0])
            return live_rows_attention(
                query, store.key_buffer, store.value_buffer, [], length, scaling, capacity=capacity
            )
        offset = store.host_offset.tolist()
        return live_rows_attention(
            query, store.key_buffer, store.value_buffer, offset, length, scaling, head_stride=store.head_stride
        )
    pages = layout.decode_pages(store.key_buffer, store.value_buffer, store.row_bias)
    return decode_attention(
        query, pages.key_pages, pages.value_pages, pages.owner, pages.bias, scaling, softcap=softcap
    )


def corrected_merge(
    query: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    prepared: PreparedMoments,
    scaling: float,
    *,
    retained_nonempty: bool = False,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MomentKV's merge of the retained attention ``out [S, G*q, d]``, ``lse [S, G*q]`` (float32) with
    the evicted set's estimate for ``query [S, G*q, d]``: ``o = w o_R + (1 - w) o_E``,
    ``w = sigmoid(lse_R - lse_E)``.  Returns ``[S, G*q, d]`` float32, and with ``with_lse`` also the
    log-sum-exp of both sets, ``log(Z_R + Z_E)`` (what learned sinks need).  ``retained_nonempty``: the
    caller knows every query sees at least one retained row (``lse`` finite), so no weight is NaN."""
    out_E, lse_E = prepared.estimates(query, scaling)  # [S, G*q, d], [S, G*q]
    # w = Z_R / (Z_R + Z_E): exactly 1 where nothing was evicted (lse_E = -inf), and where
    # neither set holds anything (-inf - -inf = NaN) the retained output (0) stands
    weight = torch.sigmoid(lse - lse_E)
    if not retained_nonempty:
        weight = weight.nan_to_num_(nan=1.0)
    merged = torch.lerp(out_E, out, weight.unsqueeze(-1))
    return (merged, torch.logaddexp(lse, lse_E)) if with_lse else merged


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, batch: int, q_len: int) -> torch.Tensor:
    """The attention ``out [S, G*q, d]`` over rows of log-sum-exp ``lse [S, G*q]`` (float32) with each query
    head's learned sink ``sinks [Hq]`` in its softmax: ``out`` times :func:`runtime.math.sinks.sink_weight`
    (a query that sees no row keeps its 0).  ``S = batch * Hkv``; a segment's rows are its ``G`` heads times
    ``q_len`` tokens.  Returns float32 ``[S, G*q, d]``."""
    segments, rows = lse.shape
    heads = segments // batch
    sink = sinks.view(heads, rows // q_len, 1).expand(heads, rows // q_len, q_len).reshape(1, heads, rows)
    weight = sink_weight(lse.view(batch, heads, rows), sink)  # [B, Hkv, G*q]
    return out.float() * weight.view(segments, rows, 1)
