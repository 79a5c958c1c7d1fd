"""The packed per-layer cache: its attention against direct computations, buffers it owns, and the
attention implementation it leaves behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from test_runtime_cache import inf_calibration

from runtime import CompressionPolicy, RaggedCache, compress_prompt, generate, ragged_attention
from runtime.compression.prefill import prefill
from runtime.kv_store.paged_attention import decode_attention, segment_attention
from runtime.kv_store.transformers_compat import cache_argument

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _pages(capacities: list[int], page: int) -> tuple[torch.Tensor, torch.Tensor]:
    owner = torch.cat([torch.full((c // page,), s, dtype=torch.int64) for s, c in enumerate(capacities)])
    start = torch.cat([torch.arange(c // page, dtype=torch.int64) * page for c in capacities])
    return owner, start


def _naive(query, keys, values, offsets, limit, scaling):
    """One softmax per (segment, query row) over the segment's first ``limit`` rows, in float64."""
    segments, rows, dim = query.shape
    out = torch.zeros(segments, rows, dim, dtype=torch.float64)
    lse = torch.full((segments, rows), float("-inf"), dtype=torch.float64)
    for s in range(segments):
        for m in range(rows):
            n = int(limit[s, m])
            if n == 0:
                continue
            k = keys[offsets[s] : offsets[s] + n].double()
            v = values[offsets[s] : offsets[s] + n].double()
            logits = scaling * (k @ query[s, m].double())
            lse[s, m] = torch.logsumexp(logits, 0)
            out[s, m] = torch.softmax(logits, 0) @ v
    return out, lse


@pytest.mark.parametrize("page", [1, 4, 16])
def test_segment_attention_equals_one_softmax_per_head_and_query(page):
    generator = torch.Generator().manual_seed(0)
    capacities = [page * n for n in (3, 1, 5, 2)]
    segments, rows, dim = len(capacities), 6, 8
    total = sum(capacities)
    keys, values = torch.randn(total, dim, generator=generator), torch.randn(total, dim, generator=generator)
    query = torch.randn(segments, rows, dim, generator=generator)
    limit = torch.stack([torch.randint(0, c + 1, (rows,), generator=generator) for c in capacities])
    limit[1, :] = 0  # a head that sees nothing: out 0, lse -inf
    owner, start = _pages(capacities, page)
    offsets = np.cumsum([0] + capacities)[:-1]
    out, lse = segment_attention(query, keys.view(-1, page, dim), values.view(-1, page, dim), owner, start, limit, 0.37)
    expected_out, expected_lse = _naive(query, keys, values, offsets, limit, 0.37)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash-kernel", "bmm"])
def test_decode_attention_equals_direct_computation(monkeypatch, dtype, tolerance, fused):
    """Decoding: each head's queries see its stored rows; free capacity (and a head with none) hidden.
    Both the fused CPU kernel path and the two-``bmm`` path other devices take."""
    import runtime.kv_store.paged_attention

    if not fused:
        monkeypatch.setattr(runtime.kv_store.paged_attention, "_FLASH_CPU_DTYPES", ())
    generator = torch.Generator().manual_seed(1)
    page, dim, rows = 4, 8, 3
    capacities, lengths = [8, 12, 4, 16], [5, 12, 0, 9]
    total = sum(capacities)
    keys = torch.randn(total, dim, generator=generator).to(dtype)
    values = torch.randn(total, dim, generator=generator).to(dtype)
    query = torch.randn(len(capacities), rows, dim, generator=generator)
    owner, _ = _pages(capacities, page)
    offsets = np.cumsum([0] + capacities)[:-1]
    bias = torch.full((total,), float("-inf"), dtype=dtype)
    for offset, length in zip(offsets, lengths, strict=True):
        bias[offset : offset + length] = 0
    out, lse = decode_attention(
        query, keys.view(-1, page, dim), values.view(-1, page, dim), owner, bias.view(-1, page), 0.5
    )
    limit = torch.tensor(lengths).unsqueeze(1).expand(-1, rows)
    expected_out, expected_lse = _naive(query.to(dtype).float(), keys.float(), values.float(), offsets, limit, 0.5)
    torch.testing.assert_close(out.double(), expected_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, atol=tolerance, rtol=tolerance)


# capacities and live lengths [B][Hkv] of the layouts live_rows_attention reads
LIVE_ROW_LAYOUTS = {
    # every segment the same: the [S, cap, d] view, one call
    "one-call": ([[12, 12, 12]], [[9, 9, 9]]),
    # one batch row, unequal heads (a free tail, a head with no live row): one call per head
    "batch-1": ([[8, 12, 4, 16]], [[5, 12, 0, 9]]),
    # per-head budgets equal across 3 batch rows: one strided call per head
    "heads-across-rows": ([[8, 16, 4]] * 3, [[5, 16, 1]] * 3),
    # head 0 the same in every row, head 1 not (a row with none), head 2 unevenly spaced: mixed
    "mixed": ([[8, 16, 4], [8, 12, 8], [8, 16, 4]], [[6, 10, 3], [6, 0, 3], [6, 11, 3]]),
}


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("layout", list(LIVE_ROW_LAYOUTS))
def test_live_rows_attention_equals_direct_computation(dtype, tolerance, layout):
    """Decoding over each segment's live rows read in place (free capacity after them, a segment with
    none; heads read across batch rows as one strided view where their segments are alike): as one
    softmax per head over exactly its live rows."""
    from runtime.kv_store.paged_attention import live_rows_attention
    from runtime.kv_store.segments import _even_strides

    generator = torch.Generator().manual_seed(3)
    capacities, lengths = LIVE_ROW_LAYOUTS[layout]
    dim, rows = 8, 3
    flat_capacities = [c for row in capacities for c in row]
    flat_offsets = np.cumsum([0] + flat_capacities)[:-1].tolist()
    heads = len(capacities[0])
    offsets = [flat_offsets[b * heads : (b + 1) * heads] for b in range(len(capacities))]
    keys = torch.randn(sum(flat_capacities), dim, generator=generator).to(dtype)
    values = torch.randn(sum(flat_capacities), dim, generator=generator).to(dtype)
    query = torch.randn(len(flat_capacities), rows, dim, generator=generator)
    capacity = flat_capacities[0] if layout == "one-call" else None
    strides = _even_strides(torch.tensor(offsets))
    out, lse = live_rows_attention(query, keys, values, offsets, lengths, 0.5, head_stride=strides, capacity=capacity)
    limit = torch.tensor([n for row in lengths for n in row]).unsqueeze(1).expand(-1, rows)
    expected_out, expected_lse = _naive(query.to(dtype).float(), keys.float(), values.float(), flat_offsets, limit, 0.5)
    torch.testing.assert_close(out.double(), expected_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, atol=tolerance, rtol=tolerance)


def test_heads_alike_across_batch_rows_take_one_call_each():
    """The call count the decode step's choice reads: one per KV head whose segments hold the same
    count at evenly spaced offsets, one per segment of any other head."""
    from runtime.kv_store.paged_attention import live_row_calls
    from runtime.kv_store.segments import _even_strides

    offsets = torch.tensor([[0, 8, 24], [28, 36, 48], [56, 64, 80]])  # head 2 unevenly spaced
    assert _even_strides(offsets) == [28, 28, None]
    assert _even_strides(offsets[:1]) == [0, 0, 0]
    strides = _even_strides(offsets)
    assert live_row_calls([[6, 10, 3], [6, 10, 3], [6, 10, 3]], strides) == 1 + 1 + 3
    assert live_row_calls([[6, 10, 3], [6, 9, 3], [6, 10, 3]], strides) == 1 + 3 + 3
    assert live_row_calls([[0, 10, 3]] * 3, strides) == 3 + 1 + 3  # no live row: per segment (none computed)


@torch.no_grad()
def test_a_stacked_cache_and_its_sources_decode_without_overwriting_each_other():
    """``RaggedCache.stack`` used to put the sources' buffers in the batch as they were: a source
    with spare capacity and the stacked cache, both decoding, wrote their next token into the
    same rows of the same tensors."""
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with ragged_attention(model):
        source = RaggedCache.for_model(model)
        prefill(model, source, ids[:, :10])
        model(ids[:, 10:11], **cache_argument(model, source))  # growing past the prompt leaves spare capacity
        assert all(int(layer.capacity.min()) > int(layer.length.max()) for layer in source.layers)
        stacked = RaggedCache.stack([source, source.copy()])
        model(torch.tensor([[5], [5]]), **cache_argument(model, stacked))
        written = [layer.head(0, h)[0].clone() for layer in stacked.layers for h in range(layer.num_heads)]
        model(torch.tensor([[77]]), **cache_argument(model, source))  # the source decodes another token
        after = [layer.head(0, h)[0] for layer in stacked.layers for h in range(layer.num_heads)]
    for before, now in zip(written, after, strict=True):
        assert torch.equal(before, now)


@torch.no_grad()
@pytest.mark.parametrize("small_layers_gathered", [True, False], ids=["gathered", "pages"])
def test_batch_with_inf_budgets_correction_and_decode_eviction_equals_one_by_one(monkeypatch, small_layers_gathered):
    """Heads of different lengths in every row, the MomentKV correction and decode-time eviction,
    all through one attention call per layer (small layers' heads gathered into one page each, or
    attended page by page): each row generates what it generates alone."""
    import runtime.kv_store.layout

    if not small_layers_gathered:
        monkeypatch.setattr(runtime.kv_store.layout, "_GATHER_ROWS", 0)
    model = make_tiny_llama(num_layers=3, num_heads=6, num_kv_heads=3)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=generator) for n in (60, 41, 52)]
    policy = CompressionPolicy(
        keep_ratio=0.3, allocation="inf", scorer="keydiff", correction="order1", evict_every=3, window=4, n_sink=2
    )
    calibration = inf_calibration(3, 3)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    batch = generate(model, ids, policy, attention_mask=mask, calibration=calibration, max_new_tokens=8, pad_token_id=0)
    lengths = batch.cache.head_lengths()
    assert len(np.unique(lengths.numpy())) > 2  # really ragged
    for row, prompt in enumerate(prompts):
        single = generate(model, prompt.unsqueeze(0), policy, calibration=calibration, max_new_tokens=8)
        assert batch.new_tokens[row].tolist() == single.new_tokens[0].tolist()
        assert torch.equal(lengths[:, row], single.cache.head_lengths()[:, 0])


@torch.no_grad()
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_runtime_leaves_the_models_attention_implementation_as_it_found_it(implementation):
    """``generate`` / ``compress_prompt`` switch to the ragged attention function for their own
    calls only: an eager model stays eager (it used to be left on the ragged function, which runs
    SDPA for ordinary caches)."""
    model = make_tiny_llama(attn_implementation=implementation)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    generate(model, ids, policy, context_columns=25, max_new_tokens=3)
    assert model.config._attn_implementation == implementation
    cache, _ = compress_prompt(model, ids, policy, context_columns=25)
    assert model.config._attn_implementation == implementation
    with ragged_attention(model):  # what serving the returned cache through model.generate takes
        model.generate(ids, **cache_argument(model, cache), max_new_tokens=2, do_sample=False)
    assert model.config._attn_implementation == implementation


@torch.no_grad()
def test_profiler_labels_are_recorded_only_while_a_profiler_records():
    """runtime.kv_store.profiling.label: a decode step under torch.profiler shows the runtime's labels; with no
    profiler on, no record_function is entered (it cost ~50 us per layer and step)."""
    from contextlib import nullcontext

    from runtime.kv_store.profiling import label

    assert isinstance(label("kvcal.attention"), nullcontext)
    model = make_tiny_llama(num_layers=2)
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="order1")
    with ragged_attention(model):
        cache, _ = compress_prompt(model, ids, policy)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            model(torch.tensor([[3]]), **cache_argument(model, cache))
    names = {event.name for event in profiler.events()}
    assert {"kvcal.attention", "kvcal.correction"} <= names


def test_merged_parts_equal_one_softmax_over_their_union():
    """merge_attention of two disjoint row sets equals attention over both; an empty set
    (``lse = -inf``) leaves the other's, and two empty sets give out 0, lse -inf."""
    from runtime.kv_store.paged_attention import merge_attention

    generator = torch.Generator().manual_seed(5)
    query, keys, values = (torch.randn(n, 8, generator=generator, dtype=torch.float64) for n in (4, 11, 11))

    def attend(rows):
        logits = query @ keys[rows].T
        return torch.softmax(logits, -1) @ values[rows], torch.logsumexp(logits, -1)

    for split in (0, 3, 11):
        out, lse = merge_attention(*attend(slice(0, split)), *attend(slice(split, 11)))
        expected_out, expected_lse = attend(slice(0, 11))
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(lse, expected_lse)
    empty = torch.full((4,), float("-inf"), dtype=torch.float64)
    out, lse = merge_attention(
        torch.zeros(4, 8, dtype=torch.float64), empty, torch.zeros(4, 8, dtype=torch.float64), empty
    )
    assert torch.equal(out, torch.zeros(4, 8, dtype=torch.float64)) and torch.isneginf(lse).all()


@torch.no_grad()
@pytest.mark.parametrize("correction", ["none", "order1"])
def test_a_chunk_in_two_parts_equals_the_chunk_over_every_row(monkeypatch, correction):
    """A chunk after a compressed prefix (heads of different lengths in every row, a left-padded
    batch, padding inside the chunk too) attended in two merged parts, the rows before the chunk
    and the chunk itself causally (runtime.kv_store.layer_attention._chunk_split_attention, the CPU's path),
    gives the logits of attending every stored row with the visibility mask (the path elsewhere)."""
    import runtime.kv_store.layer_attention

    model = make_tiny_llama(num_layers=3, num_heads=6, num_kv_heads=3)
    generator = torch.Generator().manual_seed(4)
    lengths, chunk = (60, 41, 52), 23
    ids = torch.zeros(3, max(lengths) + chunk, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, max(lengths) - n :] = torch.randint(1, 128, (n + chunk,), generator=generator)
        mask[row, max(lengths) - n :] = 1
    mask[1, -chunk + 4] = 0  # a padding column inside the chunk
    policy = CompressionPolicy(keep_ratio=0.3, allocation="inf", scorer="keydiff", correction=correction)
    with ragged_attention(model):
        cache, _ = compress_prompt(
            model, ids, policy, attention_mask=mask, context_columns=max(lengths), calibration=inf_calibration(3, 3)
        )
        assert len(np.unique(cache.head_lengths().numpy())) > 2  # really ragged
        copy = cache.copy()
        split = model(ids[:, -chunk:], attention_mask=mask, **cache_argument(model, cache)).logits
        monkeypatch.setattr(runtime.kv_store.layer_attention, "fused_kernel_serves", lambda *args: False)
        every_row = model(ids[:, -chunk:], attention_mask=mask, **cache_argument(model, copy)).logits
    real = mask[:, -chunk:].bool()
    torch.testing.assert_close(split[real], every_row[real], atol=1e-5, rtol=1e-5)
