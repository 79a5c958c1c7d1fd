"""A randomised campaign: does every row of a left-padded batch get the answer it gets alone?

    python benchmarks/row_alone_campaign.py [--cases 200] [--seed 0] [--architectures NAME ...] [--json OUT]

kvcal promises that padding is never stored and each row is compressed on its own real length
(runtime/serve/generation.py), so a row's generated tokens and logits do not depend on the rows beside
it.  The tests check that on chosen cases; this draws many at random, over what a request can combine:
the architecture (tests/tiny_architectures.py's ten tiny models: sliding windows, soft-capping, query
norms, fused projections; a tiny Llama 4 with chunks of 64 positions; a tiny gpt-oss with learned sinks;
a tiny Qwen3.5, Gated DeltaNet layers beside attention; a tiny Gemma 4, its sliding layers held apart; tiny
Gemma 3n and Gemma 4 whose last two layers read earlier layers' caches),
2-3 rows of 12-200 tokens, question-aware or
question-agnostic prompts (``build_inputs``), several questions about one context compressed once
(``answer``'s path), beam search (2 beams), every artifact-free scorer, the ratio evicted (0 to 0.95) or
a fixed budget, the protected window and sinks, the block-wise prefill, decode-time eviction
(``evict_every``), the first-order correction, and the attention kernel (the CPU's own, the page kernel
and FlashAttention's varlen call that a GPU runs, the latter with its plain-torch reference forced in,
and flex_attention).

Each case runs ``runtime.generate`` on the batch and on each row alone (6 new tokens, one torch thread)
and compares the row's tokens and every step's logits (beams: the sequence's score) within 1e-4; a step
where the tokens part is a failure unless the two logits there agree within that bound (a tie).  In
float64, so that near-ties do not flip (gpt-oss in float32: its experts multiply in float32 only).  A
failing row is run again through the unmodified model (transformers' generate, nothing compressed):
where it too answers otherwise in the batch, the failure is counted as the model's own.  KNorm is not
drawn for the models whose per-head key norm makes every key's norm equal.  Prints one line per failing
case with everything needed to rerun it (``--only N``), then the counts; exits 1 when a failure is
kvcal's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

TOLERANCE = 1e-4
MODELS_OWN = "the model's own"  # a failure the unmodified model shows too
# float64 by default: a row's scores in a batch and alone then differ by ~1e-16, not float32's ~1e-7, so that
# near-ties (KNorm on keys an RMS norm made nearly equal) do not flip and what differs is the logic
DTYPE = torch.float64
NEW_TOKENS = 6
# artifact-free (KVzip needs its reconstruction pass, expected_attention and learned an artifact)
SCORERS = ("keydiff", "knorm", "leverage", "snapkv", "streaming")


def architectures() -> dict:
    import tiny_architectures
    import transformers
    from test_attention_sinks import gpt_oss
    from test_gemma4 import gemma4
    from test_hybrid_models import hybrid
    from test_kv_sharing import sharing
    from test_rope_forms import _llama4_with_chunks

    made = {name: (lambda name=name: tiny_architectures.make_tiny(name)) for name in tiny_architectures.NAMES}
    made["llama4-chunks-64"] = lambda: _llama4_with_chunks(64)
    made["gpt-oss"] = lambda: gpt_oss()
    made["qwen3.5-hybrid"] = lambda: hybrid()
    if hasattr(transformers, "Gemma4ForCausalLM"):  # sliding layers transformers' own, full ones of another geometry
        made["gemma4"] = lambda: gemma4()
    # KV sharing: six layers, the last two reading layers 2 and 3's caches (tests/test_kv_sharing.py)
    made["gemma3n-kv-sharing"] = lambda: sharing("gemma3n_text")
    if hasattr(transformers, "Gemma4ForCausalLM"):
        made["gemma4-kv-sharing"] = lambda: sharing("gemma4_text")
    if hasattr(transformers, "MiMoV2FlashForCausalLM"):  # values narrower than the keys, sliding layers held apart
        from test_mimo_v2_flash import mimo

        made["mimo-v2-flash"] = lambda: mimo()
    return made


# KNorm ranks keys by their norm, which an RMS norm over each head (with the tiny models' unit weights) makes equal
# up to rounding: the ranking is then rounding's, in a batch as alone, and says nothing of kvcal's logic
KEYS_OF_ONE_NORM = ("qwen3", "gemma3", "qwen3.5-hybrid", "gemma4", "gemma3n-kv-sharing", "gemma4-kv-sharing")


def draw_case(rng: random.Random, index: int, names: list[str]) -> dict:
    rows = rng.choice((2, 3))
    architecture = rng.choice(names)
    scorers = [s for s in SCORERS if not (s == "knorm" and architecture in KEYS_OF_ONE_NORM)]
    case = {
        "index": index,
        # rows: a batch of prompts; questions: one context compressed once and copied to each question's row (answer's
        # path for several questions); beams: rows decoded by beam search (2 beams)
        "kind": rng.choices(("rows", "questions", "beams"), weights=(70, 15, 15))[0],
        "architecture": architecture,
        "lengths": [rng.randint(12, 200) for _ in range(rows)],
        "agnostic": rng.random() < 0.4,
        "question_lengths": [rng.randint(1, 12) for _ in range(rows)],
        "scorer": rng.choice(scorers),
        "window": rng.choice((0, 4, 32)),
        "n_sink": rng.choice((0, 4)),
        "block_size": rng.choice((None, None, 16, 48)),
        "evict_every": rng.choice((None, None, 1, 3)),
        "correction": rng.choice(("none", "none", "order1")),
        # the attention kernels: the CPU's own; the page kernel and FlashAttention's varlen call a GPU runs (varlen
        # with its plain-torch reference, forced); flex_attention
        "kernel": rng.choice(("default", "default", "pages", "varlen", "flex")),
        "seed": rng.randrange(1 << 30),
    }
    if rng.random() < 0.2:
        case["budget"] = rng.randint(1, 40)
    else:
        case["compression_ratio"] = rng.choice((0.0, 0.3, 0.6, 0.85, 0.95))
    return case


def policy_of(case: dict):
    from runtime import CompressionPolicy

    size = {"budget": case["budget"]} if "budget" in case else {"compression_ratio": case["compression_ratio"]}
    return CompressionPolicy(
        **size,
        scorer=case["scorer"],
        window=case["window"],
        n_sink=case["n_sink"],
        evict_every=case["evict_every"],
        correction=case["correction"],
    )


def run(model, contexts, questions, case):
    """Tokens ``[rows, new]`` and, per step, what decided them ``[rows, new, vocab]`` (greedy: the logits; beams:
    the sequence's score, repeated) of ``runtime.generate``, or of answer's path for several questions."""
    from runtime import compress_prompt, generate
    from runtime.serve.generation import generate_from_cache

    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True)
    if case["kind"] == "beams":
        options.update(num_beams=2, output_scores=True)
    else:
        options.update(output_logits=True)
    if case["kind"] == "questions" and len(questions) > 1:
        ids, mask, columns = layout(contexts, questions, agnostic=True)
        cache, report = compress_prompt(
            model,
            ids[:1],
            policy_of(case),
            attention_mask=mask[:1],
            context_columns=columns,
            block_size=case["block_size"],
        )
        cache.batch_repeat_interleave(len(questions))
        result = generate_from_cache(model, ids, mask, cache, report, **options)
    else:
        ids, mask, columns = layout(contexts, questions, case["agnostic"] or case["kind"] == "questions")
        result = generate(
            model,
            ids,
            policy_of(case),
            attention_mask=mask,
            context_columns=columns,
            block_size=case["block_size"],
            **options,
        )
    if case["kind"] == "beams":
        scores = result.output.sequences_scores.double()  # [rows]
        return result.new_tokens, scores[:, None, None].expand(-1, result.new_tokens.shape[1], 1)
    return result.new_tokens, torch.stack(result.logits, dim=1).double()


def compare(batch, alone) -> str | None:
    """None when the row equals itself alone, else what differs."""
    (tokens, logits), (tokens_alone, logits_alone) = batch, alone
    for step in range(tokens.shape[0]):
        gap = float((logits[step] - logits_alone[step]).abs().max())
        if gap > TOLERANCE:
            return f"step {step}: logits differ by {gap:.3g}"
        if int(tokens[step]) != int(tokens_alone[step]):
            return None  # a tie the two broke apart, within the tolerance: later steps feed other tokens
    return None


def layout(contexts, questions, agnostic: bool):
    """``ids``, ``mask`` and the compressed columns (None: question-aware) of a batch of rows."""
    from runtime.serve.generation import build_inputs

    if agnostic:
        return build_inputs(contexts, questions, pad_token_id=0)
    prompts = [c + q for c, q in zip(contexts, questions, strict=True)]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, None


def model_depends_on_the_batch(model, contexts, questions, agnostic: bool, row: int) -> float | None:
    """The largest logit gap when the unmodified model (transformers' own generate, nothing compressed) answers
    ``row`` of this batch otherwise than alone: then so does kvcal, which serves the model as it is (Llama 4 scales
    its no-RoPE layers' queries by the column, padding counted, where a row alone has no padding); else None."""
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    options.update(output_logits=True, return_dict_in_generate=True)
    ids, mask, _ = layout(contexts, questions, agnostic)
    alone_ids, alone_mask, _ = layout(contexts[row : row + 1], questions[row : row + 1], agnostic)
    with torch.no_grad():
        together = torch.stack(model.generate(ids, attention_mask=mask, **options).logits, 1)[row]
        alone = torch.stack(model.generate(alone_ids, attention_mask=alone_mask, **options).logits, 1)[0]
    # a model whose rows do not depend on the batch gives them within ~1e-14 in float64 (~1e-6 where it computes in
    # float32: gpt-oss, the Gated DeltaNet's kernels); above TOLERANCE / 10 it is the model's own dependence, which
    # compression may then move by more or less than TOLERANCE
    gap = float((together.double() - alone.double()).abs().max())
    return gap if gap > TOLERANCE / 10 else None


@contextlib.contextmanager
def kernel(name: str):
    """Run under the attention kernel ``name`` (``default``: whatever the runtime picks on this machine)."""
    from runtime.kv_store import layer_attention, varlen_attention
    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

    saved = (os.environ.get(DECODE_KERNEL_VARIABLE), layer_attention.varlen_serves, varlen_attention.flash_varlen)
    try:
        if name in ("pages", "flex"):
            os.environ[DECODE_KERNEL_VARIABLE] = name
        if name == "varlen":
            # varlen_serves but its device and dtype: a GPU's conditions
            layer_attention.varlen_serves = lambda query, store, softcap: varlen_attention.varlen_takes(store, softcap)
            varlen_attention.flash_varlen = varlen_attention.reference_varlen
        yield
    finally:
        if saved[0] is None:
            os.environ.pop(DECODE_KERNEL_VARIABLE, None)
        else:
            os.environ[DECODE_KERNEL_VARIABLE] = saved[0]
        layer_attention.varlen_serves, varlen_attention.flash_varlen = saved[1], saved[2]


def check(case: dict, builders: dict, models: dict) -> str | None:
    with kernel(case.get("kernel", "default")):
        return _check(case, builders, models)


def _check(case: dict, builders: dict, models: dict) -> str | None:
    name = case["architecture"]
    if name not in models:
        model = builders[name]()
        # gpt-oss's experts multiply in float32 or lower only (torch's grouped mm)
        models[name] = model if name == "gpt-oss" else model.to(DTYPE)
    model = models[name]
    vocab = int(model.config.vocab_size)
    generator = random.Random(case["seed"])
    contexts = [[generator.randrange(3, vocab) for _ in range(n)] for n in case["lengths"]]
    questions = [[generator.randrange(3, vocab) for _ in range(n)] for n in case["question_lengths"]]
    if not case["agnostic"]:  # question-aware: the whole prompt is compressed but its last token
        contexts = [c + q[:-1] for c, q in zip(contexts, questions, strict=True)]
        questions = [q[-1:] for q in questions]
    if case["kind"] == "questions":  # one context, each row's question
        contexts = contexts[:1] * len(contexts)
    tokens, logits = run(model, contexts, questions, case)
    for row in range(len(contexts)):
        alone = run(model, contexts[row : row + 1], questions[row : row + 1], case)
        problem = compare((tokens[row], logits[row]), (alone[0][0], alone[1][0]))
        if problem is not None:
            agnostic = case["agnostic"] or case["kind"] == "questions"
            own = model_depends_on_the_batch(model, contexts, questions, agnostic, row)
            if own is not None:
                return f"{MODELS_OWN} (its logits {own:.3g} apart): row {row}: {problem}"
            return f"row {row}: {problem}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, nargs="*", default=None, help="run these case indices alone")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument(
        "--architectures", nargs="*", default=None, help="draw among these architectures only (default: every one)"
    )
    args = parser.parse_args(argv)
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    builders = architectures()
    names = sorted(builders)
    if args.architectures:
        unknown = sorted(set(args.architectures) - set(names))
        if unknown:
            parser.error(f"unknown architectures {unknown}; choose among {names}")
        names = sorted(args.architectures)
    rng = random.Random(args.seed)
    cases = [draw_case(rng, index, names) for index in range(args.cases)]
    if args.only is not None:
        cases = [cases[index] for index in args.only]
    models, failures, own, refused, started = {}, [], [], [], time.time()
    for case in cases:
        try:
            problem = check(case, builders, models)
        except (ValueError, TypeError) as exc:  # refused by name: counted apart, listed
            refused.append({**case, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        except Exception as exc:  # noqa: BLE001 - a crash is a finding
            problem = f"crashed: {type(exc).__name__}: {exc}"[:300]
            traceback.print_exc()
        if problem is not None:
            (own if problem.startswith(MODELS_OWN) else failures).append({**case, "problem": problem})
            print(f"FAIL case {case['index']}: {problem}; {json.dumps(case)}", flush=True)
    print(
        f"{len(cases)} cases in {time.time() - started:.0f} s: {len(failures)} failing, {len(own)} the unmodified "
        f"model's own, {len(refused)} refused by name, {len(cases) - len(failures) - len(own) - len(refused)} rows "
        "as alone"
    )
    for item in refused:
        details = json.dumps({key: value for key, value in item.items() if key != "error"})
        print(f"refused case {item['index']}: {item['error']}; {details}")
    if args.json:
        summary = {"failures": failures, "models_own": own, "refused": refused, "cases": len(cases)}
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
