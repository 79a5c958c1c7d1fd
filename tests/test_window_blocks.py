"""A sliding-window layer's first chunk in blocks of queries, each over the keys its window can reach.

The chunk-only path (``runtime.kv_store.layer_attention.chunk_only_attention``) of a sliding layer ran the
eager reference over every (query, key) pair of the chunk: ``q^2`` logits for a window of ``W``.  In blocks
of queries each over the ``W - 1`` columns before the block and the block itself it computes ``q (W + b)``
of them.  Columns stand for positions where a row's real tokens carry positions that grow at least as fast
as their columns (left padding, consecutive positions); elsewhere the one whole block stays.  The reference
here is an independent float64 masked softmax over every pair.
"""

from __future__ import annotations

import pytest
import torch

import runtime.kv_store.layer_attention as layer_attention
from runtime.kv_store.layer_attention import chunk_only_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def reference(query, keys, values, real, positions, window, scaling, softcap=None, sinks=None, chunk=None):
    """Every pair in float64: causal by column, real keys only, ``p_q - p_k < window`` (None: any), ``p_q // chunk
    == p_k // chunk`` (None: any); a padding query sees itself (zeroed after); the cap and the sink's logit as the
    eager attention takes them."""
    batch, heads, q_len, _ = query.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    logits = scaling * query.double() @ k.transpose(-1, -2)  # [B, Hq, q, q]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    column = torch.arange(q_len)
    visible = (column[None, :] <= column[:, None]).expand(batch, q_len, q_len)
    visible = visible & real[:, None, :]
    if window is not None:
        visible = visible & (positions[:, :, None] - positions[:, None, :] < window)
    if chunk is not None:
        visible = visible & (positions[:, :, None] // chunk == positions[:, None, :] // chunk)
    visible = visible | torch.eye(q_len, dtype=torch.bool)
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    if sinks is None:
        weights = torch.softmax(logits, -1)
    else:
        column_sink = sinks.double().reshape(1, heads, 1, 1).expand(batch, heads, q_len, 1)
        weights = torch.softmax(torch.cat([logits, column_sink], -1), -1)[..., :-1]
    out = (weights @ v).transpose(1, 2)  # [B, q, Hq, d]
    return out * real[:, :, None, None]


def _inputs(q_len=150, padding=(0, 37), seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch = len(padding)
    query = torch.randn(batch, 4, q_len, 16, generator=generator)
    keys, values = (
        torch.randn(batch, 2, q_len, 16, generator=generator),
        torch.randn(batch, 2, q_len, 16, generator=generator),
    )
    real = torch.ones(batch, q_len, dtype=torch.bool)
    positions = torch.zeros(batch, q_len, dtype=torch.long)
    for row, pad in enumerate(padding):
        real[row, :pad] = False
        positions[row] = torch.arange(q_len) - pad
        positions[row, :pad] = 1  # as transformers' generate() writes a padding column's position
    return query, keys, values, real, positions


def _count_blocks(monkeypatch) -> list:
    """The blocks the chunk-only path attends (one entry each)."""
    blocks = []
    own = layer_attention._block_attention
    monkeypatch.setattr(layer_attention, "_block_attention", lambda *a, **k: blocks.append(1) or own(*a, **k))
    return blocks


@pytest.mark.parametrize("window", [1, 5, 16, 40, 149, 400])
@pytest.mark.parametrize("features", ["plain", "softcap", "sinks"])
def test_blocks_of_queries_equal_every_pair(window, features, monkeypatch):
    """Blocks of at least 8 queries (and the whole chunk): the float64 reference within 1e-5, left padding
    included; windows of 1 to past the chunk."""
    query, keys, values, real, positions = _inputs()
    softcap = 2.0 if features == "softcap" else None
    sinks = torch.linspace(-1.0, 3.0, 4) if features == "sinks" else None
    expected = reference(query, keys, values, real, positions, window, 0.25, softcap, sinks)
    blocks = _count_blocks(monkeypatch)
    for queries_per_block in (8, 10_000):
        monkeypatch.setattr(layer_attention, "WINDOW_BLOCK_QUERIES", queries_per_block)
        blocks.clear()
        got = chunk_only_attention(
            query, keys, values, real, 0.25, positions=positions, window=window, softcap=softcap, sinks=sinks
        )
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
        step = max(queries_per_block, window)  # a block takes the window where that is more
        assert len(blocks) == (-(-150 // step) if 150 > window + step else 1)


def test_positions_slower_than_columns_keep_one_block(monkeypatch):
    """A row whose real tokens are not contiguous (a padding column between two real ones): a key more than
    W columns back may be fewer than W positions back, so the chunk stays one block, and is exact."""
    query, keys, values, real, positions = _inputs(padding=(0, 0))
    real[1, 60:70] = False
    positions[1] = torch.cumsum(real[1].long(), 0) - 1
    positions[1, 60:70] = 1
    expected = reference(query, keys, values, real, positions, 16, 0.25)
    blocks = _count_blocks(monkeypatch)
    monkeypatch.setattr(layer_attention, "WINDOW_BLOCK_QUERIES", 8)
    got = chunk_only_attention(query, keys, values, real, 0.25, positions=positions, window=16)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert len(blocks) == 1


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 149, 400])
@pytest.mark.parametrize("features", ["plain", "softcap"])
def test_attention_chunks_in_blocks_equal_every_pair(chunk, features, monkeypatch):
    """Llama 4's chunked layers (``attention_chunk``: a query sees the keys of its own chunk of positions, counted
    from a row's first real token): blocks over the ``C - 1`` columns before them, the float64 reference within
    1e-5, left padding included."""
    query, keys, values, real, positions = _inputs()
    softcap = 2.0 if features == "softcap" else None
    expected = reference(query, keys, values, real, positions, None, 0.25, softcap, chunk=chunk)
    blocks = _count_blocks(monkeypatch)
    for queries_per_block in (8, 10_000):
        monkeypatch.setattr(layer_attention, "WINDOW_BLOCK_QUERIES", queries_per_block)
        blocks.clear()
        got = chunk_only_attention(
            query, keys, values, real, 0.25, positions=positions, softcap=softcap, attention_chunk=chunk
        )
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
        step = max(queries_per_block, chunk)
        assert len(blocks) == (-(-150 // step) if 150 > chunk + step else 1)


def test_a_masked_first_chunk_keeps_sdpa_on_a_fused_kernel(monkeypatch):
    """sdpa with a mask and ``enable_gqa`` (KV heads broadcast to their query heads) falls back to its math kernel
    on CUDA, which materialises every logit in float32 (a left-padded first chunk of 32K tokens, 8 rows and 32
    heads: 1 TB; Llama 4's chunk blocks of 8192 over 40 heads: gigabytes each): a masked first chunk, with a window,
    attention chunks or padding alone, hands sdpa as many KV heads as query heads, and no ``enable_gqa``."""
    calls = []
    own = torch.nn.functional.scaled_dot_product_attention

    def recorded(query, key, value, attn_mask=None, **options):
        calls.append((query.shape[1], key.shape[1], value.shape[1], attn_mask is not None, options.get("enable_gqa")))
        return own(query, key, value, attn_mask=attn_mask, **options)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    query, keys, values, real, positions = _inputs()
    chunk_only_attention(query, keys, values, real, 0.25, positions=positions, window=16)
    chunk_only_attention(query, keys, values, real, 0.25, positions=positions, attention_chunk=16)
    chunk_only_attention(query, keys, values, real, 0.25)  # a left-padded first chunk, no window: its padding mask
    assert len(calls) == 3 and all(masked and q == k == v and not gqa for q, k, v, masked, gqa in calls), calls


@pytest.mark.parametrize("tail", [1, 5, 150])
@pytest.mark.parametrize(
    "features", [dict(), dict(window=16), dict(softcap=2.0, window=40), dict(attention_chunk=64), dict(sinks=True)]
)
@pytest.mark.parametrize("padding", [(0, 37), (0, 0)])
def test_the_chunks_last_columns_alone_equal_every_pair(tail, features, padding):
    """``chunk_only_attention`` of the queries of the chunk's last ``tail`` columns alone (a layer reading another's
    cache, which Gemma 4 runs only where generate() keeps logits) over the whole chunk, without a window, with
    one (columns bounding positions: the keys trimmed), soft-capping, attention chunks and learned sinks: the
    float64 reference's last rows within 1e-5."""
    query, keys, values, real, positions = _inputs(padding=padding)
    options = dict(features)
    sinks = torch.linspace(-1.0, 3.0, 4) if options.pop("sinks", False) else None
    expected = reference(
        query,
        keys,
        values,
        real,
        positions,
        options.get("window"),
        0.25,
        options.get("softcap"),
        sinks,
        chunk=options.get("attention_chunk"),
    )
    got = chunk_only_attention(
        query[:, :, -tail:], keys, values, real, 0.25, positions=positions, sinks=sinks, **options
    )
    assert got.shape == (2, tail, 4, 16)
    torch.testing.assert_close(got.double(), expected[:, -tail:], atol=1e-5, rtol=1e-5)
