"""Held-out tasks: every family on both haystacks, seeds the profiler never used, unique ids."""

from __future__ import annotations

import pytest

from needles import FAMILIES, PRESETS
from profiler.evaluation_results import EVALUATION_SEED_OFFSET
from profiler.held_out_tasks import HAYSTACKS, held_out_tasks
from profiler.presets import PRESETS as PROFILE_PRESETS


def _quick_base():
    preset = PROFILE_PRESETS["quick"]
    return PRESETS[preset.probes].replace(**dict(preset.probe_overrides))


def test_the_quick_recommendation_measures_70_tasks_of_every_family_on_both_haystacks():
    """Issue 26: at least 60 tasks on quick, from every family and both haystacks, at the preset's lengths,
    at other depths than the profiled probes'."""
    from profiler.stages.recommendation import TASK_FAMILIES

    preset = PROFILE_PRESETS["quick"]
    base = _quick_base()
    tasks = held_out_tasks(
        base,
        families=TASK_FAMILIES,
        count=preset.recommendation_count,
        profiler_seed=base.seed,
        model_context=8192,
        depths=dict(preset.recommendation_depths),
    )
    assert TASK_FAMILIES == tuple(FAMILIES) and tasks.haystacks == HAYSTACKS == ("simple", "prose")
    assert tasks.size == len(FAMILIES) * 2 * (4 + 1) == 70
    assert tasks.lengths == base.lengths == (1024, 2048)
    assert not {d for spec in tasks.specs for d in spec.depths} & set(base.depths)
    seeds = [base.seed + EVALUATION_SEED_OFFSET + i for i in range(2)]
    assert [spec.seed for spec in tasks.specs] == [seeds[0], seeds[0], seeds[1], seeds[1]]
    assert tasks.describe().startswith(
        "70 tasks: 7 families x 2 haystacks (simple, prose) x (1024 tokens at depths 10,40,60,90; "
        "2048 tokens at depths 50) x 1; seeds"
    )
    assert [spec["haystack"] for spec in tasks.to_dict()["specs"]] == ["simple", "simple", "prose", "prose"]


def test_task_ids_are_unique_across_haystacks_and_the_probes_say_their_haystack(embedded_tokenizer):
    base = PRESETS["smoke"]
    tasks = held_out_tasks(base, families=("retrieval", "counting"), count=1, profiler_seed=0, model_context=2048)
    probes = tasks.probes(embedded_tokenizer)
    assert len(probes) == tasks.size == 2 * 2 * len(base.lengths) * len(base.depths)
    assert len({probe.id for probe in probes}) == len(probes)
    assert [probe.meta["haystack"] for probe in probes].count("prose") == len(probes) // 2
    # the same cell on the two haystacks holds another needle (its own seed)
    first = {(p.family, p.length, p.depth): p.answer for p in probes if p.meta["haystack"] == "simple"}
    second = {(p.family, p.length, p.depth): p.answer for p in probes if p.meta["haystack"] == "prose"}
    assert first.keys() == second.keys() and first != second


def test_a_task_seed_that_is_the_profilers_is_refused():
    base = PRESETS["smoke"]
    for seed in (7, 6):  # the first haystack's seed, or the second's (seed + 1)
        with pytest.raises(ValueError, match="include the profiler's probe seed 7"):
            held_out_tasks(base, families=("retrieval",), count=1, profiler_seed=7, model_context=2048, seed=seed)
    with pytest.raises(ValueError, match="distinct haystacks"):
        held_out_tasks(base, families=("retrieval",), count=1, profiler_seed=0, model_context=2048, haystacks=())
