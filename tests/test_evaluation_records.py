"""evaluate-artifact keeps what it measured: per-task records, the journal, resuming, on a tiny
random-weight Llama (the embedded tokenizer, real needle tasks); the CLI's refusals before any
model work.  The real model's kill-and-resume run is in tests/test_evaluate_artifact.py."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_llama

from profiler.evaluation_journal import (
    JOURNAL_FORMAT,
    JournalError,
    JournalWriter,
    configuration_differences,
    journal_path,
    read_journal,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

TIMING = ("prefill_seconds", "decode_seconds")


def odd_length(text: str, probe) -> bool:
    """A correctness rule that splits a random model's answers both ways (the needles rule marks
    them all wrong): whether the answer has an odd number of characters."""
    return len(text) % 2 == 1


@pytest.fixture(scope="module")
def setting(embedded_tokenizer):
    """(model, tokenizer, probes, policies): a tiny random Llama, 6 smoke-sized retrieval tasks,
    the baseline and two artifact-free policies."""
    from needles import PRESETS, generate_probes
    from runtime.plan.policy_spec import parse_policy

    model = make_tiny_llama(vocab_size=len(embedded_tokenizer), seed=3)
    spec = PRESETS["smoke"].replace(families=("retrieval",), count=3, seed=11)
    probes = list(generate_probes(spec, embedded_tokenizer))
    policies = [parse_policy(name) for name in ("baseline", "uniform/keydiff", "uniform/knorm")]
    return model, embedded_tokenizer, probes, policies


def run(setting, **options) -> dict:
    from profiler.evaluation import evaluate

    model, tokenizer, probes, policies = setting
    return evaluate(
        model,
        tokenizer,
        probes,
        policies,
        [0.5, 0.75],
        max_new_tokens=7,
        progress=False,
        is_correct=odd_length,
        **options,
    )


def without_timing(value):
    """``value`` with every wall-time entry dropped (they differ from run to run)."""
    if isinstance(value, dict):
        return {key: without_timing(item) for key, item in value.items() if key not in TIMING}
    if isinstance(value, list):
        return [without_timing(item) for item in value]
    return value


def test_per_task_records_hold_every_answer_and_add_up_to_the_aggregates(setting):
    _, _, probes, _ = setting
    seen = []
    evaluation = run(setting, on_task=lambda probe, rows: seen.append((probe.id, rows)))
    assert [task for task, _ in seen] == evaluation["task_ids"] == [probe.id for probe in probes]
    per_task = evaluation["per_task"]
    assert [task["id"] for task in per_task] == evaluation["task_ids"]
    for probe, task, (_, rows) in zip(probes, per_task, seen, strict=True):
        assert (task["family"], task["haystack"], task["length"], task["depth"]) == (
            "retrieval",
            "simple",
            probe.length,
            probe.depth,
        )
        assert task["tokens"] == len(probe.input_ids)
        assert [(row["policy"], row["compression_ratio"]) for row in rows] == [("baseline", None)] + [
            (name, ratio) for name in ("uniform/keydiff", "uniform/knorm") for ratio in (0.5, 0.75)
        ]
        assert json.loads(json.dumps(rows)) == rows  # what the journal keeps reads back unchanged
        assert task["baseline"]["text"] == rows[0]["text"] and task["baseline"]["correct"] == odd_length(
            rows[0]["text"], probe
        )
        for cell, row in zip(task["cells"], rows[1:], strict=True):
            assert cell["text"] == row["text"] and cell["attention_error"] == row["error"] > 0
            assert cell["correct"] == odd_length(cell["text"], probe)
    results = [evaluation["baseline"], *evaluation["results"]]
    outcomes = [outcome for result in results for outcome in result["outcomes"]]
    assert any(outcomes) and not all(outcomes)  # both outcomes occur
    for column, result in enumerate(results):
        entries = [task["baseline"] if column == 0 else task["cells"][column - 1] for task in per_task]
        if column:
            assert all(
                (e["policy"], e["compression_ratio"]) == (result["policy"], result["compression_ratio"])
                for e in entries
            )
            errors = [e["attention_error"] for e in entries]
            assert result["attention_error"] == pytest.approx(sum(errors) / len(errors), rel=1e-12)
        assert result["outcomes"] == [e["correct"] for e in entries]
        assert result["kv_bytes"] == sum(e["kv_bytes"] for e in entries) // len(entries)
        assert result["prefill_seconds"] == pytest.approx(sum(e["prefill_seconds"] for e in entries) / len(entries))


class Interrupted(Exception):
    """Stands for the kill: raised by the journal's callback once ``after`` tasks are kept."""


def test_an_interrupted_run_resumed_from_its_journal_equals_a_straight_run(setting, tmp_path):
    straight = run(setting)
    path = journal_path(tmp_path / "ev.json")
    writer = JournalWriter.start(path, {"seed": 11, "ratios": (0.5, 0.75)}, created="2026-01-01T00:00:00+00:00")

    def keep_two(probe, rows):
        writer.append(probe, rows)
        if writer.tasks == 2:
            raise Interrupted

    with pytest.raises(Interrupted):
        run(setting, on_task=keep_two)
    journal = read_journal(path)
    assert journal.configuration == {"seed": 11, "ratios": [0.5, 0.75]} and journal.created.startswith("2026")
    assert list(journal.rows) == straight["task_ids"][:2]
    again = JournalWriter.resume(journal)
    ran = []
    resumed = run(
        setting, recorded=journal.rows, on_task=lambda probe, rows: (ran.append(probe.id), again.append(probe, rows))
    )
    assert ran == straight["task_ids"][2:]  # the recorded tasks were not run again
    assert without_timing(resumed) == without_timing(straight)  # texts, outcomes, bytes, errors, aggregates
    assert list(read_journal(path).rows) == straight["task_ids"]
    # the kept tasks' timings are the interrupted run's, as recorded
    first = journal.rows[straight["task_ids"][0]]
    assert resumed["per_task"][0]["baseline"]["decode_seconds"] == first[0]["decode_seconds"]


def test_a_line_cut_by_a_kill_is_dropped_and_cut_away_before_the_next_append(setting, tmp_path):
    evaluation = run(setting)
    _, _, probes, _ = setting
    rows = {task["id"]: task for task in evaluation["per_task"]}
    path = tmp_path / "ev.json.partial.jsonl"
    writer = JournalWriter.start(path, {"k": 1}, created="now")
    for probe in probes[:3]:
        writer.append(probe, [{"text": rows[probe.id]["baseline"]["text"]}])
    whole = path.read_bytes()
    for cut in (len(whole) - 1, len(whole) - 30):  # the third task's line, written in part
        path.write_bytes(whole[:cut])
        journal = read_journal(path)
        assert list(journal.rows) == [probe.id for probe in probes[:2]]
        JournalWriter.resume(journal).append(probes[2], [{"text": "again"}])
        assert read_journal(path).rows[probes[2].id] == [{"text": "again"}]
        assert path.read_bytes().count(b"\n") == 4  # header and three whole lines, nothing of the cut one
    # a garbled last line (a machine crash) is dropped too; a garbled line before a good one is refused
    path.write_bytes(whole + b"\x00\x00\x00\n")
    assert len(read_journal(path).rows) == 3
    lines = whole.split(b"\n")
    path.write_bytes(b"\n".join([lines[0], lines[1][:20], lines[2], b""]))
    with pytest.raises(JournalError, match="damaged at line 2"):
        read_journal(path)
    path.write_bytes(b"\n".join([lines[0], lines[1], lines[1], b""]))  # one task twice
    with pytest.raises(JournalError, match="damaged at line 3"):
        read_journal(path)
    path.write_bytes(b'{"format": "something else"}\n')
    with pytest.raises(JournalError, match=JOURNAL_FORMAT):
        read_journal(path)


def test_configuration_differences_name_every_changed_setting():
    recorded = {"max_new_tokens": 24, "policies": ["baseline", "flagship"], "seed": 3}
    assert (
        configuration_differences(recorded, {"max_new_tokens": 24, "policies": ("baseline", "flagship"), "seed": 3})
        == []
    )
    differences = configuration_differences(recorded, {"max_new_tokens": 12, "policies": ["baseline"], "seed": 3})
    assert differences == [
        "max_new_tokens: 24 in the journal, 12 now",
        'policies: ["baseline", "flagship"] in the journal, ["baseline"] now',
    ]
    assert configuration_differences({"a": 1}, {"a": 1, "b": 2}) == ["b: null in the journal, 2 now"]


def test_the_cli_never_replaces_an_output_or_a_journal_without_resume_or_force(tmp_path, capsys):
    """Refused before any model work (the artifact does not even exist)."""
    from profiler.evaluate_cli import main

    out = tmp_path / "ev.json"
    base = ["--artifact", str(tmp_path / "missing.h5"), "--json", str(out), "--no-progress"]
    out.write_text("{}")
    assert main(base) == 2
    assert f"{out} exists: --force replaces it" in capsys.readouterr().err
    assert main([*base, "--resume"]) == 2
    assert "no journal" in capsys.readouterr().err and out.read_text() == "{}"
    journal = journal_path(out)
    journal.write_text(json.dumps({"format": JOURNAL_FORMAT, "created": "t", "configuration": {}}) + "\n")
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "interrupted run" in err and "--resume continues it, --force discards it" in err
    assert main([*base, "--resume", "--force"]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["--artifact", str(tmp_path / "missing.h5"), "--resume"]) == 2
    assert "--resume continues the journal kept beside --json OUT" in capsys.readouterr().err
    journal.write_text("not json\n")
    assert main([*base, "--resume"]) == 2
    assert "not an evaluate-artifact journal" in capsys.readouterr().err
    assert journal.read_text() == "not json\n" and out.read_text() == "{}"  # nothing was replaced
    from common.atomic import output_lock

    with output_lock(out, "evaluate-artifact"):  # a run on the same output going on: its journal is its own
        assert main([*base, "--force"]) == 2
    assert "another evaluate-artifact run" in capsys.readouterr().err


def test_the_old_tolerance_option_names_its_replacement(capsys):
    from profiler.evaluate_cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--tolerance", "2"])
    assert exited.value.code == 2 and "--tolerance was replaced by --paired-tolerance" in capsys.readouterr().err
