"""Packed storage of one layer's per-KV-head token segments (vLLM's one KV tensor per layer).

The retained tokens of every (batch row ``b``, KV head ``h``) pair, a *segment*
``s = b * Hkv + h``, live in one contiguous buffer per layer (AdaKV's "flattened" cache)::

    key_buffer, value_buffer   [C, d]          C = sum of the segments' capacities
    position_buffer            int32 [C]       absolute RoPE position of every row
    row_bias                   [C + 1]         keys' dtype: 0 for a stored row, -inf for free
                                               capacity, plus a trailing -inf (gathered padding);
                                               only the page kernel reads it (see below)
    offset, capacity, length   int64 [B, Hkv]  (host) segment s holds its live rows at
                                               buffer rows offset_s .. offset_s + length_s - 1
    host_offset, host_capacity, host_length    the same tables as numpy arrays sharing their
                                               memory (the host mirror)

Offsets and capacities are multiples of the page size ``P`` (chosen at every repack by
:func:`runtime.kv_store.layout.page_size_for`), so ``key_buffer.view(C // P, P, d)`` cuts every segment
into whole pages.  Rows stay in arrival order: a segment's first rows are the attention sinks,
its last rows the recent window.

Memory.  :meth:`SegmentStore.compact` repacks after eviction (one gather) so every capacity is
its length rounded up to a page.  Appending past a segment's capacity repacks once for all
segments running short, giving each a slack of ``max(16, length / 32)`` rows, so decoding copies
the buffers every few dozen steps rather than at every step.  Every repack renews ``generation``
(unique over all stores), from which the page tables (:class:`runtime.kv_store.layout.PageLayout`) are
rebuilt.

Host mirror.  The tables are host memory, and every decision a decode step takes on them (is
there room, is every segment alike, where does each segment's live run end) reads them through
numpy views of that memory (``host_*``), never through torch: a decode step appends one row per
segment (the lengths advance on the host, the device's first-free-row table ``ends`` by one
in place), so it needs nothing read back from the device, and no torch op of its own touches the
tables (on a CPU as on a GPU, a torch op in the step is one that works on device data).  What
is derived from the tables for the device (``ends``, the live rows' bias, the page tables of
:class:`runtime.kv_store.layout.PageLayout`) is built on the host when the storage changes and copied once
(:func:`runtime.math.arrays.to_device`: non-blocking from pinned memory on CUDA).

The live rows' bias is read only by the page kernel (:func:`runtime.kv_store.paged_attention.decode_attention`,
a GPU's fallback); the kernels a step runs otherwise (the CPU's live rows, a GPU's FlashAttention
varlen call) read the lengths.  So a one-token step's append leaves the bias behind (one op, and
on a GPU one kernel launch, per layer and step: issue 39's count) until :attr:`SegmentStore.row_bias`
is first read, which rebuilds it from the host tables; from then on the store's appends keep it
current in place, so a step captured in a graph with the page kernel carries the bias's update.

The store knows nothing of attention, moments or policies: it stores, moves and drops rows.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from runtime.kv_store.layout import exclusive_cumsum, page_size_for, round_up, segment_rows
from runtime.math.arrays import host_array, to_device, version_counter

_MIN_SLACK = 16
_GENERATIONS = itertools.count(1)  # unique over all stores: a layout built for one never fits another


class StepPositions:
    """A one-token decode step's positions as the stores write them, int32 ``[B * Hkv]`` (every KV
    head of every row), made once per step and shared by every layer of a cache: each layer is
    handed the same ``position_ids`` and would otherwise convert and expand it again (3 aten ops a
    layer, issue 39's op count).  Keyed on the tensor itself and its version counter, so a tensor
    changed in place (a replayed graph's static input) is converted again (an inference tensor keeps no
    counter: keyed on itself alone, as generate() hands every eager step a new one).

    ``given``: while a decode step is captured for a graph (or warmed up for one), the ``position_ids [B, 1]``
    the model's forward was given (runtime.serve.decode_graph), for the layers of a model whose attention is
    not handed them (Llama 4's), which would otherwise number the step from the host's counts: a graph
    would replay the captured numbers.  None otherwise."""

    def __init__(self) -> None:
        self.given: torch.Tensor | None = None
        self._source: torch.Tensor | None = None
        self._key: tuple = ()  # (the source's version, heads)
        self._flat: torch.Tensor | None = None

    def flat(self, positions: torch.Tensor, heads: int) -> torch.Tensor:
        """``positions [B, 1]`` as int32 ``[B * heads]``, row-major (segment ``b * heads + h``)."""
        key = (version_counter(positions), heads)
        if positions is not self._source or key != self._key:
            self._source, self._key = positions, key
            self._flat = positions.expand(positions.shape[0], heads).reshape(-1).to(torch.int32)
        return self._flat


def _even_strides(offset) -> list[int | None]:
    """Per column of ``offset [B, Hkv]`` (host: numpy or a CPU tensor): the common difference between
    consecutive rows, or None when they are not evenly spaced (0 for a single row)."""
    offset = host_array(offset)
    if offset.shape[0] < 2:
        return [0] * offset.shape[1]
    step = offset[1:] - offset[:-1]  # [B - 1, Hkv]
    even = (step == step[:1]).all(0)
    return [int(step[0, h]) if bool(even[h]) else None for h in range(offset.shape[1])]


class SegmentStore:
    """One layer's packed segments ``[B, Hkv]`` of head dim ``d`` (see the module docstring), values of
    ``value_dim`` (``d`` but where a model's values are narrower than its keys: MiMo-V2-Flash)."""

    def __init__(self, batch: int, heads: int, dim: int, dtype: torch.dtype, device, value_dim: int | None = None):
        """An empty store: every segment of capacity 0."""
        self.num_heads, self.head_dim, self.dtype = int(heads), int(dim), dtype
        self.value_dim = int(dim if value_dim is None else value_dim)
        zeros = torch.zeros(batch, heads, dtype=torch.int64)
        # whether one-token appends update the bias: from its first read on (module docstring); until
        # then they leave it behind, and that read rebuilds it
        self.bias_follows_appends = False
        self.install(
            torch.zeros(0, dim, dtype=dtype, device=device),
            torch.zeros(0, self.value_dim, dtype=dtype, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
            zeros,
            zeros.clone(),
            zeros.clone(),
            1,
        )

    # -- buffers and tables ----------------------------------------------------------------

    def install(self, keys, values, positions, offset, capacity, length, page_size) -> None:
        """Adopt buffers ``keys / values [C, d]``, ``positions`` int32 ``[C]`` and tables ``offset /
        capacity / length`` int64 ``[B, Hkv]`` (host: CPU tensors or numpy arrays; capacities multiples
        of ``page_size``)."""
        self.key_buffer, self.value_buffer, self.position_buffer = keys, values, positions  # [C, d], [C, d], [C]
        offset, capacity, length = (torch.from_numpy(host_array(t).copy()) for t in (offset, capacity, length))
        self.offset, self.capacity, self.length = offset, capacity, length  # int64 [B, Hkv] host
        # the host mirror: numpy views of the same memory (see the module docstring)
        self.host_offset, self.host_capacity, self.host_length = offset.numpy(), capacity.numpy(), length.numpy()
        # plain attributes, not properties: read on every decode step of every layer
        self.batch_size, self.device = int(length.shape[0]), keys.device
        self.page_size = int(page_size)
        self.generation = next(_GENERATIONS)  # what was derived from offsets / capacities is stale
        self.loose = False  # segments shrank in place: compact() releases the memory
        # per KV head h, the buffer rows between batch rows' segments of h when they are evenly
        # spaced (offset[b, h] = offset[0, h] + b * stride: a decode step then reads head h of every
        # batch row as one strided [B, n, d] view), else None; 0 with one batch row
        self.head_stride = _even_strides(self.host_offset)
        # segments at increasing offsets in s = b * Hkv + h (FlashAttention varlen's packing,
        # runtime.kv_store.varlen_attention): known once per repack, read by every step
        self.increasing = bool(np.all(np.diff(self.host_offset.reshape(-1)) > 0))
        # one entry per buffer row, plus a trailing -inf that gathered padding reads
        self._row_bias = torch.empty(keys.shape[0] + 1, dtype=keys.dtype, device=keys.device)
        self._rebuild_bias()
        self._row_batch = None  # int64 [C]: each buffer row's batch row, made on first use (hide_outside_window)
        self.ends = None
        self.refresh_lengths()

    @property
    def row_bias(self) -> torch.Tensor:
        """``[C + 1]`` in the keys' dtype: 0 on every live row, -inf on free capacity and the
        trailing entry.  The first read rebuilds what one-token appends left behind and makes every
        later append keep it current (module docstring)."""
        if not self.bias_follows_appends:
            self._rebuild_bias()
            self.bias_follows_appends = True
        return self._row_bias

    def _rebuild_bias(self) -> None:
        """The bias from the host tables (the live rows of every segment), into the same tensor."""
        live = to_device(segment_rows(self.host_offset.reshape(-1), self.host_length.reshape(-1)), self.device)
        self._row_bias.fill_(float("-inf"))
        self._row_bias.index_fill_(0, live, 0.0)

    def refresh_lengths(self) -> None:
        """Re-derive what follows from ``length`` after an in-place change (eviction): on the host mirror,
        ``ends`` copied to the device once, into the tensor it had (a captured decode step reads that
        one: :mod:`runtime.serve.decode_graph`)."""
        flat_capacity, flat_length = self.host_capacity.reshape(-1), self.host_length.reshape(-1)
        ends = (self.host_offset.reshape(-1) + flat_length).copy()  # [S] first free row
        ends = to_device(ends, self.key_buffer.device)
        if self.ends is None or self.ends.shape != ends.shape:
            self.ends = ends
        else:
            self.ends.copy_(ends)
        # rows every segment can still take without a repack: min(capacity - length) here, a lower
        # bound after padded appends (which subtract the largest count)
        self.free = int((flat_capacity - flat_length).min()) if flat_length.size else 0
        # every segment: same length and capacity, so the buffer is a [B, Hkv, cap, d] tensor
        self.uniform = bool(
            flat_length.size > 0 and (flat_length == flat_length[0]).all() and (flat_capacity == flat_capacity[0]).all()
        )

    def repack(self, capacity: torch.Tensor, sources: list[tuple[SegmentStore, int]] | None = None) -> None:
        """New buffers with segment capacities ``capacity [B', Hkv]`` (at least the lengths, rounded up
        to the new page size), each batch row ``b'`` taking the live rows of ``sources[b'] = (store,
        row)`` (default: this store's own rows in order): one gather and one scatter per source."""
        if sources is None:
            sources = [(self, b) for b in range(self.batch_size)]
        capacity = host_array(capacity)
        length = np.stack([source.host_length[b] for source, b in sources]) if sources else capacity.copy()
        capacity = np.maximum(capacity, length)
        page = page_size_for(float(length.mean()) if length.size else 0.0)
        capacity = round_up(capacity, page)
        offset = exclusive_cumsum(capacity.reshape(-1)).reshape(capacity.shape)
        total, device = int(capacity.sum()), self.device
        keys = torch.zeros(total, self.head_dim, dtype=self.dtype, device=device)
        values = torch.zeros(total, self.value_dim, dtype=self.dtype, device=device)
        positions = torch.zeros(total, dtype=torch.int32, device=device)
        for source in {id(store): store for store, _ in sources}.values():
            rows = [index for index, (store, _) in enumerate(sources) if store is source]
            from_rows = [sources[index][1] for index in rows]
            counts = length[rows].reshape(-1)
            src = to_device(segment_rows(source.host_offset[from_rows].reshape(-1), counts), device)
            dst = to_device(segment_rows(offset[rows].reshape(-1), counts), device)
            keys.index_copy_(0, dst, source.key_buffer.index_select(0, src))
            values.index_copy_(0, dst, source.value_buffer.index_select(0, src))
            positions.index_copy_(0, dst, source.position_buffer.index_select(0, src))
        self.install(keys, values, positions, offset, capacity, length, page)

    @classmethod
    def stacked(
        cls, like: SegmentStore, sources: list[tuple[SegmentStore, int]], capacity: torch.Tensor
    ) -> SegmentStore:
        """A new store of the rows ``sources`` (``(store, row)`` pairs of ``like``'s head count, head
        dim, dtype and device) with capacities ``capacity [len(sources), Hkv]``: copies, not views."""
        store = cls(0, like.num_heads, like.head_dim, like.dtype, like.device, like.value_dim)
        store.repack(capacity, sources)
        return store

    def compact(self) -> None:
        """Release what eviction freed: every capacity becomes its length rounded up to a page."""
        if self.loose:
            self.repack(self.length.clone())

    def select_batch(self, order: list[int]) -> None:
        """Keep batch rows ``order`` (repeats allowed), in that order (beam search, batch expansion)."""
        self.repack(self.capacity[order] if order else self.capacity[:0], [(self, b) for b in order])

    # -- appending -------------------------------------------------------------------------

    def reserve(self, counts: torch.Tensor) -> None:
        """Make room for ``counts [B]`` more rows in every head of each row (repacks at most once)."""
        counts = host_array(counts)  # host
        need = self.host_length + counts[:, None]  # [B, Hkv]
        if int(counts.max()) <= self.free or (need <= self.host_capacity).all():
            return
        slack = np.where(self.host_length > 0, np.maximum(need // 32, _MIN_SLACK), 0)
        short = self.host_capacity - need < slack  # out of room now, or soon: grow them all in one repack
        self.repack(np.where(short, need + slack, self.host_capacity))

    def append(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        real: torch.Tensor | None,
        step_positions: StepPositions | None = None,
    ) -> torch.Tensor | None:
        """Store the chunk's real tokens, ``keys / values [B, Hkv, q, d]`` at ``positions`` int ``[B, q]``
        (``real`` bool ``[B, q]``, None: all real), at the end of every head; returns the counts ``[B]``
        (None without padding: ``q`` for every row).  ``step_positions``: the memo a one-token step
        shares with the other layers (:class:`StepPositions`), else the positions are converted here."""
        batch, heads, q_len, dim = keys.shape
        if real is None:
            if q_len > self.free:
                self.reserve(np.full(batch, q_len, dtype=np.int64))
            self._append_all(keys, values, positions, step_positions)
            return None
        counts = real.sum(1).cpu()  # [B]
        self.reserve(counts)
        ends = self.ends.view(batch, heads)  # first free row of each head
        take = real.nonzero(as_tuple=True)  # (row, column) of every real token, [T] each
        rank = real.long().cumsum(1) - 1  # [B, q] rank among the row's real tokens
        target = (ends[take[0]] + rank[take].unsqueeze(1)).reshape(-1)  # [T * Hkv]
        self._store(
            target,
            keys.transpose(1, 2)[take].reshape(-1, dim),  # [T, Hkv, d] -> rows in target's order
            values.transpose(1, 2)[take].reshape(-1, values.shape[-1]),
            positions[take].unsqueeze(1).expand(-1, heads).reshape(-1),
        )
        self.length += counts.unsqueeze(1)
        self.ends += counts.to(self.device).repeat_interleave(heads)
        self.free -= int(counts.max())
        if self.uniform and not bool((counts == counts[0]).all()):
            self.uniform = False
        return counts

    def _append_all(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, step_positions: StepPositions | None
    ) -> None:
        """:meth:`append` of a chunk ``[B, Hkv, q, d]`` without padding: ``q`` rows for every head."""
        batch, heads, q_len, dim = keys.shape
        if q_len == 1:  # a decode step: every head's next row is its first free one (fewest ops)
            memo = step_positions if step_positions is not None else StepPositions()
            self._store(  # the bias only once something reads it (module docstring)
                self.ends,
                keys.reshape(-1, dim),
                values.reshape(-1, values.shape[-1]),
                memo.flat(positions, heads),
                bias=self.bias_follows_appends,
            )
        elif self.uniform:  # one strided copy into the [B, Hkv, cap, d] view
            capacity, length = int(self.host_capacity[0, 0]), int(self.host_length[0, 0])
            end = length + q_len
            self.key_buffer.view(batch, heads, capacity, dim)[:, :, length:end] = keys
            self.value_buffer.view(batch, heads, capacity, values.shape[-1])[:, :, length:end] = values
            self.position_buffer.view(batch, heads, capacity)[:, :, length:end] = positions.to(torch.int32).unsqueeze(1)
            self._row_bias[:-1].view(batch, heads, capacity)[:, :, length:end].fill_(0.0)  # no scalar tensor
        else:
            rank = torch.arange(q_len, device=self.ends.device)
            target = (self.ends.view(batch, heads, 1) + rank).reshape(-1)  # [B * Hkv * q]
            self._store(
                target,
                keys.reshape(-1, dim),
                values.reshape(-1, values.shape[-1]),
                positions.unsqueeze(1).expand(batch, heads, q_len).reshape(-1),
            )
        self.ends += q_len  # on the device, in place
        self.advance_host(q_len)

    def advance_host(self, rows: int) -> None:
        """The host's part of appending ``rows`` rows to every segment (the device's, ``ends``, is
        :meth:`append`'s): a replayed decode step (:mod:`runtime.serve.decode_graph`) runs only this."""
        self.host_length += rows  # the host mirror: the tables' own memory, no torch op
        self.free -= rows

    def _store(
        self, target: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, *, bias=True
    ) -> None:
        """Write rows ``keys / values [n, d]``, ``positions [n]`` at buffer rows ``target [n]`` (and mark
        them live in the bias, unless ``bias`` is False)."""
        self.key_buffer.index_copy_(0, target, keys.to(self.key_buffer.dtype))
        self.value_buffer.index_copy_(0, target, values.to(self.value_buffer.dtype))
        self.position_buffer.index_copy_(0, target, positions.to(torch.int32))  # no op when int32 already
        if bias:
            self._row_bias.index_fill_(0, target, 0.0)

    # -- reading ---------------------------------------------------------------------------

    def head(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Live ``keys [n, d]``, ``values [n, d]`` and ``positions int32 [n]`` of head (b, h) (views)."""
        start = int(self.host_offset[b, h])
        end = start + int(self.host_length[b, h])
        return self.key_buffer[start:end], self.value_buffer[start:end], self.position_buffer[start:end]

    def live_mask(self, rows: list[int], n: int) -> torch.Tensor:
        """bool ``[R, Hkv, n]`` on the buffers' device: which of the first ``n`` rows of every head of
        batch rows ``rows`` are live."""
        return torch.arange(n, device=self.device) < to_device(self.host_length[rows], self.device).unsqueeze(-1)

    def padded_rows(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch rows ``rows``' live tokens, every head padded to the longest (one gather):
        ``keys, values [R, Hkv, n, d]`` (padding zero), ``positions`` int64 ``[R, Hkv, n]`` and
        ``valid`` bool ``[R, Hkv, n]``."""
        lengths = self.host_length[rows]  # [R, Hkv] host: the gather is sized and indexed without a device read
        n = int(lengths.max()) if lengths.size else 0
        row = np.arange(n)
        valid = row < lengths[..., None]  # [R, Hkv, n]
        padded = not valid.all()
        index = to_device(np.where(valid, self.host_offset[rows][..., None] + row, 0), self.device)
        valid = to_device(valid, self.device)
        flat = index.reshape(-1)  # index_select: faster than advanced indexing on CPU (R-page-kernels-2026-11-22)
        keys = self.key_buffer.index_select(0, flat).view(*index.shape, -1)
        values = self.value_buffer.index_select(0, flat).view(*index.shape, -1)
        positions = self.position_buffer.index_select(0, flat).view(index.shape).long()
        if padded:
            keys.masked_fill_(~valid.unsqueeze(-1), 0.0)
            values.masked_fill_(~valid.unsqueeze(-1), 0.0)
            positions.masked_fill_(~valid, 0)
        return keys, values, positions, valid

    def masked_rows(self, rows: list[int], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``keys, values [R, Hkv, n, d]`` of the rows of batch rows ``rows`` marked in ``mask``
        bool ``[R, Hkv, n]`` (device; only live rows), zero elsewhere (one gather)."""
        source = to_device(self.host_offset[rows], self.device).unsqueeze(-1) + torch.arange(
            mask.shape[-1], device=self.device
        )
        weight = mask.unsqueeze(-1).float()  # [R, Hkv, n, 1]
        index = torch.where(mask, source, 0)
        flat = index.reshape(-1)
        keys = self.key_buffer.index_select(0, flat).view(*index.shape, -1).float() * weight
        values = self.value_buffer.index_select(0, flat).view(*index.shape, -1).float() * weight
        return keys, values

    # -- evicting --------------------------------------------------------------------------

    def keep(self, b: int, h: int, rows: torch.Tensor, *, shrink: bool = True) -> None:
        """Drop all live rows of head (b, h) but ``rows`` (sorted, unique), which move to the front of
        the segment in place; ``shrink`` marks the memory for release by the next :meth:`compact`."""
        keys, values, positions = self.head(b, h)
        rows = rows.to(keys.device)
        count = int(rows.numel())
        for store in (keys, values, positions):
            store[:count] = store.index_select(0, rows)
        start = int(self.offset[b, h])
        self._row_bias[start + count : start + keys.shape[0]] = float("-inf")
        self.length[b, h] = count
        self.refresh_lengths()
        self.loose = self.loose or shrink

    def keep_rows(self, rows: list[int], keep: torch.Tensor, *, shrink: bool = True, kept=None) -> None:
        """Drop, in every head of batch rows ``rows``, the live rows not marked in ``keep`` bool
        ``[R, Hkv, n]`` (n >= the longest head; rows past a head's length are ignored): one gather and
        one scatter move the kept rows to the front of their segments, in order.

        ``kept`` int ``[R, Hkv]`` (host): how many rows ``keep`` marks in each head, when the caller
        knows it (a budget's ranking keeps ``min(budget, length)``); else it is read back from the
        device, the one synchronisation here.  No shape depends on device data: every live row
        (known on the host) is rewritten, the ``j``-th with the ``j``-th kept row (the rows past
        the kept ones with evicted rows, which the bias hides)."""
        lengths = self.host_length[rows]  # [R, Hkv] host
        n = keep.shape[-1]
        device = self.device
        live = segment_rows(self.host_offset[rows].reshape(-1), lengths.reshape(-1))  # buffer rows, host
        slots = segment_rows(np.arange(lengths.size) * n, lengths.reshape(-1))  # their places in [R * Hkv * n]
        slots = to_device(slots, device)
        valid = torch.arange(n, device=device) < to_device(lengths, device).unsqueeze(-1)
        keep = keep & valid
        # per head, the kept rows first, in order: a stable sort of "not kept"
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices  # [R, Hkv, n]
        offset = to_device(self.host_offset[rows], device).unsqueeze(-1)  # [R, Hkv, 1]
        source = (offset + order).reshape(-1).index_select(0, slots)  # [live rows]
        target = to_device(live, device)
        for buffer in (self.key_buffer, self.value_buffer, self.position_buffer):
            buffer.index_copy_(0, target, buffer.index_select(0, source))
        counts = keep.sum(-1)  # [R, Hkv] device
        place = torch.arange(n, device=device).expand(*keep.shape).reshape(-1).index_select(0, slots)
        stays = place < counts.reshape(-1).repeat_interleave(n).index_select(0, slots)
        self._row_bias.index_copy_(0, target, torch.where(stays, 0.0, float("-inf")).to(self._row_bias.dtype))
        kept = counts.cpu().numpy() if kept is None else host_array(kept)
        self.host_length[rows] = kept
        self.refresh_lengths()
        self.loose = self.loose or shrink

    def drop_outside_window(self, window: int) -> None:
        """Drop every row the next query of its batch row cannot see through a sliding window of
        ``window`` tokens: those at positions ``<= newest + 1 - window``, ``newest`` the batch row's
        latest stored position.  The memory is released (at the next :meth:`compact`) only when
        the segments are far larger than the window, e.g. after a long prefill: decode steps
        reuse their capacity."""
        live = self._live_positions()
        if live is not None:
            valid, positions = live
            newest = torch.where(valid, positions, -1).amax(dim=(1, 2))  # [B]
            self._keep_from(valid, positions, newest + 2 - window, room=window)

    def drop_before(self, first: np.ndarray, room: int) -> None:
        """Drop every row stored at a position below its batch row's ``first`` (int64 ``[B]``, host): a
        chunked layer's rows before the chunk of its next query (Llama 4's ``attention_chunk_size``).  The
        memory is released only when the segments are far larger than ``room`` (the chunk)."""
        live = self._live_positions()
        if live is not None:
            valid, positions = live
            self._keep_from(valid, positions, to_device(np.asarray(first, dtype=np.int64), self.device), room=room)

    def _live_positions(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(valid bool [B, Hkv, n], positions int64 [B, Hkv, n])`` of every stored row (``n`` the longest
        head; ``valid`` False past a head's length), None when nothing is stored."""
        lengths = self.host_length
        n = int(lengths.max()) if lengths.size else 0
        if n == 0:
            return None
        batch, heads = lengths.shape
        row = np.arange(n)
        live = row < lengths[..., None]  # [B, Hkv, n] host
        index = to_device(np.where(live, self.host_offset[..., None] + row, 0), self.device)
        positions = self.position_buffer.index_select(0, index.reshape(-1)).view(batch, heads, n).long()
        return to_device(live, self.device), positions

    def _keep_from(self, valid: torch.Tensor, positions: torch.Tensor, first: torch.Tensor, room: int) -> None:
        """Keep the rows at positions ``>= first`` (int ``[B]``, on the device) of their batch row."""
        batch = valid.shape[0]
        keep = valid & (positions >= first.view(batch, 1, 1))
        # which rows fall out depends on the stored positions: one read of the kept counts (a
        # sliding-window layer's one synchronisation per step), which also says whether any fell
        kept = keep.sum(-1).cpu().numpy()  # [B, Hkv]
        if (kept == self.host_length).all():
            return
        shrink = int(self.host_capacity.max()) > 2 * room
        self.keep_rows(list(range(batch)), keep, shrink=shrink, kept=kept)

    def hide_outside_window(self, window: int, newest: torch.Tensor) -> None:
        """Hide from the page kernel every row the next query of its batch row cannot see through a sliding
        window of ``window`` tokens (positions ``<= newest_b + 1 - window``; ``newest`` int ``[B]`` or ``[B, 1]``
        on the device, the batch rows' latest positions): their bias becomes -inf, nothing moves and the
        host tables still count them, until :meth:`drop_outside_window` drops them.  Device ops only, on
        buffers that stay (a decode step that does this replays from a graph: runtime.serve.decode_graph);
        only the page kernel, which reads the bias, may attend a store with hidden rows."""
        if self._row_batch is None:  # each buffer row's batch row, free capacity included (its bias is -inf)
            batch_of = np.repeat(np.arange(self.batch_size), self.num_heads)  # [S]
            rows = np.zeros(self.key_buffer.shape[0], dtype=np.int64)
            rows[segment_rows(self.host_offset.reshape(-1), self.host_capacity.reshape(-1))] = np.repeat(
                batch_of, self.host_capacity.reshape(-1)
            )
            self._row_batch = to_device(rows, self.device)
        bias = self.row_bias  # rebuilt from the host tables first if appends had left it behind
        limit = (newest.reshape(-1).to(self.position_buffer.dtype) + (1 - window)).index_select(0, self._row_batch)
        bias[:-1].masked_fill_(self.position_buffer <= limit, float("-inf"))

    # -- accounting ------------------------------------------------------------------------

    def kv_bytes(self) -> int:
        """Bytes allocated for keys and values (capacity, i.e. page rounding and slack included)."""
        return sum(t.numel() * t.element_size() for t in (self.key_buffer, self.value_buffer))

    def index_bytes(self) -> int:
        """Bytes allocated for the per-row RoPE positions and visibility bias."""
        return sum(t.numel() * t.element_size() for t in (self.position_buffer, self._row_bias))
