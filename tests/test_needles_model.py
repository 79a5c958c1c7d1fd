"""The probes are well-formed for a real model: the embedded SmolLM2-135M-Instruct, reading the
whole (uncompressed) context greedily, answers `quick` retrieval probes on the simple-sentence
haystack.  The full quick measurement (all families) is benchmarks/needles_success.py."""

from __future__ import annotations

import pytest

from needles import PRESETS, answer_is_correct, generate_probes, greedy_answer


@pytest.mark.slow
def test_embedded_model_answers_quick_retrieval_probes(embedded_model, embedded_tokenizer):
    spec = PRESETS["quick"].replace(families=("retrieval",))
    assert spec.haystack == "simple"
    probes = sorted(generate_probes(spec, embedded_tokenizer), key=lambda p: (p.length, p.depth))
    assert len(probes) == 9
    # A deterministic subset from the shortest to the longest, all three depths, to keep CPU time
    # down: (1024, 10), (1024, 90), (2048, 50), (4096, 10), (4096, 90).
    subset = probes[0::2]
    results = []
    for probe in subset:
        text = greedy_answer(embedded_model, embedded_tokenizer, probe, max_new_tokens=20)
        results.append((probe.id, probe.answer, text, answer_is_correct(text, probe)))
    correct = sum(ok for *_, ok in results)
    assert correct >= 0.8 * len(subset), results
