"""The opt-in flex_attention decode path (runtime/kv_store/flex_decode.py) against one softmax per head over
exactly its live rows: the uncompiled reference implementation with its log-sum-exp (the CUDA path's
arithmetic), the compiled CPU kernel (tiny shapes: compiling takes tens of seconds), and a decode
through the model with ``KVCAL_DECODE_KERNEL=flex``."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from test_runtime_cache import inf_calibration

from runtime import CompressionPolicy, generate
from runtime.kv_store.flex_decode import (
    DECODE_KERNEL_VARIABLE,
    build_mask,
    flex_available,
    flex_decode_attention,
    flex_serves,
)
from runtime.kv_store.segments import SegmentStore

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest: one torch thread
    pytest.mark.skipif(not flex_available(), reason="no flex_attention with enable_gqa / return_aux here (torch 2.6)"),
]

# Segments of unequal lengths, one with no live row, one with a single row, one spanning several of
# the mask's 128-row KV blocks, and segments sharing a block (offsets are not block-aligned).
# Compiling imports torch's inductor, which warns of its own deprecated torch.jit use (not ours).
compiles = [
    pytest.mark.compiles,
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]
reference_implementation = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CAPACITIES = [16, 16, 160, 16, 320, 32]
LENGTHS = [0, 1, 130, 7, 300, 32]


def _store(dtype, capacities=CAPACITIES, lengths=LENGTHS, heads=2, dim=16, seed=0) -> SegmentStore:
    """A packed store of ``len(capacities) / heads`` batch rows, random rows (free capacity random too)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(capacities)
    capacity = torch.tensor(capacities, dtype=torch.int64)
    offset = (torch.cumsum(capacity, 0) - capacity).view(-1, heads)
    store = SegmentStore(offset.shape[0], heads, dim, dtype, "cpu")
    store.install(
        torch.randn(total, dim, generator=generator).to(dtype),
        torch.randn(total, dim, generator=generator).to(dtype),
        torch.zeros(total, dtype=torch.int32),
        offset,
        capacity.view(-1, heads),
        torch.tensor(lengths, dtype=torch.int64).view(-1, heads),
        16,
    )
    return store


def _direct(query, store, scaling, softcap=None):
    """One softmax per (segment, query head) over exactly the segment's live rows, float64."""
    segments, group, dim = query.shape
    out = torch.zeros(segments, group, dim, dtype=torch.float64)
    lse = torch.full((segments, group), float("-inf"), dtype=torch.float64)
    offsets, lengths = store.offset.reshape(-1).tolist(), store.length.reshape(-1).tolist()
    for s in range(segments):
        if lengths[s] == 0:
            continue
        keys = store.key_buffer[offsets[s] : offsets[s] + lengths[s]].double()
        values = store.value_buffer[offsets[s] : offsets[s] + lengths[s]].double()
        logits = scaling * query[s].to(store.dtype).double() @ keys.T  # [G, n]
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        lse[s] = torch.logsumexp(logits, -1)
        out[s] = torch.softmax(logits, -1) @ values
    return out, lse


@reference_implementation
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "soft-capped"])
def test_reference_flex_with_lse_equals_one_softmax_per_head(dtype, tolerance, softcap):
    """Uncompiled (PyTorch's reference implementation of the same block mask and mask_mod), with the
    log-sum-exp the correction merges with: GQA groups of 3, segments of 0, 1, 7, 32, 130, 300 rows."""
    store = _store(dtype)
    query = torch.randn(store.offset.numel(), 3, 16, generator=torch.Generator().manual_seed(1))
    out, lse = flex_decode_attention(query, store, 0.4, softcap=softcap, need_lse=True, compiled=False)
    expected_out, expected_lse = _direct(query, store, 0.4, softcap)
    torch.testing.assert_close(out.double(), expected_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), expected_lse, atol=tolerance, rtol=tolerance)


def test_block_tables_cover_every_live_row_and_no_other_segment_block():
    """The block mask's tables (what the compiled kernels iterate over): head s visits exactly the
    128-row KV blocks its capacity overlaps, so its live rows are all inside them."""
    store = _store(torch.float32)
    offset, capacity = store.offset.reshape(-1), store.capacity.reshape(-1)
    mask = build_mask(offset, capacity, store.key_buffer.shape[0], 3, "cpu")
    counts = mask.block_mask.kv_num_blocks[0, :, 0].tolist()
    indices = mask.block_mask.kv_indices[0, :, 0]
    for s, (start, size) in enumerate(zip(offset.tolist(), capacity.tolist(), strict=True)):
        expected = list(range(start // 128, (start + size - 1) // 128 + 1))
        assert indices[s, : counts[s]].tolist() == expected


def test_flex_serves_only_where_the_compiled_kernel_can():
    store = _store(torch.float32)
    query = torch.randn(store.offset.numel(), 3, 16)
    assert flex_serves(query, store.key_buffer, 16, need_lse=False)
    assert not flex_serves(query, store.key_buffer, 16, need_lse=True)  # compiled for CPU: no lse
    assert not flex_serves(query, store.key_buffer, 8, need_lse=False)  # below flex's smallest head dim
    assert not flex_serves(query, store.key_buffer[:0], 16, need_lse=False)  # nothing stored
    wide = _store(torch.float64)  # flex_attention does not compile float64 for the CPU: it crashed there
    assert not flex_serves(query.double(), wide.key_buffer, 16, need_lse=False)


def test_without_the_flex_api_nothing_serves(monkeypatch):
    """A torch without flex_attention's needed features (feature detection left FLEX_API None):
    the selection falls through to the default kernels."""
    import runtime.kv_store.flex_decode

    monkeypatch.setattr(runtime.kv_store.flex_decode, "FLEX_API", None)
    store = _store(torch.float32)
    assert not runtime.kv_store.flex_decode.flex_available()
    assert not flex_serves(torch.randn(store.offset.numel(), 3, 16), store.key_buffer, 16, need_lse=False)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@compiles[0]
@compiles[1]
def test_compiled_flex_equals_one_softmax_per_head_as_lengths_grow(dtype, tolerance):
    """The compiled CPU kernel (tiny shape; compiling takes tens of seconds the first time) over the
    same segments, then again after every segment grew by one row and after a repack to new sizes:
    the block mask's ``ends`` are read at each call, and ``dynamic=True`` takes the new buffer size."""
    store = _store(dtype)
    query = torch.randn(store.offset.numel(), 3, 16, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        out, lse = flex_decode_attention(query, store, 0.4, need_lse=False)
        assert lse is None
        torch.testing.assert_close(out.double(), _direct(query, store, 0.4)[0], atol=tolerance, rtol=tolerance)
        grown = store.length + (store.length < store.capacity).long()
        store.length.copy_(grown)
        store.refresh_lengths()
    other = _store(dtype, capacities=[48, 16, 64, 16, 32, 16], lengths=[40, 0, 64, 2, 5, 16], seed=3)
    out, _ = flex_decode_attention(query, other, 0.4, need_lse=False)
    torch.testing.assert_close(out.double(), _direct(query, other, 0.4)[0], atol=tolerance, rtol=tolerance)


@torch.no_grad()
@compiles[0]
@compiles[1]
def test_generation_with_the_flex_kernel_selected_equals_the_default_kernels(monkeypatch):
    """``KVCAL_DECODE_KERNEL=flex``: a batch with INF budgets (heads of unequal lengths) and
    decode-time eviction generates the same tokens as the runtime's default decode kernels."""
    model = make_tiny_llama(num_layers=2, num_heads=6, num_kv_heads=3)
    ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(4))
    policy = CompressionPolicy(keep_ratio=0.4, allocation="inf", scorer="keydiff", evict_every=3, window=4, n_sink=2)
    calibration = inf_calibration(2, 3)

    def run():
        return generate(model, ids, policy, calibration=calibration, max_new_tokens=8)

    import runtime.kv_store.layer_attention

    monkeypatch.delenv(DECODE_KERNEL_VARIABLE, raising=False)
    default = run()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex_decode_attention(*args, **kwargs)

    monkeypatch.setattr(runtime.kv_store.layer_attention, "flex_decode_attention", counted)
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "flex")
    flex = run()
    assert len(calls) == 2 * 8  # both layers at each of the 8 one-token forwards
    assert len(set(default.cache.head_lengths().reshape(-1).tolist())) > 2  # really ragged
    assert flex.new_tokens.tolist() == default.new_tokens.tolist()
    assert torch.equal(flex.cache.head_lengths(), default.cache.head_lengths())


@torch.no_grad()
def test_with_a_correction_on_cpu_the_flex_selection_falls_back_to_the_default_kernels(monkeypatch):
    """The MomentKV correction merges with the log-sum-exp, which flex_attention compiled for CPU
    cannot return: with ``KVCAL_DECODE_KERNEL=flex`` the runtime keeps its own kernels there."""
    import runtime.kv_store.layer_attention

    model = make_tiny_llama(num_layers=2, num_heads=6, num_kv_heads=3)
    ids = torch.randint(1, 128, (2, 60), generator=torch.Generator().manual_seed(5))
    policy = CompressionPolicy(keep_ratio=0.4, allocation="inf", scorer="keydiff", correction="order1")
    calibration = inf_calibration(2, 3)
    monkeypatch.delenv(DECODE_KERNEL_VARIABLE, raising=False)
    default = generate(model, ids, policy, calibration=calibration, max_new_tokens=4)

    def refused(*args, **kwargs):
        raise AssertionError("flex_attention was called for a corrected layer on CPU")

    monkeypatch.setattr(runtime.kv_store.layer_attention, "flex_decode_attention", refused)
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "flex")
    selected = generate(model, ids, policy, calibration=calibration, max_new_tokens=4)
    assert selected.new_tokens.tolist() == default.new_tokens.tolist()


@torch.no_grad()
@compiles[0]
@compiles[1]
def test_a_soft_capping_model_generates_with_the_flex_kernel_as_with_the_default_kernels(monkeypatch):
    """Gemma 2's soft-cap in flex_attention's score_mod, compiled on the CPU: Inductor could not lower the cap (a
    float the closure held, traced as an input read with .item(): "LoweringException: RuntimeError:
    unbacked_bindings", found by benchmarks/row_alone_campaign.py); the compiled kernel now takes it as a constant,
    and a left-padded batch generates the tokens of the default kernels."""
    from tiny_architectures import make_tiny

    import runtime.kv_store.layer_attention

    model = make_tiny("gemma2")
    ids = torch.randint(3, 500, (2, 90), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :20], mask[1, :20] = 0, 0
    policy = CompressionPolicy(keep_ratio=0.4, scorer="keydiff")
    monkeypatch.delenv(DECODE_KERNEL_VARIABLE, raising=False)
    default = generate(model, ids, policy, attention_mask=mask, max_new_tokens=6)
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("softcap"))
        return flex_decode_attention(*args, **kwargs)

    monkeypatch.setattr(runtime.kv_store.layer_attention, "flex_decode_attention", counted)
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "flex")
    flex = generate(model, ids, policy, attention_mask=mask, max_new_tokens=6)
    assert calls and all(cap == model.config.attn_logit_softcapping for cap in calls)
    assert flex.new_tokens.tolist() == default.new_tokens.tolist()
