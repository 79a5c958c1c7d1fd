"""Running an evaluation: probes x policies x compression ratios through the real model.

For every probe the uncompressed baseline runs first: the context is prefilled into a full
cache and the answer generated greedily, while forward pre-hooks on each layer's ``o_proj``
record the attention output of the first forward after the prefix (the question tokens in
question-agnostic mode, the last prompt token in question-aware mode).  Then every (policy,
ratio) compresses the same prefix, generates, and is scored:

* ``correct``: the answer contains the ground truth (substring match as RULER does);
* ``attention_error``: mean over layers of ``norm(o_hat - o) / norm(o)`` on those recorded
  outputs (end to end: a layer's error includes what earlier layers changed);
* ``kv_bytes``: bytes the cache holds for keys and values right after compression;
* ``prefill_seconds``: prefill + compression; ``decode_seconds``: ``model.generate`` (question
  tokens and new tokens).

Results are aggregated per (policy, ratio) into the records of ``evaluation_results``.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from runtime.geometry import ModelGeometry
from runtime.policy_spec import PolicySpec

from .evaluation_results import (
    EVALUATION_SCHEMA,
    best_per_ratio,
    recommend,
    wilson_interval,
)

EVALUATION_SEED_OFFSET = 1_000_003  # held-out task seed = the profiled probes' seed + this, unless given


def held_out_spec(
    base, *, families, count: int, profiler_seed: int | None, model_context: int, depths=None, seed: int | None = None
):
    """Needle tasks the profiler never saw: ``base`` (a ``needles.ProbeSpec``) with ``families``,
    ``count`` tasks per cell, lengths beyond 90% of the model's context dropped, and the seed
    ``profiler_seed + EVALUATION_SEED_OFFSET`` (or ``seed``; refused when it is the profiler's)."""
    lengths = tuple(n for n in base.lengths if n <= 0.9 * model_context) or (min(base.lengths),)
    if seed is None:
        seed = (profiler_seed or 0) + EVALUATION_SEED_OFFSET
    if profiler_seed is not None and seed == profiler_seed:
        raise ValueError(f"task seed {seed} is the profiler's probe seed; evaluation tasks must be unseen")
    changes = {"families": tuple(families), "lengths": lengths, "count": count, "seed": seed}
    if depths is not None:
        changes["depths"] = tuple(depths)
    return base.replace(**changes)


class AttentionOutputRecorder:
    """Records the input of every layer's ``o_proj`` on the first forward after :meth:`arm`."""

    def __init__(self, model):
        self.layers = [attention.o_proj for attention in ModelGeometry.of(model).attention_modules]
        self.outputs: list[torch.Tensor | None] = [None] * len(self.layers)
        self._armed = False
        self._handles = [
            module.register_forward_pre_hook(self._hook(index)) for index, module in enumerate(self.layers)
        ]

    def _hook(self, index: int):
        def record(module, args):
            if self._armed and self.outputs[index] is None:
                self.outputs[index] = args[0].detach().float().clone()  # [B, q, Hq * d]
                if index == len(self.layers) - 1:
                    self._armed = False

        return record

    def arm(self) -> None:
        self.outputs = [None] * len(self.layers)
        self._armed = True

    def take(self) -> list[torch.Tensor]:
        outputs, self.outputs = self.outputs, [None] * len(self.layers)
        self._armed = False
        return outputs

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def relative_error(approx: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """Mean over layers of ``norm(approx - exact) / norm(exact)``."""
    errors = [float((a - e).norm() / e.norm().clamp_min(1e-12)) for a, e in zip(approx, exact, strict=True)]
    return sum(errors) / len(errors)


def _run_one(model, tokenizer, probe, policy, calibration, recorder, question_aware, max_new_tokens):
    from runtime import compress_prompt

    ids = torch.tensor([probe.input_ids], dtype=torch.long)
    context_columns = None if question_aware else probe.context_end
    start = time.perf_counter()
    cache, _ = compress_prompt(model, ids, policy, context_columns=context_columns, calibration=calibration)
    prefilled = time.perf_counter()
    kv_bytes = cache.kv_bytes()
    recorder.arm()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
        )
    done = time.perf_counter()
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    return {
        "text": text,
        "outputs": recorder.take(),
        "kv_bytes": kv_bytes,
        "prefill_seconds": prefilled - start,
        "decode_seconds": done - prefilled,
        "new_tokens": int(out.shape[1] - ids.shape[1]),
    }


def evaluate(
    model,
    tokenizer,
    probes,
    policies: list[PolicySpec],
    ratios: list[float],
    *,
    calibration=None,
    question_aware: bool = False,
    max_new_tokens: int = 24,
    tolerance: float = 0.02,
    progress: bool = True,
    is_correct=None,
) -> dict:
    """Run every probe through the baseline and every (policy, ratio); aggregated results."""
    if is_correct is None:
        from needles import answer_is_correct as is_correct
    compressed = [spec for spec in policies if not spec.is_baseline]
    for spec in compressed:  # fail before any model time is spent
        spec.policy(ratios[0]).check_calibration(calibration)
    runs = defaultdict(list)  # (policy, ratio) -> per-probe records
    recorder = AttentionOutputRecorder(model)
    total = len(probes) * (1 + len(compressed) * len(ratios))
    bar = tqdm(total=total, desc="evaluate", unit="run", disable=not progress)
    try:
        for probe in probes:
            reference = _run_one(model, tokenizer, probe, None, calibration, recorder, question_aware, max_new_tokens)
            runs[("baseline", None)].append(
                {
                    **reference,
                    "correct": bool(is_correct(reference["text"], probe)),
                    "family": probe.family,
                    "error": None,
                    "full_bytes": reference["kv_bytes"],
                }
            )
            bar.update()
            for spec in compressed:
                for ratio in ratios:
                    result = _run_one(
                        model,
                        tokenizer,
                        probe,
                        spec.policy(ratio),
                        calibration,
                        recorder,
                        question_aware,
                        max_new_tokens,
                    )
                    runs[(spec.name, ratio)].append(
                        {
                            **result,
                            "correct": bool(is_correct(result["text"], probe)),
                            "family": probe.family,
                            "error": relative_error(result["outputs"], reference["outputs"]),
                            "full_bytes": reference["kv_bytes"],
                        }
                    )
                    bar.set_postfix_str(f"{spec.name} @ {ratio:g}")
                    bar.update()
    finally:
        bar.close()
        recorder.remove()

    records = {key: _aggregate(key, items) for key, items in runs.items()}
    baseline = records.pop(("baseline", None))
    results = [records[(spec.name, ratio)] for spec in compressed for ratio in ratios]
    return {
        "schema": EVALUATION_SCHEMA,
        "question_aware": question_aware,
        "baseline": baseline,
        "results": results,
        "recommendation": recommend(baseline["accuracy"], results, tolerance),
        "best_per_ratio": best_per_ratio(results, [spec.name for spec in compressed]),
    }


def _aggregate(key, items: list[dict]) -> dict:
    policy, ratio = key
    correct = sum(item["correct"] for item in items)
    low, high = wilson_interval(correct, len(items))
    families = defaultdict(lambda: [0, 0])
    for item in items:
        families[item["family"]][0] += item["correct"]
        families[item["family"]][1] += 1
    errors = [item["error"] for item in items if item["error"] is not None]
    kv_bytes = sum(item["kv_bytes"] for item in items)
    full_bytes = sum(item["full_bytes"] for item in items)
    return {
        "policy": policy,
        "compression_ratio": ratio,
        "n": len(items),
        "correct": correct,
        "accuracy": correct / len(items),
        "ci_low": low,
        "ci_high": high,
        "attention_error": sum(errors) / len(errors) if errors else None,
        "kv_bytes": kv_bytes // len(items),
        "kv_fraction": kv_bytes / full_bytes if full_bytes else 1.0,
        "prefill_seconds": sum(item["prefill_seconds"] for item in items) / len(items),
        "decode_seconds": sum(item["decode_seconds"] for item in items) / len(items),
        "per_family": {name: {"correct": c, "n": n, "accuracy": c / n} for name, (c, n) in sorted(families.items())},
    }
