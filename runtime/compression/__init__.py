"""Compression: the prefill (:mod:`~runtime.compression.prefill`), eviction of heads to their budgets
(:mod:`~runtime.compression.eviction`), the keep rule (:mod:`~runtime.compression.keep_rule`), the one
driver that says when eviction runs during a forward pass (:mod:`~runtime.compression.driver`), the
ragged attention function that runs a model over the cache (:mod:`~runtime.compression.ragged_attention`),
the prompt's query statistics (:mod:`~runtime.compression.prompt_statistics`) and KVzip's reconstruction
scoring (:mod:`~runtime.compression.kvzip`).  Imports the plan and everything below it.
"""
