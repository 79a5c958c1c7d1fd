"""Evaluation results: the policy grammar, accuracy intervals, the recommendation, output.

Pure data and arithmetic (no model): ``profiler.evaluation`` fills these records by running
the model; this module defines what they mean.  The JSON layout is documented in
``docs/evaluation-format.md`` and versioned by ``EVALUATION_SCHEMA``.

Ratios here are **compression** ratios, the fraction of the context's cache that is evicted
(0.75 keeps a quarter), as in kvpress tables.  ``CompressionPolicy.ratio`` is the fraction
*kept*; :meth:`PolicySpec.policy` converts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EVALUATION_SCHEMA = "kvcal-evaluation/1"
BASELINE = "baseline"


@dataclass(frozen=True)
class PolicySpec:
    """A named policy: ``baseline`` or ``ALLOCATION/SCORER[:STATISTICS][+MOMENTS...]`` plus options."""

    name: str
    allocation: str | None = None  # None: the uncompressed baseline
    scorer: str | None = None
    statistics: str | None = None
    options: dict = field(default_factory=dict)  # extra CompressionPolicy fields

    @property
    def is_baseline(self) -> bool:
        return self.allocation is None

    def policy(self, compression: float):
        """The runtime policy evicting ``compression`` of the context (None for the baseline)."""
        if self.is_baseline:
            return None
        from runtime import CompressionPolicy

        if not 0.0 <= compression < 1.0:
            raise ValueError(f"compression ratio must be in [0, 1), got {compression}")
        return CompressionPolicy(
            ratio=1.0 - compression,
            allocation=self.allocation,
            scorer=self.scorer,
            statistics=self.statistics,
            **self.options,
        )


# ``+SUFFIX`` MomentKV switches of the policy grammar -> CompressionPolicy fields
MOMENT_SUFFIXES = {
    "correction": {"correction": "calibrated"},  # each head's order from the artifact's moments section
    "correction0": {"correction": "order0"},
    "correction1": {"correction": "order1"},
    "moments": {"moment_eviction": True},  # moment-informed eviction, a_j ||r_j||
}


def parse_policy(text: str) -> PolicySpec:
    """``baseline``, ``uniform/keydiff``, ``inf/expected_attention:calibrated+moments+correction``... (checked).

    Grammar: ``ALLOCATION/SCORER[:STATISTICS][+SUFFIX]...`` with SUFFIX in
    :data:`MOMENT_SUFFIXES`, or a name registered with :func:`register_named_policy`.
    """
    from runtime import CompressionPolicy

    text = text.strip()
    if text == BASELINE:
        return PolicySpec(BASELINE)
    if text in NAMED_POLICIES:
        return NAMED_POLICIES[text]
    allocation, slash, rest = text.partition("/")
    if not slash or not rest:
        raise ValueError(
            f"policy {text!r} is not 'baseline', a named policy ({', '.join(NAMED_POLICIES)}) "
            "or ALLOCATION/SCORER[:STATISTICS][+SUFFIX...], e.g. uniform/keydiff, "
            "inf/expected_attention:calibrated+correction"
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
    CompressionPolicy(
        ratio=0.5, allocation=spec.allocation, scorer=spec.scorer, statistics=spec.statistics, **spec.options
    )
    return spec


NAMED_POLICIES: dict[str, PolicySpec] = {}


def register_named_policy(spec: PolicySpec) -> None:
    """Give a policy with options a short name usable on the command line."""
    NAMED_POLICIES[spec.name] = spec


# The policy we recommend serving with, chosen by measurement (benchmarks/runtime_quality.py,
# embedded model, retrieval + multi-key, question-agnostic): REAL's INF budgets from the
# artifact, KeyDiff selection (question-agnostic and attention-free, so it keeps a needle's
# whole digit span where attention estimates keep only its first tokens), and the MomentKV
# correction with each head's order from the artifact's moments section.
FLAGSHIP = PolicySpec("flagship", "inf", "keydiff", None, {"correction": "calibrated"})
register_named_policy(FLAGSHIP)


def wilson_interval(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (``(0, 1)`` when ``total`` is 0)."""
    if total <= 0:
        return 0.0, 1.0
    p = correct / total
    denominator = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denominator
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)


def recommend(baseline_accuracy: float, results: list[dict], tolerance: float = 0.02) -> dict:
    """The cheapest policy/ratio whose accuracy is within ``tolerance`` of the baseline.

    Cheapest = highest compression ratio; ties go to the higher accuracy, then the fewer KV
    bytes held, then the policy name.  ``tolerance`` is in accuracy units (0.02 = 2 points).
    """
    floor = baseline_accuracy - tolerance
    candidates = [r for r in results if r.get("ratio") is not None and r["accuracy"] >= floor - 1e-12]
    if not candidates:
        best = max(results, key=lambda r: (r["accuracy"], -(r.get("ratio") or 0.0)), default=None)
        text = (
            f"No policy stays within {tolerance * 100:.0f} points of the uncompressed accuracy {baseline_accuracy:.2f}."
        )
        if best is not None:
            text += f" The most accurate is {best['policy']} at ratio {best['ratio']:g} ({best['accuracy']:.2f})."
        return {
            "policy": None,
            "ratio": None,
            "accuracy": None,
            "baseline_accuracy": baseline_accuracy,
            "tolerance": tolerance,
            "text": text,
        }
    chosen = min(candidates, key=lambda r: (-r["ratio"], -r["accuracy"], r.get("kv_bytes", 0), r["policy"]))
    text = (
        f"Serve with {chosen['policy']} at compression ratio {chosen['ratio']:g}: accuracy "
        f"{chosen['accuracy']:.2f} vs {baseline_accuracy:.2f} uncompressed (tolerance "
        f"{tolerance * 100:.0f} points), holding {chosen.get('kv_fraction', float('nan')):.0%} of the full KV bytes."
    )
    return {
        "policy": chosen["policy"],
        "ratio": chosen["ratio"],
        "accuracy": chosen["accuracy"],
        "baseline_accuracy": baseline_accuracy,
        "tolerance": tolerance,
        "text": text,
    }


def markdown_table(evaluation: dict) -> str:
    """Results as a Markdown table (baseline first, then by policy and ratio)."""
    rows = [evaluation["baseline"]] + sorted(evaluation["results"], key=lambda r: (r["policy"], r["ratio"]))
    lines = [
        "| policy | ratio | accuracy [95% CI] | attn. output error | KV bytes (of full) | prefill s | decode s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:g}"
        error = "-" if r.get("attention_error") is None else f"{r['attention_error']:.3f}"
        lines.append(
            f"| {r['policy']} | {ratio} | {r['accuracy']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] | {error} | "
            f"{r['kv_bytes'] / 2**20:.1f} MiB ({r['kv_fraction']:.0%}) | {r['prefill_seconds']:.2f} | "
            f"{r['decode_seconds']:.2f} |"
        )
    recommendation = evaluation.get("recommendation")
    if recommendation:
        lines += ["", recommendation["text"]]
    return "\n".join(lines)
