"""The probe: one tokenized needle-in-a-haystack prompt with token-level behaviour labels.

A probe is what the profiler runs and what evaluations score.  ``input_ids`` is the whole
prompt after the model's chat template, generation prompt included.  Tokens
``[0, context_end)`` are the context (template head + haystack with the needle); tokens
``[context_end, len(input_ids))`` are the question and the rest of the template.  The same ids
serve both modes: question-aware compression sees them all, question-agnostic compression
prefills and compresses ``input_ids[:context_end]`` before the question arrives.

``spans`` label token ranges ``[start, end)`` of ``input_ids``: ``R`` retrieval-reasoning,
``B`` bias, ``D`` distraction; every token outside them is ``W`` (widespread).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

LABELS = ("W", "R", "B", "D")  # code of a label = its index here
LABEL_CODE = {name: code for code, name in enumerate(LABELS)}


@dataclass(frozen=True)
class Span:
    label: str  # "R" | "B" | "D"
    start: int  # first token (inclusive)
    end: int  # last token + 1

    def __post_init__(self):
        if self.label not in ("R", "B", "D"):
            raise ValueError(f"span label must be R, B or D, got {self.label!r}")
        if not 0 <= self.start < self.end:
            raise ValueError(f"empty or negative span [{self.start}, {self.end})")


@dataclass(frozen=True)
class Probe:
    id: str
    family: str
    length: int  # asked context length in tokens (the whole prompt lands within 2% of it)
    depth: float  # needle depth, percent of the context
    seed: int
    question: str
    answer: str
    input_ids: list[int]
    spans: list[Span]
    context_end: int  # input_ids[:context_end] is the question-free context prefix
    meta: dict = field(default_factory=dict)  # free-form extras (haystack name, slot values...)

    def __post_init__(self):
        n = len(self.input_ids)
        if not 0 < self.context_end <= n:
            raise ValueError(f"context_end {self.context_end} outside (0, {n}]")
        for span in self.spans:
            if span.end > n:
                raise ValueError(f"span {span} runs past the prompt ({n} tokens)")

    def labels(self) -> np.ndarray:
        """Per-token behaviour codes ``[len(input_ids)]`` (uint8, see ``LABELS``)."""
        codes = np.zeros(len(self.input_ids), dtype=np.uint8)
        for span in self.spans:
            codes[span.start : span.end] = LABEL_CODE[span.label]
        return codes

    def context_ids(self) -> list[int]:
        """The question-free context prefix ``input_ids[:context_end]`` (question-agnostic prefill)."""
        return self.input_ids[: self.context_end]

    def question_ids(self) -> list[int]:
        """The question part ``input_ids[context_end:]`` (question, template tail, generation prompt)."""
        return self.input_ids[self.context_end :]

    def to_json(self) -> str:
        record = asdict(self)
        record["spans"] = [asdict(span) for span in self.spans]
        return json.dumps(record, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Probe:
        record = json.loads(line)
        record["spans"] = [Span(**span) for span in record["spans"]]
        return cls(**record)
