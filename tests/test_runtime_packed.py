"""The packed per-layer cache: its attention against direct computations, buffers it owns, and the
attention implementation it leaves behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from test_runtime_cache import inf_calibration

from runtime import CompressionPolicy, RaggedCache, compress_prompt, generate, prefill, ragged_attention
from runtime.paged_attention import decode_attention, segment_attention
from runtime.transformers_compat import cache_argument

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
    import runtime.paged_attention

    if not fused:
        monkeypatch.setattr(runtime.paged_attention, "_FLASH_CPU_DTYPES", ())
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


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("uniform", [True, False], ids=["one-call", "per-segment"])
def test_live_rows_attention_equals_direct_computation(dtype, tolerance, uniform):
    """Decoding over each segment's live rows read in place (free capacity after them, a segment with
    none): as one softmax per head over exactly its live rows."""
    from runtime.paged_attention import live_rows_attention

    generator = torch.Generator().manual_seed(3)
    dim, rows = 8, 3
    capacities = [12, 12, 12] if uniform else [8, 12, 4, 16]
    lengths = [9, 9, 9] if uniform else [5, 12, 0, 9]
    offsets = np.cumsum([0] + capacities)[:-1].tolist()
    keys = torch.randn(sum(capacities), dim, generator=generator).to(dtype)
    values = torch.randn(sum(capacities), dim, generator=generator).to(dtype)
    query = torch.randn(len(capacities), rows, dim, generator=generator)
    capacity = capacities[0] if uniform else None
    out, lse = live_rows_attention(query, keys, values, offsets, lengths, 0.5, capacity=capacity)
    limit = torch.tensor(lengths).unsqueeze(1).expand(-1, rows)
    expected_out, expected_lse = _naive(query.to(dtype).float(), keys.float(), values.float(), offsets, limit, 0.5)
    torch.testing.assert_close(out.double(), expected_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, atol=tolerance, rtol=tolerance)


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
    import runtime.layout

    if not small_layers_gathered:
        monkeypatch.setattr(runtime.layout, "_GATHER_ROWS", 0)
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
