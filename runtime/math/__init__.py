"""The math under the runtime, with no state of its own: MomentKV's evicted-set sums and corrected
merge (:mod:`~runtime.math.momentkv`), RoPE rotations (:mod:`~runtime.math.rope`), a model's attention
geometry (:mod:`~runtime.math.geometry`), Compactor's chunked attention (:mod:`~runtime.math.chunk_attention`)
and the host/device table conversions (:mod:`~runtime.math.arrays`).  Imports nothing else of ``runtime``.
"""
