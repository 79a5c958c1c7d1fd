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

import argparse
import time

import numpy as np

from artifacts import Section
from profiler.arguments import comma_separated, number_in

from .base import Stage

# profiler.budget_curves' defaults, spelled out so that the parser needs no torch (tested equal)
CURVE_GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
CURVE_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)
CURVE_FLOOR = 0.25
RETENTION_WEIGHT = 1.0
SELECTIONS = ("keydiff", "leverage")
RETENTION_QUERIES = ("question", "answer")  # whose attention the retention loss follows
# The answer's retrieval hits: on the embedded model (54 held-out tasks, KeyDiff selection) curve/keydiff
# kept 0.85 / 0.69 of them at 75 / 90% compression with it and 0.43 / 0.07 with the question's mass
# (profiler.budget_curves, "Measured").
DEFAULT_RETENTION = "answer"
N_SINK, WINDOW = 4, 32  # CompressionPolicy's defaults: the tokens the engine always keeps


class BudgetCurvesStage(Stage):
    name = "budget-curves"
    section = "budget_curves"
    summary = (
        "per KV head, how attention-output error on calibration text and the needle's lost retrieval hits "
        "(REAL's, at the probes' answer steps) fall as the head's kept fraction grows (KeyDiff selection by "
        "default); per compression ratio, budgets by marginal utility on those curves (LU-KV), served as "
        "allocation 'curve'."
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("budget-curves stage")
        group.add_argument(
            "--curve-selection",
            choices=SELECTIONS,
            default=None,
            help="scorer that picks the kept tokens while the curves are measured (default keydiff)",
        )
        group.add_argument(
            "--curve-compression-ratios",
            type=comma_separated(number_in(0.0, 1.0, low_open=True, high_open=True)),
            default=None,
            help="compression ratios (fractions evicted) to allocate; the runtime interpolates between them "
            f"(default {','.join(f'{r:g}' for r in CURVE_RATIOS)})",
        )
        group.add_argument(
            "--curve-floor",
            type=number_in(0.0, 1.0),
            default=None,
            help=f"every head keeps at least this share of the average kept fraction (default {CURVE_FLOOR:g})",
        )
        group.add_argument(
            "--curve-retention",
            choices=RETENTION_QUERIES,
            default=None,
            help="retention loss: 'question' = the question tokens' attention mass on evicted R tokens; "
            "'answer' = the probe's answer appended (teacher forcing) and REAL's retrieval hits of its steps "
            f"(most attended token an R token) whose token is evicted (default {DEFAULT_RETENTION})",
        )
        group.add_argument(
            "--curve-retention-weight",
            type=number_in(0.0),
            default=None,
            help="weight of the (normalised) R-span retention loss against the (normalised) attention-output "
            f"error (default {RETENTION_WEIGHT:g})",
        )

    def __init__(self, job):
        super().__init__(job)
        self.selection = job.setting("curve_selection", "keydiff")
        self.ratios = tuple(sorted(float(r) for r in job.setting("curve_compression_ratios", CURVE_RATIOS)))
        self.floor = float(job.setting("curve_floor", CURVE_FLOOR))
        self.retention_weight = float(job.setting("curve_retention_weight", RETENTION_WEIGHT))
        self.retention = job.setting("curve_retention", DEFAULT_RETENTION)
        if self.retention not in RETENTION_QUERIES:
            raise ValueError(
                f"unknown curve retention {self.retention!r}; choose one of {', '.join(RETENTION_QUERIES)}"
            )
        if self.selection not in SELECTIONS:
            raise ValueError(f"unknown curve selection {self.selection!r}; choose one of {', '.join(SELECTIONS)}")
        if not self.ratios or any(not 0.0 < r < 1.0 for r in self.ratios) or len(set(self.ratios)) != len(self.ratios):
            raise ValueError(f"curve compression ratios must be distinct and in (0, 1), got {self.ratios}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(f"the curve floor must lie in [0, 1], got {self.floor}")
        if not self.retention_weight >= 0.0:
            raise ValueError(f"the retention weight must be >= 0, got {self.retention_weight}")
        # the last tokens of each calibration window play the future queries (32, fewer in short windows)
        self.query_window = max(4, min(32, job.calib_tokens // 4))

    def prepare(self) -> None:

        job = self.job
        self.probes = job.probes()  # the behaviour stage's probes

    def config(self) -> dict:
        job = self.job
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
            "windows": job.calib_samples,
            "window_tokens": job.calib_tokens,
            "probes": len(self.probes),
            "probes_sha256": self.probes.digest,
            "source": job.calibration_config()["source"],
        }

    def build(self, sections: dict[str, Section]) -> Section:
        from profiler.budget_curves import measure_curves  # torch: not for the parser

        started = time.perf_counter()
        job = self.job
        probes = [self.probes[i] for i in range(len(self.probes))]
        answers = None
        if self.retention == "answer":
            answers = [job.tokenizer.encode(probe.answer, add_special_tokens=False) for probe in probes]
        measured = measure_curves(
            job.model,
            job.windows,
            probes,
            grid=CURVE_GRID,
            selection=self.selection,
            query_window=self.query_window,
            n_sink=N_SINK,
            window=WINDOW,
            answers=answers,
            progress=job.options.progress,
        )
        section = curve_section(measured, CURVE_GRID, self.ratios, self.floor, self.retention_weight)
        fractions = section["fractions"]
        detail = "; ".join(
            f"{r:g}: {row.min():.3f}..{row.max():.3f}"
            for r, row in zip(section["compression_ratios"], fractions, strict=True)
            if r in (0.5, 0.75, 0.9)
        )
        self.say(
            f"budget-curves: {job.windows.shape[0]} windows, {measured['probes']} probes, {self.selection} selection; "
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
