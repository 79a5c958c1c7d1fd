"""Uncompressed greedy success rate of a model on needle probes, per family.

This is the sanity check that the probes are well-formed (a model that reads the whole
context should answer them) and the baseline that compressed runs are compared with.

    .venv/bin/python benchmarks/needles_success.py                      # quick preset, all families
    .venv/bin/python benchmarks/needles_success.py --families retrieval --preset quick
    .venv/bin/python benchmarks/needles_success.py --model ./other-model --haystack prose --json out.json

Default model: the embedded SmolLM2-135M-Instruct (CPU, float32).  Prints one line per probe
and a per-family table; ``--json`` also writes the table and the per-probe answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

from tqdm import tqdm

from needles import PRESETS, answer_is_correct, generate_probes, greedy_answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    parser.add_argument("--model", default=None, help="model directory or hub id (default: embedded)")
    parser.add_argument("--families", default=None, help="comma-separated families (default: the preset's)")
    parser.add_argument("--haystack", default=None, help="haystack source (default: the preset's, simple)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--json", default=None, help="write results to this JSON file")
    args = parser.parse_args(argv)

    from common.models import load_model, load_tokenizer

    spec = PRESETS[args.preset].replace(seed=args.seed)
    if args.families:
        spec = spec.replace(families=tuple(f.strip() for f in args.families.split(",")))
    if args.haystack:
        spec = spec.replace(haystack=args.haystack)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    probes = list(generate_probes(spec, tokenizer))

    records = []
    started = time.perf_counter()
    for probe in tqdm(probes, desc="answering", unit="probe", file=sys.stderr):
        tick = time.perf_counter()
        text = greedy_answer(model, tokenizer, probe, max_new_tokens=args.max_new_tokens)
        ok = answer_is_correct(text, probe)
        records.append(
            {
                "id": probe.id,
                "family": probe.family,
                "length": probe.length,
                "depth": probe.depth,
                "tokens": len(probe.input_ids),
                "answer": probe.answer,
                "generated": text,
                "correct": ok,
                "seconds": round(time.perf_counter() - tick, 2),
            }
        )
        tqdm.write(f"{'OK ' if ok else 'BAD'} {probe.id:<40} {probe.answer!r:<28} -> {text.strip()!r}", file=sys.stderr)

    by_family: dict[str, list[bool]] = defaultdict(list)
    for record in records:
        by_family[record["family"]].append(record["correct"])
    table = {family: {"correct": sum(v), "total": len(v), "rate": sum(v) / len(v)} for family, v in by_family.items()}
    total = sum(r["correct"] for r in records)
    print(
        f"preset={args.preset} haystack={spec.haystack} seed={spec.seed} model={args.model or 'embedded'} "
        f"max_new_tokens={args.max_new_tokens} ({time.perf_counter() - started:.0f} s)"
    )
    print(f"{'family':<20}{'correct':>8}{'total':>7}{'rate':>8}")
    for family, row in table.items():
        print(f"{family:<20}{row['correct']:>8}{row['total']:>7}{row['rate']:>8.0%}")
    print(f"{'all':<20}{total:>8}{len(records):>7}{total / max(1, len(records)):>8.0%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"spec": spec.to_dict(), "families": table, "probes": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
