"""Every command's options, each declared once: its flag, its ``dest``, its kind (what values it
takes), its default and its help (issue 30: one place where each command declares its options).

From one :class:`Option` come both the ``argparse`` argument (the text is parsed and checked
where it is read, so a bad value is a usage error, exit 2, before torch is imported) and the
check of a value given in code (:meth:`Option.resolve`, a ``ValueError`` naming the option).
profile-model's stages declare their settings (:attr:`profiler.stages.base.Stage.options`,
``JobOptions.settings``); evaluate-artifact (``profiler.evaluate_cli.OPTIONS``), inspect-artifact
(``artifacts.cli.OPTIONS``) and generate-probes (``needles.cli.OPTIONS``) declare theirs as a
list, from which :func:`add_options` builds the parser; :func:`check_given` runs each given
value's further check (:attr:`Option.check`) and :func:`check_outputs` applies
``common.atomic.check_output_path``'s rules to every :class:`OutputFile` option, before any
model work.

Part of the shared base (:mod:`common`), beside :mod:`common.command_line`.  Imports no torch:
every ``--help`` builds its parser from these declarations.
"""

from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from common.command_line import RenamedOption, choice_of, comma_separated, did_you_mean, int_at_least, number_in


class Kind:
    """What values an option takes: ``parse`` reads (and checks) command-line text, ``accepts``
    checks a value given in code, ``description`` says what is expected."""

    choices: tuple | None = None
    description: str = "a value"

    def parse(self, text: str) -> Any:
        return text

    def accepts(self, value) -> bool:
        return True


@dataclass(frozen=True)
class Integer(Kind):
    """An integer from ``minimum`` to ``maximum``: every count is bounded, so that a mistyped
    100000000 is refused at once instead of running for minutes (``common.command_line.MAX_*``)."""

    minimum: int
    maximum: int

    @property
    def description(self) -> str:
        return f"an integer in [{self.minimum}, {self.maximum}]"

    @property
    def parse(self) -> Callable[[str], int]:
        return int_at_least(self.minimum, self.maximum)

    def accepts(self, value) -> bool:
        integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return integral and self.minimum <= value <= self.maximum


@dataclass(frozen=True)
class Number(Kind):
    """A finite number from ``low`` to ``high`` (the ends included unless ``low_open`` / ``high_open``)."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    @property
    def description(self) -> str:
        return f"a finite number in {self.parse.__name__.removeprefix('number in ')}"

    @property
    def parse(self) -> Callable[[str], float]:
        return number_in(self.low, self.high, low_open=self.low_open, high_open=self.high_open)

    def accepts(self, value) -> bool:
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below


@dataclass(frozen=True)
class Choice(Kind):
    """One of ``values``; ``what`` names a value in the error ("unknown family 'nope' (did you mean
    ...)"), else argparse's "invalid choice"."""

    values: tuple[str, ...]
    what: str = ""

    @property
    def choices(self) -> tuple[str, ...]:
        return self.values

    @property
    def description(self) -> str:
        return "one of " + ", ".join(self.values)

    def parse(self, text: str) -> str:
        if self.what:
            return choice_of(self.values, self.what)(text)
        if text not in self.values:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r}{did_you_mean(text, self.values)} (choose from {', '.join(self.values)})"
            )
        return text

    def accepts(self, value) -> bool:
        return value in self.values


@dataclass(frozen=True)
class Text(Kind):
    """A non-empty string (an empty ``--calib-field=`` is a mistake, not a value)."""

    description: str = "a non-empty string"
    metavar: str = "TEXT"

    def parse(self, text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected {self.description}, got {text!r}")
        return text

    def accepts(self, value) -> bool:
        return isinstance(value, str) and bool(value.strip())


@dataclass(frozen=True)
class ListOf(Kind):
    """A non-empty list of ``item`` values, written comma-separated on the command line
    (``distinct``: no value twice)."""

    item: Kind
    distinct: bool = False

    @property
    def description(self) -> str:
        return f"a non-empty list of {'distinct ' if self.distinct else ''}values, each {self.item.description}"

    def parse(self, text: str) -> tuple:
        values = comma_separated(self.item.parse)(text)
        if self.distinct and len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"expected distinct values, got {text!r}")
        return values

    def accepts(self, value) -> bool:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
            return False
        if self.distinct and len(set(value)) != len(value):
            return False
        return all(self.item.accepts(item) for item in value)


@dataclass(frozen=True)
class Switch(Kind):
    """An option that takes no value: given, it is True (``argparse``'s ``store_true``)."""

    description: str = "True or False"

    def accepts(self, value) -> bool:
        return isinstance(value, bool)


@dataclass(frozen=True)
class OutputFile(Text):
    """A file the command writes (``what``: "HTML report", "probe file"): a non-empty path that
    :func:`check_outputs` checks by ``common.atomic.check_output_path``'s rules before any work
    (not a directory, not an input of the command, even through a link; a ``text`` output replaces
    only a text file unless ``--force``; its directory writable)."""

    what: str = "output"
    text: bool = True
    description: str = "a file path"
    metavar: str = "OUT"


@dataclass(frozen=True)
class Option:
    """One setting: ``--flag`` on the command line, ``dest`` in ``JobOptions.settings``.

    ``flag``: ``--name``, or a positional argument's name (no dashes; then ``dest`` is the same).
    ``default``: the value when the setting is not given (None in the settings), or a function
    of the preset (``profiler.presets.ProfilePreset``) for "the preset's".  ``check``: a
    further check of a given value (raises ``ValueError``), run when the job is made
    (profile-model) or by :func:`check_given` after parsing (may import heavier modules, such as
    transformers, that ``--help`` must not).  ``required``: must be given.  ``shown``: what
    ``--help`` shows after the flag, when not :attr:`metavar`'s choice.
    """

    flag: str
    dest: str
    kind: Kind
    default: Any
    help: str
    check: Callable[[Any], None] | None = None
    required: bool = False
    shown: str | None = None

    @property
    def positional(self) -> bool:
        return not self.flag.startswith("-")

    def add_to(self, group, default=None) -> None:
        """Add the ``argparse`` argument; ``default`` its value when not given (profile-model: None,
        "not given", resolved by :meth:`resolve`; the other commands: :attr:`default`)."""
        kind = self.kind
        if isinstance(kind, Switch):
            group.add_argument(self.flag, dest=self.dest, action="store_true", help=self.help)
            return
        if self.positional:
            nargs = None if self.required else "?"
            group.add_argument(self.flag, nargs=nargs, type=kind.parse, default=default, help=self.help)
            return
        # a Choice checks its value in its own parse (one line with a suggestion, not argparse's list)
        group.add_argument(
            self.flag,
            dest=self.dest,
            type=kind.parse,
            default=default,
            metavar=self.metavar,
            help=self.help,
            **({"required": True} if self.required else {}),
        )

    @property
    def metavar(self) -> str:
        """What ``--help`` shows after the flag: the choices when few, else N (an integer), X (a number),
        LIST (comma-separated) or the flag's name."""
        if self.shown is not None:
            return self.shown
        kind = self.kind
        choices = kind.choices or getattr(getattr(kind, "item", None), "choices", None)
        if choices and len(choices) <= 4:
            return "{" + ",".join(choices) + "}"
        if isinstance(kind, ListOf):
            return "LIST"
        if isinstance(kind, Integer | Number):
            return "N" if isinstance(kind, Integer) else "X"
        return getattr(kind, "metavar", None) or self.flag.removeprefix("--").replace("-", "_").upper()

    def resolve(self, value, preset):
        """The setting's value: ``value`` checked, or the default when it is None."""
        if value is None:
            return self.default(preset) if callable(self.default) else self.default
        if not self.kind.accepts(value):
            raise ValueError(f"{self.dest} ({self.flag}) must be {self.kind.description}, got {value!r}")
        if self.check is not None:
            self.check(value)
        return value


@dataclass(frozen=True)
class Renamed:
    """An option that was renamed: using it is a usage error naming the new spelling."""

    flag: str
    message: str

    def add_to(self, group) -> None:
        group.add_argument(self.flag, action=RenamedOption, message=self.message)


def resolve_settings(options: Sequence[Option], settings: Mapping[str, Any], preset) -> Mapping[str, Any]:
    """Every option's value (read-only), from ``settings`` (by ``dest``; None or missing: the default).
    A name that no option declares is refused: a misspelt setting must not be silently ignored."""
    known = {option.dest for option in options}
    unknown = sorted(name for name in settings if name not in known)
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(unknown)}; the settings are {', '.join(sorted(known))}")
    return MappingProxyType({option.dest: option.resolve(settings.get(option.dest), preset) for option in options})


def add_options(parser, options: Sequence[Option | Renamed]) -> None:
    """Add every option's argument to ``parser``, each with its :attr:`Option.default` (a command
    without presets: the default is a value, not a function of one)."""
    for option in options:
        if isinstance(option, Renamed):
            option.add_to(parser)
        else:
            option.add_to(parser, default=option.default)


def check_given(options: Sequence[Option | Renamed], args) -> None:
    """Each given option's further check (:attr:`Option.check`), after parsing and before any model
    work: ``ValueError`` naming the first that fails.  A value equal to the default is checked too."""
    for option in options:
        if isinstance(option, Option) and option.check is not None:
            value = getattr(args, option.dest)
            if value is not None:
                option.check(value)


def check_outputs(
    options: Sequence[Option | Renamed], args, inputs=(), force: bool = False, also: Sequence[tuple] = ()
) -> None:
    """Every :class:`OutputFile` option given, by ``common.atomic.check_output_path``'s rules
    (``inputs``: the files the command reads, which no output may replace), and no two outputs
    naming one file: ``OutputError`` (an ``OSError``) or ``ValueError`` before anything is written.

    ``also``: the other files the command writes, ``(name, path, what)`` each, or ``(name, path,
    what, atomic)`` (evaluate-artifact's journal ``OUT.partial.jsonl``, written through a temporary
    file, and lock ``OUT.lock``, opened in place: ``atomic`` False): checked the same way (never an
    input, even through a link or with ``force``; not another output; names that fit the file
    system), their kind left to the command."""
    import os

    from common.atomic import check_output_path

    outputs = [
        (option.flag, getattr(args, option.dest), option.kind.what, option.kind.text, True)
        for option in options
        if isinstance(option, Option) and isinstance(option.kind, OutputFile) and getattr(args, option.dest)
    ]
    outputs += [(entry[0], entry[1], entry[2], False, entry[3] if len(entry) > 3 else True) for entry in also]
    seen: dict[str, str] = {}
    for name, path, what, text, atomic in outputs:
        real = os.path.realpath(path)
        if real in seen:
            raise ValueError(f"{seen[real]} and {name} name the same file {path}: give each its own")
        seen[real] = name
        check_output_path(path, what, inputs=inputs, text=text, force=force, atomic=atomic)
