"""RULER in the form of kvpress's leaderboard, on the embedded model (issue 43).

The offline RULER tasks of lm-eval 0.4.13 (they generate their data from the tokenizer; the
essay-haystack and QA tasks download theirs and are left out: :data:`OFFLINE_TASKS`), at one
context length (``--length``, 4096 as the leaderboard; the embedded SmolLM2-135M-Instruct has
8192 positions), each instance run by each method at each ratio (fraction of the context's KV
cache evicted), greedy, and scored with the task's own metric:

* the instances are built once with lm-eval's own task code (``TaskManager`` with metadata
  ``{"tokenizer": <the embedded model>, "max_seq_lengths": [length]}``, its ``load``,
  ``build_all_requests``; each task after ``simple_evaluate``'s default seeds, so a task's
  instances are those ``lm_eval --tasks <task>`` builds) and saved to ``--instances`` (the
  prompt's context and question token ids, the gold answers, the document, the task's
  generation settings and its ``process_results``);
  a later run (another split of the table) reads them from there, so every run sees the same
  instances and the same token ids;
* question-agnostic, as kvpress's RULER evaluation (``evaluation/benchmarks/ruler``): the prompt
  is split where its question starts (the last RULER question line,
  ``runtime.lm_eval_model.question_split``); the context alone is prefilled and compressed, the
  question and the answer prefix (the task's ``gen_prefix``) are fed through the compressed cache.
  ``--prompt chat`` (default) formats them as kvpress's pipeline does (the context in a user turn
  of the chat template, the question, the assistant header, the answer prefix);
  ``--prompt plain`` keeps lm-eval's own prompt (``input + " " + gen_prefix``, no chat template);
* methods: ``uncompressed`` (kvpress's pipeline without a press, ratio 0); kvcal's ``flagship``
  (``parse_policy("flagship")``) and ``artifact`` (``calibration.policy(r)`` of ``--artifact``;
  where that is the flagship policy its record points at the flagship's instead of running it
  again) served by ``runtime.generate(context_columns=...)``; kvpress 0.5.5's presses through its
  pipeline (``pipe.forward``): ``compactor`` (CompactorPress), ``kvzip`` (KVzipPress), ``snapkv``
  (SnapKVPress), ``expected_attention`` (ExpectedAttentionPress), ``keydiff`` (KeyDiffPress) and
  ``adakv-expected_attention`` (``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``, what
  kvpress's leaderboard calls ``expected_attention``);
* generation: the task's ``max_gen_toks`` (niah 128, vt 30, cwe 120, fwe 50), stopping at EOS
  (the tasks' ``until`` is empty); scoring: the task's ``process_results`` (RULER's
  ``string_match_all``: the share of the gold answers found in the answer).

Each (instance, method, ratio) is appended to ``--out`` (JSON lines) as it finishes; a rerun
with the same settings skips what is there (a killed run loses at most the cell it was in).
``--report`` reads ``--out`` and prints, per task x method x ratio, n, the mean score, a 95%
Wilson interval (of the mean score as a proportion of n: exact for 0/1 scores) and paired
wins / losses against the flagship at the same ratio on the same instances; the uncompressed
score per task, with a note where it is near zero (< 0.1: the task carries no signal); and
writes ``--plot`` (score vs ratio, one line per method, averaged over the tasks with signal)
when matplotlib is installed (``pip install matplotlib``; not a dependency of kvcal).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/ruler_table.py \\
        --artifact out/kv_calibration.h5 --out out/ruler.jsonl [--length 4096] [--limit 25] \\
        [--tasks niah_single_1 ruler_vt] [--methods flagship snapkv] [--ratios 0.5 0.75] [--report]

Needs the ``lm-eval`` and ``kvpress`` extras in one environment (lm-eval 0.4.13 and kvpress 0.5.5
live together with transformers 5.2.x: ``pip install -e '.[lm-eval,kvpress]'``); ``--report``
needs neither.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cell_journal  # noqa: E402

# lm-eval 0.4.13's RULER tasks that build their data from the tokenizer alone (no download):
# niah_single_1's haystack is a repeated sentence, niah_multikey_2/3's are needles; niah_single_2/3,
# niah_multikey_1, niah_multivalue and niah_multiquery read Paul Graham's essays from the hub and
# qa_squad / qa_hotpot their datasets.
OFFLINE_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
KVPRESS_METHODS = ("compactor", "kvzip", "snapkv", "expected_attention", "keydiff", "adakv-expected_attention")
METHODS = ("uncompressed", "flagship", "artifact", *KVPRESS_METHODS)
REFERENCE = "flagship"
RATIOS = (0.5, 0.75, 0.9, 0.95)
NO_SIGNAL = 0.1  # an uncompressed mean score below this: the task carries no signal for this model


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON lines, one per finished (instance, method, ratio); resumed")
    parser.add_argument("--artifact", help="the kvcal artifact of the embedded model (needed by flagship and artifact)")
    parser.add_argument(
        "--instances", help="the saved task instances (default: --out with .instances.json); built when missing"
    )
    parser.add_argument("--length", type=int, default=4096, help="RULER's max_seq_lengths: the prompt length in tokens")
    parser.add_argument("--tasks", nargs="+", default=list(OFFLINE_TASKS), help=f"of {' '.join(OFFLINE_TASKS)}")
    parser.add_argument("--limit", type=int, default=None, help="the first N instances of each task")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"of {' '.join(METHODS)}")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS), help="fractions evicted, in (0, 1)")
    parser.add_argument(
        "--prompt", choices=("chat", "plain"), default="chat", help="kvpress's chat format or lm-eval's"
    )
    parser.add_argument("--report", action="store_true", help="print the table of --out and write --plot; run nothing")
    parser.add_argument("--plot", help="the PNG of --report (default: --out with .png)")
    parser.add_argument("--merge", nargs="+", default=[], help="--report: more journals (other processes' --out)")
    args = parser.parse_args(argv)
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; of {', '.join(METHODS)}")
    unknown = set(args.tasks) - set(OFFLINE_TASKS)
    if unknown:
        parser.error(f"--tasks: {sorted(unknown)} are not offline RULER tasks; of {', '.join(OFFLINE_TASKS)}")
    if any(not 0.0 < r < 1.0 for r in args.ratios):
        parser.error(f"--ratios must be in (0, 1), got {args.ratios}")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    if not args.report and {"flagship", "artifact"} & set(args.methods):
        if not args.artifact or not Path(args.artifact).is_file():
            parser.error(f"--artifact: the methods flagship and artifact need a calibration file, got {args.artifact}")
    out = Path(args.out)
    args.instances = Path(args.instances) if args.instances else out.with_suffix(".instances.json")
    args.plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    return args


# -- the journal (pure) --------------------------------------------------------------------------


def cell_key(record: dict) -> tuple[str, str, float]:
    return record["instance"], record["method"], float(record["ratio"])


def read_journal(path: Path, settings: dict | None) -> dict:
    """``(instance, method, ratio) -> record`` of an earlier run (:func:`cell_journal.read_journal`)."""
    return cell_journal.read_journal(path, settings, cell_key, "ruler_table")


def plan(instances: list[dict], methods, ratios, done: dict) -> list[tuple[dict, str, float]]:
    """The (instance, method, ratio) cells still to run, instance by instance (a run cut short has
    every method of the instances it reached); ``uncompressed`` runs once per instance, at ratio 0."""
    cells = []
    for instance in instances:
        for method in methods:
            for ratio in (0.0,) if method == "uncompressed" else ratios:
                if (instance["id"], method, float(ratio)) not in done:
                    cells.append((instance, method, float(ratio)))
    return cells


# -- the report (pure) ---------------------------------------------------------------------------


def summarise(records) -> dict:
    """``(task, method, ratio) -> {n, mean, low, high, wins, losses, paired}``: the mean score, its 95%
    Wilson interval (the summed score as successes of n) and, but for the flagship itself, paired
    wins / losses against the flagship at the same ratio on the instances both ran."""
    from common.formulas import wilson_interval

    scores = defaultdict(dict)  # (task, method, ratio) -> instance -> score
    for record in records:
        scores[(record["task"], record["method"], float(record["ratio"]))][record["instance"]] = record["score"]
    rows = {}
    for (task, method, ratio), outcome in sorted(scores.items()):
        n, total = len(outcome), sum(outcome.values())
        low, high = wilson_interval(total, n)
        row = {"n": n, "mean": total / n, "low": low, "high": high, "wins": None, "losses": None, "paired": 0}
        reference = scores.get((task, REFERENCE, ratio))
        if method != REFERENCE and method != "uncompressed" and reference:
            shared = [i for i in outcome if i in reference]
            row["wins"] = sum(outcome[i] > reference[i] for i in shared)
            row["losses"] = sum(outcome[i] < reference[i] for i in shared)
            row["paired"] = len(shared)
        rows[(task, method, ratio)] = row
    return rows


def no_signal_tasks(rows: dict) -> list[str]:
    """The tasks whose uncompressed mean score is below :data:`NO_SIGNAL`."""
    return sorted(
        task for (task, method, _), row in rows.items() if method == "uncompressed" and row["mean"] < NO_SIGNAL
    )


def table(rows: dict) -> str:
    lines = [f"{'task':<16} {'method':<25} {'ratio':>5} {'n':>3} {'score':>6}  {'95% Wilson':<12}  vs {REFERENCE} w/l"]
    order = {method: index for index, method in enumerate(METHODS)}
    quiet = set(no_signal_tasks(rows))
    keys = sorted(rows, key=lambda key: (key[0], key[2], order.get(key[1], len(order)), key[1]))
    for task, method, ratio in keys:
        row = rows[(task, method, ratio)]
        paired = f"{row['wins']}/{row['losses']} on {row['paired']}" if row["wins"] is not None else ""
        note = "  (no signal: uncompressed < 0.1)" if method == "uncompressed" and task in quiet else ""
        lines.append(
            f"{task:<16} {method:<25} {ratio:>5g} {row['n']:>3} {row['mean']:>6.3f}  "
            f"[{row['low']:.2f}, {row['high']:.2f}]  {paired}{note}"
        )
    lines.append("")
    lines.append("uncompressed per task:")
    for (task, method, _), row in sorted(rows.items()):
        if method == "uncompressed":
            verdict = "near zero: no signal" if task in quiet else "signal"
            lines.append(f"  {task:<16} {row['mean']:.3f} (n={row['n']}) {verdict}")
    return "\n".join(lines)


def curves(rows: dict) -> tuple[dict, list[str]]:
    """``task -> method -> [(ratio, mean)]`` for each task kept: those with signal (all tasks when none
    has) that some method ran compressed (a task run only uncompressed has nothing to compare); the
    uncompressed score at ratio 0 on each method's line (and a point of its own).  One panel per task:
    methods run on different tasks are never averaged into one line (the flagship over two tasks
    against a press over one would compare different things)."""
    quiet = set(no_signal_tasks(rows))
    tasks = sorted({task for task, _, _ in rows})
    kept = [task for task in tasks if task not in quiet] or tasks
    compressed = {task for task, method, _ in rows if method != "uncompressed"}
    kept = [task for task in kept if task in compressed] or kept
    panels = {}
    for task in kept:
        base = rows.get((task, "uncompressed", 0.0))
        start = [(0.0, base["mean"])] if base else []
        lines = {"uncompressed": start} if base else {}
        for (row_task, method, ratio), row in sorted(rows.items(), key=lambda item: item[0][2]):
            if row_task == task and method != "uncompressed":
                lines.setdefault(method, list(start)).append((ratio, row["mean"]))
        panels[task] = lines
    return panels, kept


def plot(rows: dict, path: Path, title: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib; kvcal does not depend on it)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels, kept = curves(rows)
    figure, all_axes = plt.subplots(1, len(kept), figsize=(6 * len(kept), 4.5), squeeze=False)
    order = {method: index for index, method in enumerate(METHODS)}
    styles = [("o", "-"), ("s", "--"), ("^", "-."), ("v", ":"), ("D", "-"), ("P", "--"), ("X", "-."), ("*", ":")]
    for axes, task in zip(all_axes[0], kept, strict=True):
        lines = panels[task]
        for method in sorted(lines, key=lambda m: (order.get(m, len(order)), m)):
            marker, style = styles[order.get(method, len(order)) % len(styles)]
            emphasis = {"color": "black", "linewidth": 2.5} if method == REFERENCE else {}
            xs, ys = [r for r, _ in lines[method]], [s for _, s in lines[method]]
            axes.plot(xs, ys, marker=marker, linestyle=style, label=method, alpha=0.85, **emphasis)
        axes.set_xlabel("compression ratio (fraction of the context's KV cache evicted)")
        axes.set_ylabel("mean RULER score")
        axes.set_ylim(-0.02, 1.02)
        axes.set_title(f"{title}\n{task}", fontsize=9)
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"plot: {path}"


# -- the instances (lm-eval) ---------------------------------------------------------------------


def split_prompt(text: str, doc: dict, prompt: str, tokenizer) -> tuple[list[int], list[int]]:
    """The context's and the question's token ids of one instance (module docstring)."""
    from runtime.lm_eval_model import question_split

    cut = question_split(doc["input"])
    if cut is None:
        raise ValueError(f"no RULER question line in {doc['input'][-200:]!r}")
    if prompt == "plain":  # lm-eval's request text: input + target_delimiter + gen_prefix
        if not text.startswith(doc["input"]):
            raise ValueError("lm-eval's request text does not start with the document's input")
        context, question = text[:cut], text[cut:]
        context_ids = list(tokenizer(context)["input_ids"])
    else:  # kvpress's KVPressTextGenerationPipeline.preprocess
        context, question = doc["input"][:cut], doc["input"][cut:]
        separator = "#" * (len(context) + 10)
        wrapped = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}], add_generation_prompt=True, tokenize=False
        )
        context, suffix = wrapped.split(separator)
        question = question + suffix + doc["gen_prefix"]
        context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, tokenizer.encode(question, add_special_tokens=False)


def build_instances(args, tokenizer, source: str) -> dict:
    """The instances of ``args.tasks`` as lm-eval builds them (module docstring)."""
    import random

    import lm_eval
    import numpy
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.tasks import TaskManager

    manager = TaskManager(metadata={"tokenizer": source, "max_seq_lengths": [args.length]})
    instances = []
    for name in args.tasks:
        # simple_evaluate's seeds before each task (the generators draw from the global random
        # state, unseeded two builds differ): a task's instances are those `lm_eval --tasks <task>`
        # builds, whichever split of the table builds them
        random.seed(DEFAULT_RANDOM_SEED)
        numpy.random.seed(DEFAULT_OTHER_SEED)
        torch.manual_seed(DEFAULT_OTHER_SEED)
        task = manager.load([name])["tasks"][name]
        task.build_all_requests(limit=args.limit, rank=0, world_size=1)
        function = task.config.process_results
        where = f"{function.__module__}:{function.__qualname__}"
        if _resolve(where) is not function:
            raise RuntimeError(f"{name}: its process_results {where} cannot be imported back")
        for request in task.instances:
            text, gen_kwargs = request.args
            context_ids, question_ids = split_prompt(text, request.doc, args.prompt, tokenizer)
            instances.append(
                {
                    "id": f"{name}/{request.doc_id}",
                    "task": name,
                    "doc": request.doc,
                    "context_ids": context_ids,
                    "question_ids": question_ids,
                    "max_gen_toks": int(gen_kwargs.get("max_gen_toks", 256)),
                    "until": list(gen_kwargs.get("until") or []),
                    "process_results": where,
                    "metric": str(request.doc["max_length"]),
                }
            )
    return {"lm_eval": lm_eval.__version__, "tokenizer": source, "instances": instances}


def _resolve(where: str):
    module, _, name = where.partition(":")
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def load_instances(args, tokenizer, source: str) -> list[dict]:
    """``args.tasks``' instances from ``--instances``; the tasks it lacks are built and added (a run of
    other tasks, another split of the table, extends the same file: one set of instances per table)."""
    wanted = {"length": args.length, "limit": args.limit, "prompt": args.prompt}
    saved = {"settings": wanted, "lm_eval": None, "tokenizer": source, "instances": []}
    if args.instances.exists():
        saved = json.loads(args.instances.read_text())
        if saved["settings"] != wanted:
            sys.exit(f"ruler_table: error: {args.instances} holds {saved['settings']}, not {wanted}")
    have = {instance["task"] for instance in saved["instances"]}
    missing = [task for task in args.tasks if task not in have]
    if missing:
        built = build_instances(argparse.Namespace(**{**vars(args), "tasks": missing}), tokenizer, source)
        saved = {**saved, "lm_eval": built["lm_eval"], "instances": saved["instances"] + built["instances"]}
        args.instances.parent.mkdir(parents=True, exist_ok=True)
        args.instances.write_text(json.dumps(saved))
    return [instance for instance in saved["instances"] if instance["task"] in args.tasks]


# -- the methods ---------------------------------------------------------------------------------


def kvpress_press(method: str, ratio: float):
    import kvpress

    if method == "adakv-expected_attention":  # kvpress's leaderboard's "expected_attention"
        return kvpress.AdaKVPress(kvpress.ExpectedAttentionPress(compression_ratio=ratio, epsilon=1e-2))
    press = {
        "compactor": kvpress.CompactorPress,
        "kvzip": kvpress.KVzipPress,
        "snapkv": kvpress.SnapKVPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "keydiff": kvpress.KeyDiffPress,
    }[method]
    return press(compression_ratio=ratio)


def run_cell(instance, method, ratio, pipe, model, tokenizer, calibration, policies) -> str:
    import torch

    from runtime import generate

    context, question = instance["context_ids"], instance["question_ids"]
    if method in ("flagship", "artifact"):
        ids = torch.tensor([context + question], dtype=torch.long)
        result = generate(
            model,
            ids,
            policies[(method, ratio)],
            context_columns=len(context),
            calibration=calibration,
            max_new_tokens=instance["max_gen_toks"],
            pad_token_id=tokenizer.eos_token_id,
        )
        return tokenizer.decode(result.new_tokens[0], skip_special_tokens=True)
    press = None if method == "uncompressed" else kvpress_press(method, ratio)
    inputs = {"context_ids": torch.tensor([context]), "questions_ids": [torch.tensor([question])]}
    (answer,) = pipe.forward(inputs, press=press, max_new_tokens=instance["max_gen_toks"], cache=None)
    return answer


def score(instance: dict, answer: str) -> float:
    """The task's own metric: its ``process_results`` on the document and the answer."""
    for stop in instance["until"]:  # lm-eval's convention (RULER's until is empty)
        answer = answer.split(stop)[0] if stop else answer
    return float(_resolve(instance["process_results"])(instance["doc"], [answer])[instance["metric"]])


def run(args) -> dict:
    import torch

    torch.set_num_threads(1)
    with warnings.catch_warnings():  # kvpress 0.5.5 -> fire 0.6 -> the standard library's deprecated pipes
        warnings.simplefilter("ignore", DeprecationWarning)
        import kvpress  # noqa: F401  (registers the pipeline)
    from tqdm import tqdm
    from transformers import pipeline

    from common.models import embedded_model_dir, load_model, load_tokenizer
    from runtime import load_calibration
    from runtime.plan.policy_spec import parse_policy
    from runtime.plan.recommendation import recommended_spec

    model, tokenizer = load_model(), load_tokenizer()
    instances = load_instances(args, tokenizer, str(embedded_model_dir()))
    calibration = load_calibration(model, tokenizer, path=args.artifact) if args.artifact else None
    policies, served = {}, {}
    for ratio in args.ratios:
        policies[("flagship", ratio)] = parse_policy("flagship").policy(ratio)
        if calibration is not None:
            policies[("artifact", ratio)] = calibration.policy(ratio)
            served[ratio] = recommended_spec(calibration, ratio).name
    settings = {
        "instances": str(args.instances.resolve()),
        "artifact": str(Path(args.artifact).resolve()) if args.artifact else None,
        "prompt": args.prompt,
        "length": args.length,
    }
    done = read_journal(Path(args.out), settings)
    cells = plan(instances, args.methods, args.ratios, done)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    print(f"{len(instances)} instances; {len(cells)} cells to run; {len(done)} resumed from {args.out}", flush=True)
    with Path(args.out).open("a") as out:
        for instance, method, ratio in tqdm(cells, desc="ruler", unit="cell"):
            same = method == "artifact" and policies[("artifact", ratio)] == policies[("flagship", ratio)]
            if same and (instance["id"], "flagship", ratio) in done:  # the artifact serves the flagship
                answer, seconds = done[(instance["id"], "flagship", ratio)]["answer"], 0.0
            else:
                started = time.perf_counter()
                with torch.no_grad():
                    answer = run_cell(instance, method, ratio, pipe, model, tokenizer, calibration, policies)
                seconds = round(time.perf_counter() - started, 3)
            record = {
                "instance": instance["id"],
                "task": instance["task"],
                "method": method,
                "ratio": ratio,
                "score": score(instance, answer),
                "answer": answer,
                "seconds": seconds,
                "context_tokens": len(instance["context_ids"]),
                "question_tokens": len(instance["question_ids"]),
            }
            if method == "artifact":
                record["policy"] = served[ratio]
                record["same_as_flagship"] = bool(same)
            out.write(json.dumps(record) + "\n")
            out.flush()
            done[cell_key(record)] = record
    return done


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        done = {}
        for path in [args.out, *args.merge]:
            done.update(read_journal(Path(path), None))
    else:
        done = run(args)
    rows = summarise(done.values())
    print(table(rows))
    print(plot(rows, args.plot, f"RULER (offline tasks), {Path(args.out).name}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
