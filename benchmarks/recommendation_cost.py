"""What one held-out task of the recommendation stage costs, split into its parts.

    python benchmarks/recommendation_cost.py ARTIFACT [--candidates flagship,inf/leverage]
           [--tasks 4] [--unshared] [--threads 2]

Runs ``profiler.evaluation._run_probe`` (the stage's and evaluate-artifact's per-task work: one
prefill, every (candidate, compression ratio of the default grid) cell compressed from a copy, one
batched decode of the baseline and every cell) on ``--tasks`` retrieval / multi_key tasks at depth
50 of the quick preset (1K and 2K tokens), and prints per task the wall seconds of the prefill, the
batched decode and the rest (scoring, copies, eviction).  ``--unshared`` scores every cell for
itself instead of once per scorer (``CompressionPolicy.scores_key``), to measure that saving.
The default candidates: every recommendation candidate
(``profiler.evaluation_results.RECOMMENDATION_CANDIDATES``).
"""

from __future__ import annotations

import argparse
import time
import warnings


def main(argv=None) -> int:
    from profiler.evaluation_results import COMPRESSION_GRID, RECOMMENDATION_CANDIDATES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--candidates", default=",".join(RECOMMENDATION_CANDIDATES))
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--unshared", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import profiler.evaluation as evaluation
    from common.models import load_model, load_tokenizer
    from needles import PRESETS
    from profiler.held_out_tasks import held_out_tasks
    from profiler.presets import PRESETS as PROFILE_PRESETS
    from runtime import bind, load_calibration
    from runtime.plan.policy import CompressionPolicy
    from runtime.plan.policy_spec import parse_policy

    model, tokenizer = load_model(), load_tokenizer()
    calibration = load_calibration(model, tokenizer, path=args.artifact)
    base = PRESETS["quick"].replace(**dict(PROFILE_PRESETS["quick"].probe_overrides))
    tasks = held_out_tasks(
        base, families=("retrieval", "multi_key"), count=1, profiler_seed=0, model_context=8192, depths=(50.0,)
    )
    probes = tasks.probes(tokenizer)[: args.tasks]
    specs = [parse_policy(name) for name in args.candidates.split(",")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an artifact calibrated under another scorer warns; timing only
        cells = [((spec.name, r), bind(spec.policy(r), calibration, model)) for spec in specs for r in COMPRESSION_GRID]
    if args.unshared:
        CompressionPolicy.scores_key = lambda self: None  # every cell scores for itself
    decoded = []
    decode_together = evaluation.decode_together

    def timed_decode(*arguments, **options):
        texts, seconds = decode_together(*arguments, **options)
        decoded.append(seconds)
        return texts, seconds

    evaluation.decode_together = timed_decode
    recorder = evaluation.AttentionOutputRecorder(model)
    print(f"{len(cells)} cells + the baseline per task; {'unshared' if args.unshared else 'shared'} scoring")
    for probe in probes:
        started = time.perf_counter()
        records = evaluation._run_probe(model, tokenizer, probe, cells, calibration, recorder, False, 24)
        total = time.perf_counter() - started
        prefill = records[0]["prefill_seconds"]
        print(
            f"{probe.id} ({len(probe.input_ids)} tokens): {total:.1f} s = prefill {prefill:.2f} + decode "
            f"{decoded[-1]:.1f} + scoring, copies and eviction {total - prefill - decoded[-1]:.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
