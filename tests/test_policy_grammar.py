"""The torch-free policy grammar (common.policy_grammar) against the runtime's own checks: every
combination of allocation, scorer, statistics and suffixes is refused by both or by neither, and
reads the same sections."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from common.names import ALLOCATIONS, SCORER_NAMES, STATISTICS
from common.policy_grammar import MOMENT_SUFFIXES, sections_needed, serving_refusal, split_policy
from runtime.plan.policy import REQUIREMENTS
from runtime.plan.policy_spec import parse_policy

SUFFIX_RUNS = [()] + [(s,) for s in MOMENT_SUFFIXES] + list(itertools.permutations(MOMENT_SUFFIXES, 2))


def _texts():
    for allocation, scorer, statistics, suffixes in itertools.product(
        ALLOCATIONS, SCORER_NAMES, (None, *STATISTICS), SUFFIX_RUNS
    ):
        yield f"{allocation}/{scorer}{':' + statistics if statistics else ''}{''.join('+' + s for s in suffixes)}"


@pytest.mark.parametrize(
    "text",
    [
        "inf/keydiff+correction0+correction1",
        "inf/keydiff+correction+correction",
        "uniform/snapkv+moments+moments",
        "inf/leverage+correction1+correction",
    ],
)
def test_a_suffix_given_twice_or_two_corrections_are_refused(text):
    with pytest.raises(ValueError, match="give each suffix once and at most one of"):
        parse_policy(text)


def test_every_combination_is_refused_by_the_grammar_exactly_when_the_runtime_refuses_it():
    disagree = []
    for text in _texts():
        try:
            spec = parse_policy(text)
        except ValueError:
            spec = None
        try:
            parts = split_policy(text)
        except ValueError:
            parts = None
        if (spec is None) != (parts is None):
            disagree.append(text)
            continue
        if spec is not None:
            runtime_sections = [requirement.section for requirement in spec.policy(0.5).requirements()]
            if [need[0] for need in sections_needed(parts)] != runtime_sections:
                disagree.append(f"{text}: {sections_needed(parts)} vs {runtime_sections}")
    assert disagree == []


def test_requirements_say_what_each_section_the_grammar_knows_is():
    from common.policy_grammar import SECTION_ORDER

    assert [r.section for r in REQUIREMENTS] == list(SECTION_ORDER)


@pytest.mark.parametrize(
    "text, sections, reason",
    [
        ("@@garbage@@", {"budgets"}, "is not 'baseline', a named policy"),
        ("inf/nonexistent", {"budgets"}, "unknown scorer 'nonexistent'"),
        ("global/kvzip", {"budgets"}, "reconstruction pass per prompt"),
        ("baseline", {"budgets"}, "'baseline' compresses nothing"),
        ("inf/leverage+correction", {"budgets"}, "needs the section 'moments'"),
        ("inf/leverage", {"query_stats"}, "needs the section 'budgets' or 'behaviour'"),
    ],
)
def test_serving_refusal_says_why(text, sections, reason):
    assert reason in serving_refusal(text, sections)


def test_a_servable_policy_has_no_refusal_and_the_grammar_imports_no_torch():
    assert serving_refusal("flagship", {"behaviour", "moments"}) is None
    assert serving_refusal("uniform/keydiff", set()) is None
    code = "import sys, common.policy_grammar; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )
