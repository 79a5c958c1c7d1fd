"""``evaluate-artifact``'s journal: every finished task's results, kept as they come.

``OUT.partial.jsonl`` beside the JSON output ``OUT``, one JSON object per line:

* line 1, the header: ``{"format": JOURNAL_FORMAT, "created": ISO time the run started,
  "configuration": {...}}``, the configuration being everything the results depend on (model,
  artifact digest, policies, compression ratios, task spec and ids, answer length, question
  awareness: ``profiler.evaluate_cli``).  It is written atomically (``common.atomic``);
* every further line one task: ``{"task": probe id, "rows": [...]}``, the rows
  ``profiler.evaluation.evaluate`` hands to ``on_task`` (row 0 the baseline, then every cell).

A task's line is appended in one write, flushed and fsynced before the next task starts, with
Ctrl-C / SIGTERM held until it is whole (``profiler.checkpoint.interrupts_deferred``).  A
process killed while appending leaves at most an incomplete (or, after a crash of the machine,
garbled) last line: :func:`read_journal` drops an unreadable *last* line (that task runs again)
and refuses a journal with an unreadable line before a readable one, or a whole line that reads
as JSON but is not a task's object (written by hand).  :func:`check_recorded` checks every
recorded task against the run resuming it, before its model loads: a task it runs, and rows of
its cells with fields of the types ``profiler.evaluation`` wrote (a hand-edited journal is refused
naming its line, not a traceback once the model has loaded).  Appending after a resume
first cuts the file back to its last whole line.  So a run killed at any moment loses at most
the task in flight; the final JSON is written atomically from all the rows, and only then is
the journal removed.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

JOURNAL_FORMAT = "kvcal-evaluation-journal/1"


class JournalError(ValueError):
    """A journal that cannot be continued; the message says why and what to do."""


def journal_path(out: str | os.PathLike) -> Path:
    """``OUT.partial.jsonl`` beside the JSON output ``OUT``."""
    out = Path(out)
    return out.with_name(out.name + ".partial.jsonl")


def canonical(configuration: dict) -> dict:
    """``configuration`` as it reads back from JSON (tuples become lists...): what is compared."""
    return json.loads(json.dumps(configuration, sort_keys=True))


@dataclass
class Journal:
    path: Path
    created: str
    configuration: dict
    rows: dict[str, list[dict]] = field(default_factory=dict)  # probe id -> its rows, in file order
    whole_bytes: int = 0  # the file's length up to its last readable line
    lines: dict[str, int] = field(default_factory=dict)  # probe id -> its line number (1: the header)


def read_journal(path: str | os.PathLike) -> Journal:
    """The header and the recorded tasks of the journal at ``path`` (see the module docstring)."""
    path = Path(path)
    data = path.read_bytes()
    lines, offset, parsed = [], 0, []
    while offset < len(data):
        end = data.find(b"\n", offset)
        end = len(data) if end < 0 else end + 1
        lines.append((offset, end))
        offset = end
    for index, (start, end) in enumerate(lines):
        whole = data[end - 1 : end] == b"\n"
        try:
            record = json.loads(data[start:end].decode("utf-8")) if whole else None
            readable = whole
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            record, readable = None, False
        if not isinstance(record, dict):
            if index == 0:  # no header: refused below
                break
            if readable:  # whole and JSON, but no task: not what a kill leaves
                raise JournalError(
                    f"the journal {path} is damaged at line {index + 1}: {_shown(record)} is not a task's object; "
                    "delete that line (its task runs again) or the journal (or run with --force) to start over"
                )
            if index == len(lines) - 1:  # the task in flight
                break
            raise JournalError(
                f"the journal {path} is damaged at line {index + 1}; delete it (or run with --force) to start over"
            )
        parsed.append((record, end))
    header = parsed[0][0] if parsed else {}
    if header.get("format") != JOURNAL_FORMAT or not isinstance(header.get("configuration"), dict):
        raise JournalError(
            f"{path} is not an evaluate-artifact journal of this version ({JOURNAL_FORMAT}); delete it (or run "
            "with --force) to start over"
        )
    journal = Journal(path, str(header.get("created", "")), header["configuration"], whole_bytes=parsed[0][1])
    for number, (record, end) in enumerate(parsed[1:], start=2):
        task, rows = record.get("task"), record.get("rows")
        if not isinstance(task, str) or not isinstance(rows, list) or task in journal.rows:
            raise JournalError(
                f"the journal {path} is damaged at line {number} (not one new task's rows); delete it (or run with "
                "--force) to start over"
            )
        journal.rows[task] = rows
        journal.lines[task] = number
        journal.whole_bytes = end
    return journal


def _shown(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _seconds(value) -> bool:
    return _real(value) and math.isfinite(value) and value >= 0


# what evaluate() writes in every row (profiler.evaluation): field -> (check, what it must be)
ROW_FIELDS = {
    "text": (lambda value: isinstance(value, str), "a string"),
    "correct": (lambda value: isinstance(value, bool), "true or false"),
    "kv_bytes": (
        lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0,
        "a whole number of bytes",
    ),
    "prefill_seconds": (_seconds, "a number of seconds"),
    "decode_seconds": (_seconds, "a number of seconds"),
}


def row_problem(rows, keys: list[tuple]) -> str | None:
    """What is wrong with one task's recorded ``rows`` for the cells ``keys`` (``(policy, ratio)``,
    the baseline's ``("baseline", None)`` first: ``profiler.evaluation_results.cell_keys``), or None."""
    if not isinstance(rows, list):
        return f"its rows are {_shown(rows)}, not a list"
    if len(rows) != len(keys):
        return (
            f"it holds {len(rows)} rows, this run has {len(keys)} per task (the baseline, then every policy at "
            "every compression ratio)"
        )
    for index, (row, (policy, ratio)) in enumerate(zip(rows, keys, strict=True)):
        where = f"row {index + 1} ({policy}" + ("" if ratio is None else f" at {ratio:g}") + ")"
        if not isinstance(row, dict):
            return f"{where} is {_shown(row)}, not an object"
        for name in ("policy", "compression_ratio"):
            if name not in row:
                return f"{where} has no {name!r}"
        recorded = row["compression_ratio"]
        if row["policy"] != policy or not (recorded is None or _real(recorded)) or recorded != ratio:
            return (
                f"{where} is of policy {_shown(row['policy'])} at compression_ratio {_shown(recorded)}, not of "
                "this run's cell"
            )
        for name, (check, expected) in ROW_FIELDS.items():
            if name not in row:
                return f"{where} has no {name!r}"
            if not check(row[name]):
                return f"{where}: {name!r} is {_shown(row[name])}, not {expected}"
        if "error" not in row:
            return f"{where} has no 'error'"
        error = row["error"]
        if index == 0 and error is not None:
            return f"{where}: 'error' is {_shown(error)}, not null (the baseline has no attention error)"
        if index > 0 and not (error is None or _real(error)):
            return f"{where}: 'error' is {_shown(error)}, not a number"
    return None


def check_recorded(journal: Journal, keys: list[tuple], task_ids) -> None:
    """Every task ``journal`` recorded is one of ``task_ids`` (this run's) with rows of the cells
    ``keys`` whose fields have the types ``profiler.evaluation`` writes: JournalError naming the
    journal, the line and what is wrong (checked before the model loads)."""
    known = set(task_ids)
    for task, rows in journal.rows.items():
        line = journal.lines.get(task, "?")
        if task not in known:
            problem = "not one of this run's tasks (its task ids are in the journal's header)"
        else:
            problem = row_problem(rows, keys)
        if problem is not None:
            raise JournalError(
                f"the journal {journal.path} line {line} (task {_shown(task)}): {problem}; delete that line (its "
                "task runs again) or the journal (or run with --force) to start over"
            )


def configuration_differences(recorded: dict, current: dict) -> list[str]:
    """What differs between a journal's configuration and this run's, one phrase per key."""

    def shown(value) -> str:
        text = json.dumps(value, sort_keys=True)
        return text if len(text) <= 160 else text[:157] + "..."

    current = canonical(current)
    return [
        f"{key}: {shown(recorded.get(key))} in the journal, {shown(current.get(key))} now"
        for key in sorted(set(recorded) | set(current))
        if recorded.get(key) != current.get(key)
    ]


class JournalWriter:
    """Appends one line per finished task (``on_task`` of ``profiler.evaluation.evaluate``)."""

    def __init__(self, path: Path, whole_bytes: int):
        self.path = path
        with open(path, "r+b") as fh:  # drop an incomplete last line before appending after it
            fh.truncate(whole_bytes)
            os.fsync(fh.fileno())
        self.tasks = 0

    @classmethod
    def start(cls, path: str | os.PathLike, configuration: dict, created: str) -> JournalWriter:
        """A new journal holding only the header (replacing any file at ``path``, atomically)."""
        from common.atomic import write_atomic

        header = {"format": JOURNAL_FORMAT, "created": created, "configuration": canonical(configuration)}
        text = json.dumps(header, sort_keys=True) + "\n"
        write_atomic(path, text, what="evaluation journal")
        return cls(Path(path), len(text.encode("utf-8")))

    @classmethod
    def resume(cls, journal: Journal) -> JournalWriter:
        return cls(journal.path, journal.whole_bytes)

    def append(self, probe, rows: list[dict]) -> None:
        """Persist one task's rows (flushed and fsynced; interrupts held until the line is whole)."""
        from .checkpoint import interrupts_deferred

        line = (json.dumps({"task": probe.id, "rows": rows}, sort_keys=True) + "\n").encode("utf-8")
        with interrupts_deferred():  # a Ctrl-C held here is raised once the line is whole and counted
            with open(self.path, "ab") as fh:
                fh.write(line)
                fh.flush()
                os.fsync(fh.fileno())
            self.tasks += 1
