"""A first prefill chunk through a sliding window or attention chunks: sdpa with the mask (each KV head repeated for
its query heads) against the reference
eager attention (float32 logits materialised), block by block, as ``runtime.kv_store.layer_attention`` computes it.

Both variants take the same blocks of queries and the same mask (``_visible``); the eager one is what every
sliding layer's first chunk ran before sdpa took the layers without soft-capping or sinks (Mistral, Qwen2 with a
window, Gemma 3, Phi-3, and Llama 4's chunked layers).  Prints seconds per call (median of ``--repeats``,
alternated) and the largest difference of the outputs.

    python benchmarks/masked_prefill.py --tokens 4096 --window 1024 --repeats 3
    python benchmarks/masked_prefill.py --tokens 4096 --chunk 1024 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.kv_store.eager_attention import eager_attention_forward
from runtime.kv_store.layer_attention import WINDOW_BLOCK_QUERIES, _masked_chunk_attention, _visible
from runtime.kv_store.paged_attention import first_visible


def eager_blocks(query, keys, values, positions, window, chunk, scaling):
    """The eager variant: the blocks and masks of ``_masked_chunk_attention`` (no padding), eager attention."""
    q_len = query.shape[2]
    reach = min(span for span in (window, chunk, q_len) if span is not None)
    step = max(WINDOW_BLOCK_QUERIES, reach)
    blocked = q_len > reach + step
    first_seen = first_visible(positions, window, chunk)
    outs = []
    for start in range(0, q_len, step) if blocked else (0,):
        stop = min(start + step, q_len) if blocked else q_len
        first = max(0, start - reach + 1) if blocked else 0
        visible = _visible(None, positions, first_seen, start, stop, first, query.device)
        out, _ = eager_attention_forward(
            None,
            query[:, :, start:stop],
            keys[:, :, first:stop],
            values[:, :, first:stop],
            visible[:, None],
            scaling=scaling,
        )
        outs.append(out)
    return torch.cat(outs, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=None, help="a sliding window of W positions")
    parser.add_argument("--chunk", type=int, default=None, help="attention chunks of C positions (Llama 4)")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.window is None and args.chunk is None:
        parser.error("give --window or --chunk")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, args.q_heads, args.tokens, args.head_dim, generator=generator)
    keys = torch.randn(1, args.kv_heads, args.tokens, args.head_dim, generator=generator)
    values = torch.randn(1, args.kv_heads, args.tokens, args.head_dim, generator=generator)
    positions = torch.arange(args.tokens).unsqueeze(0)
    scaling = args.head_dim**-0.5
    variants = {
        "sdpa": lambda: _masked_chunk_attention(
            query, keys, values, None, scaling, positions, args.window, None, None, args.chunk
        ),
        "eager": lambda: eager_blocks(query, keys, values, positions, args.window, args.chunk, scaling),
    }
    times = {name: [] for name in variants}
    outputs = {}
    for _ in range(args.repeats):
        for name, run in variants.items():
            started = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} s, median {medians[name]:.2f} s")
    print(f"sdpa / eager: {medians['sdpa'] / medians['eager']:.3f}")
    print(f"largest |difference|: {(outputs['sdpa'] - outputs['eager']).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
