"""A sliding-window layer's first prefill in blocks of queries against one block of every pair.

    python benchmarks/window_prefill.py [--tokens 4096] [--layers 2] [--window 128] [--repeats 3] [--json OUT]

The random gpt-oss of ``benchmarks/sink_prefill.py`` (gpt-oss-20b's attention, learned sinks), every layer
sliding over ``--window`` tokens (gpt-oss-20b's: 128), its MLP small, float32, one torch thread.
``compress_prompt(model, ids, None)`` (the prefill alone) runs each layer's first chunk through
``runtime.kv_store.layer_attention._masked_chunk_attention`` either in blocks of ``max(W, 256)`` queries,
each over the ``W - 1`` columns before it and itself, or, as before, as one block of every (query, key) pair
(``WINDOW_BLOCK_QUERIES`` set past the chunk); the two alternate ``--repeats`` times.  Printed: the median
seconds, their ratio, and the two variants' last logits' max |difference|.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch
    from sink_prefill import build

    import runtime.kv_store.layer_attention as layer_attention
    from runtime import compress_prompt
    from runtime.compression.ragged_attention import ragged_attention
    from runtime.kv_store.transformers_compat import cache_argument

    torch.set_num_threads(1)
    model = build(args.layers, "sliding_attention", args.window)
    ids = torch.randint(3, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    block = layer_attention.WINDOW_BLOCK_QUERIES
    variants = {"blocks": block, "one block": 10 * args.tokens}
    times = {name: [] for name in variants}
    last = {}
    with torch.no_grad():
        for repeat in range(args.repeats):
            for name in list(variants) if repeat % 2 == 0 else list(variants)[::-1]:
                layer_attention.WINDOW_BLOCK_QUERIES = variants[name]
                try:
                    start = time.perf_counter()
                    cache, _ = compress_prompt(model, ids[:, :-1], None)
                    times[name].append(time.perf_counter() - start)
                    with ragged_attention(model):
                        last[name] = model(ids[:, -1:], **cache_argument(model, cache)).logits[0, -1]
                finally:
                    layer_attention.WINDOW_BLOCK_QUERIES = block
            print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    difference = float((last["blocks"] - last["one block"]).abs().max())
    print(
        f"\n{args.tokens} tokens x {args.layers} sliding layers (window {args.window}), median of {args.repeats}: "
        f"blocks {median['blocks']:.2f} s, one block {median['one block']:.2f} s "
        f"(blocks / one block {median['blocks'] / median['one block']:.3f}); last logits differ by {difference:.2e}"
    )
    if args.json:
        record = {"args": vars(args) | {"json": str(args.json)}, "seconds": times, "median": median}
        args.json.write_text(json.dumps(record | {"logit_difference": difference}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
