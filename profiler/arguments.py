"""Argument types shared by the command-line tools.

Every value is checked where it is parsed, so a bad option is an argparse error (exit 2, with
the usage line) before any import of torch or any model work: a count must be at least 1 (0
used to mean "the preset's", silently), a fraction lies in its interval, a number is finite,
a list is not empty.
"""

from __future__ import annotations

import argparse
import math


def int_at_least(minimum: int):
    """An argparse type: an integer ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def number_in(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False):
    """An argparse type: a finite float in the interval from ``low`` to ``high`` (closed unless
    ``low_open`` / ``high_open``)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        inside = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
        if not math.isfinite(value) or not inside:
            raise argparse.ArgumentTypeError(f"expected a number in {interval}, got {text!r}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


def comma_separated(kind):
    """An argparse type: ``'a,b,c'`` -> a non-empty tuple of ``kind`` values (empty parts skipped)."""
    name = getattr(kind, "__name__", "")

    def parse(text: str):
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated {name} values, got none in {text!r}")
        values = []
        for part in parts:
            try:
                values.append(kind(part))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"{exc} (in {text!r})") from None
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"expected comma-separated {name} values, got {text!r}") from exc
        return tuple(values)

    return parse


class RenamedOption(argparse.Action):
    """An option that was renamed: using it is an error that names the new spelling (``message``)."""

    def __init__(self, option_strings, dest, message: str, **kwargs):
        self.message = message
        super().__init__(option_strings, dest, nargs=1, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.message}")
