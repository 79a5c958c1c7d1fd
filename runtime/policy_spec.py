"""Policies by name: the grammar the command lines, the evaluation JSON and the artifact's
``recommendation`` section write policies in, and the named policies.

    parse_policy("inf/leverage").policy(compression_ratio=0.75)       # a CompressionPolicy
    parse_policy("global/learned+correction")                          # MomentKV suffixes
    parse_policy("flagship"), parse_policy("baseline")                 # named policies

Grammar: ``baseline`` (no compression), a name in :data:`NAMED_POLICIES`, or
``ALLOCATION/SCORER[:STATISTICS][+SUFFIX]...`` with ALLOCATION in ``runtime.policy.ALLOCATIONS``,
SCORER in ``runtime.scorers.SCORERS``, STATISTICS ``calibrated|future|prompt`` (expected_attention
only) and SUFFIX in :data:`MOMENT_SUFFIXES`.  A spec carries no size: :meth:`PolicySpec.policy`
makes the :class:`runtime.policy.CompressionPolicy` for one compression ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .names import NAMED_POLICIES as NAMED_POLICY_TEXTS
from .policy import CompressionPolicy

BASELINE = "baseline"

# ``+SUFFIX`` MomentKV switches of the grammar -> CompressionPolicy fields
MOMENT_SUFFIXES = {
    "correction": {"correction": "calibrated"},  # each head's order from the artifact's moments section
    "correction0": {"correction": "order0"},
    "correction1": {"correction": "order1"},
    "moments": {"moment_eviction": True},  # moment-informed eviction, a_j ||r_j||
}


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
        (``runtime.kvzip``), so ``calibration.policy()`` cannot serve them."""
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
    if not isinstance(text, str):
        raise ValueError(f"a policy is written as text (e.g. 'inf/leverage'), got {text!r}")
    text = text.strip()
    if text == BASELINE:
        return PolicySpec(BASELINE)
    if text in NAMED_POLICIES:
        return NAMED_POLICIES[text]
    allocation, slash, rest = text.partition("/")
    if not slash or not rest:
        raise ValueError(
            f"policy {text!r} is not 'baseline', a named policy ({', '.join(NAMED_POLICIES)}) "
            "or ALLOCATION/SCORER[:STATISTICS][+SUFFIX...], e.g. uniform/keydiff, inf/leverage, "
            "global/learned+correction"
        )
    rest, *suffixes = rest.split("+")
    options = {}
    for suffix in suffixes:
        if suffix not in MOMENT_SUFFIXES:
            raise ValueError(
                f"policy {text!r}: unknown suffix +{suffix}; known: {', '.join('+' + name for name in MOMENT_SUFFIXES)}"
            )
        options.update(MOMENT_SUFFIXES[suffix])
    scorer, colon, statistics = rest.partition(":")
    spec = PolicySpec(text, allocation, scorer, statistics if colon else None, options)
    spec.policy(0.5)  # checks allocation, scorer, statistics and their combination
    return spec


# The policy served when an artifact recorded no measured recommendation (see
# runtime.recommendation): REAL's INF budgets from the artifact, Compactor's leverage scores and
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
