"""Evicting KV heads down to their budgets: scorer, sinks and window, moments.

:class:`HeadEvictor` is built once per compression from a :class:`~runtime.plan.serving_plan.ServingPlan`
(the policy with the calibration tensors it reads, loaded and checked by ``bind``) and the
prompt's statistics.  ``compress()`` calls :meth:`HeadEvictor.evict_layer` for every layer
after prefill (or after each prefill block, or inside the prefill right after each layer's
attention), and the eviction driver calls it while decoding when the policy has ``evict_every``
(:meth:`HeadEvictor.evict_decoded`, :func:`runtime.compression.driver.after_attention`: heads that
grew ``evict_every`` tokens past their budget are cut back to it).  One layer is one batched
computation for all its rows and heads:
the scorer's ``score`` over a :class:`~runtime.scorers.LayerInputs` (built by the scorer's input
providers, :class:`~runtime.scorers.ScorerInputs`), one ranking
(:func:`~runtime.compression.keep_rule.keep_mask`), one gather that compacts the kept rows
(:meth:`~runtime.kv_store.cache.RaggedLayer.keep_rows`) and one batched fold of the evicted rows into the
moment sums.  Scorers see every head at the current absolute position of its row (EA's RoPE
average starts at the next token, so at decode time it moves with generation).

Moment-informed eviction (``policy.moment_eviction``, docs/design.md section 4) works row by row
(:meth:`HeadEvictor.evict_row_in_rounds`): the scorer's attention estimate ``a_j`` is combined
with the moment residual, ``a_j ||r_j||``, and tokens are evicted in ``policy.moment_rounds``
rounds with the sums updated in between (:func:`runtime.math.momentkv.evict_in_rounds`).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.compression.keep_rule import keep_mask, protected_mask
from runtime.kv_store.profiling import label
from runtime.math.arrays import host_array, to_device
from runtime.math.momentkv import evict_in_rounds
from runtime.plan.serving_plan import ServingPlan
from runtime.scorers import LayerInputs, ScorerInputs

# Elements of one row's keys (Hkv x n x d) a CPU scoring tile may hold in all: scorers make a few
# intermediates of that size, and past the caches' size they run memory-bound (docs/results.md
# R-leverage-tiles-2026-11-22).
_CPU_TILE_ELEMENTS = 1 << 18
# On an accelerator: a tile's padded keys and values, and the scorers' float32 intermediates of
# that size, are transient memory on top of the cache; all rows at once made the flagship's peak at
# 32K tokens x 8 rows 2.3 GiB above uniform/keydiff's (docs/results.md R-gpu-prefill-2026-11-27).
# 2^25 elements (one row of 8 KV heads x 32K x 128) still keep every call large.
_ACCELERATOR_TILE_ELEMENTS = 1 << 25


def rows_per_tile(device: torch.device, row_elements: int) -> int:
    """How many batch rows one scoring call takes: as many as fit :data:`_CPU_TILE_ELEMENTS` on a
    CPU, :data:`_ACCELERATOR_TILE_ELEMENTS` elsewhere (at least one)."""
    budget = _CPU_TILE_ELEMENTS if torch.device(device).type == "cpu" else _ACCELERATOR_TILE_ELEMENTS
    return max(1, budget // max(row_elements, 1))


class HeadEvictor:
    """Evicts the heads of a :class:`~runtime.kv_store.cache.RaggedCache` under one :class:`ServingPlan`;
    ``prompt_stats`` are the prompt's own query statistics (scorers with ``statistics='prompt'``).
    It is also the decode-time eviction hook (:meth:`evict_decoded`, :meth:`layer_done`) that a
    compression leaves in each row's :class:`runtime.compression.driver.DecodePlan`."""

    def __init__(self, plan: ServingPlan, prompt_stats=None):
        if not isinstance(plan, ServingPlan):
            raise TypeError(
                f"HeadEvictor takes a ServingPlan (runtime.plan.serving_plan.bind(policy, calibration, model)), "
                f"got {type(plan).__name__}"
            )
        self.plan = plan
        self.policy = plan.policy
        self.scorer = plan.scorer
        self.geometry = geometry = plan.geometry
        self.num_layers = geometry.num_layers
        self.num_q_heads = geometry.num_q_heads
        self.num_kv_heads = geometry.num_kv_heads
        self.group = geometry.group_size
        self.scalings = geometry.scalings
        self.prompt_stats = prompt_stats
        self._deferred: list[tuple[int, torch.Tensor]] = []  # a decode round's NaN flags (layer_done)
        self._round_layer = -1  # the last layer of the current decode step that was done
        # what the scorer needs: the plan's loaded tensors, the prompt's statistics and the cache
        self.inputs = ScorerInputs(
            self.scorer,
            geometry,
            prompt_stats=prompt_stats,
            query_stats=plan.query_stats,
            query_centres=plan.query_centres,
            learned=plan.learned,
            rope_forms=plan.rope_forms,
        )

    def _refuse_nan(self, layer_idx: int, h: int, what: str = "scores") -> None:
        raise ValueError(
            f"{self.scorer!r} returned NaN {what} for layer {layer_idx}, KV head {h}: its inputs overflow "
            "(the calibration's statistics or the cached keys); refusing to evict on them"
        )

    def evict_row_in_rounds(
        self,
        layer,
        layer_idx: int,
        b: int,
        budgets,
        next_position: int,
        *,
        shrink: bool = True,
        stats_row: int | None = None,
    ) -> None:
        """Moment-informed eviction of every KV head of row ``b`` down to ``budgets`` int ``[Hkv]``
        tokens (see the module docstring): the scorer's attention estimates of the row's heads in
        one call, then the rounds head by head; ``shrink=False`` (decoding) keeps the capacity."""
        budgets = [int(budget) for budget in budgets]
        lengths = [int(length) for length in layer.length[b]]
        cut = [h for h in range(self.num_kv_heads) if budgets[h] < lengths[h]]
        if not cut:
            return
        if layer.moments[b] is None:
            raise ValueError(
                "moment-informed eviction needs a cache that tracks moments "
                "(call cache.track_moments() before compressing)"
            )
        inputs = self.layer_inputs(layer, layer_idx, [b], [next_position], [b if stats_row is None else stats_row])
        attention = self.scorer.attention(inputs)  # [1, Hkv, n]
        policy = self.policy
        for h in cut:
            length, budget = lengths[h], budgets[h]
            if bool(torch.isnan(attention[0, h, :length]).any()):
                self._refuse_nan(layer_idx, h, "attention estimates")
            every = torch.ones(length, dtype=torch.bool, device=inputs.keys.device)
            protected = protected_mask(every, budget, policy.n_sink, policy.window)  # [length]
            rows = evict_in_rounds(
                attention[0, h, :length],
                inputs.keys[0, h, :length],
                inputs.values[0, h, :length],
                layer.moments[b],
                h,
                inputs.scaling,
                budget,
                rounds=policy.moment_rounds,
                protected=protected,
                tau=policy.tau or 0.0,
            )
            layer.keep(b, h, rows, fold=False, shrink=shrink)

    # -- a whole layer at once ---------------------------------------------------------------

    def layer_inputs(
        self, layer, layer_idx: int, rows: list[int], next_positions: list[int], stats_rows: list[int] | None = None
    ) -> LayerInputs:
        """What the scorer sees of batch rows ``rows`` of layer ``layer_idx`` (every KV head, padded)."""
        keys, values, positions, valid = layer.padded_rows(rows)
        return self.inputs.layer(
            layer_idx,
            keys,
            values,
            positions,
            valid,
            layer.length[rows],
            next_positions,
            queries=[layer.rows[r].recent_queries for r in rows],  # [Hq, w, d] each, or None
            chunk_attention=[layer.rows[r].chunk_attention for r in rows],  # {ChunkSpec: ChunkAttention}, or None
            stats_rows=rows if stats_rows is None else stats_rows,
        )

    def layer_scores(
        self,
        layer,
        layer_idx: int,
        rows: list[int],
        next_positions: list[int],
        stats_rows: list[int] | None = None,
        parts: list | None = None,
        *,
        defer_check: bool = False,
    ) -> torch.Tensor:
        """The scorer's scores ``[R, Hkv, n]`` of rows ``rows`` of the layer (padding: ``-inf``).

        Rows are scored in tiles of :func:`rows_per_tile` rows (on a CPU a few, so the scorer's
        intermediates stay in cache; on a GPU as many as keep them to a few hundred MiB), every
        head of a tile in one call.
        ``parts``: :meth:`layer_score_parts` of these rows under a scorer with the same parts
        (shared with other policies); the scores are then only combined from them.
        ``defer_check``: the NaN check is kept on the device until the round ends (:meth:`layer_done`).
        """
        stats_rows = rows if stats_rows is None else stats_rows
        longest = int(host_array(layer.length)[rows].max()) if rows else 0
        tiles = self._tiles(layer, rows)
        if parts is not None and len(parts) != len(tiles):
            raise ValueError(f"shared score parts for {len(parts)} tiles of rows, these rows make {len(tiles)}")
        pieces = []
        for index, tile in enumerate(tiles):
            if parts is None:
                inputs = self.layer_inputs(layer, layer_idx, rows[tile], next_positions[tile], stats_rows[tile])
                valid, scores = inputs.valid, self.scorer.score(inputs)
            else:  # combined from the shared parts: the inputs are not gathered again, only their mask
                lengths = host_array(layer.length)[rows[tile]]  # [r, Hkv] host
                valid = np.arange(int(lengths.max()) if lengths.size else 0) < lengths[..., None]
                valid = to_device(valid, layer.key_buffer.device)  # as padded_rows masks the live tokens
                scores = self.scorer.combine(parts[index], valid)
            scores = self.checked_scores(scores, valid, layer_idx, defer=defer_check)
            pieces.append(torch.nn.functional.pad(scores, (0, longest - scores.shape[-1]), value=float("-inf")))
        return torch.cat(pieces) if pieces else torch.zeros(0, layer.num_heads, 0)

    def _tiles(self, layer, rows: list[int]) -> list[slice]:
        longest = int(host_array(layer.length)[rows].max()) if rows else 0
        step = rows_per_tile(layer.key_buffer.device, layer.num_heads * max(longest, 1) * layer.head_dim)
        return [slice(lo, lo + step) for lo in range(0, len(rows), step)]

    def layer_score_parts(
        self, layer, layer_idx: int, rows: list[int], next_positions: list[int], stats_rows: list[int] | None = None
    ) -> list:
        """The scorer's ``score_parts`` of rows ``rows`` of the layer, one per tile of rows (as
        :meth:`layer_scores` tiles them)."""
        stats_rows = rows if stats_rows is None else stats_rows
        return [
            self.scorer.score_parts(
                self.layer_inputs(layer, layer_idx, rows[tile], next_positions[tile], stats_rows[tile])
            )
            for tile in self._tiles(layer, rows)
        ]

    def checked_scores(
        self, scores: torch.Tensor, valid: torch.Tensor, layer_idx: int, *, defer: bool = False
    ) -> torch.Tensor:
        """The scorer's ``scores [R, Hkv, n]`` of a layer, refused when their shape is not ``valid``'s or
        any is NaN: ranking NaN keeps arbitrary tokens, silently (a calibration whose statistics
        overflow does that).  ``+inf`` is a score (never evict).  One check for the layer, naming the
        first head with a NaN score.  ``defer``: the NaN check stays on the device, read back by
        :meth:`layer_done` with the rest of the round's (one host synchronisation per round)."""
        if tuple(scores.shape) != tuple(valid.shape):
            raise ValueError(
                f"{self.scorer!r} returned layer scores of shape {tuple(scores.shape)} for {tuple(valid.shape)}"
            )
        bad = torch.isnan(scores) & valid
        if defer:
            self._deferred.append((layer_idx, bad.any(-1)))  # [R, Hkv] on the device
        elif bool(bad.any()):
            self._refuse_nan(layer_idx, int(bad.any(-1).nonzero()[0, 1]))
        return scores

    def layer_done(self, layer_idx: int) -> None:
        """The decode-eviction hook's end of a layer (:func:`runtime.compression.driver.after_attention`
        calls it after every layer of a step): after the plan's last layer, the round's deferred NaN
        checks read back at once, refused naming the first layer and head with a NaN score (the round
        has cut those heads already, on NaN scores; the error stops the generation before it serves
        another token).  A step that ended before its last layer attended cannot leave a round
        unfinished silently: the next step's first layer refuses."""
        if self._deferred and layer_idx <= self._round_layer:
            self._deferred = []
            raise RuntimeError(
                f"a decode step ended at layer {self._round_layer} before the plan's last layer "
                f"{self.num_layers - 1} attended: its eviction round was never finished (the cache belongs to "
                "another model?)"
            )
        self._round_layer = layer_idx
        if layer_idx < self.num_layers - 1:
            return
        self.check_deferred()

    def check_deferred(self) -> None:
        """The NaN checks deferred since the last call (``defer_check``) read back at once, one host
        synchronisation, refused naming the first layer and head with a NaN score: after a decode round
        (:meth:`layer_done`) and after a whole compression (:func:`runtime.compression.prefill.compress`
        and the eviction inside the prefill), whose cache the error then keeps from being served."""
        deferred, self._deferred, self._round_layer = self._deferred, [], -1
        if not deferred:
            return
        if not bool(torch.stack([flags.any() for _, flags in deferred]).any()):
            return
        for index, flags in deferred:  # the error's message: a few more reads, only on refusal
            if bool(flags.any()):
                self._refuse_nan(index, int(flags.any(0).nonzero()[0, 0]))

    def evict_decoded(
        self,
        layer,
        layer_idx: int,
        rows: list[int],
        budgets: torch.Tensor,
        next_positions: list[int],
        stats_rows: list[int],
    ) -> None:
        """The decode-time eviction hook (:class:`runtime.compression.driver.DecodeEvictionHook`): the heads of
        batch rows ``rows`` that decoding grew past their budgets cut back to ``budgets`` int64
        ``[R, Hkv]``, the capacity kept for the tokens that follow."""
        self.evict_layer(
            layer, layer_idx, rows, budgets, next_positions, shrink=False, stats_rows=stats_rows, defer_check=True
        )

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
        defer_check: bool = False,
    ) -> None:
        """Cut every KV head of batch rows ``rows`` down to ``budgets`` int ``[R, Hkv]`` tokens.

        ``scores``: the layer's ``[R, Hkv, n]`` scores when already computed (``global``
        allocation ranks every head's scores before any head is cut).  ``shrink=False``
        (decoding) keeps the capacity for the tokens that follow; ``defer_check`` (decoding) leaves
        the scores' NaN check to the round's end (:meth:`layer_done`).
        """
        budgets = host_array(budgets)  # [R, Hkv] host
        lengths = host_array(layer.length)[rows]  # [R, Hkv] host
        if not rows or not (lengths > budgets).any():
            return
        if self.policy.moment_eviction:  # rounds that re-score against updated sums: head by head
            stats_rows = rows if stats_rows is None else stats_rows
            for i, (r, position) in enumerate(zip(rows, next_positions, strict=True)):
                self.evict_row_in_rounds(
                    layer, layer_idx, r, budgets[i], int(position), shrink=shrink, stats_row=stats_rows[i]
                )
            return
        if scores is None:
            with label("kvcal.scoring"):
                scores = self.layer_scores(layer, layer_idx, rows, next_positions, stats_rows, defer_check=defer_check)
        device = scores.device
        valid = to_device(np.arange(scores.shape[-1]) < lengths[..., None], device)
        keep = keep_mask(scores, valid, to_device(budgets, device), self.policy.n_sink, self.policy.window)
        # the ranking keeps min(budget, length) rows of every head (runtime.compression.keep_rule._split): known here
        layer.keep_rows(rows, keep, shrink=shrink, kept=np.minimum(np.maximum(budgets, 0), lengths))
