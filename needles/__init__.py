"""needles: REAL-style needle-in-a-haystack probes with token-level behaviour labels.

A probe (:class:`needles.probe.Probe`) is a tokenized prompt - the model's chat template around
one user message "context, blank line, question", the format :mod:`prompt_format` defines for
probes and serving alike - with its question, ground-truth answer and token spans labelled
``R`` (retrieval-reasoning: the answer), ``B`` (bias: question-related facts that are not the
answer) and ``D`` (distraction: same-shaped statements with another answer); every other
token is ``W`` (widespread).  See REAL ("REtrieval-reAsoning and Logic-constructed Attention Behaviors
for Long-Context KV Cache Compression", section 2.1) and docs/design.md section 3.

Public API::

    from needles import ProbeSpec, PRESETS, generate_probes, load_probes, answer_is_correct

    tokenizer = AutoTokenizer.from_pretrained(path)   # needles takes the tokenizer, never loads one
    spec = PRESETS["quick"].replace(families=("retrieval",), seed=3)
    probes = list(generate_probes(spec, tokenizer))
    probe = probes[0]
    probe.input_ids, probe.labels(), probe.context_end, probe.answer
    answer_is_correct("The number is 1234567.", probe)

Pieces: :mod:`needles.families` (Jinja2 needle templates in ``needles/templates/`` + slot
samplers over ``needles/data/``), :mod:`needles.haystacks` (simple / prose / files / datasets
filler), :mod:`needles.placement` (length fitting, depth, token labels via offset mapping),
:mod:`needles.spec` (grids and presets), :mod:`needles.scoring`, :mod:`needles.show`, and the
``generate-probes`` command (:mod:`needles.cli`).
"""

from needles.families import FAMILIES, RenderedNeedle, TemplateError, render_family, render_needle
from needles.haystacks import (
    DatasetHaystack,
    Haystack,
    HaystackError,
    ProseHaystack,
    SimpleHaystack,
    TextFilesHaystack,
    make_haystack,
    prose_haystack,
)
from needles.placement import LengthError, SpanError, place_needle
from needles.probe import LABELS, Probe, Span
from needles.scoring import answer_is_correct, greedy_answer, normalise
from needles.spec import PRESETS, ProbeSpec, generate_probes, load_probes, make_probe, write_probes

__all__ = [
    "FAMILIES",
    "PRESETS",
    "LABELS",
    "DatasetHaystack",
    "Haystack",
    "HaystackError",
    "LengthError",
    "Probe",
    "ProbeSpec",
    "ProseHaystack",
    "RenderedNeedle",
    "SimpleHaystack",
    "Span",
    "SpanError",
    "TemplateError",
    "TextFilesHaystack",
    "answer_is_correct",
    "generate_probes",
    "greedy_answer",
    "load_probes",
    "make_haystack",
    "make_probe",
    "normalise",
    "place_needle",
    "prose_haystack",
    "render_family",
    "render_needle",
    "write_probes",
]
