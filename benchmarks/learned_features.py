"""Does the learned scorer gain end to end from ``hidden`` features?  Needle retrieval after compression.

    python benchmarks/learned_features.py --artifact out/kv_calibration.h5 --seeds 1000 2000 \\
        [--families retrieval multi_key] [--compression 0.5 0.75 0.9] [--threads 1] \\
        [--fit-cache FIT.npz] [--json OUT.json]

benchmarks/scorer_fit.py showed that predicting KVzip's reconstruction importance (the
learned-scorer teacher) from the layer's attention input (``hidden``: the normed hidden state,
D = 576) ranks held-out prose a little better than from the head's own pre-RoPE key and value
(``kv``: what the runtime's ``learned`` scorer serves).  This measures whether that shows up in
needle-retrieval accuracy after question-agnostic compression.

1. Fit.  Both feature sets on exactly the windows, tokens, held-out split and ridge selection of
   the quick profile's ``learned-scorer`` stage (the artifact's config: ``num_samples`` windows of
   ``sample_tokens`` tokens from the built-in calibration text, profiling seed; the last
   ``max(1, N // 5)`` windows held out; per head, the ridge strength of
   :data:`profiler.learned_scorer.RIDGE_GRID` with the best held-out rank correlation).  The
   ``kv`` weights come from the stage class itself (:class:`LearnedScorerStage` driven through
   a minimal job) and are compared with the artifact's ``learned_scorer`` section; the
   ``hidden`` weights from the same teacher passes (``record_window(..., hidden=True)``), with
   the stage's selection repeated over ``RidgeSums(1, D, Hkv)``.  Held-out R^2 / rank
   correlation are printed per feature set: per-head selection (the stage's) and per ridge
   strength (scorer_fit.py's view).
2. Serve.  Each probe's context is prefilled once (as benchmarks/runtime_quality.py does) with
   forward hooks on every layer's ``k_proj`` (its input: the attention input) and ``v_proj``:
   ``hidden @ W + b`` gives the hidden-feature scores ``[L, Hkv, T]`` by position during the
   prefill (timed inside the hooks); the same hooks also compute the ``kv``-feature scores
   from ``k_proj`` / ``v_proj`` outputs (a control, ``global/kv-lookup``: it must match the
   runtime's own ``global/learned`` row, so that any difference between ``hidden`` and
   ``learned`` is the features, not the lookup path).  :class:`PositionTableScorer` looks the
   scores up by position (``comparable = True``, so ``allocation="global"``, one ranking of
   every head's tokens, applies).
3. Rows: ``global/learned`` (the runtime's LearnedScorer with the refitted ``kv`` weights),
   ``global/hidden``, each with and without ``+corr`` (MomentKV correction with the artifact's
   per-head orders), and the ``global/kv-lookup`` control; every cell of a probe decodes in one
   batch with the uncompressed baseline.  Accuracy (``needles.answer_is_correct``) per seed and
   pooled, with the 95% Wilson interval; per (ratio, hidden vs learned) pair the probes only one
   of them answers (a paired view: the same probes under both).  Costs: the prefill, the hook
   time computing the hidden scores, the ``learned`` scorer's own scoring time
   (``score``) and every row's whole compression time.

The result (hidden features keep no more needles than the served ``kv`` features) and the
command that produced it: docs/results.md R-learned-features-2026-11-22.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.formulas import wilson_interval  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from profiler.evaluation import decode_together  # noqa: E402
from runtime import CompressionPolicy, RaggedCache, load_calibration  # noqa: E402
from runtime.compression.prefill import compress, prefill_for_policies  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402
from runtime.math.geometry import ModelGeometry  # noqa: E402
from runtime.scorers import LayerInputs, LearnedScorer, Scorer  # noqa: E402

CORR = {"correction": "calibrated"}  # benchmarks/runtime_quality.py's MOMENT_VARIANTS["+corr"]
ROWS = {  # row -> (scorer kind, extra policy fields); allocation is "global" throughout
    "global/learned": ("learned", {}),
    "global/learned+corr": ("learned", CORR),
    "global/hidden": ("hidden", {}),
    "global/hidden+corr": ("hidden", CORR),
    "global/kv-lookup": ("kv", {}),  # control: the learned kv scores through the lookup path
}


# -- 1. fitting ---------------------------------------------------------------------------------------


def _stage_context(model, tokenizer, num_samples: int, sample_tokens: int, seed: int):
    """The :class:`profiler.stages.StageContext` a one-process ``--stages learned-scorer`` job with
    these calibration settings gives the stage (no probes)."""
    from profiler.distributed import ProcessInfo
    from profiler.presets import PRESETS
    from profiler.stages import StageContext, resolve_settings

    given = {"calib_samples": num_samples, "calib_tokens": sample_tokens, "seed": seed}
    return StageContext(
        preset_name="quick",
        preset=PRESETS["quick"],
        settings=resolve_settings(given, PRESETS["quick"], ("learned-scorer",)),
        stage_names=("learned-scorer",),
        model=model,
        tokenizer=tokenizer,
        geometry=ModelGeometry.of(model),
        identity=None,  # read only for probes
        out=Path("not-written.h5"),
        existing_sections=frozenset(),
        info=ProcessInfo(rank=0, world_size=1, device=torch.device("cpu")),
        progress=False,
    )


def _per_ridge(sums, held_features, teacher, kind):
    """Mean / min held-out (R^2, rank correlation) over heads for each ridge strength (scorer_fit.py's view)."""
    from profiler.learned_scorer import RIDGE_GRID, predict, r_squared, spearman

    layers, heads = teacher.shape[:2]
    out = {}
    for ridge in RIDGE_GRID:
        r2, rho = np.zeros((layers, heads)), np.zeros((layers, heads))
        for layer in range(layers):
            prediction = predict(sums[layer].solve(ridge), held_features[layer])
            prediction = prediction[:, :, 0] if kind == "kv" else prediction[0].T  # [Hkv, n]
            for h in range(heads):
                r2[layer, h] = r_squared(prediction[h], teacher[layer, h])
                rho[layer, h] = spearman(prediction[h], teacher[layer, h])
        out[ridge] = {"r2_mean": r2.mean(), "r2_min": r2.min(), "rho_mean": rho.mean(), "rho_min": rho.min()}
    return out


def fit_both(model, tokenizer, num_samples: int, sample_tokens: int, seed: int) -> dict:
    """Ridge weights of both feature sets on the learned-scorer stage's windows (see the module docstring)."""
    from profiler.learned_scorer import RIDGE_GRID, RidgeSums, predict, r_squared, record_window, spearman
    from profiler.stages.learned_scorer import LearnedScorerStage

    started = time.perf_counter()
    context = _stage_context(model, tokenizer, num_samples, sample_tokens, seed)
    windows = context.windows  # the built-in calibration text
    stage = LearnedScorerStage(context)
    geometry = ModelGeometry.of(model)
    layers, heads, dim = geometry.num_layers, geometry.num_kv_heads, model.config.hidden_size
    hidden_sums = [RidgeSums(1, dim, heads) for _ in range(layers)]
    fit_units = stage.work()
    assert fit_units == list(range(stage.fit_windows)), fit_units
    held_out = []
    for index in range(num_samples):
        records = record_window(model, windows[index], stage.instruction, hidden=True)
        if index < stage.fit_windows:
            stage.commit(index, records)  # the stage's own sums (kv features)
            for layer, record in enumerate(records):
                hidden_sums[layer].add(record.hidden.unsqueeze(0), record.teacher.T.unsqueeze(0))
        else:
            held_out.append(records)
    stage.reduce()
    kv_section = stage.build({}, {})  # the stage's held-out ridge selection (it re-records the held-out windows)

    # hidden: the stage's selection (per head, the best held-out rank correlation over RIDGE_GRID)
    teacher = np.stack(
        [torch.cat([w[layer].teacher for w in held_out], dim=1).double().numpy() for layer in range(layers)]
    )  # [L, Hkv, n]
    hidden_held = [torch.cat([w[layer].hidden for w in held_out]).double().numpy()[None] for layer in range(layers)]
    kv_held = [torch.cat([w[layer].kv for w in held_out], dim=1).double().numpy() for layer in range(layers)]
    best = {name: np.zeros((layers, heads)) for name in ("ridge", "r2", "rank_correlation", "bias")}
    best["rank_correlation"][:] = -2.0
    weights = np.zeros((layers, dim, heads))
    for layer in range(layers):
        for ridge in RIDGE_GRID:
            solution = hidden_sums[layer].solve(ridge)  # [1, D+1, Hkv]
            prediction = predict(solution, hidden_held[layer])[0].T  # [Hkv, n]
            for h in range(heads):
                rho = spearman(prediction[h], teacher[layer, h])
                if rho > best["rank_correlation"][layer, h]:
                    best["rank_correlation"][layer, h] = rho
                    best["r2"][layer, h] = r_squared(prediction[h], teacher[layer, h])
                    best["ridge"][layer, h] = ridge
                    weights[layer, :, h] = solution[0, :-1, h]
                    best["bias"][layer, h] = solution[0, -1, h]
    stage_sums = stage.sums
    fit = {
        "windows_sha256": np.array(context.windows_digest()),
        "fit_tokens": np.array(int(round(stage.sums[0].zz[0, -1, -1]))),
        "held_out_tokens": np.array(int(teacher.shape[-1])),
        "kv_weights": kv_section.arrays["weights"],  # [L, Hkv, 2d]
        "kv_bias": kv_section.arrays["bias"],
        "kv_ridge": kv_section.arrays["ridge"],
        "kv_r2": kv_section.arrays["r2"],
        "kv_rank_correlation": kv_section.arrays["rank_correlation"],
        "hidden_weights": weights,  # [L, D, Hkv]
        "hidden_bias": best["bias"],
        "hidden_ridge": best["ridge"],
        "hidden_r2": best["r2"],
        "hidden_rank_correlation": best["rank_correlation"],
        "seconds": np.array(time.perf_counter() - started),
    }
    for kind, sums, held in (("kv", stage_sums, kv_held), ("hidden", hidden_sums, hidden_held)):
        table = _per_ridge(sums, held, teacher, kind)
        fit[f"{kind}_per_ridge"] = np.array(
            [[r, v["r2_mean"], v["r2_min"], v["rho_mean"], v["rho_min"]] for r, v in table.items()]
        )
    return fit


def print_fit(fit: dict, artifact_kv=None) -> None:
    print(
        f"fit: {int(fit['fit_tokens'])} tokens, held out {int(fit['held_out_tokens'])} tokens, windows sha256 "
        f"{str(fit['windows_sha256'])[:16]}..., {float(fit['seconds']):.0f} s"
    )
    for kind in ("kv", "hidden"):
        rho, r2 = fit[f"{kind}_rank_correlation"], fit[f"{kind}_r2"]
        ridges = dict(zip(*np.unique(fit[f"{kind}_ridge"], return_counts=True), strict=True))
        print(
            f"  {kind:6s} per-head ridge (stage's selection): held-out rank correlation mean {rho.mean():.3f} "
            f"(min {rho.min():.3f}), R^2 mean {r2.mean():.3f} (min {r2.min():.3f}); ridges chosen "
            + ", ".join(f"{k:g}x{v}" for k, v in ridges.items())
        )
        for ridge, r2_mean, r2_min, rho_mean, rho_min in fit[f"{kind}_per_ridge"]:
            print(
                f"    ridge {ridge:g}: R^2 mean {r2_mean:.3f} (min {r2_min:.3f}), "
                f"rank correlation mean {rho_mean:.3f} (min {rho_min:.3f})"
            )
    if artifact_kv is not None:
        weights, bias, rho = artifact_kv
        print(
            f"  kv refit vs the artifact's learned_scorer: max |dw| {np.abs(fit['kv_weights'] - weights).max():.2e}, "
            f"max |db| {np.abs(fit['kv_bias'] - bias).max():.2e}, max |d rho| "
            f"{np.abs(fit['kv_rank_correlation'] - rho).max():.2e}"
        )


# -- 2. serving -------------------------------------------------------------------------------------------


class PositionTableScorer(Scorer):
    """Scores precomputed for one prompt's context, looked up by absolute position (``table [L, Hkv, T]``).

    Like runtime.scorers.KVzipScorer, but ``comparable`` (the scores are predicted log KVzip
    importances, one scale for every head), so the ``global`` allocation applies.  Rows past the
    context (decoded later) score ``+inf``.  ``seconds``: time spent scoring.
    """

    comparable = True

    def __init__(self, name: str, table: torch.Tensor | None = None):
        self.name = name
        self.table = table
        self.seconds = 0.0

    def _lookup(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            raise ValueError(f"{self!r} has no score table")
        table = self.table[layer]  # [Hkv, T]
        length = table.shape[-1]
        index = positions.long().clamp(0, length - 1)
        found = table.to(positions.device).expand(*positions.shape[:-2], -1, -1).gather(-1, index)
        return torch.where(positions < length, found, torch.full_like(found, float("inf")))

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        started = time.perf_counter()
        if any(int(p) != self.table.shape[-1] for p in inputs.next_positions):
            raise ValueError(
                f"the table covers {self.table.shape[-1]} tokens, the cache has seen {inputs.next_positions}"
            )
        scores = self._lookup(inputs.layer, inputs.positions).masked_fill(~inputs.valid, float("-inf"))
        self.seconds += time.perf_counter() - started
        return scores

    def __repr__(self) -> str:
        return f"PositionTableScorer({self.name!r})"


class TimedLearnedScorer(LearnedScorer):
    """The runtime's learned scorer, unchanged, with the time its ``score`` takes."""

    def __init__(self):
        self.seconds = 0.0

    def score(self, inputs: LayerInputs) -> torch.Tensor:
        started = time.perf_counter()
        scores = super().score(inputs)
        self.seconds += time.perf_counter() - started
        return scores


class PrefillScores:
    """Forward hooks that turn each layer's attention input (and its k/v projections) into
    learned-scorer predictions ``[L, Hkv, T]`` during a single-prompt prefill."""

    def __init__(self, model, fit: dict):
        self.geometry = ModelGeometry.of(model)
        self.hidden_w = torch.from_numpy(fit["hidden_weights"]).float()  # [L, D, Hkv]
        self.hidden_b = torch.from_numpy(fit["hidden_bias"]).float()  # [L, Hkv]
        self.kv_w = torch.from_numpy(fit["kv_weights"]).float()  # [L, Hkv, 2d]
        self.kv_b = torch.from_numpy(fit["kv_bias"]).float()
        self.handles = []
        self.hidden, self.kv, self._keys = {}, {}, {}
        self.hidden_seconds = self.kv_seconds = 0.0

    def __enter__(self):
        g = self.geometry
        for layer, module in enumerate(g.attention_modules):
            if getattr(module, "k_norm", None) is not None:
                raise ValueError(
                    "this benchmark reads pre-RoPE keys from k_proj: models with k_norm need k_norm's output"
                )

            def on_k(_module, args, output, layer=layer):
                started = time.perf_counter()
                x = args[0][0].float()  # [T, D] the attention input
                self.hidden[layer] = (x @ self.hidden_w[layer].to(x.device) + self.hidden_b[layer].to(x.device)).T
                self.hidden_seconds += time.perf_counter() - started
                self._keys[layer] = output[0]

            def on_v(_module, args, output, layer=layer):
                started = time.perf_counter()
                shape = (-1, g.num_kv_heads, g.head_dim)
                keys = self._keys.pop(layer).float().reshape(shape).transpose(0, 1)  # [Hkv, T, d]
                values = output[0].float().reshape(shape).transpose(0, 1)
                features = torch.cat([keys, values], dim=-1)  # [Hkv, T, 2d]
                w, b = self.kv_w[layer].to(features.device), self.kv_b[layer].to(features.device)
                self.kv[layer] = torch.einsum("htf,hf->ht", features, w) + b[:, None]
                self.kv_seconds += time.perf_counter() - started

            self.handles.append(module.k_proj.register_forward_hook(on_k))
            self.handles.append(module.v_proj.register_forward_hook(on_v))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def tables(self) -> dict[str, torch.Tensor]:
        layers = self.geometry.num_layers
        return {
            "hidden": torch.stack([self.hidden[i] for i in range(layers)]).cpu(),
            "kv": torch.stack([self.kv[i] for i in range(layers)]).cpu(),
        }


def retrieval_kept(cache, positions: torch.Tensor) -> float:
    """Mean over (layer, KV head) of the fraction of the retrieval (R) span's positions still cached."""
    if positions.numel() == 0:
        return float("nan")
    fractions = []
    for layer in cache.layers:
        for h in range(layer.num_heads):
            kept = layer.head(0, h)[2].long().cpu()
            fractions.append(float(torch.isin(positions, kept).float().mean()))
    return float(np.mean(fractions))


@torch.no_grad()
def run_probe(model, tokenizer, probe, cells, calibration, fit, max_new_tokens):
    """Answers of the baseline and every (row, ratio) cell for one probe, and timings."""
    from needles import answer_is_correct
    from needles.probe import LABEL_CODE

    ids = torch.tensor([probe.input_ids], dtype=torch.long)
    base = RaggedCache.for_model(model)
    hooks = PrefillScores(model, fit)
    started = time.perf_counter()
    with hooks:
        stats = prefill_for_policies(model, base, ids[:, : probe.context_end], [policy for _, policy in cells])
    timings = {
        "prefill_seconds": time.perf_counter() - started,
        "hidden_score_seconds": hooks.hidden_seconds,
        "kv_score_seconds_hooks": hooks.kv_seconds,
    }
    tables = hooks.tables()
    if tables["hidden"].shape[-1] != probe.context_end:
        raise RuntimeError(f"hooks saw {tables['hidden'].shape[-1]} tokens, the context has {probe.context_end}")

    retrieval = torch.from_numpy(probe.labels()[: probe.context_end] == LABEL_CODE["R"]).nonzero().squeeze(1)
    keys = [("baseline", None)] + [key for key, _ in cells]
    caches, extra = [base], [{"r_kept": 1.0}]
    for (row, _), policy in cells:
        kind = ROWS[row][0]
        scorer = TimedLearnedScorer() if kind == "learned" else PositionTableScorer(kind, tables[kind])
        policy = dataclasses.replace(policy, scorer=scorer)
        cache = base.copy()
        report = compress(model, cache, policy, calibration, prompt_stats=stats)
        caches.append(cache)
        extra.append(
            {
                "compress_seconds": report.seconds,
                "scoring_seconds": scorer.seconds,
                "r_kept": retrieval_kept(cache, retrieval),
            }
        )
    base.stop_observing()
    kv_bytes = [cache.kv_bytes() for cache in caches]
    texts, timings["decode_seconds"] = decode_together(model, tokenizer, ids, caches, max_new_tokens)
    results = {}
    for index, (key, text) in enumerate(zip(keys, texts, strict=True)):
        results["/".join(str(k) for k in key)] = {
            "text": text,
            "correct": bool(answer_is_correct(text, probe)),
            "kept": kv_bytes[index] / kv_bytes[0],
            **extra[index],
        }
    return results, timings


# -- 3. report --------------------------------------------------------------------------------------


def cell_stats(per_probe: list[dict], name: str) -> dict:
    hits = [p["results"][name]["correct"] for p in per_probe]
    correct, n = sum(hits), len(hits)
    low, high = wilson_interval(correct, n)
    r_kept = float(np.nanmean([p["results"][name]["r_kept"] for p in per_probe]))
    return {"correct": correct, "n": n, "accuracy": correct / max(n, 1), "low": low, "high": high, "r_kept": r_kept}


def _fmt(c: dict) -> str:
    return f"{c['correct']:2d}/{c['n']} {c['accuracy']:.2f} [{c['low']:.2f},{c['high']:.2f}] R{c['r_kept']:.2f}"


def report(per_probe: list[dict], rows: list[str], ratios: list[float], seeds: list[int]) -> tuple[list[str], dict]:
    lines, table = [], {}
    groups = [(f"seed {s}", [p for p in per_probe if p["seed"] == s]) for s in seeds]
    if len(seeds) > 1:
        groups.append(("pooled", per_probe))
    header = f"{'policy':24s}" + "".join(f"  {'evict ' + format(r, '.2f'):>30s}" for r in ratios)
    for label, probes in groups:
        lines += [
            "",
            f"{label}: {len(probes)} probes; cells: correct/n accuracy [95% Wilson] and the mean per-head fraction "
            "of the retrieval span kept",
            header,
        ]
        table[label] = {}
        base = cell_stats(probes, "baseline/None")
        table[label]["baseline"] = base
        lines.append(f"{'baseline (no eviction)':24s}" + f"  {_fmt(base):>30s}" * len(ratios))
        for row in rows:
            values = [cell_stats(probes, f"{row}/{r}") for r in ratios]
            table[label][row] = dict(zip(map(str, ratios), values, strict=True))
            lines.append(f"{row:24s}" + "".join(f"  {_fmt(v):>30s}" for v in values))
    # paired view, pooled: probes only one of two rows answers
    pairs = [("global/hidden", "global/learned"), ("global/hidden+corr", "global/learned+corr")]
    pairs += [("global/kv-lookup", "global/learned")]
    lines += ["", "paired (all probes): a only / b only / both / neither"]
    table["paired"] = {}
    for a, b in pairs:
        if a not in rows or b not in rows:
            continue
        for r in ratios:
            ca = [p["results"][f"{a}/{r}"]["correct"] for p in per_probe]
            cb = [p["results"][f"{b}/{r}"]["correct"] for p in per_probe]
            counts = [
                sum(x and not y for x, y in zip(ca, cb, strict=True)),
                sum(y and not x for x, y in zip(ca, cb, strict=True)),
                sum(x and y for x, y in zip(ca, cb, strict=True)),
                sum(not x and not y for x, y in zip(ca, cb, strict=True)),
            ]
            table["paired"][f"{a} vs {b} @ {r}"] = counts
            lines.append(f"  {a} vs {b} @ {r}: {counts[0]} / {counts[1]} / {counts[2]} / {counts[3]}")
    # costs
    prefill = sum(p["prefill_seconds"] for p in per_probe)
    hidden = sum(p["hidden_score_seconds"] for p in per_probe)
    kv_hooks = sum(p["kv_score_seconds_hooks"] for p in per_probe)
    lines += [
        "",
        f"costs over {len(per_probe)} probes: prefill {prefill:.1f} s "
        f"({prefill / len(per_probe):.2f} s per probe, hooks "
        "included)",
        f"  hidden scores in the prefill hooks: {hidden:.2f} s = {hidden / prefill:.4f} x the prefill",
        f"  kv scores in the prefill hooks (control): {kv_hooks:.2f} s = {kv_hooks / prefill:.4f} x the prefill",
    ]
    table["costs"] = {"prefill_seconds": prefill, "hidden_hook_seconds": hidden, "kv_hook_seconds": kv_hooks}
    for row in rows:
        for r in ratios:
            name = f"{row}/{r}"
            comp = sum(p["results"][name]["compress_seconds"] for p in per_probe)
            scoring = sum(p["results"][name]["scoring_seconds"] for p in per_probe)
            table["costs"][name] = {"compress_seconds": comp, "scoring_seconds": scoring}
            lines.append(
                f"  {name:28s} compress {comp:6.2f} s = {comp / prefill:.4f} x prefill "
                f"(scorer.score {scoring:.2f} s = {scoring / prefill:.4f} x)"
            )
    return lines, table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, help="the quick profile of the embedded model (moments section)")
    parser.add_argument("--preset", default="quick", help="needles probe preset (default quick)")
    parser.add_argument("--families", nargs="+", default=["retrieval", "multi_key"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1000, 2000], help="probe seeds (default 1000 2000)")
    parser.add_argument("--compression", nargs="+", type=float, default=[0.5, 0.75, 0.9])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--limit", type=int, default=None, help="only the first N probes of each seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fit-cache", default=None, help="npz of the fit: read when present, else written")
    parser.add_argument("--fit-only", action="store_true", help="fit (and print the fit statistics) only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model(None), load_tokenizer(None)
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    config = calibration.config.get("learned_scorer") or {}
    profiled_seed = int((calibration.config.get("profiler") or {}).get("seed", 0))
    num_samples, sample_tokens = int(config.get("num_samples", 16)), int(config.get("sample_tokens", 512))
    if config and config.get("source") != "needles prose haystack":
        raise SystemExit(f"the artifact's learned scorer was fitted on {config.get('source')!r}: not reproduced here")

    if args.fit_cache and Path(args.fit_cache).exists():
        with np.load(args.fit_cache) as cached:
            fit = {name: cached[name] for name in cached.files}
        print(f"fit read from {args.fit_cache}")
    else:
        fit = fit_both(model, tokenizer, num_samples, sample_tokens, profiled_seed)
        if args.fit_cache:
            np.savez(args.fit_cache, **fit)
    if config.get("windows_sha256") and str(fit["windows_sha256"]) != config["windows_sha256"]:
        raise SystemExit("the refit's calibration windows are not the artifact's (windows_sha256 differs)")
    artifact_kv = None
    if calibration.scorer_weights is not None:
        import h5py

        with h5py.File(args.artifact, "r") as f:
            rho = f["learned_scorer/rank_correlation"][...]
        artifact_kv = (np.asarray(calibration.scorer_weights), np.asarray(calibration.scorer_bias), rho)
    print_fit(fit, artifact_kv)
    if args.fit_only:
        return 0

    # the learned rows serve the refitted kv weights (the same fit as the hidden ones)
    calibration = copy.copy(calibration)
    calibration.scorer_weights, calibration.scorer_bias = fit["kv_weights"], fit["kv_bias"]
    enable(model)

    from tqdm import tqdm

    from needles import PRESETS, generate_probes

    cells = []
    for row in args.rows:
        kind, extra = ROWS[row]
        for ratio in args.compression:
            placeholder = TimedLearnedScorer() if kind == "learned" else PositionTableScorer(kind)
            policy = CompressionPolicy(compression_ratio=ratio, allocation="global", scorer=placeholder, **extra)
            if missing := policy.missing(calibration):
                raise ValueError(missing[0])
            cells.append(((row, ratio), policy))

    per_probe = []
    started = time.perf_counter()
    for seed in args.seeds:
        if seed == profiled_seed:
            raise SystemExit(f"seed {seed} is the artifact's profiling seed: the test probes must be unseen")
        spec = PRESETS[args.preset].replace(families=tuple(args.families), seed=seed)
        probes = list(generate_probes(spec, tokenizer))[: args.limit]
        for probe in tqdm(probes, desc=f"seed {seed}", unit="probe"):
            results, timings = run_probe(model, tokenizer, probe, cells, calibration, fit, args.max_new_tokens)
            per_probe.append(
                {
                    "seed": seed,
                    "id": probe.id,
                    "family": probe.family,
                    "context": probe.context_end,
                    "depth": probe.depth,
                    **timings,
                    "results": results,
                }
            )
    lines, table = report(per_probe, args.rows, args.compression, args.seeds)
    print(
        f"{len(per_probe)} probes ({args.preset}, {', '.join(args.families)}, seeds {args.seeds}), question-agnostic, "
        f"allocation global, {time.perf_counter() - started:.0f} s"
    )
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "artifact": args.artifact,
                    "seeds": args.seeds,
                    "families": args.families,
                    "compression": args.compression,
                    "rows": args.rows,
                    "fit": {
                        k: (v.tolist() if isinstance(v, np.ndarray) and v.ndim <= 1 else None)
                        for k, v in fit.items()
                        if not k.endswith("weights")
                    },
                    "fit_arrays": {
                        k: np.asarray(v).tolist() for k, v in fit.items() if k.endswith(("ridge", "correlation", "r2"))
                    },
                    "table": table,
                    "probes": per_probe,
                },
                indent=1,
                default=float,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
