"""The ``budgets`` stage: per-KV-head budget tables from INFsc (REAL Eq. 4-6).

No model work: :func:`profiler.budget_tables.budget_tables` evaluates the runtime's own
allocation (``runtime.budgets``) on a grid of average token budgets and of ratios, from the
INFsc of this run's behaviour section or of the artifact already at the output path.
"""

from __future__ import annotations

import argparse
import math

from artifacts import Section
from profiler.arguments import RenamedOption, comma_separated, non_negative_int, number_in, positive_int
from profiler.budget_tables import (
    DEFAULT_BETA,
    DEFAULT_MIN_BUDGET,
    DEFAULT_RATIOS,
    DEFAULT_TOKEN_BUDGETS,
    budget_tables,
)

from .base import Stage


class BudgetsStage(Stage):
    name = "budgets"
    section = "budgets"
    summary = (
        "per-KV-head budget tables for a grid of average budgets from INFsc (REAL); needs the behaviour "
        "section of this run or of the artifact at --out."
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("budgets stage")
        group.add_argument(
            "--budgets",
            dest="token_budgets",
            type=comma_separated(positive_int),
            default=None,
            help=f"average token budgets per KV head (default: {','.join(map(str, DEFAULT_TOKEN_BUDGETS))})",
        )
        group.add_argument(
            "--keep-ratios",
            dest="keep_ratios",
            type=comma_separated(number_in(0.0, 1.0, low_open=True)),
            default=None,
            help="average budgets as fractions of the sequence length KEPT (default: 0.1,...,0.9)",
        )
        group.add_argument(
            "--ratios",
            action=RenamedOption,
            message="was renamed --keep-ratios (average budgets as fractions of the sequence length kept)",
        )
        group.add_argument(
            "--beta", type=number_in(1.0), default=None, help=f"REAL's beta >= 1 (default {DEFAULT_BETA:g})"
        )
        group.add_argument(
            "--min-budget",
            type=non_negative_int,
            default=None,
            help=f"smallest per-head budget (default {DEFAULT_MIN_BUDGET})",
        )

    def __init__(self, job):
        super().__init__(job)
        self.token_budgets = job.setting("token_budgets", DEFAULT_TOKEN_BUDGETS)
        self.ratios = job.setting("keep_ratios", DEFAULT_RATIOS)
        self.beta = job.setting("beta", DEFAULT_BETA)
        self.min_budget = job.setting("min_budget", DEFAULT_MIN_BUDGET)
        # the parser checks each value; this is for JobOptions built in code (before any model work)
        if not self.token_budgets or any(int(b) != b or b < 1 for b in self.token_budgets):
            raise ValueError(f"token budgets must be integers >= 1, got {self.token_budgets}")
        if not self.ratios or any(not (0.0 < float(r) <= 1.0) for r in self.ratios):
            raise ValueError(f"keep ratios must lie in (0, 1], got {self.ratios}")
        if not (math.isfinite(float(self.beta)) and float(self.beta) >= 1.0):
            raise ValueError(f"beta must be a finite number >= 1, got {self.beta}")
        if int(self.min_budget) != self.min_budget or self.min_budget < 0:
            raise ValueError(f"min_budget must be an integer >= 0, got {self.min_budget}")

    def check(self, existing: set[str]) -> None:
        if "behaviour" not in self.job.stage_names and "behaviour" not in existing:
            raise ValueError(
                f"the budgets stage needs INFsc: run the behaviour stage too, or keep an artifact "
                f"with a behaviour section for this model at {self.job.out}"
            )

    def config(self) -> dict:
        return {
            "token_budgets": sorted({int(b) for b in self.token_budgets}),
            "ratios": sorted({float(r) for r in self.ratios}),
            "beta": float(self.beta),
            "min_budget": int(self.min_budget),
            "token_seq_len": int(self.job.identity.max_position_embeddings),
        }

    def build(self, sections: dict[str, Section]) -> Section:
        arrays, attrs = budget_tables(
            sections["behaviour"]["INFsc"],
            self.job.geometry.num_kv_heads,
            max_seq_len=int(self.job.identity.max_position_embeddings),
            token_budgets=self.token_budgets,
            ratios=self.ratios,
            beta=self.beta,
            min_budget=self.min_budget,
        )
        inf_kv, budgets = arrays["inf_kv"], arrays["token_budgets"]
        detail = ""
        if len(arrays["token_tables"]):
            pick = min(1, len(budgets) - 1)
            table = arrays["token_tables"][pick]
            detail = f", b={budgets[pick]}: per-head {table.min()}..{table.max()}"
        self.say(
            f"budgets: {len(budgets)} token budgets, {len(arrays['ratios'])} ratios, beta={self.beta}, "
            f"KV-head INF weights {inf_kv.min():.3g}..{inf_kv.max():.3g} "
            f"({int((inf_kv == 0).sum())} of {inf_kv.size} zero){detail}"
        )
        return Section(arrays=arrays, attrs=attrs)
