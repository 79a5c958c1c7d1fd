"""The KV store: storage, page layout and attention kernels.

:mod:`~runtime.kv_store.cache` (the transformers cache; it stores and attends, never evicts and never
calls up), :mod:`~runtime.kv_store.segments` (the packed per-layer buffers), :mod:`~runtime.kv_store.layout`
(page tables), :mod:`~runtime.kv_store.row_state` (what a layer keeps per batch row), the kernels
(:mod:`~runtime.kv_store.layer_attention`, :mod:`~runtime.kv_store.paged_attention`,
:mod:`~runtime.kv_store.eager_attention`, :mod:`~runtime.kv_store.flex_decode`) and the transformers glue
(:mod:`~runtime.kv_store.attention_interface`, :mod:`~runtime.kv_store.transformers_compat`).  Imports
only :mod:`runtime.math` of ``runtime``.
"""
