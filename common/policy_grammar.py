"""The policy grammar without torch: the spelling of a policy, what it reads from an artifact, and
whether an artifact can serve it, for the artifact reader and the command-line parsers.

    split_policy("inf/keydiff+correction")        # PolicyText(allocation='inf', scorer='keydiff', ...)
    serving_refusal("global/kvzip", sections)      # why a file with ``sections`` cannot serve it, or None

Grammar: ``baseline``, a name in ``common.names.NAMED_POLICIES``, or
``ALLOCATION/SCORER[:STATISTICS][+SUFFIX]...``; each suffix at most once and at most one
correction suffix.  :func:`runtime.plan.policy_spec.parse_policy` parses with :func:`split_policy`
and builds the :class:`runtime.plan.policy.CompressionPolicy`, which checks the combinations again
with the scorers themselves; the tables below state, without importing a scorer, what those
checks and ``runtime.plan.policy.REQUIREMENTS`` decide (tests/test_policy_grammar.py checks every
combination against them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .names import ALLOCATIONS, NAMED_POLICIES, SCORER_NAMES, STATISTICS

BASELINE = "baseline"

# ``+SUFFIX`` MomentKV switches -> CompressionPolicy fields
MOMENT_SUFFIXES = {
    "correction": {"correction": "calibrated"},  # each head's order from the artifact's moments section
    "correction0": {"correction": "order0"},
    "correction1": {"correction": "order1"},
    "moments": {"moment_eviction": True},  # moment-informed eviction, a_j ||r_j||
}

# What the scorers are, stated once (runtime/scorers/base.py sets a registered scorer class's
# ``comparable`` and ``yields_attention`` from these): scores comparable across heads (the only
# ones allocation 'global' ranks), an attention estimate (what moment eviction needs), a
# reconstruction pass per prompt (kvzip: measured by evaluate-artifact, never served from an artifact).
COMPARABLE_SCORERS = ("kvzip", "learned")
ATTENTION_SCORERS = ("expected_attention", "prototype_attention", "snapkv")
RECONSTRUCTION_SCORERS = ("kvzip",)


@dataclass(frozen=True)
class PolicyText:
    """A policy as written: ``baseline`` (allocation None) or its parts."""

    name: str
    allocation: str | None = None
    scorer: str | None = None
    statistics: str | None = None
    options: tuple[tuple[str, object], ...] = ()  # CompressionPolicy fields the suffixes set

    @property
    def is_baseline(self) -> bool:
        return self.allocation is None


def split_policy(text: str) -> PolicyText:
    """``text`` in its parts, every part and combination checked (ValueError naming what is wrong)."""
    if not isinstance(text, str):
        raise ValueError(f"a policy is written as text (e.g. 'inf/leverage'), got {text!r}")
    text = text.strip()
    if text == BASELINE:
        return PolicyText(BASELINE)
    if text in NAMED_POLICIES:
        return split_policy(NAMED_POLICIES[text])
    allocation, slash, rest = text.partition("/")
    if not slash or not rest:
        raise ValueError(
            f"policy {text!r} is not 'baseline', a named policy ({', '.join(NAMED_POLICIES)}) "
            "or ALLOCATION/SCORER[:STATISTICS][+SUFFIX...], e.g. uniform/keydiff, inf/leverage, "
            "global/learned+correction"
        )
    rest, *suffixes = rest.split("+")
    options: dict = {}
    for suffix in suffixes:
        if suffix not in MOMENT_SUFFIXES:
            raise ValueError(
                f"policy {text!r}: unknown suffix +{suffix}; known: {', '.join('+' + name for name in MOMENT_SUFFIXES)}"
            )
        clash = set(MOMENT_SUFFIXES[suffix]) & set(options)
        if clash:
            raise ValueError(
                f"policy {text!r}: +{suffix} sets {', '.join(sorted(clash))} a suffix before it already set; "
                "give each suffix once and at most one of +correction, +correction0, +correction1"
            )
        options.update(MOMENT_SUFFIXES[suffix])
    scorer, colon, statistics = rest.partition(":")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"policy {text!r}: unknown allocation {allocation!r}; known: {', '.join(ALLOCATIONS)}")
    if scorer not in SCORER_NAMES:
        raise ValueError(
            f"policy {text!r}: unknown scorer {scorer!r}; known scorers: {', '.join(sorted(SCORER_NAMES))}"
        )
    if colon:
        if statistics not in STATISTICS:
            raise ValueError(f"policy {text!r}: unknown statistics {statistics!r}; known: {', '.join(STATISTICS)}")
        if scorer != "expected_attention":
            raise ValueError(f"policy {text!r}: statistics applies to the expected_attention scorer only")
    if options.get("moment_eviction") and scorer not in ATTENTION_SCORERS:
        raise ValueError(
            f"policy {text!r}: +moments needs a scorer that estimates attention ({', '.join(ATTENTION_SCORERS)})"
        )
    if allocation == "global" and scorer not in COMPARABLE_SCORERS:
        raise ValueError(
            f"policy {text!r}: allocation 'global' ranks all heads' tokens together and needs a scorer whose "
            f"scores compare across heads ({', '.join(COMPARABLE_SCORERS)})"
        )
    if allocation == "global" and options.get("moment_eviction"):
        raise ValueError(f"policy {text!r}: allocation 'global' and +moments cannot be combined")
    return PolicyText(text, allocation, scorer, statistics if colon else None, tuple(sorted(options.items())))


# Which artifact sections a policy reads, by its parts: the one statement of it.  Each need is the
# sections any one of which meets it (INF budgets: 'budgets' or 'behaviour'), named by its first.
# sections_needed reads it for a policy's text, runtime.plan.policy.CompressionPolicy.requirements
# for a built policy; runtime.plan.policy.REQUIREMENTS says what each section is and how its absence
# is reported, runtime.plan.serving_plan loads each.  A scorer that reads the artifact is one entry
# of SCORER_SECTIONS.
ALLOCATION_SECTIONS = {"inf": ("budgets", "behaviour"), "curve": ("budget_curves",)}
STATISTICS_SECTIONS = {"calibrated": ("query_stats",), "future": ("future_queries",)}  # Expected Attention's
SCORER_SECTIONS = {"prototype_attention": ("future_queries",), "learned": ("learned_scorer",)}
CORRECTION_SECTIONS = {"calibrated": ("moments",)}  # each head's MomentKV order
# the order needs are checked and reported in
SECTION_ORDER = ("budgets", "budget_curves", "query_stats", "future_queries", "moments", "learned_scorer")


def sections_for(
    allocation: str, scorer: str, statistics: str | None, correction: str | None
) -> tuple[tuple[str, ...], ...]:
    """The artifact sections a policy of these parts reads (``statistics``: the kind of query
    statistics its scorer reads, None for none; ``correction``: its MomentKV correction), each need
    once, in :data:`SECTION_ORDER`."""
    needs = (
        ALLOCATION_SECTIONS.get(allocation),
        STATISTICS_SECTIONS.get(statistics),
        SCORER_SECTIONS.get(scorer),
        CORRECTION_SECTIONS.get(correction),
    )
    return tuple(sorted(dict.fromkeys(need for need in needs if need), key=lambda need: SECTION_ORDER.index(need[0])))


def sections_needed(policy: PolicyText) -> tuple[tuple[str, ...], ...]:
    """The artifact sections ``policy`` reads (:func:`sections_for` of its parts)."""
    if policy.is_baseline:
        return ()
    statistics = (policy.statistics or "calibrated") if policy.scorer == "expected_attention" else None
    return sections_for(policy.allocation, policy.scorer, statistics, dict(policy.options).get("correction"))


def serving_refusal(text: str, sections) -> str | None:
    """Why a file holding ``sections`` cannot serve the policy ``text`` (as a recommendation is
    served: ``runtime.plan.recommendation``), or None when it can."""
    try:
        policy = split_policy(text)
    except ValueError as exc:
        return str(exc)
    if policy.is_baseline:
        return "'baseline' compresses nothing: it is measured, never recommended"
    if policy.scorer in RECONSTRUCTION_SCORERS:
        return (
            f"{text!r} needs a reconstruction pass per prompt (runtime.compression.kvzip): it is measured, "
            "never recommended"
        )
    for need in sections_needed(policy):
        if not any(name in sections for name in need):
            return f"{text!r} needs the section {' or '.join(repr(n) for n in need)}, which the file lacks"
    return None
