"""The packed segment storage on its own (runtime.kv_store.segments, runtime.kv_store.layout) against a naive
reference: one list of (key, value, position) rows per (batch row, KV head)."""

from __future__ import annotations

import pytest
import torch

import runtime.kv_store.layout
from runtime.kv_store.layout import PageLayout, page_size_for
from runtime.kv_store.paged_attention import decode_attention
from runtime.kv_store.segments import SegmentStore, StepPositions

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

HEADS, DIM = 3, 4


class Reference:
    """Per-head tensors ``keys / values [n, d]``, ``positions int64 [n]``, indexed ``[b][h]``."""

    def __init__(self, batch: int, dtype: torch.dtype = torch.float32):
        empty = (torch.zeros(0, DIM, dtype=dtype), torch.zeros(0, DIM, dtype=dtype), torch.zeros(0, dtype=torch.int64))
        self.heads = [[empty for _ in range(HEADS)] for _ in range(batch)]

    def append(self, keys, values, positions, real):
        for b, row in enumerate(self.heads):
            take = torch.ones(keys.shape[2], dtype=torch.bool) if real is None else real[b]
            for h, (k, v, p) in enumerate(row):
                row[h] = (
                    torch.cat([k, keys[b, h, take]]),
                    torch.cat([v, values[b, h, take]]),
                    torch.cat([p, positions[b, take].long()]),
                )

    def keep(self, b, h, rows):
        self.heads[b][h] = tuple(t[rows] for t in self.heads[b][h])


def _chunk(generator, batch, q_len, start):
    keys = torch.randn(batch, HEADS, q_len, DIM, generator=generator)
    values = torch.randn(batch, HEADS, q_len, DIM, generator=generator)
    positions = start + torch.arange(q_len).expand(batch, q_len)
    return keys, values, positions


def _check(store: SegmentStore, reference: Reference):
    assert store.batch_size == len(reference.heads)
    page = store.page_size
    assert bool((store.offset % page == 0).all()) and bool((store.capacity % page == 0).all())
    assert bool((store.capacity >= store.length).all())
    live = torch.zeros(store.key_buffer.shape[0] + 1, dtype=torch.bool)
    for b, row in enumerate(reference.heads):
        for h, (keys, values, positions) in enumerate(row):
            got_k, got_v, got_p = store.head(b, h)
            assert torch.equal(got_k, keys) and torch.equal(got_v, values)
            assert torch.equal(got_p.long(), positions)
            start = int(store.offset[b, h])
            live[start : start + keys.shape[0]] = True
    # row_bias: 0 exactly on the live rows, -inf on free capacity and the trailing entry
    assert torch.equal(store.row_bias == 0, live)
    assert bool(torch.isneginf(store.row_bias[~live]).all())
    assert torch.equal(store.ends, (store.offset + store.length).reshape(-1))
    assert store.free <= int((store.capacity - store.length).min())  # a bound: no repack when q <= free


def _filled(lengths_scale: int, seed: int = 0) -> tuple[SegmentStore, Reference, torch.Generator]:
    """Three batch rows of ragged real tokens (left padding), fed in three chunks."""
    generator = torch.Generator().manual_seed(seed)
    batch = 3
    store, reference = SegmentStore(batch, HEADS, DIM, torch.float32, "cpu"), Reference(batch)
    seen = 0
    for q_len in (lengths_scale, lengths_scale // 2 + 1, 1):
        keys, values, positions = _chunk(generator, batch, q_len, seen)
        real = torch.rand(batch, q_len, generator=generator) < 0.7
        real[0] = True  # one row without padding, one with a token-free chunk
        real[2, : q_len // 2 + 1] = False
        store.append(keys, values, positions, real)
        reference.append(keys, values, positions, real)
        _check(store, reference)
        seen += q_len
    keys, values, positions = _chunk(generator, batch, 5, seen)  # no padding at all
    store.append(keys, values, positions, None)
    reference.append(keys, values, positions, None)
    _check(store, reference)
    return store, reference, generator


@pytest.mark.parametrize("scale,paged", [(8, False), (300, True)], ids=["page1", "pages"])
def test_append_and_repack_keep_every_head_in_order(scale, paged):
    store, reference, _ = _filled(scale)
    store.repack(store.length.clone())  # capacities = lengths, page chosen from the mean
    _check(store, reference)
    page = store.page_size
    assert page == page_size_for(float(store.length.float().mean())) and (page > 1) == paged
    assert torch.equal(store.capacity, (store.length + page - 1) // page * page)


def test_uniform_appends_use_the_strided_view_and_stay_correct():
    generator = torch.Generator().manual_seed(1)
    store, reference = SegmentStore(2, HEADS, DIM, torch.bfloat16, "cpu"), Reference(2, torch.bfloat16)
    for step in range(40):  # prefill-sized then decode-sized chunks, growing past capacity
        keys, values, positions = _chunk(generator, 2, 7 if step == 0 else 1, step)
        keys, values = keys.bfloat16(), values.bfloat16()
        store.append(keys, values, positions, None)
        reference.append(keys, values, positions, None)
        assert store.uniform
        _check(store, reference)
    assert store.capacity.min() > 40  # it grew, with slack


def test_decode_steps_sharing_converted_positions_store_the_right_positions():
    """Two stores (two layers) fed one-token steps with one :class:`StepPositions`: the positions are
    converted once a step, and a positions tensor changed in place (a replayed graph's input), or
    a store with another head count, is converted again; every store holds the reference's rows."""
    generator = torch.Generator().manual_seed(4)
    memo = StepPositions()
    # a step's last layer and the next step's first have the same heads: only the version tells
    stores = [SegmentStore(2, heads, DIM, torch.float32, "cpu") for heads in (HEADS, HEADS, 1, HEADS)]
    references = [Reference(2) for _ in stores]
    positions = torch.zeros(2, 1, dtype=torch.int64)
    for step in range(6):
        if step % 2:
            positions.fill_(step * 10)  # the same tensor, changed in place
        else:
            positions = torch.tensor([[step], [step + 100]])  # a new tensor
        made = []
        for store, reference in zip(stores, references, strict=True):
            heads = store.num_heads
            keys = torch.randn(2, heads, 1, DIM, generator=generator)
            values = torch.randn(2, heads, 1, DIM, generator=generator)
            store.append(keys, values, positions, None, step_positions=memo)
            made.append(memo.flat(positions, heads))
            for b in range(2):
                for h in range(heads):
                    k, v, p = reference.heads[b][h]
                    reference.heads[b][h] = (
                        torch.cat([k, keys[b, h]]),
                        torch.cat([v, values[b, h]]),
                        torch.cat([p, positions[b].long()]),
                    )
        assert made[1] is made[0] and made[2] is not made[1]  # converted once for equal heads
        assert (
            made[0].dtype == torch.int32 and made[0].tolist() == [positions[0, 0]] * HEADS + [positions[1, 0]] * HEADS
        )
        for store, reference in zip(stores, references, strict=True):
            for b in range(2):
                for h in range(store.num_heads):
                    assert torch.equal(store.head(b, h)[2].long(), reference.heads[b][h][2])
                    assert torch.equal(store.head(b, h)[0], reference.heads[b][h][0])


@pytest.mark.parametrize("scale", [8, 300], ids=["page1", "pages"])
def test_keep_and_keep_rows_then_compact_match_the_reference(scale):
    store, reference, generator = _filled(scale)
    store.repack(store.length.clone())
    assert (store.page_size > 1) == (scale > 100)
    store.keep(1, 2, torch.tensor([0, 2, 3]), shrink=False)
    reference.keep(1, 2, torch.tensor([0, 2, 3]))
    _check(store, reference)
    assert not store.loose
    rows = [0, 2]
    n = int(store.length[rows].max()) + 3  # wider than the longest head: the excess is ignored
    keep = torch.rand(len(rows), HEADS, n, generator=generator) < 0.5
    store.keep_rows(rows, keep)
    for i, b in enumerate(rows):
        for h in range(HEADS):
            length = reference.heads[b][h][0].shape[0]
            reference.keep(b, h, keep[i, h, :length].nonzero().squeeze(1))
    _check(store, reference)
    assert store.loose
    before = store.capacity.clone()
    store.compact()
    _check(store, reference)
    assert not store.loose
    assert torch.equal(store.capacity, (store.length + store.page_size - 1) // store.page_size * store.page_size)
    assert int(store.capacity.sum()) < int(before.sum())


@pytest.mark.parametrize("scale", [8, 300], ids=["page1", "pages"])
def test_select_batch_and_stack_copy_rows(scale):
    store, reference, generator = _filled(scale)
    other, other_reference, _ = _filled(scale // 2 + 2, seed=5)
    order = [2, 0, 0]
    expected = Reference(0)
    expected.heads = [list(reference.heads[b]) for b in order]
    stacked = SegmentStore.stacked(
        store,
        [(store, 1), (other, 0), (store, 2)],
        torch.cat([store.capacity[1:2], other.capacity[:1], store.capacity[2:]]),
    )
    stacked_reference = Reference(0)
    stacked_reference.heads = [list(reference.heads[1]), list(other_reference.heads[0]), list(reference.heads[2])]
    _check(stacked, stacked_reference)
    # the stacked store owns its buffers: appending to it leaves the sources as they were
    keys, values, positions = _chunk(generator, 3, 2, 1000)
    stacked.append(keys, values, positions, None)
    stacked_reference.append(keys, values, positions, None)
    _check(stacked, stacked_reference)
    _check(store, reference)
    _check(other, other_reference)
    store.select_batch(order)
    _check(store, expected)
    store.select_batch([])
    assert store.batch_size == 0 and store.key_buffer.shape[0] == 0


def test_padded_and_masked_rows():
    store, reference, generator = _filled(40)
    rows = [2, 0]
    keys, values, positions, valid = store.padded_rows(rows)
    for i, b in enumerate(rows):
        for h, (k, v, p) in enumerate(reference.heads[b]):
            n = k.shape[0]
            assert torch.equal(keys[i, h, :n], k) and torch.equal(values[i, h, :n], v)
            assert torch.equal(positions[i, h, :n], p) and bool(valid[i, h, :n].all())
            assert not bool(valid[i, h, n:].any()) and not bool(keys[i, h, n:].any())
    mask = store.live_mask(rows, valid.shape[-1]) & (torch.rand(valid.shape, generator=generator) < 0.5)
    assert torch.equal(store.live_mask(rows, valid.shape[-1]), valid)
    got_k, got_v = store.masked_rows(rows, mask)
    assert torch.equal(got_k, keys * mask.unsqueeze(-1)) and torch.equal(got_v, values * mask.unsqueeze(-1))


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "pages"])
def test_decode_pages_attend_every_head_over_its_live_rows(monkeypatch, gathered):
    monkeypatch.setattr(runtime.kv_store.layout, "_GATHER_ROWS", 1 << 30 if gathered else 0)
    store, reference, generator = _filled(150)
    store.repack(store.length + torch.tensor([[0, 9, 3]]))  # unequal capacities, free rows in some heads
    layout = PageLayout.build(store.offset, store.capacity, store.page_size, store.key_buffer.shape[0], "cpu")
    assert (layout.gather is not None) == gathered and layout.segment_pages is None
    assert int(layout.owner.numel()) * store.page_size == store.key_buffer.shape[0]
    pages = layout.decode_pages(store.key_buffer, store.value_buffer, store.row_bias)
    query = torch.randn(store.batch_size * HEADS, 2, DIM, generator=generator)
    out, lse = decode_attention(query, pages.key_pages, pages.value_pages, pages.owner, pages.bias, 0.5)
    for b, row in enumerate(reference.heads):
        for h, (k, v, _) in enumerate(row):
            logits = 0.5 * query[b * HEADS + h] @ k.T  # [2, n]
            torch.testing.assert_close(out[b * HEADS + h], torch.softmax(logits, -1) @ v, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b * HEADS + h], torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)


def test_one_token_appends_leave_the_bias_behind_until_it_is_read():
    """Only the page kernel reads ``row_bias``, so a one-token step's append does not update it (one
    op and one GPU launch per layer and step, issue 39's count) until it is first read: the read
    rebuilds it exactly from the host tables, in the same tensor, and every append after it keeps it
    current in place (a step captured with the page kernel carries the update)."""
    from test_decode_sync import SyncCounter

    generator = torch.Generator().manual_seed(8)
    store, reference = SegmentStore(2, HEADS, DIM, torch.float32, "cpu"), Reference(2)
    keys, values, positions = _chunk(generator, 2, 9, 0)
    store.append(keys, values, positions, None)
    reference.append(keys, values, positions, None)
    rows = torch.tensor([0, 2, 5, 8])
    store.keep(1, 2, rows)  # unequal heads: the non-uniform append path
    reference.keep(1, 2, rows)
    keys, values, positions = _chunk(generator, 2, 1, 9)
    store.append(keys, values, positions, None)  # the first step repacks, with room for the next ones
    reference.append(keys, values, positions, None)
    tensor, generation = store._row_bias, store.generation
    for step in range(10, 14):
        keys, values, positions = _chunk(generator, 2, 1, step)
        counter = SyncCounter()
        with counter:
            store.append(keys, values, positions, None)
        reference.append(keys, values, positions, None)
        assert counter.names["index_fill_"] == 0, counter.names
    assert store.generation == generation  # no repack in these steps: the stale bias is this tensor
    _check(store, reference)  # reads row_bias: rebuilt, exact
    assert store._row_bias is tensor and store.bias_follows_appends
    for step in range(14, 18):
        keys, values, positions = _chunk(generator, 2, 1, step)
        counter = SyncCounter()
        with counter:
            store.append(keys, values, positions, None)
        reference.append(keys, values, positions, None)
        assert counter.names["index_fill_"] == 1, counter.names
        assert store.bias_follows_appends
        _check(store, reference)


@pytest.mark.parametrize("pages_per_segment", [1, 3])
def test_the_page_kernel_counts_a_page_whose_first_rows_are_hidden(pages_per_segment):
    """A sliding-window layer's decode steps hide the rows that left the window (bias -inf), which are a
    segment's first rows: a page whose first rows are hidden and later ones visible still counts, in its
    output and its log-sum-exp (the CPU path read the first row alone), with one page per segment and with
    several merged."""
    from runtime.kv_store.paged_attention import paged_attention

    generator = torch.Generator().manual_seed(11)
    segments, page, queries = 4, 8, 2
    num_pages = segments * pages_per_segment
    keys = torch.randn(num_pages, page, DIM, generator=generator)
    values = torch.randn(num_pages, page, DIM, generator=generator)
    owner = torch.arange(segments).repeat_interleave(pages_per_segment)
    bias = torch.zeros(num_pages, page)
    for s in range(segments):  # the first 3 + s rows of each segment hidden, the last 2 rows free capacity
        first = s * pages_per_segment
        flat = bias[first : first + pages_per_segment].view(-1)
        flat[: 3 + s] = float("-inf")
        flat[-2:] = float("-inf")
    query = torch.randn(segments, queries, DIM, generator=generator)
    out, lse = decode_attention(query, keys, values, owner, bias, 0.5)
    reference = paged_attention(query, keys, values, owner, bias.unsqueeze(2), 0.5)
    for s in range(segments):
        pages = owner == s
        k, v = keys[pages].reshape(-1, DIM), values[pages].reshape(-1, DIM)
        visible = bias[pages].reshape(-1) == 0
        logits = 0.5 * query[s] @ k[visible].T
        torch.testing.assert_close(out[s], torch.softmax(logits, -1) @ v[visible], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[s], torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, reference[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, reference[1], atol=1e-5, rtol=1e-5)
