"""The runtime's vocabulary, importable without torch: the names a policy is spelled with.

Command-line parsers (``evaluate-artifact``, ``profile-model``) offer these names in ``--help``
and check them without loading torch; the runtime validates with the same objects, so there is
no copy to keep in step.  ``runtime/__init__.py`` loads its exports lazily, so importing this
module imports nothing else.
"""

from __future__ import annotations

ALLOCATIONS = ("uniform", "inf", "global", "curve")  # how a budget is split over the KV heads
STATISTICS = ("calibrated", "future", "prompt")  # the query statistics expected_attention reads
CORRECTIONS = ("none", "calibrated", "order0", "order1")  # MomentKV correction of the evicted mass

# The scorers, each a module of runtime/scorers/ and the class it defines: a new scorer is its
# module plus one line here (the module's name is the scorer's name).
SCORER_CLASSES = (
    ("expected_attention", "ExpectedAttentionScorer"),
    ("prototype_attention", "PrototypeAttentionScorer"),
    ("keydiff", "KeyDiffScorer"),
    ("snapkv", "SnapKVScorer"),
    ("knorm", "KNormScorer"),
    ("streaming", "StreamingScorer"),
    ("leverage", "LeverageScorer"),
    ("kvzip", "KVzipScorer"),
    ("learned", "LearnedScorer"),
)
SCORER_NAMES = tuple(name for name, _ in SCORER_CLASSES)

# Policies with a short name, spelled in the policy grammar (runtime.plan.policy_spec parses them).
NAMED_POLICIES = {"flagship": "inf/leverage+correction"}

# The selections profile-model's moments stage calibrates correction orders under
# (--moments-selection): the scorers whose kept tokens a captured forward pass can reproduce.
MOMENT_SELECTIONS = ("snapkv", "keydiff", "learned", "leverage")
