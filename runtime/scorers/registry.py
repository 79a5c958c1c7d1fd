"""The scorers by name: one registration line per scorer (its module under ``runtime/scorers/``
and the class that module defines)."""

from __future__ import annotations

from importlib import import_module

from .base import Scorer

REGISTERED = (
    ("expected_attention", "ExpectedAttentionScorer"),
    ("prototype_attention", "PrototypeAttentionScorer"),
    ("keydiff", "KeyDiffScorer"),
    ("snapkv", "SnapKVScorer"),
    ("knorm", "KNormScorer"),
    ("streaming", "StreamingScorer"),
    ("leverage", "LeverageScorer"),
    ("kvzip", "KVzipScorer"),
    ("learned", "LearnedScorer"),
)

SCORERS: dict[str, type[Scorer]] = {}
for _module, _class in REGISTERED:
    _scorer = getattr(import_module(f".{_module}", __package__), _class)
    SCORERS[_scorer.name] = _scorer


def make_scorer(name: str, **options) -> Scorer:
    """A scorer by name; ``options`` go to its constructor."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known scorers: {', '.join(sorted(SCORERS))}")
    try:
        return SCORERS[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options {options} for scorer {name!r}: {exc}") from None
