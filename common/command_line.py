"""The parser of every kvcal command (profile-model, evaluate-artifact, inspect-artifact,
generate-probes): one line per usage error, a suggestion for a near miss, help wrapped at spaces.

Part of the shared base (:mod:`common`), which every package imports and which imports none of
them.  Imports no torch.
"""

from __future__ import annotations

import argparse
import difflib
import math
import sys
import textwrap

# Bounds of the counts the commands take: far above any real run, far below what would exhaust
# memory or time before the first result.
MAX_TOKENS = 1 << 20  # a prompt, window or budget in tokens (the longest released contexts are 1M)
MAX_COUNT = 1 << 16  # probes, tasks, windows, decode steps, checkpoints
MAX_SEED = 2**32 - 1  # numpy's seed range


def int_at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an integer ``>= minimum`` (and ``<= maximum`` when given)."""
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer {bounds}, got {text!r}")
        return value

    parse.__name__ = f"integer {bounds}"
    return parse


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


def comma_separated(kind, distinct: bool = False):
    """An argparse type: ``'a,b,c'`` -> a non-empty tuple of ``kind`` values (empty parts skipped;
    ``distinct``: no value twice)."""
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
                raise argparse.ArgumentTypeError(f"{exc} (in {text!r})" if len(parts) > 1 else str(exc)) from None
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"expected comma-separated {name} values, got {text!r}") from exc
        if distinct and len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"expected distinct values, got {text!r}")
        return tuple(values)

    return parse


def did_you_mean(text: str, known) -> str:
    """``" (did you mean 'x'?)"`` for the known name closest to ``text``, else ``""``."""
    close = difflib.get_close_matches(text, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def choice_of(values, what: str = "value"):
    """An argparse type: one of ``values``; a near miss names the closest."""

    def parse(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}{did_you_mean(text, values)}; choose from {', '.join(values)}"
            )
        return text

    parse.__name__ = what
    return parse


class _Wrapping:
    """Wrap help at spaces only: argparse's default (``textwrap``) breaks a long word anywhere and
    a hyphenated one at its hyphen ("i|nf/leverage", "query-|stats")."""

    def _split_lines(self, text, width):
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]

    def _fill_text(self, text, width, indent):
        paragraphs = [" ".join(part.split()) for part in text.split("\n\n")]
        return "\n\n".join(
            textwrap.fill(
                part,
                width,
                initial_indent=indent,
                subsequent_indent=indent,
                break_long_words=False,
                break_on_hyphens=False,
            )
            for part in paragraphs
        )


class CommandHelpFormatter(_Wrapping, argparse.HelpFormatter):
    """Help text wrapped at spaces only (see :class:`_Wrapping`)."""


class RawDescriptionCommandHelpFormatter(_Wrapping, argparse.RawDescriptionHelpFormatter):
    """The same, with the description and epilog printed as written."""

    def _fill_text(self, text, width, indent):
        return argparse.RawDescriptionHelpFormatter._fill_text(self, text, width, indent)


class CommandParser(argparse.ArgumentParser):
    """The parser of every kvcal command: a usage error is one line on stderr, ``<prog>: error:
    <what> (see <prog> --help)``, exit 2 (argparse's default prints the whole usage first, 24
    lines for profile-model), an unknown option names the closest known one, and help is
    wrapped at spaces (:class:`CommandHelpFormatter`); options are never abbreviated."""

    def __init__(self, *args, raw_description: bool = False, **kwargs):
        kwargs.setdefault(
            "formatter_class", RawDescriptionCommandHelpFormatter if raw_description else CommandHelpFormatter
        )
        # no abbreviations: argparse takes --calib-token for --calib-tokens, and a mistyped flag for
        # another (a profile-model run went ahead on one); an unknown flag names the closest instead
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            unknown = message.removeprefix("unrecognized arguments: ").split()[0].split("=")[0]
            message += did_you_mean(unknown, [flag for flag in self._option_string_actions if flag.startswith("--")])
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


class RenamedOption(argparse.Action):
    """An option that was renamed: using it is an error that names the new spelling (``message``)."""

    def __init__(self, option_strings, dest, message: str, **kwargs):
        self.message = message
        super().__init__(option_strings, dest, nargs=1, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.message}")


def fail(prog: str, message: str) -> int:
    """Print a command's error as one line on stderr; the exit status 2."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2
