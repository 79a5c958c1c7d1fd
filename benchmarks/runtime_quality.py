"""Retrieval accuracy under question-agnostic compression: allocations x scorers x ratios.

    python benchmarks/runtime_quality.py --artifact kv_calibration.h5 [--preset quick]
        [--families retrieval] [--lengths 1024 2048] [--count 1] [--haystack simple]
        [--compression 0.5 0.75 0.9] [--rows ROW ...] [--reference ROW] [--max-new-tokens 24]
        [--limit N] [--threads 1] [--json OUT]

On the ``needles`` probes of ``--preset`` (default ``quick``: 1K/2K/4K tokens, depths
10/50/90%) restricted to ``--families`` (default ``retrieval``), with the embedded model:

* each probe's context ``input_ids[:context_end]`` is prefilled **once** into a ragged cache
  (recording the prompt's query statistics and last queries for every scorer);
* for every row (``--rows``; default: allocation ``uniform``/``inf`` x scorer EA calibrated,
  EA prompt, KeyDiff, SnapKV, KNorm, StreamingLLM; MomentKV variants such as
  ``inf/snapkv+mom+corr`` on request, see ``--list-rows``) x compression ratio, a copy of that
  cache is compressed to keep ``1 - ratio`` of the context (the EA paper's convention: ratio = fraction evicted), then
  ``model.generate`` feeds the question and decodes greedily;
* the uncompressed baseline decodes from the unevicted cache; all cells of a probe decode
  together as one batch (``RaggedCache.stack``: one compressed cache per batch element).

Question-agnostic baselines from the field: ``leverage`` (Compactor, arXiv 2507.08143, as
kvpress's CompactorPress: blend = the compression ratio) and its one-change ablations
(``leverage-exact``, ``-b05``, ``-post``, ``-scaled``, ``-only``, ``ncattn``); ``kvzip``
(arXiv 2505.23416): a reconstruction pass scores the prefilled cache once per probe
(``runtime.compression.kvzip``); ``global/kvzip`` uses KVzip's own allocation (one top-k over all heads).
Cells print accuracy with its 95% Wilson interval, the kept fraction of the KV bytes and the
compression time per probe; the prefill and reconstruction times are summed at the end.

With ``--reference ROW`` every other row is also paired against it: W / L = probes only that row / only
the reference answered, per ratio (R-chunk-size-2026-11-27).  ``--json`` is rewritten after every probe.

Accuracy = fraction of probes whose answer contains the ground truth
(``needles.answer_is_correct``).  All cells come from one run.  The probes are unseen by the
artifact (a seed other than its profiling seed), but several defaults were chosen on them
(docs/results.md calls them the 18 tuning probes); held-out numbers come from
``evaluate-artifact``.  Policy defaults: 4 sinks, 32-token window, EA horizon 512, SnapKV
window 32.
The INF allocation and calibrated EA need ``--artifact`` (the embedded model's profile);
without it those rows are skipped.
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

from common.formulas import wilson_interval  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from profiler.evaluation import decode_together  # noqa: E402
from runtime import CompressionPolicy, RaggedCache, load_calibration  # noqa: E402
from runtime.compression.kvzip import with_reconstruction_scores  # noqa: E402
from runtime.compression.prefill import compress, prefill_for_policies  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402

SCORERS = {  # row label -> CompressionPolicy fields
    "ea-calibrated": {"scorer": "expected_attention", "statistics": "calibrated"},
    "ea-prompt": {"scorer": "expected_attention", "statistics": "prompt"},
    "ea-calibrated-pool7": {"scorer": "expected_attention", "statistics": "calibrated", "scorer_options": {"pool": 7}},
    "ea-prompt-pool7": {"scorer": "expected_attention", "statistics": "prompt", "scorer_options": {"pool": 7}},
    # kvpress's ExpectedAttentionPress adds epsilon = 1e-2 to the attention estimate before the value norm
    "ea-calibrated-eps": {
        "scorer": "expected_attention",
        "statistics": "calibrated",
        "scorer_options": {"epsilon": 1e-2},
    },
    "ea-prompt-eps": {"scorer": "expected_attention", "statistics": "prompt", "scorer_options": {"epsilon": 1e-2}},
    # EA's epsilon before it defaulted to 1e-2
    "ea-calibrated-eps0": {
        "scorer": "expected_attention",
        "statistics": "calibrated",
        "scorer_options": {"epsilon": 0.0},
    },
    "ea-prompt-eps0": {"scorer": "expected_attention", "statistics": "prompt", "scorer_options": {"epsilon": 0.0}},
    # statistics of the queries after the probes' context (the artifact's future_queries section)
    "ea-future": {"scorer": "expected_attention", "statistics": "future"},
    "ea-future-eps0": {"scorer": "expected_attention", "statistics": "future", "scorer_options": {"epsilon": 0.0}},
    "proto": {"scorer": "prototype_attention"},  # its defaults: max over the centres and the GQA group, horizon 64
    # a needle is several contiguous tokens: keep the neighbours of a peak (kvpress's SnapKV / EA pooling)
    "proto-pool3": {"scorer": "prototype_attention", "scorer_options": {"pool": 3}},
    "proto-pool5": {"scorer": "prototype_attention", "scorer_options": {"pool": 5}},
    "proto-pool9": {"scorer": "prototype_attention", "scorer_options": {"pool": 9}},
    "proto-mean": {"scorer": "prototype_attention", "scorer_options": {"centres": "mean"}},
    "proto-gmax": {"scorer": "prototype_attention", "scorer_options": {"group": "max"}},
    "proto-eps": {"scorer": "prototype_attention", "scorer_options": {"epsilon": 1e-2}},
    "proto-mean-gmax": {"scorer": "prototype_attention", "scorer_options": {"centres": "mean", "group": "max"}},
    "proto-gmax-h64": {"scorer": "prototype_attention", "scorer_options": {"group": "max", "horizon": 64}},
    "proto-mean-h64": {"scorer": "prototype_attention", "scorer_options": {"centres": "mean", "horizon": 64}},
    "proto-mean-gmax-h64": {
        "scorer": "prototype_attention",
        "scorer_options": {"centres": "mean", "group": "max", "horizon": 64},
    },
    # RoPE averaged over the span the question and answer occupy (~40-60 tokens), not EA's 512
    "proto-h64": {"scorer": "prototype_attention", "scorer_options": {"horizon": 64}},
    "proto-eps-h64": {"scorer": "prototype_attention", "scorer_options": {"horizon": 64, "epsilon": 1e-2}},
    "ea-future-h64": {"scorer": "expected_attention", "statistics": "future", "scorer_options": {"horizon": 64}},
    "keydiff": {"scorer": "keydiff"},
    "snapkv": {"scorer": "snapkv"},
    "knorm": {"scorer": "knorm"},
    "streaming": {"scorer": "streaming"},
    # Compactor (arXiv 2507.08143) as kvpress's CompactorPress: blend = the compression ratio
    # ("ratio" is replaced per cell), Gaussian sketch of 48 columns, pre-RoPE keys
    "leverage": {"scorer": "leverage", "scorer_options": {"blend": "ratio"}},
    # ablations of the Compactor recipe (one change each)
    "leverage-b05": {"scorer": "leverage", "scorer_options": {"blend": 0.5}},  # compactor-vllm's weight
    "leverage-exact": {"scorer": "leverage", "scorer_options": {"blend": "ratio", "sketch": None}},
    "leverage-post": {"scorer": "leverage", "scorer_options": {"blend": "ratio", "pre_rope": False}},
    "leverage-scaled": {"scorer": "leverage", "scorer_options": {"blend": "ratio", "attention_scale": None}},
    "leverage-only": {"scorer": "leverage", "scorer_options": {"blend": None, "sketch": None}},
    "ncattn": {"scorer": "leverage", "scorer_options": {"blend": 0}},  # non-causal chunked attention alone
    # smaller chunks for the chunked attention: its cost in the prefill is proportional to the chunk (issue 28)
    "leverage-c128": {"scorer": "leverage", "scorer_options": {"blend": "ratio", "chunk": 128}},
    "leverage-c64": {"scorer": "leverage", "scorer_options": {"blend": "ratio", "chunk": 64}},
    "leverage-c32": {"scorer": "leverage", "scorer_options": {"blend": "ratio", "chunk": 32}},
    # KVzip (arXiv 2505.23416): scores from a context-reconstruction pass, computed once per probe
    "kvzip": {"scorer": "kvzip"},
    # the artifact's learned scorer (profile-model's learned-scorer stage: KVzip distilled into a
    # per-head linear map of the pre-RoPE key and value); no extra forward pass
    "learned": {"scorer": "learned"},
}
# MomentKV variants: "+corr" = correction with the artifact's per-head orders,
# "+corr1" = first order on every head, "+mom" = moment-informed eviction (a_j ||r_j||)
MOMENT_VARIANTS = {
    "+corr": {"correction": "calibrated"},
    "+corr1": {"correction": "order1"},
    "+mom": {"moment_eviction": True},
    "+mom+corr": {"moment_eviction": True, "correction": "calibrated"},
}
ALLOCATIONS = ("uniform", "inf")
# the engine's global allocation (runtime.compression.keep_rule.global_budgets): over KVzip's scores it is the
# paper's own allocation (one top-k over every layer and KV head)
GLOBAL_ROWS = {
    "global/kvzip": ("global", SCORERS["kvzip"]),
    "global/kvzip+corr": ("global", {**SCORERS["kvzip"], **MOMENT_VARIANTS["+corr"]}),
    "global/learned": ("global", SCORERS["learned"]),
    "global/learned+corr": ("global", {**SCORERS["learned"], **MOMENT_VARIANTS["+corr"]}),
}


def all_rows() -> dict[str, tuple[str, dict]]:
    """``ALLOCATION/LABEL[VARIANT]`` -> (allocation, policy fields) for every known row."""
    rows = {}
    for allocation in ALLOCATIONS:
        for label, fields in SCORERS.items():
            rows[f"{allocation}/{label}"] = (allocation, fields)
            for suffix, extra in MOMENT_VARIANTS.items():
                if extra.get("moment_eviction") and fields["scorer"] not in ("expected_attention", "snapkv"):
                    continue
                rows[f"{allocation}/{label}{suffix}"] = (allocation, {**fields, **extra})
    rows.update(GLOBAL_ROWS)
    return rows


DEFAULT_ROWS = [
    f"{allocation}/{label}"
    for allocation in ALLOCATIONS
    for label in ("ea-calibrated", "ea-prompt", "keydiff", "snapkv", "knorm", "streaming")
]
SEED_OFFSET = 1000


@torch.no_grad()
def run_probe(model, tokenizer, probe, cells, calibration, max_new_tokens):
    """Answers of the baseline and every (label, allocation, ratio) cell for one probe, and timings."""
    from needles import answer_is_correct

    ids = torch.tensor([probe.input_ids], dtype=torch.long)
    base = RaggedCache.for_model(model)
    started = time.perf_counter()
    stats = prefill_for_policies(model, base, ids[:, : probe.context_end], [policy for _, policy in cells])
    timings = {"prefill_seconds": time.perf_counter() - started}
    policies, kvzip = with_reconstruction_scores(
        model, tokenizer, base, probe.input_ids[: probe.context_end], [policy for _, policy in cells]
    )
    if kvzip is not None:
        timings.update(kvzip_seconds=kvzip.seconds, kvzip_chunks=kvzip.chunks, kvzip_tokens=kvzip.reconstruction_tokens)

    keys = [("baseline", None)] + [key for key, _ in cells]
    caches = [base]
    compress_seconds = [0.0]
    for policy in policies:
        cache = base.copy()
        report = compress(model, cache, policy, calibration, prompt_stats=stats)
        caches.append(cache)
        compress_seconds.append(report.seconds)
    base.stop_observing()  # the baseline decodes without the recorded queries
    kv_bytes = [cache.kv_bytes() for cache in caches]
    # every cell decodes in one batch: same prompt, one compressed cache per batch element
    texts, _ = decode_together(model, tokenizer, ids, caches, max_new_tokens)
    results = {}
    for row, (key, text) in enumerate(zip(keys, texts, strict=True)):
        results[key] = {
            "text": text,
            "correct": bool(answer_is_correct(text, probe)),
            "kv_bytes": kv_bytes[row],
            "kept": kv_bytes[row] / kv_bytes[0],
            "compress_seconds": compress_seconds[row],
        }
    return results, timings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", default=None, help="calibration artifact of the embedded model")
    parser.add_argument("--preset", default="quick", help="needles probe preset (default quick)")
    parser.add_argument("--families", nargs="+", default=["retrieval"], help="needle families (default retrieval)")
    parser.add_argument(
        "--compression",
        nargs="+",
        type=float,
        default=[0.5, 0.75, 0.9],
        help="fractions of the context evicted (default 0.5 0.75 0.9)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24, help="greedy tokens per answer (default 24)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N probes")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths (default: the preset's)")
    parser.add_argument("--count", type=int, default=1, help="probes per (family, length, depth) (default 1)")
    parser.add_argument("--haystack", default=None, help="haystack: simple | prose | ... (default: the preset's)")
    parser.add_argument(
        "--reference",
        default=None,
        help="a row to pair every other row against: W / L = probes only that row / only the reference answered",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"probe seed (default: the artifact's profiling seed + {SEED_OFFSET}, so the "
        "test probes are never the ones the artifact was profiled on)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--json", default=None, help="also write per-probe results and the table as JSON")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=DEFAULT_ROWS,
        help="policy rows (default: every allocation x scorer without MomentKV; see --list-rows)",
    )
    parser.add_argument("--list-rows", action="store_true", help="print the known rows and exit")
    args = parser.parse_args(argv)
    rows = all_rows()
    if args.list_rows:
        print("\n".join(rows))
        return 0
    unknown = [row for row in args.rows if row not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown}; see --list-rows")
    if args.reference is not None and args.reference not in args.rows:
        parser.error(f"--reference {args.reference!r} must be one of --rows")
    if args.count < 1:
        parser.error("--count must be at least 1")
    if any(not 0.0 < r < 1.0 for r in args.compression):
        parser.error("compression ratios must be in (0, 1)")
    torch.set_num_threads(args.threads)

    from tqdm import tqdm

    from needles import PRESETS, generate_probes

    if args.preset not in PRESETS:
        parser.error(f"unknown preset {args.preset!r}; known: {', '.join(PRESETS)}")
    model, tokenizer = load_model(), load_tokenizer()
    enable(model)
    calibration = load_calibration(model, tokenizer, path=args.artifact) if args.artifact else None
    profiled_seed = None  # config entries are free-form: one of another kind is ignored (docs/artifact-format.md)
    behaviour = calibration.config.get("behaviour") if calibration else None
    spec = behaviour.get("spec") if isinstance(behaviour, dict) else None
    seed = spec.get("seed") if isinstance(spec, dict) else None
    if isinstance(seed, int) and not isinstance(seed, bool):
        profiled_seed = seed
    seed = args.seed if args.seed is not None else (profiled_seed or 0) + SEED_OFFSET
    if profiled_seed is not None and seed == profiled_seed:
        parser.error(f"seed {seed} is the artifact's profiling seed: the test probes must be unseen")
    spec = PRESETS[args.preset].replace(families=tuple(args.families), seed=seed, count=args.count)
    if args.lengths:
        spec = spec.replace(lengths=tuple(args.lengths))
    if args.haystack:
        spec = spec.replace(haystack=args.haystack)
    probes = list(generate_probes(spec, tokenizer))[: args.limit]

    cells = []
    for row in args.rows:
        allocation, fields = rows[row]
        for ratio in args.compression:
            options = dict(fields.get("scorer_options", {}))
            if options.get("blend") == "ratio":  # kvpress's CompactorPress: blend = the compression ratio
                options["blend"] = ratio
            policy = CompressionPolicy(
                compression_ratio=ratio,
                allocation=allocation,
                **{**fields, "scorer_options": options},
            )
            missing = policy.missing(calibration)
            if missing:
                if ratio == args.compression[0]:
                    print(f"skipping {row}: {missing[0]}", file=sys.stderr)
                continue
            cells.append(((row, ratio), policy))

    started = time.perf_counter()
    per_probe = []
    for probe in tqdm(probes, desc="probes", unit="probe"):
        results, timings = run_probe(model, tokenizer, probe, cells, calibration, args.max_new_tokens)
        per_probe.append(
            {
                "id": probe.id,
                "length": len(probe.input_ids),
                "context": probe.context_end,
                "depth": probe.depth,
                **timings,
                "results": {"/".join(str(k) for k in key): value for key, value in results.items()},
            }
        )
        if args.json:  # the probes so far, rewritten after each one: a stopped run keeps its results
            Path(args.json).write_text(json.dumps({"probes": per_probe, "rows": args.rows, "seed": seed}, indent=2))

    def cell(key):
        """Accuracy, its 95% Wilson interval, n, mean kept fraction and mean compress seconds of one cell."""
        name = "/".join(str(k) for k in key)
        hits = [p["results"][name] for p in per_probe]
        correct = sum(h["correct"] for h in hits)
        low, high = wilson_interval(correct, len(hits))
        return {
            "accuracy": correct / max(len(hits), 1),
            "correct": correct,
            "n": len(hits),
            "low": low,
            "high": high,
            "kept": sum(h["kept"] for h in hits) / max(len(hits), 1),
            "compress_seconds": sum(h["compress_seconds"] for h in hits) / max(len(hits), 1),
        }

    header = f"{'policy':28s}" + "".join(f"  {'evict ' + format(r, '.2f'):>26s}" for r in args.compression)

    def fmt(c: dict) -> str:
        return f"{c['accuracy']:.2f} [{c['low']:.2f},{c['high']:.2f}] k{c['kept']:.3f} {c['compress_seconds']:4.1f}s"

    baseline = cell(("baseline", None))
    lines = [
        f"{len(probes)} probes ({args.preset}, {', '.join(args.families)}, seed {seed}), question-agnostic, "
        f"{time.perf_counter() - started:.0f} s; cells: accuracy [95% Wilson], kept fraction of the KV bytes, "
        "compress seconds per probe",
        header,
        f"{'baseline (no eviction)':28s}" + f"  {fmt(baseline):>26s}" * len(args.compression),
    ]
    table = {"baseline": baseline}
    for row in args.rows:
        keys = [(row, r) for r in args.compression]
        if not any(key == c for key in keys for c, _ in cells):
            continue
        values = [cell(key) for key in keys]
        table[row] = dict(zip(map(str, args.compression), values, strict=True))
        lines.append(f"{row:28s}" + "".join(f"  {fmt(v):>26s}" for v in values))
    if args.reference is not None:
        lines.append(f"paired against {args.reference}: W / L = probes only this row / only the reference answered")
        for row in args.rows:
            if row == args.reference:
                continue
            pairs = []
            for ratio in args.compression:
                mine, theirs = f"{row}/{ratio}", f"{args.reference}/{ratio}"
                if not per_probe or mine not in per_probe[0]["results"] or theirs not in per_probe[0]["results"]:
                    pairs.append("-")
                    continue
                wins = sum(p["results"][mine]["correct"] and not p["results"][theirs]["correct"] for p in per_probe)
                losses = sum(p["results"][theirs]["correct"] and not p["results"][mine]["correct"] for p in per_probe)
                pairs.append(f"{wins} / {losses}")
            lines.append(f"{row:28s}" + "".join(f"  {pair:>26s}" for pair in pairs))
    prefill_s = sum(p["prefill_seconds"] for p in per_probe)
    lines.append(f"prefill {prefill_s:.0f} s in all ({prefill_s / max(len(per_probe), 1):.1f} s per probe)")
    if any("kvzip_seconds" in p for p in per_probe):
        kvzip_s = sum(p["kvzip_seconds"] for p in per_probe)
        lines.append(f"kvzip reconstruction {kvzip_s:.0f} s in all ({kvzip_s / prefill_s:.2f} x the prefill)")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "table": table,
                    "probes": per_probe,
                    "artifact": args.artifact,
                    "compression": args.compression,
                    "seed": seed,
                    "families": args.families,
                    "rows": args.rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
