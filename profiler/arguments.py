"""Argument types shared by the command-line tools."""

from __future__ import annotations

import argparse


def comma_separated(kind):
    """An argparse type: ``'a,b,c'`` -> a tuple of ``kind`` values (empty parts skipped)."""

    def parse(text: str):
        try:
            return tuple(kind(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__} values, got {text!r}") from exc

    return parse


class RenamedOption(argparse.Action):
    """An option that was renamed: using it is an error that names the new spelling (``message``)."""

    def __init__(self, option_strings, dest, message: str, **kwargs):
        self.message = message
        super().__init__(option_strings, dest, nargs=1, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.message}")
