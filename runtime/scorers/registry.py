"""The scorers by name: the registration lines are :data:`common.names.SCORER_CLASSES` (a
scorer's module under ``runtime/scorers/`` and the class it defines; torch-free, so that
command-line parsers list the names without importing a scorer)."""

from __future__ import annotations

from importlib import import_module

from common.names import SCORER_CLASSES
from runtime.scorers.base import Scorer

REGISTERED = SCORER_CLASSES

SCORERS: dict[str, type[Scorer]] = {}
for _module, _class in REGISTERED:
    _scorer = getattr(import_module(f".{_module}", __package__), _class)
    if _scorer.name != _module:
        raise ImportError(
            f"runtime.scorers.{_module}.{_class} is named {_scorer.name!r}: a scorer's name is its module's"
        )
    SCORERS[_scorer.name] = _scorer


def make_scorer(name: str, **options) -> Scorer:
    """A scorer by name; ``options`` go to its constructor."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known scorers: {', '.join(sorted(SCORERS))}")
    try:
        return SCORERS[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options {options} for scorer {name!r}: {exc}") from None
