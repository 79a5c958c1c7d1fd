"""Pre-RoPE query moments per (layer, query head): running float64 sums, mean, covariance.

Expected Attention (Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution, arXiv 2510.00636) scores keys with the mean and covariance of the
queries *before* RoPE (after the query norm where the model has one, e.g. Qwen3).  They are
collected with forward hooks on each layer's query module (``ModelGeometry.query_modules``,
read through ``ModelGeometry.pre_rope_queries``: ``q_proj``'s output after the query norm, or
the query slice of a fused ``qkv_proj``) and kept as sums

    n,    s = sum q  [d],    S = sum q q^T  [d, d]          (float64)

so that shards (processes, resumed runs, prefill blocks) combine by addition.  Then

    mean = s / n,      cov = S / n - mean mean^T            (population covariance)

One class, :class:`QueryMoments`, in two forms:

* **batch-summed** (``rows=None``; the profiler's calibration statistics): every forward
  pass's queries of all batch rows go into one set of sums per layer, after skipping the
  first ``n_sink`` positions of every row (attention-sink tokens have atypical queries).
  Each addition forms ``sum q`` and ``q^T q`` (one ``bmm`` per layer) in float64, on the
  device of that layer's queries; :meth:`finalize` gives the artifact's ``n``, ``mean``,
  ``cov``; :meth:`state` / :meth:`from_state` / :meth:`merge` / :meth:`reset` serve
  checkpoints and cross-process reduction.
* **per row** (``rows=B``; a prompt's own statistics in the runtime): one set of sums per
  batch row, over that row's real tokens only (a bool mask per chunk leaves out padding and
  the sink positions); each addition is formed in float32 on the CPU and then added to the
  float64 sums (``product_dtype=torch.float32, device="cpu"``, see :meth:`for_prompt`);
  :meth:`mean_cov` gives one row's mean and covariance.

Within one instance additions happen in call order (per layer, per forward pass), so a
resumed run reproduces an uninterrupted one bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from runtime.kv_store.shared_scope import this_thread_only
from runtime.math.geometry import ModelGeometry


class QueryMoments:
    """Float64 sums ``n``, ``total`` (``sum q``), ``outer`` (``sum q q^T``) per (layer, query head).

    Shapes: ``n [L, Hq]``, ``total [L, Hq, d]``, ``outer [L, Hq, d, d]``, with a leading batch
    row axis ``[B, ...]`` when ``rows=B`` (see the module docstring).  ``product_dtype`` is the
    dtype in which each addition's sum and outer products are formed before they are added
    to the float64 sums; ``device`` is where the sums live (None: each layer's sums follow the
    device of that layer's queries).
    """

    def __init__(
        self,
        num_layers: int,
        num_q_heads: int,
        head_dim: int,
        rows: int | None = None,
        *,
        product_dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ):
        if rows is not None and rows <= 0:
            raise ValueError(f"rows must be a positive batch size or None (batch-summed), got {rows}")
        self.shape = (num_layers, num_q_heads, head_dim)
        self.rows = rows
        self.product_dtype = product_dtype
        self.device = device
        lead = () if rows is None else (rows,)
        self.n = np.zeros((*lead, num_layers, num_q_heads), dtype=np.int64)
        self._total = [
            torch.zeros(*lead, num_q_heads, head_dim, dtype=torch.float64, device=device) for _ in range(num_layers)
        ]
        self._outer = [
            torch.zeros(*lead, num_q_heads, head_dim, head_dim, dtype=torch.float64, device=device)
            for _ in range(num_layers)
        ]

    @classmethod
    def for_model(cls, model, rows: int | None = None, **options) -> QueryMoments:
        """Sums shaped for ``model`` (or its :class:`~runtime.math.geometry.ModelGeometry`)."""
        geometry = ModelGeometry.of(model)
        return cls(geometry.num_layers, geometry.num_q_heads, geometry.head_dim, rows, **options)

    @classmethod
    def for_prompt(cls, model, batch_size: int) -> QueryMoments:
        """Per-row sums of a prompt batch: float32 products, float64 sums on the CPU."""
        return cls.for_model(model, batch_size, product_dtype=torch.float32, device="cpu")

    # -- adding ------------------------------------------------------------------------------

    def add(self, layer: int, queries: torch.Tensor | np.ndarray, row: int | None = None) -> None:
        """Add queries ``[N, Hq, d]`` of one layer (any float dtype), to batch row ``row`` when per row."""
        if (row is None) != (self.rows is None):
            raise ValueError("give row= exactly when the sums are kept per row")
        q = torch.as_tensor(queries).detach().to(self.product_dtype)
        if self.device is not None:
            q = q.to(self.device)
        _, heads, dim = self.shape
        if q.ndim != 3 or q.shape[1:] != (heads, dim):
            raise ValueError(f"queries must be [N, {heads}, {dim}], got {tuple(q.shape)}")
        if self._total[layer].device != q.device:
            self._total[layer] = self._total[layer].to(q.device)
            self._outer[layer] = self._outer[layer].to(q.device)
        per_head = q.transpose(0, 1)  # [Hq, N, d]
        total = per_head.sum(dim=1).to(torch.float64)  # [Hq, d]
        outer = torch.bmm(per_head.transpose(1, 2), per_head).to(torch.float64)  # [Hq, d, d]
        if row is None:
            self.n[layer] += q.shape[0]
            self._total[layer] += total
            self._outer[layer] += outer
        else:
            self.n[row, layer] += q.shape[0]
            self._total[layer][row] += total
            self._outer[layer][row] += outer

    @contextmanager
    def collect(self, geometry, *, n_sink: int = 0, real: torch.Tensor | None = None):
        """Forward hooks on ``geometry.query_modules`` that add every forward pass's pre-RoPE queries.

        Batch-summed: inputs are ``[B, T]`` windows starting at position 0 without padding; the
        first ``n_sink`` positions of every row are skipped.  Per row: ``real`` (bool ``[B, T]``
        of the chunk, None = every token) says which tokens count; each row goes to its own sums.
        ``geometry``: a :class:`~runtime.math.geometry.ModelGeometry` (or a model).
        """
        if n_sink < 0:
            raise ValueError(f"n_sink must be >= 0, got {n_sink}")
        if self.rows is None and real is not None:
            raise ValueError("real= selects tokens per row: build the sums with rows=batch_size")
        if self.rows is not None and n_sink:
            raise ValueError("per-row sums leave tokens out through real=, not n_sink")
        geometry = ModelGeometry.of(geometry)
        _, heads, dim = self.shape

        def make_hook(layer: int):
            def hook(_module, _inputs, output):
                queries = geometry.pre_rope_queries(layer, output)  # [B, T, Hq, d]
                if self.rows is None:
                    queries = queries[:, n_sink:]  # [B, T - n_sink, Hq, d]
                    if queries.shape[1]:
                        self.add(layer, queries.reshape(-1, heads, dim))
                    return
                for b in range(queries.shape[0]):
                    self.add(layer, queries[b] if real is None else queries[b][real[b]], row=b)

            return hook

        handles = [
            module.register_forward_hook(this_thread_only(make_hook(layer)))
            for layer, module in enumerate(geometry.query_modules)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    # -- sums --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Zero all sums in place (tensors stay on their devices)."""
        self.n[...] = 0
        for layer in range(self.shape[0]):
            self._total[layer].zero_()
            self._outer[layer].zero_()

    def _stacked(self, sums: list[torch.Tensor]) -> np.ndarray:
        """Per-layer tensors as one array with the layer axis after the row axis (if any)."""
        return np.stack([t.cpu().numpy() for t in sums], axis=0 if self.rows is None else 1)

    @property
    def total(self) -> np.ndarray:
        """``sum q``: ``[L, Hq, d]`` (per row: ``[B, L, Hq, d]``)."""
        return self._stacked(self._total)

    @property
    def outer(self) -> np.ndarray:
        """``sum q q^T``: ``[L, Hq, d, d]`` (per row: ``[B, L, Hq, d, d]``)."""
        return self._stacked(self._outer)

    def merge(self, other: QueryMoments) -> QueryMoments:
        """Add another shard's sums into this one (in place) and return self."""
        if other.shape != self.shape or other.rows != self.rows:
            raise ValueError(
                f"cannot merge query moments of shape {other.shape} (rows {other.rows}) into "
                f"{self.shape} (rows {self.rows})"
            )
        self.n += other.n
        for layer in range(self.shape[0]):
            self._total[layer] += other._total[layer].to(self._total[layer].device)
            self._outer[layer] += other._outer[layer].to(self._outer[layer].device)
        return self

    def state(self) -> dict[str, np.ndarray]:
        """The raw sums ``n``, ``total``, ``outer`` as numpy arrays (checkpoints, cross-process reduction)."""
        return {"n": self.n.copy(), "total": self.total, "outer": self.outer}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], **options) -> QueryMoments:
        """Sums from :meth:`state` (per row when ``n`` has a row axis); ``options`` as in the constructor."""
        per_row = np.ndim(state["n"]) == 3
        *lead, layers, heads, dim = np.shape(state["total"])
        moments = cls(layers, heads, dim, lead[0] if per_row else None, **options)
        moments.n[...] = state["n"]
        take = (lambda a, layer: a[:, layer]) if per_row else (lambda a, layer: a[layer])  # noqa: E731
        moments._total = [
            torch.from_numpy(np.array(take(state["total"], layer), dtype=np.float64)).to(moments._total[layer].device)
            for layer in range(layers)
        ]
        moments._outer = [
            torch.from_numpy(np.array(take(state["outer"], layer), dtype=np.float64)).to(moments._outer[layer].device)
            for layer in range(layers)
        ]
        return moments

    # -- statistics ------------------------------------------------------------------------

    def finalize(self) -> dict[str, np.ndarray]:
        """Batch-summed: ``n`` int64 ``[L, Hq]``, ``mean`` float32 ``[L, Hq, d]``, ``cov`` float32
        ``[L, Hq, d, d]`` (the artifact's ``query_stats`` section)."""
        if self.rows is not None:
            raise ValueError("finalize() is for batch-summed moments; per-row moments give mean_cov(row)")
        if np.any(self.n <= 0):
            raise ValueError(
                "no queries were accumulated for some heads (calibration text too short for n_sink, or no samples)"
            )
        count = self.n.astype(np.float64)
        mean = self.total / count[..., None]
        cov = self.outer / count[..., None, None] - mean[..., :, None] * mean[..., None, :]
        cov = 0.5 * (cov + np.swapaxes(cov, -1, -2))  # exact symmetry despite rounding
        return {"n": self.n.copy(), "mean": mean.astype(np.float32), "cov": cov.astype(np.float32)}

    def mean_cov(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: population mean ``[L, Hq, d]`` and covariance ``[L, Hq, d, d]`` of row ``row`` (float64)."""
        if self.rows is None:
            raise ValueError("mean_cov(row) is for per-row moments; batch-summed moments give finalize()")
        counts = self.n[row]
        n = int(counts.flat[0])
        if n == 0:
            raise ValueError(f"no prompt queries were recorded for batch element {row}")
        if np.any(counts != n):
            raise RuntimeError(f"batch element {row}: layers recorded different numbers of queries")
        total = torch.stack([t[row] for t in self._total]).cpu()  # [L, Hq, d]
        outer = torch.stack([t[row] for t in self._outer]).cpu()  # [L, Hq, d, d]
        mean = total / n
        cov = outer / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)
        return mean, cov
