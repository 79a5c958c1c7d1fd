"""The ``recommendation`` stage: which policy to serve at which compression ratio, measured.

Needle tasks of every family on both haystacks, at the preset's lengths and other depths than
the profiled probes', with seeds disjoint from theirs (:mod:`profiler.held_out_tasks`), run
through the model uncompressed and under every
candidate policy at every compression ratio, question-agnostic (the context is compressed
before the question is seen), with the sections this job has just built (or the existing
artifact's) as the calibration (:func:`profiler.evaluation.evaluate`).  Per ratio the flagship
(inf/leverage+correction) is served unless a candidate, on the same tasks, is shown not to be
worse by more than a tolerance with a confidence (a dearer one: better), the cheapest such one
(:func:`profiler.paired_decision.decide`; the candidates are listed cheapest to serve first,
:data:`profiler.evaluation_results.RECOMMENDATION_CANDIDATES`).  The section records the rule and
every task's outcome, so that ``evaluate-artifact --write-recommendation`` can add tasks and decide
again.  A candidate the calibration cannot serve (a section it needs is neither built nor present)
is left out, with a note; without the flagship the most accurate candidate is served, and the
section's ``rule`` says so.  The runtime serves the result with ``calibration.policy(compression_ratio=...)``.

The work runs on the main process after the other stages' sections are built (it needs them);
an interrupted run redoes it.
"""

from __future__ import annotations

import time

from artifacts import Section
from common.command_line import MAX_COUNT
from common.options import Choice, Integer, ListOf, Number, Option, Text
from needles.families import FAMILIES
from profiler.evaluation_results import COMPRESSION_GRID, RECOMMENDATION_CANDIDATES
from profiler.held_out_tasks import HAYSTACKS
from profiler.paired_decision import DEFAULT_CONFIDENCE, DEFAULT_TOLERANCE

from .base import Requirement, RopeRead, Stage

TASK_FAMILIES = tuple(FAMILIES)  # every needle family, those the model fails uncompressed included

DEFAULT_COMPRESSION_RATIOS = COMPRESSION_GRID
TASK_DEPTHS = (10.0, 50.0, 90.0)  # the profiled probes of the quick preset sit at 25 and 75


def recommendation_tasks(preset, *, families, haystacks, count: int, model_context: int):
    """The held-out tasks the recommendation stage of ``preset`` (a :class:`profiler.presets.ProfilePreset`)
    measures policies on: its probes' lengths, the stage's depths, seeds after the probes' own
    (:func:`profiler.held_out_tasks.held_out_tasks`)."""
    from needles import PRESETS as PROBE_PRESETS
    from profiler.held_out_tasks import held_out_tasks

    base = PROBE_PRESETS[preset.probes].replace(**dict(preset.probe_overrides))
    return held_out_tasks(
        base,
        families=tuple(families),
        haystacks=tuple(haystacks),
        depths=dict(preset.recommendation_depths) or TASK_DEPTHS,
        count=count,
        profiler_seed=base.seed,
        model_context=model_context,
    )


def _check_candidates(names) -> None:
    from profiler.recommendation import candidate_specs

    candidate_specs(names)


class RecommendationStage(Stage):
    name = "recommendation"
    section = "recommendation"
    summary = (
        "run held-out needle tasks (never the profiled probes) uncompressed and under candidate eviction "
        "policies at a grid of compression ratios; record per ratio the policy to serve (the flagship unless "
        "paired evidence on the same tasks shows a cheaper one not worse) and every task's outcome; "
        "calibration.policy(compression_ratio=...) serves it. On by default from the quick preset up."
    )
    options = (
        Option(
            "--recommend-policies",
            "recommend_policies",
            ListOf(Text("a policy name")),
            lambda preset: preset.recommendation_candidates or RECOMMENDATION_CANDIDATES,
            "candidate policies, cheapest to serve first (the first that passes the paired rule is served); "
            "default: the preset's (quick: the flagship alone), else " + ", ".join(RECOMMENDATION_CANDIDATES),
            check=_check_candidates,
        ),
        Option(
            "--recommend-compression-ratios",
            "recommend_compression_ratios",
            ListOf(Number(0.0, 1.0, low_open=True, high_open=True), distinct=True),
            DEFAULT_COMPRESSION_RATIOS,
            "compression ratios to recommend a policy for (default "
            f"{','.join(f'{r:g}' for r in DEFAULT_COMPRESSION_RATIOS)}); beyond the largest: the flagship",
        ),
        Option(
            "--recommend-families",
            "recommend_families",
            ListOf(Choice(TASK_FAMILIES), distinct=True),
            TASK_FAMILIES,
            "needle families of the held-out tasks (default: all, " + ",".join(TASK_FAMILIES) + ")",
        ),
        Option(
            "--recommend-haystacks",
            "recommend_haystacks",
            ListOf(Choice(HAYSTACKS), distinct=True),
            HAYSTACKS,
            "haystacks of the held-out tasks, each with its own seed (default: " + ",".join(HAYSTACKS) + ")",
        ),
        Option(
            "--recommend-count",
            "recommend_count",
            Integer(1, MAX_COUNT),
            lambda preset: max(1, preset.recommendation_count),
            "held-out tasks per (family, haystack, length, depth) cell (default: the preset's; 70 tasks on quick)",
        ),
        Option(
            "--recommend-tolerance",
            "recommend_tolerance",
            Number(0.0, 1.0),
            DEFAULT_TOLERANCE,
            f"accuracy (a fraction) a cheaper candidate may give up against the flagship, on the same tasks, "
            f"to replace it (default {DEFAULT_TOLERANCE:g})",
        ),
        Option(
            "--recommend-confidence",
            "recommend_confidence",
            Number(0.0, 1.0, low_open=True, high_open=True),
            DEFAULT_CONFIDENCE,
            f"one-sided confidence that it gives up no more (default {DEFAULT_CONFIDENCE:g})",
        ),
    )

    @classmethod
    def on_by_default(cls, preset) -> bool:
        return preset.recommendation_count > 0

    @classmethod
    def requires(cls, settings) -> tuple[Requirement, ...]:
        from profiler.recommendation import candidate_specs, sections_serving

        specs = candidate_specs(settings["recommend_policies"])
        ratio = float(settings["recommend_compression_ratios"][0])
        serving = tuple(sections for spec in specs for sections in sections_serving(spec, ratio))
        return (Requirement(f"the sections of at least one candidate ({', '.join(s.name for s in specs)})", serving),)

    @classmethod
    def rope_reads(cls, settings) -> tuple[RopeRead, ...]:
        from profiler.recommendation import candidate_specs
        from runtime.plan.rope_check import rope_needs

        ratio = float(settings["recommend_compression_ratios"][0])
        reads = []
        for spec in candidate_specs(settings["recommend_policies"]):
            keys, queries = rope_needs(spec.policy(ratio).build_scorer())
            if keys or queries:
                instead = "--recommend-policies inf/keydiff+correction"
                reads.append(RopeRead(spec.name, keys=keys, queries=queries, instead=instead))
        return tuple(reads)

    def __init__(self, context):
        from profiler.recommendation import candidate_specs

        super().__init__(context)
        settings = context.settings
        self.candidates = candidate_specs(settings["recommend_policies"])
        self.ratios = tuple(float(r) for r in settings["recommend_compression_ratios"])
        self.count = settings["recommend_count"]
        self.tolerance = float(settings["recommend_tolerance"])
        self.confidence = float(settings["recommend_confidence"])
        self.tasks = recommendation_tasks(
            context.preset,
            families=settings["recommend_families"],
            haystacks=settings["recommend_haystacks"],
            count=self.count,
            model_context=context.identity.max_position_embeddings or 4096,
        )

    def config(self) -> dict:
        return {
            "candidates": [spec.name for spec in self.candidates],
            "compression_ratios": list(self.ratios),
            "tasks": self.tasks.to_dict(),
            "question_aware": False,
            "max_new_tokens": self.context.preset.max_new_tokens,
            "tolerance": self.tolerance,
            "confidence": self.confidence,
        }

    def build(self, sections, config) -> Section:
        from profiler.evaluation import evaluate
        from profiler.recommendation import recommendation_section
        from runtime.plan.calibration import Calibration

        context = self.context
        started = time.perf_counter()
        calibration = Calibration.from_sections(context.out, context.identity, dict(config), dict(sections))
        candidates = []
        for spec in self.candidates:
            missing = spec.policy(self.ratios[0]).missing(calibration)
            if missing:
                self.say(f"recommendation: leaving out {spec.name}: {missing[0]}")
                continue
            candidates.append(spec)
        if not candidates:
            raise ValueError("recommendation: no candidate policy can be served by the sections of this artifact")
        probes = self.tasks.probes(context.tokenizer)
        evaluation = evaluate(
            context.model,
            context.tokenizer,
            probes,
            candidates,
            list(self.ratios),
            calibration=calibration,
            max_new_tokens=context.preset.max_new_tokens,
            progress=context.progress and context.info.is_main,
        )
        section = recommendation_section(
            evaluation,
            [spec.name for spec in candidates],
            self.tasks.seed,
            ",".join(self.tasks.families),
            tolerance=self.tolerance,
            confidence=self.confidence,
        )
        rule = section["rule"][0].decode()
        if section["reference"][0] < 0:
            self.say(f"recommendation: the flagship is not among the candidates served; rule {rule}")
        served = zip(section["compression_ratios"], section["policy"], section["accuracy"], strict=True)
        self.say(
            f"recommendation: {len(probes)} held-out tasks, baseline {evaluation['baseline']['accuracy']:.2f}, "
            f"rule {rule}; "
            + "; ".join(f"{ratio:g}: {policy.decode()} {accuracy:.2f}" for ratio, policy, accuracy in served)
            + f"; {time.perf_counter() - started:.1f} s"
        )
        return section
