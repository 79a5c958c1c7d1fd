"""The compression policy: how many tokens each KV head keeps, and which ones.

    CompressionPolicy(compression_ratio=0.75)                       # evict 75%: uniform leverage, no artifact
    CompressionPolicy(budget=512, allocation="inf", beta=2.0)        # REAL budgets from the artifact
    CompressionPolicy(keep_ratio=0.5, scorer="expected_attention", statistics="prompt")
    CompressionPolicy(compression_ratio=0.5, scorer="snapkv", scorer_options={"window": 64})
    CompressionPolicy(compression_ratio=0.75, allocation="inf").missing(calibration)  # [] when servable

* size, exactly one of: ``compression_ratio`` (the fraction of the context's cache evicted, as
  kvpress and the literature use it: 0.75 keeps a quarter), ``keep_ratio`` (the fraction kept,
  ``1 - compression_ratio``) or ``budget`` (tokens per KV head on average).  The old ``ratio=``
  (a kept fraction) is refused with a message naming both;
* allocation: ``uniform`` (every head the same), ``inf`` (REAL, docs/design.md section 3: the
  artifact's per-KV-head INF weights split the total, ``beta`` and ``min_budget`` apply),
  ``global`` (the uniform total, shared out by ranking every head's tokens together: for
  scorers whose scores are comparable across heads, e.g. ``learned``) or ``curve`` (the
  artifact's ``budget_curves`` section: per compression ratio, per-head kept fractions
  allocated by marginal utility on measured loss curves, LU-KV arXiv 2602.08585, interpolated
  between its grid ratios; ``min_budget`` applies, ``beta`` does not);
* scorer: a name from ``runtime.scorers.SCORERS`` or a :class:`runtime.scorers.Scorer`
  instance (default ``leverage``: Compactor's scores need no artifact and measured best of the
  artifact-free scorers, see :data:`DEFAULT_SCORER`); ``statistics`` (``calibrated``: the
  artifact's query statistics of calibration text | ``future``: of the queries after the context of
  needle probes, section ``future_queries`` | ``prompt``: the prompt's own) for ``expected_attention``;
  ``prototype_attention`` reads the ``future_queries`` centres;
  ``scorer_options`` go to the scorer's constructor (``leverage``'s ``blend`` defaults to the
  compression ratio, as kvpress's CompactorPress sets it);
* ``n_sink`` first tokens and the last ``window`` tokens of every head are always kept;
* MomentKV (docs/design.md section 4; the cache then keeps per-head moments of what it evicted):
  ``correction`` = ``none`` | ``calibrated`` (each head's order from the artifact's
  ``moments`` section, measured under one selection scorer: serving them with another one
  warns once) | ``order0`` | ``order1`` (every head); ``tau`` clamps the
  cross-covariance (None: the artifact's per-head value for ``calibrated``, else 0);
  ``moment_eviction`` scores ``a_j ||r_j||`` in ``moment_rounds`` rounds (scorers that
  estimate attention: expected_attention, snapkv);
* ``evict_every``: also evict while decoding, whenever a head has grown that many tokens past
  its budget (1 = every step); None = only the prompt is compressed.

Every field is checked when the policy is built.  A policy is a plain value: it states what it
reads from an artifact (:meth:`CompressionPolicy.requirements`, from the one table
:data:`REQUIREMENTS`) and says what a calibration lacks to serve it
(:meth:`CompressionPolicy.missing`); serving it with a calibration and a model is
:func:`runtime.plan.serving_plan.bind`'s job, which loads and checks what it needs once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass, field

import numpy as np

from common.checks import check_flag, check_integer, check_number, is_number
from common.names import ALLOCATIONS, CORRECTIONS, STATISTICS
from common.policy_grammar import sections_for
from runtime.plan.budgets import allocate_budgets, curve_row
from runtime.scorers import SCORERS, QueryCentres, Scorer, make_scorer, query_statistics

# The scorer of a policy that names none: Compactor's leverage + chunked attention needs no
# artifact and kept the most of the artifact-free scorers on needle probes; calibrated Expected
# Attention, the old default, kept none from 75% on (docs/results.md R-leverage-36-probes-2026-11-22).
DEFAULT_SCORER = "leverage"
RATIO_RENAMED = (
    "CompressionPolicy(ratio=...) was the fraction of the context KEPT; it is now spelled "
    "keep_ratio=... (kept) or compression_ratio=... (evicted, as kvpress uses it): ratio=0.25 is "
    "keep_ratio=0.25, i.e. compression_ratio=0.75"
)


def _present(calibration) -> str:
    return ", ".join(calibration.sections) or "none"


def _future_reader(scorer: Scorer) -> str:
    return repr(scorer) if QueryCentres() in scorer.needs else "expected_attention with statistics='future'"


@dataclass(frozen=True)
class Requirement:
    """One thing a policy can read from an artifact: its ``section``, whether a calibration ``held``
    it, and the sentence saying what is ``absent`` when it does not (naming the file, the sections
    present and a remedy).  Which policy needs it is :func:`common.policy_grammar.sections_for`'s."""

    section: str
    need: str  # for people: what it is and where it lives
    held: Callable[[object], bool]
    absent: Callable[[CompressionPolicy, Scorer, object], str]


# What a policy can read from an artifact, one entry per section of common.policy_grammar.SECTION_ORDER
# (which policy needs which is common.policy_grammar.sections_for's); runtime.plan.serving_plan.bind
# loads each with its loader.
REQUIREMENTS = (
    Requirement(
        "budgets",
        "INF budgets (section 'budgets' or 'behaviour')",
        held=lambda calibration: calibration.inf_weights is not None,
        absent=lambda policy, scorer, calibration: (
            f"allocation='inf' needs INF scores, but {calibration.path} has neither a 'budgets' "
            f"nor a 'behaviour' section (present: {_present(calibration)})"
        ),
    ),
    Requirement(
        "budget_curves",
        "budget curves (section 'budget_curves')",
        held=lambda calibration: getattr(calibration, "budget_curve", None) is not None,
        absent=lambda policy, scorer, calibration: (
            f"allocation='curve' needs per-head budget curves, but {calibration.path} has no 'budget_curves' "
            f"section (present: {_present(calibration)}); re-run profile-model with the "
            "budget-curves stage, or use allocation='inf'"
        ),
    ),
    Requirement(
        "query_stats",
        "query statistics (section 'query_stats')",
        held=lambda calibration: calibration.has_query_stats,
        absent=lambda policy, scorer, calibration: (
            f"expected_attention with statistics='calibrated' needs query statistics, but "
            f"{calibration.path} has no 'query_stats' section (present: "
            f"{_present(calibration)}); use statistics='prompt' or "
            "re-run profile-model with the query-stats stage"
        ),
    ),
    Requirement(
        "future_queries",
        "future-query statistics (section 'future_queries')",
        held=lambda calibration: getattr(calibration, "has_future_queries", False),
        absent=lambda policy, scorer, calibration: (
            f"{_future_reader(scorer)} needs the statistics of the queries after a probe's context, but "
            f"{calibration.path} has no 'future_queries' section (present: {_present(calibration)}); re-run "
            "profile-model with the future-queries stage"
        ),
    ),
    Requirement(
        "moments",
        "per-head correction orders (section 'moments')",
        held=lambda calibration: getattr(calibration, "moment_orders", None) is not None,
        absent=lambda policy, scorer, calibration: (
            f"correction='calibrated' needs per-head correction orders, but {calibration.path} has "
            f"no 'moments' section (present: {_present(calibration)}); use "
            "correction='order1' or re-run profile-model with the moments stage"
        ),
    ),
    Requirement(
        "learned_scorer",
        "learned scorer weights (section 'learned_scorer')",
        held=lambda calibration: getattr(calibration, "scorer_weights", None) is not None,
        absent=lambda policy, scorer, calibration: (
            f"the learned scorer needs its weights, but {calibration.path} has no 'learned_scorer' section "
            f"(present: {_present(calibration)}); re-run profile-model with the "
            "learned-scorer stage"
        ),
    ),
)

_REQUIREMENT = {requirement.section: requirement for requirement in REQUIREMENTS}


@dataclass(frozen=True)
class CompressionPolicy:
    budget: int | None = None
    compression_ratio: float | None = None
    keep_ratio: float | None = None
    allocation: str = "uniform"
    beta: float = 2.0
    min_budget: int = 1
    scorer: str | Scorer = DEFAULT_SCORER
    statistics: str | None = None
    scorer_options: dict = field(default_factory=dict)
    n_sink: int = 4
    window: int = 32
    correction: str = "none"
    tau: float | None = None
    moment_eviction: bool = False
    moment_rounds: int = 4
    evict_every: int | None = None
    ratio: InitVar[float | None] = None  # the old spelling, refused (RATIO_RENAMED)

    def __post_init__(self, ratio):
        if ratio is not None:
            raise TypeError(RATIO_RENAMED)
        given = [name for name in ("budget", "compression_ratio", "keep_ratio") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of compression_ratio (fraction of the context evicted), keep_ratio (fraction "
                f"kept) or budget (tokens per KV head); got {', '.join(given) or 'none'}"
            )
        for name in ("compression_ratio", "keep_ratio"):
            value = getattr(self, name)
            if value is not None:
                if not is_number(value):  # np.int64(0) and np.float32(0.5) are numbers; True is not
                    raise ValueError(f"{name} must be a number, got {value!r}")
                object.__setattr__(self, name, float(value))
        if self.compression_ratio is not None and not (0.0 <= float(self.compression_ratio) < 1.0):
            raise ValueError(f"compression_ratio (fraction evicted) must be in [0, 1), got {self.compression_ratio}")
        if self.keep_ratio is not None and not (0.0 < float(self.keep_ratio) <= 1.0):
            raise ValueError(f"keep_ratio (fraction kept) must be in (0, 1], got {self.keep_ratio}")
        if self.budget is not None:
            check_integer("budget (tokens per KV head)", self.budget, minimum=1)
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {self.allocation!r}; known: {', '.join(ALLOCATIONS)}")
        check_number("beta", self.beta, minimum=1.0)
        check_integer("min_budget", self.min_budget, minimum=0)
        check_integer("n_sink", self.n_sink, minimum=0)
        check_integer("window", self.window, minimum=0)
        check_flag("moment_eviction", self.moment_eviction)
        if isinstance(self.scorer, str):
            if self.scorer not in SCORERS:
                raise ValueError(f"unknown scorer {self.scorer!r}; known scorers: {', '.join(sorted(SCORERS))}")
        elif not isinstance(self.scorer, Scorer):
            raise ValueError(f"scorer must be a name ({', '.join(sorted(SCORERS))}) or a Scorer, got {self.scorer!r}")
        if self.statistics is not None:
            if self.statistics not in STATISTICS:
                raise ValueError(f"unknown statistics {self.statistics!r}; known: {', '.join(STATISTICS)}")
            if self.scorer != "expected_attention":
                raise ValueError("statistics applies to the expected_attention scorer only")
        scorer = self.build_scorer()  # options are checked by the scorer's constructor
        if self.correction not in CORRECTIONS:
            raise ValueError(f"unknown correction {self.correction!r}; known: {', '.join(CORRECTIONS)}")
        if self.tau is not None:
            check_number("tau", self.tau, minimum=0.0)
        if self.moment_eviction and not scorer.yields_attention:
            raise ValueError(
                f"moment_eviction needs a scorer that estimates attention (expected_attention, snapkv), not {scorer!r}"
            )
        if self.allocation == "global" and not scorer.comparable:
            raise ValueError(
                f"allocation='global' ranks all heads' tokens together: it needs a scorer whose scores are "
                f"comparable across heads (learned), not {scorer!r}"
            )
        if self.allocation == "global" and self.moment_eviction:
            raise ValueError("allocation='global' and moment_eviction cannot be combined")
        check_integer("moment_rounds", self.moment_rounds, minimum=1)
        if self.evict_every is not None:
            check_integer("evict_every", self.evict_every, minimum=1)  # decode steps; None: only the prompt

    @property
    def kept_fraction(self) -> float | None:
        """The fraction of the context each head keeps on average (None for a token budget)."""
        if self.keep_ratio is not None:
            return float(self.keep_ratio)
        if self.compression_ratio is not None:
            return 1.0 - float(self.compression_ratio)
        return None

    @property
    def evicted_fraction(self) -> float | None:
        """``1 - kept_fraction``: the compression ratio (None for a token budget)."""
        kept = self.kept_fraction
        return None if kept is None else 1.0 - kept

    @property
    def tracks_moments(self) -> bool:
        """Whether the cache must keep moment sums of the evicted tokens."""
        return self.correction != "none" or self.moment_eviction

    def build_scorer(self) -> Scorer:
        if isinstance(self.scorer, Scorer):
            return self.scorer
        return make_scorer(self.scorer, **self.scorer_arguments())

    def scorer_arguments(self) -> dict:
        """The options the registered scorer ``self.scorer`` (a name) is built with: the policy's
        ``scorer_options`` and what the policy adds to them."""
        options = dict(self.scorer_options)
        if self.scorer == "leverage" and self.evicted_fraction is not None:
            options.setdefault("blend", round(self.evicted_fraction, 6))  # kvpress CompactorPress's choice
        if self.scorer == "expected_attention":
            if "statistics" in options and self.statistics is not None:
                raise ValueError("give statistics either as a policy field or in scorer_options, not both")
            options.setdefault("statistics", self.statistics or "calibrated")
        return options

    def scores_key(self) -> tuple | None:
        """Equal for two policies whose scorers compute the same score parts of a cache under one
        calibration (the same registered scorer, built with the same ``parts_options``: leverage
        scorers that differ only in their blend share them), so that the parts computed once serve
        both (``runtime.compression.prefill.shared_scores``); None when that cannot be told (a ``Scorer``
        instance) or the scores depend on the eviction (``moment_eviction``)."""
        if isinstance(self.scorer, Scorer) or self.moment_eviction:
            return None
        parts = SCORERS[self.scorer].parts_options(self.scorer_arguments())
        return (self.scorer, repr(sorted(parts.items())))

    def requirements(self, scorer: Scorer | None = None) -> list[Requirement]:
        """What this policy reads from an artifact, in :data:`REQUIREMENTS`' order (``scorer``: this
        policy's, when already built)."""
        scorer = self.build_scorer() if scorer is None else scorer
        needs = sections_for(self.allocation, scorer.name, query_statistics(scorer), self.correction)
        return [_REQUIREMENT[need[0]] for need in needs]

    def needs_calibration(self) -> list[str]:
        """What this policy reads from an artifact (human-readable)."""
        return [requirement.need for requirement in self.requirements()]

    def missing(self, calibration, scorer: Scorer | None = None) -> list[str]:
        """Why ``calibration`` (None: no artifact) cannot serve this policy: one sentence per
        missing piece, each naming its section and the remedy; empty when it can.  Nothing is
        read, nothing warns: :func:`runtime.plan.serving_plan.bind` serves (and refuses with the first).
        ``scorer``: this policy's, when already built."""
        scorer = self.build_scorer() if scorer is None else scorer
        requirements = self.requirements(scorer)
        if not requirements:
            return []
        if calibration is None:
            return [
                f"policy {self.describe()} needs a calibration artifact for: "
                f"{'; '.join(requirement.need for requirement in requirements)}. "
                "Load one with runtime.load_calibration(model, tokenizer)."
            ]
        return [
            requirement.absent(self, scorer, calibration)
            for requirement in requirements
            if not requirement.held(calibration)
        ]

    def head_budgets(
        self,
        seq_len: int,
        num_layers: int,
        num_kv_heads: int,
        inf_weights: np.ndarray | None = None,
        curve: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Integer tokens to keep per KV head, int64 ``[L, Hkv]``, for a context of ``seq_len``.

        ``inf_weights``: the artifact's ``[L, Hkv]`` INF weights (allocation ``inf``); ``curve``:
        its budget curve ``(compression_ratios [NR], fractions [NR, L, Hkv])`` (allocation
        ``curve``, ``Calibration.budget_curve``).  The total is ``round(average x L x Hkv)`` exactly
        (within what ``[min_budget, seq_len]`` per head allows).
        """
        average = float(self.budget) if self.budget is not None else self.kept_fraction * seq_len
        if self.allocation == "curve":
            if curve is None:
                raise ValueError("allocation='curve' needs the artifact's budget curve (section 'budget_curves')")
            ratios, fractions = curve
            if np.asarray(fractions).shape[1:] != (num_layers, num_kv_heads):
                raise ValueError(
                    f"the budget curve has shape {np.asarray(fractions).shape[1:]}, the model "
                    f"[{num_layers}, {num_kv_heads}] KV heads"
                )
            keep = min(max(average, 1e-9) / seq_len, 1.0)
            row = curve_row(ratios, fractions, keep)
            total = float(row.sum())
            weights = row / total if total > 0 else np.full(row.shape, 1.0 / row.size)
            # beta = 1: each head's ideal budget is its share of the total, row[h] x seq_len
            return allocate_budgets(weights, max(average, 1e-9), seq_len, beta=1.0, min_budget=self.min_budget)
        if self.allocation == "inf":
            if inf_weights is None:
                raise ValueError("allocation='inf' needs the artifact's INF weights")
            weights = np.asarray(inf_weights, dtype=np.float64)
            if weights.shape != (num_layers, num_kv_heads):
                raise ValueError(
                    f"INF weights have shape {weights.shape}, the model has [{num_layers}, {num_kv_heads}] KV heads"
                )
        else:
            weights = np.full((num_layers, num_kv_heads), 1.0 / (num_layers * num_kv_heads))
        return allocate_budgets(weights, max(average, 1e-9), seq_len, beta=self.beta, min_budget=self.min_budget)

    def describe(self) -> str:
        size = (
            f"budget={self.budget}"
            if self.budget is not None
            else f"compression_ratio={round(self.evicted_fraction, 6):g}"
        )
        extras = "".join(
            f", {name}={getattr(self, name)!r}"
            for name in ("correction", "moment_eviction", "evict_every")
            if getattr(self, name) != type(self).__dataclass_fields__[name].default
        )
        return f"CompressionPolicy({size}, allocation={self.allocation}, scorer={self.build_scorer()!r}{extras})"
