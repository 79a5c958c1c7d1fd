"""The ``recommendation`` stage's method: which candidate policies the sections can serve, and the
section from an evaluation.

The evaluation itself (needle tasks uncompressed and under every candidate at every compression
ratio) is :func:`profiler.evaluation.evaluate`, shared with ``evaluate-artifact``; the best
candidate per ratio is :func:`profiler.evaluation_results.best_per_ratio`.  Imports no torch at
module level (``evaluate-artifact --write-recommendation`` reads :func:`recommendation_section`).
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from artifacts import Section
from artifacts.schema import SECTIONS


def candidate_specs(names) -> list:
    """The ``runtime.policy_spec.PolicySpec`` of each name, refused (``ValueError``) when the stage
    cannot recommend it: 'baseline' (measured anyway), or a policy that needs a reconstruction pass
    per prompt at serving (``calibration.policy()`` cannot serve it)."""
    from runtime.policy_spec import parse_policy  # torch: not for the parser

    if not names:
        raise ValueError("--recommend-policies: no policy given")
    specs = [parse_policy(name) for name in names]
    if any(spec.is_baseline for spec in specs):
        raise ValueError("--recommend-policies: 'baseline' is measured anyway; list compression policies")
    unservable = [spec.name for spec in specs if spec.needs_reconstruction]
    if unservable:
        raise ValueError(
            f"--recommend-policies: {', '.join(unservable)} need a reconstruction pass per prompt at serving, "
            "which calibration.policy() cannot serve; compare them with evaluate-artifact"
        )
    return specs


def sections_serving(spec, compression_ratio: float) -> tuple[frozenset[str], ...]:
    """The sets of artifact sections, any one of which serves the policy ``spec`` (a
    ``PolicySpec``) at ``compression_ratio``: every need the runtime lists
    (``CompressionPolicy.needs_calibration``, e.g. "INF budgets (section 'budgets' or
    'behaviour')") met by one of the sections it names.  ``(frozenset(),)`` when it needs none."""
    choices = []
    for need in spec.policy(compression_ratio).needs_calibration():
        named = tuple(name for name in re.findall(r"'(\w+)'", need) if name in SECTIONS)
        if named:  # a need that names no section is left to the check when the section is built
            choices.append(named)
    return tuple(frozenset(combination) for combination in itertools.product(*choices))


def recommendation_section(evaluation: dict, candidates: list[str], task_seed: int, families: str) -> Section:
    """The artifact's ``recommendation`` section from an evaluation (``profiler.evaluation.evaluate``)
    of ``candidates`` (in preference order) at one grid of compression ratios."""
    from profiler.evaluation_results import best_per_ratio

    too_long = [name for name in candidates if len(name) > 128 or not name.isascii()]
    if too_long:
        raise ValueError(f"policy names are stored as ASCII of at most 128 characters: {too_long}")
    best = best_per_ratio([r for r in evaluation["results"] if r["policy"] in candidates], candidates)
    ratios = [row["compression_ratio"] for row in best]
    accuracy = {(r["policy"], r["compression_ratio"]): r["accuracy"] for r in evaluation["results"]}
    missing = [(name, ratio) for name in candidates for ratio in ratios if (name, ratio) not in accuracy]
    if missing:
        raise ValueError(f"the evaluation lacks {missing[:3]}: every candidate needs every compression ratio")
    tasks = {row["n"] for row in best} | {evaluation["baseline"]["n"]}
    if len(tasks) != 1:
        raise ValueError(f"every cell must have run the same tasks, got counts {sorted(tasks)}")
    return Section(
        arrays={
            "compression_ratios": np.array(ratios, dtype=np.float64),
            "policy": np.array([row["policy"].encode("ascii") for row in best], dtype="S128"),
            "accuracy": np.array([row["accuracy"] for row in best], dtype=np.float64),
            "ci_low": np.array([row["ci_low"] for row in best], dtype=np.float64),
            "ci_high": np.array([row["ci_high"] for row in best], dtype=np.float64),
            "candidates": np.array([name.encode("ascii") for name in candidates], dtype="S128"),
            "candidate_accuracy": np.array([[accuracy[(name, r)] for r in ratios] for name in candidates]),
        },
        attrs={
            "tasks": int(tasks.pop()),
            "baseline_accuracy": float(evaluation["baseline"]["accuracy"]),
            "task_seed": int(task_seed),
            "families": families,
        },
    )
