"""Compactor's chunk mass (runtime.chunk_attention.chunk_mass) against its earlier softmax-and-sum form.

    python benchmarks/chunk_mass_cost.py [--context 2048] [--chunk 256] [--repeats 5] [--threads 1]

Random post-RoPE queries and keys of the embedded model's geometry (3 KV heads, 3 query heads each,
d = 64), ``--context`` tokens in chunks of ``--chunk``: milliseconds per layer of ``chunk_mass`` (an
exp in place and one product with the queries' inverse sums) and of the form it replaced (a softmax,
then a sum over the queries and a mean over the group), interleaved; and their largest difference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.chunk_attention import _CHUNKS_AT_ONCE, chunk_mass  # noqa: E402


def softmax_then_sum(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The form before R-chunk-mass-2026-11-27 (same shapes as ``chunk_mass``)."""
    heads, group, chunks, size, dim = queries.shape
    masses = []
    for lo in range(0, chunks, _CHUNKS_AT_ONCE):
        hi = min(lo + _CHUNKS_AT_ONCE, chunks)
        block = queries[:, :, lo:hi].float().transpose(1, 2).reshape(heads, hi - lo, group * size, dim)
        logits = block @ keys[:, lo:hi].float().transpose(-1, -2) * scale
        weights = torch.softmax(logits, dim=-1).view(heads, hi - lo, group, size, size)
        masses.append(weights.sum(3).mean(2))
    return torch.cat(masses, dim=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="tokens (default 2048)")
    parser.add_argument("--chunk", type=int, default=256, help="chunk size (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each, interleaved (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    chunks = args.context // args.chunk
    queries = torch.randn(3, 3, chunks, args.chunk, 64, generator=generator)
    keys = torch.randn(3, chunks, args.chunk, 64, generator=generator)
    kinds = {"chunk_mass (exp in place, one product)": chunk_mass, "softmax, then sum (before)": softmax_then_sum}
    seconds = dict.fromkeys(kinds, 0.0)
    for function in kinds.values():
        function(queries, keys, 0.125)  # warm-up
    for _ in range(args.repeats):
        for name, function in kinds.items():
            start = time.perf_counter()
            function(queries, keys, 0.125)
            seconds[name] += time.perf_counter() - start
    base = seconds["softmax, then sum (before)"]
    print(f"{args.context} tokens, chunks of {args.chunk}, ms per layer:\n")
    print("| form | ms | ratio to before |")
    print("|---|---|---|")
    for name, total in seconds.items():
        print(f"| {name} | {total / args.repeats * 1e3:.1f} | {total / base:.2f} |")
    difference = (chunk_mass(queries, keys, 0.125) - softmax_then_sum(queries, keys, 0.125)).abs().max()
    print(f"\nlargest difference: {float(difference):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
