"""Pre-RoPE query statistics per (layer, query head): running float64 sums, mean, covariance.

Expected Attention (seed 000; DESIGN.md section 1) needs, per query head, the mean and the
covariance of the queries *before* RoPE (after the query norm where the model has one, e.g.
Qwen3).  They are collected with forward hooks on ``q_proj`` (or ``q_norm``) and kept as sums

    n,    s = sum q  [d],    S = sum q q^T  [d, d]          (float64)

so that shards (processes, resumed runs) combine by addition.  At the end

    mean = s / n,      cov = S / n - mean mean^T            (population covariance)

The first ``n_sink`` positions of every sample are skipped: attention-sink tokens have
atypical queries that would dominate the statistics.  Samples in a batch must all start at
position 0 and have no padding (calibration windows are fixed-length token runs).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from runtime.geometry import ModelGeometry


class QueryStatsAccumulator:
    """Float64 sums ``n [L, Hq]``, ``total [L, Hq, d]``, ``outer [L, Hq, d, d]``.

    Each layer's sums live on the device of that layer's queries (no host synchronisation per
    forward pass); :meth:`state` copies them out.  Additions happen in call order whatever the
    checkpointing, so a resumed run reproduces an uninterrupted one bit for bit.
    """

    def __init__(self, num_layers: int, num_q_heads: int, head_dim: int):
        self.shape = (num_layers, num_q_heads, head_dim)
        self.n = np.zeros((num_layers, num_q_heads), dtype=np.int64)
        self._total = [torch.zeros(num_q_heads, head_dim, dtype=torch.float64) for _ in range(num_layers)]
        self._outer = [torch.zeros(num_q_heads, head_dim, head_dim, dtype=torch.float64) for _ in range(num_layers)]

    def add(self, layer: int, queries: torch.Tensor | np.ndarray) -> None:
        """Add queries ``[N, Hq, d]`` of one layer (any float dtype; summed in float64)."""
        q = torch.as_tensor(queries).detach().to(torch.float64)
        _, heads, dim = self.shape
        if q.ndim != 3 or q.shape[1:] != (heads, dim):
            raise ValueError(f"queries must be [N, {heads}, {dim}], got {tuple(q.shape)}")
        if self._total[layer].device != q.device:
            self._total[layer] = self._total[layer].to(q.device)
            self._outer[layer] = self._outer[layer].to(q.device)
        per_head = q.transpose(0, 1)  # [Hq, N, d]
        self.n[layer] += q.shape[0]
        self._total[layer] += per_head.sum(dim=1)
        self._outer[layer] += torch.bmm(per_head.transpose(1, 2), per_head)  # [Hq, d, d]

    def reset(self) -> None:
        """Zero all sums in place (tensors stay on their devices)."""
        self.n[...] = 0
        for layer in range(self.shape[0]):
            self._total[layer].zero_()
            self._outer[layer].zero_()

    @property
    def total(self) -> np.ndarray:
        return np.stack([t.cpu().numpy() for t in self._total])  # [L, Hq, d]

    @property
    def outer(self) -> np.ndarray:
        return np.stack([t.cpu().numpy() for t in self._outer])  # [L, Hq, d, d]

    def merge(self, other: "QueryStatsAccumulator") -> "QueryStatsAccumulator":
        """Add another shard's sums into this one (in place) and return self."""
        if other.shape != self.shape:
            raise ValueError(f"cannot merge query statistics of shape {other.shape} into {self.shape}")
        self.n += other.n
        for layer in range(self.shape[0]):
            self._total[layer] += other._total[layer].to(self._total[layer].device)
            self._outer[layer] += other._outer[layer].to(self._outer[layer].device)
        return self

    def finalize(self) -> dict[str, np.ndarray]:
        """``n`` int64 ``[L, Hq]``, ``mean`` float32 ``[L, Hq, d]``, ``cov`` float32 ``[L, Hq, d, d]``."""
        if np.any(self.n <= 0):
            raise ValueError("no queries were accumulated for some heads (calibration text too short "
                             "for n_sink, or no samples)")
        count = self.n.astype(np.float64)
        mean = self.total / count[..., None]
        cov = self.outer / count[..., None, None] - mean[..., :, None] * mean[..., None, :]
        cov = 0.5 * (cov + np.swapaxes(cov, -1, -2))  # exact symmetry despite rounding
        return {"n": self.n.copy(), "mean": mean.astype(np.float32), "cov": cov.astype(np.float32)}

    def state(self) -> dict[str, np.ndarray]:
        """The raw sums as numpy arrays (for checkpoints and cross-process reduction)."""
        return {"n": self.n.copy(), "total": self.total, "outer": self.outer}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "QueryStatsAccumulator":
        layers, heads, dim = state["total"].shape
        acc = cls(layers, heads, dim)
        acc.n[...] = state["n"]
        acc._total = [torch.from_numpy(np.array(state["total"][l], dtype=np.float64)) for l in range(layers)]
        acc._outer = [torch.from_numpy(np.array(state["outer"][l], dtype=np.float64)) for l in range(layers)]
        return acc


@contextmanager
def collect_queries(geometry: ModelGeometry, accumulator: QueryStatsAccumulator, n_sink: int):
    """Forward hooks that add every forward pass's pre-RoPE queries (minus sink positions) to
    ``accumulator``.  Inputs must be ``[B, T]`` windows starting at position 0 without padding."""
    if n_sink < 0:
        raise ValueError(f"n_sink must be >= 0, got {n_sink}")
    heads, dim = geometry.num_q_heads, geometry.head_dim

    def make_hook(layer: int):
        def hook(_module, _inputs, output):
            batch, length = output.shape[0], output.shape[1]
            queries = output.reshape(batch, length, heads, dim)[:, n_sink:]  # [B, T - n_sink, Hq, d]
            if queries.shape[1]:
                accumulator.add(layer, queries.reshape(-1, heads, dim))
        return hook

    handles = [module.register_forward_hook(make_hook(layer))
               for layer, module in enumerate(geometry.query_modules)]
    try:
        yield accumulator
    finally:
        for handle in handles:
            handle.remove()
