"""A Gemma 4 prefill whose readers (KV sharing) attend the columns transformers runs through them, or every column.

    python benchmarks/kv_sharing_prefill.py [--tokens 4096] [--layers 15] [--shared 5] [--hidden 512]
                                            [--window 512] [--repeats 3] [--json OUT]

A random Gemma 4 (text) with Gemma 4 E2B's attention shape (8 query heads, one KV head, head dim 256 in the sliding
layers and 512 in the full ones, four sliding layers to one full), ``--layers`` layers of which the last
``--shared`` read earlier layers' caches, its MLP and hidden size small (``--hidden``), float32, one torch thread.
``compress_prompt(model, ids, None)`` (the prefill alone, one column of logits kept; ``sink_prefill.py``'s
alternation): transformers' Gemma 4
(5.24) runs only the column whose logits the prefill keeps through the readers, and each reader attends that
query over the chunk (``chunk_only_attention`` given fewer queries: ``t q`` logits); or, as first built, zero
queries fill the other columns and the whole chunk is attended, its last row kept.  The two alternate
``--repeats`` times.  Printed: the median seconds, their ratio, and the two variants' last logits' max |difference|
(the last token fed through each cache).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


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
    from sink_prefill import alternate_prefills, report

    import runtime.kv_store.layer_attention as layer_attention

    torch.set_num_threads(1)
    model = build(args.layers, args.shared, args.hidden, args.window)
    if not hasattr(model.model, "_maybe_slice_kv_shared_inputs"):
        parser.error("this transformers runs every column through Gemma 4's readers: nothing to compare")
    ids = torch.randint(3, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def every_column(query, keys, values, real, scaling, positions, window, softcap, sinks, chunk):
        """As first built: zero queries before the kept columns, the whole chunk attended, their rows dropped."""
        options = dict(positions=positions, window=window, softcap=softcap, sinks=sinks, attention_chunk=chunk)
        return layer_attention.at_the_chunks_columns(
            lambda whole: layer_attention.chunk_only_attention(whole, keys, values, real, scaling, **options),
            query,
            keys.shape[2],
        )

    variants = {"columns run": layer_attention._chunk_tail_attention, "every column": every_column}
    times, last = alternate_prefills(model, ids, layer_attention, "_chunk_tail_attention", variants, args.repeats)
    report(args, times, last, f"{args.layers} layers, the last {args.shared} reading earlier ones' caches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
