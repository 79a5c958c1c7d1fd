"""A Gemma 4 prefill whose readers (KV sharing) attend the columns transformers runs through them, or every column.

    python benchmarks/kv_sharing_prefill.py [--tokens 4096] [--layers 15] [--shared 5] [--hidden 512]
                                            [--window 512] [--repeats 3] [--json OUT]

A random Gemma 4 (text) with Gemma 4 E2B's attention shape (8 query heads, one KV head, head dim 256 in the sliding
layers and 512 in the full ones, four sliding layers to one full), ``--layers`` layers of which the last
``--shared`` read earlier layers' caches, its MLP and hidden size small (``--hidden``), float32, one torch thread.
A prefill of ``--tokens`` tokens into an empty ``RaggedCache`` (the model's forward pass under kvcal's attention,
one column of logits kept, as ``runtime.compression.prefill.prefill`` runs it): transformers' Gemma 4
(5.24) runs only the column whose logits the prefill keeps through the readers, and each reader attends that
query over the chunk (``chunk_only_attention`` given fewer queries: ``t q`` logits); or, as first built, zero
queries fill the other columns and the whole chunk is attended, its last row kept.  The two alternate
``--repeats`` times.  Printed: the median seconds, their ratio, and the two variants' last logits' max |difference|.
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


def build(layers: int, shared: int, hidden: int, window: int):
    import torch
    import transformers as T

    types = ["full_attention" if (index + 1) % 5 == 0 else "sliding_attention" for index in range(layers)]
    config = T.Gemma4TextConfig(
        vocab_size=1024,
        vocab_size_per_layer_input=1024,
        hidden_size=hidden,
        hidden_size_per_layer_input=16,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=window,
        layer_types=types,
        num_kv_shared_layers=shared,
        max_position_embeddings=131072,
    )
    torch.manual_seed(0)
    return T.Gemma4ForCausalLM(config).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=15)
    parser.add_argument("--shared", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import torch

    import runtime.kv_store.layer_attention as layer_attention
    from runtime import RaggedCache, ragged_attention
    from runtime.kv_store.transformers_compat import cache_argument

    torch.set_num_threads(1)
    model = build(args.layers, args.shared, args.hidden, args.window)
    if not hasattr(model.model, "_maybe_slice_kv_shared_inputs"):
        parser.error("this transformers runs every column through Gemma 4's readers: nothing to compare")
    ids = torch.randint(3, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    tail = layer_attention._chunk_tail_attention

    def padded(query, keys, values, real, scaling, positions, window, softcap, sinks, attention_chunk):
        fewer, total = query.shape[2], keys.shape[2]
        query = torch.cat([query.new_zeros(*query.shape[:2], total - fewer, query.shape[3]), query], dim=2)
        out = layer_attention.chunk_only_attention(
            query,
            keys,
            values,
            real,
            scaling,
            positions=positions,
            window=window,
            softcap=softcap,
            sinks=sinks,
            attention_chunk=attention_chunk,
        )
        return out[:, total - fewer :]

    seconds, logits = {"columns run": [], "every column": []}, {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, function in (("columns run", tail), ("every column", padded)):
                layer_attention._chunk_tail_attention = function
                cache = RaggedCache.for_model(model)
                started = time.perf_counter()
                with ragged_attention(model):
                    output = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_argument(model, cache))
                seconds[name].append(time.perf_counter() - started)
                logits[name] = output.logits
    layer_attention._chunk_tail_attention = tail
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = medians["columns run"] / medians["every column"]
    difference = float((logits["columns run"] - logits["every column"]).abs().max())
    for name, value in medians.items():
        print(f"{name}: {value:.3f} s (median of {args.repeats})")
    print(f"ratio columns run / every column: {ratio:.3f}; last logits max |difference| {difference:.2e}")
    if args.json:
        args.json.write_text(json.dumps({**vars(args), "json": None, "seconds": seconds, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
