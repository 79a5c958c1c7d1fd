"""A compact, JSON-able summary of a validated artifact: what ``inspect-artifact`` prints."""

from __future__ import annotations

import json

import numpy as np

from .reader import ArtifactReader
from .schema import OPTIONAL_MODEL_ATTRS


def _paired_evidence(rec, candidates: list[str]) -> dict | None:
    """The rule the recommendation was decided by and, per ratio and candidate, the paired wins,
    losses and bound against the reference (schema 1.4; None for older files)."""
    if "rule" not in rec.arrays:
        return None
    references = [int(i) for i in rec["reference"]]
    return {
        "rule": rec["rule"][0].decode("ascii"),
        "tolerance": float(rec["tolerance"][0]),
        "confidence": float(rec["confidence"][0]),
        "reference": [candidates[i] if i >= 0 else None for i in references],
        "evidence": [
            {
                name: {"wins": int(w), "losses": int(lo), "bound": float(b)}
                for name, w, lo, b in zip(candidates, wins, losses, bounds, strict=True)
            }
            for wins, losses, bounds in zip(rec["wins"], rec["losses"], rec["bound"], strict=True)
        ],
    }


def _range(array: np.ndarray) -> dict:
    array = np.asarray(array, dtype=np.float64)
    return {"min": float(array.min()), "mean": float(array.mean()), "max": float(array.max())}


def summarize(reader: ArtifactReader) -> dict:
    """Read (and so validate) every section and describe it with a few key figures."""
    model = reader.model
    summary = {
        "path": str(reader.path),
        "valid": True,
        "schema_version": reader.schema_version,
        "toolkit_version": reader.toolkit_version,
        "created": reader.created,
        "model": {
            name: getattr(model, name)
            for name in model.__dataclass_fields__
            if name not in OPTIONAL_MODEL_ATTRS or getattr(model, name)  # absent optional attributes
        },
        "config": reader.config,
        "sections": {},
    }
    sections = summary["sections"]
    if reader.has("behaviour"):
        b = reader.section("behaviour")
        infsc = b["INFsc"]
        top = np.argsort(-infsc, axis=None, kind="stable")[:5]
        families, counts = np.unique(b["probe_family"], return_counts=True)
        sections["behaviour"] = {
            "probes": int(b["probe_length"].size),
            "success_rate": float(b["probe_success"].mean()),
            "families": {f.decode("ascii"): int(c) for f, c in zip(families, counts, strict=True)},
            "lengths": {"min": int(b["probe_length"].min()), "max": int(b["probe_length"].max())},
            "decode_steps": int(b["probe_steps"].sum()),
            "RAsc": _range(b["RAsc"]),
            "LCsc": _range(b["LCsc"]),
            "INFsc": _range(infsc),
            "top_heads": [
                {
                    "layer": int(i // infsc.shape[1]),
                    "head": int(i % infsc.shape[1]),
                    "INFsc": float(infsc.reshape(-1)[i]),
                }
                for i in top
            ],
        }
    if reader.has("query_stats"):
        q = reader.section("query_stats")
        sections["query_stats"] = {
            "n_sink": int(q.attrs["n_sink"]),
            "queries_per_head": {"min": int(q["n"].min()), "max": int(q["n"].max())},
            "mean_query_norm": _range(np.linalg.norm(q["mean"], axis=-1)),
            "cov_trace": _range(np.trace(q["cov"], axis1=-2, axis2=-1)),
        }
    if reader.has("future_queries"):
        f = reader.section("future_queries")
        mean_norm = np.linalg.norm(f["mean"], axis=-1)  # [L, Hq]
        centre_norm = np.linalg.norm(f["centres"], axis=-1)  # [L, Hq, K]
        sections["future_queries"] = {
            "queries_per_head": {"min": int(f["n"].min()), "max": int(f["n"].max())},
            "centres_per_head": int(f["centres"].shape[2]),
            "mean_query_norm": _range(mean_norm),
            "centre_norm": _range(centre_norm),
            "largest_centre_weight": _range(f["centre_weights"].max(-1)),
        }
    if reader.has("budgets"):
        bt = reader.section("budgets")
        tables = {}
        for budget, table in zip(bt["token_budgets"], bt["token_tables"], strict=True):
            tables[str(int(budget))] = {"min": int(table.min()), "max": int(table.max()), "std": float(table.std())}
        sections["budgets"] = {
            "beta": bt.attrs["beta"],
            "min_budget": bt.attrs["min_budget"],
            "inf_kv": _range(bt["inf_kv"]),
            "token_budgets": tables,
            "ratios": [float(r) for r in bt["ratios"]],
        }
    if reader.has("moments"):
        m = reader.section("moments")
        orders, counts = np.unique(m["order"], return_counts=True)
        names = {-1: "none", 0: "zeroth", 1: "first"}
        sections["moments"] = {
            "order_counts": {names[int(o)]: int(c) for o, c in zip(orders, counts, strict=True)},
            "reference_ratios": [float(r) for r in m["reference_ratios"]],
            "mean_error": {names[k - 1]: [float(e) for e in m["errors"][:, k].mean(axis=(1, 2))] for k in range(3)},
            # 1.5: the selection scorers the orders were calibrated under (the first is order's); None before
            "selections": [n.decode("ascii") for n in m["selections"]] if "selections" in m.arrays else None,
        }
    if reader.has("learned_scorer"):
        ls = reader.section("learned_scorer")
        sections["learned_scorer"] = {
            "features": ls.attrs["features"],
            "teacher": ls.attrs["teacher"],
            "fit_tokens": int(ls.attrs["fit_tokens"]),
            "held_out_tokens": int(ls.attrs["held_out_tokens"]),
            "r2": _range(ls["r2"]),
            "rank_correlation": _range(ls["rank_correlation"]),
        }
    if reader.has("recommendation"):
        rec = reader.section("recommendation")
        candidates = [name.decode("ascii") for name in rec["candidates"]]
        sections["recommendation"] = {
            "tasks": int(rec.attrs["tasks"]),
            "baseline_accuracy": float(rec.attrs["baseline_accuracy"]),
            "task_seed": int(rec.attrs["task_seed"]),
            "families": str(rec.attrs["families"]),
            "best": [
                {
                    "compression_ratio": float(ratio),
                    "policy": policy.decode("ascii"),
                    "accuracy": float(accuracy),
                    "ci_low": float(low),
                    "ci_high": float(high),
                }
                for ratio, policy, accuracy, low, high in zip(
                    rec["compression_ratios"],
                    rec["policy"],
                    rec["accuracy"],
                    rec["ci_low"],
                    rec["ci_high"],
                    strict=True,
                )
            ],
            "candidates": {
                name: [float(a) for a in row] for name, row in zip(candidates, rec["candidate_accuracy"], strict=True)
            },
            "decision": _paired_evidence(rec, candidates),
        }
    if reader.has("budget_curves"):
        bc = reader.section("budget_curves")
        settings = reader.config.get("budget_curves") or {}  # the stage's settings (the section has no attributes)
        sections["budget_curves"] = {
            "selection": settings.get("selection", "?"),
            "floor": settings.get("floor"),
            "retention_weight": settings.get("retention_weight"),
            "retention": settings.get("retention", "question"),  # files before the setting measured the question
            "probes": settings.get("probes", "?"),
            "windows": settings.get("windows", "?"),
            "grid": [float(f) for f in bc["grid"]],
            "mean_output_error": [float(e) for e in bc["output_error"].mean(axis=(1, 2))],
            "mean_retention_loss": [float(e) for e in bc["retention_loss"].mean(axis=(1, 2))],
            "fractions": {
                f"{float(ratio):g}": _range(row)
                for ratio, row in zip(bc["compression_ratios"], bc["fractions"], strict=True)
            },
        }
    for name in reader.sections:  # a section with no summary above: its attributes and value ranges
        if name not in sections:
            section = reader.section(name)
            sections[name] = {
                "generic": True,
                "attrs": {
                    key: value.item() if hasattr(value, "item") else value for key, value in section.attrs.items()
                },
                "datasets": {key: _range(value) for key, value in section.arrays.items() if value.dtype.kind in "iuf"},
            }
    return summary


def _flatten(config: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``{"a": {"b": 1}}`` -> ``[("a.b", 1)]``, scalars only, sorted."""
    items = []
    for key, value in sorted(config.items()):
        if isinstance(value, dict):
            items += _flatten(value, f"{prefix}{key}.")
        elif not isinstance(value, list):
            items.append((f"{prefix}{key}", value))
    return items


def _config_line(items: list[tuple[str, object]], limit: int = 400) -> str:
    """``key=value, ...`` of as many whole items as fit in ``limit`` characters, then how many more
    there are (an item is never cut: a cut key or value reads as another one)."""
    if not items:
        return "none"
    texts = [f"{key}={value}" for key, value in items]
    line = ", ".join(texts)
    if len(line) <= limit:
        return line
    kept, length = [], 0
    for text in texts:
        if length + len(text) + 2 * bool(kept) > limit:
            break
        kept.append(text)
        length += len(text) + 2 * (len(kept) > 1)
    return ", ".join([*kept, f"... ({len(texts) - len(kept)} more; --json shows them all)"])


def _described(sections: dict, name: str) -> bool:
    """Whether ``name`` has its own summary (not the generic one)."""
    return name in sections and not sections[name].get("generic")


def _layers(model: dict) -> str:
    """``"L layers"``; of a hybrid model ``"L attention layers (decoder layers 3, 7, ...)"``."""
    variant = json.loads(model.get("attention_variant") or "{}")
    indices = variant.get("attention_layers")
    if not indices:
        return f"{model['num_layers']} layers"
    shown = ", ".join(str(i) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")
    return f"{model['num_layers']} attention layers (decoder layers {shown})"


def _values_width(model: dict) -> str:
    """``" (values 128)"`` where the values' head dim is not the keys' (MiMo-V2-Flash), else nothing."""
    value = json.loads(model.get("attention_variant") or "{}").get("value_head_dim")
    return f" (values {value})" if value else ""


def format_summary(summary: dict) -> str:
    """The summary as human-readable text."""
    m = summary["model"]
    lines = [
        f"{summary['path']}: valid calibration artifact (schema {summary['schema_version']}, "
        f"kvcal {summary['toolkit_version']}, created {summary['created']})",
        f"model       {m['name']} ({m['model_type']}: {_layers(m)}, {m['num_q_heads']} query heads, "
        f"{m['num_kv_heads']} KV heads, head dim {m['head_dim']}{_values_width(m)}, RoPE theta {m['rope_theta']:g}"
        f"{', query norm' if m['query_norm'] else ''})",
        f"fingerprints  arch {m['arch_fingerprint'][:16]}  weights {m['weights_fingerprint'][:16]}  "
        f"tokenizer {m['tokenizer_fingerprint'][:16]}",
        "config      " + _config_line(_flatten(summary["config"])),
    ]
    sections = summary["sections"]
    if not sections:
        lines.append("sections    none")
    if _described(sections, "behaviour"):
        b = sections["behaviour"]
        fam = ", ".join(f"{k} {v}" for k, v in b["families"].items())
        lines += [
            f"behaviour   {b['probes']} probes ({fam}), lengths {b['lengths']['min']}-{b['lengths']['max']}, "
            f"success {b['success_rate']:.0%}, {b['decode_steps']} decode steps",
            f"            INFsc {b['INFsc']['min']:.3f} .. {b['INFsc']['max']:.3f} (mean {b['INFsc']['mean']:.3f}); "
            "top heads " + ", ".join(f"L{h['layer']}H{h['head']} {h['INFsc']:.2f}" for h in b["top_heads"]),
        ]
    if _described(sections, "query_stats"):
        q = sections["query_stats"]
        lines.append(
            f"query_stats {q['queries_per_head']['min']}-{q['queries_per_head']['max']} queries per head "
            f"(first {q['n_sink']} tokens of each sample skipped); mean-query norm "
            f"{q['mean_query_norm']['min']:.2f} .. {q['mean_query_norm']['max']:.2f}; cov trace "
            f"{q['cov_trace']['min']:.2f} .. {q['cov_trace']['max']:.2f}"
        )
    if _described(sections, "future_queries"):
        f = sections["future_queries"]
        lines.append(
            f"future_queries {f['queries_per_head']['min']}-{f['queries_per_head']['max']} queries per head after "
            f"the probes' context (question, answer); mean-query norm {f['mean_query_norm']['min']:.2f} .. "
            f"{f['mean_query_norm']['max']:.2f}; {f['centres_per_head']} centres per head, norms "
            f"{f['centre_norm']['min']:.2f} .. {f['centre_norm']['max']:.2f}, largest weight "
            f"{f['largest_centre_weight']['min']:.2f} .. {f['largest_centre_weight']['max']:.2f}"
        )
    if _described(sections, "budgets"):
        bt = sections["budgets"]
        spread = "; ".join(f"{k}: {v['min']}-{v['max']}" for k, v in bt["token_budgets"].items())
        lines.append(
            f"budgets     beta {bt['beta']:g}, min {bt['min_budget']}; per-head spread at average "
            f"budget {spread}; keep ratios {', '.join(f'{r:g}' for r in bt['ratios'])}"
        )
    if _described(sections, "moments"):
        mo = sections["moments"]
        counts = ", ".join(f"{k} {v}" for k, v in mo["order_counts"].items())
        lines.append(
            f"moments     correction order per KV head: {counts}; reference keep ratios "
            f"{', '.join(f'{r:g}' for r in mo['reference_ratios'])}"
            + (f"; calibrated under {', '.join(mo['selections'])}" if mo.get("selections") else "")
        )
    if _described(sections, "learned_scorer"):
        ls = sections["learned_scorer"]
        lines.append(
            f"learned_scorer  {ls['features']} features -> log {ls['teacher']} importance, fitted on "
            f"{ls['fit_tokens']} tokens; held-out ({ls['held_out_tokens']} tokens) rank correlation "
            f"{ls['rank_correlation']['min']:.2f} .. {ls['rank_correlation']['max']:.2f}, "
            f"R^2 {ls['r2']['min']:.2f} .. {ls['r2']['max']:.2f}"
        )
    if _described(sections, "recommendation"):
        rec = sections["recommendation"]
        lines.append(
            f"recommendation  measured on {rec['tasks']} held-out tasks ({rec['families']}, seed {rec['task_seed']}), "
            f"uncompressed accuracy {rec['baseline_accuracy']:.2f}; serve:"
        )
        lines += [
            f"            compression ratio {row['compression_ratio']:g}: {row['policy']} (accuracy "
            f"{row['accuracy']:.2f} [{row['ci_low']:.2f}, {row['ci_high']:.2f}], n={rec['tasks']})"
            for row in rec["best"]
        ]
        decision = rec.get("decision")
        if decision:
            lines.append(
                f"            decided by {decision['rule']} (tolerance {decision['tolerance']:g}, confidence "
                f"{decision['confidence']:g}; reference {decision['reference'][0] or 'none'}): a candidate "
                "replaces the reference only when its bound on the accuracy given up is within the tolerance"
            )
    if _described(sections, "budget_curves"):
        bc = sections["budget_curves"]
        spread = "; ".join(f"{k}: {v['min']:.3f}-{v['max']:.3f}" for k, v in bc["fractions"].items())
        errors = ", ".join(
            f"{f:g} {e:.3f}/{r:.4f}"
            for f, e, r in zip(bc["grid"], bc["mean_output_error"], bc["mean_retention_loss"], strict=True)
        )
        lines += [
            f"budget_curves  {bc['selection']} selection, {bc['windows']} windows, {bc['probes']} probes, floor "
            f"{bc['floor']}, retention ({bc['retention']}) weight {bc['retention_weight']}; per-head kept fraction "
            "by compression "
            f"ratio {spread}",
            f"            mean output error / retention loss by kept fraction: {errors}",
        ]
    for name, generic in sections.items():
        if generic.get("generic"):
            ranges = ", ".join(f"{key} {r['min']:.3g}..{r['max']:.3g}" for key, r in generic["datasets"].items())
            lines.append(f"{name:<11} {ranges}")
    return "\n".join(lines)
