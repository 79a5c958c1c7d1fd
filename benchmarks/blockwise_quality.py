"""What the block-wise prefill changes in what is kept, on held-out tasks: the flagship with and without blocks.

``compress_prompt(..., block_size=B)`` (and ``generate``, ``answer``) prefills a long context in
blocks of ``B`` tokens and cuts every head back to the whole context's budget after each block
(KeyDiff, arXiv 2504.15364, Eq. 6), so the cache never holds more than the budgets plus one block.
That changes what is kept: a block's eviction ranks only the rows held so far, scored from the
queries and keys seen so far (the leverage sketch, Compactor's chunked attention over the blocks
fed), and a row evicted early never comes back, where the one-pass prefill ranks every row of the
context at once.  This measures the difference where it matters, on answers, paired.

On the held-out needle tasks the recommendation stage measures policies on (every family on both
haystacks, seeds the profiler never used, the quick preset's lengths and depths:
``profiler.held_out_tasks``), greedy, question-agnostic (the context compressed before the
question is read), per compression ratio (fraction evicted) the cells

* ``one-pass``: ``runtime.generate`` under the flagship (``inf/leverage+correction``, the
  artifact's budgets), the context prefilled at once (each layer cut right after its attention);
* ``block B``: the same with ``block_size=B`` for each ``--block-sizes`` B;
* ``baseline``: nothing evicted (once per task).

An answer is correct when it contains the ground truth (``needles.answer_is_correct``, as
evaluate-artifact scores).  The table: per cell n, accuracy, 95% Wilson interval, and paired wins /
losses against ``one-pass`` at the same ratio (a win: right where one-pass is wrong), with the
paired rule's upper 95% bound on the accuracy given up (``profiler.paired_decision.loss_bound``).
Each finished (task, cell, ratio) is appended to ``--out`` (JSON lines); a rerun with the same
settings resumes; ``--shard I/N`` runs every N-th task (a process per core, each its own ``--out``;
``--report`` reads several).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/blockwise_quality.py --artifact kv_calibration.h5 \\
        --out blockwise.jsonl [--block-sizes 256 512] [--ratios 0.75,0.9] [--shard 0/2] [--limit N]
    python benchmarks/blockwise_quality.py --artifact kv_calibration.h5 --out a.jsonl b.jsonl --report
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from kvpress_side_by_side import interleaved, read_journal  # noqa: E402
from kvpress_side_by_side import table as side_by_side_table  # noqa: E402

REFERENCE = "one-pass"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", required=True, help="the embedded model's artifact (the flagship's budgets)")
    parser.add_argument(
        "--out", required=True, nargs="+", help="JSON lines, one per finished (task, cell, ratio); resumed"
    )
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--ratios", default="0.75,0.9", help="compression ratios (fraction evicted)")
    parser.add_argument("--preset", default="quick", help="the profile preset whose held-out tasks run (quick)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N tasks (in the interleaved order)")
    parser.add_argument("--shard", default="0/1", help="INDEX/COUNT: run every COUNT-th task from INDEX")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="greedy answer length (evaluate-artifact's)")
    parser.add_argument("--report", action="store_true", help="print the table of every --out, run nothing")
    args = parser.parse_args(argv)
    try:
        args.ratios = tuple(float(r) for r in args.ratios.split(","))
    except ValueError:
        parser.error(f"--ratios: comma-separated numbers, got {args.ratios!r}")
    if not args.ratios or any(not 0.0 < r < 1.0 for r in args.ratios):
        parser.error(f"--ratios must be in (0, 1), got {args.ratios}")
    if not args.block_sizes or any(b < 1 for b in args.block_sizes):
        parser.error(f"--block-sizes must be positive, got {args.block_sizes}")
    if not Path(args.artifact).is_file():
        parser.error(f"--artifact {args.artifact}: no such file")
    if len(args.out) > 1 and not args.report:
        parser.error("several --out files only with --report")
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        parser.error(f"--shard: INDEX/COUNT with 0 <= INDEX < COUNT, got {args.shard!r}")
    args.shard = (int(index), int(count))
    return args


def table(done: dict, ratios, cells) -> str:
    return side_by_side_table(done, ratios, cells, reference=REFERENCE, bound=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    cells = (REFERENCE, *(f"block {b}" for b in args.block_sizes))
    if args.report:
        done = {}
        for path in args.out:
            done.update(read_journal(Path(path), None))
        print(table(done, args.ratios, cells))
        return 0
    import torch

    torch.set_num_threads(1)
    from common.models import load_model, load_tokenizer
    from needles import FAMILIES, answer_is_correct
    from profiler.held_out_tasks import HAYSTACKS
    from profiler.presets import PRESETS
    from profiler.stages.recommendation import recommendation_tasks
    from runtime import generate, load_calibration
    from runtime.plan.policy_spec import FLAGSHIP

    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    tasks = recommendation_tasks(
        PRESETS[args.preset],
        families=FAMILIES,
        haystacks=HAYSTACKS,
        count=1,
        model_context=int(getattr(model.config, "max_position_embeddings", 0) or 4096),
    )
    probes = tasks.probes(tokenizer)
    probes = interleaved(probes)
    if args.limit is not None:
        probes = probes[: args.limit]
    index, count = args.shard
    probes = probes[index::count]
    settings = {
        "artifact": Path(args.artifact).name,
        "tasks": tasks.describe(),
        "block_sizes": list(args.block_sizes),
        "ratios": list(args.ratios),
        "max_new_tokens": args.max_new_tokens,
    }
    journal = Path(args.out[0])
    done = read_journal(journal, settings)
    plan = [("baseline", None)] + [(cell, ratio) for ratio in args.ratios for cell in cells]
    print(f"{len(probes)} of {tasks.describe()}; {len(plan)} cells; {len(done)} results resumed from {journal}")
    with journal.open("a") as out:
        for number, probe in enumerate(probes):
            ids = torch.tensor([probe.input_ids], dtype=torch.long)
            for cell, ratio in plan:
                if (probe.id, cell, ratio) in done:
                    continue
                policy = None if ratio is None else FLAGSHIP.policy(ratio)
                block = int(cell.split()[1]) if cell.startswith("block ") else None
                started = time.perf_counter()
                result = generate(
                    model,
                    ids,
                    policy,
                    context_columns=probe.context_end,
                    calibration=calibration,
                    block_size=block,
                    max_new_tokens=args.max_new_tokens,
                    pad_token_id=tokenizer.eos_token_id,
                )
                text = tokenizer.decode(result.new_tokens[0], skip_special_tokens=True)
                record = {
                    "task": probe.id,
                    "family": probe.family,
                    "cell": cell,
                    "ratio": ratio,
                    "text": text,
                    "correct": bool(answer_is_correct(text, probe)),
                    "kept": None if result.report is None else int(result.report.lengths_after.sum()),
                    "seconds": round(time.perf_counter() - started, 3),
                }
                out.write(json.dumps(record) + "\n")
                out.flush()
                done[(probe.id, cell, ratio)] = record
            print(f"task {number + 1}/{len(probes)} {probe.id} done", flush=True)
    print(table(done, args.ratios, cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
