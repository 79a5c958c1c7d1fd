"""benchmarks/ruler_table.py's pure parts, without lm-eval, kvpress or a model: the journal's resume
and skip logic, the report's aggregation (mean, Wilson interval, paired counts against the
flagship), the no-signal note and the plot's curves, on a small journal written here."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from common.formulas import wilson_interval

# By its path: benchmarks/ is no package kvcal installs, and pytest may run from anywhere.
_SPEC = importlib.util.spec_from_file_location(
    "ruler_table", Path(__file__).resolve().parent.parent / "benchmarks" / "ruler_table.py"
)
ruler_table = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("ruler_table", ruler_table)
_SPEC.loader.exec_module(ruler_table)

SETTINGS = {"instances": "/x/ruler.instances.json", "artifact": "/x/a.h5", "prompt": "chat", "length": 2048}


def record(task, index, method, ratio, score):
    return {"instance": f"{task}/{index}", "task": task, "method": method, "ratio": ratio, "score": score}


def journal(tmp_path, records, cut_last=False):
    path = tmp_path / "ruler.jsonl"
    lines = [json.dumps({"settings": SETTINGS})] + [json.dumps(r) for r in records]
    text = "\n".join(lines) + "\n"
    if cut_last:  # a run killed in the middle of writing its last line
        text = text[: -len(lines[-1]) // 2]
    path.write_text(text)
    return path


RECORDS = [
    # niah_single_1: the model answers uncompressed; at 0.75 snapkv wins one and loses one against the flagship
    record("niah_single_1", 0, "uncompressed", 0.0, 1.0),
    record("niah_single_1", 1, "uncompressed", 0.0, 1.0),
    record("niah_single_1", 2, "uncompressed", 0.0, 0.0),
    record("niah_single_1", 0, "flagship", 0.75, 1.0),
    record("niah_single_1", 1, "flagship", 0.75, 0.0),
    record("niah_single_1", 2, "flagship", 0.75, 0.0),
    record("niah_single_1", 0, "snapkv", 0.75, 0.0),
    record("niah_single_1", 1, "snapkv", 0.75, 1.0),
    record("niah_single_1", 2, "snapkv", 0.75, 0.0),
    # ruler_cwe: fractional scores, near zero uncompressed (no signal)
    record("ruler_cwe", 0, "uncompressed", 0.0, 0.1 - 0.05),
    record("ruler_cwe", 1, "uncompressed", 0.0, 0.0),
    record("ruler_cwe", 0, "flagship", 0.75, 0.0),
    record("ruler_cwe", 0, "snapkv", 0.75, 0.2),  # the flagship did not run instance 1: not paired there
    record("ruler_cwe", 1, "snapkv", 0.75, 0.0),
]


def test_summary_means_wilson_and_paired_counts():
    rows = ruler_table.summarise(RECORDS)
    snap = rows[("niah_single_1", "snapkv", 0.75)]
    assert (snap["n"], snap["mean"]) == (3, pytest.approx(1 / 3))
    assert (snap["low"], snap["high"]) == pytest.approx(wilson_interval(1, 3))
    assert (snap["wins"], snap["losses"], snap["paired"]) == (1, 1, 3)
    flagship = rows[("niah_single_1", "flagship", 0.75)]
    assert flagship["wins"] is None  # the reference is not paired with itself
    assert rows[("niah_single_1", "uncompressed", 0.0)]["wins"] is None  # another ratio: not paired
    cwe = rows[("ruler_cwe", "snapkv", 0.75)]
    assert (cwe["n"], cwe["mean"], cwe["wins"], cwe["losses"], cwe["paired"]) == (2, pytest.approx(0.1), 1, 0, 1)
    assert (cwe["low"], cwe["high"]) == pytest.approx(wilson_interval(0.2, 2))


def test_near_zero_uncompressed_is_no_signal_and_left_out_of_the_curves():
    rows = ruler_table.summarise(RECORDS)
    assert ruler_table.no_signal_tasks(rows) == ["ruler_cwe"]
    text = ruler_table.table(rows)
    assert "ruler_cwe        0.025 (n=2) near zero: no signal" in text
    assert "niah_single_1    0.667 (n=3) signal" in text
    assert "1/1 on 3" in text
    panels, kept = ruler_table.curves(rows)
    assert kept == ["niah_single_1"] and list(panels) == kept
    lines = panels["niah_single_1"]
    assert lines["snapkv"] == [(0.0, pytest.approx(2 / 3)), (0.75, pytest.approx(1 / 3))]
    assert lines["flagship"] == [(0.0, pytest.approx(2 / 3)), (0.75, pytest.approx(1 / 3))]
    assert lines["uncompressed"] == [(0.0, pytest.approx(2 / 3))]


def test_a_task_run_only_uncompressed_stays_out_of_the_curves():
    """A task with signal but no compressed cell yet (a table split not run) would lower or raise
    the uncompressed point alone: the curves average the tasks some method ran compressed."""
    fwe = [record("ruler_fwe", i, "uncompressed", 0.0, score) for i, score in enumerate((0.2, 0.4))]
    panels, kept = ruler_table.curves(ruler_table.summarise(RECORDS + fwe))
    assert kept == ["niah_single_1"]
    assert panels["niah_single_1"]["uncompressed"] == [(0.0, pytest.approx(2 / 3))]


def test_methods_run_on_different_tasks_get_a_panel_per_task_never_one_average():
    """The flagship run on two tasks and a press on one: averaging each method over the tasks it ran
    would put the flagship's mean of two tasks beside the press's one task.  Each task is its own panel."""
    fwe = [record("ruler_fwe", i, "uncompressed", 0.0, score) for i, score in enumerate((0.2, 0.4))]
    fwe += [record("ruler_fwe", 0, "flagship", 0.75, 0.3), record("ruler_fwe", 1, "flagship", 0.75, 0.1)]
    panels, kept = ruler_table.curves(ruler_table.summarise(RECORDS + fwe))
    assert kept == ["niah_single_1", "ruler_fwe"]
    assert panels["ruler_fwe"]["flagship"] == [(0.0, pytest.approx(0.3)), (0.75, pytest.approx(0.2))]
    assert "snapkv" not in panels["ruler_fwe"]
    assert panels["niah_single_1"]["flagship"] == [(0.0, pytest.approx(2 / 3)), (0.75, pytest.approx(1 / 3))]


def test_every_task_gets_a_panel_when_none_has_signal():
    quiet = [r for r in RECORDS if r["task"] == "ruler_cwe"]
    panels, kept = ruler_table.curves(ruler_table.summarise(quiet))
    assert kept == ["ruler_cwe"]
    assert panels["ruler_cwe"]["snapkv"][-1] == (0.75, pytest.approx(0.1))


def test_resume_skips_what_the_journal_holds_and_reruns_a_cut_line(tmp_path):
    path = journal(tmp_path, RECORDS[:4], cut_last=True)  # the flagship's cell on instance 0 was cut
    done = ruler_table.read_journal(path, SETTINGS)
    assert set(done) == {("niah_single_1/0", "uncompressed", 0.0), ("niah_single_1/1", "uncompressed", 0.0),
                         ("niah_single_1/2", "uncompressed", 0.0)}  # fmt: skip
    instances = [{"id": f"niah_single_1/{i}"} for i in range(3)]
    cells = ruler_table.plan(instances, ["uncompressed", "flagship", "snapkv"], [0.5, 0.75], done)
    assert [(c[0]["id"], c[1], c[2]) for c in cells[:4]] == [
        ("niah_single_1/0", "flagship", 0.5),
        ("niah_single_1/0", "flagship", 0.75),  # the cut line runs again
        ("niah_single_1/0", "snapkv", 0.5),
        ("niah_single_1/0", "snapkv", 0.75),
    ]
    assert len(cells) == 3 * 4  # uncompressed once per instance (ratio 0), all done
    full = ruler_table.read_journal(journal(tmp_path, RECORDS), SETTINGS)
    assert ruler_table.plan(instances, ["uncompressed", "flagship", "snapkv"], [0.75], full) == []


def test_a_journal_of_other_settings_is_refused_and_a_new_one_started(tmp_path):
    path = journal(tmp_path, RECORDS)
    with pytest.raises(SystemExit, match="other settings"):
        ruler_table.read_journal(path, {**SETTINGS, "length": 4096})
    fresh = tmp_path / "sub" / "new.jsonl"
    assert ruler_table.read_journal(fresh, SETTINGS) == {}
    assert json.loads(fresh.read_text()) == {"settings": SETTINGS}
    assert len(ruler_table.read_journal(path, None)) == len(RECORDS)  # --report reads any journal


def test_arguments_are_checked(tmp_path):
    out = str(tmp_path / "r.jsonl")
    with pytest.raises(SystemExit):
        ruler_table.parse_args(["--out", out, "--tasks", "niah_single_2", "--methods", "snapkv"])  # needs a download
    with pytest.raises(SystemExit):
        ruler_table.parse_args(["--out", out, "--methods", "flagship"])  # no artifact
    with pytest.raises(SystemExit):
        ruler_table.parse_args(["--out", out, "--methods", "snapkv", "--ratios", "1.0"])
    args = ruler_table.parse_args(["--out", out, "--methods", "snapkv", "uncompressed"])
    assert args.instances == tmp_path / "r.instances.json" and args.plot == tmp_path / "r.png"
    assert args.length == 4096 and tuple(args.tasks) == ruler_table.OFFLINE_TASKS


def test_saved_instances_serve_a_split_of_the_tasks_and_other_settings_are_refused(tmp_path):
    """A run of some of the tasks reads their instances from the file another split wrote (nothing
    is built: lm-eval is not needed when the file has them)."""
    path = tmp_path / "r.instances.json"
    settings = {"length": 2048, "limit": 2, "prompt": "chat"}
    instances = [{"id": f"{task}/{i}", "task": task} for task in ("niah_single_1", "ruler_vt") for i in range(2)]
    path.write_text(json.dumps({"settings": settings, "lm_eval": "0.4.13", "tokenizer": "t", "instances": instances}))
    args = ruler_table.parse_args(["--out", str(tmp_path / "r.jsonl"), "--methods", "snapkv", "--length", "2048",
                                   "--limit", "2", "--tasks", "ruler_vt"])  # fmt: skip
    assert [i["id"] for i in ruler_table.load_instances(args, None, "t")] == ["ruler_vt/0", "ruler_vt/1"]
    args.prompt = "plain"
    with pytest.raises(SystemExit, match="holds"):
        ruler_table.load_instances(args, None, "t")
