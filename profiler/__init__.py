"""profiler: the offline calibration job behind ``profile-model``.

The job (:mod:`profiler.job`) loads the model once and runs the stages of
:mod:`profiler.stages`, one module each, every one writing one artifact section; the stage
modules hold the life cycle (settings, sharded work, reduction, the section) and call the
method modules here:

* ``behaviour`` (:mod:`profiler.stages.behaviour`) - REAL's attention-behaviour scores
  ("REtrieval-reAsoning and Logic-constructed Attention Behaviors for Long-Context KV Cache
  Compression", Eq. 1-3): :mod:`profiler.behaviour_probe` greedy-decodes one probe while
  :mod:`profiler.attention_capture` records each (layer, query head)'s dominant context token;
  :mod:`profiler.behaviour_scores` turns the records into ``W_R, W_B, W_D, W_W``, RAsc, LCsc,
  INFsc; probes come from :mod:`profiler.probe_source`.
* ``query-stats`` (:mod:`profiler.stages.query_stats`) - Expected Attention statistics
  ("Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
  Distribution", arXiv 2510.00636): ``runtime.query_moments.QueryMoments`` sums pre-RoPE
  queries of the windows of :mod:`profiler.calibration_text`.
* ``budgets`` (:mod:`profiler.stages.budgets`) - per-KV-head budget tables,
  :mod:`profiler.budget_tables`, through ``runtime.budgets`` (never re-implemented here).
* ``moments`` (:mod:`profiler.stages.moments`) - the MomentKV correction order per KV head
  ("MomentKV: Closing the Directional Gap in KV Cache Eviction for Long-Context Inference"):
  :mod:`profiler.moments_calibration`.
* ``learned-scorer`` (:mod:`profiler.stages.learned_scorer`) - a per-head token scorer
  distilled from KVzip's reconstruction importance (arXiv 2505.23416):
  :mod:`profiler.scorer_fitting`.

Around them: :mod:`profiler.checkpoint` (atomic resume work file), :mod:`profiler.distributed`
(``accelerate`` / ``torchrun`` sharding and exact reduction), :mod:`profiler.presets`,
:mod:`profiler.cli`; ``evaluate-artifact`` is :mod:`profiler.evaluate_cli` over
:mod:`profiler.evaluation`.  What a model must provide is checked by
``runtime.geometry.ModelGeometry`` (shared with the runtime).

Reproducibility: all accumulators are sums added in a fixed order per process, so an
interrupted and resumed run reproduces an uninterrupted one bit for bit; with N processes the
per-process sums are added in another order (float64, ~1e-16 relative; the float32 model
arithmetic itself also depends on the number of intra-op threads).
"""
