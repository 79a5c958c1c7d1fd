"""The profiler at user scale (issue 28): no stage holds a term that grows with the context squared,
nor one it never reads (docs/design.md "The profiler at user scale").

Every chunked computation is checked against the unchunked one (or a direct reference) on tiny
inputs, with chunks of one row and a chunk boundary at the last token; the passes that only capture
attention are checked not to compute the vocabulary logits ``[T, V]`` they never read.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from needles.probe import Probe, Span


def _direct_reconstruction_importance(query, key, context, scale):
    """KVzip's teacher from the whole causal attention matrix ``[Hq, T, T]`` at once (float64)."""
    num_q, total, _ = query.shape
    group = num_q // key.shape[0]
    keys = key.double().repeat_interleave(group, dim=0)  # [Hq, T, d]
    logits = scale * query.double() @ keys.transpose(1, 2)  # [Hq, T, T]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    weights = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    best = weights[:, context:, :context].amax(dim=1)  # [Hq, C]: over the reconstruction queries
    return best.reshape(key.shape[0], group, context).amax(dim=1).log()  # [Hkv, C]


@pytest.mark.parametrize(
    "chunk, max_logits",
    [
        (256, 2**26),  # one chunk: every reconstruction query at once
        (4, 2**26),  # 13 queries in chunks of 4: a chunk of one at the last token
        (256, 1),  # the logits bound: one query per chunk
        (256, 6 * 30 * 5),  # the bound: 5 queries over the 30 keys of 6 heads, then 3 at the end
    ],
)
def test_the_teacher_in_bounded_chunks_equals_the_whole_attention_matrix(chunk, max_logits):
    from profiler.learned_scorer import reconstruction_importance

    generator = torch.Generator().manual_seed(4)
    num_q, num_kv, total, context, dim, scale = 6, 2, 30, 17, 8, 0.4
    query = torch.randn(num_q, total, dim, generator=generator)
    key = torch.randn(num_kv, total, dim, generator=generator)
    got = reconstruction_importance(query, key, context, scale, chunk=chunk, max_logits=max_logits)
    want = _direct_reconstruction_importance(query, key, context, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _lm_head_calls(model):
    """A list that grows by one at every call of ``model``'s output head (the logits ``[B, T, V]``)."""
    calls = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: calls.append(tuple(output.shape)))
    return calls


def test_the_moments_calibration_never_computes_the_vocabulary_logits():
    from profiler.moments import measure_correction_errors_by_selection

    model = make_tiny_llama(num_layers=2, seed=3)
    calls = _lm_head_calls(model)
    windows = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    measure_correction_errors_by_selection(
        model, windows, [("leverage", "uniform"), ("keydiff", "uniform")], query_window=16, progress=False
    )
    assert calls == []


def test_the_budget_curves_never_compute_the_vocabulary_logits():
    from profiler.budget_curves import measure_curves

    model = make_tiny_llama(num_layers=2, seed=3)
    calls = _lm_head_calls(model)
    windows = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    probe = Probe("p", "hand", 80, 50.0, 0, "q?", "zebra", ids, [Span("R", 30, 34)], context_end=70)
    measure_curves(model, windows, [probe], progress=False)
    measure_curves(model, windows, [probe], answers=[[5, 6]], progress=False)
    assert calls == []
