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
   ``--compress-repeats`` times; reported: each median CPU seconds and their ratio;
3. **decisions**: ``generate`` under each of :data:`DECISION_CASES` (eviction inside the prefill,
   after it, block-wise, global allocation, decode-time eviction) on both sides; reported: whether
   the tokens, the budgets, the lengths and every head's kept positions are identical.

One torch thread; the embedded model; ``--artifact`` a calibration both revisions read
(default: a smoke profile made here).  < 1 is faster than the base.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `from runtime.x import`, `from runtime import`, `import runtime.x` at a line's start
ABSOLUTE_IMPORT = re.compile(r"^(\s*)(from|import) runtime(\.|\s)", re.M)
sys.path.insert(0, str(REPO))


def unpack_base_runtime(revision: str, directory: Path) -> None:
    """``REV:runtime/`` as the package ``runtime_base`` under ``directory``, its absolute imports of
    ``runtime`` rewritten to ``runtime_base`` (the two must not share modules)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision, "runtime"], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"revision_ab: git archive {revision} failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(directory, filter="data")
    (directory / "runtime").rename(directory / "runtime_base")
    for path in (directory / "runtime_base").rglob("*.py"):
        text = ABSOLUTE_IMPORT.sub(r"\1\2 runtime_base\3", path.read_text())
        for node in ast.walk(ast.parse(text)):  # what the rewrite missed would load this tree's modules
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(name == "runtime" or name.startswith("runtime.") for name in names):
                raise SystemExit(f"revision_ab: {revision}'s {path.name} imports runtime in a way not rewritten")
        path.write_text(text)
    sys.path.insert(0, str(directory))


def prefill_module(runtime):
    """The module holding ``prefill_for_policies``: ``compression.prefill`` since the subpackages
    (issue 42), ``compression`` before, ``compress`` before the redesign renamed it."""
    for name in ("compression.prefill", "compression", "compress"):
        try:
            module = importlib.import_module(f"{runtime.__name__}.{name}")
        except ModuleNotFoundError:
            continue
        if hasattr(module, "prefill_for_policies"):
            return module
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

    runs, scopes = {}, {"plain": contextlib.nullcontext}
    for tag, (runtime, calibration) in sides.items():
        policy = runtime.FLAGSHIP.policy(0.75)
        base = prefilled(runtime, model, ids, [policy])
        base.batch_repeat_interleave(batch)
        full = base.copy()
        full.stop_observing()
        compress_function(runtime)(model, base, policy, calibration)
        runs[f"full/{tag}"] = [full, torch.full((batch, 1), 1000)]
        runs[f"flagship/{tag}"] = [base, torch.full((batch, 1), 1000)]
        # each side's caches attended by its own attention function (their signatures may differ)
        scopes[f"full/{tag}"] = scopes[f"flagship/{tag}"] = lambda runtime=runtime: runtime.ragged_attention(model)
    plain = DynamicCache(config=plain_model.config)
    plain_model(ids, **cache_argument(plain_model, plain), use_cache=True, logits_to_keep=1)
    plain.batch_repeat_interleave(batch)
    runs["plain"] = [plain, torch.full((batch, 1), 1000)]
    models = {name: plain_model if name == "plain" else model for name in runs}
    for _ in range(2):  # warm-up; both sides must agree
        logits = {}
        for name, run in runs.items():
            with scopes[name]():
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
            with scopes[name]():  # the switch itself is not timed
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


def served(runtime, model, ids, mask, policy, calibration, question: int, **options) -> dict:
    """What ``runtime`` serves for ``ids [B, T]``: the greedy tokens, the report's budgets and lengths,
    and every (layer, row, KV head)'s kept positions after the generation."""
    result = runtime.generate(
        model,
        ids,
        policy,
        attention_mask=mask,
        context_columns=ids.shape[1] - question,
        calibration=calibration,
        max_new_tokens=12,
        pad_token_id=0,
        **options,
    )
    kept = [
        [[layer.head(b, h)[2].tolist() for h in range(layer.num_heads)] for b in range(layer.batch_size)]
        for layer in result.cache.layers
    ]
    report = result.report
    return {
        "tokens": result.new_tokens.tolist(),
        "budgets": None if report is None else report.budgets.tolist(),
        "lengths": None if report is None else report.lengths_after.tolist(),
        "kept": kept,
    }


# the served decisions compared: (name, policy text or CompressionPolicy arguments, generate() options)
DECISION_CASES = (
    ("flagship", "flagship", {}),
    ("inf/keydiff+correction", "inf/keydiff+correction", {}),
    ("uniform/snapkv", "uniform/snapkv", {}),
    ("global/learned", "global/learned", {}),
    ("uniform/keydiff, block-wise prefill", "uniform/keydiff", {"block_size": 256}),
    ("keydiff evicting while decoding", {"budget": 96, "scorer": "keydiff", "evict_every": 4}, {}),
    (
        "flagship evicting while decoding",
        {"budget": 96, "allocation": "inf", "scorer": "leverage", "correction": "calibrated", "evict_every": 3},
        {},
    ),
)


def decisions_ab(sides, model, ids) -> dict:
    """Each of :data:`DECISION_CASES` served by both sides on two rows (the second left-padded by 100
    tokens), 75% evicted: whether tokens, budgets, lengths and kept positions are identical."""
    import torch

    context = ids[:, -512:]
    rows = torch.cat([context, torch.cat([torch.zeros(1, 100, dtype=context.dtype), context[:, 100:]], 1)])
    mask = torch.ones_like(rows)
    mask[1, :100] = 0
    results = {}
    for name, policy, options in DECISION_CASES:
        outcomes = []
        for runtime, calibration in sides.values():
            served_policy = (
                runtime.parse_policy(policy).policy(0.75)
                if isinstance(policy, str)
                else runtime.CompressionPolicy(**policy)
            )
            outcomes.append(served(runtime, model, rows, mask, served_policy, calibration, 24, **options))
        base, this = outcomes
        results[name] = {part: base[part] == this[part] for part in base}
    return results


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
    from runtime.compression.ragged_attention import enable
    from runtime.kv_store.transformers_compat import cache_argument

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
        report["decisions"] = decisions_ab(sides, model, ids)
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
    print("\nServed decisions, two rows (one left-padded), 75% evicted, 12 new tokens (identical: yes / no):\n")
    print("| case | tokens | budgets | lengths | kept positions |")
    print("|---|---|---|---|---|")
    for name, same in report["decisions"].items():
        cells = " | ".join("yes" if same[part] else "NO" for part in ("tokens", "budgets", "lengths", "kept"))
        print(f"| {name} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
