"""A first prefill chunk through a sliding window or attention chunks: sdpa with the mask (each KV head repeated for
its query heads) against the reference
eager attention (float32 logits materialised), block by block, as ``runtime.kv_store.layer_attention`` computes it.

Both variants take the same blocks of queries and the same mask (``_visible``); the eager one is what every
sliding layer's first chunk ran before sdpa took the layers without soft-capping or sinks (Mistral, Qwen2 with a
window, Gemma 3, Phi-3, and Llama 4's chunked layers).  Prints seconds per call (median of ``--repeats``,
alternated) and the largest difference of the outputs.

    python benchmarks/masked_prefill.py --tokens 4096 --window 1024 --repeats 3
    python benchmarks/masked_prefill.py --tokens 4096 --chunk 1024 --repeats 3

``--padding N`` (no window, no chunk): a left-padded first chunk of two rows, the second ``N`` columns of padding:
its padding mask through sdpa with each KV head repeated (``runtime.kv_store.layer_attention.masked_sdpa``) against
sdpa's ``enable_gqa`` with the same mask (what it ran before, and what falls to the math kernel on CUDA).

    python benchmarks/masked_prefill.py --tokens 2048 --padding 300 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from runtime.kv_store.eager_attention import eager_attention_forward
from runtime.kv_store.layer_attention import (
    WINDOW_BLOCK_QUERIES,
    _masked_chunk_attention,
    _visible,
    chunk_only_attention,
)
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
    parser.add_argument("--padding", type=int, default=0, help="a second row with this many padding columns")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if (args.window is None and args.chunk is None) == (args.padding == 0):
        parser.error("give --window or --chunk, or --padding alone")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    rows = 2 if args.padding else 1
    query = torch.randn(rows, args.q_heads, args.tokens, args.head_dim, generator=generator)
    keys = torch.randn(rows, args.kv_heads, args.tokens, args.head_dim, generator=generator)
    values = torch.randn(rows, args.kv_heads, args.tokens, args.head_dim, generator=generator)
    positions = torch.arange(args.tokens).unsqueeze(0)
    scaling = args.head_dim**-0.5
    if args.padding:
        real = torch.ones(rows, args.tokens, dtype=torch.bool)
        real[1, : args.padding] = False
        variants = {
            "repeated heads": lambda: chunk_only_attention(query, keys, values, real, scaling),
            "enable_gqa": lambda: padded_with_gqa(query, keys, values, real, scaling),
        }
        _compare(variants, args.repeats)
        return
    variants = {
        "sdpa": lambda: _masked_chunk_attention(
            query, keys, values, None, scaling, positions, args.window, None, None, args.chunk
        ),
        "eager": lambda: eager_blocks(query, keys, values, positions, args.window, args.chunk, scaling),
    }
    _compare(variants, args.repeats)


def padded_with_gqa(query, keys, values, real, scaling):
    """A padded first chunk as it ran before ``masked_sdpa``: sdpa's ``enable_gqa`` with the padding mask."""
    q_len = query.shape[2]
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    mask = (causal & real[:, None, None, :]) | torch.eye(q_len, dtype=torch.bool)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True
    ).transpose(1, 2)
    return out * real[:, :, None, None].to(out.dtype)


def _compare(variants: dict, repeats: int) -> None:
    """Time each variant ``repeats`` times, alternated; print the medians, their ratio and the largest difference."""
    times = {name: [] for name in variants}
    outputs = {}
    for _ in range(repeats):
        for name, run in variants.items():
            started = time.perf_counter()
            outputs[name] = run()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} s, median {medians[name]:.2f} s")
    first, second = variants
    print(f"{first} / {second}: {medians[first] / medians[second]:.3f}")
    print(f"largest |difference|: {(outputs[first] - outputs[second]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
