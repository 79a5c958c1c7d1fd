"""Compactor's chunk mass (runtime.math.chunk_attention.chunk_mass) against the forms it replaced.

    python benchmarks/chunk_mass_cost.py [--context 2048] [--chunk 256] [--repeats 5] [--threads 1]
                                         [--query-std 1.7] [--key-std 2.3] [--scale 1.0]

Random post-RoPE queries and keys of the embedded model's geometry (3 KV heads, 3 query heads each,
d = 64), ``--context`` tokens in chunks of ``--chunk``, logits ``scale * q.k`` as Compactor takes them
(unscaled).  The defaults give logits of std ~31, as the embedded model's chunk logits have (std
14-38 over its layers on the 2K filler context of benchmarks/prefill_all_in.py, where 11% of the
weights fall below float32's smallest normal; 51% of these Gaussian ones do); ``--query-std 1
--key-std 1 --scale 0.125`` is the earlier benchmark's tame data, where nothing underflows.
Milliseconds per layer, interleaved, of:

* ``chunk_mass``: the logits clamped at ``max - 80`` before an exp in place, as many chunks per product
  as fit 131072 logits per query head (2 at ``--chunk 256``);
* ``exp in place, unclamped`` (R-chunk-mass-2026-11-27, 8 chunks per product): torch's CPU ``exp_`` is
  ~12x slower on arguments whose exp underflows;
* ``softmax, then sum`` (before R-chunk-mass-2026-11-27);
* ``two fused attention passes``: tried for issue 28 and not used (:func:`two_fused_passes`);

and the largest differences from ``softmax, then sum``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.math.chunk_attention import chunk_mass  # noqa: E402


def _by_blocks(queries: torch.Tensor, keys: torch.Tensor, scale: float, block_mass) -> torch.Tensor:
    """The earlier forms' loop (same shapes as ``chunk_mass``): 8 chunks per product, each block's
    logits ``[Hkv, k, G*c, c]`` turned into masses ``[Hkv, k, c]`` by ``block_mass(logits, group)``."""
    heads, group, chunks, size, dim = queries.shape
    masses = []
    for lo in range(0, chunks, 8):
        hi = min(lo + 8, chunks)
        block = queries[:, :, lo:hi].float().transpose(1, 2).reshape(heads, hi - lo, group * size, dim)
        masses.append(block_mass(block @ keys[:, lo:hi].float().transpose(-1, -2) * scale, group))
    return torch.cat(masses, dim=1)


def exp_in_place_unclamped(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The form of R-chunk-mass-2026-11-27."""

    def block_mass(logits, group):
        weights = logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        inverse = weights.sum(-1).reciprocal_().unsqueeze(-2)
        return (inverse @ weights).squeeze(-2) / group

    return _by_blocks(queries, keys, scale, block_mass)


def softmax_then_sum(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The form before R-chunk-mass-2026-11-27."""

    def block_mass(logits, group):
        heads, chunks, rows, size = logits.shape
        return torch.softmax(logits, dim=-1).view(heads, chunks, group, rows // group, size).sum(3).mean(2)

    return _by_blocks(queries, keys, scale, block_mass)


def two_fused_passes(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Tried for issue 28: the mass from two calls of torch's fused CPU attention kernel, which return
    each query's logsumexp.  Pass 1 gives ``lse_i = log sum_j exp(s q_i.k_j)`` over the chunk's keys;
    pass 2 lets every key attend to its chunk's ``G c`` queries with the bias ``-lse_i`` (an extra
    coordinate: ``[s q_i, -lse_i] . [k_j, 1]``), so its logsumexp is ``log sum_i exp(s q_i.k_j - lse_i)``,
    the log of the mass.  The kernel wants values of the head's width, so both passes also multiply by
    zero values."""
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    heads, group, chunks, size, dim = queries.shape
    rows = queries.float().transpose(1, 2).reshape(heads * chunks, group, size, dim)  # [Hkv*K, G, c, d]
    blocks = keys.float().reshape(heads * chunks, 1, size, dim)
    lse = fused(rows, blocks.expand(-1, group, -1, -1), torch.zeros_like(rows), 0.0, False, scale=scale)[1]
    biased = torch.cat([rows * scale, -lse.unsqueeze(-1)], -1).reshape(heads * chunks, 1, group * size, dim + 1)
    padded = torch.cat([blocks, torch.ones(heads * chunks, 1, size, 1)], -1)
    log_mass = fused(padded, biased, torch.zeros_like(biased), 0.0, False, scale=1.0)[1]  # [Hkv*K, 1, c]
    return (log_mass.exp() / group).reshape(heads, chunks, size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="tokens (default 2048)")
    parser.add_argument("--chunk", type=int, default=256, help="chunk size (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each, interleaved (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--query-std", type=float, default=1.7, help="queries' std (default 1.7)")
    parser.add_argument("--key-std", type=float, default=2.3, help="keys' std (default 2.3)")
    parser.add_argument("--scale", type=float, default=1.0, help="logit scale (default 1.0: Compactor's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    chunks = args.context // args.chunk
    queries = torch.randn(3, 3, chunks, args.chunk, 64, generator=generator) * args.query_std
    keys = torch.randn(3, chunks, args.chunk, 64, generator=generator) * args.key_std
    kinds = {
        "chunk_mass (clamped at max - 80)": chunk_mass,
        "exp in place, unclamped (R-chunk-mass-2026-11-27)": exp_in_place_unclamped,
        "softmax, then sum (before)": softmax_then_sum,
        "two fused attention passes (tried, issue 28)": two_fused_passes,
    }
    seconds = dict.fromkeys(kinds, 0.0)
    for function in kinds.values():
        function(queries, keys, args.scale)  # warm-up
    for _ in range(args.repeats):
        for name, function in kinds.items():
            start = time.perf_counter()
            function(queries, keys, args.scale)
            seconds[name] += time.perf_counter() - start
    base = seconds["softmax, then sum (before)"]
    logits = queries[:, :, 0].float() @ keys[:, 0].float().transpose(-1, -2).unsqueeze(1) * args.scale
    weights = torch.softmax(logits, dim=-1)
    print(
        f"{args.context} tokens, chunks of {args.chunk}, logit std {float(logits.std()):.1f}, "
        f"{float((weights < 1.1754944e-38).float().mean()):.0%} of the weights below float32's smallest normal; "
        "ms per layer:\n"
    )
    print("| form | ms | ratio to before |")
    print("|---|---|---|")
    for name, total in seconds.items():
        print(f"| {name} | {total / args.repeats * 1e3:.1f} | {total / base:.2f} |")
    reference = softmax_then_sum(queries, keys, args.scale)
    for name in ("chunk_mass", "two fused attention passes"):
        function = kinds[next(kind for kind in kinds if kind.startswith(name))]
        difference = (function(queries, keys, args.scale) - reference).abs().max()
        print(f"\nlargest difference of {name} from softmax, then sum: {float(difference):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
