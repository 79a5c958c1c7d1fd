"""Evicting one KV head down to its budget: scorer, sinks and window, moments.

:class:`HeadEvictor` is built once per compression from the model, the policy, the
calibration and the prompt's statistics.  ``compress()`` calls it for every head after
prefill (or after each prefill block), and the cache calls it while decoding when the policy
has ``evict_every`` (a head that grew ``evict_every`` tokens past its budget is cut back to
the budget).  One call:

1. builds the head's :class:`~runtime.scorers.HeadContext` at the current absolute position
   (EA's RoPE average starts at the next token, so at decode time it moves with generation);
2. plain eviction: ``select_rows`` keeps sinks, recent window and the best scores; the
   evicted rows are folded into the layer's moment sums when the cache tracks them;
3. moment-informed eviction (``policy.moment_eviction``, docs/design.md section 4): the scorer's
   attention estimate ``a_j`` is combined with the moment residual, ``a_j ||r_j||``, and
   tokens are evicted in ``policy.moment_rounds`` rounds with the sums updated in between
   (:func:`runtime.moments.evict_in_rounds`).
"""

from __future__ import annotations

import numpy as np
import torch

from .geometry import ModelGeometry
from .moments import evict_in_rounds
from .rope import averaged_rope, rope_cos_sin
from .scorers import ALL_QUERIES, HeadContext, select_rows


class HeadEvictor:
    """Evicts single heads of a :class:`~runtime.cache.RaggedCache` under one policy."""

    def __init__(self, model, policy, calibration=None, prompt_stats=None):
        policy.check_calibration(calibration)
        self.policy = policy
        self.scorer = policy.build_scorer()
        self.geometry = geometry = ModelGeometry.of(model)
        self.num_layers = geometry.num_layers
        self.num_q_heads = geometry.num_q_heads
        self.num_kv_heads = geometry.num_kv_heads
        self.group = geometry.group_size
        self.scalings = geometry.scalings
        self._rope: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._key_rope_memo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.prompt_stats = prompt_stats
        if self.scorer.query_statistics == "prompt" and prompt_stats is None:
            raise ValueError(f"{self.scorer!r} needs the prompt's query statistics: prefill with policy=... first")
        self.calibrated = None
        if self.scorer.query_statistics == "calibrated":
            identity = calibration.identity
            if (identity.num_layers, identity.num_q_heads) != (self.num_layers, self.num_q_heads):
                raise ValueError("calibration statistics do not match the model's layers / query heads")
            self.calibrated = (
                torch.from_numpy(np.asarray(calibration.query_mean)),
                torch.from_numpy(np.asarray(calibration.query_cov)),
            )
        self.learned = None
        if self.scorer.learned:
            weights = torch.from_numpy(np.asarray(calibration.scorer_weights, dtype=np.float32))  # [L, Hkv, 2d]
            if tuple(weights.shape) != (self.num_layers, self.num_kv_heads, 2 * geometry.head_dim):
                raise ValueError(
                    f"learned scorer weights of shape {tuple(weights.shape)} do not fit the model "
                    f"({self.num_layers} layers, {self.num_kv_heads} KV heads, d={geometry.head_dim})"
                )
            self.learned = (weights, np.asarray(calibration.scorer_bias, dtype=np.float64))

    def _rope_at(self, next_position: int):
        if self._rope is None or self._rope[0] != next_position:
            self._rope = (next_position, averaged_rope(self.geometry, next_position, self.scorer.rope_horizon))
        return self._rope[1]

    def _key_rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [n, d]`` at ``positions``; the heads of a freshly prefilled prompt share their
        positions, so the last result is reused while the positions are the same."""
        memo = self._key_rope_memo
        if memo is None or memo[0].shape != positions.shape or not torch.equal(memo[0], positions):
            memo = self._key_rope_memo = (positions.clone(), *rope_cos_sin(self.geometry, positions))
        return memo[1], memo[2]

    def _query_stats(self, b: int):
        if self.calibrated is not None:
            return self.calibrated
        if b not in self._stats:
            self._stats[b] = self.prompt_stats.mean_cov(b)
        return self._stats[b]

    def context(
        self, layer, layer_idx: int, b: int, h: int, next_position: int, stats_row: int | None = None
    ) -> HeadContext:
        """What the scorer sees of head ``(b, layer_idx, h)`` with the next token at ``next_position``
        (``stats_row``: the element's row in the prompt statistics, default ``b``)."""
        keys, values, positions = layer.head(b, h)
        context = HeadContext(
            layer=layer_idx,
            kv_head=h,
            keys=keys,
            values=values,
            positions=positions,
            scaling=self.scalings[layer_idx],
            next_position=next_position,
        )
        heads = slice(h * self.group, (h + 1) * self.group)
        if self.scorer.rope_horizon:
            context.rope_cos, context.rope_sin = self._rope_at(next_position)
        if self.scorer.query_statistics is not None:
            mean_all, cov_all = self._query_stats(b if stats_row is None else stats_row)
            context.query_mean, context.query_cov = mean_all[layer_idx, heads], cov_all[layer_idx, heads]
        if self.scorer.observation_window:
            recorded = layer.recent_queries[b]  # [Hq, w_recorded, d]
            if recorded is None or recorded.shape[1] < min(self.scorer.observation_window, next_position):
                have = 0 if recorded is None else recorded.shape[1]
                wanted = self.scorer.observation_window
                needs = "every prompt query" if wanted >= ALL_QUERIES else f"the last {wanted} prompt queries"
                raise ValueError(
                    f"{self.scorer!r} needs {needs}, only {have} were recorded: prefill with policy=... "
                    "(or observe_queries=...) for this scorer"
                )
            context.recent_queries = recorded[heads, -self.scorer.observation_window :]
        if self.scorer.key_rope:  # the RoPE of each key's own position (to undo it: pre-RoPE keys)
            context.key_cos, context.key_sin = self._key_rope(positions)
        if self.scorer.learned:
            weights, bias = self.learned
            context.learned_weights, context.learned_bias = weights[layer_idx, h], float(bias[layer_idx, h])
        return context

    def head_scores(self, layer, layer_idx: int, b: int, h: int, next_position: int) -> torch.Tensor:
        """The scorer's scores ``[n]`` of head ``(b, layer_idx, h)`` (nothing evicted)."""
        return self._checked(self.scorer.score(self.context(layer, layer_idx, b, h, next_position)), layer_idx, h)

    def _checked(self, scores: torch.Tensor, layer_idx: int, h: int, what: str = "scores") -> torch.Tensor:
        """``scores``, refused when any is NaN: ranking NaN keeps arbitrary tokens, silently (a
        calibration whose statistics overflow does that).  ``+inf`` is a score (never evict)."""
        if bool(torch.isnan(scores).any()):
            raise ValueError(
                f"{self.scorer!r} returned NaN {what} for layer {layer_idx}, KV head {h}: its inputs overflow "
                "(the calibration's statistics or the cached keys); refusing to evict on them"
            )
        return scores

    def evict(
        self,
        layer,
        layer_idx: int,
        b: int,
        h: int,
        budget: int,
        next_position: int,
        *,
        shrink: bool = True,
        stats_row: int | None = None,
        scores: torch.Tensor | None = None,
    ) -> int:
        """Cut head ``(b, layer_idx, h)`` down to ``budget`` tokens; returns how many were evicted.

        ``shrink=False`` (decoding) keeps the buffers' capacity so the next tokens append
        without reallocating.  ``scores``: the head's scores when already computed (``global``
        allocation ranks every head's scores before any head is cut).
        """
        length = layer.lengths[b][h]
        if budget >= length:
            return 0
        context = self.context(layer, layer_idx, b, h, next_position, stats_row)
        policy = self.policy
        if policy.moment_eviction:
            if layer.moments[b] is None:
                raise ValueError(
                    "moment-informed eviction needs a cache that tracks moments (RaggedCache(..., track_moments=True))"
                )
            attention = self._checked(self.scorer.attention(context), layer_idx, h, "attention estimates")
            protected = torch.zeros(length, dtype=torch.bool, device=context.keys.device)
            protected[: min(policy.n_sink, budget)] = True
            recent = min(policy.window, max(budget - policy.n_sink, 0))
            if recent:
                protected[length - recent :] = True
            rows = evict_in_rounds(
                attention,
                context.keys,
                context.values,
                layer.moments[b],
                h,
                context.scaling,
                budget,
                rounds=policy.moment_rounds,
                protected=protected,
                tau=policy.tau or 0.0,
            )
            layer.keep(b, h, rows, fold=False, shrink=shrink)
        else:
            scores = self._checked(self.scorer.score(context), layer_idx, h) if scores is None else scores
            if scores.shape != (length,):
                raise ValueError(f"{self.scorer!r} returned scores of shape {tuple(scores.shape)} for {length} tokens")
            layer.keep(b, h, select_rows(scores, budget, policy.n_sink, policy.window), shrink=shrink)
        return length - layer.lengths[b][h]
