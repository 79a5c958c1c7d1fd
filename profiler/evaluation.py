"""Running an evaluation: probes x policies x compression ratios through the real model.

For every probe the prefix (the context in question-agnostic mode, the prompt but its last
token in question-aware mode) is prefilled once into a full cache; every (policy, ratio)
compresses its own copy of it, and the uncompressed baseline (batch row 0) and every cell
decode greedily together in one batch (the runtime keeps each row's own cache, budgets and
correction; batch == one by one is tested in tests/test_runtime_cache.py).  Forward
pre-hooks on each layer's ``o_proj`` record the attention output of the first forward after
the prefix for every row.  Each cell is scored:

* ``correct``: the answer contains the ground truth (substring match as RULER does);
* ``attention_error``: mean over layers of ``norm(o_hat - o) / norm(o)`` on those recorded
  outputs (end to end: a layer's error includes what earlier layers changed);
* ``kv_bytes``: bytes the cache holds for keys and values right after compression;
* ``prefill_seconds``: the shared prefill + this cell's compression (for ``kvzip`` policies
  including the reconstruction pass, :func:`runtime.compression.kvzip.kvzip_scores`, run once per probe and
  shared by them); ``decode_seconds``: the batched ``model.generate`` (question tokens and new
  tokens) divided by its rows.

Policies that need a forward pass of their own at serving (``kvzip``) are measured like the
others; the policy to serve is decided elsewhere (``profiler.recommendation``,
``evaluation_results.paired_recommendation``), among those ``calibration.policy()`` can serve.

Results are kept per task (``evaluation_results.task_record``) and aggregated per (policy,
ratio) into the records of ``evaluation_results``.  ``evaluate(on_task=...)`` hands every
task's records over as soon as they are measured, and ``evaluate(recorded=...)`` takes those of
an earlier, interrupted run instead of running their tasks again (``evaluate-artifact --resume``).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from common.formulas import wilson_interval
from profiler.greedy import greedy_generate
from runtime.math.geometry import ModelGeometry
from runtime.plan.policy_spec import PolicySpec

from .evaluation_results import EVALUATION_SCHEMA, cell_keys, task_record


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


@torch.no_grad()
def decode_together(model, tokenizer, ids: torch.Tensor, caches, max_new_tokens: int) -> tuple[list[str], float]:
    """Greedy answers to one prompt ``ids [1, T]`` from each of ``caches`` (copies of its prefilled
    prefix, compressed or not), decoded as one batch (``RaggedCache.stack``: equal to one by one,
    the runtime's batch tests); returns the answers and the batch's wall seconds."""
    from runtime import RaggedCache, ragged_attention
    from runtime.kv_store.transformers_compat import cache_argument

    batch = RaggedCache.stack(caches)
    rows = ids.expand(len(caches), -1)
    started = time.perf_counter()
    with ragged_attention(model):
        out = greedy_generate(model, tokenizer, rows, max_new_tokens, **cache_argument(model, batch))
    seconds = time.perf_counter() - started
    return [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out], seconds


@torch.no_grad()
def _run_probe(model, tokenizer, probe, cells, calibration, recorder, question_aware, max_new_tokens):
    """The baseline and every ``(key, plan)`` cell (plans bound to ``calibration`` by
    ``runtime.plan.serving_plan.bind``) on one probe: one prefill, one copy of it compressed per cell,
    and one batched ``generate`` (row 0 the baseline).  Returns per-row records."""
    from runtime import RaggedCache, bind
    from runtime.compression.kvzip import uses_kvzip, with_reconstruction_scores
    from runtime.compression.prefill import compress, prefill_for_policies, shared_scores
    from runtime.math.geometry import input_device
    from runtime.serve.generation import check_inputs

    ids = torch.tensor([probe.input_ids], dtype=torch.long, device=input_device(model))
    check_inputs(model, ids, None)
    columns = ids.shape[1] - 1 if question_aware else probe.context_end
    plans = [plan for _, plan in cells]
    policies = [plan.policy for plan in plans]
    start = time.perf_counter()
    base = RaggedCache.for_model(model)
    stats = prefill_for_policies(model, base, ids[:, :columns], plans)
    prefill_seconds = time.perf_counter() - start
    # KVzip's policies share one reconstruction pass; its time counts in each of their cells
    scored, reconstruction = with_reconstruction_scores(model, tokenizer, base, ids[0, :columns], policies)
    plans = [
        plan if policy is original else bind(policy, calibration, model)  # this probe's KVzip scores, bound again
        for policy, original, plan in zip(scored, policies, plans, strict=True)
    ]
    # the policies that share score parts (one scorer, e.g. leverage at every ratio) are scored once
    sharing = defaultdict(list)  # scores_key -> indices of the plans
    for index, plan in enumerate(plans):
        if plan.policy.scores_key() is not None:
            sharing[plan.policy.scores_key()].append(index)
    shared = {}  # plan index -> (every layer's scores of the prefill, seconds its scoring takes alone)
    for indices in sharing.values():
        shared.update(zip(indices, shared_scores(base, [plans[i] for i in indices], stats), strict=True))
    caches, compress_seconds = [], []
    for index, (original, plan) in enumerate(zip(policies, plans, strict=True)):
        cache = base.copy()
        scores, scoring_seconds = shared.get(index, (None, 0.0))
        report = compress(model, cache, plan, prompt_stats=stats, scores=scores)
        caches.append(cache)
        # each cell's time counts the scoring it shares (what serving that policy alone costs)
        compress_seconds.append(
            report.seconds + scoring_seconds + (reconstruction.seconds if uses_kvzip(original) else 0.0)
        )
    base.stop_observing()  # the baseline decodes without the recorded queries
    caches.insert(0, base)
    compress_seconds.insert(0, 0.0)
    kv_bytes = [cache.kv_bytes() for cache in caches]
    recorder.arm()
    texts, seconds = decode_together(model, tokenizer, ids, caches, max_new_tokens)
    decode_seconds = seconds / len(caches)
    outputs = recorder.take()  # per layer [rows, q, Hq * d]
    records = []
    for row, text in enumerate(texts):
        mine = [layer[row : row + 1] for layer in outputs]
        reference = [layer[0:1] for layer in outputs]
        records.append(
            {
                "text": text,
                "kv_bytes": kv_bytes[row],
                "prefill_seconds": prefill_seconds + compress_seconds[row],
                "decode_seconds": decode_seconds,
                "error": None if row == 0 else relative_error(mine, reference),
            }
        )
    return records


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
    progress: bool = True,
    is_correct=None,
    on_task=None,
    recorded=None,
) -> dict:
    """Run every probe through the baseline and every (policy, ratio); per-task and aggregated results.

    Per probe the prefix is prefilled once; each (policy, ratio) compresses its own copy, and
    the baseline and all cells decode together as one batch (equal to one by one: the
    runtime's batch equivalence tests), so a cell costs its compression and a batch row of
    decoding, not a prefill.  ``decode_seconds`` is the batch's time divided by its rows.

    ``on_task(probe, rows)``: called after each probe is measured, with its rows (row 0 the
    baseline, then the policies in order, each at every ratio in order): JSON-able dicts
    ``{policy, compression_ratio, text, correct, kv_bytes, prefill_seconds, decode_seconds,
    error}``.  ``recorded``: probe id -> such rows of an earlier run; those probes are not run
    again and their rows are used as they are (they must be of the same cells, ValueError).
    """
    if is_correct is None:
        from needles import answer_is_correct as is_correct
    from runtime import bind

    recorded = recorded or {}
    compressed = [spec for spec in policies if not spec.is_baseline]
    # every cell bound once, before any model time is spent (a policy the calibration cannot serve fails here)
    cells = [
        ((spec.name, ratio), bind(spec.policy(ratio), calibration, model)) for spec in compressed for ratio in ratios
    ]
    keys = cell_keys(policies, ratios)
    runs = defaultdict(list)  # (policy, ratio) -> per-probe records
    per_task = []
    recorder = AttentionOutputRecorder(model)
    resumed = sum(probe.id in recorded for probe in probes)
    bar = tqdm(
        total=len(probes),
        initial=resumed,
        desc=f"evaluate ({resumed} resumed)" if resumed else "evaluate",
        unit="task",
        disable=not progress,
    )
    try:
        for probe in probes:
            rows = recorded.get(probe.id)
            if rows is None:
                records = _run_probe(
                    model, tokenizer, probe, cells, calibration, recorder, question_aware, max_new_tokens
                )
                rows = [
                    {
                        "policy": policy,
                        "compression_ratio": ratio,
                        **record,
                        "correct": bool(is_correct(record["text"], probe)),
                    }
                    for (policy, ratio), record in zip(keys, records, strict=True)
                ]
                if on_task is not None:
                    on_task(probe, rows)
                bar.update()
            elif [(row["policy"], row["compression_ratio"]) for row in rows] != keys:
                raise ValueError(f"the recorded rows of task {probe.id} are not of the cells evaluated now")
            full_bytes = rows[0]["kv_bytes"]
            for key, row in zip(keys, rows, strict=True):
                runs[key].append({**row, "family": probe.family, "full_bytes": full_bytes})
            per_task.append(task_record(probe, rows))
    finally:
        bar.close()
        recorder.remove()

    records = {key: _aggregate(key, items) for key, items in runs.items()}
    baseline = records.pop(("baseline", None))
    return {
        "schema": EVALUATION_SCHEMA,
        "question_aware": question_aware,
        "task_ids": [probe.id for probe in probes],  # the order of every record's "outcomes" and of "per_task"
        "baseline": baseline,
        "results": [records[(spec.name, ratio)] for spec in compressed for ratio in ratios],
        "per_task": per_task,
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
        "outcomes": [bool(item["correct"]) for item in items],  # per task, in the order of "task_ids"
    }
