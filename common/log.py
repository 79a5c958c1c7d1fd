"""The tools' messages through :mod:`logging`, and the command lines' ``-q`` / ``-v``.

One logger per package, children of ``kvcal``: ``kvcal.artifacts``, ``kvcal.needles``,
``kvcal.profiler``, ``kvcal.runtime`` (:func:`logger`).  A program that imports the packages
routes or silences them as any other library's (``logging.getLogger("kvcal").setLevel(...)``);
without a handler of its own, Python shows only warnings and errors.

A command line installs one handler on ``kvcal`` (:func:`configure`), which writes

* records marked as the command's output (``extra=OUTPUT``: the profiler's one-line stage
  summaries, what a run wrote, evaluate-artifact's table) to **stdout**, as they have always been;
* every other record (notes, warnings, the one-line error before exit 2) to **stderr**;

each as its bare message (the messages name their command themselves).  Levels shown: INFO
and above by default, WARNING and above with ``-q`` / ``--quiet`` (errors are never silenced),
DEBUG and above with ``-v`` / ``--verbose``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable

ROOT = "kvcal"
OUTPUT = {"kvcal_output": True}  # extra= of a record that is the command's output (stdout)


def logger(package: str) -> logging.Logger:
    """The logger of ``package`` (``"profiler"``, ``"runtime"``...): ``kvcal.<package>``."""
    return logging.getLogger(f"{ROOT}.{package}")


def output(package: str) -> Callable[[str], None]:
    """A function that logs its message to ``kvcal.<package>`` at INFO as a line of the command's
    output (stdout under a command line; ``-q`` hides it)."""
    return functools.partial(logger(package).info, extra=OUTPUT)


def add_verbosity_arguments(parser: argparse.ArgumentParser, quiet_help: str | None = None) -> None:
    """``-q`` / ``--quiet`` and ``-v`` / ``--verbose`` (exclusive), read by :func:`configure`."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-q", "--quiet", action="store_true", help=quiet_help or "only warnings and errors (no summaries, no notes)"
    )
    group.add_argument("-v", "--verbose", action="store_true", help="also debugging messages")


def level(args: argparse.Namespace) -> int:
    """The level ``-q`` / ``-v`` ask for (INFO without either)."""
    if getattr(args, "quiet", False):
        return logging.WARNING
    if getattr(args, "verbose", False):
        return logging.DEBUG
    return logging.INFO


class _CommandHandler(logging.Handler):
    """Output records to stdout, the rest to stderr: the streams as they are when a record is
    written (a test's captured streams, a closed pipe's replacement)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stdout if getattr(record, "kvcal_output", False) else sys.stderr
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except BrokenPipeError:  # the reader went away (e.g. `| head`): nothing more to say
            pass
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)


def configure(args: argparse.Namespace) -> logging.Logger:
    """Install the command lines' handler on ``kvcal`` (replacing one an earlier call installed,
    so that running several commands in one process does not repeat their lines) at the level
    ``args`` ask for; returns the ``kvcal`` logger."""
    root = logging.getLogger(ROOT)
    for handler in list(root.handlers):
        if isinstance(handler, _CommandHandler):
            root.removeHandler(handler)
    handler = _CommandHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(level(args))
    root.propagate = False  # a program's own root handler does not print the lines a second time
    return root
