"""``profile-model``: profile a model's attention heads once and write its calibration file."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import textwrap

from artifacts.log import add_verbosity_arguments, configure, logger
from artifacts.version import add_version_argument
from profiler.arguments import (
    MAX_COUNT,
    CommandParser,
    check_attention_implementation,
    comma_separated,
    did_you_mean,
    fail,
    int_at_least,
)
from profiler.presets import PRESETS
from runtime.models import ATTENTION_HELP, AUTO_ATTENTION, DTYPE_CHOICES, DTYPE_HELP

DESCRIPTION_HEAD = """\
Profile a model's attention heads once and write the calibration artifact that the KV-cache
eviction runtime loads (kv_calibration.h5). Stages, each writing one section of the file:
"""

DESCRIPTION_TAIL = """
Long runs checkpoint into <out>.work.npz; after Ctrl-C or a crash rerun the same command with
--resume (a resume with another --dtype or --attn-implementation is refused). Multi-process:
`accelerate launch [--cpu | --multi_gpu] --num_processes N -m profiler.cli ...` (or torchrun)
shards probes and calibration text over N processes and reduces the sums exactly; the main
process alone writes the file. Big models: one process with --device-map auto spreads the
layers over the visible GPUs.
"""

PRESET_HELP = "; ".join(  # README.md: what each preset runs
    f"{name} {p.calib_samples}x{p.calib_tokens} tokens, {p.max_new_tokens} new" for name, p in PRESETS.items()
)


LOG = logger("profiler")


def _description() -> str:
    from profiler.stages import STAGES

    lines = [DESCRIPTION_HEAD]
    for stage in STAGES:  # one line each; README.md describes them in full
        lines.append(f"  {stage.name:<15}{textwrap.shorten(stage.summary, width=78, placeholder=' ...')}")
    return "\n".join(lines) + "\n" + DESCRIPTION_TAIL


def build_parser() -> argparse.ArgumentParser:
    """The job's own options here; the settings (JobOptions.settings) from the stages' declarations
    (``profiler.stages.option_groups``)."""
    from profiler.stages import STAGE_NAMES, STAGES, option_groups

    parser = CommandParser(
        prog="profile-model",
        usage="profile-model [MODEL] [--out OUT] [--preset PRESET] [--stages LIST] [--resume] [--force] [options]",
        description=_description(),
        raw_description=True,
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="model directory or hub id (default: the embedded SmolLM2-135M-Instruct)"
    )
    add_version_argument(parser)
    add_verbosity_arguments(parser, "only warnings and errors: no stage summaries, no progress bars")
    parser.add_argument(
        "--out",
        default=None,
        help="output file (default: kv_calibration.h5 next to the weights, else in kvcal's cache, where "
        "load_calibration looks)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an artifact of another model, or one that does not validate, at --out (never a file that "
        "is not a kvcal artifact)",
    )
    parser.add_argument(
        "--preset", choices=list(PRESETS), default="quick", help=f"job size (default quick). {PRESET_HELP}"
    )

    opt_in = [stage.name for stage in STAGES if not any(stage.on_by_default(preset) for preset in PRESETS.values())]

    def stages(text: str) -> tuple[str, ...]:
        chosen = comma_separated(str)(text)
        for stage in chosen:
            if stage not in STAGE_NAMES:
                raise argparse.ArgumentTypeError(
                    f"unknown stage {stage!r}{did_you_mean(stage, STAGE_NAMES)}; choose from {','.join(STAGE_NAMES)}"
                )
        if len(set(chosen)) != len(chosen):
            raise argparse.ArgumentTypeError(f"a stage named twice in {text!r}")
        return chosen

    parser.add_argument(
        "--stages",
        type=stages,
        default=None,
        metavar="LIST",
        help=f"comma-separated stages (above; default: all but {','.join(opt_in)}; recommendation from quick up); "
        "an existing artifact's other sections for the same model are kept",
    )
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run from its work file")
    for title, options in option_groups():
        group = parser.add_argument_group(title)
        for option in options:
            option.add_to(group)
    group = parser.add_argument_group("execution")
    group.add_argument(
        "--device-map",
        default=None,
        metavar="MAP",
        help='transformers device_map (default: "auto" on a single GPU process, CPU otherwise)',
    )
    group.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help=DTYPE_HELP + "; recorded")
    group.add_argument(
        "--attn-implementation",
        default=AUTO_ATTENTION,
        metavar="NAME",
        help=ATTENTION_HELP + "; recorded",
    )
    group.add_argument(
        "--checkpoint-every",
        type=int_at_least(1, MAX_COUNT),
        default=4,
        metavar="N",
        help="probes or calibration batches between work-file checkpoints (default 4)",
    )
    group.add_argument(
        "--no-progress", action="store_true", help="no progress bars (none either when stderr is no terminal)"
    )
    return parser


def _raise_keyboard_interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # before the job's imports (torch): --help and --version stay fast
    configure(args)
    try:
        check_attention_implementation(args.attn_implementation)
    except ValueError as exc:
        return fail("profile-model", exc)
    from artifacts import ArtifactError
    from profiler.checkpoint import WorkFileMismatch
    from profiler.distributed import relaunch_with_torchrun, requested_cpu_processes
    from profiler.job import JobInterrupted, JobOptions, run_job
    from profiler.stages import settings_options
    from runtime.models import ModelError, use_progress_bars

    workers = requested_cpu_processes()
    if workers:
        # `accelerate launch --cpu --num_processes N` started only this process: start the N
        # gloo workers ourselves (see profiler.distributed).
        LOG.info(f"profile-model: starting {workers} CPU worker processes (gloo)")
        return relaunch_with_torchrun(workers, list(sys.argv[1:] if argv is None else argv))
    options = JobOptions(
        model=args.model,
        out=args.out,
        preset=args.preset,
        stages=None if args.stages is None else tuple(args.stages),
        resume=args.resume,
        force=args.force,
        checkpoint_every=args.checkpoint_every,
        device_map=args.device_map,
        dtype=args.dtype,
        attn_implementation=args.attn_implementation,
        progress=use_progress_bars(args.no_progress or args.quiet),
        settings={option.dest: getattr(args, option.dest) for option in settings_options()},
    )
    previous_handler = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `kill` stops like Ctrl-C
    try:
        run_job(options)
    except KeyboardInterrupt:  # while loading or writing: the last checkpoint (if any) is intact
        LOG.error(
            "\nprofile-model: interrupted outside a profiling stage; rerun with --resume to continue "
            "from the last checkpoint, if there is one"
        )
        return 130
    except JobInterrupted as exc:
        argv_now = ["profile-model", *(sys.argv[1:] if argv is None else argv)]
        if "--resume" not in argv_now:
            argv_now.append("--resume")
        resume = shlex.join(argv_now)
        LOG.error(f"\nprofile-model: interrupted; progress is saved in {exc.work_path}.\nContinue with:  {resume}")
        return 130
    except (ValueError, OSError, WorkFileMismatch, ModelError, ArtifactError) as exc:
        return fail("profile-model", exc)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
