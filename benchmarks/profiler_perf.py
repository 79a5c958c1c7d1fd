"""Profiler performance on the embedded model: overhead ratios and a full quick job.

    python benchmarks/profiler_perf.py [--probes-preset quick] [--limit 12] [--skip-job]

Measures, within one run on this machine:

1. behaviour stage vs plain greedy ``generate()`` (sdpa) on the same probes and the same
   ``max_new_tokens``: ratio of total wall times (target <= 1.15), and the median of the
   per-probe ratios.  Modes alternate per probe and repeat so that background load on a
   shared machine hits both alike.
2. query-stats stage vs a plain forward pass (``model.model``, no LM head in either) over the
   same calibration windows (target <= 1.10), alternating per batch.
3. ``profile-model --preset quick`` on the embedded model in a subprocess: wall time (target
   <= 10 min) and peak resident memory of the child process.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.models import load_model, load_tokenizer  # noqa: E402
from profiler.behaviour import run_probe  # noqa: E402
from profiler.calibration_text import calibration_windows  # noqa: E402
from profiler.greedy import greedy_generate  # noqa: E402
from profiler.presets import PRESETS  # noqa: E402
from profiler.probe_source import preset_probes  # noqa: E402
from runtime.compression.prompt_statistics import QueryMoments  # noqa: E402
from runtime.math.geometry import ModelGeometry  # noqa: E402


def plain_generate(model, tokenizer, probe, max_new_tokens):
    with torch.no_grad():
        return greedy_generate(model, tokenizer, torch.tensor([probe.input_ids]), max_new_tokens)


def _summary(pairs: list[tuple[float, float]], names: tuple[str, str]) -> dict:
    """Totals, their ratio, and the median of per-item ratios (robust to load spikes)."""
    base = sum(a for a, _ in pairs)
    other = sum(b for _, b in pairs)
    ratios = sorted(b / a for a, b in pairs)
    return {
        f"{names[0]}_s": round(base, 2),
        f"{names[1]}_s": round(other, 2),
        "ratio": round(other / base, 3),
        "median_item_ratio": round(statistics.median(ratios), 3),
    }


def bench_behaviour(model, tokenizer, probes, max_new_tokens, repeats):
    geometry = ModelGeometry.of(model)
    pairs, steps = [], 0
    plain_generate(model, tokenizer, probes[0], 2)  # warm-up
    for index, probe in enumerate(probes):
        for repeat in range(repeats):
            times = {}
            order = ("plain", "capture") if (index + repeat) % 2 == 0 else ("capture", "plain")
            for mode in order:
                start = time.perf_counter()
                if mode == "plain":
                    plain_generate(model, tokenizer, probe, max_new_tokens)
                else:
                    result = run_probe(model, tokenizer, geometry, probe, max_new_tokens)
                    steps += result.steps if repeat == 0 else 0
                times[mode] = time.perf_counter() - start
            pairs.append((times["plain"], times["capture"]))
    return {
        "probes": len(probes),
        "repeats": repeats,
        "decode_steps": steps,
        "mean_prompt_tokens": sum(len(p.input_ids) for p in probes) / len(probes),
        **_summary(pairs, ("plain_generate", "behaviour_probe")),
    }


def bench_query_stats(model, windows, batch_size, n_sink, repeats):
    geometry = ModelGeometry.of(model)
    acc = QueryMoments(geometry.num_layers, geometry.num_q_heads, geometry.head_dim)
    pairs = []
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    with torch.no_grad():
        model.model(input_ids=batches[0][:1, :32], use_cache=False)  # warm-up
        for index, ids in enumerate(batches):
            for repeat in range(repeats):
                times = {}
                order = ("plain", "stats") if (index + repeat) % 2 == 0 else ("stats", "plain")
                for mode in order:
                    start = time.perf_counter()
                    if mode == "plain":
                        model.model(input_ids=ids, use_cache=False)
                    else:
                        with acc.collect(geometry, n_sink=n_sink):
                            model.model(input_ids=ids, use_cache=False)
                    times[mode] = time.perf_counter() - start
                pairs.append((times["plain"], times["stats"]))
    return {
        "windows": int(windows.shape[0]),
        "tokens_per_window": int(windows.shape[1]),
        "repeats": repeats,
        **_summary(pairs, ("plain_forward", "query_stats")),
    }


def bench_quick_job():
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kv_calibration.h5"
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "profiler.cli", "--preset", "quick", "--out", str(out), "--no-progress"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
        peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if result.returncode != 0:
            raise SystemExit(f"profile-model failed:\n{result.stderr[-3000:]}")
        summary = [
            line for line in result.stdout.splitlines() if line.split(":")[0] in ("behaviour", "query-stats", "budgets")
        ]
        return {"wall_s": round(wall, 1), "peak_rss_mib": round(peak_kib / 1024, 1), "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--probes-preset",
        default="quick",
        choices=list(PRESETS),
        help="profile preset whose probes the behaviour comparison uses",
    )
    parser.add_argument("--limit", type=int, default=12, help="probes used for the behaviour comparison")
    parser.add_argument("--calib-windows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="measurements per probe / batch and mode")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--skip-job", action="store_true", help="do not run the full quick job")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(), load_tokenizer()
    preset = PRESETS["quick"]
    probe_set = preset_probes(
        PRESETS[args.probes_preset].probes, tokenizer, overrides=dict(PRESETS[args.probes_preset].probe_overrides)
    )
    picks = sorted({round(i * (len(probe_set) - 1) / max(1, args.limit - 1)) for i in range(args.limit)})
    probes = [probe_set[i] for i in picks]  # evenly over the grid: families, lengths and depths
    results = {
        "threads": torch.get_num_threads(),
        "behaviour": bench_behaviour(model, tokenizer, probes, preset.max_new_tokens, args.repeats),
    }
    print("behaviour:", json.dumps(results["behaviour"]), flush=True)
    windows = calibration_windows(tokenizer, None, args.calib_windows, preset.calib_tokens)
    results["query_stats"] = bench_query_stats(model, windows, preset.batch_size, preset.n_sink, args.repeats)
    print("query_stats:", json.dumps(results["query_stats"]), flush=True)
    if not args.skip_job:
        results["quick_job"] = bench_quick_job()
        print("quick_job:", json.dumps(results["quick_job"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
