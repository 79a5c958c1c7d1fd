"""Sliding windows and logit soft-capping in the packed cache's kernels and storage, against
direct computations (one softmax per head and query, float64), ties of positions at the window's
edge included.  End to end on every architecture: tests/test_architectures.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.kv_store.paged_attention import Window, decode_attention, segment_attention
from runtime.kv_store.segments import SegmentStore

SOFTCAP = 2.0  # small, so that the cap changes the weights visibly


def _naive(query, keys, values, positions, offsets, limit, query_positions, window, softcap, scaling, chunk=None):
    """Per (segment, query row): softmax over the segment's first ``limit`` rows whose position
    ``k`` satisfies ``p - k < window`` (``p`` the query's position) and ``k // chunk == p // chunk``, logits
    capped."""
    segments, rows, dim = query.shape
    out = torch.zeros(segments, rows, dim, dtype=torch.float64)
    lse = torch.full((segments, rows), float("-inf"), dtype=torch.float64)
    for s in range(segments):
        for m in range(rows):
            chosen = [
                offsets[s] + j
                for j in range(int(limit[s, m]))
                if window is None or int(query_positions[s, m]) - int(positions[offsets[s] + j]) < window
                if chunk is None or int(query_positions[s, m]) // chunk == int(positions[offsets[s] + j]) // chunk
            ]
            if not chosen:
                continue
            logits = scaling * (keys[chosen].double() @ query[s, m].double())
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            lse[s, m] = torch.logsumexp(logits, 0)
            out[s, m] = torch.softmax(logits, 0) @ values[chosen].double()
    return out, lse


def _pages(capacities, page):
    owner = torch.cat([torch.full((c // page,), s, dtype=torch.int64) for s, c in enumerate(capacities)])
    start = torch.cat([torch.arange(c // page, dtype=torch.int64) * page for c in capacities])
    return owner, start


@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("window, chunk", [(None, None), (1, None), (3, None), (7, None), (None, 2), (None, 5)])
@pytest.mark.parametrize("page", [1, 4])
def test_segment_attention_with_a_window_and_soft_capping_equals_the_direct_computation(page, window, chunk, softcap):
    """Chunks of 2 and 5 positions (Llama 4's chunked layers: ``k // C == p // C``) cut some queries off from
    every row they could see: ``out = 0``, ``lse = -inf``, as the direct computation."""
    generator = torch.Generator().manual_seed(0)
    capacities = [page * n for n in (3, 2, 4)]
    segments, rows, dim = len(capacities), 5, 8
    total = sum(capacities)
    keys = torch.randn(total, dim, generator=generator) * 3
    values = torch.randn(total, dim, generator=generator)
    # positions increase within a segment with gaps (evicted tokens), as the cache stores them
    positions = torch.cat([torch.randint(1, 3, (c,), generator=generator).cumsum(0) for c in capacities]).int()
    query = torch.randn(segments, rows, dim, generator=generator)
    limit = torch.stack([torch.randint(0, c + 1, (rows,), generator=generator) for c in capacities])
    offsets = np.cumsum([0] + capacities)[:-1]
    # each query sits at or after its last visible row's position (ties: p - k == 0 is inside)
    last = torch.stack([positions[offsets[s] + limit[s].clamp(min=1) - 1] for s in range(segments)]).long()
    query_positions = last + torch.randint(0, 3, (segments, rows), generator=generator)
    owner, start = _pages(capacities, page)
    span = (
        None
        if window is None and chunk is None
        else Window.of(positions.view(-1, page), query_positions, window, chunk)
    )
    out, lse = segment_attention(
        query, keys.view(-1, page, dim), values.view(-1, page, dim), owner, start, limit, 0.37,
        softcap=softcap, window=span,
    )  # fmt: skip
    expected = _naive(query, keys, values, positions, offsets, limit, query_positions, window, softcap, 0.37, chunk)
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash-kernel", "bmm"])
def test_decode_attention_soft_caps_on_both_paths(monkeypatch, fused):
    import runtime.kv_store.paged_attention

    if not fused:
        monkeypatch.setattr(runtime.kv_store.paged_attention, "_FLASH_CPU_DTYPES", ())
    generator = torch.Generator().manual_seed(1)
    page, dim, rows = 4, 8, 3
    capacities, lengths = [8, 12, 4], [5, 12, 0]
    total = sum(capacities)
    keys = torch.randn(total, dim, generator=generator) * 3
    values = torch.randn(total, dim, generator=generator)
    query = torch.randn(len(capacities), rows, dim, generator=generator)
    owner, _ = _pages(capacities, page)
    offsets = np.cumsum([0] + capacities)[:-1]
    bias = torch.full((total,), float("-inf"))
    for offset, length in zip(offsets, lengths, strict=True):
        bias[offset : offset + length] = 0
    out, lse = decode_attention(
        query, keys.view(-1, page, dim), values.view(-1, page, dim), owner, bias.view(-1, page), 0.5, softcap=SOFTCAP
    )
    limit = torch.tensor(lengths).unsqueeze(1).expand(-1, rows)
    positions = torch.zeros(total, dtype=torch.int32)
    expected = _naive(query, keys, values, positions, offsets, limit, None, None, SOFTCAP, 0.5)
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected[1], atol=1e-5, rtol=1e-5)


def test_a_store_drops_exactly_what_the_next_query_cannot_see():
    """Window 4: after the newest position p, the next query (p + 1) sees positions > p + 1 - 4,
    so positions <= p - 3 go, p - 2 (the tie at the edge) stays; each batch row by its own newest
    position, every head alike, evicted gaps respected."""
    store = SegmentStore(2, 2, 3, torch.float32, "cpu")
    keys = torch.arange(2 * 2 * 6 * 3, dtype=torch.float32).view(2, 2, 6, 3)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    real = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    store.append(keys, keys + 0.5, positions, real)
    store.keep(0, 1, torch.tensor([0, 2, 5]))  # head (0, 1) keeps positions 0, 2, 5
    store.drop_outside_window(4)
    kept = [[store.head(b, h)[2].tolist() for h in range(2)] for b in range(2)]
    assert kept == [[[3, 4, 5], [5]], [[3, 4, 5], [3, 4, 5]]]
    torch.testing.assert_close(store.head(0, 0)[0], keys[0, 0, 3:])
    torch.testing.assert_close(store.head(1, 1)[1], keys[1, 1, 3:] + 0.5)
