"""Probe grids, presets, determinism, haystack sources, the CLI and answer scoring."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from transformers import ByT5Tokenizer

from needles import (
    PRESETS,
    HaystackError,
    ProbeSpec,
    answer_is_correct,
    generate_probes,
    load_probes,
    make_haystack,
    prose_haystack,
    write_probes,
)
from needles.cli import main as cli_main
from needles.families import FAMILIES
from needles.haystacks import join_units
from needles.probe import Probe

SMALL = ProbeSpec(lengths=(512, 768), depths=(20.0, 80.0))


def test_presets_have_the_documented_grids():
    assert PRESETS["smoke"].size == 2 * len(FAMILIES)
    quick = PRESETS["quick"]
    assert 50 <= quick.size <= 70 and max(quick.lengths) <= 4096
    paper = PRESETS["paper"]
    assert paper.lengths == tuple(1024 * k for k in range(1, 31))
    assert len(paper.depths) == 33 and paper.depths[0] == 2.0 and paper.depths[-1] == 98.0
    assert all(b - a == 3.0 for a, b in itertools.pairwise(paper.depths))
    assert set(paper.families) == set(FAMILIES)
    json.dumps(paper.to_dict())


def test_spec_validation():
    with pytest.raises(ValueError, match="unknown needle families"):
        ProbeSpec(families=("nope",))
    with pytest.raises(ValueError, match="depths"):
        ProbeSpec(depths=(101.0,))
    with pytest.raises(ValueError, match="count"):
        ProbeSpec(count=0)
    with pytest.raises(ValueError, match="unknown probe preset"):
        list(generate_probes("huge", ByT5Tokenizer()))
    with pytest.raises(TypeError, match="tokenizer object"):  # needles never loads a model itself
        list(generate_probes("smoke", "HuggingFaceTB/SmolLM2-135M-Instruct"))


def test_grid_probes_have_their_metadata_and_lengths(embedded_tokenizer):
    probes = list(generate_probes(SMALL, embedded_tokenizer))
    assert len(probes) == SMALL.size
    assert len({p.id for p in probes}) == len(probes)
    for probe in probes:
        assert abs(len(probe.input_ids) - probe.length) <= 0.02 * probe.length
        assert probe.spans and 0 < probe.context_end < len(probe.input_ids)
        assert all(s.end <= probe.context_end for s in probe.spans)
        assert probe.meta["haystack"] == "simple"
        assert Probe.from_json(probe.to_json()) == probe
        # question-agnostic split: the context prefix holds the needle but not the question
        assert probe.context_ids() + probe.question_ids() == probe.input_ids
        assert probe.question not in embedded_tokenizer.decode(probe.context_ids())
        assert probe.question in embedded_tokenizer.decode(probe.question_ids())


def test_same_spec_and_seed_are_byte_identical(embedded_tokenizer, tmp_path):
    first = tmp_path / "a.jsonl"
    second = tmp_path / "b.jsonl"
    write_probes(generate_probes(SMALL, embedded_tokenizer), first)
    write_probes(generate_probes(SMALL, embedded_tokenizer), second)
    assert first.read_bytes() == second.read_bytes()
    # and in a fresh interpreter (different hash randomisation)
    code = (
        "import sys; from needles import *; from common.models import load_tokenizer; "
        "spec = ProbeSpec(lengths=(512, 768), depths=(20.0, 80.0)); "
        "write_probes(generate_probes(spec, load_tokenizer()), sys.argv[1])"
    )
    third = tmp_path / "c.jsonl"
    subprocess.run([sys.executable, "-c", code, str(third)], check=True, env={"PYTHONHASHSEED": "123", **_env()})
    assert third.read_bytes() == first.read_bytes()


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


def test_distinct_seeds_give_distinct_needles(embedded_tokenizer):
    spec = ProbeSpec(lengths=(512,), depths=(50.0,))
    answers = {}
    for seed in range(3):
        for probe in generate_probes(spec.replace(seed=seed), embedded_tokenizer):
            answers.setdefault(probe.family, []).append((probe.question, probe.answer, tuple(probe.input_ids)))
    for family, items in answers.items():
        assert len(set(items)) == 3, family
        assert len({ids for _, _, ids in items}) == 3


def test_load_probes_round_trip_and_bad_lines(embedded_tokenizer, tmp_path):
    probes = list(generate_probes(PRESETS["smoke"].replace(families=("counting",)), embedded_tokenizer))
    path = tmp_path / "p.jsonl"
    assert write_probes(probes, path) == 2
    assert load_probes(path) == probes
    assert [p.name for p in tmp_path.iterdir()] == ["p.jsonl"]  # no partial file left behind
    path.write_text(path.read_text() + "{not json}\n")
    with pytest.raises(ValueError, match=":3:"):
        load_probes(path)


def test_cli_writes_probes_and_shows_coloured_spans(embedded_tokenizer, tmp_path, capsys, monkeypatch):
    out = tmp_path / "probes.jsonl"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # colour only on a terminal (tests/test_cli_output.py)
    monkeypatch.delenv("NO_COLOR", raising=False)
    code = cli_main(
        [
            "--preset",
            "smoke",
            "--families",
            "comparison,retrieval",
            "--out",
            str(out),
            "--show",
            "2",
            "--quiet",
            "--seed",
            "4",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4
    for record in records:
        for key in ("id", "family", "length", "depth", "seed", "question", "answer", "input_ids", "spans"):
            assert key in record
        assert record["seed"] == 4
        assert all(set(span) == {"label", "start", "end"} and span["label"] in "RBD" for span in record["spans"])
    shown = capsys.readouterr().out
    assert "\033[1;32m" in shown and "\033[33m" in shown and "\033[31m" in shown  # R, B, D colours
    first = load_probes(out)[0]
    assert first.answer in shown and first.question in shown


def test_cli_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for word in ("--preset", "--model", "--seed", "--out", "--show", "paper", "retrieval", "context_end"):
        assert word in help_text
    with pytest.raises(SystemExit) as exited:  # a usage error: one line, exit 2
        cli_main(["--out", str(tmp_path / "x.jsonl"), "--families", "nope", "--quiet"])
    assert exited.value.code == 2
    assert "unknown family 'nope'" in capsys.readouterr().err


def test_simple_and_prose_haystacks_are_deterministic_per_seed():
    for name in ("simple", "prose"):
        haystack = make_haystack(name)

        def take(seed, haystack=haystack):
            return list(itertools.islice(haystack.sentences(seed), 50))

        assert take(1) == take(1) and take(1) != take(2)
        assert all(s.strip().endswith(".") for s in take(3))
    prose = join_units(list(itertools.islice(make_haystack("prose").sentences(0), 200)))
    assert "\n\n" in prose and len(set(prose.split(". "))) > 100  # paragraphs, varied sentences


def test_prose_haystack_for_calibration(embedded_tokenizer):
    text = prose_haystack(embedded_tokenizer, 700, seed=2)
    assert len(embedded_tokenizer(text, add_special_tokens=False)["input_ids"]) >= 700
    assert text == prose_haystack(embedded_tokenizer, 700, seed=2)


def _corpus(n=60):
    return [
        f"Document {i} talks about the harbour. It was written in spring number {i}. Nobody read it twice."
        for i in range(n)
    ]


def test_text_file_haystack(embedded_tokenizer, tmp_path):
    (tmp_path / "docs").mkdir()
    for i, doc in enumerate(_corpus()):
        (tmp_path / "docs" / f"{i:03d}.txt").write_text(doc + "\n")
    (tmp_path / "docs" / "ignored.bin").write_bytes(b"\x00\x01")
    spec = ProbeSpec(families=("retrieval",), lengths=(1024,), depths=(50.0,), haystack=f"files:{tmp_path / 'docs'}")
    probe = next(generate_probes(spec, embedded_tokenizer))
    text = embedded_tokenizer.decode(probe.input_ids)
    assert "talks about the harbour" in text and abs(len(probe.input_ids) - 1024) <= 21
    with pytest.raises(HaystackError):
        make_haystack(f"files:{tmp_path / 'missing'}")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "saved"])
def test_dataset_haystack_from_local_files(embedded_tokenizer, tmp_path, fmt):
    import datasets

    data = datasets.Dataset.from_dict({"body": _corpus(), "id": list(range(60))})
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        data.to_json(str(path))
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        data.to_csv(str(path))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        data.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        data.save_to_disk(str(path))
    spec = ProbeSpec(
        families=("counting",), lengths=(768,), depths=(30.0,), haystack=f"dataset:{path}", text_column="body"
    )
    probe = next(generate_probes(spec, embedded_tokenizer))
    assert "talks about the harbour" in embedded_tokenizer.decode(probe.input_ids)
    assert probe.meta["haystack"] == f"dataset:{path}"
    with pytest.raises(HaystackError, match="no column"):
        next(generate_probes(spec.replace(text_column="text"), embedded_tokenizer))


def test_answer_is_correct_is_a_normalised_substring_match(embedded_tokenizer):
    probe = next(generate_probes(PRESETS["smoke"].replace(families=("temporal",)), embedded_tokenizer))
    answer = probe.answer  # e.g. "Cedar Room"
    assert answer_is_correct(f"It is held in the {answer}.", probe)
    assert answer_is_correct(f"  it is in the\n{answer.upper().replace(' ', '   ')} ", probe)
    assert not answer_is_correct("It is held in the kitchen.", probe)
    assert not answer_is_correct("", probe)
    assert answer_is_correct("the number 1234567!", "1234567")
