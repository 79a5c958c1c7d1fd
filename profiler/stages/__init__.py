"""The calibration stages, in the order a job runs them (see :mod:`profiler.stages.base`).

Each stage writes one artifact section; ``profile-model --stages`` picks a subset.
"""

from __future__ import annotations

from .base import Stage
from .behaviour import BehaviourStage
from .budgets import BudgetsStage
from .learned_scorer import LearnedScorerStage
from .moments import MomentsStage
from .query_stats import QueryStatsStage

STAGES: tuple[type[Stage], ...] = (BehaviourStage, QueryStatsStage, BudgetsStage, MomentsStage, LearnedScorerStage)
STAGE_NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)
SECTIONS: dict[str, str] = {stage.name: stage.section for stage in STAGES}

__all__ = ["STAGES", "STAGE_NAMES", "SECTIONS", "Stage"]
