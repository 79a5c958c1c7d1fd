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


def alternate_prefills(model, ids, module, attribute: str, variants: dict, repeats: int, beside=None):
    """``compress_prompt(model, ids[:, :-1], None)`` with ``module.attribute`` set to each of ``variants``
    (name -> value) in turn, the order flipped every repeat, and each of ``beside`` (name -> callable) once a
    repeat after them.  Returns ``(seconds {name: [s]}, logits {variant: the last position's, fed through
    its cache}``."""
    import torch

    from runtime import compress_prompt
    from runtime.compression.ragged_attention import ragged_attention
    from runtime.kv_store.transformers_compat import cache_argument

    beside = beside or {}
    own = getattr(module, attribute)
    times = {name: [] for name in (*variants, *beside)}
    last = {}
    with torch.no_grad():
        for repeat in range(repeats):
            for name in list(variants) if repeat % 2 == 0 else list(variants)[::-1]:
                setattr(module, attribute, variants[name])
                try:
                    start = time.perf_counter()
                    cache, _ = compress_prompt(model, ids[:, :-1], None)
                    times[name].append(time.perf_counter() - start)
                    with ragged_attention(model):
                        last[name] = model(ids[:, -1:], **cache_argument(model, cache)).logits[0, -1]
                finally:
                    setattr(module, attribute, own)
            for name, run in beside.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
            print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    return times, last


def report(args, times: dict, last: dict, what: str) -> dict:
    """Print the medians of ``times``, the first two variants' ratio and their last logits' difference, and
    write them to ``args.json``; returns the medians."""
    first, second = list(last)
    median = {name: statistics.median(values) for name, values in times.items()}
    difference = float((last[first] - last[second]).abs().max())
    others = "".join(f", {name} {median[name]:.2f} s" for name in times if name not in last)
    print(
        f"\n{args.tokens} tokens x {what}, median of {args.repeats}: {first} {median[first]:.2f} s, {second} "
        f"{median[second]:.2f} s ({first} / {second} {median[first] / median[second]:.3f}){others}; last logits "
        f"differ by {difference:.2e}"
    )
    if args.json:
        record = {"args": vars(args) | {"json": str(args.json)}, "seconds": times, "median": median}
        args.json.write_text(json.dumps(record | {"logit_difference": difference}, indent=1))
    return median


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    import runtime.kv_store.cache as cache_module

    torch.set_num_threads(1)
    model = build(args.layers)
    ids = torch.randint(3, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    variants = {"kernels": cache_module.lse_kernel_serves, "eager": lambda *_: False}
    beside = {"transformers' eager forward": lambda: model.model(ids[:, :-1])}
    times, last = alternate_prefills(model, ids, cache_module, "lse_kernel_serves", variants, args.repeats, beside)
    report(args, times, last, f"{args.layers} full layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
