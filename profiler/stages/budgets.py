"""The ``budgets`` stage: per-KV-head budget tables from INFsc (REAL Eq. 4-6).

No model work: :func:`profiler.budgets.budget_tables` evaluates the runtime's own
allocation (``runtime.plan.budgets``) on a grid of average token budgets and of ratios, from the
INFsc of this run's behaviour section or of the artifact already at the output path.
"""

from __future__ import annotations

from artifacts import Section
from common.command_line import MAX_TOKENS
from common.options import Integer, ListOf, Number, Option, Renamed
from profiler.budgets import (
    DEFAULT_BETA,
    DEFAULT_MIN_BUDGET,
    DEFAULT_RATIOS,
    DEFAULT_TOKEN_BUDGETS,
    budget_tables,
)

from .base import Requirement, Stage


class BudgetsStage(Stage):
    name = "budgets"
    section = "budgets"
    summary = (
        "per-KV-head budget tables for a grid of average budgets from INFsc (REAL); needs the behaviour "
        "section of this run or of the artifact at --out."
    )
    options = (
        Option(
            "--budgets",
            "token_budgets",
            ListOf(Integer(1, MAX_TOKENS)),
            DEFAULT_TOKEN_BUDGETS,
            f"average token budgets per KV head (default: {','.join(map(str, DEFAULT_TOKEN_BUDGETS))})",
        ),
        Option(
            "--keep-ratios",
            "keep_ratios",
            ListOf(Number(0.0, 1.0, low_open=True)),
            DEFAULT_RATIOS,
            "average budgets as fractions of the sequence length KEPT (default: 0.025,0.05,0.1,0.2,...,0.9)",
        ),
        Renamed("--ratios", "was renamed --keep-ratios (average budgets as fractions of the sequence length kept)"),
        Option("--beta", "beta", Number(1.0), DEFAULT_BETA, f"REAL's beta >= 1 (default {DEFAULT_BETA:g})"),
        Option(
            "--min-budget",
            "min_budget",
            Integer(0, MAX_TOKENS),
            DEFAULT_MIN_BUDGET,
            f"smallest per-head budget (default {DEFAULT_MIN_BUDGET})",
        ),
    )

    @classmethod
    def requires(cls, settings) -> tuple[Requirement, ...]:
        return (Requirement.section("behaviour", "INFsc"),)

    def __init__(self, context):
        super().__init__(context)
        self.token_budgets = context.settings["token_budgets"]
        self.ratios = context.settings["keep_ratios"]
        self.beta = context.settings["beta"]
        self.min_budget = context.settings["min_budget"]

    def config(self) -> dict:
        return {
            "token_budgets": sorted({int(b) for b in self.token_budgets}),
            "ratios": sorted({float(r) for r in self.ratios}),
            "beta": float(self.beta),
            "min_budget": int(self.min_budget),
            "token_seq_len": int(self.context.identity.max_position_embeddings),
        }

    def build(self, sections, config) -> Section:
        arrays, attrs = budget_tables(
            sections["behaviour"]["INFsc"],
            self.context.geometry.num_kv_heads,
            max_seq_len=int(self.context.identity.max_position_embeddings),
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
