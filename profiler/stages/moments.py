"""The ``moments`` stage: which MomentKV correction order helps each KV head.

MomentKV ("MomentKV: Closing the Directional Gap in KV Cache Eviction for Long-Context
Inference") corrects attention over a compressed cache with the moments of the evicted keys
and values.  Whether the 0th- or 1st-order correction helps a head is measured on the first
``MOMENT_WINDOWS`` calibration windows (:func:`profiler.moments.measure_correction_errors`:
per KV head, the relative attention-output error of no / 0th / 1st-order correction at two
reference compressions, tokens selected by ``--moments-selection``).  A few seconds per
window, run by the main process alone after the sharded stages, not checkpointed.

The orders are calibrated under one selection, the one a serving policy should use them with
(the runtime warns otherwise): by default the learned scorer with the global allocation (the
``global/learned+correction`` candidate) when the job builds or the artifact has a
``learned_scorer`` section, else KeyDiff with per-head budgets (``inf/keydiff+correction``).
"""

from __future__ import annotations

import time

import numpy as np

from artifacts import Section
from profiler.options import Choice, Option
from runtime.names import MOMENT_SELECTIONS as MOMENTS_SELECTIONS

from .base import Requirement, Stage

MOMENT_WINDOWS = 4  # calibration windows the stage measures on
MOMENT_KEEP_RATIOS = (0.25, 0.5)  # reference budgets: 75% and 50% compression
# the selection when none is asked: the learned scorer if there are learned weights (the scorer of
# the global/learned+correction recommendation candidate), else KeyDiff (inf/keydiff+correction's)
DEFAULT_SELECTIONS = ("learned", "keydiff")


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
            Choice(MOMENTS_SELECTIONS),
            None,
            "scorer that selects the kept tokens while the correction errors are measured; "
            "serve corrections with the same scorer (the runtime warns otherwise); 'learned' shares each "
            "compression's total out globally, as global/learned+correction serves it, and needs the "
            "learned_scorer section (built in this run or in the artifact). Default: learned when that "
            "section is there, else keydiff (the scorer of inf/keydiff+correction)",
        ),
    )

    @classmethod
    def requires(cls, settings) -> tuple[Requirement, ...]:
        if settings["moments_selection"] == "learned":
            return (
                Requirement.section("learned_scorer", "the learned scorer's weights (--moments-selection learned)"),
            )
        return ()

    def __init__(self, context):
        super().__init__(context)
        has_weights = "learned-scorer" in context.stage_names or "learned_scorer" in context.existing_sections
        self.selection = context.settings["moments_selection"] or (
            DEFAULT_SELECTIONS[0] if has_weights else DEFAULT_SELECTIONS[1]
        )
        tokens = context.settings["calib_tokens"]
        query_window = max(4, min(32, tokens // 4))
        self.moment_settings = {
            "query_window": query_window,
            "observation_window": max(1, min(32, (tokens - query_window) // 2)),
            "selection": self.selection,
            "allocation": "global" if self.selection == "learned" else "uniform",
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
        from profiler.moments import measure_correction_errors  # torch: not for the parser

        started = time.perf_counter()
        settings = self.moment_settings
        windows = self.context.windows[:MOMENT_WINDOWS]
        learned = None
        if settings["selection"] == "learned":
            learned = (sections["learned_scorer"]["weights"], sections["learned_scorer"]["bias"])
        result = measure_correction_errors(
            self.context.model,
            windows,
            keep_ratios=MOMENT_KEEP_RATIOS,
            query_window=settings["query_window"],
            scorer=settings["selection"],
            allocation=settings["allocation"],
            learned=learned,
            observation_window=settings["observation_window"],
            n_sink=settings["n_sink"],
            recent_window=settings["recent_window"],
            progress=self.context.progress,
        )
        errors = result["errors"].mean(axis=(2, 3))  # [R, 3]
        chosen = np.take_along_axis(result["errors"], (result["order"].astype(np.int64) + 1)[None, None], axis=1)
        parts = ", ".join(
            f"keep {r:g}: none {e[0]:.3f} / 0th {e[1]:.3f} / 1st {e[2]:.3f} / chosen {c:.3f}"
            for r, e, c in zip(result["reference_ratios"], errors, chosen.mean(axis=(1, 2, 3)), strict=True)
        )
        counts = {name: int((result["order"] == value).sum()) for name, value in (("none", -1), ("0th", 0), ("1st", 1))}
        self.say(
            f"moments: {windows.shape[0]} windows x {windows.shape[1]} tokens, mean relative attention-output "
            f"error {parts}; orders {counts}; {time.perf_counter() - started:.1f} s"
        )
        return Section(arrays=result)
