"""``inspect-artifact PATH [--json]``: validate a calibration file and summarise it."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import ArtifactError
from .reader import open_artifact
from .summary import format_summary, summarize

EXIT_VALID, EXIT_INVALID = 0, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inspect-artifact",
        description="Validate a KV-cache calibration artifact (kv_calibration.h5) written by "
                    "profile-model and print what it holds: the model it belongs to, when and how "
                    "it was made, and key figures of each section. Every dataset is read and "
                    "checked (checksums, shapes against the recorded architecture, finite values). "
                    "Exit status: 0 valid, 2 invalid (the reason goes to stderr).",
    )
    parser.add_argument("path", help="the .h5 calibration file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with open_artifact(args.path) as reader:
            summary = summarize(reader)
    except ArtifactError as exc:
        print(f"inspect-artifact: invalid artifact: {exc}", file=sys.stderr)
        return EXIT_INVALID
    text = json.dumps(summary, indent=2, sort_keys=True) if args.json else format_summary(summary)
    try:
        print(text)
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
    return EXIT_VALID


if __name__ == "__main__":
    sys.exit(main())
