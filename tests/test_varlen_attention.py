"""A chunk over a packed layer as one FlashAttention varlen call (runtime/kv_store/varlen_attention.py,
issue 40): the GPU's path, checked here without a GPU.

* the packing (queries to sequences of one KV head and G query heads, the buffer read in place
  from each segment's offset, the outputs and log-sum-exps back in segment order) against a naive
  loop over (row, KV head, query head, token), through :func:`reference_varlen` (the kernel's
  documented semantics: bottom-right causal, ``seqused_k`` keys from ``cu_k``);
* the real ``aten::_flash_attention_forward`` call on the meta device (its schema and the shapes
  our reshapes assume: ``out [Tq, G, d]``, ``lse [G, Tq]``);
* the whole runtime with the varlen path forced and the reference kernel in it: a block-wise
  prefill and a question fed through the compressed cache on the embedded model answer as the
  default path does (the same greedy tokens, logits within float32 noise).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.kv_store import layer_attention, varlen_attention
from runtime.kv_store.layout import PageLayout
from runtime.kv_store.segments import SegmentStore
from runtime.kv_store.varlen_attention import (
    flash_varlen,
    reference_varlen,
    varlen_chunk_attention,
    varlen_decode_attention,
    varlen_serves,
)


def packed_layer(batch=2, heads=3, dim=16, q_len=5, seed=0, dtype=torch.float32):
    """A packed layer's buffers with a chunk of ``q_len`` just appended to every segment: segments at
    increasing offsets with gaps (their capacity), each with its own count of rows before the chunk."""
    generator = torch.Generator().manual_seed(seed)
    before = np.array([[7, 0, 12], [3, 9, 1]])[:batch, :heads]
    length = before + q_len
    capacity = length + np.array([[2, 5, 0], [4, 1, 3]])[:batch, :heads]
    offset = np.concatenate([[0], np.cumsum(capacity.reshape(-1))[:-1]]).reshape(batch, heads)
    rows = int(capacity.sum())
    keys = torch.randn(rows, dim, generator=generator).to(dtype)
    values = torch.randn(rows, dim, generator=generator).to(dtype)
    return keys, values, offset, length, before


def naive(query, keys, values, offset, length, scaling):
    """Token t of segment (b, h) over the segment's rows up to the chunk's t-th: ``[S, G*q, d]``, ``[S, G*q]``."""
    batch, query_heads, q_len, dim = query.shape
    heads = length.shape[1]
    group = query_heads // heads
    out = torch.zeros(batch * heads, group * q_len, dim)
    lse = torch.zeros(batch * heads, group * q_len)
    for b in range(batch):
        for h in range(heads):
            s, start, count = b * heads + h, int(offset[b, h]), int(length[b, h])
            for g in range(group):
                for t in range(q_len):
                    visible = count - q_len + t + 1
                    k = keys[start : start + visible].float()
                    v = values[start : start + visible].float()
                    logits = k @ query[b, h * group + g, t].float() * scaling
                    out[s, g * q_len + t] = torch.softmax(logits, 0) @ v
                    lse[s, g * q_len + t] = torch.logsumexp(logits, 0)
    return out, lse


@pytest.mark.parametrize("group", [1, 3])
def test_the_varlen_packing_is_a_chunk_over_each_segment_causally(group):
    keys, values, offset, length, _ = packed_layer()
    batch, heads, q_len, dim = 2, 3, 5, 16
    query = torch.randn(batch, heads * group, q_len, dim, generator=torch.Generator().manual_seed(1))
    out, lse = varlen_chunk_attention(query, keys, values, offset, length, 0.25, kernel=reference_varlen)
    expected_out, expected_lse = naive(query, keys, values, offset, length, 0.25)
    assert out.shape == (batch * heads, group * q_len, dim) and out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


def test_a_decode_step_reads_the_device_tables_of_a_store_with_unequal_heads():
    """A store whose heads hold different counts (evicted unevenly) then one decode row each: the
    varlen step over the layout's tables and the advanced ``ends`` is every head's attention over
    its live rows, and it reads no host table."""
    generator = torch.Generator().manual_seed(3)
    store = SegmentStore(2, 3, 16, torch.float32, "cpu")
    store.append(torch.randn(2, 3, 40, 16, generator=generator), torch.randn(2, 3, 40, 16, generator=generator),
                 torch.arange(40).expand(2, 40), None)  # fmt: skip
    keep = torch.rand(2, 3, 40, generator=generator) < torch.tensor([0.2, 0.5, 0.9])[None, :, None]
    store.keep_rows([0, 1], keep)
    store.append(torch.randn(2, 3, 1, 16, generator=generator), torch.randn(2, 3, 1, 16, generator=generator),
                 torch.full((2, 1), 40), None)  # fmt: skip
    layout = PageLayout.build(store.offset, store.capacity, store.page_size, store.key_buffer.shape[0], "cpu")
    query = torch.randn(6, 4, 16, generator=generator)  # [S, G, d]
    calls = []

    def recording(*arguments):
        calls.append(arguments)
        return reference_varlen(*arguments)

    out, lse = varlen_decode_attention(query, store, layout, 0.25, kernel=recording)
    assert out.shape == (6, 4, 16) and lse.shape == (6, 4)
    for b in range(2):
        for h in range(3):
            keys, values, _ = store.head(b, h)
            logits = query[b * 3 + h] @ keys.T * 0.25  # [G, n]
            torch.testing.assert_close(out[b * 3 + h], torch.softmax(logits, -1) @ values, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b * 3 + h], torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
    assert len({int(n) for n in store.host_length.reshape(-1)}) > 1  # the heads differ
    # what the step dispatches around the kernel: no table made per step (the query starts are the
    # layout's, made at the repack: one GPU launch per layer and step fewer, issue 39)
    from test_decode_sync import SyncCounter

    raw = reference_varlen(*calls[0])  # the kernel's outputs, made outside the count

    def kernel(*arguments):
        calls.append(arguments)
        return raw

    counter = SyncCounter()
    with counter:
        varlen_decode_attention(query, store, layout, 0.25, kernel=kernel)
    assert calls[1][3] is layout.decode_query_starts
    assert counter.names["arange"] == 0 and not counter.syncs, counter.names


def test_a_decode_step_without_the_correction_keeps_the_kernels_dtype():
    """Without MomentKV's merge (``need_lse=False``) the step hands back the kernel's output in the
    buffer's dtype and no log-sum-exp: the float32 round trip (two casts, two GPU launches per layer
    and step) was for nothing there; the values are the float32 path's."""
    from test_decode_sync import SyncCounter

    generator = torch.Generator().manual_seed(5)
    store = SegmentStore(1, 3, 16, torch.bfloat16, "cpu")
    keys, values = torch.randn(2, 1, 3, 20, 16, generator=generator).bfloat16()
    store.append(keys, values, torch.arange(20).expand(1, 20), None)
    layout = PageLayout.build(store.offset, store.capacity, store.page_size, store.key_buffer.shape[0], "cpu")
    query = torch.randn(3, 2, 16, generator=generator).bfloat16()
    counts = {}
    for need_lse in (True, False):
        counter = SyncCounter()
        with counter:
            counts[need_lse] = (
                varlen_decode_attention(
                    query, store, layout, 0.25, kernel=lambda *a: _kernel_dtype(reference_varlen(*a)), need_lse=need_lse
                ),
                counter.names["_to_copy"],
            )
    (full, lse), casts_full = counts[True]
    (plain, none), casts_plain = counts[False]
    assert none is None and plain.dtype == torch.bfloat16 and full.dtype == torch.float32 and lse is not None
    assert torch.equal(plain.float(), full)
    assert casts_plain < casts_full, (casts_plain, casts_full)


def _kernel_dtype(outputs):
    """The reference's float32 output in bf16, as the flash kernel returns it (its lse stays float32)."""
    out, lse = outputs
    return out.bfloat16(), lse


def test_the_flash_call_takes_our_packing_on_the_meta_device():
    """The real op's meta kernel: the schema we call (keyword seqused_k, int32 cu tables) and the
    layouts our reshapes read (out ``[Tq, G, d]``, lse ``[G, Tq]``)."""
    keys, values, offset, length, _ = packed_layer(dtype=torch.bfloat16)
    query = torch.randn(2, 6, 5, 16, dtype=torch.bfloat16)
    meta = torch.device("meta")
    out, lse = varlen_chunk_attention(query.to(meta), keys.to(meta), values.to(meta), offset, length, 0.25)
    assert out.shape == (6, 10, 16) and lse.shape == (6, 10) and out.device.type == "meta"
    packed = torch.empty(30, 2, 16, dtype=torch.bfloat16, device=meta)
    cu = torch.zeros(7, dtype=torch.int32, device=meta)
    raw_out, raw_lse = flash_varlen(packed, packed[:, :1], packed[:, :1], cu, cu, 5, 17, 0.25, cu[:6])
    # the log-sum-exp's layout changed between torch releases (2.6: padded per sequence): both are read
    assert raw_out.shape == (30, 2, 16) and raw_lse.shape in ((2, 30), (6, 2, 5))


def test_both_log_sum_exp_layouts_give_the_same_attention():
    """torch 2.6's flash kernel returns the varlen log-sum-exp padded per sequence ``[S, G, max_q]``,
    newer ones unpadded ``[G, Tq]``: a kernel of either layout gives the same (out, lse)."""
    keys, values, offset, length, _ = packed_layer()
    query = torch.randn(2, 6, 5, 16, generator=torch.Generator().manual_seed(2))

    def padded(*arguments):
        out, lse = reference_varlen(*arguments)  # lse [G, S * q]
        return out, lse.view(2, 6, 5).transpose(0, 1)  # [S, G, q]: every sequence has q = max_q queries

    unpadded = varlen_chunk_attention(query, keys, values, offset, length, 0.25, kernel=reference_varlen)
    other = varlen_chunk_attention(query, keys, values, offset, length, 0.25, kernel=padded)
    torch.testing.assert_close(unpadded, other)


def test_the_varlen_path_serves_only_where_its_kernel_runs():
    keys, values, offset, length, _ = packed_layer(dtype=torch.bfloat16)

    class Store:
        key_buffer, head_dim, host_offset = keys, 16, offset

    assert not varlen_serves(torch.zeros(1, 3, 2, 16, dtype=torch.bfloat16), Store(), None)  # the CPU


@pytest.fixture
def varlen_forced(monkeypatch):
    """The runtime with the GPU's chunk path taken on the CPU, its kernel the reference."""
    monkeypatch.setattr(layer_attention, "varlen_serves", lambda query, store, softcap: True)
    calls = []

    def counted(*arguments):
        calls.append("decode" if arguments[5] == 1 else "chunk")  # max_q
        return reference_varlen(*arguments)

    monkeypatch.setattr(varlen_attention, "flash_varlen", counted)
    return calls


@pytest.mark.slow
def test_block_wise_prefill_and_question_through_the_varlen_path_answer_as_the_default(
    embedded_model, embedded_tokenizer, varlen_forced, monkeypatch, one_thread
):
    from runtime import CompressionPolicy
    from runtime.serve.generation import generate

    text = ("The grass is green. The sky is blue. " * 30) + "The passcode is 4821. " + ("Here we go. " * 30)
    question = " What is the passcode? Answer:"
    context = embedded_tokenizer(text, return_tensors="pt")["input_ids"]
    ids = torch.cat([context, embedded_tokenizer(question, return_tensors="pt")["input_ids"]], dim=1)
    policy = CompressionPolicy(scorer="keydiff", compression_ratio=0.5)
    kwargs = {"context_columns": context.shape[1], "block_size": 128, "max_new_tokens": 6}
    kwargs.update(output_logits=True, return_dict_in_generate=True)
    forced = generate(embedded_model, ids, policy, **kwargs)
    # the blocks after the first, the question and every decode step went through it
    assert {"chunk", "decode"} <= set(varlen_forced)
    monkeypatch.undo()
    default = generate(embedded_model, ids, policy, **kwargs)
    assert forced.new_tokens.tolist() == default.new_tokens.tolist()
    for a, b in zip(forced.logits, default.logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_flagships_corrected_question_through_the_varlen_path_answers_as_the_default(
    embedded_model, embedded_tokenizer, smoke_artifact, varlen_forced, monkeypatch, one_thread
):
    """The MomentKV merge reads the varlen call's log-sum-exp: the flagship (+correction) served
    from the smoke artifact, the question fed through its compressed cache."""
    from runtime import answer, load_calibration
    from runtime.plan.policy_spec import parse_policy

    calibration = load_calibration(embedded_model, embedded_tokenizer, path=smoke_artifact)
    policy = parse_policy("flagship").policy(0.75)
    assert policy.correction is not None
    context = ("The grass is green. The sky is blue. " * 30) + "The passcode is 4821. " + ("Here we go. " * 30)
    question = "What is the passcode?"
    kwargs = {"calibration": calibration, "max_new_tokens": 6}
    forced = answer(embedded_model, embedded_tokenizer, context, question, policy, **kwargs)
    assert {"chunk", "decode"} <= set(varlen_forced)
    monkeypatch.undo()
    assert forced == answer(embedded_model, embedded_tokenizer, context, question, policy, **kwargs)
