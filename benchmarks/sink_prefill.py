"""The first prefill of a model with learned attention sinks: the segment kernels against the eager reference.

    python benchmarks/sink_prefill.py [--tokens 4096] [--layers 2] [--repeats 3] [--json OUT]

A random gpt-oss of gpt-oss-20b's attention (hidden 2880, 64 query / 8 KV heads of 64, learned sinks drawn
in [2, 7)), every layer full, its MLP made small (4 experts 64 wide, so that the attention is what is
timed), float32, one torch thread.  ``compress_prompt(model, ids, None)`` (nothing evicted: the prefill
alone) runs each first chunk with sinks either through the segment kernels, which give each query's
log-sum-exp (``runtime.kv_store.layer_attention.lse_kernel_serves``: the CPU's flash kernel in two parts), or,
as before, through the chunk-only path's eager reference with the sink's logit (that function patched to
say no); the two alternate, ``--repeats`` times each, and transformers' own eager forward of the decoder is
timed once per repeat beside them.  Printed: the median seconds and their ratios; the two variants' logits
of the last position are compared too (max |difference|).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(layers: int, layer_type: str = "full_attention", window: int = 128):
    """The random gpt-oss of gpt-oss-20b's attention described above, every layer ``layer_type``."""
    import torch
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=1024,
        hidden_size=2880,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=window,
        layer_types=[layer_type] * layers,
        max_position_embeddings=131072,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.uniform_(2.0, 7.0)
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    import runtime.kv_store.cache as cache_module
    from runtime import compress_prompt
    from runtime.compression.ragged_attention import ragged_attention
    from runtime.kv_store.transformers_compat import cache_argument

    torch.set_num_threads(1)
    model = build(args.layers)
    ids = torch.randint(3, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    kernel_serves = cache_module.lse_kernel_serves
    variants = {"kernels": kernel_serves, "eager": lambda *_: False}
    times = {name: [] for name in (*variants, "transformers eager")}
    last = {}
    with torch.no_grad():
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 == 0 else list(variants)[::-1]
            for name in order:
                cache_module.lse_kernel_serves = variants[name]
                try:
                    start = time.perf_counter()
                    cache, _ = compress_prompt(model, ids[:, :-1], None)
                    times[name].append(time.perf_counter() - start)
                    with ragged_attention(model):
                        last[name] = model(ids[:, -1:], **cache_argument(model, cache)).logits[0, -1]
                finally:
                    cache_module.lse_kernel_serves = kernel_serves
            start = time.perf_counter()
            model.model(ids[:, :-1])
            times["transformers eager"].append(time.perf_counter() - start)
            print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    median = {name: statistics.median(values) for name, values in times.items()}
    difference = float((last["kernels"] - last["eager"]).abs().max())
    print(
        f"\n{args.tokens} tokens x {args.layers} full layers, median of {args.repeats}: "
        f"kernels {median['kernels']:.2f} s, "
        f"eager {median['eager']:.2f} s (kernels / eager {median['kernels'] / median['eager']:.3f}), transformers' "
        f"eager forward {median['transformers eager']:.2f} s; last logits differ by {difference:.2e}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"json": str(args.json)},
                    "seconds": times,
                    "median": median,
                    "logit_difference": difference,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
