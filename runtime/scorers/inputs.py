"""What a scorer reads: one :class:`LayerInputs` per call, and the :class:`Need` s it declares.

Every scorer sees the same base of a layer: ``R`` batch rows x every KV head, each head's live
tokens padded to the longest (``valid`` says which are real).  Beyond that, a scorer declares
what it needs (``Scorer.needs``, a tuple of the frozen dataclasses below) and finds each in the
inputs by that same need: ``inputs[QueryStatistics("calibrated")]``.  Who supplies them is
:mod:`runtime.scorers.providers` (one small provider per kind of need, for the runtime and the
profiler alike).

========================  =====================================================================
need                      what ``inputs[need]`` holds
========================  =====================================================================
QueryStatistics(kind)     ``(mean [R, Hkv, G, d], cov [R, Hkv, G, d, d])`` pre-RoPE, of the
                          group's query heads: ``"calibrated"`` (the artifact's ``query_stats``),
                          ``"future"`` (its ``future_queries`` mean/covariance: queries after the
                          context of needle probes) or ``"prompt"`` (the prompt's own queries)
AveragedRope(horizon)     :class:`~runtime.math.rope.Rotation` ``cos, sin [R, d]``: the layer's RoPE
                          averaged over ``horizon`` positions from each row's next token, in the
                          form its queries rotate in (``.matrices()``: ``Rbar [R, d, d]``)
RecentQueries(window)     ``(queries [R, Hkv, G, w, d], positions int64 [R, w])``: the last
                          ``window`` post-RoPE prompt queries (:data:`ALL_QUERIES`: every one),
                          right-aligned to the longest row's record (``-1``: no query there)
ChunkAttentionMass(spec)  float32 ``[R, Hkv, n]``: the mass every key received from the queries of
                          its own chunk, softmax over that chunk's keys only (Compactor's
                          non-causal chunked attention, :mod:`runtime.math.chunk_attention`; 0 for a
                          key outside every chunk)
KeyRope()                 :class:`~runtime.math.rope.Rotation` ``cos, sin [R, Hkv, n, d]``: the
                          RoPE of every key's own position, in the form the layer's keys rotate in
                          (``.undo(keys)``: the pre-RoPE keys)
LearnedWeights()          ``(weights [Hkv, 2d], bias [Hkv])`` float32: the artifact's learned
                          scorer of this layer
QueryCentres()            ``(centres [Hkv, G, K, d], weights [Hkv, G, K])``: the artifact's
                          pre-RoPE future-query centres (the same for every row)
========================  =====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.math.chunk_attention import ChunkSpec

# An observation window that covers every prompt query (the cache keeps them all; 2^62 is
# never reached, and slicing ``[-ALL_QUERIES:]`` clamps to what was recorded).
ALL_QUERIES = 1 << 62


class Need:
    """Base of the needs: frozen dataclasses, equal (and hashed) by value, so a scorer looks its
    input up with the need it declared."""

    what = "an input"

    def describe(self) -> str:
        return self.what


@dataclass(frozen=True)
class QueryStatistics(Need):
    kind: str  # "calibrated" | "future" | "prompt"

    KINDS = ("calibrated", "future", "prompt")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"query statistics must be 'calibrated', 'future' or 'prompt', got {self.kind!r}")

    def describe(self) -> str:
        return f"the {self.kind} pre-RoPE query statistics (mean, covariance)"


@dataclass(frozen=True)
class AveragedRope(Need):
    horizon: int

    def describe(self) -> str:
        return f"RoPE averaged over {self.horizon} positions from the next token"


@dataclass(frozen=True)
class RecentQueries(Need):
    window: int

    def describe(self) -> str:
        return "every prompt query" if self.window >= ALL_QUERIES else f"the last {self.window} prompt queries"


@dataclass(frozen=True)
class ChunkAttentionMass(Need):
    spec: ChunkSpec

    def describe(self) -> str:
        return f"the prompt's chunked attention ({self.spec.chunk}-token chunks)"


@dataclass(frozen=True)
class KeyRope(Need):
    what = "the keys' RoPE (key_cos/key_sin at each key's position)"


@dataclass(frozen=True)
class LearnedWeights(Need):
    what = "the artifact's learned_scorer weights"


@dataclass(frozen=True)
class QueryCentres(Need):
    what = "the artifact's future-query centres (section 'future_queries')"


@dataclass
class LayerInputs:
    """Everything a scorer may look at for ``R`` batch rows x every KV head of one layer, each
    head's tokens padded to the longest; padding rows of ``keys``/``values`` are zero."""

    layer: int
    keys: torch.Tensor  # [R, Hkv, n, d] post-RoPE
    values: torch.Tensor  # [R, Hkv, n, d]
    positions: torch.Tensor  # int64 [R, Hkv, n] absolute RoPE positions, increasing per head
    valid: torch.Tensor  # bool [R, Hkv, n]
    lengths: torch.Tensor  # int64 [R, Hkv] (host)
    scaling: float  # the attention scale s (1/sqrt(d) for Llama)
    next_positions: list[int]  # [R] absolute position of each row's next token
    supplied: dict[Need, object] = field(default_factory=dict)  # need -> what the module docstring lists

    def __getitem__(self, need: Need):
        if need not in self.supplied:
            raise ValueError(
                f"the layer's inputs lack {need.describe()}: build them with runtime.scorers.ScorerInputs "
                "for the scorer that declares this need"
            )
        return self.supplied[need]


def recent_query_window(scorer) -> int:
    """How many of the last prompt queries ``scorer`` observes (0: none; :data:`ALL_QUERIES`: every one)."""
    return max([0] + [need.window for need in scorer.needs if isinstance(need, RecentQueries)])


def chunk_specs(scorer) -> tuple[ChunkSpec, ...]:
    """The chunked attentions ``scorer`` reads (:class:`ChunkAttentionMass`), accumulated during the prefill."""
    return tuple(need.spec for need in scorer.needs if isinstance(need, ChunkAttentionMass))


def query_statistics(scorer) -> str | None:
    """The kind of query statistics ``scorer`` reads (``"calibrated"``, ``"future"``, ``"prompt"``) or None."""
    kinds = [need.kind for need in scorer.needs if isinstance(need, QueryStatistics)]
    return kinds[0] if kinds else None
