"""MomentKV runtime costs on the embedded model: correction per decode step, decode-time
eviction, and the peak memory of chunked (block-wise) prefill.

    python benchmarks/moments_perf.py [--context 4096] [--keep 0.25] [--steps 48] [--threads 1]
                                      [--budget 512] [--block 256] [--artifact PATH] [--json OUT]

1. **correction overhead per decode step**: one ``--context``-token prompt compressed once to
   ``--keep`` of its cache (SnapKV selection, uniform budgets), copied into caches that differ
   only in the correction (none; first order on every head; with ``--artifact``, the
   artifact's per-head orders); single-token forward passes through them alternate step by
   step (same tokens), and the median step time of each is divided by the uncorrected one's
   (target: <= 1.15).  The same for decode-time eviction (``evict_every`` 1 and 16).
2. **chunked prefill memory**: the prompt prefilled at once vs in blocks of ``--block``
   tokens with eviction to ``--budget`` tokens per head after each block (KeyDiff), each in
   a fresh process: the largest KV cache held (bytes, from the cache's own accounting)
   and the process's peak resident memory growth during prefill (``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.models import load_model, load_tokenizer  # noqa: E402
from runtime import CompressionPolicy, RaggedCache, compress_prompt, load_calibration  # noqa: E402
from runtime.compression.prefill import compress, prefill  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402
from runtime.kv_store.transformers_compat import cache_argument  # noqa: E402

SENTENCES = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "A bird sings in the tree.",
    "The river runs to the sea.",
]


def context_ids(tokenizer, length: int) -> torch.Tensor:
    text = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(length))
    return torch.tensor([tokenizer(text)["input_ids"][:length]])


@torch.no_grad()
def decode_overhead(model, ids, keep: float, steps: int, calibration) -> dict:
    base = RaggedCache.for_model(model)
    stats = prefill(model, base, ids, observe_queries=32, record_prompt_stats=True, n_sink=4)
    plain = CompressionPolicy(keep_ratio=keep, scorer="snapkv")
    variants = {"none": plain, "order1": CompressionPolicy(keep_ratio=keep, scorer="snapkv", correction="order1")}
    if calibration is not None and calibration.moment_orders is not None:
        variants["calibrated"] = CompressionPolicy(keep_ratio=keep, scorer="snapkv", correction="calibrated")
    caches = {}
    for name, policy in variants.items():
        cache = base.copy()
        compress(model, cache, policy, calibration, prompt_stats=stats)
        caches[name] = cache
    for every in (1, 16):  # decode-time eviction, no correction
        policy = CompressionPolicy(keep_ratio=keep, scorer="keydiff", evict_every=every)
        cache = base.copy()
        compress(model, cache, policy, calibration, prompt_stats=stats)
        caches[f"evict_every={every}"] = cache
    keydiff = base.copy()
    compress(model, keydiff, CompressionPolicy(keep_ratio=keep, scorer="keydiff"), calibration, prompt_stats=stats)
    caches["keydiff (no decode eviction)"] = keydiff
    tokens = torch.randint(100, 5000, (steps,), generator=torch.Generator().manual_seed(0))
    times = {name: [] for name in caches}
    for step in range(steps):
        for name, cache in caches.items():
            position = torch.tensor([[ids.shape[1] + step]])
            started = time.perf_counter()
            model(
                input_ids=tokens[step].view(1, 1), position_ids=position, **cache_argument(model, cache), use_cache=True
            )
            times[name].append(time.perf_counter() - started)
    median = {name: statistics.median(values[4:]) for name, values in times.items()}  # first steps warm up
    lengths = {name: int(cache.head_lengths().sum()) for name, cache in caches.items()}
    return {
        "median_step_ms": {name: 1000 * value for name, value in median.items()},
        "correction_ratio": {name: median[name] / median["none"] for name in variants},
        "decode_eviction_ratio": {
            name: median[name] / median["keydiff (no decode eviction)"]
            for name in caches
            if name.startswith("evict_every")
        },
        "live_tokens": lengths,
        "moment_bytes": caches["order1"].moment_bytes(),
    }


def _chunked_child(queue, context: int, budget: int, block: int | None, threads: int) -> None:
    torch.set_num_threads(threads)
    model, tokenizer = load_model(), load_tokenizer()
    enable(model)
    ids = context_ids(tokenizer, context)
    peak = {"cache": 0}
    original = RaggedCache.kv_bytes

    def spy(cache):  # compress() reads kv_bytes before evicting: that is the cache's peak
        value = original(cache)
        peak["cache"] = max(peak["cache"], value)
        return value

    RaggedCache.kv_bytes = spy
    policy = CompressionPolicy(budget=budget, scorer="keydiff")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    with torch.no_grad():
        full_ids = torch.cat([ids, ids[:, -1:]], dim=1)  # one extra column: compress_prompt leaves it for generate
        cache, report = compress_prompt(model, full_ids, policy, context_columns=context, block_size=block)
    seconds = time.perf_counter() - started
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put(
        {
            "block": block,
            "peak_cache_bytes": peak["cache"],
            "final_cache_bytes": original(cache),
            "peak_rss_growth_mib": (rss_after - rss_before) / 1024,
            "seconds": seconds,
            "max_head_tokens_after": int(report.lengths_after.max()),
        }
    )


def chunked_memory(context: int, budget: int, block: int, threads: int) -> list[dict]:
    results = []
    spawn = multiprocessing.get_context("spawn")
    for size in (None, block):
        queue = spawn.Queue()
        child = spawn.Process(target=_chunked_child, args=(queue, context, budget, size, threads))
        child.start()
        results.append(queue.get())
        child.join()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument("--keep", type=float, default=0.25, help="fraction of the cache kept (default 0.25)")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed per cache (default 48)")
    parser.add_argument("--budget", type=int, default=512, help="chunked prefill: tokens per head (default 512)")
    parser.add_argument("--block", type=int, default=256, help="chunked prefill: block size (default 256)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--artifact", default=None, help="calibration artifact (adds the per-head orders row)")
    parser.add_argument("--skip-memory", action="store_true", help="only the decode timings")
    parser.add_argument("--json", default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(), load_tokenizer()
    enable(model)
    calibration = load_calibration(model, tokenizer, path=args.artifact) if args.artifact else None
    ids = context_ids(tokenizer, args.context)
    results = {"context": args.context, "keep": args.keep, "threads": args.threads}
    results["decode"] = decode = decode_overhead(model, ids, args.keep, args.steps, calibration)
    print(f"decode step at {args.context} tokens, {args.keep:.0%} kept (median of {args.steps - 4} steps):")
    for name, value in decode["median_step_ms"].items():
        print(f"  {name:32s} {value:7.2f} ms   live tokens {decode['live_tokens'][name]}")
    for name, ratio in decode["correction_ratio"].items():
        print(f"  correction {name:21s} x{ratio:.3f} of the uncorrected step")
    for name, ratio in decode["decode_eviction_ratio"].items():
        print(f"  {name:32s} x{ratio:.3f} of a step without decode eviction")
    print(f"  moment sums: {decode['moment_bytes'] / 2**20:.2f} MiB for the whole model")
    if not args.skip_memory:
        results["chunked"] = chunked = chunked_memory(args.context, args.budget, args.block, args.threads)
        print(f"prefill of {args.context} tokens, budget {args.budget} per head (KeyDiff):")
        for row in chunked:
            label = "at once" if row["block"] is None else f"blocks of {row['block']}"
            print(
                f"  {label:16s} peak cache {row['peak_cache_bytes'] / 2**20:6.1f} MiB, final "
                f"{row['final_cache_bytes'] / 2**20:5.1f} MiB, peak RSS growth {row['peak_rss_growth_mib']:6.0f} MiB, "
                f"{row['seconds']:.1f} s"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
