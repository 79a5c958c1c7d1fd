"""Which heads keep the needle? Fraction of each head's retrieval (R) span tokens that survive
question-agnostic compression, per scorer, on the heads REAL ranks highest.

    python benchmarks/needle_retention.py --artifact kv_calibration.h5 [--keep 0.25]
        [--length 2048] [--depths 10 50] [--seed 1000] [--top 12] [--allocation inf|uniform]
        [--scorers ea-calibrated ea-prompt keydiff ...]

For each retrieval probe the context is prefilled once; copies are compressed with INF
budgets (``--allocation``; the same budgets for every scorer) and each of ``--scorers``
(calibrated EA, prompt EA, KeyDiff by default; ``ea-future`` and ``proto`` read the artifact's
``future_queries`` section); the
table lists, for the ``--top`` KV heads by INF weight, the fraction of the R span (the
needle's answer tokens) each scorer kept.  This is how calibrated Expected Attention's collapse
at high compression was diagnosed (docs/results.md R-flagship-keydiff-2026-11-21): on this model
it drops most of the needle in several high-INF retrieval heads where KeyDiff keeps it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.models import load_model, load_tokenizer  # noqa: E402
from runtime import CompressionPolicy, RaggedCache, load_calibration  # noqa: E402
from runtime.compression.prefill import compress, prefill  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402

SCORERS = {
    "ea-calibrated": {"scorer": "expected_attention", "statistics": "calibrated"},
    "ea-prompt": {"scorer": "expected_attention", "statistics": "prompt"},
    "keydiff": {"scorer": "keydiff"},
    "ea-future": {"scorer": "expected_attention", "statistics": "future"},
    "proto": {"scorer": "prototype_attention"},
    "proto-mean": {"scorer": "prototype_attention", "scorer_options": {"centres": "mean"}},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, help="calibration artifact of the embedded model")
    parser.add_argument("--keep", type=float, default=0.25, help="fraction of the cache kept (default 0.25)")
    parser.add_argument("--length", type=int, default=2048, help="probe length in tokens (default 2048)")
    parser.add_argument("--depths", type=float, nargs="+", default=[10.0, 50.0], help="needle depths (default 10 50)")
    parser.add_argument("--seed", type=int, default=1000, help="probe seed (default 1000)")
    parser.add_argument("--top", type=int, default=12, help="heads listed, by INF weight (default 12)")
    parser.add_argument("--allocation", default="inf", choices=("inf", "uniform"), help="budgets (default inf)")
    parser.add_argument(
        "--scorers",
        nargs="+",
        default=["ea-calibrated", "ea-prompt", "keydiff"],
        choices=sorted(SCORERS),
        help="scorers compared (default ea-calibrated ea-prompt keydiff)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from needles.spec import make_probe

    model, tokenizer = load_model(), load_tokenizer()
    enable(model)
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    weights = calibration.inf_weights
    top = np.argsort(-weights.ravel())[: args.top]
    for depth in args.depths:
        probe = make_probe(tokenizer, "retrieval", args.length, depth, seed=args.seed)
        ids = torch.tensor([probe.input_ids])
        base = RaggedCache.for_model(model)
        stats = prefill(
            model, base, ids[:, : probe.context_end], record_prompt_stats=True, observe_queries=32, n_sink=4
        )
        needle = {p for span in probe.spans if span.label == "R" for p in range(span.start, span.end)}
        kept = {}
        for name in args.scorers:
            fields = SCORERS[name]
            cache = base.copy()
            compress(
                model,
                cache,
                CompressionPolicy(keep_ratio=args.keep, allocation=args.allocation, **fields),
                calibration,
                prompt_stats=stats,
            )
            kept[name] = np.array(
                [
                    [len(set(layer.head(0, h)[2].tolist()) & needle) / len(needle) for h in range(layer.num_heads)]
                    for layer in cache.layers
                ]
            )
        print(
            f"{probe.id} (answer {probe.answer}, {len(needle)} R tokens), {args.keep:.0%} kept, "
            f"{args.allocation} budgets"
        )
        print("  mean over all heads: " + ", ".join(f"{name} {value.mean():.2f}" for name, value in kept.items()))
        print("  head      INF w   " + "  ".join(f"{name:>13s}" for name in kept))
        for index in top:
            layer, head = divmod(int(index), weights.shape[1])
            print(
                f"  L{layer:<2d} H{head}  {weights[layer, head]:.3f}   "
                + "  ".join(f"{kept[name][layer, head]:13.2f}" for name in kept)
            )
    calibration.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
