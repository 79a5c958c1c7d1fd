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
import sys
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
    from sink_prefill import alternate_prefills, build, report

    import runtime.kv_store.layer_attention as layer_attention

    torch.set_num_threads(1)
    model = build(args.layers, "sliding_attention", args.window)
    ids = torch.randint(3, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    variants = {"blocks": layer_attention.WINDOW_BLOCK_QUERIES, "one block": 10 * args.tokens}
    times, last = alternate_prefills(model, ids, layer_attention, "WINDOW_BLOCK_QUERIES", variants, args.repeats)
    report(args, times, last, f"{args.layers} sliding layers (window {args.window})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
