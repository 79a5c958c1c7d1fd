"""torch's CPU ``exp`` where its result underflows, and what clamping first buys the paged kernel.

    python benchmarks/exp_underflow.py [--repeats 7] [--threads 1]

1. ``torch.exp`` of a ``[3, 8, 768, 256]`` float32 block (the chunk mass's logits at the embedded
   model's geometry) filled with one value, or half ``-inf``: milliseconds (fastest of ``--repeats``).
2. ``runtime.paged_attention.paged_attention`` as the runtime runs it (the exp of ``logits - max``
   clamped at ``EXP_FLOOR``, hidden rows zeroed after) against the same kernel with a plain in-place
   ``exp`` (what it did before R-chunk-mass-underflow-2026-11-27; the zeroing pass, a no-op then,
   still runs), interleaved, on a decode step over
   pages (24 segments of 512 rows with 10% free slack, pages of 16, 3 query rows each) and on a
   40-token chunk after a 512-row past (answer()'s question after a compressed context), logits of
   the embedded model's scale; and the largest difference between the two.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime import paged_attention as kernels  # noqa: E402


def fastest(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def plain_exp_(shifted: torch.Tensor) -> torch.Tensor:
    return shifted.exp_()


def case(segments: int, rows: int, chunk: int, group: int, generator) -> tuple:
    """Pages of 16 rows for ``segments`` segments of ``rows`` stored rows (10% more capacity, free),
    ``group * max(chunk, 1)`` query rows each: (query, key_pages, value_pages, owner, bias)."""
    page, dim = 16, 64
    capacity = -(-int(rows * 1.1) // page) * page
    pages = capacity // page
    keys = torch.randn(segments * pages, page, dim, generator=generator) * 2.3
    values = torch.randn(segments * pages, page, dim, generator=generator)
    owner = torch.arange(segments).repeat_interleave(pages)
    page_start = torch.arange(pages).repeat(segments) * page
    queries = max(chunk, 1) * group
    query = torch.randn(segments, queries, dim, generator=generator) * 1.7
    row = page_start.unsqueeze(1) + torch.arange(page)  # [np, P]
    # decode: every query sees the stored rows; a chunk: query t of the chunk sees the past and t + 1 rows
    seen = torch.full((queries,), rows) if chunk == 0 else rows - chunk + torch.arange(chunk).repeat(group) + 1
    visible = row.unsqueeze(2) < seen.view(1, 1, -1)  # [np, P, M]
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return query, keys, values, owner, bias


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
    print("1. torch.exp of a [3, 8, 768, 256] float32 block, ms:\n")
    print("| values | ms |\n|---|---|")
    for name, values in fills.items():
        print(f"| {name} | {fastest(lambda values=values: torch.exp(values), args.repeats):.2f} |")

    print("\n2. paged_attention, ms per call (interleaved):\n")
    print("| case | clamped, hidden zeroed (now) | plain exp (before) | ratio | largest difference |")
    print("|---|---|---|---|---|")
    cases = {
        "decode step: 24 segments x 512 rows, 3 queries": case(24, 512, 0, 3, generator),
        "40-token chunk after 512 rows: 3 segments, 120 queries": case(3, 512, 40, 3, generator),
    }
    for name, inputs in cases.items():

        def run(exp, inputs=inputs):
            kernels.exp_shifted_ = exp
            return kernels.paged_attention(*inputs, 0.125)

        now = kernels.exp_shifted_
        times = {"now": [], "before": []}
        for _ in range(args.repeats):
            for label, exp in (("now", now), ("before", plain_exp_)):
                start = time.perf_counter()
                run(exp)
                times[label].append(time.perf_counter() - start)
        out_now, lse_now = run(now)
        out_before, lse_before = run(plain_exp_)
        kernels.exp_shifted_ = now
        difference = max(float((out_now - out_before).abs().max()), float((lse_now - lse_before).abs().max()))
        fast, slow = min(times["now"]) * 1e3, min(times["before"]) * 1e3
        print(f"| {name} | {fast:.2f} | {slow:.2f} | {fast / slow:.2f} | {difference:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
