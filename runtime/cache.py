"""A transformers 5.x cache whose KV heads each keep their own set of tokens.

Layout (per layer, per batch element ``b``, per KV head ``h``): one key buffer and one value
buffer of shape ``[capacity, d]`` of which the first ``length[b][h]`` rows are live, plus the
absolute RoPE position of every live row (``int32 [capacity]``).  Rows stay in arrival order,
so "the first tokens" (attention sinks) and "the last tokens" (the recent window) are the
first and last rows.  Left-padding tokens are never stored: a batch element only holds its
real tokens, so batching costs no memory either.

Right after :meth:`RaggedLayer.keep` (eviction) every buffer is exactly as long as its kept
tokens, so the bytes held for keys and values equal ``sum(per-head lengths) * 2 * d *
bytes_per_value``.  Appending beyond the capacity reallocates with a small slack (1/32 of
the length, at least 16 rows) so decoding does not copy the cache at every step.

Sizes seen by transformers:

* ``get_seq_length()`` is the **logical** length: the number of token columns fed so far
  (padding included), so that generate() slices its inputs and numbers positions correctly
  after eviction.
* the attention mask describes only the chunk being fed: ``get_mask_sizes(q)`` returns
  ``(q, tokens_seen)`` and ``get_query_offset()`` is ``tokens_seen``, so the 4D mask is the
  causal + padding mask of the new chunk against itself.  Every retained past token is
  visible to every new query (evicted tokens are gone, padding was never stored); the
  attention function (``runtime.attention``) adds the chunk itself causally.

The layer's ``update()`` only parks the new chunk; the registered attention function calls
:meth:`RaggedLayer.attend`, which stores the chunk's real (non-padding) tokens and computes
attention head by head.  A chunk left parked means the model did not run the ragged
attention function, which is reported as an error at the next update.

MomentKV state, per batch element (so that caches compressed under different policies can be
stacked into one batch):

* ``moments[b]``: :class:`runtime.moments.MomentSums` of every token evicted from each KV
  head of this layer (None when not tracked; :meth:`RaggedCache.track_moments` switches it
  on before anything is evicted); :meth:`RaggedLayer.keep` folds the evicted rows in;
* ``corrections[b]``: per-head correction orders and ``tau`` (None: plain attention); with
  something evicted, :meth:`RaggedLayer.attend` merges the retained attention with the moment
  estimate of the evicted set (docs/design.md section 4);
* ``decode_plans[b]``: a :class:`DecodePlan` when heads are also evicted while decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from .geometry import ModelGeometry
from .moments import MomentSums, PreparedMoments, attention_with_lse

# Tensor attribute through which the attention function finds the layer that parked a chunk.
LAYER_TAG = "_kvcal_ragged_layer"
ATTENTION_NAME = "kvcal_ragged"
_MIN_SLACK = 16
_ROW_STATE = (
    "key_store",
    "value_store",
    "position_store",
    "lengths",
    "real_seen",
    "recent_queries",
    "moments",
    "corrections",
    "decode_plans",
    "_prepared",
)


@dataclass
class DecodePlan:
    """Decode-time eviction of one batch element: ``evictor`` (a :class:`runtime.eviction.HeadEvictor`)
    cuts a head back to ``budgets[layer, head]`` once it holds ``every`` tokens more;
    ``stats_row`` is the element's row in the evictor's prompt statistics."""

    evictor: object
    budgets: np.ndarray  # int64 [L, Hkv]
    every: int
    stats_row: int


class RaggedLayer(DynamicLayer):
    """One decoder layer's per-KV-head token stores (see the module docstring)."""

    is_croppable = False

    def __init__(self, layer_idx: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.layer_idx = int(layer_idx)
        self.key_store: list[list[torch.Tensor]] = []  # [B][Hkv] -> [capacity, d]
        self.value_store: list[list[torch.Tensor]] = []  # [B][Hkv] -> [capacity, d]
        self.position_store: list[list[torch.Tensor]] = []  # [B][Hkv] -> int32 [capacity]
        self.lengths: list[list[int]] = []  # [B][Hkv] live rows
        self.tokens_seen = 0  # logical columns fed (padding included)
        self.real_seen: list[int] = []  # [B] real tokens fed: the next token's RoPE position
        self.observe_queries = 0  # keep the last N post-RoPE queries (SnapKV's observation window)
        self.recent_queries: list[torch.Tensor | None] = []  # [B] -> [Hq, <=N, d]
        self.moments: list[MomentSums | None] = []  # [B] sums of the evicted tokens, None: not tracked
        self.corrections: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # [B] orders int [Hkv], tau [Hkv]
        self.decode_plans: list[DecodePlan | None] = []  # [B]
        self._prepared: list[PreparedMoments | None] = []  # [B] derived from moments[b] (by version)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- transformers API ------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads, _, dim = key_states.shape
        self.batch_size, self.num_heads, self.head_dim = batch, heads, dim
        empty = lambda dtype: torch.empty(0, dim, dtype=dtype, device=self.device)  # noqa: E731
        self.key_store = [[empty(self.dtype) for _ in range(heads)] for _ in range(batch)]
        self.value_store = [[empty(self.dtype) for _ in range(heads)] for _ in range(batch)]
        self.position_store = [
            [torch.empty(0, dtype=torch.int32, device=self.device) for _ in range(heads)] for _ in range(batch)
        ]
        self.lengths = [[0] * heads for _ in range(batch)]
        self.real_seen = [0] * batch
        self.recent_queries = [None] * batch
        self.moments = [None] * batch
        self.corrections = [None] * batch
        self.decode_plans = [None] * batch
        self._prepared = [None] * batch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Park the new chunk ``[B, Hkv, q, d]`` for :meth:`attend`; returns it tagged."""
        if self._pending is not None:
            self._pending = None
            raise RuntimeError(
                "RaggedCache: the previous chunk was never attended. The model must run with "
                f"attn_implementation={ATTENTION_NAME!r}: call runtime.enable(model) first."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_size or key_states.shape[1] != self.num_heads:
            raise ValueError(
                f"RaggedCache holds batch {self.batch_size} x {self.num_heads} KV heads, "
                f"got keys of shape {tuple(key_states.shape)}"
            )
        self._pending = (key_states, value_states)
        setattr(key_states, LAYER_TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask covers only the chunk being fed: kv columns [tokens_seen, tokens_seen + q).
        return query_length, self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.layer_idx)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "RaggedCache cannot be cropped: evicted tokens cannot be restored "
            "(assisted / speculative decoding is not supported with eviction)"
        )

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex_batch([b for b in range(self.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex_batch([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex_batch([int(i) for i in beam_idx.reshape(-1).tolist()])

    def offload(self):
        raise ValueError("RaggedCache does not support offloading")

    def prefetch(self):
        raise ValueError("RaggedCache does not support offloading")

    # -- storage ---------------------------------------------------------------------------

    def _reindex_batch(self, order: list[int]) -> None:
        if not self.is_initialized:
            return
        # Buffers are appended in place, so rows shared by two batch entries must be copied.
        self.key_store = [[t.clone() for t in self.key_store[b]] for b in order]
        self.value_store = [[t.clone() for t in self.value_store[b]] for b in order]
        self.position_store = [[t.clone() for t in self.position_store[b]] for b in order]
        self.lengths = [list(self.lengths[b]) for b in order]
        self.real_seen = [self.real_seen[b] for b in order]
        self.recent_queries = [self.recent_queries[b] for b in order]
        self.moments = [None if self.moments[b] is None else self.moments[b].copy() for b in order]
        self.corrections = [self.corrections[b] for b in order]
        self.decode_plans = [self.decode_plans[b] for b in order]
        self._prepared = [None] * len(order)
        self.batch_size = len(order)

    def _append(self, b: int, h: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> int:
        """Append ``[m, d]`` rows to head (b, h); returns the new live length."""
        length, count = self.lengths[b][h], keys.shape[0]
        new_length = length + count
        buffer = self.key_store[b][h]
        if new_length > buffer.shape[0]:
            slack = 0 if length == 0 else max(_MIN_SLACK, new_length // 32)
            capacity = new_length + slack
            grown_k = buffer.new_empty(capacity, self.head_dim)
            grown_v = buffer.new_empty(capacity, self.head_dim)
            grown_p = torch.empty(capacity, dtype=torch.int32, device=buffer.device)
            grown_k[:length] = buffer[:length]
            grown_v[:length] = self.value_store[b][h][:length]
            grown_p[:length] = self.position_store[b][h][:length]
            self.key_store[b][h], self.value_store[b][h], self.position_store[b][h] = grown_k, grown_v, grown_p
        self.key_store[b][h][length:new_length] = keys
        self.value_store[b][h][length:new_length] = values
        self.position_store[b][h][length:new_length] = positions
        self.lengths[b][h] = new_length
        return new_length

    def head(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live ``keys [n, d]``, ``values [n, d]`` and ``positions int32 [n]`` of head (b, h)."""
        n = self.lengths[b][h]
        return self.key_store[b][h][:n], self.value_store[b][h][:n], self.position_store[b][h][:n]

    def keep(self, b: int, h: int, rows: torch.Tensor, *, fold: bool = True, shrink: bool = True) -> None:
        """Evict all rows of head (b, h) but ``rows`` (sorted, unique).

        ``fold``: add the evicted rows to ``moments[b]`` when tracked (False when the caller
        already did, as moment-informed eviction does between its rounds).  ``shrink``: the
        buffers become exactly as long as the kept rows; otherwise the rows are compacted in
        place and the capacity stays (decode-time eviction: no reallocation per step).
        """
        keys, values, positions = self.head(b, h)
        rows = rows.to(keys.device)
        if fold and self.moments and self.moments[b] is not None and rows.numel() < keys.shape[0]:
            evicted = torch.ones(keys.shape[0], dtype=torch.bool, device=keys.device)
            evicted[rows] = False
            self.moments[b].add(h, keys[evicted], values[evicted])
        kept = [store.index_select(0, rows) for store in (keys, values, positions)]
        if shrink:
            self.key_store[b][h], self.value_store[b][h], self.position_store[b][h] = kept
        else:
            count = kept[0].shape[0]
            for buffer, rows_kept in zip((self.key_store, self.value_store, self.position_store), kept, strict=True):
                buffer[b][h][:count] = rows_kept
        self.lengths[b][h] = int(rows.numel())

    def track_moments(self) -> None:
        """Start moment sums for every batch element (refused once something was evicted)."""
        if not self.is_initialized:
            raise ValueError("the cache is empty: prefill it before tracking moments")
        for b in range(self.batch_size):
            if self.moments[b] is not None:
                continue
            if any(length != self.real_seen[b] for length in self.lengths[b]):
                raise ValueError(
                    f"batch element {b} already evicted tokens without tracking their moments; "
                    "track moments before the first eviction"
                )
            self.moments[b] = MomentSums(self.num_heads, self.head_dim, device=self.device)

    def _prepared_moments(self, b: int) -> PreparedMoments | None:
        """The correction's per-head quantities for element ``b`` (None when nothing to correct)."""
        correction, sums = self.corrections[b], self.moments[b]
        if correction is None or sums is None:
            return None
        prepared = self._prepared[b]
        if prepared is None or prepared.version != sums.version:
            prepared = self._prepared[b] = PreparedMoments(sums, *correction)
        return prepared if prepared.any_active else None

    # -- attention ---------------------------------------------------------------------------

    def attend(
        self, query: torch.Tensor, real: torch.Tensor | None, positions: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Store the parked chunk's real tokens and attend each query head over its KV head.

        ``query [B, Hq, q, d]`` post-RoPE; ``real`` bool ``[B, q]`` (None: all real);
        ``positions`` int ``[B, q]`` RoPE positions of the chunk.  Returns ``[B, q, Hq, d]``;
        rows of padding queries are zero.
        """
        if self._pending is None:
            raise RuntimeError("RaggedLayer.attend called without a parked chunk (update() first)")
        new_keys, new_values = self._pending
        self._pending = None
        batch, num_q_heads, q_len, dim = query.shape
        group = num_q_heads // self.num_heads
        output = query.new_zeros(batch, q_len, num_q_heads, dim)
        for b in range(batch):
            rows = None if real is None or bool(real[b].all()) else real[b].nonzero().squeeze(1)
            count = q_len if rows is None else int(rows.numel())
            if count == 0:
                continue

            def pick(t: torch.Tensor, rows: torch.Tensor | None = rows) -> torch.Tensor:
                return t if rows is None else t.index_select(-2, rows)

            chunk_q = pick(query[b])  # [Hq, count, d]
            chunk_k, chunk_v = pick(new_keys[b]), pick(new_values[b])  # [Hkv, count, d]
            chunk_pos = (positions[b] if rows is None else positions[b, rows]).to(torch.int32)
            if self.observe_queries:
                self._observe(b, chunk_q)
            prepared = self._prepared_moments(b)
            retained = []  # corrected path: per KV head (out [G, count, d], lse [G, count])
            for h in range(self.num_heads):
                old = self.lengths[b][h]
                total = self._append(b, h, chunk_k[h], chunk_v[h], chunk_pos)
                q = chunk_q[h * group : (h + 1) * group]  # [G, count, d]
                if prepared is not None:
                    mask = None if count == 1 else _chunk_mask(old, count, total, q.device)
                    retained.append(
                        attention_with_lse(
                            q, self.key_store[b][h][:total], self.value_store[b][h][:total], scaling, mask
                        )
                    )
                    continue
                keys = self.key_store[b][h][:total].unsqueeze(0).unsqueeze(0)  # [1, 1, n, d]
                values = self.value_store[b][h][:total].unsqueeze(0).unsqueeze(0)
                if count == 1:
                    # One query per head sees every retained token: the G heads become G rows.
                    out = torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(0, 1).unsqueeze(0), keys, values, scale=scaling
                    )  # [1, 1, G, d]
                    output[b, (rows if rows is not None else slice(None)), h * group : (h + 1) * group] = out[0]
                    continue
                if old == 0:
                    mask, causal = None, True
                else:  # retained past fully visible, the chunk itself causal
                    mask, causal = _chunk_mask(old, count, total, q.device), False
                out = torch.nn.functional.scaled_dot_product_attention(
                    q.unsqueeze(0), keys, values, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=True
                )  # [1, G, count, d]
                target = out[0].transpose(0, 1)  # [count, G, d]
                if rows is None:
                    output[b, :, h * group : (h + 1) * group] = target
                else:
                    output[b, rows, h * group : (h + 1) * group] = target
            if prepared is not None:
                out_R = torch.stack([out for out, _ in retained])  # [Hkv, G, count, d]
                lse_R = torch.stack([lse for _, lse in retained])  # [Hkv, G, count]
                merged = prepared.corrected(
                    chunk_q.reshape(self.num_heads, group, count, dim), out_R, lse_R, scaling
                )  # [Hkv, G, count, d]
                target = merged.permute(2, 0, 1, 3).reshape(count, num_q_heads, dim).to(output.dtype)
                output[b, (rows if rows is not None else slice(None))] = target
            self.real_seen[b] += count
            plan = self.decode_plans[b]
            if plan is not None:
                self._evict_over_budget(b, plan)
        self.tokens_seen += q_len
        return output

    def _evict_over_budget(self, b: int, plan: DecodePlan) -> None:
        budgets = plan.budgets[self.layer_idx]
        for h in range(self.num_heads):
            budget = int(budgets[h])
            if self.lengths[b][h] - budget >= plan.every:
                plan.evictor.evict(
                    self, self.layer_idx, b, h, budget, self.real_seen[b], shrink=False, stats_row=plan.stats_row
                )

    def _observe(self, b: int, chunk_q: torch.Tensor) -> None:
        previous = self.recent_queries[b]
        joined = chunk_q if previous is None else torch.cat([previous, chunk_q], dim=1)
        self.recent_queries[b] = joined[:, -self.observe_queries :].clone()

    # -- accounting ----------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (capacity, i.e. padding included)."""
        return sum(
            t.numel() * t.element_size() for store in (self.key_store, self.value_store) for row in store for t in row
        )

    def index_bytes(self) -> int:
        """Bytes allocated for the per-token RoPE positions."""
        return sum(t.numel() * t.element_size() for row in self.position_store for t in row)

    def moment_bytes(self) -> int:
        """Bytes of the moment sums (``O(Hkv d^2)`` per element, whatever the context length)."""
        return sum(sums.nbytes() for sums in self.moments if sums is not None)


def _chunk_mask(old: int, count: int, total: int, device) -> torch.Tensor:
    """bool ``[count, total]``: the ``old`` retained tokens fully visible, the chunk itself causal."""
    mask = torch.ones(count, total, dtype=torch.bool, device=device)
    mask[:, old:] = torch.ones(count, count, dtype=torch.bool, device=device).tril()
    return mask


class RaggedCache(Cache):
    """``Cache(layers=[RaggedLayer, ...])``; pass it as ``past_key_values`` (see module docstring)."""

    def __init__(self, num_layers: int):
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        super().__init__(layers=[RaggedLayer(index) for index in range(num_layers)])

    @classmethod
    def for_model(cls, model) -> RaggedCache:
        return cls(ModelGeometry.of(model).num_layers)

    def head_lengths(self) -> torch.Tensor:
        """Live tokens per head, int64 ``[L, B, Hkv]``."""
        return torch.tensor([layer.lengths for layer in self.layers], dtype=torch.int64)

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values over all layers (padding included)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def index_bytes(self) -> int:
        return sum(layer.index_bytes() for layer in self.layers)

    def moment_bytes(self) -> int:
        return sum(layer.moment_bytes() for layer in self.layers)

    def track_moments(self) -> None:
        """Keep moment sums of every token evicted from now on (call before the first eviction)."""
        for layer in self.layers:
            layer.track_moments()

    def set_correction(self, orders, tau, rows: list[int] | None = None) -> None:
        """Correct attention with the moments: ``orders`` int ``[L, Hkv]`` in {-1, 0, 1}, ``tau [L, Hkv]``
        (None: switch correction off) for batch elements ``rows`` (default all)."""
        for index, layer in enumerate(self.layers):
            for b in range(layer.batch_size) if rows is None else rows:
                if orders is None:
                    layer.corrections[b] = None
                    continue
                if layer.moments[b] is None:
                    raise ValueError("correction needs moment sums: call track_moments() before evicting")
                layer.corrections[b] = (
                    torch.as_tensor(np.asarray(orders[index]), dtype=torch.int64),
                    torch.as_tensor(np.asarray(tau[index]), dtype=torch.float32),
                )
                layer._prepared[b] = None

    def set_decode_plan(self, plan: DecodePlan | None, row: int) -> None:
        """Evict batch element ``row`` while decoding under ``plan`` (None: stop)."""
        for layer in self.layers:
            layer.decode_plans[row] = plan

    def bytes_per_token(self) -> int:
        """Key + value bytes of one token in one KV head."""
        layer = self.layers[0]
        if not layer.is_initialized:
            raise ValueError("the cache is empty")
        return 2 * layer.head_dim * torch.empty(0, dtype=layer.dtype).element_size()

    def copy(self) -> RaggedCache:
        """An independent copy (e.g. one prefill, several policies): buffers are cloned."""
        if any(layer._pending is not None for layer in self.layers):
            raise RuntimeError("cannot copy a cache in the middle of a forward pass")
        clone = RaggedCache(len(self.layers))
        for source, target in zip(self.layers, clone.layers, strict=True):
            target.__dict__.update({key: value for key, value in source.__dict__.items() if key not in _ROW_STATE})
            if source.is_initialized:
                target.key_store = [[t.clone() for t in row] for row in source.key_store]
                target.value_store = [[t.clone() for t in row] for row in source.value_store]
                target.position_store = [[t.clone() for t in row] for row in source.position_store]
                target.lengths = [list(row) for row in source.lengths]
                target.real_seen = list(source.real_seen)
                target.recent_queries = list(source.recent_queries)
                target.moments = [None if sums is None else sums.copy() for sums in source.moments]
                target.corrections = list(source.corrections)
                target.decode_plans = list(source.decode_plans)
                target._prepared = [None] * len(source.moments)
        return clone

    @classmethod
    def stack(cls, caches: list[RaggedCache]) -> RaggedCache:
        """One batched cache from caches that saw the same columns (e.g. copies of one prefill
        compressed under different policies), batch elements in order; buffers are shared."""
        if not caches:
            raise ValueError("need at least one cache to stack")
        first = caches[0]
        if any(len(c.layers) != len(first.layers) for c in caches):
            raise ValueError("caches to stack must have the same number of layers")
        if any(c.get_seq_length() != first.get_seq_length() for c in caches):
            raise ValueError("caches to stack must have seen the same number of columns")
        stacked = cls(len(first.layers))
        for index, target in enumerate(stacked.layers):
            sources = [c.layers[index] for c in caches]
            if not all(source.is_initialized for source in sources):
                raise ValueError("caches to stack must all be prefilled")
            if any(source._pending is not None for source in sources):
                raise RuntimeError("cannot stack caches in the middle of a forward pass")
            base = sources[0]
            target.__dict__.update(
                {key: value for key, value in base.__dict__.items() if key not in _ROW_STATE + ("batch_size",)}
            )
            target.key_store = [row for source in sources for row in source.key_store]
            target.value_store = [row for source in sources for row in source.value_store]
            target.position_store = [row for source in sources for row in source.position_store]
            target.lengths = [list(row) for source in sources for row in source.lengths]
            target.real_seen = [n for source in sources for n in source.real_seen]
            target.recent_queries = [q for source in sources for q in source.recent_queries]
            target.moments = [sums for source in sources for sums in source.moments]
            target.corrections = [c for source in sources for c in source.corrections]
            target.decode_plans = [p for source in sources for p in source.decode_plans]
            target._prepared = [None] * len(target.moments)
            target.batch_size = len(target.lengths)
        return stacked

    def stop_observing(self) -> None:
        """Drop the recorded prompt queries and record no more (what decoding needs no longer)."""
        for layer in self.layers:
            layer.recent_queries = [None] * layer.batch_size
            layer.observe_queries = 0

    def observe_queries(self, count: int) -> None:
        """Keep the last ``count`` post-RoPE queries of each layer (SnapKV's observation window)."""
        for layer in self.layers:
            layer.observe_queries = int(count)
