"""One decode step's attention, layer by layer, under each way of reading the packed segments.

    python benchmarks/decode_kernels.py --artifact PATH [--context 2048] [--batch-sizes 1 2 4 8]
                                        [--repeats 100] [--growing-steps 48] [--threads 1] [--no-flex]

The embedded model prefills the context (filler sentences) at each batch size and compresses it
(25% kept) under ``uniform/keydiff`` (equal segments) and the flagship ``inf/leverage+correction``
(unequal INF budgets).  Then a random query ``[S, G, d]`` per layer is attended over every layer
of those caches (one pass over the layers = one step's attention), ``--repeats`` passes (after 5
untimed), the kernels interleaved pass by pass:

* ``pages``: ``layout.decode_pages`` + ``paged_attention.decode_attention`` (one fused call over
  the layer's masked pages, then their merge; small layers gathered into one page per head);
* ``per segment``: ``paged_attention.live_rows_attention`` without head strides: one call over the
  ``[S, cap, d]`` view when the segments are equal, else one call per segment over its slice;
* ``choice``: what the runtime serves (``layer_attention._decode_step_attention``: one call per KV
  head over the strided ``[B, n, d]`` view of its segments in every batch row where its budget is
  the same in every row, one per segment of the other heads, while that takes at most
  ``LIVE_ROW_CALLS`` calls, else pages);
* ``flex``: ``flex_decode.flex_decode_attention``, one ``torch.compile``-d ``flex_attention`` call
  per layer (no log-sum-exp: compiled for CPU it cannot return one).  Its first pass compiles
  when the segment count is new: ``first pass s`` is that pass, ``graphs`` the graphs Dynamo
  compiled for it.

Then ``--growing-steps`` steps in which every layer first appends one random token to every head
(``SegmentStore.append``, as a decode step does: lengths change at every step and the storage
repacks when a head runs out of slack), then each kernel attends every layer (interleaved).  The
second table gives the mean ms per step, the storage repacks and the graphs compiled meanwhile
(recompilation as lengths and buffer sizes change).  The buffers are warmer in cache here than in
a real step (no weights read in between): read the ratios.  docs/results.md
R-decode-kernels-2026-11-27 and R-flex-decode-2026-11-27.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.models import load_model, load_tokenizer, use_progress_bars  # noqa: E402
from runtime import CompressionPolicy, RaggedCache, load_calibration  # noqa: E402
from runtime.compression.prefill import compress, prefill  # noqa: E402
from runtime.compression.ragged_attention import enable  # noqa: E402
from runtime.kv_store.flex_decode import flex_available, flex_decode_attention  # noqa: E402
from runtime.kv_store.layer_attention import _decode_step_attention  # noqa: E402
from runtime.kv_store.paged_attention import decode_attention, live_rows_attention  # noqa: E402
from runtime.plan.policy_spec import FLAGSHIP  # noqa: E402
from runtime.plan.serving_plan import bind  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from prefill_all_in import context_ids  # noqa: E402

SCALING = 0.125


def pages(layer, query):
    store = layer.store
    p = layer.layout.decode_pages(store.key_buffer, store.value_buffer, store.row_bias)
    return decode_attention(query, p.key_pages, p.value_pages, p.owner, p.bias, SCALING)


def per_segment(layer, query):
    store = layer.store
    length = store.length.tolist()
    if store.uniform:
        capacity = int(store.capacity[0, 0])
        return live_rows_attention(query, store.key_buffer, store.value_buffer, [], length, SCALING, capacity=capacity)
    offset = store.offset.tolist()
    return live_rows_attention(query, store.key_buffer, store.value_buffer, offset, length, SCALING)


def choice(layer, query):
    return _decode_step_attention(query, layer.store, layer.layout, SCALING, None)


def flex(layer, query):
    return flex_decode_attention(query, layer.store, SCALING, need_lse=False)


def graphs() -> int:
    """Graphs Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def one_pass(kernel, cache, queries) -> float:
    """Seconds for ``kernel`` over every layer once."""
    start = time.perf_counter()
    for layer, query in zip(cache.layers, queries, strict=True):
        kernel(layer, query)
    return time.perf_counter() - start


def interleaved(kernels: dict, cache, queries, repeats: int) -> dict[str, float]:
    """Mean seconds per pass of each kernel, passes interleaved."""
    total = dict.fromkeys(kernels, 0.0)
    for _ in range(repeats):
        for name, kernel in kernels.items():
            total[name] += one_pass(kernel, cache, queries)
    return {name: seconds / repeats for name, seconds in total.items()}


def grow(cache, kernels: dict, queries, steps: int) -> tuple[dict[str, float], int, int, float]:
    """``steps`` decode-like steps: one random token appended to every head of every layer, then
    each kernel over every layer.  Returns (mean seconds per step of each kernel, repacks, graphs
    compiled, slowest flex step in seconds)."""
    total = dict.fromkeys(kernels, 0.0)
    repacks, graphs_before, slowest = 0, graphs(), 0.0
    position = max(int(layer.store.position_buffer.max()) for layer in cache.layers) + 1
    for _ in range(steps):
        for layer in cache.layers:
            store = layer.store
            batch, heads, dim = store.batch_size, store.num_heads, store.head_dim
            generation = store.generation
            new = torch.randn(2, batch, heads, 1, dim, dtype=store.dtype)
            store.append(new[0], new[1], torch.full((batch, 1), position), None)
            repacks += store.generation != generation
        position += 1
        for name, kernel in kernels.items():
            seconds = one_pass(kernel, cache, queries)
            total[name] += seconds
            if name == "flex":
                slowest = max(slowest, seconds)
    return {name: seconds / steps for name, seconds in total.items()}, repacks, graphs() - graphs_before, slowest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", required=True, help="calibration artifact (INF budgets)")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens (default 2048)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="(default 1 2 4 8)")
    parser.add_argument("--repeats", type=int, default=100, help="timed passes over the layers (default 100)")
    parser.add_argument("--growing-steps", type=int, default=48, help="steps with appends (default 48; 0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--no-flex", action="store_true", help="leave out the compiled flex_attention kernel")
    args = parser.parse_args(argv)
    if not Path(args.artifact).is_file():
        print(f"error: no artifact at {args.artifact}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    use_progress_bars(no_progress=True)
    warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated")  # inductor's own import
    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    policies = {
        "uniform/keydiff": bind(CompressionPolicy(keep_ratio=0.25, scorer="keydiff"), None, model),
        "flagship": bind(FLAGSHIP.policy(0.75), calibration, model),
    }
    kernels = {"pages": pages, "per segment": per_segment, "choice": choice}
    if flex_available() and not args.no_flex:
        kernels["flex"] = flex
    enable(model)
    ids = context_ids(tokenizer, args.context)
    names = list(kernels)
    header = " | ".join(f"{name} us/step" for name in names)
    print(f"| batch | segments | policy | {header} | flex / choice | flex first pass s | graphs |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|---|")
    growing = []
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for batch in args.batch_sizes:
            for name, plan in policies.items():
                cache = RaggedCache.for_model(model)
                stats = prefill(model, cache, ids.repeat(batch, 1), policy=plan)
                compress(model, cache, plan, prompt_stats=stats)
                segments = batch * model.config.num_key_value_heads
                queries = [torch.randn(segments, group, layer.head_dim, generator=generator) for layer in cache.layers]
                first, compiled = float("nan"), 0
                if "flex" in kernels:
                    before = graphs()
                    first = one_pass(flex, cache, queries)
                    compiled = graphs() - before
                for _ in range(5):
                    for kernel in kernels.values():
                        one_pass(kernel, cache, queries)
                times = interleaved(kernels, cache, queries, args.repeats)
                cells = " | ".join(f"{times[kernel] * 1e6:.0f}" for kernel in names)
                ratio = f"{times['flex'] / times['choice']:.2f}" if "flex" in times else "-"
                print(f"| {batch} | {segments} | {name} | {cells} | {ratio} | {first:.1f} | {compiled} |", flush=True)
                if args.growing_steps:
                    growing.append((batch, name, *grow(cache, kernels, queries, args.growing_steps)))
                del cache
    if growing:
        print(f"\n{args.growing_steps} steps, one token appended to every head before each step:\n")
        header = " | ".join(f"{name} ms/step" for name in names)
        print(f"| batch | policy | {header} | flex / choice | repacks | graphs compiled | slowest flex step ms |")
        print("|---|---|" + "---|" * len(names) + "---|---|---|---|")
        for batch, name, times, repacks, compiled, slowest in growing:
            cells = " | ".join(f"{times[kernel] * 1e3:.2f}" for kernel in names)
            ratio = f"{times['flex'] / times['choice']:.2f}" if "flex" in times else "-"
            print(f"| {batch} | {name} | {cells} | {ratio} | {repacks} | {compiled} | {slowest * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
