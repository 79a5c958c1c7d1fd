"""Policies by name: the grammar the command lines, the evaluation JSON and the artifact's
``recommendation`` section write policies in, and the named policies.

    parse_policy("inf/leverage").policy(compression_ratio=0.75)       # a CompressionPolicy
    parse_policy("global/learned+correction")                          # MomentKV suffixes
    parse_policy("flagship"), parse_policy("baseline")                 # named policies

Grammar: ``baseline`` (no compression), a name in :data:`NAMED_POLICIES`, or
``ALLOCATION/SCORER[:STATISTICS][+SUFFIX]...`` with ALLOCATION in ``runtime.plan.policy.ALLOCATIONS``,
SCORER in ``runtime.scorers.SCORERS``, STATISTICS ``calibrated|future|prompt`` (expected_attention
only) and SUFFIX in :data:`MOMENT_SUFFIXES`, each suffix once and one correction at most
(``common.policy_grammar``, torch-free, splits and checks the text; the artifact reader checks a
recommendation's policies with it).  A spec carries no size: :meth:`PolicySpec.policy` makes the
:class:`runtime.plan.policy.CompressionPolicy` for one compression ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.names import NAMED_POLICIES as NAMED_POLICY_TEXTS
from common.policy_grammar import BASELINE, MOMENT_SUFFIXES, split_policy
from runtime.plan.policy import CompressionPolicy

__all__ = ["BASELINE", "MOMENT_SUFFIXES", "PolicySpec", "parse_policy", "register_named_policy"]


@dataclass(frozen=True)
class PolicySpec:
    """A policy without its size: ``baseline`` or ``ALLOCATION/SCORER[:STATISTICS][+SUFFIX...]``."""

    name: str
    allocation: str | None = None  # None: the uncompressed baseline
    scorer: str | None = None
    statistics: str | None = None
    options: dict = field(default_factory=dict)  # extra CompressionPolicy fields

    @property
    def is_baseline(self) -> bool:
        return self.allocation is None

    @property
    def needs_reconstruction(self) -> bool:
        """True for ``kvzip`` policies: each prompt needs a reconstruction pass at serving
        (``runtime.compression.kvzip``), so ``calibration.policy()`` cannot serve them."""
        return self.scorer == "kvzip"

    def policy(self, compression_ratio: float) -> CompressionPolicy | None:
        """The runtime policy evicting ``compression_ratio`` of the context (None for the baseline)."""
        if self.is_baseline:
            return None
        return CompressionPolicy(
            compression_ratio=compression_ratio,
            allocation=self.allocation,
            scorer=self.scorer,
            statistics=self.statistics,
            **self.options,
        )


NAMED_POLICIES: dict[str, PolicySpec] = {}


def register_named_policy(spec: PolicySpec) -> None:
    """Give a policy a short name usable wherever a policy is typed."""
    NAMED_POLICIES[spec.name] = spec


def parse_policy(text: str) -> PolicySpec:
    """``baseline``, ``flagship``, ``uniform/keydiff``, ``inf/expected_attention:calibrated+correction``...

    Every part is checked (an unknown scorer, allocation, statistics or suffix raises ValueError
    naming the known ones).
    """
    if isinstance(text, str) and text.strip() in NAMED_POLICIES:
        return NAMED_POLICIES[text.strip()]
    parts = split_policy(text)  # the grammar, each part and combination (ValueError)
    if parts.is_baseline:
        return PolicySpec(BASELINE)
    spec = PolicySpec(parts.name, parts.allocation, parts.scorer, parts.statistics, dict(parts.options))
    spec.policy(0.5)  # the scorers check their own options again
    return spec


# The policy served when an artifact recorded no measured recommendation (see
# runtime.plan.recommendation): REAL's INF budgets from the artifact, Compactor's leverage scores and
# MomentKV correction with the artifact's per-head orders: the most accurate policy on held-out
# tasks (docs/results.md R-flagship-2026-11-22).  Its scoring costs about a sixth of the prefill
# on a CPU (R-scorer-cost-2026-11-22).  An artifact without the moments section falls back to
# INF_LEVERAGE, one without budgets to the artifact-free policy.
_FLAGSHIP = parse_policy(NAMED_POLICY_TEXTS["flagship"])  # inf/leverage+correction
FLAGSHIP = PolicySpec("flagship", _FLAGSHIP.allocation, _FLAGSHIP.scorer, _FLAGSHIP.statistics, _FLAGSHIP.options)
register_named_policy(FLAGSHIP)
# REAL's INF budgets with Compactor's leverage scores: the flagship's fallback for an artifact
# with budgets but no moments section (R-flagship-2026-11-22 measured it too).
INF_LEVERAGE = PolicySpec("inf/leverage", "inf", "leverage")
# The policy that needs no artifact (CompressionPolicy's defaults).
ARTIFACT_FREE = PolicySpec("uniform/leverage", "uniform", "leverage")
