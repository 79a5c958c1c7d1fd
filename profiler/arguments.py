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
