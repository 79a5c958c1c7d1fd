"""The ``budget-curves`` stage: per-head loss curves and per-ratio budgets by marginal utility.

LU-KV (arXiv 2602.08585) learns per-head budgets per (model, compression ratio) and ships them as a
``[ratio, L, H]`` curve.  This stage measures, per KV head, how attention-output error on
calibration text and the needle's lost R-span attention on the behaviour probes fall as the
head's kept fraction grows (:func:`profiler.budget_curves.measure_curves`, under one selection
scorer, KeyDiff by default), then allocates each compression ratio of a grid by marginal
utility on the convex hulls of those curves (:func:`profiler.budget_curves.allocate_fractions`),
with the total conserved exactly and a per-head floor.  The runtime serves it as
``allocation="curve"``.  One forward pass per calibration window and per probe, run by the main
process after the sharded stages, not checkpointed.
"""

from __future__ import annotations

import time

import numpy as np

from artifacts import Section
from common.options import Choice, ListOf, Number, Option
from profiler.budget_curves import CURVE_FLOOR, CURVE_GRID, CURVE_RATIOS, RETENTION_WEIGHT, SELECTIONS

from .base import RopeRead, Stage

RETENTION_QUERIES = ("question", "answer")  # whose attention the retention loss follows
# The answer's retrieval hits: the question's attention mass gave curves far below INF's budgets
# (docs/results.md R-budget-curves-2026-11-22, R-budget-curves-question-2026-11-22).
DEFAULT_RETENTION = "answer"
N_SINK, WINDOW = 4, 32  # CompressionPolicy's defaults: the tokens the engine always keeps


class BudgetCurvesStage(Stage):
    name = "budget-curves"
    section = "budget_curves"
    summary = (
        "per KV head, how attention-output error on calibration text and the needle's lost retrieval hits "
        "(REAL's, at the probes' answer steps) fall as the head's kept fraction grows (KeyDiff selection by "
        "default); per compression ratio, budgets by marginal utility on those curves (LU-KV), served as "
        "allocation 'curve'. Off by default on the quick preset (make profile's time; --stages runs it)."
    )
    options = (
        Option(
            "--curve-selection",
            "curve_selection",
            Choice(SELECTIONS),
            "keydiff",
            "scorer that picks the kept tokens while the curves are measured (default keydiff)",
        ),
        Option(
            "--curve-compression-ratios",
            "curve_compression_ratios",
            ListOf(Number(0.0, 1.0, low_open=True, high_open=True), distinct=True),
            CURVE_RATIOS,
            "compression ratios (fractions evicted) to allocate; the runtime interpolates between them "
            f"(default {','.join(f'{r:g}' for r in CURVE_RATIOS)})",
        ),
        Option(
            "--curve-floor",
            "curve_floor",
            Number(0.0, 1.0),
            CURVE_FLOOR,
            f"every head keeps at least this share of the average kept fraction (default {CURVE_FLOOR:g})",
        ),
        Option(
            "--curve-retention",
            "curve_retention",
            Choice(RETENTION_QUERIES),
            DEFAULT_RETENTION,
            "retention loss: the question tokens' attention on evicted R tokens, or the answer's retrieval "
            f"hits whose token is evicted (default {DEFAULT_RETENTION})",
        ),
        Option(
            "--curve-retention-weight",
            "curve_retention_weight",
            Number(0.0),
            RETENTION_WEIGHT,
            "weight of the (normalised) R-span retention loss against the (normalised) attention-output "
            f"error (default {RETENTION_WEIGHT:g})",
        ),
    )

    @classmethod
    def rope_reads(cls, settings) -> tuple[RopeRead, ...]:
        if settings["curve_selection"] == "leverage":  # it un-rotates the keys (KeyRope)
            return (RopeRead("the leverage selection", instead="--curve-selection keydiff"),)
        return ()

    def __init__(self, context):
        super().__init__(context)
        settings = context.settings
        self.selection = settings["curve_selection"]
        self.ratios = tuple(sorted(float(r) for r in settings["curve_compression_ratios"]))
        self.floor = float(settings["curve_floor"])
        self.retention_weight = float(settings["curve_retention_weight"])
        self.retention = settings["curve_retention"]
        # the last tokens of each calibration window play the future queries (32, fewer in short windows)
        self.query_window = max(4, min(32, settings["calib_tokens"] // 4))
        self.probes = context.probes()  # the behaviour stage's probes

    def config(self) -> dict:
        context = self.context
        return {
            "selection": self.selection,
            "grid": list(CURVE_GRID),
            "compression_ratios": list(self.ratios),
            "floor": self.floor,
            "retention_weight": self.retention_weight,
            "retention": self.retention,
            "query_window": self.query_window,
            "n_sink": N_SINK,
            "window": WINDOW,
            "windows": self.settings["calib_samples"],
            "window_tokens": self.settings["calib_tokens"],
            "probes": len(self.probes),
            "probes_sha256": self.probes.digest,
            "source": context.calibration_config()["source"],
        }

    def build(self, sections, config) -> Section:
        from profiler.budget_curves import measure_curves  # torch: not for the parser

        started = time.perf_counter()
        context = self.context
        probes = [self.probes[i] for i in range(len(self.probes))]
        answers = None
        if self.retention == "answer":
            answers = [context.tokenizer.encode(probe.answer, add_special_tokens=False) for probe in probes]
        measured = measure_curves(
            context.model,
            context.windows,
            probes,
            grid=CURVE_GRID,
            selection=self.selection,
            query_window=self.query_window,
            n_sink=N_SINK,
            window=WINDOW,
            answers=answers,
            progress=context.progress,
        )
        section = curve_section(measured, CURVE_GRID, self.ratios, self.floor, self.retention_weight)
        fractions = section["fractions"]
        detail = "; ".join(
            f"{r:g}: {row.min():.3f}..{row.max():.3f}"
            for r, row in zip(section["compression_ratios"], fractions, strict=True)
            if r in (0.5, 0.75, 0.9, 0.95, 0.975)
        )
        self.say(
            f"budget-curves: {context.windows.shape[0]} windows, {measured['probes']} probes, "
            f"{self.selection} selection; "
            f"mean output error at kept {CURVE_GRID[0]:g} / 0.1 / 0.5: "
            + " / ".join(
                f"{measured['output_error'][CURVE_GRID.index(f)].mean():.3f}" for f in (CURVE_GRID[0], 0.1, 0.5)
            )
            + f"; per-head kept fractions {detail}; {time.perf_counter() - started:.1f} s"
        )
        return section


def curve_section(measured: dict, grid, ratios, floor: float, retention_weight: float):
    """The ``budget_curves`` section from :func:`profiler.budget_curves.measure_curves`'s result."""
    from profiler.budget_curves import allocate_fractions, combined_loss

    ratios = np.asarray(sorted(float(r) for r in ratios), dtype=np.float64)
    loss = combined_loss(measured["output_error"], measured["retention_loss"], retention_weight)
    fractions = allocate_fractions(loss, grid, 1.0 - ratios, floor)
    # exact conservation after floating-point accumulation: the residual goes to the head with the most room
    for r, keep in enumerate(1.0 - ratios):
        row = fractions[r].reshape(-1)
        residual = keep * row.size - row.sum()
        room = np.argmax(1.0 - row) if residual > 0 else np.argmax(row)
        row[room] = min(max(row[room] + residual, 0.0), 1.0)
    return Section(
        arrays={
            "compression_ratios": ratios,
            "fractions": fractions.astype(np.float64),
            "grid": np.asarray(grid, dtype=np.float64),
            "output_error": np.asarray(measured["output_error"], dtype=np.float64),
            "retention_loss": np.clip(np.asarray(measured["retention_loss"], dtype=np.float64), 0.0, 1.0),
            "loss": loss.astype(np.float64),
        },
    )
