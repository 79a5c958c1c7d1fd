"""Peak memory that prefill + compression allocates on the CPU, counted allocation by allocation.

    python benchmarks/prefill_memory.py [--context 4096] [--batch 2] [--keep-ratio 0.25]
                                        [--artifact PATH] [--block-size N ...] [--json OUT]

On the embedded model, float32, one torch thread, ``--batch`` rows of ``--context`` tokens of
filler, three calls one after the other:

* ``plain``: the unmodified model's prefill into a DynamicCache (``logits_to_keep=1``);
* ``uniform/keydiff``: ``compress_prompt`` under ``CompressionPolicy(keep_ratio=K, scorer="keydiff")``;
* ``flagship``: ``compress_prompt`` under ``inf/leverage+correction`` with ``--artifact``
  (``uniform/leverage`` without one),
* ``flagship, block-wise N``: the same with ``block_size=N``, for each ``--block-size`` (the
  cache never holds more than the budgets plus one block, and the activations are one block's),

each under ``torch.profiler`` with ``profile_memory=True``: the peak is the largest running sum of
the profiler's allocation and free events during the call, i.e. the bytes torch's allocator held
at once beyond what was allocated before the call.  Unlike the process's resident peak (VmHWM,
``benchmarks/gpu_serving.py --device cpu``), this does not depend on what the C allocator kept from
earlier calls, so the columns compare within a run and between runs.  Also printed: the
running sum at the start of every third decoder layer (where a cache that grows with the layers
shows), the full cache's bytes, and issue 40's CPU bar: each compressed call's peak at most plain's
minus 0.6 x the full cache.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def allocation_peak(run) -> tuple[int, list[tuple[str, int]]]:
    """``(peak bytes, [(decoder layer, bytes held at its start)...])`` of ``run()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True
    ) as prof:  # stacks: module events
        run()
    named = [(_name(e), e) for e in prof.profiler.kineto_results.events()]
    memory = sorted((e for name, e in named if name == "[memory]"), key=lambda e: e.start_ns())
    times, held, current, peak = [], [], 0, 0
    for event in memory:
        current += event.nbytes()
        peak = max(peak, current)
        times.append(event.start_ns())
        held.append(current)
    layers = sorted((e.start_ns(), name) for name, e in named if "DecoderLayer_" in name)
    timeline = []
    for start, name in layers[::3]:
        index = bisect.bisect_right(times, start) - 1
        timeline.append((name.rsplit("_", 1)[-1], held[index] if index >= 0 else 0))
    return peak, timeline


def _name(event) -> str:
    """The event's name; "" where the profiler hands back bytes that are no UTF-8 (seen with torch
    2.13 on Python frames' names)."""
    try:
        return event.name()
    except UnicodeDecodeError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--context", type=int, default=4096, help="tokens per row (default 4096)")
    parser.add_argument("--batch", type=int, default=2, help="rows (default 2)")
    parser.add_argument("--keep-ratio", type=float, default=0.25, help="fraction kept (default 0.25)")
    parser.add_argument("--artifact", help="a calibration artifact of the embedded model: serve the flagship")
    parser.add_argument(
        "--block-size", type=int, nargs="*", default=[], help="also the flagship's block-wise prefill, per size"
    )
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    if any(size < 1 for size in args.block_size):
        parser.error(f"--block-size must be positive, got {args.block_size}")
    torch.set_num_threads(1)

    from gpu_serving import filler_ids
    from transformers import DynamicCache

    from common.models import load_model, load_tokenizer
    from runtime import CompressionPolicy, compress_prompt, load_calibration
    from runtime.kv_store.transformers_compat import cache_argument
    from runtime.plan.policy_spec import FLAGSHIP

    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact) if args.artifact else None
    ids = filler_ids(tokenizer, args.context).expand(args.batch, -1).contiguous()
    flagship = FLAGSHIP.policy(1 - args.keep_ratio) if calibration else CompressionPolicy(keep_ratio=args.keep_ratio)
    full_cache = {}

    @torch.no_grad()
    def plain() -> None:
        cache = DynamicCache(config=model.config)
        model(ids[:, :-1], **cache_argument(model, cache), use_cache=True, logits_to_keep=1)
        full_cache["bytes"] = sum(
            layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers if layer.keys is not None
        )

    def compressed(policy, block=None):
        return lambda: compress_prompt(
            model, ids, policy, context_columns=ids.shape[1] - 1, calibration=calibration, block_size=block
        )

    name = "flagship" if calibration else "uniform/leverage"
    calls = {
        "plain": plain,
        "uniform/keydiff": compressed(CompressionPolicy(keep_ratio=args.keep_ratio, scorer="keydiff")),
        name: compressed(flagship),
    }
    for block in args.block_size:
        calls[f"{name}, block-wise {block}"] = compressed(flagship, block)
    results = {}
    for name, run in calls.items():
        peak, timeline = allocation_peak(run)
        results[name] = {"peak_gib": peak / 2**30, "held_at_layer_starts_mib": {k: v / 2**20 for k, v in timeline}}
        line = " ".join(f"{k}:{v / 2**20:.0f}" for k, v in timeline)
        print(f"{name}: peak {peak / 2**30:.3f} GiB; MiB held at layer starts {line}", flush=True)
    full = full_cache["bytes"] / 2**30
    bar = results["plain"]["peak_gib"] - 0.6 * full
    print(f"full cache {full:.3f} GiB; bar (plain's peak - 0.6 x full cache) {bar:.3f} GiB")
    for name in list(calls)[1:]:
        verdict = "PASS" if results[name]["peak_gib"] <= bar else "FAIL"
        print(f"- {verdict} {name}: {results[name]['peak_gib']:.3f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "full_cache_gib": full, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
