"""The calibration stages, in the order a job runs them (see :mod:`profiler.stages.base`).

Each stage writes one artifact section; ``profile-model --stages`` picks a subset.
"""

from __future__ import annotations

from .base import Stage
from .behaviour import BehaviourStage
from .budget_curves import BudgetCurvesStage
from .budgets import BudgetsStage
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


__all__ = ["STAGES", "STAGE_NAMES", "SECTIONS", "Stage", "default_stages"]
