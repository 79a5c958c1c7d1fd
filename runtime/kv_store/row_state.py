"""What one cache layer keeps about one batch row besides its tokens.

Per (layer, batch row), one :class:`RowState`:

* ``real_seen``: real tokens fed so far (the next token's RoPE position);
* ``recent_queries [Hq, <=N, d]``: the last ``N`` post-RoPE prompt queries (SnapKV's observation
  window, :meth:`RowState.observe`);
* ``chunk_attention``: Compactor's chunked attention accumulated over the prompt, one
  :class:`~runtime.math.chunk_attention.ChunkAttention` per :class:`~runtime.math.chunk_attention.ChunkSpec`;
* ``moments``: :class:`~runtime.math.momentkv.MomentSums` of every token evicted from each KV head of
  the layer (None: not tracked), grown by :func:`fold_evicted`;
* ``correction``: the MomentKV :class:`Correction` (None: plain attention), turned into the
  layer's batched :class:`~runtime.math.momentkv.PreparedMoments` by :class:`PreparedCorrection`;
* ``decode_plan``: a :class:`runtime.compression.driver.DecodePlan` (None: no eviction while
  decoding), data the eviction driver reads after each layer's attention; it lives here so that
  it follows its row through beams, copies and stacking.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from runtime.math.arrays import to_device
from runtime.math.chunk_attention import ChunkAttention, ChunkSpec
from runtime.math.momentkv import MomentSums, PreparedMoments


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
    decode_plan: object | None = None  # runtime.compression.driver.DecodePlan: data the driver reads

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

    def get(
        self, states: list[RowState], heads: int, head_dim: int, device, value_dim: int | None = None
    ) -> PreparedMoments | None:
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
        parts = [state.moments if on else None for state, on in pairs]
        sums = MomentSums.concatenate(parts, heads, head_dim, device, value_dim)
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
