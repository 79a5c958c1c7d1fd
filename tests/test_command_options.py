"""Every command declares its options once (common.options, issue 30): its parser is built from
the declarations, so each flag it accepts is a declared :class:`Option` (or a renamed one), and the
outputs follow one rule (:func:`common.options.check_outputs`)."""

from __future__ import annotations

import argparse
import importlib

import pytest
from conftest import COMMAND_MODULES

from common.atomic import OutputError
from common.options import Integer, Option, OutputFile, Renamed, Switch, Text, add_options, check_outputs

# the flags every command shares, declared once elsewhere: help, common.version, common.log
SHARED_FLAGS = {"-h", "--help", "--version", "-q", "--quiet", "-v", "--verbose"}


def _declared(command: str) -> list:
    if command == "profile-model":
        from profiler.cli import job_options
        from profiler.stages import option_groups

        run, execution = job_options()
        return [*run, *execution, *(option for _, options in option_groups() for option in options)]
    if command == "evaluate-artifact":
        from profiler.evaluate_cli import options

        return list(options())
    module = {"inspect-artifact": "artifacts.cli", "generate-probes": "needles.cli"}[command]
    return list(importlib.import_module(module).OPTIONS)


MAINS = COMMAND_MODULES


@pytest.mark.parametrize("command", MAINS)
def test_every_flag_of_a_command_is_a_declared_option(command):
    parser = importlib.import_module(MAINS[command]).build_parser()
    declared = _declared(command)
    flags = {option.flag for option in declared if not getattr(option, "positional", False)}
    positionals = {option.flag for option in declared if getattr(option, "positional", False)}
    parsed_flags = {flag for action in parser._actions for flag in action.option_strings}
    parsed_positionals = {action.dest for action in parser._actions if not action.option_strings}
    assert parsed_flags - SHARED_FLAGS == flags
    assert parsed_positionals == positionals
    # each declared option's default is what the parser gives when it is not on the command line
    required = [f"{o.flag}=x.jsonl" for o in declared if isinstance(o, Option) and o.required and not o.positional]
    positional_values = ["x.h5"] if command == "inspect-artifact" else []
    args = parser.parse_args([*positional_values, *required])
    for option in declared:
        if isinstance(option, Option) and not option.required and command != "profile-model":
            assert getattr(args, option.dest) == option.default, option.flag


def _parser(*options) -> argparse.ArgumentParser:
    from common.command_line import CommandParser

    parser = CommandParser(prog="demo")
    add_options(parser, options)
    return parser


JSON = Option("--json", "json_out", OutputFile(what="JSON results"), None, "results")
HTML = Option("--html", "html_out", OutputFile(what="HTML report"), None, "report")


def test_two_outputs_naming_one_file_are_refused_even_through_a_link(tmp_path):
    (tmp_path / "link.json").symlink_to(tmp_path / "r.json")
    args = _parser(JSON, HTML).parse_args(["--json", str(tmp_path / "r.json"), "--html", str(tmp_path / "link.json")])
    with pytest.raises(ValueError, match="--json and --html name the same file"):
        check_outputs([JSON, HTML], args)


def test_an_output_over_an_input_or_a_binary_file_is_refused(tmp_path):
    source = tmp_path / "input.txt"
    source.write_text("text\n")
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\x89HDF\r\n\x1a\n\x00\x00")
    args = _parser(JSON).parse_args(["--json", str(source)])
    with pytest.raises(OutputError, match="an input of this command"):
        check_outputs([JSON], args, inputs=[source], force=True)
    args = _parser(JSON).parse_args(["--json", str(binary)])
    with pytest.raises(OutputError, match="HDF5"):
        check_outputs([JSON], args)
    check_outputs([JSON], args, force=True)  # --force replaces a file of another kind
    assert binary.read_bytes().startswith(b"\x89HDF")  # checked, nothing written


def test_switches_positionals_and_renamed_options_come_from_declarations(capsys):
    options = (
        Option("path", "path", Text(), None, "a file", required=True),
        Option("--all", "all", Switch(), False, "everything"),
        Option("--count", "count", Integer(1, 9), 3, "how many"),
        Renamed("--number", "was renamed --count"),
    )
    parser = _parser(*options)
    args = parser.parse_args(["a.h5", "--all"])
    assert (args.path, args.all, args.count) == ("a.h5", True, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["a.h5", "--number", "2"])
    assert "--number was renamed --count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["a.h5", "--count", "10"])
    assert "expected an integer in [1, 9], got '10'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([""])  # an empty path is a mistake, not a file name
    assert Switch().accepts(True) and not Switch().accepts(1)
