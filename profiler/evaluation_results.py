"""Evaluation results: per-task records, accuracy intervals, the paired decision, the table.

Pure data and arithmetic (no model): ``profiler.evaluation`` fills these records by running
the model; this module defines what they mean.  The JSON layout is documented in
``docs/evaluation-format.md`` and versioned by ``EVALUATION_SCHEMA``.  Policies are written
in the runtime's grammar (``runtime.plan.policy_spec``).  Imports no torch (the command lines'
``--help`` reads :data:`RECOMMENDATION_CANDIDATES`).

Ratios are **compression** ratios (``compression_ratio``), the fraction of the context's cache
that is evicted (0.75 keeps a quarter), as in kvpress tables and ``CompressionPolicy``.
"""

from __future__ import annotations

import math

from common.formulas import wilson_interval

from .paired_decision import DEFAULT_CONFIDENCE, DEFAULT_TOLERANCE

# 2: "ratio" became "compression_ratio"; 3: per-task records ("per_task"), and "recommendation"
# holds the paired decision against the flagship ("best_per_ratio" and the old pick are gone)
EVALUATION_SCHEMA = "kvcal-evaluation/3"
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


def cell_keys(policies, ratios) -> list[tuple]:
    """The ``(policy, compression_ratio)`` of every row of a task, in order: the baseline's
    ``("baseline", None)``, then each compression policy of ``policies`` (``PolicySpec`` s) at every
    ratio (what ``profiler.evaluation.evaluate`` measures and its journal records)."""
    return [("baseline", None)] + [(spec.name, ratio) for spec in policies if not spec.is_baseline for ratio in ratios]


def task_record(probe, rows: list[dict]) -> dict:
    """One task's entry of the JSON's ``per_task``: the task, and what the baseline (``rows[0]``)
    and every cell (``rows[1:]``, each ``{policy, compression_ratio, text, correct, kv_bytes,
    prefill_seconds, decode_seconds, error}``: ``profiler.evaluation.evaluate``) answered."""

    def measured(row: dict) -> dict:
        return {
            "text": row["text"],
            "correct": bool(row["correct"]),
            "kv_bytes": row["kv_bytes"],
            "prefill_seconds": row["prefill_seconds"],
            "decode_seconds": row["decode_seconds"],
        }

    return {
        "id": probe.id,
        "family": probe.family,
        "haystack": probe.meta.get("haystack") if isinstance(probe.meta, dict) else None,
        "length": probe.length,
        "tokens": len(probe.input_ids),
        "depth": probe.depth,
        "baseline": measured(rows[0]),
        "cells": [
            {
                "policy": row["policy"],
                "compression_ratio": row["compression_ratio"],
                **measured(row),
                "attention_error": row["error"],
            }
            for row in rows[1:]
        ],
    }


def tasks_for_identical_answers(tolerance: float, confidence: float) -> int | None:
    """The fewest tasks on which a cheaper candidate answering exactly as the reference passes the
    paired rule: ``loss_bound(0, 0, n) = 1 - (alpha / 2) ** (1 / n) <= tolerance``
    (``profiler.paired_decision``); None when no number does (``tolerance`` 0)."""
    if tolerance <= 0.0:
        return None
    alpha = 1.0 - confidence
    n = max(1, math.ceil(math.log(alpha / 2) / math.log1p(-tolerance)) - 1)
    while 1.0 - (alpha / 2) ** (1.0 / n) > tolerance:  # the closed form, exact up to rounding
        n += 1
    return n


def paired_recommendation(
    evaluation: dict,
    candidates: list[str],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    confidence: float = DEFAULT_CONFIDENCE,
) -> dict | None:
    """Per compression ratio, the policy the artifact's rule serves among ``candidates`` (cheapest
    to serve first), decided on this evaluation's tasks exactly as
    ``profiler.recommendation.recommendation_section`` decides (the flagship the reference, and
    :func:`profiler.paired_decision.decide`; without the flagship among the candidates the most
    accurate, ties to the cheaper), with every candidate's accuracy, interval and paired counts.
    None without candidates.  The layout is the JSON's ``recommendation`` (docs/evaluation-format.md)."""
    from .paired_decision import FALLBACK_RULE, REFERENCE_NAMES, RULE, decide, loss_bound

    cells = {(r["policy"], float(r["compression_ratio"])): r for r in evaluation["results"]}
    ratios = sorted({ratio for name, ratio in cells if name in candidates})
    if not ratios:
        return None
    reference = next((name for name in REFERENCE_NAMES if name in candidates), None)
    per_ratio = []
    for ratio in ratios:
        outcomes = {name: [bool(x) for x in cells[(name, ratio)]["outcomes"]] for name in candidates}
        n = len(outcomes[candidates[0]])
        rows = []
        for name in candidates:
            correct = sum(outcomes[name])
            low, high = wilson_interval(correct, n)
            rows.append({"policy": name, "correct": correct, "accuracy": correct / n if n else 0.0})
            rows[-1].update({"ci_low": low, "ci_high": high})
        entry = {"compression_ratio": ratio, "n": n}
        if reference is not None:
            decision = decide(reference, outcomes, candidates, tolerance, confidence)
            for row, comparison in zip(rows, decision.comparisons, strict=True):
                row.update(
                    wins=comparison.wins,
                    losses=comparison.losses,
                    ties=comparison.ties,
                    bound=comparison.bound,
                    passes=comparison.passes,
                )
            served = decision.served
            # a candidate right on every task the reference missed, and on all the others
            rank = candidates.index(reference)
            best = loss_bound(n - sum(outcomes[reference]), 0, n, confidence)
            entry["too_few_tasks"] = not ((rank > 0 and best <= tolerance) or (rank < len(candidates) - 1 and best < 0))
            entry["best_possible_bound"] = best
        else:
            served = candidates[min(range(len(candidates)), key=lambda i: (-rows[i]["correct"], i))]
        chosen = rows[candidates.index(served)]
        entry["served"] = served
        entry["overlapping"] = [
            row["policy"]
            for row in rows
            if row is not chosen and row["ci_low"] <= chosen["ci_high"] and chosen["ci_low"] <= row["ci_high"]
        ]
        entry["candidates"] = rows
        per_ratio.append(entry)
    result = {
        "rule": RULE if reference is not None else FALLBACK_RULE,
        "reference": reference,
        "tolerance": tolerance,
        "confidence": confidence,
        "candidates": list(candidates),
        "tasks_for_identical_answers": tasks_for_identical_answers(tolerance, confidence),
        "per_ratio": per_ratio,
    }
    result["text"] = " ".join(_decision_sentences(result))
    return result


def _decision_sentences(recommendation: dict) -> list[str]:
    """Per compression ratio, what is served and why, as sentences (the JSON's ``text``)."""
    reference = recommendation["reference"]
    needed = recommendation["tasks_for_identical_answers"]
    sentences = []
    for entry in recommendation["per_ratio"]:
        ratio, served, n = entry["compression_ratio"], entry["served"], entry["n"]
        if reference is None:
            text = (
                f"At compression ratio {ratio:g} serve {served}, the most accurate on {n} tasks "
                "(no flagship among the candidates)."
            )
        elif served == reference:
            text = (
                f"At compression ratio {ratio:g} serve the flagship {reference}: no candidate was shown "
                f"on the same {n} tasks to replace it."
            )
        else:
            text = (
                f"At compression ratio {ratio:g} serve {served}: on the same {n} tasks it gives up at most "
                f"{recommendation['tolerance'] * 100:g} points against the flagship {reference} with "
                f"{recommendation['confidence']:.0%} confidence."
            )
        if entry.get("too_few_tasks"):
            text += (
                f" {n} tasks are too few for any candidate to replace the flagship: a candidate right on every task "
                f"would still be bounded at {entry['best_possible_bound']:+.3f}"
                + (f"; with answers identical to the flagship's it takes {needed} tasks." if needed else ".")
            )
        if entry["overlapping"]:
            text += (
                f" The 95% intervals of {served} and of {', '.join(entry['overlapping'])} overlap: "
                "their accuracies on these tasks do not separate them."
            )
        sentences.append(text)
    return sentences


def markdown_table(evaluation: dict) -> str:
    """Results as a Markdown table (baseline first, then by policy and ratio), every accuracy with
    its 95% Wilson interval and n; then, when the evaluation holds one, the paired decision per
    compression ratio (:func:`paired_recommendation`)."""
    rows = [evaluation["baseline"]] + sorted(evaluation["results"], key=lambda r: (r["policy"], r["compression_ratio"]))
    lines = [
        "| policy | compression ratio | accuracy [95% CI] | n | attn. output error | KV bytes (of full) "
        "| prefill s | decode s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = "-" if r.get("compression_ratio") is None else f"{r['compression_ratio']:g}"
        error = "-" if r.get("attention_error") is None else f"{r['attention_error']:.3f}"
        lines.append(
            f"| {r['policy']} | {ratio} | {r['accuracy']:.2f} [{r['ci_low']:.2f}, {r['ci_high']:.2f}] | {r['n']} | "
            f"{error} | {r['kv_bytes'] / 2**20:.1f} MiB ({r['kv_fraction']:.0%}) | {r['prefill_seconds']:.2f} | "
            f"{r['decode_seconds']:.2f} |"
        )
    recommendation = evaluation.get("recommendation")
    if recommendation:
        lines += ["", *decision_table(recommendation)]
    return "\n".join(lines)


def decision_table(recommendation: dict) -> list[str]:
    """The paired decision (:func:`paired_recommendation`) as Markdown: per compression ratio every
    candidate with its accuracy, interval, n and its wins/losses and bound against the flagship,
    the served one marked, then the reasons in sentences."""
    reference = recommendation["reference"]
    if reference is None:
        head = (
            f"Policy to serve per compression ratio (rule {recommendation['rule']}: no flagship among the "
            "candidates, so the most accurate, ties to the cheaper):"
        )
    else:
        head = (
            f"Policy to serve per compression ratio (rule {recommendation['rule']}, as --write-recommendation "
            f"records it): the flagship {reference} unless a cheaper candidate, on the same tasks, gives up at most "
            f"{recommendation['tolerance'] * 100:g} points with {recommendation['confidence']:.0%} confidence "
            "(bound <= tolerance), or a dearer one is better (bound < 0). Candidates cheapest first; wins: tasks "
            "only the candidate answered, losses: only the flagship; bound: upper bound on the accuracy given up."
        )
    lines = [
        head,
        "",
        "| compression ratio | candidate | accuracy [95% CI] | n | wins / losses vs flagship | bound | served |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in recommendation["per_ratio"]:
        for row in entry["candidates"]:
            if reference is None:
                paired, bound = "-", "-"
            elif row["policy"] == reference:
                paired, bound = "reference", "-"
            else:
                paired = f"{row['wins']} / {row['losses']}"
                bound = f"{row['bound']:+.3f}" + (" (passes)" if row["passes"] else "")
            lines.append(
                f"| {entry['compression_ratio']:g} | {row['policy']} | {row['accuracy']:.2f} "
                f"[{row['ci_low']:.2f}, {row['ci_high']:.2f}] | {entry['n']} | {paired} | {bound} | "
                f"{'**served**' if row['policy'] == entry['served'] else ''} |"
            )
    return lines + ["", *(f"- {sentence}" for sentence in _decision_sentences(recommendation))]
