"""kvpress's presses, kvcal's press in kvpress, and kvcal's own runtime, side by side (issue 29).

On the project's held-out needle tasks (``profiler.held_out_tasks``: every family on both
haystacks, seeds the profiler never used, as ``evaluate-artifact`` builds them), at each
compression ratio (fraction evicted), greedy, the same tasks and the same token ids in every cell:

* ``kvpress-compactor``: kvpress's ``CompactorPress(compression_ratio=r)`` (uniform per layer);
* ``kvpress-adakv``: kvpress's ``AdaKVPress(ExpectedAttentionPress(compression_ratio=r))`` (head-wise
  budgets from one ranking over a layer's heads; ``--adakv-inner`` puts another ScorerPress inside:
  kvpress's ExpectedAttentionPress alone already answered the needle wrong on the embedded model at
  0.5 on a task where ``KnormPress`` and ``AdaKVPress(KnormPress)`` answered it, so AdaKV's
  mechanism is not what fails there);
* ``kvcal-press``: :class:`runtime.kvpress_press.CalibratedPress` (the artifact's policy without the
  correction) through kvpress's pipeline;
* ``kvcal-runtime``: kvcal's runtime serving ``calibration.policy(r)`` (the flagship
  ``inf/leverage+correction`` where the artifact has no recommendation);
* ``kvcal-runtime-nocorr``: kvcal's runtime serving the same policy without the correction (what
  ``kvcal-press`` serves: the two keep the same rows, ``tests/test_kvpress_press.py``);
* ``baseline``: kvpress's pipeline without a press (once per task).

kvpress's cells run the pipeline's own prefill-with-press and greedy decoding
(``pipe.forward``) on the task's context ids and question ids as kvcal's prompt format splits
them (``probe.input_ids[:context_end]`` and the rest), so every cell sees the same tokens; kvcal's
runtime cells run ``runtime.generate(context_columns=context_end)``.  An answer is correct when it
contains the ground truth (``needles.answer_is_correct``, as evaluate-artifact scores).

Each finished (task, cell, ratio) is appended to ``--out`` (JSON lines) as it finishes; a rerun
with the same settings resumes from it (a run takes hours on a CPU: 126 quick tasks x 21 cells;
R-kvpress-side-by-side-check-2026-11-27).  The
table: per cell n, accuracy, 95% Wilson interval, and paired wins / losses against
``kvcal-runtime`` at the same ratio (a win: this cell right where the runtime is wrong).

The tasks run round-robin over (family, haystack), so a run cut short holds every family;
``--families`` keeps some, ``--shard I/N`` runs every N-th task (a process per core, each with its
own ``--out``; concatenate their records under one settings line and print with ``--report``).

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv-kvpress/bin/python benchmarks/kvpress_side_by_side.py \\
        --artifact out/kv_calibration.h5 --out out/kvpress_side_by_side.jsonl [--limit 3]
        [--families retrieval,multi_key,counting] [--shard 0/2] [--report]

Needs the ``kvpress`` extra (``make test-kvpress`` builds ``.venv-kvpress``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cell_journal  # noqa: E402

RATIOS = (0.5, 0.75, 0.9, 0.95)
CELLS = ("kvpress-compactor", "kvpress-adakv", "kvcal-press", "kvcal-runtime", "kvcal-runtime-nocorr")
REFERENCE = "kvcal-runtime"
ADAKV_INNER = {"expected_attention": "ExpectedAttentionPress", "snapkv": "SnapKVPress", "knorm": "KnormPress"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="the kvcal artifact of the embedded model")
    parser.add_argument("--out", required=True, help="JSON lines, one per finished (task, cell, ratio); resumed")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="compression ratios (fraction evicted)")
    parser.add_argument("--preset", default="quick", help="task lengths and depths: the needles preset (quick)")
    parser.add_argument("--count", type=int, default=1, help="tasks per (family, haystack, length, depth) cell")
    parser.add_argument(
        "--families",
        default=None,
        help="comma-separated needle families to keep (default: all; the embedded model answers retrieval, "
        "multi_key and counting uncompressed and few of the others, R-quick-profile-2026-11-25)",
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks (in the interleaved order)")
    parser.add_argument(
        "--shard",
        default="0/1",
        help="INDEX/COUNT: run every COUNT-th task from INDEX (one process per core, each its own --out; "
        "concatenate the journals' records under one settings line and --report)",
    )
    parser.add_argument(
        "--cells",
        default=",".join(CELLS),
        help=f"comma-separated cells to run (default all: {','.join(CELLS)}; the baseline runs with any)",
    )
    parser.add_argument("--report", action="store_true", help="print the table of --out's results, run nothing")
    parser.add_argument(
        "--adakv-inner",
        choices=sorted(ADAKV_INNER),
        default="expected_attention",
        help="the ScorerPress inside kvpress's AdaKVPress (default expected_attention)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24, help="greedy answer length (evaluate-artifact's)")
    args = parser.parse_args(argv)
    try:
        args.ratios = tuple(float(r) for r in args.ratios.split(","))
    except ValueError:
        parser.error(f"--ratios: comma-separated numbers, got {args.ratios!r}")
    if not args.ratios or any(not 0.0 < r < 1.0 for r in args.ratios):
        parser.error(f"--ratios must be in (0, 1), got {args.ratios}")
    if not Path(args.artifact).is_file():
        parser.error(f"--artifact {args.artifact}: no such file")
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be at least 1")
    args.cells = tuple(cell.strip() for cell in args.cells.split(",") if cell.strip())
    if not args.cells or set(args.cells) - set(CELLS):
        parser.error(f"--cells: some of {', '.join(CELLS)}, got {args.cells}")
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        parser.error(f"--shard: INDEX/COUNT with 0 <= INDEX < COUNT, got {args.shard!r}")
    args.shard = (int(index), int(count))
    return args


def interleaved(probes: list) -> list:
    """``probes`` round-robin over their (family, haystack) groups, each group in its own order: a
    run cut short (``--limit``, a kill) holds every family and haystack, not only the first ones."""
    groups = defaultdict(list)
    for probe in probes:
        groups[(probe.family, probe.meta.get("haystack"))].append(probe)
    order = []
    for depth in range(max(map(len, groups.values()), default=0)):
        order.extend(group[depth] for group in groups.values() if depth < len(group))
    return order


def read_journal(path: Path, settings: dict | None) -> dict:
    """``(task, cell, ratio) -> record`` of an earlier run (:func:`cell_journal.read_journal`)."""
    return cell_journal.read_journal(
        path, settings, lambda record: (record["task"], record["cell"], record["ratio"]), "kvpress_side_by_side"
    )


def build_tasks(preset: str, count: int, calibration, model, tokenizer):
    """The held-out tasks evaluate-artifact runs for this artifact (its profiler seed + the offset)."""
    from needles import FAMILIES, PRESETS
    from profiler.held_out_tasks import held_out_tasks

    spec = calibration.config.get("behaviour", {}).get("spec", {}) if isinstance(calibration.config, dict) else {}
    seed = spec.get("seed") if isinstance(spec.get("seed"), int) else None
    context = int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    tasks = held_out_tasks(
        PRESETS[preset], families=tuple(FAMILIES), count=count, profiler_seed=seed, model_context=context
    )
    return tasks, tasks.probes(tokenizer)


def kvpress_press(cell: str, ratio: float, calibration, adakv_inner: str):
    import kvpress

    from runtime.kvpress_press import CalibratedPress

    if cell == "kvpress-compactor":
        return kvpress.CompactorPress(compression_ratio=ratio)
    if cell == "kvpress-adakv":
        return kvpress.AdaKVPress(getattr(kvpress, ADAKV_INNER[adakv_inner])(compression_ratio=ratio))
    if cell == "kvcal-press":
        return CalibratedPress(calibration, compression_ratio=ratio)
    raise ValueError(cell)


def run_cell(cell, ratio, probe, pipe, model, tokenizer, calibration, args) -> str:
    import torch

    from runtime import generate
    from runtime.kvpress_press import policy_for_kvpress

    ids = torch.tensor([probe.input_ids], dtype=torch.long)  # [1, T]
    if cell in ("kvcal-runtime", "kvcal-runtime-nocorr"):
        policy = calibration.policy(ratio) if cell == "kvcal-runtime" else policy_for_kvpress(calibration, ratio)
        result = generate(
            model,
            ids,
            policy,
            context_columns=probe.context_end,
            calibration=calibration,
            max_new_tokens=args.max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )
        return tokenizer.decode(result.new_tokens[0], skip_special_tokens=True)
    press = None if cell == "baseline" else kvpress_press(cell, ratio, calibration, args.adakv_inner)
    inputs = {"context_ids": ids[:, : probe.context_end], "questions_ids": [ids[:, probe.context_end :]]}
    (answer,) = pipe.forward(inputs, press=press, max_new_tokens=args.max_new_tokens, cache=None)
    return answer


def table(done: dict, ratios, cells, reference: str = REFERENCE, bound: bool = False) -> str:
    """Per (cell, ratio) of ``done`` (the journal): n, accuracy, its 95% Wilson interval and the wins /
    losses paired against ``reference`` at the same ratio (with ``bound``, also the paired rule's upper
    95% bound on the accuracy given up, ``profiler.paired_decision.loss_bound``)."""
    from common.formulas import wilson_interval
    from profiler.paired_decision import loss_bound

    by_cell = defaultdict(dict)  # (cell, ratio) -> task -> correct
    for (task, cell, ratio), record in done.items():
        by_cell[(cell, ratio)][task] = record["correct"]
    paired_header = f"vs {reference}: wins/losses" + (" on n, bound on the accuracy given up" if bound else "")
    lines = [f"{'cell':<22} {'ratio':>5} {'n':>4} {'accuracy':>8}  {'95% interval':<13} {paired_header}"]
    for cell, ratio in [("baseline", None)] + [(c, r) for r in ratios for c in cells]:
        outcomes = by_cell.get((cell, ratio), {})
        n, right = len(outcomes), sum(outcomes.values())
        low, high = wilson_interval(right, n)
        paired = ""
        against = by_cell.get((reference, ratio), {}) if ratio is not None else {}
        if cell != reference and against:
            shared = [t for t in outcomes if t in against]
            wins = sum(outcomes[t] and not against[t] for t in shared)
            losses = sum(against[t] and not outcomes[t] for t in shared)
            paired = f"{wins}/{losses} on {len(shared)}"
            if bound:
                paired += f", bound {loss_bound(wins, losses, len(shared)):+.3f}"
        accuracy = f"{right / n:.3f}" if n else "-"
        label = "-" if ratio is None else f"{ratio:g}"
        lines.append(f"{cell:<22} {label:>5} {n:>4} {accuracy:>8}  [{low:.2f}, {high:.2f}]  {paired}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    with warnings.catch_warnings():  # kvpress 0.5.5 -> fire 0.6 -> the standard library's deprecated pipes
        warnings.simplefilter("ignore", DeprecationWarning)
        import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    from common.models import load_model, load_tokenizer
    from needles import answer_is_correct
    from runtime import load_calibration

    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    tasks, probes = build_tasks(args.preset, args.count, calibration, model, tokenizer)
    if args.families:
        wanted = {family.strip() for family in args.families.split(",") if family.strip()}
        unknown = wanted - {probe.family for probe in probes}
        if unknown:
            raise SystemExit(f"kvpress_side_by_side: error: --families: no task of {sorted(unknown)}")
        probes = [probe for probe in probes if probe.family in wanted]
    probes = interleaved(probes)
    if args.limit is not None:
        probes = probes[: args.limit]
    index, count = args.shard
    probes = probes[index::count]
    settings = {
        "artifact": str(Path(args.artifact).resolve()),
        "tasks": tasks.describe(),
        "families": args.families,
        "ratios": list(args.ratios),
        "max_new_tokens": args.max_new_tokens,
        "adakv_inner": args.adakv_inner,
    }
    journal = Path(args.out)
    done = read_journal(journal, settings)
    if args.report:
        print(table(done, args.ratios, args.cells))
        return 0
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    plan = [("baseline", None)] + [(cell, ratio) for ratio in args.ratios for cell in args.cells]
    print(f"{len(probes)} of {tasks.describe()}; {len(plan)} cells; {len(done)} results resumed from {journal}")
    with journal.open("a") as out:
        for index, probe in enumerate(probes):
            for cell, ratio in plan:
                if (probe.id, cell, ratio) in done:
                    continue
                started = time.perf_counter()
                with torch.no_grad():
                    text = run_cell(cell, ratio, probe, pipe, model, tokenizer, calibration, args)
                record = {
                    "task": probe.id,
                    "family": probe.family,
                    "cell": cell,
                    "ratio": ratio,
                    "text": text,
                    "correct": bool(answer_is_correct(text, probe)),
                    "seconds": round(time.perf_counter() - started, 3),
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                done[(probe.id, cell, ratio)] = record
            print(f"task {index + 1}/{len(probes)} {probe.id} done", flush=True)
    print(table(done, args.ratios, args.cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
