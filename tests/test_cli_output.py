"""Output for people and for pipes (issue 30): colour only on a terminal and without NO_COLOR,
progress bars only on a terminal, a config line cut at an item with an ellipsis, a short
CompressionReport, and the tools' messages through ``logging`` with ``-q`` / ``-v``."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
from conftest import make_random_artifact

from artifacts import write_artifact
from artifacts.cli import main as inspect_main
from needles.cli import main as probes_main

ESCAPE = "\033["


def _show(tmp_path, capsys, *extra: str) -> str:
    code = probes_main(["--preset", "smoke", "--families", "retrieval", "--out", str(tmp_path / "p.jsonl"),
                        "--show", "1", "--no-progress", *extra])  # fmt: skip
    assert code == 0
    return capsys.readouterr().out


def test_show_writes_no_colour_codes_into_a_pipe(embedded_tokenizer, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    shown = _show(tmp_path, capsys)  # capsys' stdout is not a terminal
    assert ESCAPE not in shown and "question:" in shown


def test_show_colours_a_terminal_unless_no_color_is_set(embedded_tokenizer, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert "\033[1;32m" in _show(tmp_path, capsys)  # R in bold green
    monkeypatch.setenv("NO_COLOR", "1")  # https://no-color.org: present and not empty
    assert ESCAPE not in _show(tmp_path, capsys)
    monkeypatch.setenv("NO_COLOR", "")  # empty: colour as usual
    assert ESCAPE in _show(tmp_path, capsys)
    monkeypatch.delenv("NO_COLOR")
    assert ESCAPE not in _show(tmp_path, capsys, "--no-colour")


def test_inspect_cuts_a_long_config_line_at_an_item_with_an_ellipsis(tmp_path, capsys):
    config = {f"stage{i}": {f"option_number_{j}": f"value-{i}-{j}" for j in range(6)} for i in range(8)}
    path = write_artifact(tmp_path / "a.h5", dataclasses.replace(make_random_artifact(), config=config))
    assert inspect_main([str(path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("config"))
    shown = line.removeprefix("config").strip()
    items = [f"stage{i}.option_number_{j}=value-{i}-{j}" for i in range(8) for j in range(6)]
    match = re.fullmatch(r"(.*), \.\.\. \((\d+) more; --json shows them all\)", shown)
    assert match, shown
    kept = match[1].split(", ")
    assert kept == items[: len(kept)] and int(match[2]) == len(items) - len(kept)  # whole items, none cut
    assert len(line) <= len("config      ") + 400 + len(", ... (99 more; --json shows them all)")


def test_compression_report_prints_a_summary_and_keeps_its_arrays():
    import numpy as np

    from runtime.compression.prefill import CompressionReport

    batch, layers, heads = 2, 30, 3
    before = np.full((layers, batch, heads), 400, dtype=np.int64)
    report = CompressionReport(
        budgets=np.full((batch, layers, heads), 100, dtype=np.int64),
        lengths_before=before,
        lengths_after=before // 4,
        kv_bytes_before=4_000_000,
        kv_bytes_after=1_000_000,
        seconds=0.25,
    )
    for text in (repr(report), str(report)):
        assert "\n" not in text and len(text) < 300, text
        assert "2 rows" in text and "30 layers" in text and "3 KV heads" in text and "25.0% kept" in text
    assert report.lengths_after.shape == (layers, batch, heads) and report.budgets.sum() == batch * layers * heads * 100


# -- progress bars (D11) ---------------------------------------------------------------------------


@pytest.mark.slow
def test_no_bar_is_drawn_into_a_file_nor_by_the_first_conversion_under_no_progress(tmp_path):
    """The first use converts the embedded GGUF (its own tqdm bar, "Converting and de-quantizing GGUF
    tensors"): on a terminal under --no-progress it drew anyway; load_model()'s "Loading weights" bar
    went into a log file."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import termios

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    env.pop("NO_COLOR", None)
    parent, child = pty.openpty()  # stderr a terminal: only --no-progress turns the bars off
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # 80 columns (0: tqdm draws nothing)
    with os.fdopen(parent, "rb", buffering=0) as terminal:
        proc = subprocess.Popen(
            [sys.executable, "-m", "needles.cli", "--preset", "smoke", "--families", "retrieval", "--out",
             str(tmp_path / "p.jsonl"), "--no-progress"],  # fmt: skip
            cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=child, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(child)
        drawn = b""
        while True:
            try:
                chunk = terminal.read(65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            drawn += chunk
        assert proc.wait(timeout=600) == 0, drawn.decode(errors="replace")
    assert b"wrote" in drawn and b"it/s" not in drawn and b"Converting" not in drawn, drawn.decode(errors="replace")
    log = tmp_path / "load.log"
    with open(log, "wb") as stderr:  # a log file: no bar without --no-progress either
        done = subprocess.run(
            [sys.executable, "-c", "from common.models import load_model as m, load_tokenizer as t; m(); t()"],
            cwd=repo, env=env, stderr=stderr, timeout=600,
        )  # fmt: skip
    text = log.read_text(errors="replace")
    assert done.returncode == 0, text
    assert "Loading weights" not in text and "it/s" not in text, text


# -- logging, -q and -v -------------------------------------------------------------------------

COMMANDS = {
    "profile-model": ("profiler.cli", []),
    "evaluate-artifact": ("profiler.evaluate_cli", []),
    "inspect-artifact": ("artifacts.cli", ["a.h5"]),
    "generate-probes": ("needles.cli", ["--out", "p.jsonl"]),
}


@pytest.fixture
def kvcal_logging():
    """Leave the ``kvcal`` logger as the test found it (the commands configure it in-process)."""
    import logging

    root = logging.getLogger("kvcal")
    saved = (list(root.handlers), root.level, root.propagate)
    yield root
    root.handlers[:], root.level, root.propagate = saved


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_takes_quiet_and_verbose(command, capsys):
    import importlib

    module, required = COMMANDS[command]
    parser = importlib.import_module(module).build_parser()
    assert parser.parse_args([*required, "-q"]).quiet and parser.parse_args([*required, "--quiet"]).quiet
    assert parser.parse_args([*required, "-v"]).verbose and parser.parse_args([*required, "--verbose"]).verbose
    with pytest.raises(SystemExit) as info:
        parser.parse_args([*required, "-q", "-v"])
    assert info.value.code == 2 and "not allowed with" in capsys.readouterr().err
    assert "--quiet" in parser.format_help() and "--verbose" in parser.format_help()


def test_generate_probes_quiet_hides_its_note_not_its_errors(embedded_tokenizer, tmp_path, capsys, kvcal_logging):
    args = ["--preset", "smoke", "--families", "retrieval", "--out", str(tmp_path / "p.jsonl")]
    assert probes_main(args) == 0
    assert capsys.readouterr().err.strip() == f"wrote 2 probes to {tmp_path / 'p.jsonl'}"
    assert probes_main([*args, "-q"]) == 0
    assert capsys.readouterr() == ("", "")  # --quiet: nothing, no progress bar either (its old meaning)
    with pytest.raises(SystemExit) as refused:  # refused by the parser, before the tokenizer loads
        probes_main([*args, "-q", "--families", "nope"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("generate-probes: error:") and "nope" in err and err.count("\n") == 1


def test_inspect_artifact_verbose_adds_debugging_messages(tmp_path, capsys, kvcal_logging):
    path = write_artifact(tmp_path / "a.h5", make_random_artifact())
    html = tmp_path / "r.html"
    assert inspect_main([str(path), "--html", str(html)]) == 0
    quiet_err = capsys.readouterr().err
    assert inspect_main([str(path), "--html", str(html), "-v"]) == 0
    out, err = capsys.readouterr()
    assert "wrote the HTML report" in err and "wrote the HTML report" not in quiet_err
    assert out.startswith(f"{path}: valid calibration artifact")  # the summary is the result, on stdout


def test_evaluate_artifact_quiet_still_prints_its_one_line_error(tmp_path, capsys, kvcal_logging):
    from profiler.evaluate_cli import main as evaluate_main

    assert evaluate_main(["--json", str(tmp_path), "-q"]) == 2  # a directory: refused before any model work
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("evaluate-artifact: error: cannot write the JSON results")


def test_profile_model_summaries_are_its_output_quiet_hides_them_and_a_program_routes_them(
    embedded_tokenizer, tmp_path, capsys, kvcal_logging
):
    import logging

    from conftest import single_thread, tiny_profile_args, write_tiny_model_dir

    from profiler.cli import main as profile_main

    model_dir = write_tiny_model_dir(tmp_path / "model", embedded_tokenizer)
    out = tmp_path / "a.h5"

    class Kept(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record):
            self.records.append(record)

    routed = Kept()
    logging.getLogger("kvcal.profiler").addHandler(routed)  # a program's own handler
    try:
        with single_thread():
            assert profile_main(tiny_profile_args(model_dir, out, "--stages", "behaviour")) == 0
            stdout, _ = capsys.readouterr()
            assert profile_main([*tiny_profile_args(model_dir, out, "--stages", "behaviour", "--force"), "-q"]) == 0
    finally:
        logging.getLogger("kvcal.profiler").removeHandler(routed)
    assert f"wrote {out}" in stdout and "behaviour" in stdout  # the one-line stage summaries, on stdout
    messages = [record.getMessage() for record in routed.records]
    assert sum(message.startswith(f"wrote {out}") for message in messages) == 1  # the first run's; -q: none
    assert {record.name for record in routed.records} == {"kvcal.profiler"}
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and "Traceback" not in stderr  # -q


def test_profile_model_notes_are_warnings_kept_under_quiet(embedded_tokenizer, tmp_path, capsys, kvcal_logging):
    from conftest import single_thread, tiny_profile_args, write_tiny_model_dir

    from profiler.cli import main as profile_main

    model_dir = write_tiny_model_dir(tmp_path / "model", embedded_tokenizer)
    out = tmp_path / "a.h5"
    work = tmp_path / "a.h5.work.npz"
    work.write_bytes(b"an earlier run's work file")
    capsys.readouterr()  # what saving the tiny model drew
    with single_thread():
        assert profile_main([*tiny_profile_args(model_dir, out, "--stages", "behaviour"), "-q"]) == 0
        stdout, stderr = capsys.readouterr()
        assert stdout == "" and stderr == (
            f"profile-model: note: discarding the work file {work} of an earlier run (use --resume to continue it)\n"
        )
        assert profile_main([*tiny_profile_args(model_dir, out, "--stages", "behaviour", "--resume"), "-q"]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and "--resume: no work file at" in stderr and stderr.count("\n") == 1
