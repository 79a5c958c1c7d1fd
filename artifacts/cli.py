"""``inspect-artifact PATH [--json] [--html OUT]``: validate a calibration file and summarise it."""

from __future__ import annotations

import json
import sys

from common.command_line import MAX_TOKENS, CommandParser, fail
from common.log import add_verbosity_arguments, configure, logger
from common.options import Integer, Option, OutputFile, Switch, Text, add_options, check_outputs
from common.version import add_version_argument

from .errors import ArtifactError
from .reader import open_artifact
from .summary import format_summary, summarize

EXIT_VALID, EXIT_INVALID = 0, 2
LOG = logger("artifacts")

# inspect-artifact's options, each declared once (common.options): the parser is built from them
OPTIONS = (
    # the reader checks the path (a missing or invalid file: exit 2, and {"valid": false} with --json)
    Option("path", "path", Text(metavar="PATH"), None, "the .h5 calibration file", required=True),
    Option(
        "--json",
        "json",
        Switch(),
        False,
        'print the summary as JSON instead of text; an invalid file prints {"valid": false, "error": ...} '
        "(and the reason on stderr, as without --json)",
    ),
    Option(
        "--html",
        "html",
        OutputFile(what="HTML report"),
        None,
        "also write a self-contained HTML report (heatmaps of the head scores, "
        "budgets, query statistics, moments) to OUT (never the artifact itself, nor a file that is not text)",
    ),
    Option(
        "--budget",
        "budget",
        Integer(1, MAX_TOKENS),
        256,
        "average per-head budget whose allocation the report draws (default 256; "
        "the nearest table in the artifact is used)",
        shown="TOKENS",
    ),
)


def build_parser() -> CommandParser:
    parser = CommandParser(
        prog="inspect-artifact",
        description="Validate a KV-cache calibration artifact (kv_calibration.h5) written by "
        "profile-model and print what it holds: the model it belongs to, when and how "
        "it was made, and key figures of each section. Every dataset is read and "
        "checked (checksums, shapes against the recorded architecture, finite values). "
        "Exit status: 0 valid, 2 invalid (the reason goes to stderr).",
    )
    add_version_argument(parser)
    add_verbosity_arguments(parser, "only warnings and errors (the summary is printed)")
    add_options(parser, OPTIONS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure(args)
    try:
        check_outputs(OPTIONS, args, inputs=[args.path])  # --html, before the artifact is read
    except OSError as exc:  # a refused --html (common.atomic.OutputError): not about validity
        if args.json:
            print(json.dumps({"valid": None, "error": str(exc)}, indent=2, sort_keys=True))
        return fail("inspect-artifact", exc)
    try:
        with open_artifact(args.path) as reader:
            summary = summarize(reader)
            if args.html:
                from .report import write_report

                write_report(args.html, reader, budget=args.budget)
                LOG.debug(f"inspect-artifact: wrote the HTML report {args.html}")
    except ArtifactError as exc:
        LOG.error(f"inspect-artifact: invalid artifact: {exc}")
        if args.json:  # a JSON consumer gets JSON either way
            print(json.dumps({"valid": False, "error": str(exc)}, indent=2, sort_keys=True))
        return EXIT_INVALID
    except OSError as exc:  # the report could not be written (common.atomic.OutputError): not about validity
        LOG.error(f"inspect-artifact: {exc}")
        if args.json:
            print(json.dumps({"valid": None, "error": str(exc)}, indent=2, sort_keys=True))
        return EXIT_INVALID
    text = json.dumps(summary, indent=2, sort_keys=True) if args.json else format_summary(summary)
    try:
        print(text)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    return EXIT_VALID


if __name__ == "__main__":
    sys.exit(main())
