"""Evicting KV heads down to their budgets: scorer, sinks and window, moments.

:class:`HeadEvictor` is built once per compression from the model, the policy, the
calibration and the prompt's statistics.  ``compress()`` calls :meth:`HeadEvictor.evict_layer`
for every layer after prefill (or after each prefill block), and the cache calls it while
decoding when the policy has ``evict_every`` (heads that grew ``evict_every`` tokens past their
budget are cut back to it).  One layer is one batched computation for all its rows and heads:
the scorer's ``score_layer`` over a :class:`~runtime.scorers.LayerContext`, one ranking
(:func:`~runtime.selection.keep_mask`), one gather that compacts the kept rows
(:meth:`~runtime.cache.RaggedLayer.keep_rows`) and one batched fold of the evicted rows into the
moment sums.  Scorers see every head at the current absolute position of its row (EA's RoPE
average starts at the next token, so at decode time it moves with generation).

Moment-informed eviction (``policy.moment_eviction``, docs/design.md section 4) works head by head
(:meth:`HeadEvictor.evict_head_in_rounds`): the scorer's attention estimate ``a_j`` is combined
with the moment residual, ``a_j ||r_j||``, and tokens are evicted in ``policy.moment_rounds``
rounds with the sums updated in between (:func:`runtime.moments.evict_in_rounds`).
"""

from __future__ import annotations

import numpy as np
import torch

from .geometry import ModelGeometry
from .moments import evict_in_rounds
from .rope import averaged_rope, rope_cos_sin
from .scorers import ALL_QUERIES, HeadContext, LayerContext
from .selection import keep_mask, protected_mask

# Elements of one row's keys (Hkv x n x d) a CPU scoring tile may hold in all: scorers make a few
# intermediates of that size, and past the caches' size they run memory-bound (measured: Compactor's
# scores for 8 rows of 1K tokens took 6.0 s in one tile vs 3.7 s head by head).
_CPU_TILE_ELEMENTS = 1 << 18


def rows_per_tile(device: torch.device, row_elements: int) -> int:
    """How many batch rows one scoring call takes: every row on an accelerator, on a CPU as many as
    fit :data:`_CPU_TILE_ELEMENTS` (at least one)."""
    if torch.device(device).type != "cpu":
        return 1 << 30
    return max(1, _CPU_TILE_ELEMENTS // max(row_elements, 1))


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
        if self.scorer.query_statistics in ("calibrated", "future"):
            identity = calibration.identity
            if (identity.num_layers, identity.num_q_heads) != (self.num_layers, self.num_q_heads):
                raise ValueError("calibration statistics do not match the model's layers / query heads")
            future = self.scorer.query_statistics == "future"  # the future_queries section's, else query_stats'
            self.calibrated = (
                torch.from_numpy(np.asarray(calibration.future_mean if future else calibration.query_mean)),
                torch.from_numpy(np.asarray(calibration.future_cov if future else calibration.query_cov)),
            )
        self.centres = None
        if self.scorer.query_centres:
            centres = torch.from_numpy(np.asarray(calibration.future_centres, dtype=np.float32))  # [L, Hq, K, d]
            weights = torch.from_numpy(np.asarray(calibration.future_centre_weights, dtype=np.float32))  # [L, Hq, K]
            if tuple(centres.shape[:2]) != (self.num_layers, self.num_q_heads) or centres.shape[-1] != (
                geometry.head_dim
            ):
                raise ValueError(
                    f"future-query centres of shape {tuple(centres.shape)} do not fit the model ({self.num_layers} "
                    f"layers, {self.num_q_heads} query heads, d={geometry.head_dim})"
                )
            k = centres.shape[2]
            self.centres = (
                centres.reshape(self.num_layers, self.num_kv_heads, self.group, k, -1),
                weights.reshape(self.num_layers, self.num_kv_heads, self.group, k),
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
        (``stats_row``: the element's row in the prompt statistics, default ``b``): the head of
        :meth:`layer_context`, so that both see exactly the same inputs."""
        row = [b if stats_row is None else stats_row]
        return self.layer_context(layer, layer_idx, [b], [next_position], row).head(0, h)

    def _check_recorded(self, recorded: torch.Tensor | None, next_position: int) -> None:
        """Refuse to score with fewer recorded prompt queries than the scorer observes."""
        wanted = self.scorer.observation_window
        if recorded is None or recorded.shape[1] < min(wanted, next_position):
            have = 0 if recorded is None else recorded.shape[1]
            needs = "every prompt query" if wanted >= ALL_QUERIES else f"the last {wanted} prompt queries"
            raise ValueError(
                f"{self.scorer!r} needs {needs}, only {have} were recorded: prefill with policy=... "
                "(or observe_queries=...) for this scorer"
            )

    def head_scores(self, layer, layer_idx: int, b: int, h: int, next_position: int) -> torch.Tensor:
        """The scorer's scores ``[n]`` of head ``(b, layer_idx, h)`` (nothing evicted)."""
        return self._checked(self.scorer.score(self.context(layer, layer_idx, b, h, next_position)), layer_idx, h)

    def _checked(self, scores: torch.Tensor, layer_idx: int, h: int, what: str = "scores") -> torch.Tensor:
        """``scores``, refused when any is NaN: ranking NaN keeps arbitrary tokens, silently (a
        calibration whose statistics overflow does that).  ``+inf`` is a score (never evict)."""
        if bool(torch.isnan(scores).any()):
            self._refuse_nan(layer_idx, h, what)
        return scores

    def _refuse_nan(self, layer_idx: int, h: int, what: str = "scores") -> None:
        raise ValueError(
            f"{self.scorer!r} returned NaN {what} for layer {layer_idx}, KV head {h}: its inputs overflow "
            "(the calibration's statistics or the cached keys); refusing to evict on them"
        )

    def evict_head_in_rounds(
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
    ) -> None:
        """Moment-informed eviction of head ``(b, layer_idx, h)`` down to ``budget`` tokens (see the
        module docstring); ``shrink=False`` (decoding) keeps the capacity for the next tokens."""
        length = layer.lengths[b][h]
        if budget >= length:
            return
        if layer.moments[b] is None:
            raise ValueError(
                "moment-informed eviction needs a cache that tracks moments (RaggedCache(..., track_moments=True))"
            )
        context = self.context(layer, layer_idx, b, h, next_position, stats_row)
        policy = self.policy
        attention = self._checked(self.scorer.attention(context), layer_idx, h, "attention estimates")
        every = torch.ones(length, dtype=torch.bool, device=context.keys.device)
        protected = protected_mask(every, budget, policy.n_sink, policy.window)  # [length]
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

    # -- a whole layer at once ---------------------------------------------------------------

    def layer_context(
        self, layer, layer_idx: int, rows: list[int], next_positions: list[int], stats_rows: list[int] | None = None
    ) -> LayerContext:
        """What the scorer sees of batch rows ``rows`` of layer ``layer_idx`` (every KV head, padded)."""
        keys, values, positions, valid = layer.padded_rows(rows)
        lengths = layer.length[rows]
        context = LayerContext(
            layer=layer_idx,
            keys=keys,
            values=values,
            positions=positions,
            valid=valid,
            lengths=lengths,
            scaling=self.scalings[layer_idx],
            next_positions=list(next_positions),
        )
        scorer = self.scorer
        stats_rows = rows if stats_rows is None else stats_rows
        if scorer.rope_horizon:
            pairs = [self._rope_at(int(p)) for p in next_positions]
            context.rope_cos = torch.stack([cos for cos, _ in pairs])
            context.rope_sin = torch.stack([sin for _, sin in pairs])
        if scorer.query_statistics is not None:
            stats = [self._query_stats(r) for r in stats_rows]
            shape = (self.num_kv_heads, self.group)
            context.query_mean = torch.stack([mean[layer_idx].reshape(*shape, -1) for mean, _ in stats])
            context.query_cov = torch.stack([cov[layer_idx].reshape(*shape, *cov.shape[-2:]) for _, cov in stats])
        if scorer.observation_window:
            context.recent_queries = []
            for r, position in zip(rows, next_positions, strict=True):
                recorded = layer.rows[r].recent_queries  # [Hq, w_recorded, d]
                self._check_recorded(recorded, int(position))
                context.recent_queries.append(recorded[:, -scorer.observation_window :])
        if scorer.key_rope:
            cos, sin = self._key_rope(positions.reshape(-1))
            context.key_cos = cos.reshape(*positions.shape, -1).to(keys.device)
            context.key_sin = sin.reshape(*positions.shape, -1).to(keys.device)
        if scorer.query_centres:
            context.query_centres, context.centre_weights = (part[layer_idx] for part in self.centres)
        if scorer.learned:
            weights, bias = self.learned
            context.learned_weights = weights[layer_idx]
            context.learned_bias = torch.as_tensor(bias[layer_idx], dtype=torch.float32)
        return context

    def layer_scores(
        self, layer, layer_idx: int, rows: list[int], next_positions: list[int], stats_rows: list[int] | None = None
    ) -> torch.Tensor:
        """The scorer's scores ``[R, Hkv, n]`` of rows ``rows`` of the layer (padding: ``-inf``).

        Rows are scored in tiles of :func:`rows_per_tile` rows (all rows at once on a GPU; on a
        CPU a few, so the scorer's intermediates stay in cache), every head of a tile in one call.
        """
        stats_rows = rows if stats_rows is None else stats_rows
        longest = int(layer.length[rows].max()) if rows else 0
        step = rows_per_tile(layer.key_buffer.device, layer.num_heads * max(longest, 1) * layer.head_dim)
        parts = []
        for lo in range(0, len(rows), step):
            tile = slice(lo, lo + step)
            context = self.layer_context(layer, layer_idx, rows[tile], next_positions[tile], stats_rows[tile])
            scores = self.scorer.layer_scores(context)
            if tuple(scores.shape) != tuple(context.valid.shape):
                raise ValueError(
                    f"{self.scorer!r} returned layer scores of shape {tuple(scores.shape)} for "
                    f"{tuple(context.valid.shape)}"
                )
            scores = self._checked_layer(scores, context.valid, layer_idx)
            parts.append(torch.nn.functional.pad(scores, (0, longest - scores.shape[-1]), value=float("-inf")))
        return torch.cat(parts) if parts else torch.zeros(0, layer.num_heads, 0)

    def _checked_layer(self, scores: torch.Tensor, valid: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """:meth:`_checked` for a whole layer: one check, naming the first head with a NaN score."""
        bad = torch.isnan(scores) & valid
        if bool(bad.any()):
            self._refuse_nan(layer_idx, int(bad.any(-1).nonzero()[0, 1]))
        return scores

    def evict_decoded(
        self,
        layer,
        layer_idx: int,
        rows: list[int],
        budgets: torch.Tensor,
        next_positions: list[int],
        stats_rows: list[int],
    ) -> None:
        """The decode-time eviction hook (:class:`runtime.row_state.DecodeEvictionHook`): the heads of
        batch rows ``rows`` that decoding grew past their budgets cut back to ``budgets`` int64
        ``[R, Hkv]``, the capacity kept for the tokens that follow."""
        self.evict_layer(layer, layer_idx, rows, budgets, next_positions, shrink=False, stats_rows=stats_rows)

    def evict_layer(
        self,
        layer,
        layer_idx: int,
        rows: list[int],
        budgets,
        next_positions: list[int],
        *,
        shrink: bool = True,
        stats_rows: list[int] | None = None,
        scores: torch.Tensor | None = None,
    ) -> None:
        """Cut every KV head of batch rows ``rows`` down to ``budgets`` int ``[R, Hkv]`` tokens.

        ``scores``: the layer's ``[R, Hkv, n]`` scores when already computed (``global``
        allocation ranks every head's scores before any head is cut).  ``shrink=False``
        (decoding) keeps the capacity for the tokens that follow.
        """
        budgets = torch.as_tensor(np.asarray(budgets), dtype=torch.int64)
        if not rows or not bool((layer.length[rows] > budgets).any()):
            return
        if self.policy.moment_eviction:  # rounds that re-score against updated sums: head by head
            stats_rows = rows if stats_rows is None else stats_rows
            for i, (r, position) in enumerate(zip(rows, next_positions, strict=True)):
                for h in range(self.num_kv_heads):
                    self.evict_head_in_rounds(
                        layer,
                        layer_idx,
                        r,
                        h,
                        int(budgets[i, h]),
                        int(position),
                        shrink=shrink,
                        stats_row=stats_rows[i],
                    )
            return
        if scores is None:
            scores = self.layer_scores(layer, layer_idx, rows, next_positions, stats_rows)
        valid = torch.arange(scores.shape[-1]) < layer.length[rows].unsqueeze(-1)
        keep = keep_mask(scores, valid.to(scores.device), budgets, self.policy.n_sink, self.policy.window)
        layer.keep_rows(rows, keep, shrink=shrink)
