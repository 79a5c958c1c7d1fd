"""``evaluate-artifact --lm-eval-tasks``: lm-evaluation-harness tasks at the artifact's compression ratios.

Next to the needle suite, a user's own calibration check on any lm-eval task (RULER's, or one of
their own with ``--lm-eval-include``): each task is run by lm-eval's ``simple_evaluate`` once on the
unmodified model (lm-eval's own ``hf`` model around the loaded model: the reference) and once per
compression ratio through kvcal's lm-eval model (``runtime.lm_eval_model.KvcalLM`` serving
``calibration.policy(ratio)``, the policy the artifact serves), all on the same documents (lm-eval's
default seeds; a document whose prompt differs between two runs is refused, not paired).

Per task, metric and ratio: n, the mean, a 95% Wilson interval (of the mean score as a proportion
of n, exact for 0/1 scores; metrics with per-document values outside [0, 1] get lm-eval's aggregate
alone) and paired wins / losses against the uncompressed reference on the same documents.  RULER's
``-1`` (the value its documents give the lengths they were not built for) is not a score and is
left out.

lm-eval is the ``lm-eval`` extra: :func:`check_tasks` says how to install it, before any model work.
"""

from __future__ import annotations

import math
from collections import defaultdict

from common.log import logger

LOG = logger("profiler")
MISSING = (
    "--lm-eval-tasks needs lm-evaluation-harness, which is not installed: pip install 'kvcal[lm-eval]' "
    "(in a checkout of kvcal: pip install -e '.[lm-eval]')"
)
REFERENCE = "uncompressed"


def _task_manager(include: list[str] | None, metadata: dict | None = None):
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        if (error.name or "").split(".")[0] != "lm_eval":
            raise
        raise ValueError(MISSING) from None
    # the tasks read their metadata from the manager that loads them (simple_evaluate's own is skipped)
    return TaskManager(include_path=list(include) if include else None, metadata=metadata)


def check_tasks(tasks: list[str], include: list[str] | None = None) -> None:
    """lm-eval is installed and knows every task (a task, group or tag name); ValueError naming the
    unknown ones, or how to install lm-eval."""
    manager = _task_manager(include)
    unknown = [name for name in tasks if name not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"--lm-eval-tasks: lm-eval knows no task {', '.join(unknown)} (lm-eval ls tasks lists them; a task of "
            "your own: --lm-eval-include DIR with its YAML)"
        )


def run_tasks(
    model,
    tokenizer,
    calibration,
    tasks: list[str],
    ratios: list[float],
    *,
    limit: int | None = None,
    metadata: dict | None = None,
    include: list[str] | None = None,
    question: str = "auto",
    batch_size: int = 1,
) -> dict:
    """Run ``tasks`` uncompressed (lm-eval's ``hf`` model) and at each of ``ratios`` (kvcal's, serving
    ``calibration.policy(ratio)``); the JSON section ``lm_eval`` of evaluate-artifact's results
    (docs/evaluation-format.md): the settings, each run's policy and lm-eval aggregates, and
    :func:`summarise`'s rows."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from runtime.lm_eval_model import KvcalLM
    from runtime.plan.recommendation import recommended_spec
    from runtime.serve.generation import context_limit

    metadata = dict(metadata or {})
    # RULER's tasks build their prompts with a tokenizer named in the metadata: the model's own
    metadata.setdefault("tokenizer", tokenizer.name_or_path)
    manager = _task_manager(include, metadata)
    limit_tokens = context_limit(model.config)
    common = {"tasks": list(tasks), "limit": limit, "task_manager": manager, "log_samples": True}
    runs, samples = [], {}
    LOG.info(f"lm-eval: {', '.join(tasks)} uncompressed (lm-eval's hf model), the reference")
    reference = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=limit_tokens)
    results = lm_eval.simple_evaluate(model=reference, **common)
    runs.append({"ratio": None, "policy": None, "question_counts": None, "results": _plain(results["results"])})
    samples[REFERENCE] = results["samples"]
    for ratio in ratios:
        served = KvcalLM(
            pretrained=model,
            tokenizer=tokenizer,
            artifact=calibration,
            compression_ratio=ratio,
            question=question,
            batch_size=batch_size,
            max_length=limit_tokens,
        )
        name = recommended_spec(calibration, ratio).name  # what calibration.policy(ratio) serves
        LOG.info(f"lm-eval: {', '.join(tasks)} at {ratio:g} evicted, serving {name}")
        results = lm_eval.simple_evaluate(model=served, **common)
        counts = dict(served.counts)
        runs.append({"ratio": ratio, "policy": name, "question_counts": counts, "results": _plain(results["results"])})
        samples[ratio] = results["samples"]
    return {
        "tasks": list(tasks),
        "limit": limit,
        "metadata": metadata,
        "question": question,
        "reference": "lm-eval's hf model on the unmodified model",
        "runs": runs,
        "rows": summarise(samples),
    }


def _plain(value):
    """lm-eval's results with what JSON cannot hold (NaN, numpy numbers) made plain."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | str) or value is None:
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return None if math.isnan(number) else number


def _scores(samples: dict) -> tuple[dict, dict]:
    """``(task, metric) -> doc_id -> score`` of the per-document values in [0, 1], and ``(task,
    doc_id) -> prompt hash``."""
    scores, prompts = defaultdict(dict), {}
    for task, documents in samples.items():
        for document in documents:
            doc_id = document["doc_id"]
            prompts[(task, doc_id)] = document.get("prompt_hash") or repr(document.get("arguments"))
            suffix = "" if document.get("filter", "none") == "none" else f",{document['filter']}"
            for metric in document.get("metrics", ()):
                value = document.get(metric)
                if isinstance(value, bool):
                    value = float(value)
                if isinstance(value, int | float) and 0.0 <= value <= 1.0:
                    scores[(task, metric + suffix)][doc_id] = float(value)
    return scores, prompts


def summarise(samples_by_run: dict) -> list[dict]:
    """One row per (task, metric, run): n, mean, 95% Wilson interval and, but for the reference,
    paired wins / losses against it on the documents both ran.  ``samples_by_run``: the run's key
    (:data:`REFERENCE` or a ratio) -> lm-eval's ``samples``.  ValueError when a document's prompt
    differs between the reference and a run (the tasks were built differently: nothing to pair)."""
    from common.formulas import wilson_interval

    reference_scores, reference_prompts = _scores(samples_by_run[REFERENCE])
    rows = []
    for key, samples in samples_by_run.items():
        scores, prompts = (reference_scores, reference_prompts) if key == REFERENCE else _scores(samples)
        changed = sorted(k for k, h in prompts.items() if k in reference_prompts and reference_prompts[k] != h)
        if changed:
            raise ValueError(
                f"lm-eval built other prompts at ratio {key} than uncompressed for {len(changed)} document(s) "
                f"(first: task {changed[0][0]}, doc {changed[0][1]}): the runs cannot be paired"
            )
        for (task, metric), outcome in sorted(scores.items()):
            n, total = len(outcome), sum(outcome.values())
            low, high = wilson_interval(total, n)
            row = {"task": task, "metric": metric, "ratio": None if key == REFERENCE else key, "n": n}
            row.update(mean=total / n, low=low, high=high, wins=None, losses=None, paired=0)
            reference = reference_scores.get((task, metric))
            if key != REFERENCE and reference:
                shared = [doc for doc in outcome if doc in reference]
                row.update(
                    wins=sum(outcome[doc] > reference[doc] for doc in shared),
                    losses=sum(outcome[doc] < reference[doc] for doc in shared),
                    paired=len(shared),
                )
            rows.append(row)
    return rows


def markdown_table(section: dict) -> str:
    """The rows of :func:`run_tasks`'s section as a Markdown table: per task and metric, uncompressed
    first, then each ratio with the policy it served."""
    policies = {run["ratio"]: run["policy"] for run in section["runs"]}
    lines = [
        f"lm-eval tasks ({', '.join(section['tasks'])}; limit {section['limit']}; question {section['question']}; "
        f"reference: {section['reference']}); score mean, 95% Wilson interval, paired W/L vs uncompressed:",
        "",
        "| task | metric | evicted | policy | n | score | 95% interval | W/L vs uncompressed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {ratio: index for index, ratio in enumerate(policies)}
    for row in sorted(section["rows"], key=lambda r: (r["task"], r["metric"], order[r["ratio"]])):
        evicted = "0 (uncompressed)" if row["ratio"] is None else f"{row['ratio']:g}"
        paired = "" if row["wins"] is None else f"{row['wins']}/{row['losses']} of {row['paired']}"
        lines.append(
            f"| {row['task']} | {row['metric']} | {evicted} | {policies[row['ratio']] or '- (hf)'} | {row['n']} | "
            f"{row['mean']:.3f} | {row['low']:.3f}-{row['high']:.3f} | {paired} |"
        )
    return "\n".join(lines)
