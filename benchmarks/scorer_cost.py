"""What scoring costs: seconds per KV head for each scorer, and KVzip's reconstruction pass vs the prefill.

    python benchmarks/scorer_cost.py [--lengths 1024 2048 4096] [--repeat 3] [--threads 1] [--json OUT]
        [--artifact kv_calibration.h5] [--no-kvzip]

For one ``quick`` retrieval probe of each length (embedded model, seed 1000): the prefill time
(ragged cache, recording every prompt query), KVzip's reconstruction pass
(:func:`runtime.compression.kvzip.kvzip_scores`), and for every scorer the time the engine takes to score
every ``L x Hkv`` head of the prefilled cache (``HeadEvictor.layer_scores``, one call per layer,
what ``compress`` runs; median of ``--repeat``), reported per head and, for all heads together,
as a fraction of the prefill.  ``--artifact`` adds the artifact's
``learned`` scorer (profile-model's learned-scorer stage).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.models import load_model, load_tokenizer  # noqa: E402
from runtime import RaggedCache  # noqa: E402
from runtime.compression.eviction import HeadEvictor  # noqa: E402
from runtime.compression.kvzip import kvzip_scores, with_kvzip_scores  # noqa: E402
from runtime.compression.prefill import prefill  # noqa: E402
from runtime.plan.policy import CompressionPolicy  # noqa: E402
from runtime.plan.serving_plan import bind  # noqa: E402
from runtime.scorers import ALL_QUERIES  # noqa: E402

SCORERS = {
    "keydiff": {"scorer": "keydiff"},
    "leverage (sketch 48)": {"scorer": "leverage", "scorer_options": {"blend": 0.75}},
    "leverage (exact)": {"scorer": "leverage", "scorer_options": {"blend": 0.75, "sketch": None}},
    "leverage alone (exact)": {"scorer": "leverage", "scorer_options": {"blend": None, "sketch": None}},
    "non-causal attention alone": {"scorer": "leverage", "scorer_options": {"blend": 0}},
    "kvzip (lookup)": {"scorer": "kvzip"},
}


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--artifact", default=None, help="calibration artifact with a learned_scorer section")
    parser.add_argument("--no-kvzip", action="store_true", help="skip KVzip's reconstruction pass")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from needles import PRESETS, generate_probes

    model, tokenizer = load_model(), load_tokenizer()
    scorers = {label: fields for label, fields in SCORERS.items() if not (args.no_kvzip and label.startswith("kvzip"))}
    calibration = None
    if args.artifact:
        from runtime import load_calibration

        calibration = load_calibration(model, tokenizer, path=args.artifact)
        scorers["learned"] = {"scorer": "learned"}
    spec = PRESETS["quick"].replace(families=("retrieval",), seed=1000)
    probes = {}
    for probe in generate_probes(spec, tokenizer):
        probes.setdefault(probe.length, probe)
    rows = []
    for length in args.lengths:
        probe = min(probes.values(), key=lambda p: abs(p.length - length))
        ids = torch.tensor([probe.input_ids[: probe.context_end]])
        cache = RaggedCache.for_model(model)
        started = time.perf_counter()
        prefill(model, cache, ids, observe_queries=ALL_QUERIES)
        prefill_s = time.perf_counter() - started
        kvzip = [] if args.no_kvzip else [kvzip_scores(model, tokenizer, cache, ids[0]) for _ in range(args.repeat)]
        kvzip_s = statistics.median(s.seconds for s in kvzip) if kvzip else float("nan")
        row = {
            "context": ids.shape[1],
            "prefill_seconds": prefill_s,
            "kvzip_seconds": kvzip_s,
            "kvzip_over_prefill": kvzip_s / prefill_s,
            "kvzip_tokens": kvzip[0].reconstruction_tokens if kvzip else 0,
            "per_head_ms": {},
            "all_heads_over_prefill": {},
        }
        layers, heads = len(cache.layers), cache.layers[0].num_heads
        for label, fields in scorers.items():
            policy = CompressionPolicy(keep_ratio=0.25, **fields)
            if fields["scorer"] == "kvzip":
                policy = with_kvzip_scores(policy, kvzip[0])
            evictor = HeadEvictor(bind(policy, calibration, model))
            times = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                for layer_idx, layer in enumerate(cache.layers):
                    evictor.layer_scores(layer, layer_idx, [0], [ids.shape[1]])
                times.append(time.perf_counter() - started)
            row["per_head_ms"][label] = 1000 * statistics.median(times) / (layers * heads)
            row["all_heads_over_prefill"][label] = statistics.median(times) / prefill_s
        rows.append(row)
        print(
            f"context {row['context']}: prefill {prefill_s:.2f} s, kvzip reconstruction {kvzip_s:.2f} s "
            f"({row['kvzip_over_prefill']:.2f} x, {row['kvzip_tokens']} tokens); per head: "
            + ", ".join(
                f"{k} {v:.2f} ms ({100 * row['all_heads_over_prefill'][k]:.1f}% of the prefill)"
                for k, v in row["per_head_ms"].items()
            ),
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
