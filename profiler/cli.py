"""``profile-model``: profile a model's attention heads once and write its calibration file."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys

from profiler.budget_tables import DEFAULT_BETA, DEFAULT_MIN_BUDGET, DEFAULT_RATIOS, DEFAULT_TOKEN_BUDGETS
from profiler.presets import PRESETS

DESCRIPTION = """\
Profile a model's attention heads once and write the calibration artifact that the KV-cache
eviction runtime loads (kv_calibration.h5). Stages:

  behaviour    run REAL needle probes; greedy-decode each; at every generated token record,
               per (layer, query head), which labelled context token (retrieval R, bias B,
               distraction D, widespread W) dominates that query's attention; accumulate
               W_R, W_B, W_D, W_W and derive RAsc, LCsc, INFsc.
  query-stats  run calibration text and accumulate the mean and covariance of the pre-RoPE
               queries of every (layer, query head) (Expected Attention statistics).
  budgets      per-KV-head budget tables for a grid of average budgets from INFsc (REAL).

Long runs checkpoint into <out>.work.npz; after Ctrl-C or a crash rerun the same command with
--resume. Multi-process: `accelerate launch [--cpu | --multi_gpu] --num_processes N -m
profiler.cli ...` (or torchrun) shards probes and calibration text over N processes and
reduces the sums exactly; the main process alone writes the file. Big models: one process
with --device-map auto spreads the layers over the visible GPUs.
"""

PRESET_HELP = "; ".join(
    f"{name}: needles '{p.probes}' probes"
    + "".join(f" {key}={','.join(map(str, value))}" for key, value in p.probe_overrides)
    + f", {p.max_new_tokens} new tokens, {p.calib_samples}x{p.calib_tokens} calibration tokens"
    for name, p in PRESETS.items())


def comma_separated(kind):
    """An argparse type: ``'a,b,c'`` -> a tuple of ``kind`` values (empty parts skipped)."""

    def parse(text: str):
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from exc
    return parse


def build_parser() -> argparse.ArgumentParser:
    from profiler.job import STAGES

    parser = argparse.ArgumentParser(prog="profile-model", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None,
                        help="model directory or hub id (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None,
                        help="output file (default: kv_calibration.h5 in the model directory when writable, "
                             "else in the current directory)")
    parser.add_argument("--preset", choices=list(PRESETS), default="quick", help=f"job size. {PRESET_HELP}")
    def stages(text: str) -> tuple[str, ...]:
        chosen = comma_separated(str)(text)
        unknown = [stage for stage in chosen if stage not in STAGES]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"unknown stage(s) {unknown}; choose from {','.join(STAGES)}")
        return chosen

    parser.add_argument("--stages", type=stages, default=STAGES,
                        help=f"comma-separated subset of {','.join(STAGES)} (default: all). Sections of an "
                             "existing artifact for the same model at --out are kept")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run from its work file")
    group = parser.add_argument_group("behaviour stage")
    group.add_argument("--probes", dest="probes_file", default=None,
                       help="JSON-lines probe file (from generate-probes) instead of the preset's needles probes")
    group.add_argument("--max-new-tokens", type=int, default=None, help="greedy decode steps per probe")
    group = parser.add_argument_group("query-stats stage")
    group.add_argument("--calib-dataset", default=None,
                       help="calibration text: local .txt/.md/.jsonl/.json files or directories (comma-separated), "
                            "or a datasets name[:config] (default: needles' built-in prose haystack)")
    group.add_argument("--calib-split", default="train", help="datasets split (default: train)")
    group.add_argument("--calib-field", default="text", help="text field of JSON records / datasets rows")
    group.add_argument("--calib-samples", type=int, default=None, help="number of calibration windows")
    group.add_argument("--calib-tokens", type=int, default=None, help="tokens per calibration window")
    group.add_argument("--batch-size", type=int, default=None, help="calibration windows per forward pass")
    group.add_argument("--n-sink", type=int, default=None, help="leading tokens of each window left out (default 4)")
    group = parser.add_argument_group("budgets stage")
    group.add_argument("--budgets", dest="token_budgets", type=comma_separated(int), default=DEFAULT_TOKEN_BUDGETS,
                       help=f"average token budgets per KV head (default: {','.join(map(str, DEFAULT_TOKEN_BUDGETS))})")
    group.add_argument("--ratios", type=comma_separated(float), default=DEFAULT_RATIOS,
                       help="average budgets as fractions of the sequence length (default: 0.1,...,0.9)")
    group.add_argument("--beta", type=float, default=DEFAULT_BETA, help="REAL's beta >= 1 (default 2)")
    group.add_argument("--min-budget", type=int, default=DEFAULT_MIN_BUDGET, help="smallest per-head budget")
    group = parser.add_argument_group("execution")
    group.add_argument("--device-map", default=None,
                       help='transformers device_map for loading (default: "auto" on a single GPU process, CPU otherwise)')
    group.add_argument("--checkpoint-every", type=int, default=4,
                       help="probes / calibration batches between work-file checkpoints (default 4)")
    group.add_argument("--seed", type=int, default=0, help="seed of the built-in calibration text")
    group.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _raise_keyboard_interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    from artifacts import ArtifactError
    from profiler.checkpoint import WorkFileMismatch
    from profiler.job import JobInterrupted, JobOptions, run_job
    from runtime.models import ModelNotFoundError

    args = build_parser().parse_args(argv)
    from profiler.distributed import relaunch_with_torchrun, requested_cpu_processes

    workers = requested_cpu_processes()
    if workers:
        # `accelerate launch --cpu --num_processes N` started only this process: start the N
        # gloo workers ourselves (see profiler.distributed).
        print(f"profile-model: starting {workers} CPU worker processes (gloo)", file=sys.stderr)
        return relaunch_with_torchrun(workers, list(sys.argv[1:] if argv is None else argv))
    options = JobOptions(
        model=args.model, out=args.out, preset=args.preset, stages=tuple(args.stages), resume=args.resume,
        probes_file=args.probes_file, max_new_tokens=args.max_new_tokens, calib_dataset=args.calib_dataset,
        calib_split=args.calib_split, calib_field=args.calib_field, calib_samples=args.calib_samples,
        calib_tokens=args.calib_tokens, batch_size=args.batch_size, n_sink=args.n_sink,
        token_budgets=args.token_budgets, ratios=args.ratios, beta=args.beta, min_budget=args.min_budget,
        checkpoint_every=args.checkpoint_every, device_map=args.device_map, seed=args.seed,
        progress=not args.no_progress)
    previous_handler = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `kill` stops like Ctrl-C
    try:
        run_job(options)
    except KeyboardInterrupt:  # while loading or writing: the last checkpoint (if any) is intact
        print("\nprofile-model: interrupted outside a profiling stage; rerun with --resume to continue "
              "from the last checkpoint, if there is one", file=sys.stderr)
        return 130
    except JobInterrupted as exc:
        argv_now = ["profile-model", *(sys.argv[1:] if argv is None else argv)]
        if "--resume" not in argv_now:
            argv_now.append("--resume")
        print(f"\nprofile-model: interrupted; progress is saved in {exc.work_path}.\n"
              f"Continue with:  {shlex.join(argv_now)}", file=sys.stderr)
        return 130
    except (ValueError, OSError, WorkFileMismatch, ModelNotFoundError, ArtifactError) as exc:
        print(f"profile-model: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
