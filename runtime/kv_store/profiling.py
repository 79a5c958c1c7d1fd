"""Labels for ``torch.profiler``, entered only while a profiler records.

``torch.profiler.record_function`` costs about 50 microseconds even when nothing records (measured
on this project's CPU, torch 2.6 and 2.13): at every decode step of every layer that was 2-5% of a
batch-1 step of the embedded model.  :func:`label` checks first whether a profiler is on
(``torch.autograd._profiler_enabled()``, a tenth of a microsecond), so ``benchmarks/runtime_perf.py``
still splits a step into ``kvcal.attention``, ``kvcal.correction`` and ``kvcal.eviction``, and
``benchmarks/gpu_serving.py`` a prefill into those and ``kvcal.chunk_mass`` (Compactor's chunked
attention, accumulated while each layer attends) and ``kvcal.scoring`` (the scorer's part of an
eviction).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

_NOTHING = nullcontext()


def label(name: str) -> AbstractContextManager:
    """``with label("kvcal.attention"):`` a ``record_function`` range while a profiler records, else nothing."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NOTHING
