"""The ``recommendation`` stage's method: which candidate policies the sections can serve, and the
section from an evaluation.

The evaluation itself (needle tasks uncompressed and under every candidate at every compression
ratio) is :func:`profiler.evaluation.evaluate`, shared with ``evaluate-artifact``; the policy served
per ratio is decided by paired evidence (:func:`profiler.paired_decision.decide`): the flagship
unless a candidate is shown, on the same tasks, not to be worse.  Imports no torch at module level
(``evaluate-artifact --write-recommendation`` reads :func:`recommendation_section`).
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from artifacts import Section
from artifacts.schema import SECTIONS

from .paired_decision import DEFAULT_CONFIDENCE, DEFAULT_TOLERANCE, FALLBACK_RULE, REFERENCE_NAMES, RULE, decide


def candidate_specs(names) -> list:
    """The ``runtime.plan.policy_spec.PolicySpec`` of each name, refused (``ValueError``) when the stage
    cannot recommend it: 'baseline' (measured anyway), or a policy that needs a reconstruction pass
    per prompt at serving (``calibration.policy()`` cannot serve it)."""
    from runtime.plan.policy_spec import parse_policy  # torch: not for the parser

    if not names:
        raise ValueError("--recommend-policies: no policy given")
    specs = [parse_policy(name) for name in names]
    check_distinct(specs, "--recommend-policies")
    if any(spec.is_baseline for spec in specs):
        raise ValueError("--recommend-policies: 'baseline' is measured anyway; list compression policies")
    unservable = [spec.name for spec in specs if spec.needs_reconstruction]
    if unservable:
        raise ValueError(
            f"--recommend-policies: {', '.join(unservable)} need a reconstruction pass per prompt at serving, "
            "which calibration.policy() cannot serve; compare them with evaluate-artifact"
        )
    return specs


def check_distinct(specs, option: str) -> None:
    """No policy twice in ``specs`` (the ``runtime.plan.policy_spec.PolicySpec`` s given with ``option``), by
    one name or two (``flagship`` is ``inf/leverage+correction``): ValueError before the model loads
    (the paired rule needs each once: issue 41, a ValueError traceback after the whole evaluation)."""
    for index, spec in enumerate(specs):
        for earlier in specs[:index]:
            if earlier.is_baseline == spec.is_baseline and earlier.policy(0.5) == spec.policy(0.5):
                same = "" if earlier.name == spec.name else f" ({earlier.name} and {spec.name} are the same policy)"
                raise ValueError(f"{option} names {earlier.name} twice{same}: give each policy once")


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


def recommendation_section(
    evaluation: dict,
    candidates: list[str],
    task_seed: int,
    families: str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    confidence: float = DEFAULT_CONFIDENCE,
    previous: Section | None = None,
) -> Section:
    """The artifact's ``recommendation`` section from an evaluation (``profiler.evaluation.evaluate``)
    of ``candidates`` (cheapest to serve first) at one grid of compression ratios.

    Per ratio the flagship is the reference and a candidate replaces it only under the paired rule
    (:func:`profiler.paired_decision.decide`); without the flagship among the candidates the most
    accurate is served (ties: the cheaper) and the section's ``rule`` says so.  ``previous``: a
    section with recorded per-task outcomes (schema 1.4) of the same candidates and ratios
    (:func:`can_extend`); the decision is then taken on the union of its tasks and these (a task
    measured again counts once, with its new outcomes).
    """
    too_long = [name for name in candidates if len(name) > 128 or not name.isascii()]
    if too_long:
        raise ValueError(f"policy names are stored as ASCII of at most 128 characters: {too_long}")
    ratios = sorted({float(r["compression_ratio"]) for r in evaluation["results"] if r["policy"] in candidates})
    cells = {(r["policy"], float(r["compression_ratio"])): r for r in evaluation["results"]}
    missing = [(name, ratio) for name in candidates for ratio in ratios if (name, ratio) not in cells]
    if missing:
        raise ValueError(f"the evaluation lacks {missing[:3]}: every candidate needs every compression ratio")
    task_ids = [str(task) for task in evaluation["task_ids"]]
    counts = {len(cells[key]["outcomes"]) for key in cells if key[0] in candidates} | {
        len(evaluation["baseline"]["outcomes"])
    }
    if counts != {len(task_ids)}:
        raise ValueError(f"every cell must have run the same {len(task_ids)} tasks, got counts {sorted(counts)}")
    # [NC, NP, T] and [T]: whether each policy answered each task
    outcomes = np.array(
        [[cells[(name, ratio)]["outcomes"] for name in candidates] for ratio in ratios], dtype=np.uint8
    ).reshape(len(ratios), len(candidates), len(task_ids))
    baseline = np.array(evaluation["baseline"]["outcomes"], dtype=np.uint8)
    if previous is not None:
        task_ids, outcomes, baseline, families = _extend(
            previous, candidates, ratios, task_ids, outcomes, baseline, families
        )
    return _decided_section(
        candidates, ratios, task_ids, outcomes, baseline, task_seed, families, tolerance, confidence
    )


def recorded_candidates(previous: Section) -> list[str]:
    return [name.decode("ascii") for name in previous["candidates"]]


def can_extend(previous: Section, candidates, ratios) -> bool:
    """Whether ``previous`` (a ``recommendation`` section) recorded per-task outcomes (schema 1.4) at
    exactly ``ratios`` of candidates all among ``candidates``, so that new tasks can be added to them
    (the new run's other policies are then left out of the section)."""
    if "outcomes" not in previous.arrays:
        return False
    recorded_ratios = sorted(float(r) for r in previous["compression_ratios"])
    return (
        set(recorded_candidates(previous)) <= set(candidates)
        and len(recorded_ratios) == len(ratios)
        and np.allclose(recorded_ratios, sorted(ratios), rtol=0, atol=1e-12)
    )


def _extend(previous: Section, candidates, ratios, task_ids, outcomes, baseline, families):
    """The recorded tasks of ``previous`` followed by the new ones; a task measured again keeps only
    its new outcomes (ValueError when the grids differ: :func:`can_extend`)."""
    if recorded_candidates(previous) != list(candidates) or not can_extend(previous, candidates, ratios):
        raise ValueError(
            "the recorded recommendation holds no per-task outcomes of these candidates at these compression "
            "ratios: nothing to extend"
        )
    order = np.argsort(np.asarray(previous["compression_ratios"], dtype=np.float64))
    old_ids = [task.decode("ascii") for task in previous["task_ids"]]
    keep = [i for i, task in enumerate(old_ids) if task not in set(task_ids)]
    merged_families = list(dict.fromkeys(str(previous.attrs["families"]).split(",") + families.split(",")))
    return (
        [old_ids[i] for i in keep] + list(task_ids),
        np.concatenate([np.asarray(previous["outcomes"], dtype=np.uint8)[order][:, :, keep], outcomes], axis=2),
        np.concatenate([np.asarray(previous["baseline_outcomes"], dtype=np.uint8)[keep], baseline]),
        ",".join(merged_families),
    )


def _decided_section(candidates, ratios, task_ids, outcomes, baseline, task_seed, families, tolerance, confidence):
    from common.formulas import wilson_interval

    n = len(task_ids)
    reference = next((candidates.index(name) for name in REFERENCE_NAMES if name in candidates), -1)
    served, wins, losses, bounds = [], [], [], []
    for row in outcomes:  # [NP, T] at one ratio
        table = {name: row[index].astype(bool).tolist() for index, name in enumerate(candidates)}
        if reference >= 0:
            decision = decide(candidates[reference], table, candidates, tolerance, confidence)
            served.append(candidates.index(decision.served))
            wins.append([c.wins for c in decision.comparisons])
            losses.append([c.losses for c in decision.comparisons])
            bounds.append([c.bound for c in decision.comparisons])
        else:  # the most accurate, ties to the cheaper (the rule of schema 1.2 / 1.3)
            served.append(min(range(len(candidates)), key=lambda i: (-int(row[i].sum()), i)))
            wins.append([0] * len(candidates))
            losses.append([0] * len(candidates))
            bounds.append([1.0] * len(candidates))
    accuracy = outcomes.mean(axis=2) if n else np.zeros(outcomes.shape[:2])  # [NC, NP]
    chosen = [int(row[index].sum()) for row, index in zip(outcomes, served, strict=True)]
    intervals = [wilson_interval(correct, n) for correct in chosen]
    return Section(
        arrays={
            "compression_ratios": np.array(ratios, dtype=np.float64),
            "policy": np.array([candidates[index].encode("ascii") for index in served], dtype="S128"),
            "accuracy": np.array([correct / n for correct in chosen], dtype=np.float64),
            "ci_low": np.array([low for low, _ in intervals], dtype=np.float64),
            "ci_high": np.array([high for _, high in intervals], dtype=np.float64),
            "candidates": np.array([name.encode("ascii") for name in candidates], dtype="S128"),
            "candidate_accuracy": np.ascontiguousarray(accuracy.T, dtype=np.float64),
            "rule": np.array([(RULE if reference >= 0 else FALLBACK_RULE).encode("ascii")], dtype="S128"),
            "tolerance": np.array([tolerance], dtype=np.float64),
            "confidence": np.array([confidence], dtype=np.float64),
            "reference": np.full(len(ratios), reference, dtype=np.int64),
            "task_ids": np.array([task.encode("ascii") for task in task_ids], dtype="S128"),
            "baseline_outcomes": baseline.astype(np.uint8),
            "outcomes": outcomes.astype(np.uint8),
            "wins": np.array(wins, dtype=np.int64),
            "losses": np.array(losses, dtype=np.int64),
            "bound": np.array(bounds, dtype=np.float64),
        },
        attrs={
            "tasks": int(n),
            "baseline_accuracy": float(baseline.mean()) if n else 0.0,
            "task_seed": int(task_seed),
            "families": families,
        },
    )
