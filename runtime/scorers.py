"""Token scorers: which retained tokens of one KV head matter most (higher = keep).

A scorer is a small class with a ``score(head) -> [n]`` method over one KV head's live
tokens (:class:`HeadContext`) and a few class attributes saying what the compression engine
must collect for it.  The engine scores a whole layer at once, every batch row and KV head in
one call, through ``score_layer(layer) -> [R, Hkv, n]`` over a :class:`LayerContext` (the
heads' tokens padded to the longest, with a validity mask); its default calls ``score`` head by
head, and the built-in scorers override it with one batched computation.  The attributes:

* ``query_statistics``: ``"calibrated"`` (the artifact's pre-RoPE query mean/covariance, from
  calibration text), ``"future"`` (the artifact's ``future_queries`` mean/covariance: queries after
  the context of needle probes), ``"prompt"`` (measured on the prompt's own pre-RoPE queries) or
  ``None``;
* ``query_centres``: when True, the engine passes the artifact's ``future_queries`` centres and
  their weights (``query_centres [G, K, d]``, ``centre_weights [G, K]`` per KV head);
* ``rope_horizon``: when > 0, the engine averages RoPE over that many positions starting at
  the absolute position of the next token and passes ``rope_cos/rope_sin``;
* ``observation_window``: when > 0, the last that many post-RoPE prompt queries are kept
  (:data:`ALL_QUERIES`: every prompt query);
* ``key_rope``: when True, the engine passes ``key_cos/key_sin [n, d]``, the RoPE of every
  key's own position, so the scorer can undo it (pre-RoPE keys, see :func:`unrotate`);
* ``learned``: when True, the engine passes the artifact's learned-scorer weights of the head
  (``learned_weights [2d]``, ``learned_bias``);
* ``comparable``: True when scores of different heads are on one scale (log attention), so
  the ``global`` allocation may rank all heads' tokens together.

Adding a scorer: subclass :class:`Scorer`, implement ``score`` (and, for speed, ``score_layer``),
and either add it to ``SCORERS`` or put an instance directly in the policy
(``CompressionPolicy(scorer=MyScorer())``).  Which rows the scores keep (sinks, recent window,
then the best-scored, ties to the newer token) is :mod:`runtime.selection`'s, not the scorer's.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .checks import check_flag, check_integer, check_number
from .rope import rope_matrix


@dataclass
class HeadContext:
    """Everything a scorer may look at for one (batch element, layer, KV head)."""

    layer: int
    kv_head: int
    keys: torch.Tensor  # [n, d] post-RoPE
    values: torch.Tensor  # [n, d]
    positions: torch.Tensor  # int [n] absolute RoPE positions, increasing
    scaling: float  # attention scale s (1/sqrt(d) for Llama)
    next_position: int  # absolute position of the next token
    query_mean: torch.Tensor | None = None  # [G, d] pre-RoPE mean of this group's query heads
    query_cov: torch.Tensor | None = None  # [G, d, d] pre-RoPE covariance
    rope_cos: torch.Tensor | None = None  # [d] RoPE cos averaged over the horizon
    rope_sin: torch.Tensor | None = None  # [d]
    recent_queries: torch.Tensor | None = None  # [G, w, d] post-RoPE, last w prompt tokens
    key_cos: torch.Tensor | None = None  # [n, d] RoPE cos at each key's position (scorer.key_rope)
    key_sin: torch.Tensor | None = None  # [n, d]
    learned_weights: torch.Tensor | None = None  # [2d] learned-scorer coefficients (scorer.learned)
    learned_bias: float | None = None
    query_centres: torch.Tensor | None = None  # [G, K, d] pre-RoPE future-query centres (scorer.query_centres)
    centre_weights: torch.Tensor | None = None  # [G, K] their weights (sum to 1 per query head)


@dataclass
class LayerContext:
    """Everything a scorer may look at for ``R`` batch rows x every KV head of one layer, each head's
    tokens padded to the longest (``valid`` says which are real).  Fields as in :class:`HeadContext`,
    with leading ``[R, Hkv]`` (or ``[R]``) axes; padding rows of ``keys``/``values`` are zero."""

    layer: int
    keys: torch.Tensor  # [R, Hkv, n, d] post-RoPE
    values: torch.Tensor  # [R, Hkv, n, d]
    positions: torch.Tensor  # int64 [R, Hkv, n]
    valid: torch.Tensor  # bool [R, Hkv, n]
    lengths: torch.Tensor  # int64 [R, Hkv] (host)
    scaling: float
    next_positions: list[int]  # [R]
    query_mean: torch.Tensor | None = None  # [R, Hkv, G, d] pre-RoPE
    query_cov: torch.Tensor | None = None  # [R, Hkv, G, d, d]
    rope_cos: torch.Tensor | None = None  # [R, d] RoPE averaged over each row's horizon
    rope_sin: torch.Tensor | None = None  # [R, d]
    recent_queries: list[torch.Tensor | None] | None = None  # [R] -> [Hq, w, d] post-RoPE
    key_cos: torch.Tensor | None = None  # [R, Hkv, n, d]
    key_sin: torch.Tensor | None = None  # [R, Hkv, n, d]
    learned_weights: torch.Tensor | None = None  # [Hkv, 2d]
    learned_bias: torch.Tensor | None = None  # [Hkv]
    query_centres: torch.Tensor | None = None  # [Hkv, G, K, d] pre-RoPE (the same for every row)
    centre_weights: torch.Tensor | None = None  # [Hkv, G, K]

    def padded_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' recorded queries grouped per KV head, ``[R, Hkv, G, w, d]`` float32, right-aligned
        to the longest record (rows may have recorded fewer), and each query's absolute position
        ``[R, w]`` (``-1``: no query there)."""
        rows, heads, _, dim = self.keys.shape
        device = self.keys.device
        width = max(q.shape[1] for q in self.recent_queries)
        group = self.recent_queries[0].shape[0] // heads
        queries = torch.zeros(rows, heads, group, width, dim, device=device)
        positions = torch.full((rows, width), -1, dtype=torch.int64, device=device)
        for r, recorded in enumerate(self.recent_queries):  # [Hq, w_r, d]
            w = recorded.shape[1]
            queries[r, :, :, width - w :] = recorded.float().to(device).reshape(heads, group, w, dim)
            positions[r, width - w :] = int(self.next_positions[r]) - w + torch.arange(w, device=device)
        return queries, positions

    def head(self, r: int, h: int) -> HeadContext:
        """The :class:`HeadContext` of row ``r``'s KV head ``h`` (views, without padding)."""
        n = int(self.lengths[r, h])
        recent = None
        if self.recent_queries is not None and self.recent_queries[r] is not None:
            g = self.recent_queries[r].shape[0] // self.keys.shape[1]
            recent = self.recent_queries[r][h * g : (h + 1) * g]
        return HeadContext(
            layer=self.layer,
            kv_head=h,
            keys=self.keys[r, h, :n],
            values=self.values[r, h, :n],
            positions=self.positions[r, h, :n],
            scaling=self.scaling,
            next_position=int(self.next_positions[r]),
            query_mean=None if self.query_mean is None else self.query_mean[r, h],
            query_cov=None if self.query_cov is None else self.query_cov[r, h],
            rope_cos=None if self.rope_cos is None else self.rope_cos[r],
            rope_sin=None if self.rope_sin is None else self.rope_sin[r],
            recent_queries=recent,
            key_cos=None if self.key_cos is None else self.key_cos[r, h, :n],
            key_sin=None if self.key_sin is None else self.key_sin[r, h, :n],
            learned_weights=None if self.learned_weights is None else self.learned_weights[h],
            learned_bias=None if self.learned_bias is None else float(self.learned_bias[h]),
            query_centres=None if self.query_centres is None else self.query_centres[h],
            centre_weights=None if self.centre_weights is None else self.centre_weights[h],
        )


class Scorer(ABC):
    """Base class; see the module docstring."""

    name = "scorer"
    query_statistics: str | None = None
    rope_horizon = 0
    observation_window = 0
    key_rope = False
    learned = False
    query_centres = False
    comparable = False

    @abstractmethod
    def score(self, head: HeadContext) -> torch.Tensor:
        """Scores ``[n]`` for the head's live tokens; higher means more worth keeping."""

    def layer_scores(self, layer: LayerContext) -> torch.Tensor:
        """What the engine calls: :meth:`score_layer`, unless a subclass overrides :meth:`score`
        below the class that batched it (its own ``score`` is then applied head by head)."""
        for klass in type(self).__mro__:
            if "score_layer" in vars(klass):
                return self.score_layer(layer)
            if "score" in vars(klass):
                return Scorer.score_layer(self, layer)
        return Scorer.score_layer(self, layer)

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        """Scores ``[R, Hkv, n]`` float32 for every head of the layer (padding: ``-inf``).  This
        default calls :meth:`score` head by head; override it with one batched computation."""
        out = torch.full(layer.valid.shape, float("-inf"), dtype=torch.float32, device=layer.keys.device)
        rows, heads = layer.lengths.shape
        for r in range(rows):
            for h in range(heads):
                n = int(layer.lengths[r, h])
                if n:
                    out[r, h, :n] = self.score(layer.head(r, h)).float().to(out.device)
        return out

    yields_attention = False  # True when attention() is implemented (moment-informed eviction)

    def attention(self, head: HeadContext) -> torch.Tensor:
        """The scorer's estimate ``a_j [n]`` of the attention future queries pay each token."""
        raise TypeError(
            f"{self!r} gives no attention estimate (moment-informed eviction needs one: expected_attention or snapkv)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def max_pooled(attention: torch.Tensor, pool: int) -> torch.Tensor:
    """``attention [..., n]`` with each token worth its most-attended neighbour within ``pool``
    (odd) positions, which keeps multi-token spans whole (kvpress's EA / SnapKV pooling)."""
    if pool <= 1:
        return attention
    shape = attention.shape
    pooled = torch.nn.functional.max_pool1d(attention.reshape(-1, 1, shape[-1]), pool, stride=1, padding=pool // 2)
    return pooled.reshape(shape)


class ExpectedAttentionScorer(Scorer):
    """Expected Attention (arXiv 2510.00636, Eq. 5-9; docs/design.md section 1).

    ``z_i = s mu'.k_i + (s^2/2) k_i^T Sigma' k_i`` with ``mu' = Rbar mu``,
    ``Sigma' = Rbar Sigma Rbar^T``; ``a = softmax(z)`` per query head, averaged over the GQA
    group; score ``(a_i + epsilon) * ||v_i||``.  ``pool > 1`` (odd) replaces ``a_i`` by its maximum
    over the ``pool`` neighbouring rows, so a span (e.g. a number's digit tokens) is kept whole
    when one of its tokens is attended.
    """

    name = "expected_attention"
    # kvpress's ExpectedAttentionPress adds 1e-2: a token whose expected attention is below it is then
    # ranked by its value norm, instead of by an estimate of attention no query will pay.  Measured
    # (benchmarks/runtime_quality.py, embedded model, 18 unseen retrieval + multi_key probes, seed
    # 1000, uniform budgets, calibrated and prompt statistics alike): 0.39 [0.20, 0.61] / 0.06 / 0.00
    # evicting 50 / 75 / 90% with 1e-2, against 0.00 [0.00, 0.18] at every ratio with 0.
    DEFAULT_EPSILON = 1e-2

    def __init__(
        self, statistics: str = "calibrated", horizon: int = 512, epsilon: float = DEFAULT_EPSILON, pool: int = 1
    ):
        if statistics not in ("calibrated", "future", "prompt"):
            raise ValueError(
                f"expected_attention statistics must be 'calibrated', 'future' or 'prompt', got {statistics!r}"
            )
        self.rope_horizon = check_integer("expected_attention horizon", horizon, minimum=1)
        self.epsilon = check_number("expected_attention epsilon", epsilon, minimum=0.0)
        self.pool = check_integer("expected_attention pool", pool, minimum=1, odd=True)
        self.query_statistics = statistics

    yields_attention = True

    def attention(self, head: HeadContext) -> torch.Tensor:
        keys = head.keys.float()  # [n, d]
        rbar = rope_matrix(head.rope_cos, head.rope_sin).to(keys.device)  # [d, d]
        mean = head.query_mean.float().to(keys.device) @ rbar.T  # [G, d]
        cov = rbar @ head.query_cov.float().to(keys.device) @ rbar.T  # [G, d, d]
        s = head.scaling
        linear = s * (mean @ keys.T)  # [G, n]
        quadratic = 0.5 * s * s * ((keys @ cov) * keys).sum(-1)  # [G, n]
        attention = torch.softmax(linear + quadratic, dim=-1).mean(0)  # [n]
        return max_pooled(attention, self.pool)

    def score(self, head: HeadContext) -> torch.Tensor:
        return (self.attention(head) + self.epsilon) * head.values.float().norm(dim=-1)

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        # the per-head computation of attention() with leading [R, Hkv] axes (same matmuls, so the
        # same float32 results: near-ties at a budget's edge fall the same way both paths)
        keys = layer.keys.float()  # [R, Hkv, n, d]
        rbar = torch.stack([rope_matrix(cos, sin) for cos, sin in zip(layer.rope_cos, layer.rope_sin, strict=True)]).to(
            keys.device
        )[:, None, None]  # [R, 1, 1, d, d]
        mean = layer.query_mean.float().to(keys.device).unsqueeze(-2) @ rbar.transpose(-1, -2)  # [R, Hkv, G, 1, d]
        cov = rbar @ layer.query_cov.float().to(keys.device) @ rbar.transpose(-1, -2)  # [R, Hkv, G, d, d]
        s = layer.scaling
        linear = s * (mean @ keys.unsqueeze(2).transpose(-1, -2)).squeeze(-2)  # [R, Hkv, G, n]
        quadratic = 0.5 * s * s * ((keys.unsqueeze(2) @ cov) * keys.unsqueeze(2)).sum(-1)  # [R, Hkv, G, n]
        logits = (linear + quadratic).masked_fill(~layer.valid.unsqueeze(2), float("-inf"))
        attention = torch.softmax(logits, dim=-1).mean(2)  # [R, Hkv, n]
        # a head with no token at all (softmax over nothing) scores 0; NaN from overflow stays NaN
        attention = torch.where(layer.valid.any(-1, keepdim=True), attention, torch.zeros_like(attention))
        scores = (max_pooled(attention, self.pool) + self.epsilon) * layer.values.float().norm(dim=-1)
        return scores.masked_fill(~layer.valid, float("-inf"))

    def __repr__(self) -> str:
        return (
            f"ExpectedAttentionScorer(statistics={self.query_statistics!r}, horizon={self.rope_horizon}, "
            f"epsilon={self.epsilon}, pool={self.pool})"
        )


class PrototypeAttentionScorer(Scorer):
    """Expected attention of a few query directions, reduced by a max: each query head's K pre-RoPE
    future-query centres (the artifact's ``future_queries`` section: k-means of the queries after
    the context of needle probes) stand in for one mean query.

    Per query head ``g`` and centre ``c_gk``: ``a_gki = softmax_i(s (Rbar c_gk) . k_i)`` with ``Rbar``
    RoPE averaged over the ``horizon`` positions from the next token (as Expected Attention, arXiv
    2510.00636, Eq. 5-9, without the covariance term); ``centres="max"`` takes ``max_k a_gki`` (a key
    is kept when any likely question direction would read it: DefensiveKV's worst-case aggregation,
    arXiv 2510.13334; one direction per head as Q-Filters, arXiv 2503.02812; pre-RoPE query centres
    as TriAttention, arXiv 2604.04921), ``centres="mean"`` the mixture's ``sum_k w_gk a_gki``.  Over
    the GQA group ``group="mean"`` (as EA) or ``"max"``.  Score ``(a_i + epsilon) * ||v_i||``;
    ``pool`` as in :class:`ExpectedAttentionScorer`.
    """

    name = "prototype_attention"
    query_centres = True
    yields_attention = True
    REDUCTIONS = ("max", "mean")

    # Defaults measured (benchmarks/runtime_quality.py, embedded model, 18 unseen retrieval + multi_key
    # probes of seed 1000, uniform budgets, 4 centres; accuracy evicting 50 / 75 / 90%):
    #   horizon 512, group mean 0.50 / 0.33 / 0.28;  group max 0.61 / 0.39 / 0.28;  centres mean 0.56 / 0.44 / 0.28
    #   horizon 64 (the ~40 tokens a question and answer span), group max 0.72 / 0.39 / 0.28
    #   epsilon 1e-2 (EA's default): 0.39 / 0.06 / 0.00, as EA itself: the value norm then decides
    #   8 centres: 0.72 / 0.44 / 0.22 (the stage's --query-centres; 4 is its default)
    # KeyDiff on the same probes: 0.67 / 0.50 / 0.28.
    def __init__(
        self, horizon: int = 64, epsilon: float = 0.0, centres: str = "max", group: str = "max", pool: int = 1
    ):
        self.rope_horizon = check_integer("prototype_attention horizon", horizon, minimum=1)
        self.epsilon = check_number("prototype_attention epsilon", epsilon, minimum=0.0)
        if centres not in self.REDUCTIONS or group not in self.REDUCTIONS:
            raise ValueError(
                f"prototype_attention reduces centres and the group by 'max' or 'mean', got centres={centres!r}, "
                f"group={group!r}"
            )
        self.centres, self.group = centres, group
        self.pool = check_integer("prototype_attention pool", pool, minimum=1, odd=True)

    @staticmethod
    def _checked(centres, weights):
        if centres is None or weights is None:
            raise ValueError(
                "prototype_attention needs the artifact's future-query centres (section 'future_queries'): "
                "re-run profile-model with the future-queries stage"
            )

    def _reduce(self, attention: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``attention [..., G, K, n]``, ``weights [..., G, K]`` -> ``[..., n]``."""
        if self.centres == "max":
            per_head = attention.amax(-2)
        else:
            per_head = (attention * weights.unsqueeze(-1)).sum(-2)
        return per_head.amax(-2) if self.group == "max" else per_head.mean(-2)

    def attention(self, head: HeadContext) -> torch.Tensor:
        self._checked(head.query_centres, head.centre_weights)
        keys = head.keys.float()  # [n, d]
        rbar = rope_matrix(head.rope_cos, head.rope_sin).to(keys.device)  # [d, d]
        centres = head.query_centres.float().to(keys.device) @ rbar.T  # [G, K, d]
        logits = head.scaling * (centres @ keys.T)  # [G, K, n]
        attention = self._reduce(torch.softmax(logits, dim=-1), head.centre_weights.float().to(keys.device))
        return max_pooled(attention, self.pool)

    def score(self, head: HeadContext) -> torch.Tensor:
        return (self.attention(head) + self.epsilon) * head.values.float().norm(dim=-1)

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        self._checked(layer.query_centres, layer.centre_weights)
        keys = layer.keys.float()  # [R, Hkv, n, d]
        rbar = torch.stack([rope_matrix(cos, sin) for cos, sin in zip(layer.rope_cos, layer.rope_sin, strict=True)]).to(
            keys.device
        )  # [R, d, d]
        centres = layer.query_centres.float().to(keys.device)  # [Hkv, G, K, d]
        rotated = torch.einsum("hgkd,red->rhgke", centres, rbar)  # Rbar c per row: [R, Hkv, G, K, d]
        logits = layer.scaling * torch.einsum("rhgke,rhne->rhgkn", rotated, keys)  # [R, Hkv, G, K, n]
        logits = logits.masked_fill(~layer.valid[:, :, None, None], float("-inf"))
        weights = layer.centre_weights.float().to(keys.device).unsqueeze(0)  # [1, Hkv, G, K]
        attention = self._reduce(torch.softmax(logits, dim=-1), weights)  # [R, Hkv, n]
        attention = torch.where(layer.valid.any(-1, keepdim=True), attention, torch.zeros_like(attention))
        scores = (max_pooled(attention, self.pool) + self.epsilon) * layer.values.float().norm(dim=-1)
        return scores.masked_fill(~layer.valid, float("-inf"))

    def __repr__(self) -> str:
        return (
            f"PrototypeAttentionScorer(horizon={self.rope_horizon}, epsilon={self.epsilon}, centres={self.centres!r}, "
            f"group={self.group!r}, pool={self.pool})"
        )


class KeyDiffScorer(Scorer):
    """KeyDiff (arXiv 2504.15364, Eq. 8): ``-cos(k_i, mean_j k_j/||k_j||)``; no attention needed."""

    name = "keydiff"

    def score(self, head: HeadContext) -> torch.Tensor:
        keys = head.keys.float()
        anchor = torch.nn.functional.normalize(keys, dim=-1).mean(0)  # [d]
        return -torch.nn.functional.cosine_similarity(keys, anchor.unsqueeze(0), dim=-1)

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        keys = layer.keys.float()  # [R, Hkv, n, d], padding rows zero
        unit = keys / keys.norm(dim=-1, keepdim=True).clamp_min(1e-8)  # as normalize()
        anchor = unit.sum(2) / layer.lengths.to(keys.device).clamp_min(1).unsqueeze(-1)  # [R, Hkv, d]
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        scores = -(unit @ anchor.unsqueeze(-1)).squeeze(-1)  # -cos(k_i, anchor)
        return scores.masked_fill(~layer.valid, float("-inf"))


class SnapKVScorer(Scorer):
    """SnapKV: attention of the last ``window`` prompt queries, summed, pooled over neighbours."""

    name = "snapkv"

    def __init__(self, window: int = 32, kernel: int = 5):
        self.observation_window = check_integer("snapkv observation window", window, minimum=1)
        self.kernel = check_integer("snapkv pooling kernel", kernel, minimum=1, odd=True)

    yields_attention = True

    def attention(self, head: HeadContext) -> torch.Tensor:
        """Mean attention of the observation window's queries, pooled over neighbours (sums to about 1)."""
        return self.score(head) / head.recent_queries.shape[1]

    def score(self, head: HeadContext) -> torch.Tensor:
        queries = head.recent_queries.float()  # [G, w, d]
        keys = head.keys.float()
        w = queries.shape[1]
        query_positions = head.next_position - w + torch.arange(w, device=keys.device)  # [w]
        logits = head.scaling * queries @ keys.T  # [G, w, n]
        future = head.positions.to(keys.device).unsqueeze(0) > query_positions.unsqueeze(1)  # [w, n]
        logits = logits.masked_fill(future, float("-inf"))
        weights = torch.softmax(logits, dim=-1).sum(1).mean(0)  # [n]
        pooled = torch.nn.functional.avg_pool1d(
            weights[None, None], self.kernel, stride=1, padding=self.kernel // 2, count_include_pad=False
        )
        return pooled[0, 0]

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        keys = layer.keys.float()  # [R, Hkv, n, d]
        rows, heads, n, _ = keys.shape
        queries, query_positions = layer.padded_queries()  # [R, Hkv, G, w, d], [R, w]
        logits = layer.scaling * queries @ keys.unsqueeze(2).transpose(-1, -2)  # [R, Hkv, G, w, n]
        visible = layer.positions.unsqueeze(2).unsqueeze(3) <= query_positions[:, None, None, :, None]
        visible = visible & layer.valid[:, :, None, None, :]
        logits = logits.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        weights = torch.where(visible.any(-1, keepdim=True), weights, torch.zeros_like(weights))  # no query there
        weights = weights.sum(3).mean(2)  # [R, Hkv, n]
        # a mean over the kernel's neighbours that exist (count_include_pad=False at each head's own end)
        valid = layer.valid.float()
        summed = torch.nn.functional.avg_pool1d(
            (weights * valid).reshape(rows * heads, 1, n), self.kernel, stride=1, padding=self.kernel // 2
        )
        counted = torch.nn.functional.avg_pool1d(
            valid.reshape(rows * heads, 1, n), self.kernel, stride=1, padding=self.kernel // 2
        )
        pooled = (summed / counted.clamp_min(1e-12)).reshape(rows, heads, n)
        return pooled.masked_fill(~layer.valid, float("-inf"))

    def __repr__(self) -> str:
        return f"SnapKVScorer(window={self.observation_window}, kernel={self.kernel})"


class KNormScorer(Scorer):
    """KNorm: keep the keys with the lowest L2 norm."""

    name = "knorm"

    def score(self, head: HeadContext) -> torch.Tensor:
        return -head.keys.float().norm(dim=-1)

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        return (-layer.keys.float().norm(dim=-1)).masked_fill(~layer.valid, float("-inf"))


class StreamingScorer(Scorer):
    """StreamingLLM: sinks + the most recent tokens (score = position)."""

    name = "streaming"

    def score(self, head: HeadContext) -> torch.Tensor:
        return head.positions.float()

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        return layer.positions.float().masked_fill(~layer.valid, float("-inf"))


# An observation window that covers every prompt query (the cache keeps them all; 2^62 is
# never reached, and slicing ``[-ALL_QUERIES:]`` clamps to what was recorded).
ALL_QUERIES = 1 << 62


def unrotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys from post-RoPE ``keys [n, d]`` and their own ``cos, sin [n, d]``.

    transformers applies ``k cos + rotate_half(k) sin`` (``R_p = diag(cos) + diag(sin) P``,
    see :mod:`runtime.rope`); ``R_p^T R_p = (cos^2 + sin^2) I``, so the inverse is
    ``R_p^T / (cos^2 + sin^2)`` (the denominator is 1 unless RoPE carries an attention factor).
    """
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)  # rotate_half(keys)
    return (keys * cos - rotated * sin) / (cos * cos + sin * sin)


def leverage_scores(
    keys: torch.Tensor, sketch: int | None = None, generator: torch.Generator | None = None, ridge: float = 1e-6
) -> torch.Tensor:
    """Statistical leverage of every row of the column-centred key matrix, float64 ``[n]``.

    ``l_i = x_i^T (X^T X + lambda I)^{-1} x_i`` with ``X = K - mean(K)`` (``lambda = ridge *
    mean diag(X^T X)``, only to keep the Cholesky factorisation defined for rank-deficient
    ``X``); the scores lie in ``[0, 1]`` and sum to about ``rank(X)``.  With ``sketch = k``,
    the columns are first projected by a right Gaussian sketch ``Phi [d, k]`` (entries
    ``N(0, 1/k)``), ``X <- X Phi``: the approximation of "Compactor: Calibrated Query-Agnostic
    KV Cache Compression with Approximate Leverage Scores" (arXiv 2507.08143), meant for large
    ``d``; for ``d = 64`` the exact scores cost ``O(n d^2)`` too.
    """
    x = keys.double()
    x = x - x.mean(0, keepdim=True)
    if sketch is not None:
        phi = torch.randn(x.shape[1], sketch, generator=generator, dtype=torch.float64) / math.sqrt(sketch)
        x = x @ phi.to(x.device)
    gram = x.T @ x
    jitter = ridge * float(gram.diagonal().mean().clamp_min(1e-30))
    factor = torch.linalg.cholesky(gram + jitter * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device))
    whitened = torch.linalg.solve_triangular(factor, x.T, upper=False)  # L^{-1} X^T  [k, n]
    return (whitened * whitened).sum(0)


def chunked_attention_mass(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    chunk: int,
    scale: float,
    origin: int = 0,
) -> torch.Tensor:
    """Non-causal chunked attention: the attention each key receives from its own chunk's queries.

    Positions are cut into chunks ``[origin + c*chunk, origin + (c+1)*chunk)``; the queries
    ``[G, w, d]`` of chunk ``c`` attend (softmax over keys, no causal mask) to the keys of
    chunk ``c`` only; a key's mass is the sum over its chunk's queries, averaged over the
    ``G`` query heads of the group.  Returns float32 ``[n]`` (0 for a key whose chunk has no
    query).
    """
    keys = keys.float()
    queries = queries.float()
    key_chunk = torch.div(key_positions.to(keys.device).long() - origin, chunk, rounding_mode="floor")
    query_chunk = torch.div(query_positions.to(keys.device).long() - origin, chunk, rounding_mode="floor")
    mass = torch.zeros(keys.shape[0], dtype=torch.float32, device=keys.device)
    for c in torch.unique(key_chunk).tolist():
        key_rows = (key_chunk == c).nonzero().squeeze(1)
        query_rows = (query_chunk == c).nonzero().squeeze(1)
        if query_rows.numel() == 0:
            continue
        logits = scale * queries[:, query_rows] @ keys[key_rows].T  # [G, m, r]
        mass[key_rows] = torch.softmax(logits, dim=-1).sum(1).mean(0)
    return mass


def _zscore(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return (x - x.mean()) / x.std(unbiased=False).clamp_min(1e-6)


def _masked_zscore(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`_zscore` over the ``mask``ed entries of the last axis, per leading index (0 elsewhere)."""
    x, weight = x.double(), mask.double()
    count = weight.sum(-1, keepdim=True).clamp_min(1)
    mean = (x * weight).sum(-1, keepdim=True) / count
    std = (((x - mean) ** 2 * weight).sum(-1, keepdim=True) / count).sqrt().clamp_min(1e-6)
    return (x - mean) / std * weight


class LeverageScorer(Scorer):
    """Compactor ("Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate
    Leverage Scores", arXiv 2507.08143): key leverage blended with non-causal chunked attention.

    ``score = z(attention) + blend * z(leverage)`` over the head's middle rows (all but the first
    ``exclude_first`` and last ``exclude_last``, which score the middle's maximum, i.e. are
    kept), where ``z`` standardises over those rows and

    * leverage (:func:`leverage_scores`): of the head's **pre-RoPE** keys (``pre_rope``; RoPE is
      undone from each key's position), centred over the middle rows, exact or through a
      Gaussian sketch of ``sketch`` columns (``seed`` fixes it per (layer, KV head));
    * attention (:func:`chunked_attention_mass`): every prompt query (post-RoPE) attends
      non-causally to the keys of its own ``chunk``-token chunk (chunks start at the first
      middle row), logits ``attention_scale * q.k`` (None: the model's ``1/sqrt(d)``); the mass
      each key receives, averaged over the GQA group, times ``||v||`` (``value_norm``), then a
      mean over ``pool`` neighbours (zero-padded at the ends).

    Defaults follow kvpress 0.5.5's ``CompactorPress`` (``leverage_press.py``,
    ``non_causal_attention_press.py``): chunk 256, unscaled logits, ``||v||`` weighting,
    3-token pooling, 8 + 4 protected rows, sketch of 48 columns.  kvpress sets ``blend`` to
    the compression ratio (fraction evicted), which a per-head scorer does not know: pass it
    (``scorer_options={"blend": 0.75}``); the paper's own engine (compactor-vllm) uses 0.5.
    ``blend=None`` scores leverage alone, ``blend=0`` attention alone.  Differences from
    kvpress: statistics are per KV head (kvpress standardises over all heads of a layer), the
    sketch is seeded (kvpress draws a new one per call), and a short last chunk attends over
    its real keys only (kvpress pads it with zero keys that stay in the softmax).

    Measured on the embedded model (benchmarks/runtime_quality.py, 18 retrieval/multi_key
    probes, uniform budgets, evicting 50/75/90%): undoing RoPE matters (post-RoPE leverage
    0.72/0.50/0.39 vs 0.83/0.83/0.67), the sketch does not (exact: same accuracy), leverage
    alone keeps 0.78/0.72/0.61 and the chunked attention alone 0.61/0.33/0.00.
    """

    name = "leverage"
    observation_window = ALL_QUERIES  # the non-causal attention needs every prompt query

    def __init__(
        self,
        blend: float | None = 0.5,
        sketch: int | None = 48,
        pre_rope: bool = True,
        chunk: int = 256,
        attention_scale: float | None = 1.0,
        value_norm: bool = True,
        pool: int = 3,
        exclude_first: int = 8,
        exclude_last: int = 4,
        seed: int = 0,
        ridge: float = 1e-6,
    ):
        # None: leverage alone; the sketch's columns, None: exact; the scale, None: the model's 1/sqrt(d)
        self.blend = None if blend is None else check_number("leverage blend", blend, minimum=0.0)
        self.sketch = None if sketch is None else check_integer("leverage sketch", sketch, minimum=1)
        self.pre_rope = check_flag("leverage pre_rope", pre_rope)
        self.key_rope = self.pre_rope
        self.chunk = check_integer("leverage attention chunk", chunk, minimum=1)
        self.attention_scale = (
            None if attention_scale is None else check_number("leverage attention_scale", attention_scale, above=0.0)
        )
        self.value_norm = check_flag("leverage value_norm", value_norm)
        self.pool = check_integer("leverage pool", pool, minimum=1, odd=True)
        self.exclude_first = check_integer("leverage exclude_first", exclude_first, minimum=0)
        self.exclude_last = check_integer("leverage exclude_last", exclude_last, minimum=0)
        self.seed = check_integer("leverage seed", seed)
        self.ridge = check_number("leverage ridge", ridge, above=0.0)
        if self.blend == 0:  # attention alone: no leverage to compute
            self.key_rope = False
        if self.blend is None:  # leverage alone: no queries needed
            self.observation_window = 0

    def leverage(self, head: HeadContext, rows: slice = slice(None)) -> torch.Tensor:
        """Leverage scores ``[m]`` of the head's keys ``rows`` (pre- or post-RoPE, see the class)."""
        keys = head.keys[rows].float()
        if self.pre_rope:
            if head.key_cos is None or head.key_sin is None:
                raise ValueError(
                    f"{self!r} needs the keys' RoPE (key_cos/key_sin) to undo it; pass pre_rope=False "
                    "for post-RoPE leverage"
                )
            keys = unrotate(
                keys, head.key_cos[rows].float().to(keys.device), head.key_sin[rows].float().to(keys.device)
            )
        generator = None
        if self.sketch is not None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + head.layer * 1009 + head.kv_head)
        return leverage_scores(keys, self.sketch, generator, self.ridge)

    def attention_mass(self, head: HeadContext, rows: slice = slice(None)) -> torch.Tensor:
        """Non-causal chunked attention received by the keys ``rows``, ``||v||``-weighted and pooled."""
        if head.recent_queries is None:
            raise ValueError(
                f"{self!r} needs the prompt's queries: prefill with policy=... (the scorer's observation_window) first"
            )
        keys, positions = head.keys[rows], head.positions[rows].to(head.keys.device).long()
        queries = head.recent_queries  # [G, w, d], the last w prompt tokens
        w = queries.shape[1]
        query_positions = head.next_position - w + torch.arange(w, device=keys.device)
        # only the middle's queries take part (kvpress scores the middle rows as a sequence of their own)
        inside = (query_positions >= positions[0]) & (query_positions <= positions[-1])
        scale = head.scaling if self.attention_scale is None else self.attention_scale
        mass = chunked_attention_mass(
            queries[:, inside], query_positions[inside], keys, positions, self.chunk, scale, origin=int(positions[0])
        )
        if self.value_norm:
            mass = mass * head.values[rows].float().norm(dim=-1)
        if self.pool > 1:
            mass = torch.nn.functional.avg_pool1d(
                mass[None, None], self.pool, stride=1, padding=self.pool // 2, count_include_pad=True
            )[0, 0]
        return mass

    def score(self, head: HeadContext) -> torch.Tensor:
        n = head.keys.shape[0]
        first = min(self.exclude_first, n)
        last = min(self.exclude_last, n - first)
        middle = slice(first, n - last)
        if n - last - first <= 1:  # nothing to rank
            return torch.zeros(n, device=head.keys.device)
        score = None
        if self.blend != 0:
            score = _zscore(self.leverage(head, middle)) * (1.0 if self.blend is None else self.blend)
        if self.blend is not None:
            attention = _zscore(self.attention_mass(head, middle)).to(head.keys.device)
            score = attention if score is None else score.to(attention.device) + attention
        out = torch.empty(n, dtype=torch.float32, device=head.keys.device)
        out[middle] = score.float().to(out.device)
        top = out[middle].max()
        out[:first] = top
        out[n - last :] = top
        return out

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        """:meth:`score` for every row and head of a layer: the same quantities with masks over
        each head's middle rows (batched Cholesky for the leverage, one masked softmax per
        attention chunk for all heads)."""
        keys = layer.keys
        rows, heads, n, _ = keys.shape
        device = keys.device
        lengths = layer.lengths.to(device)
        first = lengths.clamp(max=self.exclude_first)  # [R, Hkv]
        last = (lengths - first).clamp(max=self.exclude_last)
        index = torch.arange(n, device=device)
        middle = (index >= first.unsqueeze(-1)) & (index < (lengths - last).unsqueeze(-1))  # [R, Hkv, n]
        count = middle.sum(-1)  # [R, Hkv]
        score = torch.zeros(rows, heads, n, dtype=torch.float64, device=device)
        if self.blend != 0:
            score = _masked_zscore(self.layer_leverage(layer, middle), middle) * (
                1.0 if self.blend is None else self.blend
            )
        if self.blend is not None:
            score = score + _masked_zscore(self.layer_attention_mass(layer, middle, first, lengths - last), middle)
        score = score.float().masked_fill(~middle, float("-inf"))
        top = score.amax(-1, keepdim=True).expand_as(score)  # the middle's maximum: ends are kept
        score = torch.where(middle, score, top)
        score = torch.where((count <= 1).unsqueeze(-1), torch.zeros_like(score), score)  # nothing to rank
        return score.masked_fill(~layer.valid, float("-inf"))

    def layer_leverage(self, layer: LayerContext, middle: torch.Tensor) -> torch.Tensor:
        """Leverage ``[R, Hkv, n]`` float64 of every head's middle rows (0 elsewhere), see :meth:`leverage`."""
        keys = layer.keys.double()
        if self.pre_rope:
            if layer.key_cos is None or layer.key_sin is None:
                raise ValueError(f"{self!r} needs the keys' RoPE (key_cos/key_sin) to undo it")
            keys = unrotate(keys, layer.key_cos.double().to(keys.device), layer.key_sin.double().to(keys.device))
        weight = middle.unsqueeze(-1).double()
        count = weight.sum(2, keepdim=True).clamp_min(1)
        x = (keys - (keys * weight).sum(2, keepdim=True) / count) * weight  # centred middle rows, 0 elsewhere
        if self.sketch is not None:
            heads = keys.shape[1]
            phi = torch.stack(
                [
                    torch.randn(
                        keys.shape[-1],
                        self.sketch,
                        generator=torch.Generator().manual_seed(self.seed * 1_000_003 + layer.layer * 1009 + h),
                        dtype=torch.float64,
                    )
                    for h in range(heads)
                ]
            ) / math.sqrt(self.sketch)  # [Hkv, d, k], as leverage() draws it per (layer, KV head)
            x = x @ phi.to(x.device)  # [R, Hkv, n, k]
        gram = x.transpose(-1, -2) @ x  # [R, Hkv, k, k]
        jitter = self.ridge * gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)  # [R, Hkv]
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        factor = torch.linalg.cholesky(gram + jitter[..., None, None] * eye)
        whitened = torch.linalg.solve_triangular(factor, x.transpose(-1, -2), upper=False)  # [R, Hkv, k, n]
        return (whitened * whitened).sum(-2)

    def layer_attention_mass(
        self, layer: LayerContext, middle: torch.Tensor, first: torch.Tensor, end: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`attention_mass` of every head's middle rows ``[R, Hkv, n]`` (0 elsewhere): per
        attention chunk, one masked softmax for all rows and heads."""
        if layer.recent_queries is None or any(q is None for q in layer.recent_queries):
            raise ValueError(
                f"{self!r} needs the prompt's queries: prefill with policy=... (the scorer's observation_window) first"
            )
        keys, positions = layer.keys.float(), layer.positions
        rows, heads, n, dim = keys.shape
        device = keys.device
        queries, query_positions = layer.padded_queries()
        group = queries.shape[2]
        origin = positions.gather(-1, first.clamp(max=n - 1).unsqueeze(-1)).squeeze(-1)  # [R, Hkv]
        stop = positions.gather(-1, (end - 1).clamp(min=0, max=n - 1).unsqueeze(-1)).squeeze(-1)
        query_positions = query_positions.unsqueeze(1)  # [R, 1, W]
        inside = (query_positions >= origin.unsqueeze(-1)) & (query_positions <= stop.unsqueeze(-1))  # [R, Hkv, W]
        key_chunk = torch.div(positions - origin.unsqueeze(-1), self.chunk, rounding_mode="floor")
        key_chunk = key_chunk.masked_fill(~middle, -1)
        query_chunk = torch.div(query_positions - origin.unsqueeze(-1), self.chunk, rounding_mode="floor")
        query_chunk = query_chunk.masked_fill(~inside, -1)
        scale = layer.scaling if self.attention_scale is None else self.attention_scale
        mass = torch.zeros(rows, heads, n, dtype=torch.float32, device=device)
        for c in range(int(key_chunk.max()) + 1 if bool(middle.any()) else 0):
            in_keys, in_queries = key_chunk == c, query_chunk == c  # [R, Hkv, n], [R, Hkv, W]
            key_rows = in_keys.any(0).any(0).nonzero().squeeze(1)  # the rows any head has in chunk c
            query_rows = in_queries.any(0).any(0).nonzero().squeeze(1)
            if key_rows.numel() == 0 or query_rows.numel() == 0:
                continue
            lo_k, hi_k = int(key_rows[0]), int(key_rows[-1]) + 1
            lo_q, hi_q = int(query_rows[0]), int(query_rows[-1]) + 1
            span_q, span_k = hi_q - lo_q, hi_k - lo_k
            grouped = queries[:, :, :, lo_q:hi_q].reshape(rows, heads, group * span_q, dim)
            logits = grouped @ keys[:, :, lo_k:hi_k].transpose(-1, -2)  # [R, Hkv, G*q, k]
            if scale != 1.0:
                logits.mul_(scale)
            chunk_keys = in_keys[:, :, lo_k:hi_k]
            ragged = not bool(chunk_keys.all())  # after evictions the heads' chunks differ: mask
            if ragged:
                logits.masked_fill_(~chunk_keys.unsqueeze(2), float("-inf"))
            weights = torch.softmax(logits, dim=-1).view(rows, heads, group, span_q, span_k)
            if ragged:  # a head with no key in this chunk: softmax over nothing, no mass
                has_keys = chunk_keys.any(-1)[:, :, None, None, None]
                weights = torch.where(has_keys, weights, torch.zeros_like(weights))
            chunk_queries = in_queries[:, :, lo_q:hi_q]
            if not bool(chunk_queries.all()):
                weights = weights * chunk_queries[:, :, None, :, None]
            mass[:, :, lo_k:hi_k] += weights.sum(3).mean(2)
        if self.value_norm:
            mass = mass * layer.values.float().norm(dim=-1)
        mass = mass * middle
        if self.pool > 1:  # a mean over neighbours, zero beyond the middle rows (as per head)
            mass = torch.nn.functional.avg_pool1d(
                mass.reshape(rows * heads, 1, n), self.pool, stride=1, padding=self.pool // 2, count_include_pad=True
            ).reshape(rows, heads, n)
        return mass

    def __repr__(self) -> str:
        return (
            f"LeverageScorer(blend={self.blend}, sketch={self.sketch}, pre_rope={self.pre_rope}, chunk={self.chunk}, "
            f"attention_scale={self.attention_scale}, value_norm={self.value_norm}, pool={self.pool}, "
            f"exclude_first={self.exclude_first}, exclude_last={self.exclude_last}, seed={self.seed})"
        )


@dataclass
class KVzipScores:
    """KVzip reconstruction scores of one prompt (:func:`runtime.kvzip.kvzip_scores`):
    ``scores[layer, kv_head, position]`` (float32
    ``[L, Hkv, T]``, ``T`` = the context's real tokens); ``last_keys [L, Hkv, d]`` is the key
    at position ``T - 1`` of every head (to recognise the cache the scores belong to)."""

    scores: torch.Tensor
    last_keys: torch.Tensor
    prefix_length: int
    chunks: int
    reconstruction_tokens: int
    seconds: float

    @property
    def length(self) -> int:
        return int(self.scores.shape[-1])


class KVzipScorer(Scorer):
    """Scores precomputed by :func:`runtime.kvzip.kvzip_scores` (KVzip, arXiv 2505.23416), looked up by position.

    One instance belongs to one prompt (one batch row): build it with
    :func:`runtime.kvzip.with_kvzip_scores`.  Rows past the scored context (tokens decoded later) score
    ``+inf``: they are never evicted before a context token.  The scores are attention weights, on
    one scale for every head, so ``allocation="global"`` ranks all heads' tokens together: KVzip's
    own allocation (one top-k over every layer and KV head, :func:`runtime.kvzip.kvzip_budgets`).
    """

    name = "kvzip"
    comparable = True

    def __init__(self, scores: KVzipScores | None = None):
        if scores is not None and not isinstance(scores, KVzipScores):
            raise ValueError(f"kvzip scores must come from runtime.kvzip.kvzip_scores, got {type(scores).__name__}")
        self.table = scores

    def _checked_table(self, layer: int, next_positions) -> KVzipScores:
        if self.table is None:
            raise ValueError(
                "the kvzip scorer needs a reconstruction pass over the prefilled cache: "
                "scores = runtime.kvzip.kvzip_scores(model, tokenizer, cache, context_ids), then "
                "compress with runtime.kvzip.with_kvzip_scores(policy, scores)"
            )
        table = self.table
        if layer >= table.scores.shape[0]:
            raise ValueError(f"kvzip scores cover {table.scores.shape[0]} layers, asked for layer {layer}")
        if min(next_positions) < table.length:
            raise ValueError(
                f"kvzip scores are for a {table.length}-token context, the cache has only seen "
                f"{min(next_positions)} tokens: they belong to another prompt"
            )
        return table

    def score(self, head: HeadContext) -> torch.Tensor:
        table = self._checked_table(head.layer, [head.next_position])
        if head.kv_head >= table.scores.shape[1]:
            raise ValueError(f"kvzip scores cover {table.scores.shape[1]} KV heads, asked for {head.kv_head}")
        positions = head.positions.long().cpu()
        last = (positions == table.length - 1).nonzero()
        if last.numel() and not torch.allclose(
            head.keys[int(last[0, 0])].float().cpu(), table.last_keys[head.layer, head.kv_head], rtol=1e-4, atol=1e-5
        ):
            raise ValueError("kvzip scores belong to another prompt (the keys differ): compute them on this cache")
        out = torch.full((positions.shape[0],), float("inf"))
        inside = positions < table.length
        out[inside] = table.scores[head.layer, head.kv_head, positions[inside]]
        return out.to(head.keys.device)

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        table = self._checked_table(layer.layer, layer.next_positions)
        rows, heads = layer.lengths.shape
        if heads != table.scores.shape[1]:
            raise ValueError(f"kvzip scores cover {table.scores.shape[1]} KV heads, the layer has {heads}")
        device = layer.keys.device
        positions = layer.positions.to(device)
        # the key at the last scored position must be the one the scores were computed with
        last = (positions == table.length - 1) & layer.valid  # [R, Hkv, n]
        found = last.any(-1)  # [R, Hkv]
        keys_there = (layer.keys.float() * last.unsqueeze(-1)).sum(2).cpu()  # [R, Hkv, d]
        wanted = table.last_keys[layer.layer].unsqueeze(0).expand(rows, -1, -1)
        if found.any() and not torch.allclose(keys_there[found.cpu()], wanted[found.cpu()], rtol=1e-4, atol=1e-5):
            raise ValueError("kvzip scores belong to another prompt (the keys differ): compute them on this cache")
        scores = table.scores[layer.layer].to(device).unsqueeze(0).expand(rows, -1, -1)  # [R, Hkv, T]
        inside = (positions < table.length) & layer.valid
        looked_up = torch.gather(scores, 2, positions.clamp(0, table.length - 1))  # [R, Hkv, n]
        out = torch.where(inside, looked_up, torch.full_like(looked_up, float("inf")))
        return out.masked_fill(~layer.valid, float("-inf"))

    def __repr__(self) -> str:
        return f"KVzipScorer({'no scores' if self.table is None else f'{self.table.length} tokens'})"


class LearnedScorer(Scorer):
    """The artifact's learned scorer: a per-head linear map from a token's pre-RoPE key and value
    to the log of its KVzip reconstruction importance (fitted by ``profile-model``'s
    ``learned-scorer`` stage; "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction", arXiv 2505.23416, distilled as in "KVzap", arXiv 2601.07891).

    ``score = [unrotate(k), v] . w + b``: one small matmul per head, no extra forward pass.
    Scores predict log attention weights, so they are comparable across heads.
    """

    name = "learned"
    key_rope = True
    learned = True
    comparable = True

    def score(self, head: HeadContext) -> torch.Tensor:
        if head.learned_weights is None or head.key_cos is None or head.key_sin is None:
            raise ValueError(f"{self!r} needs the artifact's learned_scorer weights and the keys' RoPE")
        keys = head.keys.float()
        cos, sin = head.key_cos.float().to(keys.device), head.key_sin.float().to(keys.device)
        features = torch.cat([unrotate(keys, cos, sin), head.values.float()], dim=-1)  # [n, 2d]
        return features @ head.learned_weights.float().to(keys.device) + float(head.learned_bias)

    def score_layer(self, layer: LayerContext) -> torch.Tensor:
        if layer.learned_weights is None or layer.key_cos is None or layer.key_sin is None:
            raise ValueError(f"{self!r} needs the artifact's learned_scorer weights and the keys' RoPE")
        keys = layer.keys.float()
        pre_rope = unrotate(keys, layer.key_cos.float().to(keys.device), layer.key_sin.float().to(keys.device))
        features = torch.cat([pre_rope, layer.values.float()], dim=-1)  # [R, Hkv, n, 2d]
        weights = layer.learned_weights.float().to(keys.device)  # [Hkv, 2d]
        scores = torch.einsum("rhnf,hf->rhn", features, weights) + layer.learned_bias.float().to(keys.device)[:, None]
        return scores.masked_fill(~layer.valid, float("-inf"))


SCORERS: dict[str, type[Scorer]] = {
    ExpectedAttentionScorer.name: ExpectedAttentionScorer,
    PrototypeAttentionScorer.name: PrototypeAttentionScorer,
    KeyDiffScorer.name: KeyDiffScorer,
    SnapKVScorer.name: SnapKVScorer,
    KNormScorer.name: KNormScorer,
    StreamingScorer.name: StreamingScorer,
    LeverageScorer.name: LeverageScorer,
    KVzipScorer.name: KVzipScorer,
    LearnedScorer.name: LearnedScorer,
}


def make_scorer(name: str, **options) -> Scorer:
    """A scorer by name; ``options`` go to its constructor."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known scorers: {', '.join(sorted(SCORERS))}")
    try:
        return SCORERS[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options {options} for scorer {name!r}: {exc}") from None
