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
