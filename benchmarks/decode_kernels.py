"""One decode step's attention, layer by layer, under each way of reading the packed segments.

    python benchmarks/decode_kernels.py --artifact PATH [--context 2048] [--batch-sizes 1 2 4 8]
                                        [--repeats 100] [--threads 1]

The embedded model prefills the context (filler sentences) at each batch size and compresses it
(25% kept) under ``uniform/keydiff`` (equal segments) and the flagship ``inf/leverage+correction``
(unequal INF budgets).  Then, for every layer of those caches, a random query ``[S, G, d]`` is
attended ``--repeats`` times (after 5 untimed) by:

* ``pages``: ``layout.decode_pages`` + ``paged_attention.decode_attention`` (one fused call over
  the layer's masked pages, then their merge; small layers gathered into one page per head);
* ``per segment``: ``paged_attention.live_rows_attention`` without head strides: one call over the
  ``[S, cap, d]`` view when the segments are equal, else one call per segment over its slice;
* ``per head``: the same with the store's head strides: one call per KV head over the strided
  ``[B, n, d]`` view of its segments in every batch row (its budget is the same in every row here).

Prints the summed microseconds per step (all layers) of each; the runtime's choice
(``layer_attention._decode_step_attention``: live rows while they take at most ``LIVE_ROW_CALLS``
kernel calls) is read off this table (docs/results.md R-decode-kernels-2026-11-27).  The buffers are warm in cache
here, unlike in a real step: read the ratio, not the absolute time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime import CompressionPolicy, RaggedCache, compress, enable, load_calibration, prefill  # noqa: E402
from runtime.models import load_model, load_tokenizer, use_progress_bars  # noqa: E402
from runtime.paged_attention import decode_attention, live_rows_attention  # noqa: E402
from runtime.policy_spec import FLAGSHIP  # noqa: E402
from runtime.serving_plan import bind  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from prefill_all_in import context_ids  # noqa: E402


def micros(function, repeats: int) -> float:
    for _ in range(5):
        function()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats * 1e6


def layer_times(layer, group: int, repeats: int) -> tuple[float, float, float]:
    store, layout = layer.store, layer.layout
    segments, dim = store.offset.numel(), store.head_dim
    query = torch.randn(segments, group, dim)

    def pages():
        p = layout.decode_pages(store.key_buffer, store.value_buffer, store.row_bias)
        return decode_attention(query, p.key_pages, p.value_pages, p.owner, p.bias, 0.125)

    def live(head_stride):
        length, offset = store.length.tolist(), store.offset.tolist()
        if store.uniform:
            capacity = int(store.capacity[0, 0])
            return live_rows_attention(
                query, store.key_buffer, store.value_buffer, [], length, 0.125, capacity=capacity
            )
        return live_rows_attention(
            query, store.key_buffer, store.value_buffer, offset, length, 0.125, head_stride=head_stride
        )

    def per_segment():
        return live(None)

    def per_head():
        return live(store.head_stride)

    return micros(pages, repeats), micros(per_segment, repeats), micros(per_head, repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, help="calibration artifact (INF budgets)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="(default 1 2 4 8)")
    parser.add_argument("--repeats", type=int, default=100, help="timed calls per layer (default 100)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    use_progress_bars(no_progress=True)
    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    policies = {
        "uniform/keydiff": bind(CompressionPolicy(keep_ratio=0.25, scorer="keydiff"), None, model),
        "flagship": bind(FLAGSHIP.policy(0.75), calibration, model),
    }
    enable(model)
    ids = context_ids(tokenizer, args.context)
    print("| batch | segments | policy | pages us/step | per segment | per head | segment / pages | head / pages |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        for name, plan in policies.items():
            cache = RaggedCache.for_model(model)
            stats = prefill(model, cache, ids.repeat(batch, 1), policy=plan)
            compress(model, cache, plan, prompt_stats=stats)
            total = [0.0, 0.0, 0.0]
            for layer in cache.layers:
                total = [t + x for t, x in zip(total, layer_times(layer, group, args.repeats), strict=True)]
            pages, segment, head = total
            segments = batch * model.config.num_key_value_heads
            print(
                f"| {batch} | {segments} | {name} | {pages:.0f} | {segment:.0f} | {head:.0f} "
                f"| {segment / pages:.2f} | {head / pages:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
