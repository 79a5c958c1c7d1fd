"""The ``recommendation`` stage: which policy to serve at which compression ratio, measured.

Needle tasks generated with a seed disjoint from the profiled probes' (the behaviour stage's
seed + ``EVALUATION_SEED_OFFSET``) run through the model uncompressed and under every
candidate policy at every compression ratio, question-agnostic (the context is compressed
before the question is seen), with the sections this job has just built (or the existing
artifact's) as the calibration (:func:`profiler.evaluation.evaluate`).  Per ratio the most
accurate candidate is recorded; ties go to the earlier candidate, and the default candidates
are listed cheapest to serve first (:data:`profiler.evaluation_results.RECOMMENDATION_CANDIDATES`).
A candidate the calibration cannot serve (a section it needs is neither built nor present)
is left out, with a note.  The runtime serves the result with ``calibration.policy(compression_ratio=...)``.

The work runs on the main process after the other stages' sections are built (it needs them);
an interrupted run redoes it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from artifacts import Section
from profiler.arguments import comma_separated, number_in, positive_int
from profiler.evaluation_results import RECOMMENDATION_CANDIDATES

from .base import Stage

DEFAULT_COMPRESSION_RATIOS = (0.5, 0.75, 0.9)
TASK_FAMILIES = ("retrieval", "multi_key")  # the families the embedded model answers uncompressed
TASK_DEPTHS = (10.0, 50.0, 90.0)


class RecommendationStage(Stage):
    name = "recommendation"
    section = "recommendation"
    summary = (
        "run held-out needle tasks (never the profiled probes) uncompressed and under candidate eviction "
        "policies at a grid of compression ratios; record per ratio the most accurate policy, which "
        "calibration.policy(compression_ratio=...) serves. On by default from the quick preset up."
    )

    @classmethod
    def on_by_default(cls, preset) -> bool:
        return preset.recommendation_count > 0

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("recommendation stage")
        group.add_argument(
            "--recommend-policies",
            type=comma_separated(str),
            default=None,
            help="candidate policies, cheapest to serve first (ties go to the first); default: "
            + ", ".join(RECOMMENDATION_CANDIDATES),
        )
        group.add_argument(
            "--recommend-compression-ratios",
            type=comma_separated(number_in(0.0, 1.0, low_open=True, high_open=True)),
            default=None,
            help="compression ratios (fractions of the context cache evicted) to recommend a policy for "
            "(default 0.5,0.75,0.9)",
        )
        group.add_argument(
            "--recommend-count",
            type=positive_int,
            default=None,
            help="held-out tasks per (family, length, depth) cell (default: the preset's; 2 x 2 lengths x 3 "
            "depths x this many tasks)",
        )

    def __init__(self, job):
        super().__init__(job)
        from runtime.policy_spec import parse_policy

        names = job.setting("recommend_policies", RECOMMENDATION_CANDIDATES)
        if not names:
            raise ValueError("--recommend-policies: no policy given")
        self.candidates = [parse_policy(name) for name in names]
        if any(spec.is_baseline for spec in self.candidates):
            raise ValueError("--recommend-policies: 'baseline' is measured anyway; list compression policies")
        unservable = [spec.name for spec in self.candidates if spec.needs_reconstruction]
        if unservable:
            raise ValueError(
                f"--recommend-policies: {', '.join(unservable)} need a reconstruction pass per prompt at serving, "
                "which calibration.policy() cannot serve; compare them with evaluate-artifact"
            )
        self.ratios = tuple(float(r) for r in job.setting("recommend_compression_ratios", DEFAULT_COMPRESSION_RATIOS))
        if not self.ratios or any(not 0.0 < r < 1.0 for r in self.ratios) or len(set(self.ratios)) != len(self.ratios):
            raise ValueError(f"recommendation compression ratios must be distinct and in (0, 1), got {self.ratios}")
        self.count = job.setting("recommend_count", max(1, job.preset.recommendation_count))
        if self.count < 1:
            raise ValueError(f"--recommend-count must be >= 1, got {self.count}")

    def prepare(self) -> None:
        from needles import PRESETS as PROBE_PRESETS
        from profiler.evaluation import held_out_spec

        job = self.job
        base = PROBE_PRESETS[job.preset.probes].replace(**dict(job.preset.probe_overrides))
        self.spec = held_out_spec(
            base,
            families=TASK_FAMILIES,
            depths=TASK_DEPTHS,
            count=self.count,
            profiler_seed=base.seed,
            model_context=job.identity.max_position_embeddings or 4096,
        )

    def config(self) -> dict:
        return {
            "candidates": [spec.name for spec in self.candidates],
            "compression_ratios": list(self.ratios),
            "tasks": self.spec.to_dict(),
            "question_aware": False,
            "max_new_tokens": self.job.preset.max_new_tokens,
        }

    def build(self, sections: dict[str, Section]) -> Section:
        from needles import generate_probes
        from profiler.evaluation import evaluate
        from runtime.calibration import Calibration

        job = self.job
        started = time.perf_counter()
        calibration = Calibration.from_sections(job.out, job.identity, job.config(), sections)
        candidates = []
        for spec in self.candidates:
            missing = spec.policy(self.ratios[0]).missing(calibration)
            if missing:
                self.say(f"recommendation: leaving out {spec.name}: {missing[0]}")
                continue
            candidates.append(spec)
        if not candidates:
            raise ValueError("recommendation: no candidate policy can be served by the sections of this artifact")
        probes = list(generate_probes(self.spec, job.tokenizer))
        evaluation = evaluate(
            job.model,
            job.tokenizer,
            probes,
            candidates,
            list(self.ratios),
            calibration=calibration,
            max_new_tokens=job.preset.max_new_tokens,
            progress=job.options.progress and job.info.is_main,
        )
        section = recommendation_section(
            evaluation, [spec.name for spec in candidates], self.spec.seed, ",".join(self.spec.families)
        )
        served = zip(section["compression_ratios"], section["policy"], section["accuracy"], strict=True)
        self.say(
            f"recommendation: {len(probes)} held-out tasks, baseline {evaluation['baseline']['accuracy']:.2f}; "
            + "; ".join(f"{ratio:g}: {policy.decode()} {accuracy:.2f}" for ratio, policy, accuracy in served)
            + f"; {time.perf_counter() - started:.1f} s"
        )
        return section


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
