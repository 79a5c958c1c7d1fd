"""What the host dispatches in one decode step, per configuration, on the CPU's path and on a GPU's.

    python benchmarks/decode_host_ops.py --artifact PATH [--dtype bfloat16] [--paths cpu varlen]
                                         [--context 512] [--sequence] [--json OUT]

Without a CUDA graph, a GPU decode step is bound by the host: every aten op costs it several
microseconds whatever its size (plain transformers' step on an H200 took 7.5-11 ms for 8 layers:
docs/results.md R-gpu-decode-2026-11-27).  This counts the aten ops of one decode step of the
embedded model (30 layers) after prefill + compression (75% evicted) and three warm-up steps, at a
step that does not repack the storage (as tests/test_decode_sync.py takes it), for plain
transformers (DynamicCache), uniform/keydiff and the flagship (``--artifact``'s calibration), on

* ``cpu``: the path a CPU runs (the live rows read in place by PyTorch's fused CPU kernel);
* ``varlen``: the path a GPU runs in bf16 / fp16 (one FlashAttention varlen call per layer,
  runtime/kv_store/varlen_attention.py), forced here with the kernel replaced by its plain-torch
  reference, whose own ops are not counted: the call counts as one op, as it is one launch.

in ``--dtype`` (bf16 by default, a GPU's; the casts around float32 parts count).  A count, not a
time; on a GPU every op that is not a view is one kernel launch.  ``--sequence`` also prints the
ops of one layer's attention, in order.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def attention_sequence(counter, layer: int, layers: int) -> str:
    """The ops of layer ``layer``'s attention: from its KV store's write to its output projection."""
    text = " ".join(counter.sequence)
    marks = "index_copy_ index_copy_ index_copy_"
    starts = [i for i in range(len(counter.sequence)) if " ".join(counter.sequence[i : i + 3]) == marks]
    if len(starts) != layers:
        return text
    start = starts[layer]
    end = starts[layer + 1] if layer + 1 < layers else len(counter.sequence)
    return " ".join(counter.sequence[start:end])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="the embedded model's artifact (the flagship's budgets)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--paths", nargs="+", default=["cpu", "varlen"], choices=["cpu", "varlen"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--keep-ratio", type=float, default=0.25)
    parser.add_argument("--sequence", action="store_true", help="print one layer's attention ops in order")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from test_decode_sync import KernelAsOneOp, _compressed, _plain_cache, steady_step, varlen_path_forced

    from common.models import load_model, load_tokenizer
    from runtime import CompressionPolicy, load_calibration
    from runtime.plan.policy_spec import FLAGSHIP

    model, tokenizer = load_model(dtype=getattr(torch, args.dtype)), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 1000, (1, args.context + 48), generator=torch.Generator().manual_seed(11))
    prompt, decode = ids[:, : args.context], ids[:, args.context - 1 :]
    policies = {
        "uniform/keydiff": CompressionPolicy(keep_ratio=args.keep_ratio, scorer="keydiff"),
        "flagship": FLAGSHIP.policy(1 - args.keep_ratio),
    }

    def step(cache) -> KernelAsOneOp:
        (counter,) = steady_step(model, cache, decode, lambda: (KernelAsOneOp(),))
        return counter

    plain = step(_plain_cache(model, prompt[:, :-1]))
    plain_ops = plain.ops
    results = {"dtype": args.dtype, "plain": plain_ops}
    print(f"plain transformers: {plain_ops} aten ops per step ({plain_ops / layers:.1f} a layer)")
    for path in args.paths:
        with varlen_path_forced() if path == "varlen" else contextlib.nullcontext():
            for name, policy in policies.items():
                counter = step(_compressed(model, prompt, policy, calibration))
                ops = counter.ops
                results[f"{name} [{path}]"] = ops
                names = set(counter.names) | set(plain.names)
                extra = {k: counter.names[k] - plain.names[k] for k in names if counter.names[k] != plain.names[k]}
                print(f"{name} [{path}]: {ops} aten ops per step, {ops / plain_ops:.3f}x plain; "
                      f"beyond plain's: {dict(sorted(extra.items(), key=lambda kv: -kv[1]))}")  # fmt: skip
                if args.sequence:
                    print(f"  layer 5's attention: {attention_sequence(counter, 5, layers)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
