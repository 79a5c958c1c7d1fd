"""Time to a compressed cache: a policy's own prefill plus its compression, against the plain prefill.

    python benchmarks/prefill_all_in.py (--artifact PATH [--model DIR] [--chunks C ...] | --geometry 8b|70b)
                                        [--layers 2] [--context 2048] [--batch-sizes 1 8] [--keep-ratio 0.25]
                                        [--repeats 1] [--threads 1] [--json OUT]

For each batch size B (the context repeated in every row, filler sentences as in
``benchmarks/runtime_perf.py``), alternating within one run so background load hits every side:

* ``plain``: the unmodified embedded model prefilling a DynamicCache with SDPA (``logits_to_keep=1``);
* for each policy: ``runtime.compression.prefill.prefill(model, cache, ids, policy=plan)`` into a RaggedCache, recording
  what the policy's scorer needs (the flagship's leverage: its chunked attention, accumulated in the
  prefill since issue 28; before, every prompt query), then ``runtime.compression.prefill.compress``; the cell is
  "ratio (prefill s + compression s)", ratio = (prefill + compression) / plain prefill.

With ``--geometry 8b|70b`` the model is instead a random-weight Llama of that layer geometry
(``benchmarks/profiler_scale.py``'s, with the real MLP width unless ``--mlp-width``), ``--layers``
layers: what Compactor's scoring costs against the prefill of the models users serve.  No artifact
fits a random model, so the flagship's scorer and correction are served with uniform budgets and
first-order corrections (``uniform/leverage+correction1``); the scoring and the compression work
are the flagship's, the budgets equal.  To serve the flagship itself on such a model, save it
(``profiler_scale.build_model_dir``), profile it (``profile-model DIR --preset smoke``) and pass
``--model DIR --artifact``.

Policies: the flagship ``inf/leverage+correction`` at ``1 - keep-ratio`` evicted (with ``--chunks``:
once per chunk size of its chunked attention, R-chunk-size-2026-11-27), and ``uniform/keydiff``
(records nothing).  Printed twice: the fastest of ``--repeats`` per cell over
the fastest plain prefill, and the median over the repeats of each repeat's ratio to the plain
prefill run just before it, in wall and in CPU (process) seconds: this shared machine's speed drifts
by 10-15% between minutes, which pairing and CPU time see less of.  Then the policy's own work timed
directly (the chunk mass inside its prefill, by a timer around
``RowState.accumulate_chunk_attention``, plus its compression) as a share of the plain prefill: the
whole prefill's time also moves by 10-18% with the kernel's page faults (``sys`` time; glibc maps
and unmaps every large tensor), which this share does not carry.  Issue 28's bar: flagship <= 1.02x
plain at B=8, 2K tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.models import load_model, load_tokenizer, use_progress_bars  # noqa: E402
from runtime import CompressionPolicy, RaggedCache, load_calibration  # noqa: E402
from runtime.compression.prefill import compress, prefill  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402
from runtime.kv_store.row_state import RowState  # noqa: E402
from runtime.kv_store.transformers_compat import cache_argument  # noqa: E402
from runtime.plan.policy_spec import FLAGSHIP  # noqa: E402
from runtime.plan.serving_plan import bind  # noqa: E402


def context_ids(tokenizer, length: int) -> torch.Tensor:
    """``[1, length]`` token ids of filler sentences (as benchmarks/runtime_perf.py)."""
    text, i = [], 0
    while len(tokenizer(" ".join(text))["input_ids"]) < length:
        text.append(f"Sentence {i} talks about the weather, the river and the market of town {i % 17}.")
        i += 1
    return torch.tensor([tokenizer(" ".join(text))["input_ids"][:length]])


def _kernel_work(before) -> tuple[float, int]:
    """System CPU seconds and minor page faults since ``before`` (a ``resource.getrusage``)."""
    after = resource.getrusage(resource.RUSAGE_SELF)
    return after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt


@torch.no_grad()
def plain_seconds(model, ids) -> tuple[float, float, float, int]:
    """Wall and CPU (process) seconds of the plain prefill, and its system seconds and minor page faults."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start, cpu = time.perf_counter(), time.process_time()
    model(ids, **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - start, time.process_time() - cpu, *_kernel_work(usage)


@contextlib.contextmanager
def timing_chunk_attention():
    """Yields a list whose one number becomes the wall seconds spent in
    ``RowState.accumulate_chunk_attention`` (the chunk mass inside the prefill) while the block runs:
    the benchmark's own instrumentation, a timer around that one method, removed on exit."""
    spent = [0.0]
    original = RowState.accumulate_chunk_attention

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    RowState.accumulate_chunk_attention = timed
    try:
        yield spent
    finally:
        RowState.accumulate_chunk_attention = original


@torch.no_grad()
def policy_seconds(model, ids, plan) -> tuple[float, float, float, float, float, int]:
    """Wall seconds of the prefill and of the compression, CPU (process) seconds of both, wall
    seconds of the chunk mass inside the prefill, and system seconds and minor page faults of both."""
    cache = RaggedCache.for_model(model)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with timing_chunk_attention() as chunk_mass:
        start, cpu = time.perf_counter(), time.process_time()
        stats = prefill(model, cache, ids, policy=plan)
        middle = time.perf_counter()
        compress(model, cache, plan, prompt_stats=stats)
        compression, cpu = time.perf_counter() - middle, time.process_time() - cpu
    return middle - start, compression, cpu, chunk_mass[0], *_kernel_work(usage)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default=None, help="calibration artifact (INF budgets, correction orders)")
    parser.add_argument(
        "--geometry",
        choices=("8b", "70b"),
        default=None,
        help="a random-weight Llama of this layer geometry instead of the embedded model (no artifact)",
    )
    parser.add_argument("--layers", type=int, default=2, help="layers of the --geometry model (default 2)")
    parser.add_argument(
        "--model",
        default=None,
        help="with --artifact: the model directory it profiles (default: the embedded model), e.g. a "
        "--geometry model saved by benchmarks/profiler_scale.build_model_dir and profiled by profile-model",
    )
    parser.add_argument("--mlp-width", type=int, default=None, help="MLP width of the --geometry model (default: real)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="batch sizes (default 1 8)")
    parser.add_argument("--keep-ratio", type=float, default=0.25, help="kept fraction (default 0.25)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell, the fastest kept (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=None,
        help="the flagship once per chunk size of its chunked attention (default: the scorer's own)",
    )
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.keep_ratio < 1 or args.context < 64 or min(args.batch_sizes) < 1 or args.repeats < 1:
        parser.error("need 0 < keep-ratio < 1, context >= 64, batch sizes >= 1, repeats >= 1")
    if args.chunks and min(args.chunks) < 1:
        parser.error("chunk sizes must be at least 1")
    if (args.artifact is None) == (args.geometry is None):
        parser.error("give --artifact (the embedded model) or --geometry (a random-weight model), not both")
    if args.model is not None and args.artifact is None:
        parser.error("--model needs --artifact, a profile of that model")
    if args.geometry and args.chunks:
        parser.error("--chunks serves the flagship: it needs --artifact")
    torch.set_num_threads(args.threads)
    use_progress_bars(no_progress=True)
    with tempfile.TemporaryDirectory() as directory:
        source = args.model
        if args.geometry:
            sys.path.insert(0, str(REPO / "benchmarks"))
            from profiler_scale import GEOMETRIES, build_model_dir

            width = args.mlp_width or GEOMETRIES[args.geometry][4]
            build_model_dir(Path(directory), args.geometry, args.layers, width, "float32")
            source = directory
        plain_model, model, tokenizer = load_model(source), load_model(source), load_tokenizer(source)
    if args.geometry:
        leverage = CompressionPolicy(
            keep_ratio=args.keep_ratio, allocation="uniform", scorer="leverage", correction="order1"
        )
        plans = {"uniform/leverage+correction1": bind(leverage, None, model)}
    else:
        calibration = load_calibration(model, tokenizer, path=args.artifact)
        plans = {"flagship inf/leverage+correction": bind(FLAGSHIP.policy(1 - args.keep_ratio), calibration, model)}
    if args.chunks:
        flagship = FLAGSHIP.policy(1 - args.keep_ratio)
        plans = {
            f"flagship, chunk {chunk}": bind(replace(flagship, scorer_options={"chunk": chunk}), calibration, model)
            for chunk in args.chunks
        }
    plans["uniform/keydiff"] = bind(CompressionPolicy(keep_ratio=args.keep_ratio, scorer="keydiff"), None, model)
    enable(model)
    ids = context_ids(tokenizer, args.context)
    plain_seconds(plain_model, ids[:, :256])  # warm-up
    policy_seconds(model, ids[:, :256], plans["uniform/keydiff"])
    results = {
        "context": args.context,
        "keep_ratio": args.keep_ratio,
        "artifact": args.artifact,
        "geometry": args.geometry,
        "layers": args.layers if args.geometry else None,
        "cells": [],
    }
    for batch in args.batch_sizes:
        rows = ids.repeat(batch, 1)
        plain, cells = [], {name: [] for name in plans}
        for _ in range(args.repeats):
            plain.append(plain_seconds(plain_model, rows))
            gc.collect()
            for name, plan in plans.items():
                cells[name].append(policy_seconds(model, rows, plan))
                gc.collect()
            print(
                f"B={batch}: plain {plain[-1][0]:.2f} s, "
                + ", ".join(f"{n} {sum(c[-1][:2]):.2f} s" for n, c in cells.items()),
                file=sys.stderr,
                flush=True,
            )
        base = min(run[0] for run in plain)
        cell = {"batch": batch, "plain_s": base, "plain_runs": plain}
        for name, runs in cells.items():
            best = min(runs, key=lambda run: run[0] + run[1])
            cell[name] = {
                "prefill_s": best[0],
                "compress_s": best[1],
                "ratio": (best[0] + best[1]) / base,
                # each repeat against the plain prefill just before it, wall and CPU time
                "paired_wall": statistics.median((r[0] + r[1]) / p[0] for r, p in zip(runs, plain, strict=True)),
                "paired_cpu": statistics.median(r[2] / p[1] for r, p in zip(runs, plain, strict=True)),
                # the policy's own work, timed directly: the chunk mass in its prefill plus its compression
                "own_work": statistics.median((r[3] + r[1]) / p[0] for r, p in zip(runs, plain, strict=True)),
                "chunk_mass_s": statistics.median(r[3] for r in runs),
                "runs": runs,
            }
        results["cells"].append(cell)
    print(f"Prefill + compression against the plain prefill, {args.context} tokens, {args.keep_ratio:.0%} kept:\n")
    print("| batch | plain s | " + " | ".join(plans) + " |")
    print("|---|---|" + "---|" * len(plans))
    for cell in results["cells"]:
        parts = [f"{cell[n]['ratio']:.3f} ({cell[n]['prefill_s']:.2f} + {cell[n]['compress_s']:.2f})" for n in plans]
        print(f"| {cell['batch']} | {cell['plain_s']:.2f} | " + " | ".join(parts) + " |")
    print(f"\nMedian over the {args.repeats} repeats of each one's ratio to the plain prefill before it, wall | CPU:\n")
    print("| batch | " + " | ".join(plans) + " |")
    print("|---|" + "---|" * len(plans))
    for cell in results["cells"]:
        parts = [f"{cell[n]['paired_wall']:.3f} \\| {cell[n]['paired_cpu']:.3f}" for n in plans]
        print(f"| {cell['batch']} | " + " | ".join(parts) + " |")
    print(
        "\nThe policy's own work, timed directly, as a share of the plain prefill before it (median over the "
        "repeats): chunk mass inside the prefill + compression (median chunk-mass seconds):\n"
    )
    print("| batch | " + " | ".join(plans) + " |")
    print("|---|" + "---|" * len(plans))
    for cell in results["cells"]:
        parts = [f"{cell[n]['own_work']:.3f} ({cell[n]['chunk_mass_s']:.2f} s)" for n in plans]
        print(f"| {cell['batch']} | " + " | ".join(parts) + " |")
    print("\nSystem CPU seconds and minor page faults per run (median; the kernel's share of the prefill):\n")
    print("| batch | plain | " + " | ".join(plans) + " |")
    print("|---|---|" + "---|" * len(plans))
    for cell in results["cells"]:
        sides = [cell["plain_runs"]] + [cell[n]["runs"] for n in plans]
        parts = [
            f"{statistics.median(r[-2] for r in runs):.2f} s, {statistics.median(r[-1] for r in runs) / 1e6:.2f}M"
            for runs in sides
        ]
        print(f"| {cell['batch']} | " + " | ".join(parts) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
