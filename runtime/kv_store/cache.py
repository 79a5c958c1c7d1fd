"""A transformers 5.x cache whose KV heads each keep their own set of tokens, packed per layer.

One :class:`RaggedLayer` per decoder layer: the thin adapter transformers sees.  It delegates,
along vLLM v1's lines, to

* :class:`runtime.kv_store.segments.SegmentStore`: the packed per-layer buffers ``key_buffer /
  value_buffer [C, d]``, ``position_buffer int32 [C]`` and the host tables ``offset / capacity /
  length`` int64 ``[B, Hkv]`` of every (batch row, KV head) segment; append, evict in place,
  compact, repack, batch selection and stacking;
* :class:`runtime.kv_store.layout.PageLayout`: the page tables derived from the storage at every repack
  (page size, the gather path for small layers, the one-page-per-head view of equal capacities);
* :mod:`runtime.kv_store.layer_attention`: the attention of a chunk or a decode step over the layout, and
  the MomentKV-corrected merge (kernels in :mod:`runtime.kv_store.paged_attention`);
* :mod:`runtime.kv_store.row_state`: per batch row a :class:`~runtime.kv_store.row_state.RowState` (real tokens
  seen, recorded prompt queries, MomentKV sums and correction, and the row's decode plan: data
  that :mod:`runtime.compression.driver` reads; the storage never evicts and never calls up).

Left-padding tokens are never stored: a batch row only holds its real tokens, so batching costs
no memory either.

Sizes seen by transformers:

* ``get_seq_length()`` is the **logical** length: the number of token columns fed so far
  (padding included), so that generate() slices its inputs and numbers positions correctly
  after eviction.
* the attention mask describes only the chunk being fed: ``get_mask_sizes(q)`` returns
  ``(q, tokens_seen)`` and ``get_query_offset()`` is ``tokens_seen``, so the 4D mask is the
  causal + padding mask of the new chunk against itself.  Every retained past token is
  visible to every new query (evicted tokens are gone, padding was never stored); the
  attention function (``runtime.compression.ragged_attention``) adds the chunk itself causally.

The layer's ``update()`` only parks the new chunk ``[B, Hkv, q, d]``; the registered attention
function calls :meth:`RaggedLayer.attend`, which stores the chunk's real (non-padding) tokens,
and computes attention for the whole layer; the attention function then hands the layer to
:func:`runtime.compression.driver.after_attention` (the decode-time evictions due, then a sliding-window
layer's :meth:`RaggedLayer.drop_outside_window`, or under the page kernel its hiding of those rows).
A chunk left parked means the model did not
run the ragged attention function, which is reported as an error at the next update.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from artifacts.fingerprint import (
    STATEFUL_ATTENTION_LAYER_TYPES,
    attention_chunks,
    kv_shared_layers,
    sliding_layers_apart,
)
from runtime.kv_store.layer_attention import (
    at_the_chunks_columns,
    chunk_only_attention,
    decode_kernel,
    lse_kernel_serves,
    segment_layer_attention,
)
from runtime.kv_store.layout import PageLayout
from runtime.kv_store.profiling import label
from runtime.kv_store.row_state import Correction, PreparedCorrection, RowState, fold_evicted
from runtime.kv_store.segments import SegmentStore, StepPositions
from runtime.kv_store.transformers_compat import LinearAttentionLayer, query_length
from runtime.math.chunk_attention import ChunkSpec
from runtime.math.geometry import ModelGeometry, mask_windows
from runtime.math.momentkv import MomentSums

__all__ = [
    "ATTENTION_NAME",
    "CacheConsumedError",
    "LAYER_TAG",
    "RaggedCache",
    "RaggedLayer",
    "RowState",
]

# Tensor attribute through which the attention function finds the layer that parked a chunk.
LAYER_TAG = "_kvcal_ragged_layer"
ATTENTION_NAME = "kvcal_ragged"
# the least room a sliding-window layer makes for rows its decode steps hide (RaggedLayer._hides_window)
_HIDING_ROOM = 16


class CacheConsumedError(ValueError):
    """A compressed cache given to a generation it cannot serve: it already holds as many columns as
    the prompt, or more (an earlier generation consumed it), so generate() would feed the prompt a
    second time behind it and answer from a doubled context."""


def _no_segments() -> torch.Tensor:
    """The tables of a layer that has seen nothing yet: int64 ``[0, 0]`` (a new tensor each time)."""
    return torch.zeros(0, 0, dtype=torch.int64)


@dataclass
class SharedChunk:
    """What the layers reading a layer's cache attend (:meth:`RaggedLayer.attend_shared`): the layer's attention of
    its last chunk for any query at the chunk's ``q_len`` columns, under its ``window`` and ``softcap``; the storage
    ``generation`` it read (None: the chunk alone), and how many readers are ``left``."""

    attention: Callable[[torch.Tensor], torch.Tensor]
    q_len: int
    window: int | None
    softcap: float | None
    generation: int | None
    left: int

    def read(self, query: torch.Tensor, window: int | None, softcap: float | None, generation: int | None):
        """One reader's attention of ``query [B, Hq, t, d]`` (``t``: the chunk's columns or its last ones) under its
        ``window`` and ``softcap``, the storage being at ``generation``; counts the reader."""
        if (window, softcap) != (self.window, self.softcap):
            raise ValueError(
                f"a layer attended with window {self.window} and soft-cap {self.softcap}, a layer reading its cache "
                f"with window {window} and soft-cap {softcap}: not the same attention"
            )
        if self.generation is not None and generation != self.generation:
            raise RuntimeError("a layer's storage changed before the layers reading it attended")
        if query.shape[2] > self.q_len:
            raise ValueError(f"{query.shape[2]} queries read a chunk of {self.q_len} columns")
        self.left -= 1
        return self.attention(query)


class RaggedLayer(DynamicLayer):
    """One decoder layer's packed per-KV-head token stores (see the module docstring)."""

    is_croppable = False

    def __init__(self, layer_idx: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.layer_idx = int(layer_idx)
        self.store: SegmentStore | None = None  # None until the first chunk (lazy initialization)
        self.rows: list[RowState] = []  # [B]
        self.tokens_seen = 0  # logical columns fed (padding included)
        self.observe_queries = 0  # keep the last N post-RoPE queries (SnapKV's observation window)
        self.chunk_specs: tuple[ChunkSpec, ...] = ()  # chunked attentions to accumulate (Compactor's)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the parked chunk [B, Hkv, q, d] x 2
        self._undropped = False  # a sliding-window layer attended a chunk: drop_outside_window() owed
        # a sliding-window layer's one-token decode step hides what leaves its window instead of dropping it
        # (decided in attend: _hides_window), and rows so hidden are still stored (dropped by _settle)
        self._hiding, self._hidden, self._step_positions = False, False, None
        self._layout: PageLayout | None = None  # built for the store generation self._layout_generation
        self._layout_generation = 0
        self._correction = PreparedCorrection()
        # how many layers read this layer's cache instead of their own (RaggedCache.for_model:
        # artifacts.fingerprint.kv_shared_layers), and what they attend next (attend_shared)
        self.shared_by = 0
        self._shared: SharedChunk | None = None
        self.model_config = None  # the model's config (RaggedCache.for_model): its attention is checked
        self.window: int | None = None  # a sliding-window layer's W (from the attention call), else None
        # the window the model's mask slides by where its attention passes none (PhiMoE), else None
        # (RaggedCache.for_model: geometry.mask_windows)
        self.mask_window: int | None = None
        # a chunked layer's attention chunk (Llama 4's attention_chunk_size: its queries see the keys of their own
        # chunk of C positions), else None (RaggedCache.for_model: artifacts.fingerprint.attention_chunks)
        self.attention_chunk: int | None = None
        self.softcap: float | None = None  # the layer's attention logit soft-capping, else None
        # a decode step's positions converted once for every layer (RaggedCache shares one)
        self.step_positions = StepPositions()

    # -- the storage's tables and buffers (read-only views for callers) ---------------------

    @property
    def batch_size(self) -> int:
        return 0 if self.store is None else self.store.batch_size

    @property
    def num_heads(self) -> int:
        return 0 if self.store is None else self.store.num_heads

    @property
    def head_dim(self) -> int:
        return 0 if self.store is None else self.store.head_dim

    @property
    def value_dim(self) -> int:  # head_dim but where the values are narrower (MiMo-V2-Flash)
        return 0 if self.store is None else self.store.value_dim

    @property
    def key_buffer(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.key_buffer  # [C, d]

    @property
    def value_buffer(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.value_buffer  # [C, value_dim]

    @property
    def position_buffer(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.position_buffer  # int32 [C]

    @property
    def row_bias(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.row_bias  # [C + 1]

    @property
    def offset(self) -> torch.Tensor:
        return _no_segments() if self.store is None else self.store.offset  # int64 [B, Hkv] host

    @property
    def capacity(self) -> torch.Tensor:
        return _no_segments() if self.store is None else self.store.capacity  # int64 [B, Hkv] host

    @property
    def length(self) -> torch.Tensor:
        self._settle()
        return _no_segments() if self.store is None else self.store.length  # int64 [B, Hkv] host, live rows

    @property
    def page_size(self) -> int:
        return 1 if self.store is None else self.store.page_size

    @property
    def layout(self) -> PageLayout:
        """The page tables of the storage as it is now (rebuilt after a repack)."""
        store = self.store
        if self._layout is None or self._layout_generation != store.generation:
            self._layout = PageLayout.build(
                store.offset, store.capacity, store.page_size, store.key_buffer.shape[0], store.device
            )
            self._layout_generation = store.generation
        return self._layout

    # -- per-row views (read-only lists, for callers that index [b] or [b][h]) ----------------

    @property
    def lengths(self) -> list[list[int]]:
        """Live tokens per head, ``[B][Hkv]``."""
        return self.length.tolist()

    @property
    def real_seen(self) -> list[int]:
        return [row.real_seen for row in self.rows]

    @property
    def recent_queries(self) -> list[torch.Tensor | None]:
        return [row.recent_queries for row in self.rows]

    @property
    def moments(self) -> list[MomentSums | None]:
        return [row.moments for row in self.rows]

    @property
    def decode_plans(self) -> list:  # runtime.compression.driver.DecodePlan | None per row
        return [row.decode_plan for row in self.rows]

    # -- transformers API ------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # Our own record of the KV dtype and device: DynamicLayer stopped setting ``dtype`` in 5.24.
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self.store = SegmentStore(batch, heads, dim, self.dtype, self.device, value_states.shape[-1])
        self.rows = [RowState() for _ in range(batch)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Park the new chunk ``[B, Hkv, q, d]`` for :meth:`attend`; returns it tagged."""
        implementation = getattr(self.model_config, "_attn_implementation", ATTENTION_NAME)
        if implementation != ATTENTION_NAME:  # the chunk would be attended without the cache: refuse now
            raise RuntimeError(
                f"RaggedCache needs the model to run attn_implementation={ATTENTION_NAME!r}, it runs "
                f"{implementation!r}: wrap the call in `with runtime.ragged_attention(model):` "
                "(or call runtime.compression.ragged_attention.enable(model) first)."
            )
        if self._pending is not None:
            self._pending = None
            raise RuntimeError(
                "RaggedCache: the previous chunk was never attended. The model must run with "
                f"attn_implementation={ATTENTION_NAME!r}: wrap the call in `with runtime.ragged_attention(model):` "
                "(or call runtime.compression.ragged_attention.enable(model) first)."
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        store = self.store
        if key_states.shape[0] != store.batch_size and key_states.shape[1] == store.num_heads:
            rows, held = key_states.shape[0], store.batch_size
            repeats = rows // held if held and rows % held == 0 else "n"
            raise ValueError(
                f"RaggedCache holds {held} batch row{'s' if held != 1 else ''}, the model fed {rows} rows: "
                "model.generate() with num_beams or num_return_sequences > 1 expands each prompt row but not a "
                "cache it is given, which a compressed cache does not support by itself; call runtime.generate "
                f"(it expands the cache), or cache.batch_repeat_interleave({repeats}) "
                "before model.generate"
            )
        if key_states.shape[0] != store.batch_size or key_states.shape[1] != store.num_heads:
            raise ValueError(
                f"RaggedCache holds batch {store.batch_size} x {store.num_heads} KV heads, "
                f"got keys of shape {tuple(key_states.shape)}"
            )
        self._pending = (key_states, value_states)
        setattr(key_states, LAYER_TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_mask_sizes(self, query: int | torch.Tensor) -> tuple[int, int]:
        # The mask covers only the chunk being fed: kv columns [tokens_seen, tokens_seen + q).
        return query_length(query), self.tokens_seen

    def reset(self) -> None:
        config, mask_window, attention_chunk = self.model_config, self.mask_window, self.attention_chunk
        shared_by = self.shared_by
        self.__init__(self.layer_idx)
        self.model_config, self.mask_window, self.attention_chunk = config, mask_window, attention_chunk
        self.shared_by = shared_by

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

    def _reindex_batch(self, order: list[int]) -> None:
        if not self.is_initialized:
            return
        self._settle()
        self.store.select_batch(order)
        self.rows = [self.rows[b].copy() for b in order]
        self._correction.clear()

    # -- storage -----------------------------------------------------------------------------

    def compact(self) -> None:
        """Release what eviction freed: every capacity becomes its length rounded up to a page."""
        if self.is_initialized:
            self._settle()
            self.store.compact()

    def head(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live ``keys [n, d]``, ``values [n, d]`` and ``positions int32 [n]`` of head (b, h) (views)."""
        self._settle()
        return self.store.head(b, h)

    def padded_rows(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch rows ``rows``' live tokens, every head padded to the longest (one gather):
        ``keys, values [R, Hkv, n, d]`` (padding zero), ``positions`` int64 ``[R, Hkv, n]`` and
        ``valid`` bool ``[R, Hkv, n]``."""
        self._settle()
        return self.store.padded_rows(rows)

    def keep(self, b: int, h: int, rows: torch.Tensor, *, fold: bool = True, shrink: bool = True) -> None:
        """Evict all rows of head (b, h) but ``rows`` (sorted, unique).

        ``fold``: add the evicted rows to the row's moment sums when tracked (False when the caller
        already did, as moment-informed eviction does between its rounds).  The kept rows move to
        the front of the head's segment in place; ``shrink`` marks the memory for release by the
        next :meth:`compact` (``compress`` compacts once after evicting every head; ``attend``
        compacts before the next step at the latest); decode-time eviction keeps the capacity.
        """
        self._settle()
        sums = self.rows[b].moments
        if fold and sums is not None:
            keys, values, _ = self.store.head(b, h)
            if rows.numel() < keys.shape[0]:
                evicted = torch.ones(keys.shape[0], dtype=torch.bool, device=keys.device)
                evicted[rows.to(keys.device)] = False
                sums.add(h, keys[evicted], values[evicted])
        self.store.keep(b, h, rows, shrink=shrink)

    def keep_rows(
        self, rows: list[int], keep: torch.Tensor, *, fold: bool = True, shrink: bool = True, kept=None
    ) -> None:
        """Evict, in every head of batch rows ``rows``, the live rows not marked in ``keep`` bool
        ``[R, Hkv, n]`` (n >= the longest head; rows past a head's length are ignored).

        One gather and one scatter for the whole layer move the kept rows to the front of their
        segments, in order; the evicted rows are folded into the rows' moment sums when tracked
        (``fold``), in one batched computation.  ``shrink``: as in :meth:`keep`; ``kept``: the host's
        count of the rows ``keep`` marks per head when known (:meth:`SegmentStore.keep_rows`).
        """
        self._settle()
        if keep.device != self.store.device:
            keep = keep.to(self.store.device)
        if fold and any(self.rows[r].moments is not None for r in rows):
            evicted = self.store.live_mask(rows, keep.shape[-1]) & ~keep  # [R, Hkv, n]
            keys, values = self.store.masked_rows(rows, evicted)
            fold_evicted([self.rows[r] for r in rows], keys, values, evicted)
        self.store.keep_rows(rows, keep, shrink=shrink, kept=kept)

    def track_moments(self) -> None:
        """Start moment sums for every batch element (refused once something was evicted).  A
        sliding-window or chunked layer keeps none (see :mod:`runtime.kv_store.layer_attention`): it is never
        corrected."""
        if not self.is_initialized:
            raise ValueError("the cache is empty: prefill it before tracking moments")
        if self.window is not None or self.attention_chunk is not None:
            return
        for b, row in enumerate(self.rows):
            if row.moments is not None:
                continue
            if (self.store.host_length[b] != row.real_seen).any():  # the host mirror: no device read
                raise ValueError(
                    f"batch element {b} already evicted tokens without tracking their moments; "
                    "track moments before the first eviction"
                )
            row.moments = MomentSums(self.num_heads, self.head_dim, device=self.device, value_dim=self.value_dim)

    # -- attention ---------------------------------------------------------------------------

    def attend(
        self,
        query: torch.Tensor,
        real: torch.Tensor | None,
        positions: torch.Tensor,
        scaling: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the parked chunk's real tokens and attend every query head over its KV head's
        retained tokens plus the chunk (causally), all rows and heads in one computation.

        ``query [B, Hq, q, d]`` post-RoPE; ``real`` bool ``[B, q]`` (None: all real);
        ``positions`` int ``[B, q]`` RoPE positions of the chunk; ``window``: the layer's sliding
        window W (None: full attention), ``softcap``: its logit soft-capping (None: none), ``sinks``:
        its learned attention sinks ``[Hq]`` (None: none), as the model passes them
        (:mod:`runtime.kv_store.layer_attention`).  Returns ``[B, q, Hq, d]``; rows of
        padding queries are zero.

        A sliding-window or chunked layer then owes :meth:`drop_outside_window` before its next chunk.
        """
        if self._pending is None:
            raise RuntimeError("RaggedLayer.attend called without a parked chunk (update() first)")
        if self._undropped:
            raise RuntimeError(f"layer {self.layer_idx}: drop_outside_window() was owed after the last chunk")
        if self._shared is not None:
            self._pending = None
            raise RuntimeError(
                f"layer {self.layer_idx}: {self._shared.left} of the layers reading its cache did not attend its last "
                "chunk (a forward pass stopped part-way: prefill a new cache)"
            )
        new_keys, new_values = self._pending
        self._pending = None
        self._set_variant(window, softcap)
        if real is not None and bool(real.all()):
            real = None
        batch, _, q_len, _ = query.shape
        store = self.store
        self._hiding = self._hides_window(q_len, real, sinks)
        if self._hiding:
            self._step_positions = positions
        else:  # anything but a step that hides: what earlier steps hid is dropped first
            self._settle()
        store.compact()
        if self.observe_queries:
            for b in range(batch):
                chunk = query[b] if real is None else query[b][:, real[b]]  # [Hq, q_real, d]
                if chunk.shape[1]:
                    self.rows[b].observe(chunk, self.observe_queries)
        if self.chunk_specs:
            with label("kvcal.chunk_mass"):
                for b in range(batch):
                    chunk = query[b] if real is None else query[b][:, real[b]]  # [Hq, q_real, d]
                    keys = new_keys[b] if real is None else new_keys[b][:, real[b]]  # [Hkv, q_real, d]
                    if chunk.shape[1]:
                        self.rows[b].accumulate_chunk_attention(self.chunk_specs, chunk, keys, scaling)
        fresh = not store.host_length.any()  # the host mirror: no torch op
        before = store.host_length.copy() if q_len > 1 else None  # [B, Hkv] rows held before a chunk
        # None: q_len for every row
        counts = store.append(new_keys, new_values, positions, real, step_positions=self.step_positions)
        prepared = self._correction.get(self.rows, store.num_heads, store.head_dim, store.device, store.value_dim)
        # nothing retained before this chunk: ordinary causal attention, but for learned sinks where the
        # segment kernels give each query's log-sum-exp they need (asked only then: not on a decode step)
        chunk_only = fresh and prepared is None
        if chunk_only and sinks is not None:
            chunk_only = not lse_kernel_serves(query, store, real, window, softcap, self.attention_chunk)
        # the layout of this storage generation (the property rebuilds it after a repack)
        layout = None if chunk_only else self._layout if self._layout_generation == store.generation else self.layout
        attention_chunk = self.attention_chunk

        def attention(query: torch.Tensor) -> torch.Tensor:
            """This chunk's attention of queries at its columns, or at its last ``t`` columns (``query [B, Hq, t,
            d]``, ``t`` fewer: a layer reading this one's cache, run only where its model keeps logits)."""
            if chunk_only:
                with label("kvcal.attention"):
                    return chunk_only_attention(  # the chunk's last columns alone where tail is fewer
                        query,
                        new_keys,
                        new_values,
                        real,
                        scaling,
                        positions=positions,
                        window=window,
                        softcap=softcap,
                        sinks=sinks,
                        attention_chunk=attention_chunk,
                    )
            return at_the_chunks_columns(  # the kernels take the whole chunk's queries
                lambda query: segment_layer_attention(
                    query,
                    store,
                    layout,
                    real,
                    scaling,
                    prepared,
                    positions=positions,
                    window=window,
                    softcap=softcap,
                    sinks=sinks,
                    chunk=None if before is None else (new_keys, new_values, before),
                    attention_chunk=attention_chunk,
                ),
                query,
                q_len,
            )

        output = attention(query)
        if self.shared_by:  # the layers reading this cache attend next, over what this chunk attended
            self._shared = SharedChunk(
                attention, q_len, window, softcap, None if chunk_only else store.generation, self.shared_by
            )
        seen = None if self.attention_chunk is None else [row.real_seen for row in self.rows]
        self._advance_rows(q_len, counts)
        self._undropped = window is not None or (
            seen is not None and self._crosses_chunk(seen, [row.real_seen for row in self.rows])
        )
        return output

    @property
    def owes_readers(self) -> bool:
        """Whether the layers reading this layer's cache (:attr:`shared_by`) are still to attend its last chunk over
        the storage, which what follows its attention (``runtime.compression.driver.after_attention``: decode-time
        evictions, the sliding-window drop) would change: the last of them runs it instead."""
        return self._shared is not None and self._shared.generation is not None

    def attend_shared(
        self, query: torch.Tensor, *, window: int | None = None, softcap: float | None = None
    ) -> tuple[torch.Tensor, bool]:
        """A layer that reads this layer's cache instead of its own (KV sharing,
        ``artifacts.fingerprint.kv_shared_layers``: Gemma 3n, Gemma 4 E2B / E4B) attends its ``query
        [B, Hq, q, d]`` exactly as this layer attended its last chunk: over the tokens it held, evictions included,
        and the chunk, with its positions, padding and correction.  ``q`` may be fewer than the chunk's columns: the
        chunk's last ``q`` (transformers' Gemma 4 runs only the columns whose logits it keeps through these
        layers).  Returns ``(output [B, q, Hq, d], whether it was the last reader owed what follows this layer's
        attention)``: see :attr:`owes_readers`."""
        shared = self._shared
        if shared is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: a layer reading its cache attended before it did, or more than "
                f"{self.shared_by} layers read it"
            )
        output = shared.read(query, window, softcap, self.store.generation)
        if shared.left:
            return output, False
        self._shared = None
        return output, shared.generation is not None

    def drop_outside_window(self) -> None:
        """A sliding-window layer drops every token the next query cannot see (those at or before its
        newest position + 1 - W), so it never holds more than ``W - 1`` tokens between forward passes
        (as transformers' own sliding-window cache layer), and decode steps need no window mask.
        Called after each :meth:`attend`, once the decode-time evictions due ran
        (:func:`runtime.compression.driver.after_attention`); nothing for a full-attention layer.

        Which tokens leave depends on the stored positions, so dropping them reads the device once (a
        synchronisation per layer and step on a GPU).  A one-token decode step under the page kernel
        (:meth:`_hides_window`) hides them instead: their bias becomes -inf, on the device, and they stay
        stored and counted until an operation that is not such a step drops them (:meth:`_settle`: the
        next prefill chunk, a step under another kernel or out of room, a beam reorder, any read of the
        rows or lengths).  Such a step synchronises nothing and replays from a graph.

        A chunked layer drops, only after a chunk that took a row's next position into a new attention chunk
        (the host's counts say so), every row before that chunk: one read of the device then, none
        otherwise."""
        if self._undropped:
            if self.window is None:  # a chunked layer (attend: only when a row's next chunk begins)
                chunk = self.attention_chunk
                first = np.array([row.real_seen // chunk * chunk for row in self.rows], dtype=np.int64)
                self.store.drop_before(first, room=chunk)
            elif self._hiding:
                self.store.hide_outside_window(self.window, self._step_positions)
                self._hidden, self._step_positions = True, None
            else:
                self.store.drop_outside_window(self.window)
            self._undropped = False

    def _crosses_chunk(self, before: list[int], after: list[int]) -> bool:
        """Whether some row's next position (its real tokens fed, ``before`` and ``after`` a chunk) entered
        another attention chunk of this chunked layer: what it holds before that chunk is to drop."""
        chunk = self.attention_chunk
        return any(new // chunk > old // chunk for old, new in zip(before, after, strict=True))

    def _hides_window(self, q_len: int, real, sinks) -> bool:
        """Whether this chunk's sliding-window drop is a hide (:meth:`drop_outside_window`): a sliding-window
        layer's one-token decode step, every row real, no decode-time eviction (its scores and lengths
        must see only what the window holds), under the page kernel (the one that reads the bias).
        Host tables only, but where some head has no room for the step's row: then what is hidden is
        dropped (one read of the device) and room made for a quarter of the window more (at least
        :data:`_HIDING_ROOM` rows), so that steps without a repack or a read follow (a decode step
        replayed from a graph has room for the whole generation: runtime.serve.generation.generate_from_cache
        reserves it)."""
        store = self.store
        if self.window is None or q_len != 1 or real is not None:
            return False
        if any(row.decode_plan is not None for row in self.rows):
            return False
        if decode_kernel(store, self.softcap, need_lse=sinks is not None, window=self.window) != "pages":
            return False
        if store.free < 1:  # out of room: drop what is hidden and make room to hide the next rows in
            self._settle()
            store.reserve(np.full(store.batch_size, max(_HIDING_ROOM, self.window // 4), dtype=np.int64))
        return True

    def _settle(self) -> None:
        """Drop the rows earlier decode steps only hid (:meth:`drop_outside_window`): one read of the device."""
        if self._hidden:
            self._hidden = False
            self.store.drop_outside_window(self.window)

    def _advance_rows(self, q_len: int, counts) -> None:
        """The rows' and the layer's host counts after a chunk of ``q_len`` columns (``counts [B]``
        real tokens per row, None: all real)."""
        for b, row in enumerate(self.rows):
            row.real_seen += q_len if counts is None else int(counts[b])
        self.tokens_seen += q_len

    # -- replayed decode steps (runtime.serve.decode_graph) ---------------------------------------

    def replay_key(self) -> tuple | None:
        """What this layer's part of the next one-token decode step (every row one real token)
        depends on, when that step runs device ops only and the same ones as the step before it on
        the same buffers; else None.  Equal keys: a graph captured at one such step replays the
        next (:mod:`runtime.serve.decode_graph`).  Host tables only: no torch op.

        None when the step would do host work of its own or host-sized device work: before the
        first chunk or with one parked; a sliding-window layer whose step would drop rather than hide
        (another kernel than the page kernel, or decode-time eviction: :meth:`_hides_window`), a chunked layer
        whose step takes a row into another attention chunk (its drop follows); prompt
        queries or chunked attention still recorded; a repack (no free row, or rows to release); the
        correction's quantities not built yet for the rows' sums; and the CPU
        kernel that reads the live rows in place (:func:`~runtime.kv_store.layer_attention.decode_kernel`:
        its calls are sized by the host's lengths).  Whether an eviction falls due after the step
        is the eviction driver's to say (:func:`runtime.compression.driver.due_after_step`)."""
        store = self.store
        if store is None or self._pending is not None:
            return None
        if self.window is not None and any(row.decode_plan is not None for row in self.rows):
            return None
        if self.attention_chunk is not None:
            seen = [row.real_seen for row in self.rows]
            if self._crosses_chunk(seen, [n + 1 for n in seen]):
                return None  # the step is followed by a chunked layer's drop (drop_outside_window): run it eagerly
        if self.observe_queries or self.chunk_specs or store.loose or store.free < 1 or not store.host_length.any():
            return None
        built, prepared = self._correction.built(self.rows)
        if not built:
            return None
        kernel = decode_kernel(store, self.softcap, need_lse=prepared is not None, window=self.window)
        if kernel == "live_rows" or (self.window is not None and kernel != "pages"):
            return None  # a sliding-window layer replays only where its step hides (_hides_window)
        return store.generation, id(prepared), kernel

    def advance_replayed(self) -> None:
        """The host's part of a replayed one-token decode step (the device's was captured): what
        :meth:`attend` counts on the host for one real token per row."""
        self.store.advance_host(1)
        self._advance_rows(1, None)
        if self.window is not None:  # the captured step hid what left the window (drop_outside_window)
            self._hidden = True

    def _set_variant(self, window: int | None, softcap: float | None) -> None:
        """Record the layer's window and soft-capping at its first chunk; refuse a change later
        (a cache belongs to one model)."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"the sliding window must be a positive integer, got {window!r}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"the attention soft-capping must be positive, got {softcap!r}")
        if self.tokens_seen == 0:
            self.window, self.softcap = window, None if softcap is None else float(softcap)
        elif (window, softcap) != (self.window, self.softcap):
            raise ValueError(
                f"layer {self.layer_idx} was filled with sliding window {self.window} and soft-capping "
                f"{self.softcap}, now attended with {window} and {softcap}: a cache serves one model"
            )

    def stop_observing(self) -> None:
        """Drop this layer's recorded prompt queries and chunked attention, and record no more."""
        for row in self.rows:
            row.recent_queries = None
            row.chunk_attention = None
        self.observe_queries = 0
        self.chunk_specs = ()

    # -- accounting ----------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (capacity, i.e. page rounding and slack included)."""
        return 0 if self.store is None else self.store.kv_bytes()

    def index_bytes(self) -> int:
        """Bytes allocated for the per-row RoPE positions and visibility bias."""
        return 0 if self.store is None else self.store.index_bytes()

    def moment_bytes(self) -> int:
        """Bytes of the moment sums (``O(Hkv d^2)`` per element, whatever the context length)."""
        return sum(row.moments.nbytes() for row in self.rows if row.moments is not None)


class RaggedRecurrentLayer(RaggedLayer, LinearAttentionLayer or object):
    """A layer that attends and runs a recurrent mixer beside it on the same input (Falcon-H1's ``hybrid``
    layers, attention and Mamba 2): a :class:`RaggedLayer` for its KV cache, transformers'
    ``LinearAttentionLayer`` for the mixer's conv and SSM states (which transformers' ``Cache`` finds at the
    same decoder index), as transformers' own ``LinearAttentionAndFullAttentionLayer`` pairs them."""

    def __init__(self, layer_idx: int = 0, number_of_states: int = 1, **kwargs):
        RaggedLayer.__init__(self, layer_idx, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if args:  # the attention's keys and values
            RaggedLayer.lazy_initialization(self, *args, **kwargs)
        else:  # the mixer's conv_states= / recurrent_states=, state_idx=
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        config, mask_window, states = self.model_config, self.mask_window, self.number_of_states
        attention_chunk = self.attention_chunk
        self.__init__(self.layer_idx, number_of_states=states)
        self.model_config, self.mask_window, self.attention_chunk = config, mask_window, attention_chunk

    def _reindex_batch(self, order: list[int]) -> None:
        RaggedLayer._reindex_batch(self, order)
        LinearAttentionLayer.reorder_cache(self, torch.tensor(order, dtype=torch.long))


class RaggedCache(Cache):
    """``Cache(layers=[RaggedLayer, ...])``; pass it as the model's cache argument
    (``runtime.kv_store.transformers_compat.cache_argument``; see the module docstring)."""

    def __init__(self, num_layers: int, others: dict | None = None, stateful: dict | None = None):
        """``num_layers`` :class:`RaggedLayer` (the layers whose KV cache kvcal evicts: the artifact's ``L``);
        ``others``: the model's other decoder layers, ``{decoder index: cache layer}``, which kvcal holds and
        never evicts: a hybrid model's recurrent layers in transformers' own ``LinearAttentionLayer`` (a Gated
        DeltaNet's or a convolution's state of fixed size), Gemma 4's sliding layers in a :class:`RaggedLayer` of
        their own geometry (:attr:`window_layers`), the evicted layers filling the other indices in order;
        ``stateful``: ``{layer: {"number_of_states": n}}`` of the layers with a KV cache that also run a recurrent
        mixer (:class:`RaggedRecurrentLayer`, Falcon-H1)."""
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        others, stateful = dict(others or {}), dict(stateful or {})
        ragged = [
            RaggedRecurrentLayer(index, **stateful[index]) if index in stateful else RaggedLayer(index)
            for index in range(num_layers)
        ]
        queue = iter(ragged)
        super().__init__(layers=[others[i] if i in others else next(queue) for i in range(num_layers + len(others))])
        # the RaggedLayer of every layer kvcal evicts, in order: layer i of the artifact and of ModelGeometry
        # (self.layers, which transformers indexes by decoder layer, also holds the other layers)
        self.attention_layers: list[RaggedLayer] = ragged if others else self.layers
        # every RaggedLayer, those evicted and Gemma 4's sliding ones, in decoder order: what the storage's own
        # operations go over (copies and stacks, row reorders, column counts, replayed steps)
        self.ragged_layers: list[RaggedLayer] = [layer for layer in self.layers if isinstance(layer, RaggedLayer)]
        shared = StepPositions()
        for layer in self.ragged_layers:
            layer.step_positions = shared

    @classmethod
    def for_model(cls, model) -> RaggedCache:
        """A cache for ``model`` (whose geometry refuses attention the cache cannot compute); it
        refuses a forward pass that does not run the ragged attention."""
        geometry = ModelGeometry.of(model)
        cache = cls(geometry.num_layers, *other_layers(model, geometry))
        chunks = attention_chunks(model.config)
        for layer, window, chunk in zip(cache.attention_layers, mask_windows(model, geometry), chunks, strict=True):
            layer.model_config, layer.mask_window, layer.attention_chunk = model.config, window, chunk
        for layer in cache.window_layers.values():  # their window: what the attention call passes
            layer.model_config = model.config
        for source in kv_shared_layers(geometry.text_config).values():  # the layers reading its cache, not theirs
            cache.layers[source].shared_by += 1
        return cache

    @property
    def recurrent_layers(self) -> dict:
        """``{decoder index: cache layer}`` of the decoder layers whose states stay transformers' own: a hybrid
        model's recurrent layers (empty for other models)."""
        return {index: layer for index, layer in enumerate(self.layers) if not isinstance(layer, RaggedLayer)}

    @property
    def window_layers(self) -> dict:
        """``{decoder index: RaggedLayer}`` of the sliding-window layers kvcal holds apart from the evicted ones,
        of their own head dim and KV heads (Gemma 4's: ``artifacts.fingerprint.sliding_layers_apart``): each keeps
        its window of every row's real tokens, never evicted (empty for other models)."""
        evicted = {id(layer) for layer in self.attention_layers}
        return {
            index: layer
            for index, layer in enumerate(self.layers)
            if isinstance(layer, RaggedLayer) and id(layer) not in evicted
        }

    @property
    def holds_recurrent_states(self) -> bool:
        """Whether the model has recurrent layers (a hybrid's Gated DeltaNet, Mamba or short convolutions, Falcon-H1's
        mixers beside attention), which run over every column of a batch, padding included."""
        return bool(self.recurrent_layers or self.stateful)

    @property
    def stateful(self) -> dict:
        """``{layer: {"number_of_states": n}}`` of the :class:`RaggedRecurrentLayer` among the attention layers."""
        return {
            index: {"number_of_states": layer.number_of_states}
            for index, layer in enumerate(self.attention_layers)
            if isinstance(layer, RaggedRecurrentLayer)
        }

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self.attention_layers[0].batch_size if self.attention_layers[0].is_initialized else 0
        self._reindex_recurrent([b for b in range(rows) for _ in range(repeats)])
        for layer in self.ragged_layers:
            layer.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex_recurrent([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])
        for layer in self.ragged_layers:
            layer.batch_select_indices(indices)

    def _reindex_recurrent(self, order: list[int]) -> None:
        """Batch rows ``order`` of every recurrent layer's states (transformers' ``LinearAttentionLayer`` can
        reorder its rows, not repeat or select them)."""
        for layer in self.recurrent_layers.values():
            layer.reorder_cache(torch.tensor(order, dtype=torch.long))

    def replay_key(self) -> tuple | None:
        """What the next one-token decode step depends on when it can be replayed from a graph
        captured at an earlier step with the same key (:meth:`RaggedLayer.replay_key`), else None."""
        keys = []
        for layer in self.ragged_layers:
            key = layer.replay_key()
            if key is None:
                return None
            keys.append(key)
        return tuple(keys)

    def advance_replayed(self) -> None:
        """Count a replayed one-token decode step on the host (:meth:`RaggedLayer.advance_replayed`)."""
        for layer in self.ragged_layers:
            layer.advance_replayed()

    def head_lengths(self) -> torch.Tensor:
        """Live tokens per head, int64 ``[L, B, Hkv]``."""
        return torch.stack([layer.length for layer in self.attention_layers])

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values over the layers kvcal evicts (page rounding and slack included; not
        the :attr:`window_layers`, Gemma 4's sliding ones, each at most its window)."""
        return sum(layer.kv_bytes() for layer in self.attention_layers)

    def index_bytes(self) -> int:
        return sum(layer.index_bytes() for layer in self.attention_layers)

    def moment_bytes(self) -> int:
        return sum(layer.moment_bytes() for layer in self.attention_layers)

    def track_moments(self) -> None:
        """Keep moment sums of every token evicted from now on (call before the first eviction)."""
        for layer in self.attention_layers:
            layer.track_moments()

    def set_correction(self, orders, tau, rows: list[int] | None = None) -> None:
        """Correct attention with the moments: ``orders`` int ``[L, Hkv]`` in {-1, 0, 1}, ``tau [L, Hkv]``
        (None: switch correction off) for batch elements ``rows`` (default all)."""
        for index, layer in enumerate(self.attention_layers):
            for b in range(layer.batch_size) if rows is None else rows:
                row = layer.rows[b]
                if orders is None or layer.window is not None or layer.attention_chunk is not None:
                    # sliding-window and chunked layers are never corrected (track_moments)
                    row.correction = None
                    continue
                if row.moments is None:
                    raise ValueError("correction needs moment sums: call track_moments() before evicting")
                row.correction = Correction(
                    torch.as_tensor(np.asarray(orders[index]), dtype=torch.int64),
                    torch.as_tensor(np.asarray(tau[index]), dtype=torch.float32),
                )

    def set_decode_plan(self, plan, row: int) -> None:
        """Evict batch element ``row`` while decoding under ``plan`` (a
        :class:`runtime.compression.driver.DecodePlan`, carried with the row through beams and copies and
        read by :func:`runtime.compression.driver.after_attention`; None: stop)."""
        for layer in self.attention_layers:
            layer.rows[row].decode_plan = plan

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` more tokens in every head of every row, made now (one repack per layer at
        most) rather than while decoding: a layer whose rows evict while decoding is left alone
        (its heads are cut back to their budgets before they grow far)."""
        for layer in self.ragged_layers:
            if layer.is_initialized and not any(row.decode_plan is not None for row in layer.rows):
                layer._settle()
                layer.store.reserve(np.full(layer.batch_size, int(rows), dtype=np.int64))

    def compact(self) -> None:
        """Release the memory eviction freed (every layer repacked once; see :meth:`RaggedLayer.compact`)."""
        for layer in self.ragged_layers:
            layer.compact()

    def set_columns(self, columns: int) -> None:
        """Count ``columns`` prompt columns fed, whatever layout fed them (the block-wise prefill lays each
        row's blocks out on its own: runtime.serve.generation.row_blocks), so that generate() and the masks
        read the caller's columns after it; the rows, their real tokens and positions stay as fed."""
        self._check_idle("recount the columns of")
        for layer in self.ragged_layers:
            layer.tokens_seen = int(columns)

    def bytes_per_token(self) -> int:
        """Key + value bytes of one token in one KV head."""
        layer = self.attention_layers[0]
        if not layer.is_initialized:
            raise ValueError("the cache is empty")
        return (layer.head_dim + layer.value_dim) * torch.empty(0, dtype=layer.dtype).element_size()

    def _check_idle(self, what: str) -> None:
        if any(layer._pending is not None for layer in self.ragged_layers):
            raise RuntimeError(f"cannot {what} a cache in the middle of a forward pass")

    def copy(self) -> RaggedCache:
        """An independent copy (e.g. one prefill, several policies): buffers and moment sums are cloned."""
        return RaggedCache.stack([self])

    @classmethod
    def stack(cls, caches: list[RaggedCache]) -> RaggedCache:
        """One batched cache from caches that saw the same columns (e.g. copies of one prefill
        compressed under different policies), batch elements in order.  The result owns new
        buffers: decoding it never writes into the sources, nor they into it."""
        if not caches:
            raise ValueError("need at least one cache to stack")
        first = caches[0]
        if any(
            len(c.layers) != len(first.layers)
            or c.recurrent_layers.keys() != first.recurrent_layers.keys()
            or c.window_layers.keys() != first.window_layers.keys()
            for c in caches
        ):
            raise ValueError("caches to stack must have the same layers")
        if any(c.get_seq_length() != first.get_seq_length() for c in caches):
            raise ValueError("caches to stack must have seen the same number of columns")
        for cache in caches:
            cache._check_idle("stack or copy")
            for layer in cache.ragged_layers:
                layer._settle()  # a copy holds what the window holds, nothing hidden
        others = {index: stacked_recurrent_layer([c.layers[index] for c in caches]) for index in first.recurrent_layers}
        others.update({index: RaggedLayer(layer.layer_idx) for index, layer in first.window_layers.items()})
        stacked = cls(len(first.attention_layers), others, first.stateful)
        for index, target in enumerate(stacked.ragged_layers):
            fill_stacked(target, [c.ragged_layers[index] for c in caches])
        return stacked

    def stop_observing(self) -> None:
        """Drop the recorded prompt queries and chunked attention, and record no more (what decoding
        needs no longer)."""
        for layer in self.attention_layers:
            layer.stop_observing()

    def accumulate_chunk_attention(self, specs) -> None:
        """Accumulate, in every layer, the chunked attention of each :class:`~runtime.math.chunk_attention.ChunkSpec`
        of ``specs`` over the tokens that follow (Compactor's, :mod:`runtime.math.chunk_attention`)."""
        for layer in self.attention_layers:
            layer.chunk_specs = tuple(dict.fromkeys((*layer.chunk_specs, *specs)))

    def observe_queries(self, count: int) -> None:
        """Keep the last ``count`` post-RoPE queries of each layer (SnapKV's observation window)."""
        for layer in self.attention_layers:
            layer.observe_queries = int(count)


def fill_stacked(target: RaggedLayer, sources: list[RaggedLayer]) -> None:
    """Fill the new, empty ``target`` with the batch rows of ``sources`` in order (:meth:`RaggedCache.stack`,
    layer by layer), its buffers new: decoding it never writes into the sources, nor they into it."""
    if not all(source.is_initialized for source in sources):
        if len(sources) == 1:  # copying an empty layer
            target.shared_by = sources[0].shared_by
            return
        raise ValueError("caches to stack must all be prefilled")
    if len({(s.num_heads, s.head_dim, s.value_dim, s.dtype, s.key_buffer.device) for s in sources}) != 1:
        raise ValueError("caches to stack must have the same KV heads, head dim, dtype and device")
    base = sources[0]
    target.shared_by = base.shared_by
    target.is_initialized = True
    target.dtype, target.device = base.dtype, base.device
    target.keys, target.values = base.keys, base.values
    target.tokens_seen, target.observe_queries = base.tokens_seen, base.observe_queries
    target.chunk_specs = base.chunk_specs
    target.window, target.softcap = base.window, base.softcap
    target.model_config, target.mask_window = base.model_config, base.mask_window
    target.attention_chunk = base.attention_chunk
    rows = [(source, b) for source in sources for b in range(source.batch_size)]
    capacity = torch.cat([source.capacity for source in sources])  # [B', Hkv]
    target.store = SegmentStore.stacked(base.store, [(source.store, b) for source, b in rows], capacity)
    target.rows = [source.rows[b].copy() for source, b in rows]
    if isinstance(target, RaggedRecurrentLayer):
        _stack_states(target, sources)


def row_layer(layer: RaggedLayer, row: int) -> RaggedLayer:
    """A new :class:`RaggedLayer` holding batch row ``row`` of ``layer`` (its buffers new)."""
    copied = RaggedLayer(layer.layer_idx)
    layer._settle()
    fill_stacked(copied, [layer])
    copied.batch_select_indices(torch.tensor([row]))
    return copied


def other_layers(model, geometry: ModelGeometry) -> tuple[dict, dict]:
    """What :class:`RaggedCache` holds beside the layers kvcal evicts: ``({decoder index: a new cache layer},
    {layer: options})``, the first for the layers ``geometry.layer_indices`` leaves out (a hybrid model's linear
    attention, convolution or MLP layers, each in the class transformers' own ``DynamicCache`` gives that layer
    type; Gemma 4's sliding-window layers, each a :class:`RaggedLayer` of its own geometry, never evicted), the
    second for its attention layers that also run a recurrent mixer (Falcon-H1's, :class:`RaggedRecurrentLayer`);
    both empty for other models."""
    config = geometry.text_config
    types = getattr(config, "layer_types", None) or ()
    readers = kv_shared_layers(config)  # layers attending to another's cache: none of their own (transformers' too)
    if len(geometry.layer_indices) + len(readers) == int(config.num_hidden_layers) and not set(types) & set(
        STATEFUL_ATTENTION_LAYER_TYPES
    ):
        return {}, {}
    attention = set(geometry.layer_indices)
    if sliding_layers_apart(config):
        return {index: RaggedLayer(index) for index in range(len(types)) if index not in attention | set(readers)}, {}
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

    kinds, options = get_layer_types_and_kwargs(config)
    recurrent = {
        index: DYNAMIC_LAYER_TYPE_MAPPING[kind](**option)
        for index, (kind, option) in enumerate(zip(kinds, options, strict=True))
        if index not in attention
    }
    stateful = {
        layer: {"number_of_states": options[index].get("number_of_states", 1)}
        for layer, index in enumerate(geometry.layer_indices)
        if kinds[index] in STATEFUL_ATTENTION_LAYER_TYPES
    }
    return recurrent, stateful


def stacked_recurrent_layer(sources: list):
    """One recurrent cache layer (transformers' ``LinearAttentionLayer``; its stateless ``DummyLayer``, copied)
    holding the batch rows of ``sources``
    in order, its conv and recurrent states new tensors (concatenated along the batch), so that decoding the
    result never writes into the sources (transformers updates these states in place)."""
    target = copy.copy(sources[0])
    if not hasattr(target, "conv_states"):  # transformers' DummyLayer (Nemotron-H's MoE and MLP layers): no state
        return target
    _stack_states(target, sources)
    return target


def _stack_states(target, sources: list) -> None:
    """Give ``target`` (a recurrent layer, or a :class:`RaggedRecurrentLayer`) new conv and recurrent states: those
    of ``sources`` concatenated along the batch, their flags and kernel sizes the first's."""
    base = sources[0]
    for name in (
        "conv_states",
        "recurrent_states",
        "is_conv_states_initialized",
        "is_recurrent_states_initialized",
        "has_previous_state",
        "conv_kernel_size",
    ):
        setattr(target, name, dict(getattr(base, name)))
    for kind in ("conv", "recurrent"):
        states, initialized = getattr(target, f"{kind}_states"), getattr(target, f"is_{kind}_states_initialized")
        for index in states:
            if any(getattr(source, f"is_{kind}_states_initialized")[index] != initialized[index] for source in sources):
                raise ValueError("caches to stack must all be prefilled")
            if initialized[index]:
                states[index] = torch.cat([getattr(source, f"{kind}_states")[index] for source in sources])
