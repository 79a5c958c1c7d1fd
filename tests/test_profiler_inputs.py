"""Calibration text sources, probe files and the resume work file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from needles.probe import Probe, Span
from profiler.calibration_text import calibration_windows
from profiler.checkpoint import WorkFileMismatch, load_work, save_work, work_file_path
from profiler.probe_source import file_probes, preset_probes, probes_digest


def test_windows_from_local_files(tmp_path, embedded_tokenizer):
    (tmp_path / "a.txt").write_text("Rivers carve valleys over many thousands of years. " * 40)
    records = [{"text": f"Record {i} tells of a lighthouse keeper and his dog."} for i in range(30)]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    windows = calibration_windows(embedded_tokenizer, str(tmp_path / "a.txt"), 3, 50)
    assert windows.shape == (3, 50) and windows.dtype.is_floating_point is False
    expected = embedded_tokenizer("Rivers carve valleys over many thousands of years. " * 40, add_special_tokens=False)[
        "input_ids"
    ][:150]
    assert windows.reshape(-1).tolist() == expected  # cut in order from the token stream
    both = calibration_windows(embedded_tokenizer, f"{tmp_path / 'b.jsonl'},{tmp_path / 'a.txt'}", 4, 64)
    assert both.shape == (4, 64)
    directory = calibration_windows(embedded_tokenizer, str(tmp_path), 2, 40)  # a.txt, b.jsonl sorted
    assert directory[0].tolist() == windows.reshape(-1)[:40].tolist()


def test_windows_from_a_local_datasets_directory(tmp_path, embedded_tokenizer):
    directory = tmp_path / "csv-dataset"
    directory.mkdir()
    rows = ["body,text"] + [f"{i},A lighthouse keeper counted {i} ships before dawn." for i in range(60)]
    (directory / "train.csv").write_text("\n".join(rows) + "\n")
    windows = calibration_windows(embedded_tokenizer, str(directory), 2, 32)
    first = embedded_tokenizer("A lighthouse keeper counted 0 ships before dawn.", add_special_tokens=False)[
        "input_ids"
    ]
    assert windows.shape == (2, 32) and windows[0, : len(first)].tolist() == first
    with pytest.raises(ValueError, match="no 'story' field"):
        calibration_windows(embedded_tokenizer, str(directory), 2, 32, field="story")


def test_windows_errors_are_clear(tmp_path, embedded_tokenizer):
    (tmp_path / "short.txt").write_text("Too short.")
    with pytest.raises(ValueError, match="too short"):
        calibration_windows(embedded_tokenizer, str(tmp_path / "short.txt"), 4, 64)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(ValueError, match="'text' field"):
        calibration_windows(embedded_tokenizer, str(tmp_path / "bad.jsonl"), 1, 4)


def test_default_windows_come_from_the_prose_haystack(embedded_tokenizer):
    first = calibration_windows(embedded_tokenizer, None, 2, 128, seed=1)
    again = calibration_windows(embedded_tokenizer, None, 2, 128, seed=1)
    other = calibration_windows(embedded_tokenizer, None, 2, 128, seed=2)
    assert first.shape == (2, 128) and np.array_equal(first, again) and not np.array_equal(first, other)


def test_probe_file_round_trip(tmp_path):
    probes = [
        Probe(
            id=f"p{i}",
            family="hand",
            length=20,
            depth=10.0,
            seed=i,
            question="q",
            answer="a",
            input_ids=list(range(1, 21)),
            spans=[Span("R", 2, 4)],
            context_end=15,
        )
        for i in range(3)
    ]
    path = tmp_path / "probes.jsonl"
    path.write_text("\n".join(p.to_json() for p in probes) + "\n")
    probe_set = file_probes(path)
    assert [probe_set[i] for i in range(len(probe_set))] == probes
    assert probe_set.digest == probes_digest(probes) != probes_digest(probes[:2])
    path.write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="not a probe record"):
        file_probes(path)
    path.write_text("\n")
    with pytest.raises(ValueError, match="no probes"):
        file_probes(path)


def test_work_file_round_trip_and_mismatch(tmp_path):
    out = tmp_path / "kv.h5"
    path = work_file_path(out)
    assert path.name == "kv.h5.work.npz" and work_file_path(out, 1, 2).name == "kv.h5.work-rank1of2.npz"
    assert load_work(path, "abc") is None
    arrays = {"x": np.arange(5, dtype=np.float64) / 3}
    save_work(path, "abc", {"behaviour": 3}, arrays)
    progress, loaded = load_work(path, "abc")
    assert progress == {"behaviour": 3} and np.array_equal(loaded["x"], arrays["x"])
    assert not list(tmp_path.glob(".*tmp"))  # no temporary left behind
    with pytest.raises(WorkFileMismatch, match="different job"):
        load_work(path, "other")
    path.write_bytes(b"garbage")
    with pytest.raises(WorkFileMismatch, match="cannot read"):
        load_work(path, "abc")


def test_lazy_needles_probe_set_equals_generate_probes(embedded_tokenizer):
    from needles import PRESETS, generate_probes

    probe_set = preset_probes("smoke", embedded_tokenizer, "tok")
    expected = list(generate_probes(PRESETS["smoke"], embedded_tokenizer))
    assert len(probe_set) == len(expected)
    assert [probe_set[i] for i in range(len(probe_set))] == expected
    assert probe_set.table["probe_length"].tolist() == [p.length for p in expected]
    assert probe_set.table["probe_family"].tolist() == [p.family.encode() for p in expected]
    assert probe_set.digest == preset_probes("smoke", embedded_tokenizer, "tok").digest
    assert probe_set.digest != preset_probes("smoke", embedded_tokenizer, "other").digest
    assert probe_set.config["preset"] == "smoke" and probe_set.config["source"] == "needles"


def test_file_probe_set(tmp_path):
    probes = [
        Probe(
            id=f"p{i}",
            family="hand",
            length=20 + i,
            depth=10.0,
            seed=i,
            question="q",
            answer="a",
            input_ids=list(range(1, 22 + i)),
            spans=[Span("R", 2, 4)],
            context_end=15,
        )
        for i in range(3)
    ]
    path = tmp_path / "probes.jsonl"
    path.write_text("\n".join(p.to_json() for p in probes))
    probe_set = file_probes(path)
    assert len(probe_set) == 3 and probe_set[2] == probes[2] and probe_set.max_tokens() == 23
    assert probe_set.table["probe_seed"].tolist() == [0, 1, 2]
