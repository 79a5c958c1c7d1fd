"""Token scorers: which retained tokens of one KV head matter most (higher = keep).

A scorer is a small class with a ``score(head) -> [n]`` method over one KV head's live
tokens (:class:`HeadContext`) and a few class attributes saying what the compression engine
must collect for it:

* ``query_statistics``: ``"calibrated"`` (the artifact's pre-RoPE query mean/covariance),
  ``"prompt"`` (measured on the prompt's own pre-RoPE queries) or ``None``;
* ``rope_horizon``: when > 0, the engine averages RoPE over that many positions starting at
  the absolute position of the next token and passes ``rope_cos/rope_sin``;
* ``observation_window``: when > 0, the last that many post-RoPE prompt queries are kept.

Adding a scorer: subclass :class:`Scorer`, implement ``score``, and either add it to
``SCORERS`` or put an instance directly in the policy (``CompressionPolicy(scorer=MyScorer())``).
The sink and recent-window rules are applied by the engine (:func:`select_rows`), not here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

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


class Scorer(ABC):
    """Base class; see the module docstring."""

    name = "scorer"
    query_statistics: str | None = None
    rope_horizon = 0
    observation_window = 0

    @abstractmethod
    def score(self, head: HeadContext) -> torch.Tensor:
        """Scores ``[n]`` for the head's live tokens; higher means more worth keeping."""

    yields_attention = False  # True when attention() is implemented (moment-informed eviction)

    def attention(self, head: HeadContext) -> torch.Tensor:
        """The scorer's estimate ``a_j [n]`` of the attention future queries pay each token."""
        raise TypeError(f"{self!r} gives no attention estimate (moment-informed eviction needs one: "
                        "expected_attention or snapkv)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ExpectedAttentionScorer(Scorer):
    """Expected Attention (seed 000, Eq. 5-9; DESIGN.md section 1).

    ``z_i = s mu'.k_i + (s^2/2) k_i^T Sigma' k_i`` with ``mu' = Rbar mu``,
    ``Sigma' = Rbar Sigma Rbar^T``; ``a = softmax(z)`` per query head, averaged over the GQA
    group; score ``(a_i + epsilon) * ||v_i||``.  ``pool > 1`` (odd) replaces ``a_i`` by its maximum
    over the ``pool`` neighbouring rows, so a span (e.g. a number's digit tokens) is kept whole
    when one of its tokens is attended.
    """

    name = "expected_attention"

    def __init__(self, statistics: str = "calibrated", horizon: int = 512, epsilon: float = 0.0, pool: int = 1):
        if statistics not in ("calibrated", "prompt"):
            raise ValueError(f"expected_attention statistics must be 'calibrated' or 'prompt', got {statistics!r}")
        if horizon <= 0:
            raise ValueError(f"expected_attention horizon must be positive, got {horizon}")
        if epsilon < 0:
            raise ValueError(f"expected_attention epsilon must be >= 0, got {epsilon}")
        if pool <= 0 or pool % 2 == 0:
            raise ValueError(f"expected_attention pool must be a positive odd number of tokens, got {pool}")
        self.pool = int(pool)
        self.query_statistics = statistics
        self.rope_horizon = int(horizon)
        self.epsilon = float(epsilon)

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
        if self.pool > 1:  # a token is worth what its most-attended neighbour is (keeps spans whole)
            attention = torch.nn.functional.max_pool1d(attention[None, None], self.pool, stride=1,
                                                       padding=self.pool // 2)[0, 0]
        return attention

    def score(self, head: HeadContext) -> torch.Tensor:
        return (self.attention(head) + self.epsilon) * head.values.float().norm(dim=-1)

    def __repr__(self) -> str:
        return (f"ExpectedAttentionScorer(statistics={self.query_statistics!r}, horizon={self.rope_horizon}, "
                f"epsilon={self.epsilon}, pool={self.pool})")


class KeyDiffScorer(Scorer):
    """KeyDiff (seed 001, Eq. 8): ``-cos(k_i, mean_j k_j/||k_j||)``; no attention needed."""

    name = "keydiff"

    def score(self, head: HeadContext) -> torch.Tensor:
        keys = head.keys.float()
        anchor = torch.nn.functional.normalize(keys, dim=-1).mean(0)  # [d]
        return -torch.nn.functional.cosine_similarity(keys, anchor.unsqueeze(0), dim=-1)


class SnapKVScorer(Scorer):
    """SnapKV: attention of the last ``window`` prompt queries, summed, pooled over neighbours."""

    name = "snapkv"

    def __init__(self, window: int = 32, kernel: int = 5):
        if window <= 0:
            raise ValueError(f"snapkv observation window must be positive, got {window}")
        if kernel <= 0 or kernel % 2 == 0:
            raise ValueError(f"snapkv pooling kernel must be a positive odd number, got {kernel}")
        self.observation_window = int(window)
        self.kernel = int(kernel)

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
        pooled = torch.nn.functional.avg_pool1d(weights[None, None], self.kernel, stride=1,
                                                padding=self.kernel // 2, count_include_pad=False)
        return pooled[0, 0]

    def __repr__(self) -> str:
        return f"SnapKVScorer(window={self.observation_window}, kernel={self.kernel})"


class KNormScorer(Scorer):
    """KNorm: keep the keys with the lowest L2 norm."""

    name = "knorm"

    def score(self, head: HeadContext) -> torch.Tensor:
        return -head.keys.float().norm(dim=-1)


class StreamingScorer(Scorer):
    """StreamingLLM: sinks + the most recent tokens (score = position)."""

    name = "streaming"

    def score(self, head: HeadContext) -> torch.Tensor:
        return head.positions.float()


SCORERS: dict[str, type[Scorer]] = {
    ExpectedAttentionScorer.name: ExpectedAttentionScorer,
    KeyDiffScorer.name: KeyDiffScorer,
    SnapKVScorer.name: SnapKVScorer,
    KNormScorer.name: KNormScorer,
    StreamingScorer.name: StreamingScorer,
}


def make_scorer(name: str, **options) -> Scorer:
    """A scorer by name; ``options`` go to its constructor."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known scorers: {', '.join(sorted(SCORERS))}")
    try:
        return SCORERS[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options {options} for scorer {name!r}: {exc}") from None


def select_rows(scores: torch.Tensor, budget: int, n_sink: int, window: int) -> torch.Tensor:
    """Sorted rows to keep out of ``n = len(scores)``: sinks, recent window, then top scores.

    The first ``n_sink`` rows and the last ``window`` rows are kept unconditionally; when the
    budget is smaller than both together, sinks come first, then the most recent rows.
    """
    n = scores.shape[0]
    device = scores.device
    if budget >= n:
        return torch.arange(n, device=device)
    if budget <= 0:
        return torch.empty(0, dtype=torch.long, device=device)
    sinks = min(n_sink, budget)
    recent = min(window, budget - sinks)
    middle_end = n - recent
    chosen = budget - sinks - recent
    middle = scores[sinks:middle_end]
    top = torch.topk(middle.float(), chosen, sorted=False).indices + sinks if chosen > 0 else \
        torch.empty(0, dtype=torch.long, device=device)
    rows = torch.cat([torch.arange(sinks, device=device), top, torch.arange(middle_end, n, device=device)])
    return torch.sort(rows).values
