"""The artifact's measured recommendation: which policy to serve at which compression ratio.

    calibration.policy(compression_ratio=0.75)                 # the measured best, as a CompressionPolicy
    recommended_policy(calibration, compression_ratio=0.75)    # the same

``profile-model``'s recommendation stage (or ``evaluate-artifact --write-recommendation``) runs
needle tasks the profiler never saw under candidate policies at a grid of compression ratios
and records, per ratio, the policy to serve in the artifact's ``recommendation`` section
(docs/artifact-format.md): the flagship unless paired evidence on the same tasks shows a
cheaper candidate not worse (``profiler.paired_decision``; the section also holds that evidence,
which serving does not read).  :func:`recommended_spec` serves it:

* the grid ratio nearest the asked one decides the policy (ties: the larger ratio, whose
  measurement is the stricter one); the policy then evicts exactly the asked fraction;
* with no recommendation recorded, the first of the flagship (``runtime.policy_spec.FLAGSHIP``:
  inf/leverage+correction, needs the budgets and moments sections), ``inf/leverage`` (budgets)
  and the artifact-free default (uniform leverage) that the artifact can serve;
* a recorded policy this calibration cannot serve (its section was removed since) falls back
  the same way, with a warning.

"Can serve" is :meth:`runtime.policy.CompressionPolicy.missing` coming back empty (nothing read,
nothing warned); serving the chosen policy is :func:`runtime.serving_plan.bind`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .policy import CompressionPolicy
from .policy_spec import ARTIFACT_FREE, FLAGSHIP, INF_LEVERAGE, PolicySpec, parse_policy


@dataclass(frozen=True)
class Recommendation:
    """The ``recommendation`` section: per grid compression ratio, the policy to serve."""

    compression_ratios: tuple[float, ...]  # ascending, fractions evicted
    policies: tuple[str, ...]  # policy grammar (runtime.policy_spec), one per ratio
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

    def nearest(self, compression_ratio: float) -> int:
        """Index of the grid ratio nearest ``compression_ratio`` (ties: the larger one)."""
        distances = [abs(r - compression_ratio) for r in self.compression_ratios]
        best = min(distances)
        return max(i for i, d in enumerate(distances) if d <= best + 1e-12)


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
    if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, (int, float, np.floating)):
        raise ValueError(f"compression_ratio must be a number, got {compression_ratio!r}")
    if not 0.0 <= float(compression_ratio) < 1.0:
        raise ValueError(f"compression_ratio (fraction evicted) must be in [0, 1), got {compression_ratio}")
    recommendation = getattr(calibration, "recommendation", None)
    if recommendation is None:
        return fallback_spec(calibration)
    name = recommendation.policies[recommendation.nearest(float(compression_ratio))]
    try:
        spec = parse_policy(name)  # a recorded name this runtime cannot parse is one it cannot serve
    except ValueError as exc:
        return _fall_back(calibration, name, str(exc))
    if spec.needs_reconstruction:
        return _fall_back(calibration, name, "it needs a reconstruction pass per prompt (runtime.kvzip)")
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
    """The policy the artifact measured best at (the grid ratio nearest) ``compression_ratio``,
    evicting ``compression_ratio``; the flagship when it recorded no recommendation
    (:func:`recommended_spec`).  ``Calibration.policy(compression_ratio)`` is this."""
    return recommended_spec(calibration, compression_ratio).policy(compression_ratio)
