"""Runtime performance on the embedded model: compression overhead, decode speed, KV bytes.

    python benchmarks/runtime_perf.py [--context 4096] [--keep-ratio 0.25] [--decode-tokens 32]
                                      [--repeats 3] [--threads 1] [--artifact PATH] [--json OUT]
                                      [--batch-sizes 1 8]

Measures, within one run on this machine (ratios, so background load hits both sides alike):

1. **prefill overhead**: time to evict down to ``--keep-ratio`` (``runtime.compress``) divided by the
   time of the ordinary prefill (sdpa, DynamicCache) of the same ``--context`` tokens
   (target <= 5%).  "all-in" adds the ragged-cache prefill's own extra time (per-head
   attention, prompt-statistics hooks) over the ordinary prefill.  Policies: EA with prompt
   statistics (always) and, with ``--artifact``, EA with calibrated statistics and INF budgets,
   and the learned scorer with the global allocation when the artifact has its section.
2. **decode speed**: greedy tokens/s through the compressed ragged cache vs through the full
   DynamicCache of the unmodified model, same loop, the two alternating step by step
   (target: ratio >= 1), also as ms per decode step; ``--batch-sizes`` repeats everything for
   each batch size (the context repeated in every row).
3. **KV bytes** held after compression vs the full cache (target <= 0.27 at 25%), and vs the
   budget formula ``sum(per-head budgets) x 2 x d x bytes`` (target <= 1.05).
4. With ``--artifact``: time to load and validate the artifact (fingerprint already known).

The context is simple filler sentences (no probe generator needed).  ``--threads 1`` (default)
avoids two intra-op threads spinning against other processes on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime import CompressionPolicy, RaggedCache, compress, enable, load_calibration, prefill  # noqa: E402
from runtime.models import load_model, load_tokenizer  # noqa: E402


def progress(items):
    from tqdm import tqdm  # the benchmark may use it; runtime/ does not

    items = list(items)
    return tqdm(items, desc="policies", unit="policy")


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
    text, index = [], 0
    while len(tokenizer(" ".join(text))["input_ids"]) < length:
        text.extend(SENTENCES[(index + k) % len(SENTENCES)] for k in range(50))
        index += 3
    return torch.tensor([tokenizer(" ".join(text))["input_ids"][:length]])


def dynamic_cache_bytes(cache) -> int:
    return sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )


@torch.no_grad()
def plain_prefill(model, ids):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True), time.perf_counter() - start


@torch.no_grad()
def interleaved_decode(model, caches_and_tokens: dict, steps: int) -> dict:
    """Greedy steps alternating between the caches (one step each in turn, so background load
    hits all alike); tokens per second of each."""
    seconds = {name: 0.0 for name in caches_and_tokens}
    tokens = {name: token for name, (_, token) in caches_and_tokens.items()}
    for _ in range(steps):
        for name, (cache, _) in caches_and_tokens.items():
            start = time.perf_counter()
            logits = model(tokens[name], past_key_values=cache, use_cache=True).logits
            tokens[name] = logits[:, -1].argmax(-1, keepdim=True)
            seconds[name] += time.perf_counter() - start
    return {name: steps / total for name, total in seconds.items()}


@torch.no_grad()
def compressed_cache(model, ids, policy, calibration):
    cache = RaggedCache.for_model(model)
    start = time.perf_counter()
    stats = prefill(model, cache, ids, policy=policy)
    prefill_s = time.perf_counter() - start
    report = compress(model, cache, policy, calibration, prompt_stats=stats)
    return cache, report, prefill_s


def run_batch(model, ids, batch, args, policies, results) -> None:
    """Every policy at one batch size: prefill overheads, interleaved decode, KV bytes."""
    for name, (policy, calibration) in progress(policies.items()):
        prefill_times, ragged_prefill_times, compress_times = [], [], []
        for repeat in range(args.repeats):
            order = ("plain", "ragged") if repeat % 2 == 0 else ("ragged", "plain")
            for mode in order:
                if mode == "plain":
                    full, full_token, seconds = plain_prefill(model, ids)
                    prefill_times.append(seconds)
                else:
                    cache, report, seconds = compressed_cache(model, ids, policy, calibration)
                    ragged_prefill_times.append(seconds)
                    compress_times.append(report.seconds)
        full_bytes = dynamic_cache_bytes(full)
        held = cache.kv_bytes()
        formula = int(report.budgets.sum()) * cache.bytes_per_token()
        rates = interleaved_decode(
            model, {"plain": (full, full_token), "compressed": (cache, ids[:, -1:])}, args.decode_tokens
        )
        del full, cache
        # min over repeats: the least disturbed run of each (the machine is shared)
        row = {
            "prefill_s": min(prefill_times),
            "ragged_prefill_s": min(ragged_prefill_times),
            "compress_s": min(compress_times),
            "prefill_s_all": prefill_times,
            "ragged_prefill_s_all": ragged_prefill_times,
            "compress_s_all": compress_times,
            "plain_decode_tok_s": rates["plain"],
            "compressed_decode_tok_s": rates["compressed"],
            "kv_bytes_full": full_bytes,
            "kv_bytes_compressed": held,
            "kv_bytes_formula": formula,
        }
        row["compress_overhead"] = row["compress_s"] / row["prefill_s"]
        # everything the compressed path adds: ragged prefill (with any recording hooks) + eviction
        row["total_overhead"] = (row["ragged_prefill_s"] + row["compress_s"]) / row["prefill_s"] - 1.0
        row["compressed_decode_ms"] = 1000 / row["compressed_decode_tok_s"]
        row["plain_decode_ms"] = 1000 / row["plain_decode_tok_s"]
        row["decode_speed_ratio"] = row["compressed_decode_tok_s"] / row["plain_decode_tok_s"]
        row["kv_bytes_ratio"] = held / full_bytes
        row["bytes_vs_budget_formula"] = held / formula
        results["policies"][f"{name} batch {batch}"] = row
        print(
            f"{name:20s} batch {batch}  prefill {row['prefill_s']:.2f}s (ragged {row['ragged_prefill_s']:.2f}s)  "
            f"compress {row['compress_s'] * 1000:.0f} ms = {100 * row['compress_overhead']:.1f}% of prefill "
            f"(all-in {100 * row['total_overhead']:+.1f}%)  "
            f"decode {row['compressed_decode_tok_s']:.2f} vs {row['plain_decode_tok_s']:.2f} tok/s "
            f"(x{row['decode_speed_ratio']:.2f}; {row['compressed_decode_ms']:.1f} vs {row['plain_decode_ms']:.1f} "
            f"ms/step)  KV bytes x{row['kv_bytes_ratio']:.3f} of full, "
            f"x{row['bytes_vs_budget_formula']:.3f} of budget formula",
            flush=True,
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096, help="context tokens (default 4096)")
    parser.add_argument(
        "--keep-ratio", type=float, default=0.25, help="kept fraction of the context (default 0.25: compression 0.75)"
    )
    parser.add_argument("--decode-tokens", type=int, default=32, help="greedy steps per decode timing (default 32)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="alternated prefill repetitions, the fastest of each kept (default 2)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--artifact", default=None, help="calibration artifact for calibrated EA + INF budgets")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="batch sizes to run (default 1)")
    args = parser.parse_args(argv)
    if not 0 < args.keep_ratio <= 1 or args.context < 64 or args.decode_tokens < 1 or args.repeats < 1:
        parser.error("need 0 < ratio <= 1, context >= 64, decode-tokens >= 1, repeats >= 1")
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model(), load_tokenizer()
    single = context_ids(tokenizer, args.context)  # [1, T]
    policies = {
        "ea-prompt/uniform": (
            CompressionPolicy(scorer="expected_attention", keep_ratio=args.keep_ratio, statistics="prompt"),
            None,
        )
    }
    results = {"context": args.context, "keep_ratio": args.keep_ratio, "threads": args.threads, "policies": {}}
    if args.artifact:
        load_calibration(model, tokenizer, path=args.artifact)  # computes the weights fingerprint once
        start = time.perf_counter()
        calibration = load_calibration(model, tokenizer, path=args.artifact)
        results["artifact_load_ms"] = 1000 * (time.perf_counter() - start)
        policies["ea-calibrated/inf"] = (
            CompressionPolicy(
                scorer="expected_attention", keep_ratio=args.keep_ratio, allocation="inf", statistics="calibrated"
            ),
            calibration,
        )
        if calibration.scorer_weights is not None:
            policies["learned/global"] = (
                CompressionPolicy(keep_ratio=args.keep_ratio, allocation="global", scorer="learned"),
                calibration,
            )
    policies["keydiff/uniform"] = (CompressionPolicy(keep_ratio=args.keep_ratio, scorer="keydiff"), None)

    plain_prefill(model, single[:, :256])  # warm-up
    enable(model)
    for batch in args.batch_sizes:
        ids = single.expand(batch, -1).contiguous()  # [B, T]
        run_batch(model, ids, batch, args, policies, results)
    if "artifact_load_ms" in results:
        print(f"artifact load (fingerprint known): {results['artifact_load_ms']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
