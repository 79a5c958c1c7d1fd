"""The entry points: :func:`~runtime.serve.generation.compress_prompt`, :func:`~runtime.serve.generation.generate`
and :func:`~runtime.serve.generation.answer` (:mod:`~runtime.serve.generation`), what they let through to
``model.generate`` (:mod:`~runtime.serve.generate_options`), and decode steps replayed from CUDA graphs
(:mod:`~runtime.serve.decode_graph`).  What users import is re-exported by ``runtime``.
"""
