"""The calibration stages, in the order a job runs them (see :mod:`profiler.stages.base`).

Each stage writes one artifact section; ``profile-model --stages`` picks a subset.  From the
stages' declarations come ``profile-model``'s options (:func:`option_groups`), the checks of
the settings (:func:`resolve_settings`) and of the sections each stage reads
(:func:`check_requirements`), the same for every stage.  Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from common import options as _options
from common.options import Option, Renamed

from .base import Requirement, Stage
from .behaviour import BehaviourStage
from .budget_curves import BudgetCurvesStage
from .budgets import BudgetsStage
from .context import CALIBRATION_TEXT_OPTIONS, CALIBRATION_TEXT_TITLE, PROBE_OPTIONS, PROBE_TITLE, StageContext
from .context import check_shared_settings as _check_shared_settings
from .future_queries import FutureQueriesStage
from .learned_scorer import LearnedScorerStage
from .moments import MomentsStage
from .query_stats import QueryStatsStage
from .recommendation import RecommendationStage

STAGES: tuple[type[Stage], ...] = (
    BehaviourStage,
    QueryStatsStage,
    FutureQueriesStage,
    BudgetsStage,
    BudgetCurvesStage,
    LearnedScorerStage,
    MomentsStage,  # after learned-scorer: it may select tokens with the learned scorer
    RecommendationStage,  # last: it serves the sections the others built
)
STAGE_NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)
SECTIONS: dict[str, str] = {stage.name: stage.section for stage in STAGES}


def default_stages(preset) -> tuple[str, ...]:
    """The stages a job with ``preset`` runs when ``--stages`` is not given."""
    return tuple(stage.name for stage in STAGES if stage.on_by_default(preset))


def option_groups() -> list[tuple[str, tuple[Option | Renamed, ...]]]:
    """``(title, options)`` of every ``--help`` group of settings: the shared inputs', then each stage's."""
    groups = [(CALIBRATION_TEXT_TITLE, CALIBRATION_TEXT_OPTIONS), (PROBE_TITLE, PROBE_OPTIONS)]
    groups += [(stage.options_title or f"{stage.name} stage", stage.options) for stage in STAGES if stage.options]
    return groups


def settings_options() -> tuple[Option, ...]:
    """Every setting's :class:`common.options.Option` (renamed flags left out)."""
    return tuple(option for _, group in option_groups() for option in group if isinstance(option, Option))


def resolve_settings(settings: Mapping[str, Any], preset, stage_names: Iterable[str]) -> Mapping[str, Any]:
    """Every setting's value (read-only): each given one checked against its option, the others
    their defaults; then what the shared inputs' and the chosen stages' settings must satisfy
    together.  ``ValueError`` naming the setting otherwise."""
    resolved = _options.resolve_settings(settings_options(), settings, preset)
    _check_shared_settings(resolved)
    for stage in STAGES:
        if stage.name in stage_names:
            stage.check_settings(resolved)
    return resolved


def check_requirements(stage_names: Iterable[str], settings: Mapping[str, Any], kept: Iterable[str], out) -> None:
    """Refuse (``ValueError``, naming the stage and the section) a run in which a stage reads a
    section that neither an earlier stage of the run builds nor the artifact at ``out`` keeps
    (``kept``: its section names)."""
    chosen = [stage for stage in STAGES if stage.name in set(stage_names)]
    available = set(kept)
    for stage in chosen:
        for requirement in stage.requires(settings):
            if not requirement.met_by(available):
                raise ValueError(_missing(stage, requirement, out))
        available.add(stage.section)


def _missing(stage: type[Stage], requirement: Requirement, out) -> str:
    producers = {section: name for name, section in SECTIONS.items()}
    distinct = set(requirement.alternatives)
    smallest = [sections for sections in distinct if not any(other < sections for other in distinct)]
    options = sorted(smallest, key=lambda sections: (len(sections), sorted(sections)))
    spelled = " or ".join("+".join(sorted(sections)) for sections in options) or "none"
    stages = sorted({producers.get(section, section) for sections in options for section in sections})
    return (
        f"the {stage.name} stage needs {requirement.what}, from the section(s) {spelled}: add the stage(s) that "
        f"build them ({', '.join(stages)}) to --stages before {stage.name}, or keep an artifact with them for "
        f"this model at {out}"
    )


__all__ = [
    "STAGES",
    "STAGE_NAMES",
    "SECTIONS",
    "Requirement",
    "Stage",
    "StageContext",
    "check_requirements",
    "default_stages",
    "option_groups",
    "resolve_settings",
    "settings_options",
]
