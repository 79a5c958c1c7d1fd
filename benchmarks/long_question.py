"""Answering a long question from a compressed context: time against the question's length.

    python benchmarks/long_question.py [--context 1000] [--questions 141 276 546 1086 2172]
                                       [--keep-ratio 0.25] [--artifact PATH] [--repeats 1] [--json OUT]

On the embedded model, float32, one torch thread, a context of ``--context`` random tokens and a
question of each length in ``--questions`` (random tokens): the time to answer (the question as one
chunk, then two new tokens) from a cache that already holds the context, three ways, interleaved
per repeat so that background load hits all of them alike (the context's prefill and compression
are done once per question length, outside the timing; each answer starts from a copy):

* ``plain``: the unmodified model's ``generate()`` from a DynamicCache of the whole context (SDPA);
* ``split``: the runtime's ``generate_from_cache()`` from the context compressed with the flagship
  ``inf/leverage+correction`` and ``--artifact``, else ``uniform/keydiff``, at ``--keep-ratio``
  kept: the question attended in two parts merged by their log-sum-exp (the rows before it, the
  question itself causally: ``runtime.kv_store.layer_attention._chunk_split_attention``, the CPU's path);
* ``every row``: the same with the question attended over every stored row with a visibility mask
  (``runtime.kv_store.paged_attention.segment_attention``: logits materialised for every query and row,
  the path on other devices and the CPU's before 2026-11-27).

Reported per question length: seconds of each, ``split / plain`` and ``every row / split``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--context", type=int, default=1000, help="context tokens (default 1000)")
    parser.add_argument("--questions", type=int, nargs="+", default=[141, 276, 546, 1086, 2172])
    parser.add_argument("--keep-ratio", type=float, default=0.25, help="fraction of the context kept")
    parser.add_argument("--artifact", help="a calibration artifact of the embedded model: serve the flagship")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats; the best is reported")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import DynamicCache

    import runtime.kv_store.layer_attention
    from common.models import load_model, load_tokenizer
    from runtime import CompressionPolicy, compress_prompt, load_calibration
    from runtime.kv_store.transformers_compat import cache_argument
    from runtime.plan.policy_spec import FLAGSHIP
    from runtime.serve.generation import generate_from_cache

    model, tokenizer = load_model(), load_tokenizer()
    calibration = None
    policy = CompressionPolicy(keep_ratio=args.keep_ratio, scorer="keydiff")
    if args.artifact:
        calibration = load_calibration(model, tokenizer, path=args.artifact)
        policy = FLAGSHIP.policy(1 - args.keep_ratio)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(3, 1000, (1, args.context), generator=generator)
    fused = runtime.kv_store.layer_attention.fused_kernel_serves
    with torch.no_grad():
        plain_context = DynamicCache(config=model.config)
        model(context, **cache_argument(model, plain_context), use_cache=True)
    kwargs = {"max_new_tokens": 2, "min_new_tokens": 2, "do_sample": False}

    def answer_compressed(ids: torch.Tensor, cache) -> None:
        generate_from_cache(model, ids, torch.ones_like(ids), cache.copy(), None, **kwargs)

    def every_row(ids: torch.Tensor, cache) -> None:
        runtime.kv_store.layer_attention.fused_kernel_serves = lambda *a: False
        try:
            answer_compressed(ids, cache)
        finally:
            runtime.kv_store.layer_attention.fused_kernel_serves = fused

    def plain(ids: torch.Tensor, cache) -> None:
        with torch.no_grad():
            model.generate(ids, **cache_argument(model, copy.deepcopy(plain_context)), **kwargs)

    ways = {"plain": plain, "split": answer_compressed, "every row": every_row}
    rows = []
    print(f"context {args.context} tokens, policy {'flagship' if args.artifact else 'uniform/keydiff'}")
    print("| question tokens | plain s | split s | every row s | split / plain | every row / split |")
    print("|---|---|---|---|---|---|")
    for length in args.questions:
        ids = torch.cat([context, torch.randint(3, 1000, (1, length), generator=generator)], 1)
        compressed, _ = compress_prompt(model, ids, policy, context_columns=args.context, calibration=calibration)
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(args.repeats):
            for name, run in ways.items():
                start = time.perf_counter()
                run(ids, compressed)
                best[name] = min(best[name], time.perf_counter() - start)
        rows.append({"question_tokens": length, **best})
        print(
            f"| {length} | {best['plain']:.2f} | {best['split']:.2f} | {best['every row']:.2f} | "
            f"{best['split'] / best['plain']:.2f} | {best['every row'] / best['split']:.2f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
