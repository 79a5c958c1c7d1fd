"""Evaluation results: accuracy intervals, the recommendations, output.

Pure data and arithmetic (no model): ``profiler.evaluation`` fills these records by running
the model; this module defines what they mean.  The JSON layout is documented in
``docs/evaluation-format.md`` and versioned by ``EVALUATION_SCHEMA``.  Policies are written
in the runtime's grammar (``runtime.policy_spec``).  Imports no torch (the command lines'
``--help`` reads :data:`RECOMMENDATION_CANDIDATES`).

Ratios are **compression** ratios (``compression_ratio``), the fraction of the context's cache
that is evicted (0.75 keeps a quarter), as in kvpress tables and ``CompressionPolicy``.
"""

from __future__ import annotations

import math

EVALUATION_SCHEMA = "kvcal-evaluation/2"  # 2: "ratio" became "compression_ratio"
EVALUATION_SEED_OFFSET = 1_000_003  # held-out task seed = the profiled probes' seed + this, unless given

# The policies the recommendation stage measures by default, cheapest to serve first (ties at
# a ratio go to the earlier one).  Scoring cost per prompt, as a share of the prefill: KeyDiff and
# the learned scorer under 2%, leverage about 17% (docs/results.md R-scorer-cost-2026-11-22); the
# MomentKV correction adds O(d^2) state per head and a correction term per decode step.
# the compression ratios (fractions evicted) the recommendation decides at and evaluate-artifact measures
# by default: 20x and 40x included, where the calibration pays most (issue 26; docs/results.md)
COMPRESSION_GRID = (0.5, 0.75, 0.9, 0.95, 0.975)

RECOMMENDATION_CANDIDATES = (
    "inf/keydiff+correction",
    "curve/keydiff+correction",  # held out, near the leverage policies at KeyDiff's cost (R-budget-curves-2026-11-22)
    "global/learned",
    "global/learned+correction",
    "inf/leverage",
    "inf/leverage+correction",  # the most accurate held out (docs/results.md R-flagship-2026-11-22)
    "curve/leverage+correction",
)


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
    candidates = [r for r in results if r.get("compression_ratio") is not None and r["accuracy"] >= floor - 1e-12]
    if not candidates:
        best = max(results, key=lambda r: (r["accuracy"], -(r.get("compression_ratio") or 0.0)), default=None)
        text = (
            f"No policy stays within {tolerance * 100:.0f} points of the uncompressed accuracy {baseline_accuracy:.2f}."
        )
        if best is not None:
            text += (
                f" The most accurate is {best['policy']} at compression ratio {best['compression_ratio']:g} "
                f"({best['accuracy']:.2f})."
            )
        return {
            "policy": None,
            "compression_ratio": None,
            "accuracy": None,
            "baseline_accuracy": baseline_accuracy,
            "tolerance": tolerance,
            "text": text,
        }
    chosen = min(candidates, key=lambda r: (-r["compression_ratio"], -r["accuracy"], r.get("kv_bytes", 0), r["policy"]))
    text = (
        f"Serve with {chosen['policy']} at compression ratio {chosen['compression_ratio']:g}: accuracy "
        f"{chosen['accuracy']:.2f} vs {baseline_accuracy:.2f} uncompressed (tolerance "
        f"{tolerance * 100:.0f} points), holding {chosen.get('kv_fraction', float('nan')):.0%} of the full KV bytes."
    )
    return {
        "policy": chosen["policy"],
        "compression_ratio": chosen["compression_ratio"],
        "accuracy": chosen["accuracy"],
        "baseline_accuracy": baseline_accuracy,
        "tolerance": tolerance,
        "text": text,
    }


def markdown_table(evaluation: dict) -> str:
    """Results as a Markdown table (baseline first, then by policy and ratio)."""
    rows = [evaluation["baseline"]] + sorted(evaluation["results"], key=lambda r: (r["policy"], r["compression_ratio"]))
    lines = [
        "| policy | compression ratio | accuracy [95% CI] | attn. output error | KV bytes (of full) "
        "| prefill s | decode s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.get("compression_ratio") is None else f"{r['compression_ratio']:g}"
        error = "-" if r.get("attention_error") is None else f"{r['attention_error']:.3f}"
        lines.append(
            f"| {r['policy']} | {ratio} | {r['accuracy']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] | {error} | "
            f"{r['kv_bytes'] / 2**20:.1f} MiB ({r['kv_fraction']:.0%}) | {r['prefill_seconds']:.2f} | "
            f"{r['decode_seconds']:.2f} |"
        )
    recommendation = evaluation.get("recommendation")
    if recommendation:
        lines += ["", recommendation["text"]]
    best = evaluation.get("best_per_ratio")
    if best:
        lines += ["", "Most accurate policy per compression ratio (ties: the first listed):", ""]
        lines += ["| compression ratio | policy | accuracy [95% CI] | n |", "|---|---|---|---|"]
        lines += [
            f"| {row['compression_ratio']:g} | {row['policy']} | {row['accuracy']:.2f} "
            f"[{row['ci_low']:.2f}, {row['ci_high']:.2f}] | {row['n']} |"
            for row in best
        ]
    return "\n".join(lines)


def best_per_ratio(results: list[dict], preference: list[str]) -> list[dict]:
    """Per compression ratio, the most accurate policy; ties go to the earlier one in ``preference``.

    ``results`` are the evaluation's aggregated records (policy, compression_ratio, accuracy,
    ci_low, ci_high, n); ``preference`` orders every policy name in them (cheapest to serve first).
    """
    rank = {name: index for index, name in enumerate(preference)}
    by_ratio: dict[float, list[dict]] = {}
    for record in results:
        if record.get("compression_ratio") is not None:
            by_ratio.setdefault(float(record["compression_ratio"]), []).append(record)
    best = []
    for ratio in sorted(by_ratio):
        chosen = min(by_ratio[ratio], key=lambda r: (-r["accuracy"], rank[r["policy"]]))
        best.append({key: chosen[key] for key in ("policy", "compression_ratio", "accuracy", "ci_low", "ci_high", "n")})
    return best
