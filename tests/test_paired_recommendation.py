"""The recommendation section decided by paired evidence (profiler.recommendation with
profiler.paired_decision), its per-task outcomes in the artifact (schema 1.4), and
``evaluate-artifact --write-recommendation`` adding tasks to them."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from conftest import make_random_artifact

from artifacts import ArtifactError, Section, open_artifact, reader, write_artifact
from artifacts.schema import SECTIONS
from profiler.evaluate_cli import write_recommendation
from profiler.paired_decision import DEFAULT_CONFIDENCE, DEFAULT_TOLERANCE, RULE, loss_bound
from profiler.recommendation import FALLBACK_RULE, recommendation_section
from runtime.plan.policy_spec import parse_policy
from runtime.plan.recommendation import Recommendation

CHEAP, FLAGSHIP = "inf/keydiff+correction", "inf/leverage+correction"
RATIOS = (0.5, 0.75)


def evaluation(outcomes: dict, baseline: list[bool], seed: int) -> dict:
    """An evaluation record as profiler.evaluation.evaluate returns it: ``outcomes`` maps
    (policy, ratio) to per-task booleans, the tasks named after ``seed``."""
    n = len(baseline)
    results = [
        {"policy": policy, "compression_ratio": ratio, "n": n, "accuracy": sum(row) / n, "outcomes": list(row)}
        for (policy, ratio), row in outcomes.items()
    ]
    return {
        "question_aware": False,
        "task_ids": [f"retrieval-L1024-D50-S{seed}-R{i}" for i in range(n)],
        "baseline": {"policy": "baseline", "n": n, "accuracy": sum(baseline) / n, "outcomes": list(baseline)},
        "results": results,
        "tasks": {
            "seed": seed,
            "families": ["retrieval"],
            "haystacks": ["simple"],
            "specs": [{"families": ["retrieval"], "seed": seed}],
        },
    }


def alternating(n: int, flip: int = 0) -> list[bool]:
    """Right on even tasks; the first ``flip`` odd tasks right too (wins against it)."""
    return [i % 2 == 0 or (i % 2 == 1 and i // 2 < flip) for i in range(n)]


def same_everywhere(n: int, seed: int, cheap_wins_at_075: int = 0) -> dict:
    reference = alternating(n)
    rows = {
        (CHEAP, 0.5): reference,
        (FLAGSHIP, 0.5): reference,
        (CHEAP, 0.75): alternating(n, cheap_wins_at_075),
        (FLAGSHIP, 0.75): reference,
    }
    return evaluation(rows, [True] * n, seed)


def test_on_24_tasks_the_flagship_stays_where_the_most_accurate_rule_took_the_cheaper_one():
    run = same_everywhere(24, seed=7, cheap_wins_at_075=1)
    section = recommendation_section(run, [CHEAP, FLAGSHIP], 7, "retrieval")
    # equal at 0.5 and one task better at 0.75: the old rule served the cheap policy at both
    assert [name.decode() for name in section["policy"]] == [FLAGSHIP, FLAGSHIP]
    assert section["rule"][0].decode() == RULE and list(section["reference"]) == [1, 1]
    assert section["tolerance"][0] == DEFAULT_TOLERANCE and section["confidence"][0] == DEFAULT_CONFIDENCE
    assert section["wins"].tolist() == [[0, 0], [1, 0]] and section["losses"].tolist() == [[0, 0], [0, 0]]
    assert section["bound"][1, 0] == pytest.approx(loss_bound(1, 0, 24)) and section["bound"][1, 0] > 0.03
    assert section["outcomes"].shape == (2, 2, 24) and section["outcomes"][1, 0].sum() == 13
    assert section["candidate_accuracy"][:, 1].tolist() == [13 / 24, 12 / 24]
    assert section["accuracy"].tolist() == [0.5, 0.5] and section.attrs["tasks"] == 24
    assert [task.decode() for task in section["task_ids"]][:2] == [
        "retrieval-L1024-D50-S7-R0",
        "retrieval-L1024-D50-S7-R1",
    ]


def test_a_clearly_better_cheaper_candidate_replaces_the_flagship():
    run = same_everywhere(60, seed=7, cheap_wins_at_075=25)
    section = recommendation_section(run, [CHEAP, FLAGSHIP], 7, "retrieval")
    assert [name.decode() for name in section["policy"]] == [FLAGSHIP, CHEAP]
    assert section["bound"][1, 0] < 0 and section["accuracy"][1] == 55 / 60


def test_without_the_flagship_the_most_accurate_is_served_and_the_rule_says_so():
    run = same_everywhere(24, seed=7, cheap_wins_at_075=1)
    run["results"] = [r for r in run["results"] if r["policy"] == CHEAP] + [
        {**r, "policy": "inf/leverage"} for r in run["results"] if r["policy"] == FLAGSHIP
    ]
    section = recommendation_section(run, [CHEAP, "inf/leverage"], 7, "retrieval")
    # equal at 0.5 (ties to the cheaper), one task better at 0.75
    assert [name.decode() for name in section["policy"]] == [CHEAP, CHEAP]
    assert section["rule"][0].decode() == FALLBACK_RULE and list(section["reference"]) == [-1, -1]
    assert not section["wins"].any() and np.all(section["bound"] == 1.0)


def test_cells_that_ran_other_tasks_are_refused():
    run = same_everywhere(24, seed=7)
    run["results"][0]["outcomes"] = run["results"][0]["outcomes"][:23]
    with pytest.raises(ValueError, match="same 24 tasks"):
        recommendation_section(run, [CHEAP, FLAGSHIP], 7, "retrieval")


@pytest.fixture()
def artifact(tmp_path):
    """An artifact whose recommendation was decided on 24 tasks of seed 7."""
    base = make_random_artifact(sections=("behaviour", "budgets", "moments"))  # the flagship's sections
    base.sections["recommendation"] = recommendation_section(same_everywhere(24, 7), [CHEAP, FLAGSHIP], 7, "retrieval")
    base.config["recommendation"] = {"tasks": {"seed": 7}, "source": "test"}
    return write_artifact(tmp_path / "kv_calibration.h5", base)


POLICIES = [parse_policy("baseline"), parse_policy(CHEAP), parse_policy(FLAGSHIP)]


def test_write_recommendation_adds_tasks_and_decides_again_on_all(artifact):
    # 24 identical tasks cannot show the cheap policy within 3 points; 24 + 100 can
    line = write_recommendation(artifact, same_everywhere(100, seed=8), POLICIES)
    assert "124 tasks added to the recorded tasks" in line
    with open_artifact(artifact) as opened:
        section = opened.section("recommendation")
        ids = [task.decode() for task in section["task_ids"]]
        assert len(ids) == 124 and ids[0].endswith("S7-R0") and ids[24].endswith("S8-R0")
        assert [name.decode() for name in section["policy"]] == [CHEAP, CHEAP]
        assert section["bound"][0, 0] == pytest.approx(loss_bound(0, 0, 124)) and section["bound"][0, 0] <= 0.03
        assert section.attrs["tasks"] == 124 and section.attrs["task_seed"] == 8
        assert opened.config["recommendation"]["earlier_tasks"] == [{"seed": 7}]
        assert {"behaviour", "budgets"} <= set(opened.sections)
    # the same tasks again count once, with their new outcomes
    write_recommendation(artifact, same_everywhere(100, seed=8), POLICIES)
    with open_artifact(artifact) as opened:
        assert opened.section("recommendation").attrs["tasks"] == 124
    # replacing instead: this run's tasks alone
    write_recommendation(artifact, same_everywhere(24, seed=9), POLICIES, extend=False)
    with open_artifact(artifact) as opened:
        section = opened.section("recommendation")
        assert section.attrs["tasks"] == 24 and [name.decode() for name in section["policy"]] == [FLAGSHIP] * 2


def test_another_grid_starts_afresh(artifact):
    run = same_everywhere(100, seed=8)
    run["results"] = [{**r, "compression_ratio": r["compression_ratio"] + 0.1} for r in run["results"]]
    assert "100 tasks recorded" in write_recommendation(artifact, run, POLICIES)
    with open_artifact(artifact) as opened:
        assert list(opened.section("recommendation")["compression_ratios"]) == [0.6, 0.85]


def test_the_reader_checks_the_evidence_against_the_outcomes(artifact):
    with h5py.File(artifact, "r+") as h5:
        h5["recommendation/wins"][1, 0] = 3
    with open_artifact(artifact) as opened, pytest.raises(ArtifactError, match="do not count the outcomes"):
        opened.section("recommendation")
    section = Section(dict(recommendation_section(same_everywhere(24, 7), [CHEAP, FLAGSHIP], 7, "r").arrays), {})
    section.arrays["candidate_accuracy"] = section["candidate_accuracy"] * 0.5
    broken = make_random_artifact(sections=("behaviour", "moments"))
    broken.sections["recommendation"] = Section(
        section.arrays, {"tasks": 24, "baseline_accuracy": 1.0, "task_seed": 7, "families": "r"}
    )
    with pytest.raises(ArtifactError, match="share of the outcomes"):
        write_artifact(artifact.parent / "b.h5", broken)
    del broken.sections["recommendation"].arrays["wins"]
    with pytest.raises(ArtifactError, match=r"\['wins'\] missing"):
        write_artifact(artifact.parent / "b.h5", broken)


def test_a_1_3_file_without_outcomes_still_reads_and_serves(artifact):
    optional = SECTIONS["recommendation"].optional
    with h5py.File(artifact, "r+") as h5:
        for name in optional:
            del h5["recommendation"][name]
        h5.attrs["schema_version"] = "1.3"
    with open_artifact(artifact) as opened:
        section = opened.section("recommendation")
        assert set(section.arrays) == set(SECTIONS["recommendation"].datasets) - set(optional)
        served = Recommendation.from_section(section.arrays, section.attrs)
        assert served.policies == (FLAGSHIP, FLAGSHIP) and served.tasks == 24
        with pytest.raises(ArtifactError, match="optional dataset"):
            opened.read("recommendation", "outcomes")
    # and write_recommendation on it records this run's tasks (nothing to extend)
    assert "100 tasks recorded" in write_recommendation(artifact, same_everywhere(100, seed=8), POLICIES)


def test_a_1_3_reader_skips_the_evidence_and_verifies_both_digests(artifact, monkeypatch):
    spec = SECTIONS["recommendation"]
    old = type(spec)(
        spec.description,
        {k: v for k, v in spec.datasets.items() if k not in spec.optional},
        spec.attrs,
        spec.attr_bounds,
    )
    monkeypatch.setattr(reader, "SCHEMA_MINOR", 3)
    monkeypatch.setattr(reader, "SECTIONS", {**SECTIONS, "recommendation": old})
    with reader.open_artifact(artifact) as opened:
        assert opened.schema_version == "1.6" and "recommendation" in opened.sections
        assert [name.decode() for name in opened.read("recommendation", "policy")] == [FLAGSHIP, FLAGSHIP]


def test_the_summary_and_the_report_show_the_rule_and_the_evidence(artifact):
    from artifacts.report import render_report
    from artifacts.summary import format_summary, summarize

    with open_artifact(artifact) as opened:
        summary, page = summarize(opened), render_report(opened)
    decision = summary["sections"]["recommendation"]["decision"]
    assert decision["rule"] == RULE and decision["reference"] == [FLAGSHIP, FLAGSHIP]
    assert decision["evidence"][0][CHEAP] == {"wins": 0, "losses": 0, "bound": pytest.approx(loss_bound(0, 0, 24))}
    assert f"decided by {RULE} (tolerance 0.03, confidence 0.95; reference {FLAGSHIP})" in format_summary(summary)
    assert 'id="paired-rule"' in page and "+0/-0" in page


def test_a_run_of_more_policies_extends_the_recorded_candidates_and_leaves_the_others_out(artifact):
    """evaluate-artifact's default policies include artifact-free references the stage never measured."""
    run = same_everywhere(100, seed=8)
    run["results"] += [{**r, "policy": "uniform/keydiff"} for r in run["results"] if r["policy"] == CHEAP]
    line = write_recommendation(artifact, run, [*POLICIES, parse_policy("uniform/keydiff")])
    assert "124 tasks added" in line
    with open_artifact(artifact) as opened:
        section = opened.section("recommendation")
        assert [name.decode() for name in section["candidates"]] == [CHEAP, FLAGSHIP]
        assert opened.config["recommendation"]["candidates"] == [CHEAP, FLAGSHIP]


def test_the_tolerance_and_confidence_given_are_applied_and_recorded(artifact):
    # 124 identical tasks bound the accuracy given up by 0.029 at 95%, 0.024 at 90%: not within 2 points
    write_recommendation(artifact, same_everywhere(100, seed=8), POLICIES, tolerance=0.02, confidence=0.9)
    with open_artifact(artifact) as opened:
        section = opened.section("recommendation")
        assert section["tolerance"][0] == 0.02 and section["confidence"][0] == 0.9
        assert section["bound"][0, 0] == pytest.approx(loss_bound(0, 0, 124, 0.9))
        assert [name.decode() for name in section["policy"]] == [FLAGSHIP, FLAGSHIP]


def test_write_recommendation_refuses_an_artifact_replaced_during_the_run(artifact):
    """The run measured the artifact whose SHA-256 it read at the start; another valid artifact of the
    same model put in its place meanwhile (other moments orders) is refused, nothing written into it."""
    import hashlib

    started = hashlib.sha256(artifact.read_bytes()).hexdigest()
    other = make_random_artifact(seed=3, sections=("behaviour", "budgets", "moments"))
    other.sections["recommendation"] = recommendation_section(same_everywhere(24, 7), [CHEAP, FLAGSHIP], 7, "retrieval")
    write_artifact(artifact, other)
    replaced = artifact.read_bytes()
    with pytest.raises(ValueError, match="changed since the run read it"):
        write_recommendation(artifact, same_everywhere(100, seed=8), POLICIES, expected_sha256=started)
    assert artifact.read_bytes() == replaced
    # the artifact as read at the start is written into
    now = hashlib.sha256(replaced).hexdigest()
    assert "124 tasks" in write_recommendation(artifact, same_everywhere(100, seed=8), POLICIES, expected_sha256=now)
