"""profiler: the offline calibration job behind ``profile-model``.

The job (:mod:`profiler.job`) loads the model once and runs the stages of
:mod:`profiler.stages`, one module each, every one writing one artifact section.  A stage
module holds the life cycle (its options, the sections it reads, sharded work, reduction, the
section) and reads its inputs from a frozen :class:`profiler.stages.StageContext`; its method
is the module of the same name here (stage ``budget-curves``: ``profiler/stages/budget_curves.py``
and ``profiler/budget_curves.py``):

* ``behaviour`` - REAL's attention-behaviour scores ("REtrieval-reAsoning and
  Logic-constructed Attention Behaviors for Long-Context KV Cache Compression", Eq. 1-3):
  :mod:`profiler.behaviour` greedy-decodes one probe while :mod:`profiler.attention_capture`
  records each (layer, query head)'s dominant context token, and turns the records into
  ``W_R, W_B, W_D, W_W``, RAsc, LCsc, INFsc; probes come from :mod:`profiler.probe_source`.
* ``query-stats`` - Expected Attention statistics ("Expected Attention: KV Cache Compression by
  Estimating Attention from Future Queries Distribution", arXiv 2510.00636): the method is the
  runtime's (``runtime.compression.prompt_statistics.QueryMoments`` sums pre-RoPE queries of the windows of
  :mod:`profiler.calibration_text`), so there is no ``profiler/query_stats.py``.
* ``future-queries`` - the same statistics of the queries after a probe's context, and k-means
  centres of them: :mod:`profiler.future_queries`.
* ``budgets`` - per-KV-head budget tables, :mod:`profiler.budgets`, through ``runtime.plan.budgets``
  (never re-implemented here).
* ``budget-curves`` - per-head loss curves and per-ratio budgets by marginal utility (LU-KV,
  arXiv 2602.08585): :mod:`profiler.budget_curves`.
* ``learned-scorer`` - a per-head token scorer distilled from KVzip's reconstruction importance
  (arXiv 2505.23416): :mod:`profiler.learned_scorer`.
* ``moments`` - the MomentKV correction order per KV head ("MomentKV: Closing the Directional
  Gap in KV Cache Eviction for Long-Context Inference"): :mod:`profiler.moments`.
* ``recommendation`` - the best candidate policy per compression ratio on held-out needle
  tasks: :mod:`profiler.recommendation` (which candidates the sections serve, the section), over
  :mod:`profiler.evaluation` (shared with ``evaluate-artifact``).

Around them: :mod:`common.options` (every command's options, each declared once: its parser argument and its
check), :mod:`profiler.checkpoint` (atomic resume work file), :mod:`profiler.distributed`
(``accelerate`` / ``torchrun`` sharding and exact reduction), :mod:`profiler.presets`,
:mod:`profiler.cli`; ``evaluate-artifact`` is :mod:`profiler.evaluate_cli` over
:mod:`profiler.evaluation`.  What a model must provide is checked by
``runtime.math.geometry.ModelGeometry`` (shared with the runtime).

Reproducibility: all accumulators are sums added in a fixed order per process, so an
interrupted and resumed run reproduces an uninterrupted one bit for bit; with N processes the
per-process sums are added in another order (float64, ~1e-16 relative; the float32 model
arithmetic itself also depends on the number of intra-op threads).
"""
