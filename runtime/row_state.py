"""What one cache layer keeps about one batch row besides its tokens, and the decode-eviction hook.

Per (layer, batch row), one :class:`RowState`:

* ``real_seen``: real tokens fed so far (the next token's RoPE position);
* ``recent_queries [Hq, <=N, d]``: the last ``N`` post-RoPE prompt queries (SnapKV's observation
  window, :meth:`RowState.observe`);
* ``chunk_attention``: Compactor's chunked attention accumulated over the prompt, one
  :class:`~runtime.chunk_attention.ChunkAttention` per :class:`~runtime.chunk_attention.ChunkSpec`;
* ``moments``: :class:`~runtime.moments.MomentSums` of every token evicted from each KV head of
  the layer (None: not tracked), grown by :func:`fold_evicted`;
* ``correction``: the MomentKV :class:`Correction` (None: plain attention), turned into the
  layer's batched :class:`~runtime.moments.PreparedMoments` by :class:`PreparedCorrection`;
* ``decode_plan``: a :class:`DecodePlan` (None: no eviction while decoding).

Decode-time eviction.  After every step the layer asks :func:`due_evictions` which rows hold a
head grown ``every`` tokens past its budget, and hands each group of rows sharing one hook to
that hook's :meth:`DecodeEvictionHook.evict_decoded` (the cache never knows how tokens are
scored: :class:`runtime.eviction.HeadEvictor` is the hook the runtime installs).  A hook may
defer what it must read back from the device (the NaN check of its scores) to
:meth:`DecodeEvictionHook.finish_round`, which :class:`DecodeRound` calls once the step's last
layer has attended: one host synchronisation per eviction round, not one per layer (issue 39).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from .chunk_attention import ChunkAttention, ChunkSpec
from .layout import to_device
from .moments import MomentSums, PreparedMoments


@runtime_checkable
class DecodeEvictionHook(Protocol):
    """Cuts heads back to their budgets while decoding (called by the cache after a step)."""

    def evict_decoded(
        self,
        layer,  # runtime.cache.RaggedLayer (not imported: the cache imports this module)
        layer_idx: int,
        rows: list[int],
        budgets: torch.Tensor,
        next_positions: list[int],
        stats_rows: list[int],
    ) -> None:
        """Cut every KV head of batch rows ``rows`` of ``layer`` (a :class:`runtime.cache.RaggedLayer`,
        index ``layer_idx``) down to ``budgets`` int64 ``[R, Hkv]`` tokens (a head's own length: leave
        it), keeping the capacity for the tokens that follow (``layer.keep_rows(..., shrink=False)``).
        ``next_positions[i]``: the RoPE position of row ``rows[i]``'s next token; ``stats_rows[i]``: its
        row in the hook's prompt statistics."""

    def finish_round(self) -> None:
        """After the last layer of a step in which :meth:`evict_decoded` was called: check what the
        calls deferred (raising as they would have), at most one read back from the device."""


class DecodeRound:
    """The hooks called during one decode step, finished once the step's last layer (index
    ``last_layer``) has attended (:meth:`DecodeEvictionHook.finish_round`).  One per cache, shared
    by its layers.  A step that ends before its last layer attends (a model whose last layer never
    calls the cache) cannot leave a round unfinished silently: the next step's first call refuses."""

    def __init__(self, last_layer: int) -> None:
        self.last_layer = int(last_layer)
        self._hooks: dict[int, DecodeEvictionHook] = {}
        self._layer = -1  # the last layer that called since the round began

    def called(self, hook: DecodeEvictionHook) -> None:
        """``hook.evict_decoded`` ran in this step."""
        self._hooks[id(hook)] = hook

    def layer_done(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` of the step has attended (and evicted where due)."""
        if self._hooks and layer_idx <= self._layer:
            self._hooks.clear()
            raise RuntimeError(
                f"a decode step ended at layer {self._layer} before the cache's last layer {self.last_layer} "
                "attended: its eviction round was never finished (the cache belongs to another model?)"
            )
        self._layer = layer_idx
        if layer_idx == self.last_layer:
            hooks, self._hooks, self._layer = list(self._hooks.values()), {}, -1
            for hook in hooks:
                hook.finish_round()


@dataclass
class DecodePlan:
    """Decode-time eviction of one batch element: ``hook`` cuts a head back to ``budgets[layer, head]``
    once it holds ``every`` tokens more; ``stats_row`` is the element's row in the hook's prompt
    statistics.  Rows whose plans share one hook are evicted in one call."""

    hook: DecodeEvictionHook
    budgets: np.ndarray  # int64 [L, Hkv]
    every: int
    stats_row: int

    def __post_init__(self):
        if not isinstance(self.hook, DecodeEvictionHook):
            raise TypeError(
                f"a decode plan's hook needs evict_decoded and finish_round methods, got {type(self.hook).__name__}"
            )


class Correction(NamedTuple):
    """The MomentKV correction of one row of one layer."""

    orders: torch.Tensor  # int64 [Hkv] in {-1, 0, 1} (-1: none)
    tau: torch.Tensor  # float32 [Hkv]


@dataclass
class RowState:
    """What one layer keeps about one batch row besides its tokens (see the module docstring)."""

    real_seen: int = 0  # real tokens fed: the next token's RoPE position
    recent_queries: torch.Tensor | None = None  # [Hq, <=N, d] the last N post-RoPE prompt queries
    chunk_attention: dict[ChunkSpec, ChunkAttention] | None = None
    moments: MomentSums | None = None  # sums of the tokens evicted from each KV head (None: not tracked)
    correction: Correction | None = None  # a plain (orders, tau) pair is read the same way
    decode_plan: DecodePlan | None = None

    def copy(self) -> RowState:
        return replace(
            self,
            moments=None if self.moments is None else self.moments.copy(),
            chunk_attention=None
            if self.chunk_attention is None
            else {spec: attention.copy() for spec, attention in self.chunk_attention.items()},
        )

    def accumulate_chunk_attention(self, specs, queries: torch.Tensor, keys: torch.Tensor, scale: float) -> None:
        """Add the row's next real tokens, post-RoPE ``queries [Hq, t, d]`` and ``keys [Hkv, t, d]``, to
        the chunked attention of every spec in ``specs`` (``scale``: the layer's attention scale)."""
        if self.chunk_attention is None:
            self.chunk_attention = {}
        for spec in specs:
            if spec not in self.chunk_attention:
                if self.real_seen:
                    raise ValueError(
                        "the chunked attention must be accumulated from the prompt's first token: prefill "
                        "with the policy (or its ChunkSpec) from the start"
                    )
                self.chunk_attention[spec] = ChunkAttention(spec)
            self.chunk_attention[spec].add(queries, keys, scale)

    def observe(self, chunk_queries: torch.Tensor, window: int) -> None:
        """Record ``chunk_queries [Hq, q, d]`` (post-RoPE), keeping the last ``window`` queries."""
        previous = self.recent_queries
        joined = chunk_queries if previous is None else torch.cat([previous, chunk_queries], dim=1)
        self.recent_queries = joined[:, -window:].clone()


def fold_evicted(states: list[RowState], keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> None:
    """Add evicted rows to the rows' moment sums in one batched computation: ``keys / values``
    float32 ``[R, Hkv, n, d]`` (zero where not evicted), ``evicted`` bool ``[R, Hkv, n]``;
    ``states[i]`` is batch row ``i``'s (rows without sums are skipped; a row with nothing evicted
    adds zeros, exactly, rather than asking the device whether it evicted anything)."""
    counts = evicted.sum(-1)  # [R, Hkv]
    sum_k, sum_v = keys.sum(2), values.sum(2)  # [R, Hkv, d]
    sum_vk = torch.einsum("rhnd,rhne->rhde", values, keys)  # [R, Hkv, d, d]
    for i, state in enumerate(states):
        sums = state.moments
        if sums is None:
            continue
        sums.version += 1
        sums.n += to_device(counts[i], sums.n.device)  # the same device: no copy
        sums.s_k += to_device(sum_k[i], sums.s_k.device)
        sums.s_v += to_device(sum_v[i], sums.s_v.device)
        sums.S_vk += to_device(sum_vk[i], sums.S_vk.device)


class PreparedCorrection:
    """The layer's correction quantities for every row and head, ``[B * Hkv]``, rebuilt only when a
    row's sums or correction changed."""

    def __init__(self) -> None:
        self._memo: tuple[tuple, PreparedMoments | None] | None = None

    def clear(self) -> None:
        self._memo = None

    @staticmethod
    def key(states: list[RowState]) -> tuple | None:
        """What the prepared quantities of ``states`` are built from (None: no row corrects): equal keys,
        equal quantities (a replayed decode step reads the ones it was captured with)."""
        active = [state.correction is not None and state.moments is not None for state in states]
        if not any(active):
            return None
        return tuple(
            (id(state.moments), state.moments.version, id(state.correction)) if on else None
            for state, on in zip(states, active, strict=True)
        )

    def built(self, states: list[RowState]) -> tuple[bool, PreparedMoments | None]:
        """``(True, what get() returns)`` when it is built for ``states`` already (or nothing corrects),
        ``(False, None)`` when get() would build it: no torch op."""
        key = self.key(states)
        if key is None:
            return True, None
        if self._memo is not None and self._memo[0] == key:
            return True, self._memo[1]
        return False, None

    def get(self, states: list[RowState], heads: int, head_dim: int, device) -> PreparedMoments | None:
        """:class:`PreparedMoments` over ``states`` (None: nothing to correct)."""
        key = self.key(states)
        if key is None:
            return None
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]
        active = [entry is not None for entry in key]
        pairs = list(zip(states, active, strict=True))
        # orders and tau on the host (PreparedMoments checks them there and copies them once); a
        # layer whose rows correct no head is not corrected, decided without reading the device (a
        # corrected head with nothing evicted merges with weight exactly 1: its own output)
        orders = np.concatenate(
            [_host_row(state.correction[0]) if on else np.full(heads, -1) for state, on in pairs]
        )  # [S]
        tau = np.concatenate(
            [_host_row(state.correction[1], heads) if on else np.zeros(heads, np.float32) for state, on in pairs]
        )  # [S]
        if not (orders >= 0).any():
            self._memo = (key, None)
            return None
        sums = MomentSums.concatenate([state.moments if on else None for state, on in pairs], heads, head_dim, device)
        prepared = PreparedMoments(sums, orders, tau)
        if self._memo is not None and self._memo[1] is not None and _same_rows(self._memo[0], key):
            # the same rows' sums grew (a decode-time eviction round): into the tensors a captured step reads
            self._memo[1].refill(prepared)
            prepared = self._memo[1]
        self._memo = (key, prepared)
        return prepared


def _same_rows(old: tuple, new: tuple) -> bool:
    """Whether two :meth:`PreparedCorrection.key` keys name the same rows' sums and corrections (of
    any version)."""
    return len(old) == len(new) and all(
        (a is None and b is None) or (a is not None and b is not None and (a[0], a[2]) == (b[0], b[2]))
        for a, b in zip(old, new, strict=True)
    )


def _host_row(values, heads: int | None = None) -> np.ndarray:
    """One row's correction ``orders`` (its own dtype) or, with ``heads``, ``tau`` (float32, a
    scalar broadcast to ``[Hkv]``) as numpy (a device tensor is read back: only when a correction
    was given on the device, once per change of the sums)."""
    if isinstance(values, torch.Tensor):
        values = (values if values.device.type == "cpu" else values.cpu()).detach().numpy()
    if heads is None:
        return np.asarray(values).reshape(-1)
    return np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype=np.float32).reshape(-1), (heads,)))


class DueEviction(NamedTuple):
    """One :meth:`DecodeEvictionHook.evict_decoded` call."""

    hook: DecodeEvictionHook
    rows: list[int]
    budgets: torch.Tensor  # int64 [R, Hkv]: the budget where a head is due, else its length
    next_positions: list[int]
    stats_rows: list[int]


def due_evictions(states: list[RowState], lengths, layer_idx: int) -> list[DueEviction]:
    """The hook calls decoding owes layer ``layer_idx`` whose live tokens are ``lengths`` int64
    ``[B, Hkv]`` (host: the store's numpy mirror or a CPU tensor): one per hook whose rows hold a head
    ``every`` tokens past its budget.  Decided on the host, in numpy: a decode step with nothing due
    runs no torch op here."""
    lengths = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths, dtype=np.int64)
    groups: dict[int, list[int]] = {}
    for b, state in enumerate(states):
        if state.decode_plan is not None:
            groups.setdefault(id(state.decode_plan.hook), []).append(b)
    due = []
    for rows in groups.values():
        plans = [states[b].decode_plan for b in rows]
        budgets = np.stack([np.asarray(plan.budgets[layer_idx], dtype=np.int64) for plan in plans])
        held = lengths[rows]
        over = held - budgets >= np.array([plan.every for plan in plans], dtype=np.int64)[:, None]
        if not over.any():
            continue
        due.append(
            DueEviction(
                plans[0].hook,
                rows,
                torch.from_numpy(np.where(over, budgets, held)),
                [states[b].real_seen for b in rows],
                [plan.stats_row for plan in plans],
            )
        )
    return due
