"""The ``query-stats`` stage's accumulator: :class:`runtime.query_moments.QueryMoments`, batch-summed.

Per (layer, query head) float64 sums ``n, sum q, sum q q^T`` of pre-RoPE queries over the
calibration windows, the first ``n_sink`` positions of every window skipped (see
:mod:`runtime.query_moments`).  ``QueryStatsAccumulator(L, Hq, d)`` is the batch-summed
:class:`~runtime.query_moments.QueryMoments` (``add``, ``reset``, ``merge``, ``state``,
``from_state``, ``finalize``, ``shape``, ``n``, ``total``, ``outer``).
"""

from __future__ import annotations

from runtime.geometry import ModelGeometry
from runtime.query_moments import QueryMoments

QueryStatsAccumulator = QueryMoments


def collect_queries(geometry: ModelGeometry, accumulator: QueryMoments, n_sink: int):
    """Forward hooks that add every forward pass's pre-RoPE queries (minus sink positions) to
    ``accumulator``.  Inputs must be ``[B, T]`` windows starting at position 0 without padding."""
    return accumulator.collect(geometry, n_sink=n_sink)
