"""torch's CPU ``exp`` where its result underflows float32.

    python benchmarks/exp_underflow.py [--repeats 7] [--threads 1]

``torch.exp`` of a ``[3, 8, 768, 256]`` float32 block (the chunk mass's logits at the embedded
model's geometry) filled with one value, or half ``-inf``: milliseconds (fastest of ``--repeats``).
The same clamp in the paged kernel (``runtime.kv_store.paged_attention.paged_attention``, hidden rows zeroed
after the exp) was measured with this script's second part at commit ``bbdce4a`` and not kept
(docs/results.md R-chunk-mass-underflow-2026-11-27): decode logits seldom underflow.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def fastest(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed calls, the fastest kept (default 7)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    block = torch.randn(3, 8, 768, 256, generator=generator)
    fills = {"randn (std 1)": block}
    for value in (-86.0, -87.5, -100.0, -104.0):
        fills[f"all {value:g}"] = torch.full_like(block, value)
    fills["half -inf"] = torch.where(torch.rand(block.shape, generator=generator) < 0.5, float("-inf"), block)
    print("torch.exp of a [3, 8, 768, 256] float32 block, ms:\n")
    print("| values | ms |\n|---|---|")
    for name, values in fills.items():
        print(f"| {name} | {fastest(lambda values=values: torch.exp(values), args.repeats):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
