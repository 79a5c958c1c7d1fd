"""The artifact's measured recommendation: which policy to serve at which compression ratio.

    calibration.policy(compression_ratio=0.75)                 # the measured best, as a CompressionPolicy
    recommended_policy(calibration, compression_ratio=0.75)    # the same

``profile-model``'s recommendation stage (or ``evaluate-artifact --write-recommendation``) runs
needle tasks the profiler never saw under candidate policies at a grid of compression ratios
and records, per ratio, the policy to serve in the artifact's ``recommendation`` section
(docs/artifact-format.md): the flagship unless paired evidence on the same tasks shows a
cheaper candidate not worse (``profiler.paired_decision``; the section also holds that evidence,
which serving does not read).  :func:`recommended_spec` serves it:

* the nearest grid ratio at or above the asked one decides the policy (a decision measured at
  least as strictly as the request); the policy then evicts exactly the asked fraction;
* a request beyond the grid's largest ratio is never served a smaller ratio's decision (a
  candidate shown not worse at 90% evicted says nothing about 97.5%): it gets the rule's
  reference, the flagship (as without a recommendation, below);
* with no recommendation recorded, the first of the flagship (``runtime.plan.policy_spec.FLAGSHIP``:
  inf/leverage+correction, needs the budgets and moments sections), ``inf/leverage`` (budgets)
  and the artifact-free default (uniform leverage) that the artifact can serve;
* a recorded policy this calibration cannot serve falls back the same way, with a warning: the
  artifact reader refuses a file whose recommendation names such a policy (one that does not
  parse, ``baseline``, a ``kvzip`` policy, or one needing a section the file lacks), so this only
  happens to a ``Recommendation`` set on a calibration by hand.

"Can serve" is :meth:`runtime.plan.policy.CompressionPolicy.missing` coming back empty (nothing read,
nothing warned); serving the chosen policy is :func:`runtime.plan.serving_plan.bind`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from common.checks import is_number
from runtime.plan.policy import CompressionPolicy
from runtime.plan.policy_spec import ARTIFACT_FREE, FLAGSHIP, INF_LEVERAGE, PolicySpec, parse_policy


@dataclass(frozen=True)
class Recommendation:
    """The ``recommendation`` section: per grid compression ratio, the policy to serve."""

    compression_ratios: tuple[float, ...]  # ascending, fractions evicted
    policies: tuple[str, ...]  # policy grammar (runtime.plan.policy_spec), one per ratio
    accuracy: tuple[float, ...]  # of that policy on the held-out tasks
    ci_low: tuple[float, ...]  # 95% Wilson interval
    ci_high: tuple[float, ...]
    tasks: int  # n: held-out tasks per cell
    baseline_accuracy: float  # the uncompressed model on the same tasks

    @classmethod
    def from_section(cls, arrays: dict, attrs: dict) -> Recommendation:
        order = np.argsort(np.asarray(arrays["compression_ratios"], dtype=np.float64))

        def column(name):
            return tuple(float(x) for x in np.asarray(arrays[name], dtype=np.float64)[order])

        names = [arrays["policy"][i] for i in order]
        return cls(
            compression_ratios=column("compression_ratios"),
            policies=tuple(n.decode("ascii") if isinstance(n, bytes) else str(n) for n in names),
            accuracy=column("accuracy"),
            ci_low=column("ci_low"),
            ci_high=column("ci_high"),
            tasks=int(attrs["tasks"]),
            baseline_accuracy=float(attrs["baseline_accuracy"]),
        )

    def deciding_index(self, compression_ratio: float) -> int | None:
        """Index of the grid ratio whose decision serves ``compression_ratio``: the smallest grid ratio
        at or above it (1e-9 absolute slack for a ratio typed as a decimal); None beyond the grid."""
        at_or_above = [i for i, r in enumerate(self.compression_ratios) if r >= compression_ratio - 1e-9]
        return at_or_above[0] if at_or_above else None


def fallback_spec(calibration) -> PolicySpec:
    """The first of the flagship, ``inf/leverage`` and the artifact-free default that ``calibration``
    can serve (the artifact-free default when there is no calibration)."""
    if calibration is None:
        return ARTIFACT_FREE
    for spec in (FLAGSHIP, INF_LEVERAGE):
        if not spec.policy(0.5).missing(calibration):
            return spec
    return ARTIFACT_FREE


def recommended_spec(calibration, compression_ratio: float) -> PolicySpec:
    """The policy to serve at ``compression_ratio`` with ``calibration`` (see the module docstring)."""
    if not is_number(compression_ratio):  # np.int64(0) and np.float32(0.5) are numbers; True is not
        raise ValueError(f"compression_ratio must be a number, got {compression_ratio!r}")
    if not 0.0 <= float(compression_ratio) < 1.0:
        raise ValueError(f"compression_ratio (fraction evicted) must be in [0, 1), got {compression_ratio}")
    recommendation = getattr(calibration, "recommendation", None)
    if recommendation is None:
        return fallback_spec(calibration)
    index = recommendation.deciding_index(float(compression_ratio))
    if index is None:  # beyond the measured grid: no evidence against the reference
        return fallback_spec(calibration)
    name = recommendation.policies[index]
    try:
        spec = parse_policy(name)  # a recorded name this runtime cannot parse is one it cannot serve
    except ValueError as exc:
        return _fall_back(calibration, name, str(exc))
    if spec.is_baseline:  # a reader refuses a file recommending it; a hand-made recommendation may
        return _fall_back(calibration, name, "'baseline' compresses nothing: it is measured, never recommended")
    if spec.needs_reconstruction:
        return _fall_back(calibration, name, "it needs a reconstruction pass per prompt (runtime.compression.kvzip)")
    missing = spec.policy(float(compression_ratio)).missing(calibration)
    if missing:
        return _fall_back(calibration, name, missing[0])
    return spec


def _fall_back(calibration, name: str, reason: str) -> PolicySpec:
    fallback = fallback_spec(calibration)
    warnings.warn(
        f"{calibration.path}: the recommended policy {name!r} cannot be served ({reason}); using {fallback.name}",
        stacklevel=4,
    )
    return fallback


def recommended_policy(calibration, compression_ratio: float) -> CompressionPolicy:
    """The policy the artifact's recommendation serves at ``compression_ratio`` (decided at the nearest
    grid ratio at or above it), evicting ``compression_ratio``; the flagship when it recorded no
    recommendation or the request lies beyond its grid (:func:`recommended_spec`).
    ``Calibration.policy(compression_ratio)`` is this."""
    return recommended_spec(calibration, compression_ratio).policy(compression_ratio)
