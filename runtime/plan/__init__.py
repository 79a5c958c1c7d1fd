"""The plan: a policy (:mod:`~runtime.plan.policy`, :mod:`~runtime.plan.policy_spec`), an artifact read
into a :class:`~runtime.plan.calibration.Calibration`, its per-head budgets (:mod:`~runtime.plan.budgets`)
and recommendation (:mod:`~runtime.plan.recommendation`), and the two bound once per call into a
:class:`~runtime.plan.serving_plan.ServingPlan` (:func:`~runtime.plan.serving_plan.bind`) after the model's
RoPE is checked (:mod:`~runtime.plan.rope_check`).  Imports the math, the KV store and the scorers.
"""
