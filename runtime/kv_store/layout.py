"""How one layer's packed segments are cut into pages for attention (vLLM's per-step metadata).

The storage (:class:`runtime.kv_store.segments.SegmentStore`) keeps segment ``s = b * Hkv + h`` at buffer
rows ``offset_s .. offset_s + capacity_s - 1``, capacities multiples of the page size ``P``.  A
:class:`PageLayout` is derived from those tables whenever the storage is repacked (nothing in it
changes while tokens are appended or evicted in place: only the storage's ``row_bias`` does) and
tells the attention (:mod:`runtime.kv_store.layer_attention`) how to read the buffer::

    owner        int64 [np]   segment of each page of key_buffer.view(C // P, P, d)
    page_start   int64 [np]   segment row of each page's first row (0, P, 2P, ...)

plus, for decoding, one of two shortcuts:

* ``segment_pages`` (every capacity equal): the buffer is ``[S, cap, d]`` and each segment is one
  page of ``cap`` rows, ``owner = arange(S)``: nothing to merge across pages;
* ``gather`` (a small layer, ``S x widest capacity <= _GATHER_ROWS``): decoding copies every segment
  padded to the widest capacity into one page each (one ``index_select``) rather than attending
  page by page; free rows and rows past a segment's capacity read the bias's trailing ``-inf``.

The page size itself is chosen here (:func:`page_size_for`) when the storage repacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.math.arrays import host_array, to_device

# Decoding a layer whose heads hold at most this many rows in all (padded to the widest) copies
# them into one page per head rather than attending page by page: faster on CPU below ~2,500 rows,
# slower past them (docs/results.md R-page-kernels-2026-11-22).
_GATHER_ROWS = 2048
_MAX_PAGE = 64


def page_size_for(mean_length: float) -> int:
    """The largest power of two <= ``mean_length / 16`` (1 .. 64): rounding capacities up to whole
    pages wastes (P - 1) / 2 rows per head on average, <= ~3% of the memory.  (Small pages make the
    decode kernel slower, docs/results.md R-page-kernels-2026-11-22: the size is a trade.)"""
    page = 1
    while page * 2 <= min(_MAX_PAGE, mean_length / 16):
        page *= 2
    return page


def round_up(values: np.ndarray, page: int) -> np.ndarray:
    """``values`` (int64, host) rounded up to multiples of ``page``."""
    return (values + page - 1) // page * page


def exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    """``[0, v0, v0 + v1, ...]`` without the total: the start of each run of ``values`` rows (host)."""
    return np.cumsum(values, 0) - values


def segment_rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(start, start + count) for each segment])`` without a Python loop (int64,
    host: numpy, so that no torch op reads a device tensor back to size its output)."""
    starts, counts = host_array(starts), host_array(counts)
    total = int(counts.sum())
    segment = np.repeat(np.arange(counts.size), counts)
    within = np.arange(total, dtype=np.int64) - np.repeat(exclusive_cumsum(counts), counts)
    return starts[segment] + within


@dataclass(frozen=True)
class DecodePages:
    """What one decode step attends: ``key_pages / value_pages [np, P, d]``, ``owner`` int64 ``[np]``
    and ``bias [np, P]`` (0 for a stored row, ``-inf`` for free capacity) in the keys' dtype."""

    key_pages: torch.Tensor
    value_pages: torch.Tensor
    owner: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class PageLayout:
    """The page tables of one storage generation (see the module docstring); on the buffers' device."""

    page_size: int
    owner: torch.Tensor  # int64 [np]
    page_start: torch.Tensor  # int64 [np]
    segment_pages: torch.Tensor | None  # int64 [S] = arange(S) while every capacity is equal (and > 0)
    segment_capacity: int  # that common capacity (0 otherwise)
    gather: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None  # key rows, bias rows [S * W], W, arange(S)
    # FlashAttention varlen's tables (:mod:`runtime.kv_store.varlen_attention`): int32 [S + 1] of the
    # segments' first rows closed by the buffer's end, int64 [S] the same without it, the widest
    # capacity (an upper bound of every length until the next repack), and a decode step's query
    # starts, int32 arange(S + 1) (one query row per segment), made here rather than in every step
    varlen_starts: torch.Tensor
    segment_offset: torch.Tensor
    widest: int
    decode_query_starts: torch.Tensor

    @classmethod
    def build(
        cls, offset: torch.Tensor, capacity: torch.Tensor, page_size: int, buffer_rows: int, device
    ) -> PageLayout:
        """From the storage's host tables ``offset / capacity`` int64 ``[B, Hkv]`` (numpy or CPU tensors;
        capacities multiples of ``page_size``) over a buffer of ``buffer_rows`` rows on ``device``: the
        tables are computed on the host and copied to the device once (:func:`to_device`), when the
        storage changes, so a decode step reads them without a host synchronisation."""
        flat_offset = host_array(offset).reshape(-1)  # [S] host (numpy: no torch op)
        flat_capacity = host_array(capacity).reshape(-1)
        segments = flat_capacity.size
        pages = np.maximum(flat_capacity // page_size, 0)  # [S] pages per segment
        owner = np.repeat(np.arange(segments, dtype=np.int64), pages)
        page_start = segment_rows(np.zeros(segments, dtype=np.int64), pages) * page_size
        equal = segments > 0 and int(flat_capacity[0]) > 0 and bool((flat_capacity == flat_capacity[0]).all())
        gather = None
        widest = int(flat_capacity.max()) if segments else 0
        if not equal and segments * widest <= _GATHER_ROWS:
            inside = np.arange(widest) < flat_capacity[:, None]  # [S, W]
            rows = flat_offset[:, None] + np.arange(widest)  # [S, W] buffer rows
            gather = (
                to_device(np.where(inside, rows, 0).reshape(-1), device),
                to_device(np.where(inside, rows, buffer_rows).reshape(-1), device),  # row C: the bias's -inf
                widest,
                torch.arange(segments, device=device),
            )
        return cls(
            page_size=int(page_size),
            owner=to_device(owner, device),
            page_start=to_device(page_start, device),
            segment_pages=torch.arange(segments, device=device) if equal else None,
            segment_capacity=int(flat_capacity[0]) if equal else 0,
            gather=gather,
            varlen_starts=to_device(np.append(flat_offset, buffer_rows).astype(np.int32), device),
            segment_offset=to_device(flat_offset, device),
            widest=widest,
            decode_query_starts=torch.arange(segments + 1, dtype=torch.int32, device=device),
        )

    def decode_pages(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, row_bias: torch.Tensor) -> DecodePages:
        """The pages one decode step reads from ``key_buffer / value_buffer [C, d]`` and the storage's
        ``row_bias [C + 1]``: one page per segment when capacities are equal or the layer is small
        (gathered), else the layer's own pages."""
        dim = key_buffer.shape[-1]
        keys, values, bias = key_buffer, value_buffer, row_bias[:-1]
        owner, page = self.owner, self.page_size
        if self.segment_pages is not None:  # equal capacities: each head's whole segment is one page
            owner, page = self.segment_pages, self.segment_capacity
        elif self.gather is not None:  # a small layer: every head padded to the widest, one page each
            key_rows, bias_rows, page, owner = self.gather
            keys, values = keys.index_select(0, key_rows), values.index_select(0, key_rows)
            bias = row_bias.index_select(0, bias_rows)
        pages = (keys.view(-1, page, dim), values.view(-1, page, values.shape[-1]))  # [np, P, d], [np, P, dv]
        return DecodePages(*pages, owner, bias.view(-1, page))
