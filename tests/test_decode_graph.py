"""Decode steps replayed from a captured graph generate what eager steps generate (runtime.serve.decode_graph).

A CUDA graph replays the kernels a step launched at capture, on the same memory, without the
Python that launched them.  No GPU here: the graphs are tests/step_replay.py's recorded aten ops,
which replay with the same semantics (and refuse at capture what a CUDA capture refuses).  The
page kernel, which the runtime runs on every GPU, is selected with ``KVCAL_DECODE_KERNEL=pages``;
on a CPU the runtime's own choice reads the live rows sized by the host's lengths, and is never
captured.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from step_replay import CaptureRefused, RecordedStep

from runtime import CompressionPolicy
from runtime.compression.ragged_attention import ragged_attention
from runtime.kv_store.cache import RaggedCache
from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE
from runtime.serve.generation import compress_prompt, generate_from_cache

NEW_TOKENS = 24

POLICIES = {
    "uniform/keydiff": CompressionPolicy(compression_ratio=0.75, scorer="keydiff"),
    "keydiff+correction1": CompressionPolicy(compression_ratio=0.75, scorer="keydiff", correction="order1"),
    "ragged, nothing evicted": None,
    "decode-time eviction": CompressionPolicy(compression_ratio=0.75, scorer="keydiff", evict_every=8),
    "decode-time eviction+correction1": CompressionPolicy(
        compression_ratio=0.75, scorer="keydiff", evict_every=8, correction="order1"
    ),
}


@pytest.fixture(scope="module")
def tiny():
    model = make_tiny_llama(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # a left-padded row
    return model, ids, mask


@pytest.fixture
def page_kernel(monkeypatch):
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")


def _generate(model, ids, mask, policy, graphs, **kwargs):
    with ragged_attention(model):
        cache, report = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=ids.shape[1] - 12)
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    return generate_from_cache(model, ids, mask, cache, report, decode_graphs=graphs, **kwargs)


@pytest.mark.parametrize("name", list(POLICIES))
def test_replayed_decode_steps_generate_what_eager_steps_generate(name, tiny, page_kernel, one_thread):
    """Greedy generation of 24 tokens after a 12-token question, batch 2 with a left-padded row: the
    same tokens and the same decode-step logits (to float32 rounding: the replayed generation
    reserves its room first, so its pages are cut elsewhere), with most steps replayed (after one
    warm-up and one capture; decode-time eviction rounds run eagerly and are captured again)."""
    model, ids, mask = tiny
    eager = _generate(model, ids, mask, POLICIES[name], False)
    replayed = _generate(model, ids, mask, POLICIES[name], RecordedStep)
    counts = replayed.graphs
    print(f"{name}: eager {counts.eager}, captured {counts.captured}, replayed {counts.replayed}")
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.output.logits[1:], replayed.output.logits[1:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(replayed.cache.head_lengths(), eager.cache.head_lengths())  # the host's tables followed
    assert replayed.cache.get_seq_length() == eager.cache.get_seq_length()
    # a decode-time eviction round runs eagerly, and so does the step after it when a correction's
    # quantities are refilled from the new sums; the graph stays valid (ends and the quantities in place)
    minimum = 12 if name.startswith("decode-time eviction") else NEW_TOKENS - 4
    assert counts.captured == 1
    assert counts.replayed >= minimum and counts.eager + counts.captured + counts.replayed == NEW_TOKENS


def test_without_its_host_bookkeeping_a_replayed_step_goes_wrong(tiny, page_kernel, one_thread, monkeypatch):
    """The recorded replay is no rerun of the Python: skip the host's part of a replayed step and the
    host's tables fall behind what the buffers hold (and decode-time eviction, which the host
    decides, comes late)."""
    model, ids, mask = tiny
    policy = POLICIES["decode-time eviction"]
    eager = _generate(model, ids, mask, policy, False)
    monkeypatch.setattr(RaggedCache, "advance_replayed", lambda self: None)
    replayed = _generate(model, ids, mask, policy, RecordedStep)
    assert replayed.graphs.replayed > 0
    assert replayed.cache.get_seq_length() < eager.cache.get_seq_length()
    assert not torch.equal(replayed.cache.head_lengths(), eager.cache.head_lengths())


def test_the_cpu_kernel_sized_by_host_lengths_is_never_replayed(tiny, one_thread):
    """The runtime's own CPU choice (the live rows read in place, one call per head sized by its
    length) changes its calls at every step: every step runs eagerly, and generates the same."""
    model, ids, mask = tiny
    policy = POLICIES["keydiff+correction1"]
    eager = _generate(model, ids, mask, policy, False)
    replayed = _generate(model, ids, mask, policy, RecordedStep)
    assert (replayed.graphs.captured, replayed.graphs.replayed) == (0, 0)
    assert torch.equal(eager.sequences, replayed.sequences)


def test_decode_graphs_true_needs_a_cuda_model(tiny):
    model, ids, mask = tiny
    with pytest.raises(ValueError, match="CUDA"):
        _generate(model, ids, mask, POLICIES["uniform/keydiff"], True)
    with pytest.raises(TypeError, match="StepGraph"):
        _generate(model, ids, mask, POLICIES["uniform/keydiff"], "yes")


def test_the_recorded_replay_refuses_what_a_cuda_capture_refuses():
    """The test graph itself: a read back to the host and host data made into a tensor during the
    step are refused at capture; a step of device ops replays on its inputs' current values."""
    source = torch.arange(6.0)
    with pytest.raises(CaptureRefused, match="reads device data back"):
        RecordedStep().capture(lambda: torch.ones(int(source.sum())))
    with pytest.raises(CaptureRefused, match="outside torch's dispatcher"):
        RecordedStep().capture(lambda: source + torch.from_numpy(np.array([1.0], dtype=np.float32)))
    graph = RecordedStep()
    out = graph.capture(lambda: (source * 2).sum())
    source.add_(1)  # the step's input changes in place, as a decode step's buffers do
    graph.replay()
    assert out.item() == (source * 2).sum().item() == 42.0


@pytest.mark.slow
def test_the_flagship_on_the_embedded_model_replays_its_decode_steps(
    embedded_model, embedded_tokenizer, smoke_artifact, page_kernel, one_thread
):
    """The flagship ``inf/leverage+correction`` with the smoke artifact's budgets and correction
    orders, 75% evicted, on the real embedded model: replayed decode steps generate the same tokens
    and logits (to float32 rounding) as eager ones."""
    from runtime import load_calibration
    from runtime.plan.policy_spec import FLAGSHIP

    model = embedded_model
    calibration = load_calibration(model, embedded_tokenizer, path=smoke_artifact)
    ids = torch.randint(3, 1000, (1, 400), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    results = []
    for graphs in (False, RecordedStep):
        with ragged_attention(model):
            cache, report = compress_prompt(
                model, ids, FLAGSHIP.policy(0.75), context_columns=390, calibration=calibration
            )
        results.append(
            generate_from_cache(
                model,
                ids,
                mask,
                cache,
                report,
                decode_graphs=graphs,
                max_new_tokens=10,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        )
    eager, replayed = results
    assert replayed.graphs.replayed >= 7
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.output.logits[1:], replayed.output.logits[1:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
