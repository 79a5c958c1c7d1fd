"""The compression policy: how many tokens each KV head keeps, and which ones.

    CompressionPolicy(ratio=0.25)                                   # EA, calibrated statistics
    CompressionPolicy(budget=512, allocation="inf", beta=2.0)        # REAL budgets from the artifact
    CompressionPolicy(ratio=0.5, scorer="expected_attention", statistics="prompt")
    CompressionPolicy(ratio=0.5, scorer="snapkv", scorer_options={"window": 64})

* budget: ``budget`` tokens per KV head on average, or ``ratio`` of the context (one of them);
* allocation: ``uniform`` (every head the same), ``inf`` (REAL, docs/design.md section 3: the
  artifact's per-KV-head INF weights split the total, ``beta`` and ``min_budget`` apply) or
  ``global`` (the uniform total, shared out by ranking every head's tokens together: for
  scorers whose scores are comparable across heads, e.g. ``learned``);
* scorer: a name from ``runtime.scorers.SCORERS`` or a :class:`runtime.scorers.Scorer`
  instance; ``statistics`` (``calibrated`` | ``prompt``) for ``expected_attention``;
  ``scorer_options`` go to the scorer's constructor;
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

Every field is checked when the policy is built; :meth:`CompressionPolicy.check_calibration`
says which artifact section a policy needs and fails clearly when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .budgets import allocate_budgets
from .scorers import SCORERS, Scorer, make_scorer

ALLOCATIONS = ("uniform", "inf", "global")
STATISTICS = ("calibrated", "prompt")
CORRECTIONS = ("none", "calibrated", "order0", "order1")


@dataclass(frozen=True)
class CompressionPolicy:
    budget: int | None = None
    ratio: float | None = None
    allocation: str = "uniform"
    beta: float = 2.0
    min_budget: int = 1
    scorer: str | Scorer = "expected_attention"
    statistics: str | None = None
    scorer_options: dict = field(default_factory=dict)
    n_sink: int = 4
    window: int = 32
    correction: str = "none"
    tau: float | None = None
    moment_eviction: bool = False
    moment_rounds: int = 4
    evict_every: int | None = None

    def __post_init__(self):
        if (self.budget is None) == (self.ratio is None):
            raise ValueError("give exactly one of budget (tokens per KV head) or ratio (fraction of the context)")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, (int, np.integer)):
                raise ValueError(f"budget must be an integer number of tokens, got {self.budget!r}")
            if self.budget <= 0:
                raise ValueError(f"budget must be > 0 tokens per KV head, got {self.budget}")
        if self.ratio is not None and not (0.0 < float(self.ratio) <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if self.allocation not in ALLOCATIONS:
            raise ValueError(f"unknown allocation {self.allocation!r}; known: {', '.join(ALLOCATIONS)}")
        if not self.beta >= 1.0:
            raise ValueError(f"beta must be >= 1, got {self.beta}")
        if self.min_budget < 0:
            raise ValueError(f"min_budget must be >= 0, got {self.min_budget}")
        if self.n_sink < 0 or self.window < 0:
            raise ValueError(f"n_sink and window must be >= 0, got {self.n_sink} and {self.window}")
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
        if self.tau is not None and not self.tau >= 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")
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
        if isinstance(self.moment_rounds, bool) or not isinstance(self.moment_rounds, int) or self.moment_rounds < 1:
            raise ValueError(f"moment_rounds must be a positive integer, got {self.moment_rounds!r}")
        if self.evict_every is not None and (
            isinstance(self.evict_every, bool)
            or not isinstance(self.evict_every, (int, np.integer))
            or self.evict_every < 1
        ):
            raise ValueError(f"evict_every must be a positive integer (decode steps) or None, got {self.evict_every!r}")

    @property
    def tracks_moments(self) -> bool:
        """Whether the cache must keep moment sums of the evicted tokens."""
        return self.correction != "none" or self.moment_eviction

    def correction_orders(self, calibration, num_layers: int, num_kv_heads: int):
        """Per-head correction codes int8 ``[L, Hkv]`` and ``tau`` float32 ``[L, Hkv]`` (None: no correction)."""
        if self.correction == "none":
            return None
        shape = (num_layers, num_kv_heads)
        if self.correction == "calibrated":
            orders = np.asarray(calibration.moment_orders, dtype=np.int8)
            tau = np.asarray(calibration.moment_tau, dtype=np.float32)
            if orders.shape != shape or tau.shape != shape:
                raise ValueError(f"the artifact's moments section has shape {orders.shape}, the model {shape}")
        else:
            orders = np.full(shape, 0 if self.correction == "order0" else 1, dtype=np.int8)
            tau = np.zeros(shape, dtype=np.float32)
        if self.tau is not None:
            tau = np.full(shape, self.tau, dtype=np.float32)
        return orders, tau

    def build_scorer(self) -> Scorer:
        if isinstance(self.scorer, Scorer):
            return self.scorer
        options = dict(self.scorer_options)
        if self.scorer == "expected_attention":
            if "statistics" in options and self.statistics is not None:
                raise ValueError("give statistics either as a policy field or in scorer_options, not both")
            options.setdefault("statistics", self.statistics or "calibrated")
        return make_scorer(self.scorer, **options)

    def needs_calibration(self) -> list[str]:
        """What this policy reads from an artifact (human-readable)."""
        needs = []
        if self.allocation == "inf":
            needs.append("INF budgets (section 'budgets' or 'behaviour')")
        if self.build_scorer().query_statistics == "calibrated":
            needs.append("query statistics (section 'query_stats')")
        if self.correction == "calibrated":
            needs.append("per-head correction orders (section 'moments')")
        if self.build_scorer().learned:
            needs.append("learned scorer weights (section 'learned_scorer')")
        return needs

    def check_calibration(self, calibration) -> None:
        """Raise a clear error when ``calibration`` (or its absence) cannot serve this policy."""
        needs = self.needs_calibration()
        if not needs:
            return
        if calibration is None:
            raise ValueError(
                f"policy {self.describe()} needs a calibration artifact for: {'; '.join(needs)}. "
                "Load one with runtime.load_calibration(model, tokenizer)."
            )
        if self.allocation == "inf" and calibration.inf_weights is None:
            raise ValueError(
                f"allocation='inf' needs INF scores, but {calibration.path} has neither a 'budgets' "
                f"nor a 'behaviour' section (present: {', '.join(calibration.sections) or 'none'})"
            )
        if self.build_scorer().query_statistics == "calibrated" and not calibration.has_query_stats:
            raise ValueError(
                f"expected_attention with statistics='calibrated' needs query statistics, but "
                f"{calibration.path} has no 'query_stats' section (present: "
                f"{', '.join(calibration.sections) or 'none'}); use statistics='prompt' or "
                "re-run profile-model with the query-stats stage"
            )
        if self.correction == "calibrated" and getattr(calibration, "moment_orders", None) is None:
            raise ValueError(
                f"correction='calibrated' needs per-head correction orders, but {calibration.path} has "
                f"no 'moments' section (present: {', '.join(calibration.sections) or 'none'}); use "
                "correction='order1' or re-run profile-model with the moments stage"
            )
        if self.build_scorer().learned and getattr(calibration, "scorer_weights", None) is None:
            raise ValueError(
                f"the learned scorer needs its weights, but {calibration.path} has no 'learned_scorer' section "
                f"(present: {', '.join(calibration.sections) or 'none'}); re-run profile-model with the "
                "learned-scorer stage"
            )
        if self.correction == "calibrated" and hasattr(calibration, "check_moment_selection"):
            calibration.check_moment_selection(
                self.build_scorer().name
            )  # warns once when calibrated under another scorer

    def head_budgets(
        self, seq_len: int, num_layers: int, num_kv_heads: int, inf_weights: np.ndarray | None = None
    ) -> np.ndarray:
        """Integer tokens to keep per KV head, int64 ``[L, Hkv]``, for a context of ``seq_len``."""
        average = float(self.budget) if self.budget is not None else float(self.ratio) * seq_len
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
        size = f"budget={self.budget}" if self.budget is not None else f"ratio={self.ratio}"
        extras = "".join(
            f", {name}={getattr(self, name)!r}"
            for name in ("correction", "moment_eviction", "evict_every")
            if getattr(self, name) != type(self).__dataclass_fields__[name].default
        )
        return f"CompressionPolicy({size}, allocation={self.allocation}, scorer={self.build_scorer()!r}{extras})"
