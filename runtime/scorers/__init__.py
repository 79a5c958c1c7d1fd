"""Token scorers: which retained tokens of each KV head matter most (higher = keep).

A scorer is one module here, a :class:`~runtime.scorers.base.Scorer` subclass with one batched
``score(inputs) -> [R, Hkv, n]`` over a layer's :class:`~runtime.scorers.inputs.LayerInputs`
(``R`` batch rows x every KV head, each head's live tokens padded to the longest), and a
``needs`` declaration of what else it reads (query statistics of a kind, recent queries,
averaged RoPE, the prompt's chunked attention, the keys' RoPE, the artifact's learned weights or future-query centres:
:mod:`runtime.scorers.inputs`).  The providers (:mod:`runtime.scorers.providers`) supply those,
for the serving engine (:mod:`runtime.compression.eviction`) and the profiler's stages alike.

Adding a scorer: one module here defining it, and its line in
:data:`runtime.scorers.registry.REGISTERED` (or put an instance directly in a policy:
``CompressionPolicy(scorer=MyScorer())``).  Which rows the scores keep (sinks, recent window,
then the best-scored, ties to the newer token) is :mod:`runtime.compression.keep_rule`'s, not the scorer's.

Modules: ``base`` (the protocol), ``inputs`` (the layer inputs and the needs), ``providers``,
``helpers`` (batched math several scorers share), ``registry`` (``SCORERS``, ``make_scorer``),
and one per scorer: ``expected_attention``, ``prototype_attention``, ``keydiff``, ``snapkv``,
``knorm``, ``streaming``, ``leverage`` (Compactor), ``kvzip``, ``learned``.
"""

from runtime.math.rope import unrotate
from runtime.scorers.base import Scorer
from runtime.scorers.expected_attention import ExpectedAttentionScorer
from runtime.scorers.helpers import chunked_attention_mass, leverage_scores, max_pooled
from runtime.scorers.inputs import (
    ALL_QUERIES,
    AveragedRope,
    ChunkAttentionMass,
    KeyRope,
    LayerInputs,
    LearnedWeights,
    Need,
    QueryCentres,
    QueryStatistics,
    RecentQueries,
    chunk_specs,
    query_statistics,
    recent_query_window,
)
from runtime.scorers.keydiff import KeyDiffScorer
from runtime.scorers.knorm import KNormScorer
from runtime.scorers.kvzip import KVzipScorer, KVzipScores
from runtime.scorers.learned import LearnedScorer
from runtime.scorers.leverage import LeverageScorer
from runtime.scorers.prototype_attention import PrototypeAttentionScorer
from runtime.scorers.providers import ScorerInputs
from runtime.scorers.registry import SCORERS, make_scorer
from runtime.scorers.snapkv import SnapKVScorer
from runtime.scorers.streaming import StreamingScorer

__all__ = [
    "ALL_QUERIES",
    "AveragedRope",
    "ChunkAttentionMass",
    "ExpectedAttentionScorer",
    "KNormScorer",
    "KVzipScorer",
    "KVzipScores",
    "KeyDiffScorer",
    "KeyRope",
    "LayerInputs",
    "LearnedScorer",
    "LearnedWeights",
    "LeverageScorer",
    "Need",
    "PrototypeAttentionScorer",
    "QueryCentres",
    "QueryStatistics",
    "RecentQueries",
    "SCORERS",
    "Scorer",
    "ScorerInputs",
    "SnapKVScorer",
    "StreamingScorer",
    "chunk_specs",
    "chunked_attention_mass",
    "leverage_scores",
    "make_scorer",
    "max_pooled",
    "query_statistics",
    "recent_query_window",
    "unrotate",
]
