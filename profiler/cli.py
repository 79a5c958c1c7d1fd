"""``profile-model``: profile a model's attention heads once and write its calibration file."""

from __future__ import annotations

import argparse
import functools
import shlex
import signal
import sys
import textwrap

from common.command_line import MAX_COUNT, CommandParser, fail
from common.log import add_verbosity_arguments, configure, logger
from common.models import ATTENTION_HELP, AUTO_ATTENTION, DTYPE_CHOICES, DTYPE_HELP
from common.options import Choice, Integer, ListOf, Option, Switch, Text, add_options, check_given
from common.version import add_version_argument
from profiler.arguments import check_attention_implementation
from profiler.presets import PRESETS

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


@functools.cache
def job_options() -> tuple[tuple[Option, ...], tuple[Option, ...]]:
    """The job's own options (:mod:`common.options`): those of the run, and those of its execution
    (the settings, ``JobOptions.settings``, are the stages' declarations)."""
    from profiler.stages import STAGE_NAMES, STAGES

    opt_in = [stage.name for stage in STAGES if not any(stage.on_by_default(preset) for preset in PRESETS.values())]
    run = (
        Option(
            "model", "model", Text(), None, "model directory or hub id (default: the embedded SmolLM2-135M-Instruct)"
        ),
        Option(
            "--out",
            "out",
            Text(metavar="OUT"),  # the job checks it (an artifact: validated, of this model, or --force)
            None,
            "output file (default: kv_calibration.h5 next to the weights, else in kvcal's cache, where "
            "load_calibration looks)",
        ),
        Option(
            "--force",
            "force",
            Switch(),
            False,
            "replace an artifact of another model, or one that does not validate, at --out (never a file that "
            "is not a kvcal artifact)",
        ),
        Option(
            "--preset",
            "preset",
            Choice(tuple(PRESETS)),
            "quick",
            f"job size (default quick). {PRESET_HELP}",
            shown="{" + ",".join(PRESETS) + "}",
        ),
        Option(
            "--stages",
            "stages",
            ListOf(Choice(STAGE_NAMES, what="stage"), distinct=True),
            None,
            f"comma-separated stages (above; default: all but {','.join(opt_in)}; recommendation from quick up); "
            "an existing artifact's other sections for the same model are kept",
        ),
        Option("--resume", "resume", Switch(), False, "continue an interrupted run from its work file"),
    )
    execution = (
        Option(
            "--device-map",
            "device_map",
            Text(metavar="MAP"),
            None,
            'transformers device_map (default: "auto" on a single GPU process, CPU otherwise)',
        ),
        Option(
            "--dtype",
            "dtype",
            Choice(DTYPE_CHOICES),
            None,
            DTYPE_HELP + "; recorded",
            shown="{" + ",".join(DTYPE_CHOICES) + "}",
        ),
        Option(
            "--attn-implementation",
            "attn_implementation",
            Text(metavar="NAME"),
            AUTO_ATTENTION,
            ATTENTION_HELP + "; recorded",
            check=check_attention_implementation,
        ),
        Option(
            "--checkpoint-every",
            "checkpoint_every",
            Integer(1, MAX_COUNT),
            4,
            "probes or calibration batches between work-file checkpoints (default 4)",
        ),
        Option(
            "--no-progress",
            "no_progress",
            Switch(),
            False,
            "no progress bars (none either when stderr is no terminal)",
        ),
    )
    return run, execution


def build_parser() -> argparse.ArgumentParser:
    """The job's own options (:func:`job_options`); the settings (JobOptions.settings) from the stages'
    declarations (``profiler.stages.option_groups``)."""
    from profiler.stages import option_groups

    parser = CommandParser(
        prog="profile-model",
        usage="profile-model [MODEL] [--out OUT] [--preset PRESET] [--stages LIST] [--resume] [--force] [options]",
        description=_description(),
        raw_description=True,
    )
    run, execution = job_options()
    add_version_argument(parser)
    add_verbosity_arguments(parser, "only warnings and errors: no stage summaries, no progress bars")
    add_options(parser, run)
    for title, options in option_groups():
        group = parser.add_argument_group(title)
        for option in options:
            option.add_to(group)
    add_options(parser.add_argument_group("execution"), execution)
    return parser


def _raise_keyboard_interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # before the job's imports (torch): --help and --version stay fast
    configure(args)
    try:
        check_given([option for options in job_options() for option in options], args)  # --attn-implementation
    except ValueError as exc:
        return fail("profile-model", exc)
    from artifacts import ArtifactError
    from common.models import ModelError, use_progress_bars
    from profiler.checkpoint import WorkFileMismatch
    from profiler.distributed import relaunch_with_torchrun, requested_cpu_processes
    from profiler.job import JobInterrupted, JobOptions, run_job
    from profiler.stages import settings_options

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
