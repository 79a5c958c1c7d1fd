"""What the host dispatches in a prefill + compression, per layer: the GPU's cost that a CPU can count.

    python benchmarks/prefill_host_ops.py --artifact PATH [--context 4096] [--batch-sizes 1 2]
                                          [--keep-ratio 0.25] [--json OUT]

On a GPU every aten op that launches a kernel costs the host several microseconds whatever its size,
and every read of device data (``.item()``, ``nonzero``, ``torch.equal``, a pageable copy) makes the
host wait for the queue; the flagship's prefill + compression at 32K tokens x 8 rows on an H200 took
1.34-1.57x plain's prefill (docs/results.md R-gpu-prefill-2026-11-27, R-gpu-decode-2026-11-27), with
no kernel of its own large enough to explain it.  This counts, on the embedded model on a CPU, the
aten ops dispatched per layer by plain transformers' prefill and by ``compress_prompt`` under
uniform/keydiff and the flagship (``--artifact``'s calibration), split by where they come from:

* ``chunk mass``: Compactor's chunked attention accumulated while each layer attends
  (``ChunkAttention.add``; :mod:`runtime.math.chunk_attention`);
* ``scoring``: the scorer's inputs and scores (``HeadEvictor.layer_scores``);
* ``eviction``: the rest of ``HeadEvictor.evict_layer`` (ranking, compaction, moment sums);
* ``forward``: everything else (the model's own ops and the ragged cache's attention).

and the synchronising ops (as tests/test_decode_sync.py counts them: on a CPU a read of a host table
counts too, so this is an upper bound).  ``chunk mass`` is counted twice for the flagship: with the
CPU's products of 2 chunks, and with the accelerator's (``runtime.math.chunk_attention``'s
``_ACCELERATOR_LOGITS_AT_ONCE``, forced here), which is what a GPU runs.  One torch thread.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_decode_sync import SyncCounter  # noqa: E402

import runtime.compression.eviction as eviction  # noqa: E402
import runtime.math.chunk_attention as chunk_attention  # noqa: E402
from common.models import load_model, load_tokenizer  # noqa: E402
from runtime import CompressionPolicy, compress_prompt, load_calibration  # noqa: E402
from runtime.kv_store.transformers_compat import cache_argument  # noqa: E402
from runtime.plan.policy_spec import FLAGSHIP  # noqa: E402

REGIONS = (
    (chunk_attention.ChunkAttention, "add", "chunk mass"),
    (eviction.HeadEvictor, "layer_scores", "scoring"),
    (eviction.HeadEvictor, "evict_layer", "eviction"),
)


class RegionCounter(SyncCounter):
    """Every aten op dispatched, by the innermost region (:data:`REGIONS`) it runs in."""

    def __init__(self, where: list[str]):
        super().__init__()
        self.where = where
        self.by_region: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_region[self.where[-1]] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def regions(where: list[str]):
    """Wrap the methods of :data:`REGIONS` so that ``where[-1]`` names the region running."""
    originals = []
    for owner, name, region in REGIONS:
        method = getattr(owner, name)
        originals.append((owner, name, method))

        def wrapped(*args, _method=method, _region=region, **kwargs):
            where.append(_region)
            try:
                return _method(*args, **kwargs)
            finally:
                where.pop()

        setattr(owner, name, functools.wraps(method)(wrapped))
    try:
        yield
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)


def count(run, layers: int) -> dict:
    where = ["forward"]
    counter = RegionCounter(where)
    with regions(where), torch.no_grad(), counter:
        run()
    row = {region: round(ops / layers, 1) for region, ops in sorted(counter.by_region.items())}
    row["total"] = round(counter.ops / layers, 1)
    row["syncs"] = dict(counter.syncs)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="the embedded model's artifact (the flagship's budgets)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--keep-ratio", type=float, default=0.25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    layers = model.config.num_hidden_layers
    policies = {
        "uniform/keydiff": CompressionPolicy(keep_ratio=args.keep_ratio, scorer="keydiff"),
        "flagship": FLAGSHIP.policy(1 - args.keep_ratio),
    }
    results = {}
    for batch in args.batch_sizes:
        ids = torch.randint(3, 1000, (batch, args.context), generator=torch.Generator().manual_seed(11))

        def plain(ids=ids):
            model(ids, **cache_argument(model, None), use_cache=True, logits_to_keep=1)

        def compressed(policy, ids=ids):
            compress_prompt(model, ids, policy, context_columns=args.context - 1, calibration=calibration)

        for policy in policies.values():  # the first call checks the model's RoPE once
            compressed(policy)
        cell = {"plain": count(plain, layers)}
        for name, policy in policies.items():
            cell[name] = count(functools.partial(compressed, policy), layers)
        cpu_budget = chunk_attention._LOGITS_AT_ONCE
        chunk_attention._LOGITS_AT_ONCE = chunk_attention._ACCELERATOR_LOGITS_AT_ONCE
        try:
            cell["flagship, the accelerator's chunk products"] = count(
                functools.partial(compressed, policies["flagship"]), layers
            )
        finally:
            chunk_attention._LOGITS_AT_ONCE = cpu_budget
        results[f"{args.context}x{batch}"] = cell
        print(f"{args.context} tokens x {batch} rows, aten ops per layer:")
        for name, row in cell.items():
            print(f"  {name}: {json.dumps(row)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
