"""``evaluate-artifact --resume`` checks its journal before the model loads (issue 41).

A journal ``OUT.partial.jsonl`` written under other settings (another artifact, other policies,
compression ratios, answer length, tasks, model load) is refused in one ``error:`` line naming
the setting that differs; a hand-edited journal (a row dropped or added, a row that is not an
object, a field of the wrong type or missing, a task this run does not run) is refused in one
``error:`` line naming the journal, the line and what is wrong.  Both before the model or its
tokenizer loads (a tripwire on the loader every command shares, as in tests/test_cli_campaign.py),
exit status 2, the journal byte for byte unchanged.  Before the fix the first family was refused
only once the model had loaded, in a line without ``error:``, and the second ended in
``ValueError`` / ``TypeError`` / ``KeyError`` tracebacks after the model loaded.

The journal is a real one: evaluate-artifact on the smoke artifact, killed once it recorded a task.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import ModelLoadAttempted, forbid_model_loading, kill_evaluation_after_its_first_task

from profiler.evaluation_journal import journal_path, read_journal

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "--preset": "smoke",
    "--tasks": "retrieval",
    "--haystacks": "simple",
    "--count": "2",
    "--compression-ratios": "0.5",
    "--policies": "uniform/keydiff,uniform/knorm",
    "--max-new-tokens": "4",
}


def _arguments(artifact, out, **changes) -> list[str]:
    settings = {**SETTINGS, **{flag: value for flag, value in changes.items()}}
    args = ["--artifact", str(artifact), "--json", str(out), "--no-progress"]
    for flag, value in settings.items():
        if value is True:
            args.append(flag)
        elif value is not None:
            args += [flag, value]
    return args


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, smoke_artifact):
    """(directory, artifact, journal bytes): a run of SETTINGS killed after its first task; the
    artifact is a copy in the directory."""
    directory = tmp_path_factory.mktemp("killed-evaluation")
    artifact = directory / "art.h5"
    shutil.copy(smoke_artifact, artifact)
    out = directory / "ev.json"
    journal = journal_path(out)
    kill_evaluation_after_its_first_task(_arguments(artifact, out), journal)
    assert read_journal(journal).rows
    return directory, artifact, journal.read_bytes()


@pytest.fixture
def resumable(killed_run, tmp_path):
    """The killed run's artifact (the journal records its path) and a fresh copy of its journal in
    ``tmp_path``: (artifact, out, journal)."""
    _, artifact, saved = killed_run
    out = tmp_path / "ev.json"
    journal_path(out).write_bytes(saved)
    return artifact, out, journal_path(out)


def _refused(args, monkeypatch, capsys) -> str:
    """Run evaluate-artifact ARGS with the tripwire; return its one stderr line (exit 2 asserted)."""
    from profiler.evaluate_cli import main

    forbid_model_loading(monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    capsys.readouterr()
    try:
        code = main(args)
    except ModelLoadAttempted as exc:
        pytest.fail(f"began loading the model before refusing: {exc}")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("evaluate-artifact: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- other settings ------------------------------------------------------------------------------

OTHER_SETTINGS = [
    ({"--policies": "uniform/keydiff"}, "policies"),
    ({"--policies": "uniform/knorm,uniform/keydiff"}, "policies"),
    ({"--compression-ratios": "0.75"}, "compression_ratios"),
    ({"--compression-ratios": "0.5,0.75"}, "compression_ratios"),
    ({"--max-new-tokens": "5"}, "max_new_tokens"),
    ({"--count": "1"}, "task_ids"),
    ({"--seed": "77"}, "task_ids"),
    ({"--tasks": "multi_key"}, "task_ids"),
    ({"--haystacks": "prose"}, "tasks"),  # the same ids (an id has no haystack), other tasks
    ({"--haystacks": "simple,prose"}, "task_ids"),
    ({"--question-aware": True}, "question_aware"),
    ({"--dtype": "bfloat16"}, "model"),
]


@pytest.mark.parametrize(("changes", "named"), OTHER_SETTINGS, ids=[str(c) for c, _ in OTHER_SETTINGS])
def test_a_journal_of_other_settings_is_refused_before_the_model_loads_naming_them(
    resumable, monkeypatch, capsys, changes, named
):
    artifact, out, journal = resumable
    before = journal.read_bytes()
    line = _refused([*_arguments(artifact, out, **changes), "--resume"], monkeypatch, capsys)
    assert f"{named}: " in line and "in the journal" in line and str(journal) in line, line
    assert journal.read_bytes() == before and not out.exists()


def test_a_journal_of_another_artifact_is_refused_before_the_model_loads(resumable, monkeypatch, capsys):
    """Another file (a copy elsewhere), or the same path holding other bytes."""
    from artifacts import Artifact, open_artifact, write_artifact

    artifact, out, journal = resumable
    before = journal.read_bytes()
    elsewhere = artifact.with_name("elsewhere.h5")
    shutil.copy(artifact, elsewhere)
    line = _refused([*_arguments(elsewhere, out), "--resume"], monkeypatch, capsys)
    assert "artifact: " in line and "elsewhere.h5" in line, line
    original = artifact.read_bytes()
    with open_artifact(artifact) as reader:
        changed = Artifact(
            model=reader.model,
            config={**reader.config, "note": "rewritten"},
            sections={name: reader.section(name) for name in reader.sections},
        )
    try:
        write_artifact(artifact, changed)  # the same path, other bytes
        line = _refused([*_arguments(artifact, out), "--resume"], monkeypatch, capsys)
    finally:
        artifact.write_bytes(original)  # the other tests' journal was written with it
    assert "artifact: " in line and "sha256" in line, line
    assert journal.read_bytes() == before and not out.exists()


# -- hand-edited rows ----------------------------------------------------------------------------


def _edit_first_task(edit):
    """A journal edit: ``edit(rows)`` changes the first task's rows in place (or returns new ones)."""

    def apply(lines: list) -> None:
        record = json.loads(lines[1])
        changed = edit(record["rows"])
        if changed is not None:
            record["rows"] = changed
        lines[1] = json.dumps(record)

    return apply


def _set(index, key, value):
    def edit(rows):
        rows[index][key] = value

    return edit


def _drop(index, key):
    def edit(rows):
        del rows[index][key]

    return edit


def _replace_line(text):
    def apply(lines: list) -> None:
        lines[1] = text

    return apply


def _rename_task(lines: list) -> None:
    record = json.loads(lines[1])
    record["task"] = "retrieval-L512-D25-S999-R0"
    lines[1] = json.dumps(record)


EDITS = {
    "a row dropped": (_edit_first_task(lambda rows: rows[:-1]), "rows"),
    "the baseline row dropped": (_edit_first_task(lambda rows: rows[1:]), "rows"),
    "a row added": (_edit_first_task(lambda rows: [*rows, rows[-1]]), "rows"),
    "rows empty": (_edit_first_task(lambda rows: []), "rows"),
    "a row that is a list": (_edit_first_task(lambda rows: [rows[0], [1, 2], *rows[2:]]), "not an object"),
    "a row that is a number": (_edit_first_task(lambda rows: [rows[0], 5, *rows[2:]]), "not an object"),
    "a row that is null": (_edit_first_task(lambda rows: [None, *rows[1:]]), "not an object"),
    "a row that is text": (_edit_first_task(lambda rows: ["row", *rows[1:]]), "not an object"),
    "correct as text": (_edit_first_task(_set(1, "correct", "false")), "correct"),
    "correct as a number": (_edit_first_task(_set(0, "correct", 1)), "correct"),
    "correct missing": (_edit_first_task(_drop(1, "correct")), "correct"),
    "kv_bytes missing": (_edit_first_task(_drop(1, "kv_bytes")), "kv_bytes"),
    "kv_bytes as text": (_edit_first_task(_set(0, "kv_bytes", "1024")), "kv_bytes"),
    "kv_bytes negative": (_edit_first_task(_set(1, "kv_bytes", -1)), "kv_bytes"),
    "kv_bytes fractional": (_edit_first_task(_set(1, "kv_bytes", 10.5)), "kv_bytes"),
    "kv_bytes true": (_edit_first_task(_set(1, "kv_bytes", True)), "kv_bytes"),
    "text missing": (_edit_first_task(_drop(0, "text")), "text"),
    "text a number": (_edit_first_task(_set(2, "text", 7)), "text"),
    "prefill_seconds as text": (_edit_first_task(_set(1, "prefill_seconds", "fast")), "prefill_seconds"),
    "decode_seconds negative": (_edit_first_task(_set(1, "decode_seconds", -2.0)), "decode_seconds"),
    "decode_seconds missing": (_edit_first_task(_drop(0, "decode_seconds")), "decode_seconds"),
    "error as text": (_edit_first_task(_set(1, "error", "small")), "error"),
    "error missing": (_edit_first_task(_drop(1, "error")), "error"),
    "policy renamed": (_edit_first_task(_set(1, "policy", "uniform/snapkv")), "policy"),
    "policy missing": (_edit_first_task(_drop(1, "policy")), "policy"),
    "ratio changed": (_edit_first_task(_set(1, "compression_ratio", 0.75)), "compression_ratio"),
    "ratio as false": (_edit_first_task(_set(0, "compression_ratio", False)), "compression_ratio"),
    "rows an object": (_edit_first_task(lambda rows: {"rows": rows}), "rows"),
    "a task line that is a list": (_replace_line("[1, 2]"), "line 2"),
    "a task line that is a number": (_replace_line("5"), "line 2"),
    "a task this run does not run": (_rename_task, "not one of this run's tasks"),
}


@pytest.mark.parametrize(("edit", "named"), EDITS.values(), ids=list(EDITS))
def test_a_hand_edited_journal_is_refused_before_the_model_loads_naming_its_line(
    resumable, monkeypatch, capsys, edit, named
):
    artifact, out, journal = resumable
    lines = journal.read_text().splitlines()
    assert len(lines) >= 2
    edit(lines)
    journal.write_text("\n".join(lines) + "\n")
    before = journal.read_bytes()
    line = _refused([*_arguments(artifact, out), "--resume"], monkeypatch, capsys)
    assert str(journal) in line and "line 2" in line and named in line, line
    assert journal.read_bytes() == before and not out.exists()


def test_a_hand_edited_last_task_line_that_is_whole_but_not_a_task_is_refused(resumable, monkeypatch, capsys):
    """A line cut by a kill has no newline and is dropped (that task runs again); a whole line that
    reads as JSON but is not a task was written by hand: refused, naming it."""
    artifact, out, journal = resumable
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join([*lines, "[1, 2]"]) + "\n")
    line = _refused([*_arguments(artifact, out), "--resume"], monkeypatch, capsys)
    assert f"line {len(lines) + 1}" in line and str(journal) in line, line
