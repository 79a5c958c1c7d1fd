"""profiler: the offline calibration job behind ``profile-model`` (DESIGN.md sections 1, 3, 5).

Stages and the modules that implement them:

* ``behaviour`` - REAL's attention-behaviour matrix (seed 004, Eq. 1-3).
  :mod:`profiler.attention_capture` records, at every generated token, each (layer, query
  head)'s dominant context token and its weight next to an unchanged fused ``sdpa`` forward;
  :mod:`profiler.behaviour_scores` accumulates ``W_R, W_B, W_D, W_W`` and derives RAsc, LCsc,
  INFsc; :mod:`profiler.behaviour_stage` runs one probe (greedy ``generate()``).
* ``query-stats`` - Expected Attention statistics (seed 000): :mod:`profiler.query_stats`
  hooks ``q_proj`` (or ``q_norm``) and keeps float64 sums ``n, sum q, sum q q^T`` per head,
  skipping ``n_sink`` leading tokens per window of :mod:`profiler.calibration_text`.
* ``budgets`` - per-KV-head budget tables, :mod:`profiler.budget_tables`, through
  ``runtime.budgets`` (the allocation is never re-implemented here).
* ``moments`` - the MomentKV correction order per KV head: :mod:`profiler.moments_calibration`
  compresses calibration windows and keeps, per head, the order (none, 0 or 1) with the
  smallest attention-output error.

Around them: :mod:`profiler.job` (orchestration, section building, keeping sections of an
existing artifact), :mod:`profiler.checkpoint` (atomic resume work file),
:mod:`profiler.distributed` (``accelerate`` / ``torchrun`` sharding and exact reduction),
:mod:`profiler.presets`, :mod:`profiler.probe_source`, :mod:`profiler.cli`.  What a model must
provide is checked by ``runtime.geometry.ModelGeometry`` (shared with the runtime).

Reproducibility: all accumulators are sums added in a fixed order per process, so an
interrupted and resumed run reproduces an uninterrupted one bit for bit; with N processes the
per-process sums are added in another order (float64, ~1e-16 relative; the float32 model
arithmetic itself also depends on the number of intra-op threads).
"""
