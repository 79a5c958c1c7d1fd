"""Where the leverage scorer's time goes, and what undoing RoPE in float32 instead of float64 changes.

    python benchmarks/leverage_cost.py [--batch 8] [--context 2048] [--repeats 5] [--threads 1]

The embedded model prefills ``--context`` tokens of filler (as ``benchmarks/prefill_all_in.py``) at
``--batch`` rows; then, for every layer, the leverage scorer's inputs (``HeadEvictor.layer_inputs``:
post-RoPE keys ``[B, Hkv, n, d]`` and their ``cos, sin``) are taken once and timed, interleaved, per
layer and summed over the layers:

* ``unrotate float64``: RoPE undone in float64 (the scorer before R-leverage-cost-2026-11-27);
* ``unrotate float32``: in float32 (the scorer now);
* ``leverage``: ``helpers.leverage_scores`` of the float32-unrotated keys (sketch of 48, float64).

Also the largest relative difference between the leverage scores of the two unrotations, and how
many kept rows at 25% kept (top-k of the scores) differ between them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from prefill_all_in import context_ids  # noqa: E402

from common.models import load_model, load_tokenizer, use_progress_bars  # noqa: E402
from runtime import RaggedCache  # noqa: E402
from runtime.compression.eviction import HeadEvictor  # noqa: E402
from runtime.compression.prefill import prefill  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402
from runtime.plan.policy import CompressionPolicy  # noqa: E402
from runtime.plan.serving_plan import bind  # noqa: E402
from runtime.scorers.helpers import leverage_scores, unrotate  # noqa: E402
from runtime.scorers.inputs import KeyRope  # noqa: E402


def seconds(function, arguments) -> float:
    start = time.perf_counter()
    function(*arguments)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="batch rows (default 8)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per layer and variant (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    use_progress_bars(no_progress=True)
    model, tokenizer = load_model(), load_tokenizer()
    plan = bind(CompressionPolicy(keep_ratio=0.25, scorer="leverage"), None, model)
    enable(model)
    cache = RaggedCache.for_model(model)
    with torch.no_grad():
        stats = prefill(model, cache, context_ids(tokenizer, args.context).repeat(args.batch, 1), policy=plan)
        evictor = HeadEvictor(plan, stats)
        rows = list(range(args.batch))
        totals = {"unrotate float64": 0.0, "unrotate float32": 0.0, "leverage": 0.0}
        worst, changed, kept = 0.0, 0, 0
        scorer = plan.scorer
        for index, layer in enumerate(cache.layers):
            inputs = evictor.layer_inputs(layer, index, rows, layer.real_seen)
            keys = inputs.keys
            rotation = inputs[KeyRope()]  # the embedded model's layers rotate_half
            cos, sin = rotation.cos, rotation.sin
            lengths = inputs.lengths
            first = lengths.clamp(max=scorer.exclude_first)
            last = (lengths - first).clamp(max=scorer.exclude_last)
            row = torch.arange(keys.shape[2])
            middle = (row >= first.unsqueeze(-1)) & (row < (lengths - last).unsqueeze(-1))
            sketch = scorer.layer_sketch(index, keys.shape[1], keys.shape[-1], keys.device)
            wide = unrotate(keys.double(), cos.double(), sin.double())
            narrow = unrotate(keys.float(), cos.float(), sin.float())
            variants = {
                "unrotate float64": (lambda k, c, s: unrotate(k.double(), c.double(), s.double()), (keys, cos, sin)),
                "unrotate float32": (lambda k, c, s: unrotate(k.float(), c.float(), s.float()), (keys, cos, sin)),
                "leverage": (leverage_scores, (narrow, middle, sketch)),
            }
            for _ in range(args.repeats):  # interleaved
                for name, (function, arguments) in variants.items():
                    totals[name] += seconds(function, arguments)
            a, b = leverage_scores(wide, middle, sketch), leverage_scores(narrow, middle, sketch)
            worst = max(worst, float(((a - b).abs() / a.abs().clamp_min(1e-12))[middle].max()))
            k = max(1, int(0.25 * keys.shape[2]))
            in_a = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(k, dim=-1).indices, True)
            in_b = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, b.topk(k, dim=-1).indices, True)
            changed += int((in_a & ~in_b).sum())  # kept under float64, not under float32
            kept += int(in_a.sum())
    print(f"batch {args.batch}, {args.context} tokens, {len(cache.layers)} layers, ms per step of all layers:\n")
    print("| part | ms | share of float64 unrotate |")
    print("|---|---|---|")
    base = totals["unrotate float64"] / args.repeats
    for name, total in totals.items():
        print(f"| {name} | {total / args.repeats * 1e3:.1f} | {total / args.repeats / base:.2f} |")
    print(f"\nlargest relative difference of the leverage scores, float32 vs float64 unrotation: {worst:.1e}")
    print(f"kept rows (top 25% by leverage) that differ: {changed} of {kept}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
