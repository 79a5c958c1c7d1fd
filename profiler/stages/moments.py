"""The ``moments`` stage: which MomentKV correction order helps each KV head.

MomentKV ("MomentKV: Closing the Directional Gap in KV Cache Eviction for Long-Context
Inference") corrects attention over a compressed cache with the moments of the evicted keys
and values.  Whether the 0th- or 1st-order correction helps a head is measured on the first
``MOMENT_WINDOWS`` calibration windows (:func:`profiler.moments.measure_correction_errors`:
per KV head, the relative attention-output error of no / 0th / 1st-order correction at two
reference compressions, tokens selected by ``--moments-selection``).  A few seconds per
window, run by the main process alone after the sharded stages, not checkpointed.

The orders are calibrated under every selection a serving policy uses them with, over one captured
forward pass per window (:func:`profiler.moments.measure_correction_errors_by_selection`), and the
runtime serves each policy the orders of its own scorer.  By default (:func:`default_selections`)
these are the scorers of the flagship (``inf/leverage+correction``: leverage, first, the orders a 1.4
reader serves) and of the recommendation candidates with ``+correction`` (KeyDiff, and the learned
scorer with the global allocation when the job builds or the artifact has a ``learned_scorer``
section).
"""

from __future__ import annotations

import time

import numpy as np

from artifacts import Section
from common.names import MOMENT_SELECTIONS as MOMENTS_SELECTIONS
from common.options import Choice, ListOf, Option

from .base import Requirement, RopeRead, Stage

MOMENT_WINDOWS = 4  # calibration windows the stage measures on
MOMENT_KEEP_RATIOS = (0.25, 0.5)  # reference budgets: 75% and 50% compression


def selection_allocation(selection: str) -> str:
    """How a selection's reference budgets are shared out: the learned scorer's globally, as
    ``global/learned+correction`` serves it; every other per head (uniform)."""
    return "global" if selection == "learned" else "uniform"


def default_selections(has_learned_weights: bool) -> tuple[str, ...]:
    """The scorers of the flagship and of the recommendation candidates that serve ``+correction``
    (``correction='calibrated'``), the flagship's first, each once; the learned scorer only with its
    weights, and only scorers the calibration can select with (``MOMENT_SELECTIONS``)."""
    from profiler.evaluation_results import RECOMMENDATION_CANDIDATES  # torch: not for the parser
    from runtime.plan.policy_spec import FLAGSHIP, parse_policy

    selections = []
    for spec in (FLAGSHIP, *(parse_policy(text) for text in RECOMMENDATION_CANDIDATES)):
        scorer = spec.scorer
        if spec.options.get("correction") != "calibrated" or scorer not in MOMENTS_SELECTIONS or scorer in selections:
            continue
        if scorer == "learned" and not has_learned_weights:
            continue
        selections.append(scorer)
    return tuple(selections)


class MomentsStage(Stage):
    name = "moments"
    section = "moments"
    summary = (
        "per KV head, the MomentKV correction order (none, 0th, 1st) with the lowest attention-output "
        "error on calibration text at 75% and 50% compression."
    )
    options = (
        Option(
            "--moments-selection",
            "moments_selection",
            ListOf(Choice(MOMENTS_SELECTIONS), distinct=True),
            None,
            "scorers that select the kept tokens while the correction errors are measured, each stored with "
            "its orders; 'learned' needs the learned_scorer section. Default: those of the flagship and the "
            "recommendation candidates that serve +correction (README: profile-model's options)",
        ),
    )

    @classmethod
    def requires(cls, settings) -> tuple[Requirement, ...]:
        if "learned" in (settings["moments_selection"] or ()):
            return (
                Requirement.section("learned_scorer", "the learned scorer's weights (--moments-selection learned)"),
            )
        return ()

    @classmethod
    def rope_reads(cls, settings) -> tuple[RopeRead, ...]:
        selections = settings["moments_selection"] or default_selections(has_learned_weights=False)
        return tuple(
            RopeRead(f"the {selection} selection", instead="--moments-selection keydiff")
            for selection in selections
            if selection in ("leverage", "learned")  # they un-rotate the keys (KeyRope)
        )

    def __init__(self, context):
        super().__init__(context)
        has_weights = "learned-scorer" in context.stage_names or "learned_scorer" in context.existing_sections
        given = context.settings["moments_selection"]
        self.selections = tuple(given) if given else default_selections(has_weights)
        tokens = context.settings["calib_tokens"]
        query_window = max(4, min(32, tokens // 4))
        self.moment_settings = {
            "query_window": query_window,
            "observation_window": max(1, min(32, (tokens - query_window) // 2)),
            "selection": self.selections[0],  # the default orders' (order, errors), as files of 1.4 record it
            "allocation": selection_allocation(self.selections[0]),
            "selections": list(self.selections),
            "allocations": [selection_allocation(selection) for selection in self.selections],
            "n_sink": int(context.settings["n_sink"]),
            "recent_window": 8,
        }

    def config(self) -> dict:
        return {
            "windows": min(MOMENT_WINDOWS, self.settings["calib_samples"]),
            "window_tokens": self.settings["calib_tokens"],
            **self.moment_settings,
            "keep_ratios": list(MOMENT_KEEP_RATIOS),
            "source": self.context.calibration_config()["source"],
        }

    def build(self, sections, config) -> Section:
        from profiler.moments import measure_correction_errors_by_selection  # torch: not for the parser

        started = time.perf_counter()
        settings = self.moment_settings
        windows = self.context.windows[:MOMENT_WINDOWS]
        learned = None
        if "learned" in self.selections:
            learned = (sections["learned_scorer"]["weights"], sections["learned_scorer"]["bias"])
        results = measure_correction_errors_by_selection(
            self.context.model,
            windows,
            list(zip(settings["selections"], settings["allocations"], strict=True)),
            keep_ratios=MOMENT_KEEP_RATIOS,
            query_window=settings["query_window"],
            learned=learned,
            observation_window=settings["observation_window"],
            n_sink=settings["n_sink"],
            recent_window=settings["recent_window"],
            progress=self.context.progress,
        )
        measured = sum(result.seconds for result in results)
        elapsed = time.perf_counter() - started
        for result in results:
            self.say(
                f"moments under {result.selection} ({result.allocation}): {_describe(result)}; {result.seconds:.1f} s"
            )
        self.say(
            f"moments: {windows.shape[0]} windows x {windows.shape[1]} tokens, {len(results)} selection(s); "
            f"{elapsed:.1f} s ({elapsed - measured:.1f} s in the shared forward passes)"
        )
        first = results[0]
        return Section(
            arrays={
                **first,  # order, errors, reference_ratios, tau: the default (first) selection's
                "selections": np.array([r.selection.encode("ascii") for r in results], dtype="S128"),
                "selection_allocations": np.array([r.allocation.encode("ascii") for r in results], dtype="S128"),
                "selection_orders": np.stack([r["order"] for r in results]),  # [S, L, Hkv]
                "selection_errors": np.stack([r["errors"] for r in results]),  # [S, R, 3, L, Hkv]
            }
        )


def _describe(result) -> str:
    """The mean relative attention-output errors of one selection, and how many heads chose each order."""
    errors = result["errors"].mean(axis=(2, 3))  # [R, 3]
    chosen = np.take_along_axis(result["errors"], (result["order"].astype(np.int64) + 1)[None, None], axis=1)
    parts = ", ".join(
        f"keep {r:g}: none {e[0]:.3f} / 0th {e[1]:.3f} / 1st {e[2]:.3f} / chosen {c:.3f}"
        for r, e, c in zip(result["reference_ratios"], errors, chosen.mean(axis=(1, 2, 3)), strict=True)
    )
    counts = {name: int((result["order"] == value).sum()) for name, value in (("none", -1), ("0th", 0), ("1st", 1))}
    return f"mean relative attention-output error {parts}; orders {counts}"
