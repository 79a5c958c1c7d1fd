"""The calibration report: one self-contained HTML page (inline SVG, no network assets).

``render_report(reader, evaluation=None, budget=256)`` draws, from a validated artifact:

* heatmaps layer x head of RAsc, LCsc, INFsc and of the per-KV-head budgets at an average
  budget (the ``budgets`` section's table for that budget, or the nearest one it has);
* heatmaps of the ``budget_curves`` section's per-KV-head kept fractions at compression ratios
  0.5, 0.75, 0.9, 0.95 and 0.975 (those of its grid);
* the query-statistics summary: per-head mean-query norm and covariance trace;
* the moments table: per-KV-head correction order and error reduction;
* with ``evaluation`` (the JSON ``evaluate-artifact`` writes): accuracy-vs-compression curves
  per policy, with the uncompressed baseline as a line;
* the artifact's identity and configuration.

Rendering needs jinja2 (imported here, not by ``artifacts`` itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .reader import ArtifactReader
from .summary import summarize

# Viridis, sampled at 9 points; values in between are interpolated linearly.
_VIRIDIS = np.array(
    [
        [68, 1, 84],
        [71, 44, 122],
        [59, 81, 139],
        [44, 113, 142],
        [33, 144, 141],
        [39, 173, 129],
        [92, 200, 99],
        [170, 220, 50],
        [253, 231, 37],
    ],
    dtype=np.float64,
)
CELL = 14  # heatmap cell size, px
CHART_W, CHART_H = 520, 300


def colour(value: float) -> str:
    """Viridis colour of ``value`` in [0, 1] as ``#rrggbb``."""
    position = float(np.clip(value, 0.0, 1.0)) * (len(_VIRIDIS) - 1)
    low = int(np.floor(position))
    high = min(low + 1, len(_VIRIDIS) - 1)
    rgb = _VIRIDIS[low] + (position - low) * (_VIRIDIS[high] - _VIRIDIS[low])
    return "#" + "".join(f"{int(round(c)):02x}" for c in rgb)


def heatmap(title: str, values: np.ndarray, column_label: str, fmt: str = "{:.3f}") -> dict:
    """A view model for one ``[layers, heads]`` heatmap: cells with colours and tooltips."""
    values = np.asarray(values, dtype=np.float64)
    low, high = float(values.min()), float(values.max())
    span = high - low if high > low else 1.0
    cells = [
        {
            "x": 30 + col * CELL,
            "y": 20 + row * CELL,
            "fill": colour((values[row, col] - low) / span),
            "tip": f"layer {row}, {column_label} {col}: {fmt.format(values[row, col])}",
        }
        for row in range(values.shape[0])
        for col in range(values.shape[1])
    ]
    return {
        "title": title,
        "cells": cells,
        "rows": values.shape[0],
        "cols": values.shape[1],
        "width": max(30 + values.shape[1] * CELL + 10, 150),
        "height": 20 + values.shape[0] * CELL + 30,
        "low": fmt.format(low),
        "high": fmt.format(high),
        "cell": CELL,
        "column_label": column_label,
        "row_ticks": [{"y": 20 + r * CELL + CELL - 3, "label": r} for r in range(0, values.shape[0], 5)],
        "gradient": [colour(i / 8) for i in range(9)],
    }


def accuracy_chart(evaluation: dict) -> dict | None:
    """A view model of accuracy vs compression ratio per policy (None without results)."""
    results = [r for r in evaluation.get("results", []) if r.get("compression_ratio") is not None]
    if not results:
        return None
    ratios = sorted({float(r["compression_ratio"]) for r in results})
    x_low, x_high = min(ratios + [0.0]), max(ratios + [1.0])

    def x(ratio: float) -> float:
        return 50 + (ratio - x_low) / (x_high - x_low) * (CHART_W - 70)

    def y(accuracy: float) -> float:
        return CHART_H - 40 - accuracy * (CHART_H - 60)

    policies = []
    for index, name in enumerate(sorted({r["policy"] for r in results})):
        points = sorted((float(r["compression_ratio"]), float(r["accuracy"])) for r in results if r["policy"] == name)
        hue = (index * 67) % 360
        policies.append(
            {
                "name": name,
                "stroke": f"hsl({hue}, 70%, 42%)",
                "points": " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in points),
                "dots": [
                    {"cx": round(x(a), 1), "cy": round(y(b), 1), "tip": f"{name} @ {a:g}: {b:.2f}"} for a, b in points
                ],
            }
        )
    baseline = evaluation.get("baseline", {}).get("accuracy")
    return {
        "width": CHART_W,
        "height": CHART_H,
        "policies": policies,
        "baseline_y": None if baseline is None else round(y(float(baseline)), 1),
        "baseline": baseline,
        "x_ticks": [{"x": round(x(r), 1), "label": f"{r:g}"} for r in ratios],
        "y_ticks": [{"y": round(y(a), 1), "label": f"{a:.2f}"} for a in (0.0, 0.25, 0.5, 0.75, 1.0)],
        "x0": 50,
        "x1": CHART_W - 20,
        "y0": CHART_H - 40,
        "y1": 20,
    }


def _budget_table(reader: ArtifactReader, budget: int) -> tuple[int, np.ndarray] | None:
    if not reader.has("budgets"):
        return None
    section = reader.section("budgets")
    budgets = section["token_budgets"]
    index = int(np.argmin(np.abs(budgets - budget)))
    return int(budgets[index]), section["token_tables"][index]


def build_view(reader: ArtifactReader, evaluation: dict | None = None, budget: int = 256) -> dict:
    """Everything the template shows, as plain data."""
    summary = summarize(reader)
    heatmaps, moments_rows = [], []
    if reader.has("behaviour"):
        behaviour = reader.section("behaviour")
        for name in ("RAsc", "LCsc", "INFsc"):
            heatmaps.append(heatmap(f"{name} per query head", behaviour[name], "head"))
    chosen = _budget_table(reader, budget)
    if chosen is not None:
        heatmaps.append(
            heatmap(f"Budget per KV head at an average of {chosen[0]} tokens", chosen[1], "KV head", "{:.0f}")
        )
    if reader.has("budget_curves"):
        curves = reader.section("budget_curves")
        selection = (reader.config.get("budget_curves") or {}).get("selection", "unrecorded")
        for ratio, row in zip(curves["compression_ratios"], curves["fractions"], strict=True):
            if round(float(ratio), 6) in (0.5, 0.75, 0.9, 0.95, 0.975):
                heatmaps.append(
                    heatmap(
                        f"Budget curve: kept fraction per KV head at compression ratio {float(ratio):g} "
                        f"({selection} selection)",
                        row,
                        "KV head",
                        "{:.3f}",
                    )
                )
    if reader.has("query_stats"):
        stats = reader.section("query_stats")
        heatmaps.append(heatmap("Mean-query norm (pre-RoPE)", np.linalg.norm(stats["mean"], axis=-1), "head", "{:.2f}"))
        heatmaps.append(heatmap("Query covariance trace", np.trace(stats["cov"], axis1=-2, axis2=-1), "head", "{:.2f}"))
    if reader.has("learned_scorer"):
        fit = reader.section("learned_scorer")
        heatmaps.append(
            heatmap(
                "Learned scorer: held-out rank correlation with the teacher",
                fit["rank_correlation"],
                "KV head",
                "{:.2f}",
            )
        )
    if reader.has("moments"):
        moments = reader.section("moments")
        names = {-1: "none", 0: "0th", 1: "1st"}
        errors = moments["errors"].mean(axis=0)  # [3, L, Hkv], averaged over reference ratios
        for layer in range(moments["order"].shape[0]):
            for head in range(moments["order"].shape[1]):
                order = int(moments["order"][layer, head])
                plain, best = errors[0, layer, head], errors[order + 1, layer, head]
                moments_rows.append(
                    {
                        "layer": layer,
                        "head": head,
                        "order": names[order],
                        "error_none": f"{plain:.4f}",
                        "error_chosen": f"{best:.4f}",
                        "reduction": f"{(1 - best / plain) * 100:.1f}%" if plain > 0 else "-",
                    }
                )
    return {
        "summary": summary,
        "model_rows": sorted(summary["model"].items()),
        "config_rows": sorted(
            (k, v if isinstance(v, str) else json.dumps(v, sort_keys=True)) for k, v in summary["config"].items()
        ),
        "heatmaps": heatmaps,
        "moments_rows": moments_rows,
        "chart": accuracy_chart(evaluation) if evaluation else None,
        "evaluation": evaluation,
    }


def render_report(reader: ArtifactReader, evaluation: dict | None = None, budget: int = 256) -> str:
    """The report as one HTML document."""
    import jinja2

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return environment.get_template("report.html.jinja").render(**build_view(reader, evaluation, budget))


def write_report(path: str | Path, reader: ArtifactReader, evaluation: dict | None = None, budget: int = 256) -> Path:
    """Render the report and write it atomically (``common.atomic.OutputError`` when it cannot be written)."""
    from common.atomic import write_atomic

    return write_atomic(path, render_report(reader, evaluation, budget), what="HTML report")
