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
    # down (9K prefill tokens): (1024, 10), (1024, 50), (1024, 90), (2048, 50), (4096, 90).
    # benchmarks/needles_success.py measures all nine (9/9 correct when written).
    subset = [probes[i] for i in (0, 1, 2, 4, 8)]
    assert [(p.length, p.depth) for p in subset] == [
        (1024, 10.0),
        (1024, 50.0),
        (1024, 90.0),
        (2048, 50.0),
        (4096, 90.0),
    ]
    results = []
    for probe in subset:
        text = greedy_answer(embedded_model, embedded_tokenizer, probe, max_new_tokens=20)
        results.append((probe.id, probe.answer, text, answer_is_correct(text, probe)))
    correct = sum(ok for *_, ok in results)
    assert correct >= 0.8 * len(subset), results
