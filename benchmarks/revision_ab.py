"""The runtime of this tree against the runtime of another git revision, in one process.

    python benchmarks/revision_ab.py --base REV [--batch-sizes 1 8] [--context 2048] [--steps 40]
                                     [--compress-repeats 8] [--artifact PATH] [--json OUT]

Two runs of ``benchmarks/runtime_perf.py`` on a shared machine differ by more than a small
change of the runtime does (plain's own step moved 20% between two runs of the same day:
docs/results.md R-redesign-perf-2026-11-24).  This benchmark removes that noise from the
comparison: ``git archive REV runtime`` is unpacked as the package ``runtime_base`` (the runtime
imports itself relatively, so both live in one interpreter), both prefill the same context into
their own caches on the same model, and then

1. **decode**: the ragged cache with nothing evicted ("full") and the flagship at 75% evicted,
   base and this tree, plus plain DynamicCache, one greedy step each in turn (the starting one
   rotating every step) for ``--steps`` steps; reported: the median of the paired per-step
   ratios this/base, and each configuration's median ms and ratio to plain;
2. **compression**: ``compress`` of a copy of the prefilled cache under the flagship and
   ``inf/keydiff+correction``, base and this tree alternating (order flipped every repeat),
   ``--compress-repeats`` times; reported: each median CPU seconds and their ratio.

One torch thread; the embedded model; ``--artifact`` a calibration both revisions read
(default: a smoke profile made here).  < 1 is faster than the base.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def unpack_base_runtime(revision: str, directory: Path) -> None:
    """``REV:runtime/`` as the package ``runtime_base`` under ``directory`` (refused when it imports
    ``runtime`` absolutely: the two would then share modules)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "runtime"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"revision_ab: git archive {revision} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(directory, filter="data")
    (directory / "runtime").rename(directory / "runtime_base")
    for path in (directory / "runtime_base").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(name == "runtime" or name.startswith("runtime.") for name in names):
                raise SystemExit(f"revision_ab: {revision}'s {path.name} imports runtime absolutely; cannot load both")
    sys.path.insert(0, str(directory))


def prefill_module(runtime):
    """The module holding ``prefill_for_policies`` (``compress`` before the redesign renamed it)."""
    for name in ("compression", "compress"):
        try:
            return importlib.import_module(f"{runtime.__name__}.{name}")
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"revision_ab: {runtime.__name__} has no compression module")


def compress_function(runtime):
    """``compress`` of a runtime: from its compression module (this tree's package no longer exports
    it, issue 42), else the package's (revisions before the redesign)."""
    return getattr(prefill_module(runtime), "compress", None) or runtime.compress


def step(model, cache, token, cache_argument):
    return model(token, **cache_argument(model, cache), use_cache=True).logits[:, -1]


def prefilled(runtime, model, ids, policies):
    cache = runtime.RaggedCache.for_model(model)
    prefill_module(runtime).prefill_for_policies(model, cache, ids, policies)
    return cache


def decode_ab(sides, model, plain_model, ids, batch: int, steps: int, cache_argument) -> dict:
    """Per-step times of full/flagship caches of both sides and of plain, interleaved."""
    import torch
    from transformers import DynamicCache

    runs = {}
    for tag, (runtime, calibration) in sides.items():
        policy = runtime.FLAGSHIP.policy(0.75)
        base = prefilled(runtime, model, ids, [policy])
        base.batch_repeat_interleave(batch)
        full = base.copy()
        full.stop_observing()
        compress_function(runtime)(model, base, policy, calibration)
        runs[f"full/{tag}"] = [full, torch.full((batch, 1), 1000)]
        runs[f"flagship/{tag}"] = [base, torch.full((batch, 1), 1000)]
    plain = DynamicCache(config=plain_model.config)
    plain_model(ids, **cache_argument(plain_model, plain), use_cache=True, logits_to_keep=1)
    plain.batch_repeat_interleave(batch)
    runs["plain"] = [plain, torch.full((batch, 1), 1000)]
    models = {name: plain_model if name == "plain" else model for name in runs}
    for _ in range(2):  # warm-up; both sides must agree
        logits = {}
        for name, run in runs.items():
            logits[name] = step(models[name], run[0], run[1], cache_argument)
            run[1] = logits[name].argmax(-1, keepdim=True)
        for config in ("full", "flagship"):
            if not torch.equal(logits[f"{config}/base"], logits[f"{config}/this"]):
                print(f"note: {config} logits differ between base and this tree", file=sys.stderr)
    names = list(runs)
    times = {name: [] for name in names}
    for i in range(steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            run = runs[name]
            start = time.perf_counter()
            logits = step(models[name], run[0], run[1], cache_argument)
            times[name].append(1000 * (time.perf_counter() - start))
            run[1] = logits.argmax(-1, keepdim=True)
    plain_ms = statistics.median(times["plain"])
    result = {"median_ms": {n: statistics.median(t) for n, t in times.items()}, "times_ms": times}
    result["ratio_to_plain"] = {n: statistics.median(t) / plain_ms for n, t in times.items()}
    result["paired_this_over_base"] = {
        config: statistics.median(
            new / old for old, new in zip(times[f"{config}/base"], times[f"{config}/this"], strict=True)
        )
        for config in ("full", "flagship")
    }
    return result


def compression_ab(sides, model, ids, repeats: int) -> dict:
    policies = {"flagship": "flagship", "inf/keydiff+correction": "inf/keydiff+correction"}
    prepared = {}
    for tag, (runtime, calibration) in sides.items():
        served = {name: runtime.parse_policy(text).policy(0.75) for name, text in policies.items()}
        prepared[tag] = (runtime, calibration, served, prefilled(runtime, model, ids, list(served.values())))
    seconds = {(name, tag): [] for name in policies for tag in sides}
    for i in range(repeats):
        for name in policies:
            for tag in ("base", "this") if i % 2 == 0 else ("this", "base"):
                runtime, calibration, served, cache = prepared[tag]
                copy = cache.copy()
                start = time.thread_time()
                compress_function(runtime)(model, copy, served[name], calibration)
                seconds[(name, tag)].append(time.thread_time() - start)
    medians = {f"{name}/{tag}": statistics.median(s) for (name, tag), s in seconds.items()}
    return {
        "median_cpu_s": medians,
        "this_over_base": {name: medians[f"{name}/this"] / medians[f"{name}/base"] for name in policies},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision to compare against (e.g. a commit)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=2048, help="context tokens (default 2048)")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per configuration")
    parser.add_argument("--compress-repeats", type=int, default=8, help="compressions per side and policy")
    parser.add_argument("--artifact", type=Path, help="a calibration both revisions read (default: a smoke profile)")
    parser.add_argument("--json", type=Path, help="write every time measured here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    scratch = tempfile.TemporaryDirectory()
    unpack_base_runtime(args.base, Path(scratch.name))
    import runtime_base
    from runtime_perf import context_ids  # the same filler context as runtime_perf's

    import runtime
    from common.models import load_model, load_tokenizer, use_progress_bars
    from runtime.attention import enable
    from runtime.transformers_compat import cache_argument

    use_progress_bars(no_progress=True)
    artifact = args.artifact
    if artifact is None:
        from profiler.cli import main as profile

        artifact = Path(scratch.name) / "smoke.h5"
        profile(["--preset", "smoke", "--out", str(artifact), "--no-progress"])
    model, plain_model, tokenizer = load_model(), load_model(), load_tokenizer()
    enable(model)
    ids = context_ids(tokenizer, args.context)
    sides = {
        "base": (runtime_base, runtime_base.load_calibration(model, tokenizer, path=artifact)),
        "this": (runtime, runtime.load_calibration(model, tokenizer, path=artifact)),
    }
    report = {"base": args.base, "context": args.context, "decode": {}}
    with torch.no_grad():
        for batch in args.batch_sizes:
            report["decode"][batch] = decode_ab(sides, model, plain_model, ids, batch, args.steps, cache_argument)
        report["compression"] = compression_ab(sides, model, ids, args.compress_repeats)
    print(f"This tree against {args.base}, {args.context} tokens, one thread (< 1: this tree is faster).\n")
    print(
        "| batch | full: this/base (paired) | flagship: this/base (paired) | plain ms | full base / this (x plain) "
        "| flagship base / this (x plain) |"
    )
    print("|---|---|---|---|---|---|")
    for batch, cell in report["decode"].items():
        r, paired = cell["ratio_to_plain"], cell["paired_this_over_base"]
        print(
            f"| {batch} | {paired['full']:.3f} | {paired['flagship']:.3f} "
            f"| {cell['median_ms']['plain']:.1f} | {r['full/base']:.2f} / {r['full/this']:.2f} "
            f"| {r['flagship/base']:.2f} / {r['flagship/this']:.2f} |"
        )
    print(f"\nCompression at batch 1, median CPU s over {args.compress_repeats} alternated repeats:\n")
    for name, ratio in report["compression"]["this_over_base"].items():
        m = report["compression"]["median_cpu_s"]
        print(f"* {name}: base {m[f'{name}/base']:.2f} s, this {m[f'{name}/this']:.2f} s, this/base {ratio:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
