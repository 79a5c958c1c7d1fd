"""MomentKV ("MomentKV: Closing the Directional Gap in KV Cache Eviction for Long-Context
Inference"; docs/design.md section 4): moments of the evicted set, corrected attention,
moment-informed eviction.  Pure torch, no model and no cache in here.

Notation: one KV head, head dim ``d``, scale ``s`` (``1/sqrt(d)`` for Llama), a query ``q``
(post-RoPE), retained tokens ``R`` and evicted tokens ``E``.

**Moment sums** (:class:`MomentSums`, per layer, one slot per KV head, float32, ``O(d^2)``
per head whatever the context length), over every token ever evicted from the head::

    n,   s_k = sum_E k_i [d],   s_v = sum_E v_i [d],   S_vk = sum_E v_i k_i^T [d, d]
    kbar = s_k / n,   vbar = s_v / n,   C_vk = S_vk / n - vbar kbar^T

**Evicted-set estimate** (seed Eq. 8, 9, 11; :func:`evicted_estimate`).  With centered
logits ``l_i = s q.(k_i - kbar)`` (they sum to zero over ``E``), ``exp(l) ~= 1 + l`` gives::

    o_E(q)     ~= vbar                  (order 0)
    o_E(q)     ~= vbar + s C_vk q       (order 1)
    log Z_E(q) ~= log n + s q.kbar      (Jensen lower bound of log sum_E exp(s q.k_i))

Optionally entries with ``|C_vk| < tau`` are zeroed (seed App. C.2).

**Merge** (seed Eq. 3, 12; :func:`corrected_attention`).  With ``o_R, lse_R`` the output and
log-sum-exp of ordinary attention over the retained tokens (:func:`attention_with_lse`)::

    w = sigmoid(lse_R - lse_E)          (= Z_R / (Z_R + Z_E))
    o = w o_R + (1 - w) o_E

Order ``-1`` (none) or an empty evicted set gives plain attention over ``R`` exactly.
For a serving runtime, :func:`evicted_estimates` computes the estimate for all KV heads of
a layer at once (per-head orders and ``tau`` from the artifact) and :func:`merge_outputs`
merges it with per-head ``(o_R, lse_R)`` in one step.

**Moment-informed eviction** (seed Eq. 10; :func:`moment_scores`, :func:`evict_in_rounds`).
For a retained token ``j`` with attention estimate ``a_j`` (from any scorer that yields one)::

    r_j = v_j - (vbar + s C_vk k_j),     score_j = a_j ||r_j||      (lowest evicted first)

With empty moments ``r_j = v_j``, so the score is ``a_j ||v_j||``.  In bulk the eviction
runs in a few rounds, folding each round's evicted tokens into the sums before re-scoring.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from runtime.math.arrays import to_device
from runtime.math.sinks import sink_weight

ORDER_NONE = -1
ORDERS = (ORDER_NONE, 0, 1)  # the artifact's ``moments/order`` codes; errors[:, i] is ORDERS[i]


def _check_order(order: int) -> int:
    if order not in ORDERS:
        raise ValueError(f"moment correction order must be one of {ORDERS} (-1 = none), got {order!r}")
    return int(order)


class MomentSums:
    """Running moments of the evicted tokens of one layer's KV heads (float32).

    ``n [Hkv]`` (int64 counts), ``s_k [Hkv, d]``, ``s_v [Hkv, dv]``, ``S_vk [Hkv, dv, d]``: ``dv`` the values'
    head dim, ``value_dim`` (``d`` but where a model's values are narrower than its keys: MiMo-V2-Flash).
    Keep one instance per (batch element, layer).
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str | None = None,
        value_dim: int | None = None,
    ):
        value_dim = head_dim if value_dim is None else value_dim
        if num_kv_heads <= 0 or head_dim <= 0 or value_dim <= 0:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}), head_dim ({head_dim}) and value_dim ({value_dim}) must be positive"
            )
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim, self.value_dim = int(head_dim), int(value_dim)
        self.n = torch.zeros(num_kv_heads, dtype=torch.int64, device=device)  # [Hkv]
        self.s_k = torch.zeros(num_kv_heads, head_dim, dtype=torch.float32, device=device)  # [Hkv, d]
        self.s_v = torch.zeros(num_kv_heads, value_dim, dtype=torch.float32, device=device)  # [Hkv, dv]
        self.S_vk = torch.zeros(num_kv_heads, value_dim, head_dim, dtype=torch.float32, device=device)  # [Hkv, dv, d]
        self.version = 0  # bumped by every add(): derived quantities can be cached against it

    def _check_head(self, head: int) -> int:
        if not 0 <= head < self.num_kv_heads:
            raise IndexError(f"KV head {head} out of range for {self.num_kv_heads} heads")
        return int(head)

    def add(self, head: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fold evicted tokens ``keys [m, d]``, ``values [m, dv]`` of ``head`` into the sums in place."""
        head = self._check_head(head)
        if (
            keys.dim() != 2
            or values.dim() != 2
            or keys.shape[0] != values.shape[0]
            or (keys.shape[1], values.shape[1]) != (self.head_dim, self.value_dim)
        ):
            raise ValueError(
                f"add expects keys [m, {self.head_dim}] and values [m, {self.value_dim}], got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.shape[0] == 0:
            return
        k = keys.to(self.s_k.device, torch.float32)
        v = values.to(self.s_k.device, torch.float32)
        self.version += 1
        self.n[head] += k.shape[0]
        self.s_k[head] += k.sum(0)
        self.s_v[head] += v.sum(0)
        self.S_vk[head] += v.T @ k  # sum_i v_i k_i^T  [dv, d]

    def count(self, head: int) -> int:
        return int(self.n[self._check_head(head)])

    def mean_key(self, head: int) -> torch.Tensor:
        """``kbar [d]`` (zeros when nothing was evicted)."""
        head = self._check_head(head)
        return self.s_k[head] / max(int(self.n[head]), 1)

    def mean_value(self, head: int) -> torch.Tensor:
        """``vbar [dv]`` (zeros when nothing was evicted)."""
        head = self._check_head(head)
        return self.s_v[head] / max(int(self.n[head]), 1)

    def cross_cov(self, head: int, tau: float = 0.0) -> torch.Tensor:
        """``C_vk = S_vk/n - vbar kbar^T [dv, d]``; entries with ``|C_vk| < tau`` zeroed."""
        head = self._check_head(head)
        n = int(self.n[head])
        if n == 0:
            return torch.zeros_like(self.S_vk[head])
        cov = self.S_vk[head] / n - torch.outer(self.mean_value(head), self.mean_key(head))
        if tau < 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        if tau > 0:
            cov = torch.where(cov.abs() < tau, torch.zeros_like(cov), cov)
        return cov

    def copy(self) -> MomentSums:
        other = MomentSums.__new__(MomentSums)
        other.num_kv_heads, other.head_dim, other.version = self.num_kv_heads, self.head_dim, self.version
        other.value_dim = self.value_dim
        other.n, other.s_k, other.s_v, other.S_vk = (t.clone() for t in (self.n, self.s_k, self.s_v, self.S_vk))
        return other

    @classmethod
    def concatenate(
        cls, parts: list[MomentSums | None], num_kv_heads: int, head_dim: int, device=None, value_dim: int | None = None
    ) -> MomentSums:
        """One set of sums whose heads are ``parts``' heads in order (``None``: ``num_kv_heads``
        empty heads): a whole layer's batch rows as one ``[B * Hkv]`` set, so that
        :class:`PreparedMoments` corrects every row and head in one batched computation."""
        joined = cls.__new__(cls)
        joined.num_kv_heads, joined.head_dim = num_kv_heads * len(parts), head_dim
        joined.value_dim = head_dim if value_dim is None else value_dim
        joined.version = 0
        empty = cls(num_kv_heads, head_dim, device, joined.value_dim) if any(part is None for part in parts) else None
        filled = [empty if part is None else part for part in parts]
        joined.n = torch.cat([part.n for part in filled])
        joined.s_k = torch.cat([part.s_k for part in filled])
        joined.s_v = torch.cat([part.s_v for part in filled])
        joined.S_vk = torch.cat([part.S_vk for part in filled])
        return joined

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.n, self.s_k, self.s_v, self.S_vk))


def _kernel_applies(query: torch.Tensor, keys: torch.Tensor, mask, values: torch.Tensor) -> bool:
    return (
        mask is None
        and values.shape[-1] == keys.shape[-1]  # the kernel takes one head size
        and query.device.type == "cpu"
        and keys.shape[0] > 0
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def attention_with_lse(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
    use_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [G, q, d]`` over ``keys/values [n, d]`` with its log-sum-exp.

    Returns ``out [G, q, d]`` (query dtype) and ``lse [G, q]`` (float32, natural log of
    ``sum_i exp(s q.k_i)`` over the allowed keys).  ``mask``: broadcastable to ``[G, q, n]``,
    bool (True = may attend) or additive float.  A row with no allowed key gets ``out = 0``
    and ``lse = -inf``.  Without a mask, on CPU, it runs
    ``aten._scaled_dot_product_flash_attention_for_cpu`` (returns ``(output, logsumexp)``);
    otherwise (or with ``use_kernel=False``) matmul-softmax-matmul in float32.
    """
    if (
        query.dim() != 3
        or keys.dim() != 2
        or values.dim() != 2
        or keys.shape[0] != values.shape[0]
        or query.shape[-1] != keys.shape[-1]
    ):
        raise ValueError(
            f"attention_with_lse expects query [G, q, d], keys [n, d] and values [n, dv], got "
            f"{tuple(query.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    groups, q_len, dim = query.shape
    n = keys.shape[0]
    if use_kernel is None:
        use_kernel = _kernel_applies(query, keys, mask, values)
    elif use_kernel and not _kernel_applies(query, keys, mask, values):
        raise ValueError(
            "the CPU flash-attention kernel needs a CPU float query, no mask, at least one key and values of the "
            "keys' head dim"
        )
    if n == 0:
        return (
            query.new_zeros(groups, q_len, values.shape[-1]),
            torch.full((groups, q_len), float("-inf"), dtype=torch.float32, device=query.device),
        )
    if use_kernel:
        # No mask, so every query row is independent: fold the group into the query axis and
        # share one key/value head (no copies of K/V).  The kernel needs contiguous inputs
        # (a strided float32 query gives wrong results in torch 2.13).
        q = query.reshape(1, 1, groups * q_len, dim).contiguous()  # [1, 1, G*q, d]
        k = keys.to(query.dtype).reshape(1, 1, n, dim).contiguous()  # [1, 1, n, d]
        v = values.to(query.dtype).reshape(1, 1, n, dim).contiguous()
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=float(scaling))
        return out.reshape(groups, q_len, dim), lse.reshape(groups, q_len).float()
    logits = float(scaling) * torch.matmul(query.float(), keys.float().T)  # [G, q, n]
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            logits = logits + mask.float()
    lse = torch.logsumexp(logits, dim=-1)  # [G, q]
    finite = torch.isfinite(lse)
    weights = torch.exp(logits - torch.where(finite, lse, torch.zeros_like(lse)).unsqueeze(-1))  # [G, q, n]
    out = torch.matmul(weights, values.float())  # [G, q, d]
    return out.to(query.dtype), lse


def evicted_estimate(
    query: torch.Tensor, sums: MomentSums, head: int, scaling: float, order: int, tau: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Moment estimate of the evicted set's attention: ``(o_E [G, q, d], lse_E [G, q])`` float32.

    ``o_E = vbar`` (order 0) or ``vbar + s C_vk q`` (order 1); ``lse_E = log n + s q.kbar``.
    With nothing evicted: ``o_E = 0`` and ``lse_E = -inf`` (the merge then keeps ``o_R``).
    """
    order = _check_order(order)
    if order == ORDER_NONE:
        raise ValueError("evicted_estimate needs order 0 or 1 (order -1 means no correction)")
    q = query.float().to(sums.s_k.device)  # [G, q, d]
    n = sums.count(head)
    if n == 0:
        empty = q.new_zeros(*q.shape[:-1], sums.value_dim)
        return empty, torch.full(q.shape[:-1], float("-inf"), device=q.device)
    kbar, vbar = sums.mean_key(head), sums.mean_value(head)  # [d], [dv]
    lse = math.log(n) + float(scaling) * (q @ kbar)  # [G, q]
    out = vbar.expand(*q.shape[:-1], -1)
    if order == 1:
        out = out + float(scaling) * (q @ sums.cross_cov(head, tau).T)  # (C q) for every query row
    return out.clone(), lse


class PreparedMoments:
    """What :func:`evicted_estimates` needs from a layer's sums, derived once per change.

    ``kbar, vbar [Hkv, d]``, ``cov [Hkv, d, d]`` (``tau``-clamped, zero for heads not of
    order 1), ``log_n [Hkv]``, ``active`` bool ``[Hkv]`` (order >= 0 and something evicted).
    A decoding runtime keeps one per (batch element, layer) and rebuilds it only when the
    sums changed (:attr:`MomentSums.version`), so a decode step costs two small batched matmuls.
    """

    def __init__(self, sums: MomentSums, orders, tau=0.0):
        heads = sums.num_kv_heads
        device = sums.s_k.device
        host_orders, host_tau = _host_values(orders), _host_values(tau, np.float32)
        if host_orders is not None:  # checked on the host, then copied once: no device read
            host_orders = host_orders.reshape(-1)
            if host_orders.shape[0] != heads or not np.isin(host_orders, ORDERS).all():
                raise ValueError(f"orders must be {heads} codes in {ORDERS}, got {host_orders.tolist()}")
            orders = to_device(host_orders, device)
        else:
            orders = torch.as_tensor(orders, device=device).reshape(-1)
            if orders.shape[0] != heads or not bool(torch.isin(orders, torch.tensor(ORDERS, device=device)).all()):
                raise ValueError(f"orders must be {heads} codes in {ORDERS}, got {orders.tolist()}")
        if host_tau is not None:
            host_tau = np.ascontiguousarray(np.broadcast_to(host_tau, (heads,)))
            if (host_tau < 0).any():
                raise ValueError(f"tau must be >= 0, got {host_tau.tolist()}")
            tau = to_device(host_tau, device)  # [Hkv]
        else:
            tau = torch.as_tensor(tau, dtype=torch.float32, device=device).expand(heads)  # [Hkv]
            if bool((tau < 0).any()):
                raise ValueError(f"tau must be >= 0, got {tau.tolist()}")
        count = sums.n.float()  # [Hkv]
        safe = count.clamp_min(1)
        self.version = sums.version
        self.num_kv_heads, self.head_dim, self.value_dim = heads, sums.head_dim, sums.value_dim
        self.active = (orders >= 0) & (count > 0)  # [Hkv]
        live = self.active.float()
        kbar = sums.s_k / safe[:, None] * live[:, None]  # [Hkv, d], zero where inactive
        self.vbar = sums.s_v / safe[:, None] * live[:, None]  # [Hkv, dv]
        cov = sums.S_vk / safe[:, None, None] - self.vbar[:, :, None] * kbar[:, None, :]  # [Hkv, dv, d]
        cov = torch.where(cov.abs() < tau[:, None, None], torch.zeros_like(cov), cov)
        cov = cov * (self.active & (orders == 1)).float()[:, None, None]
        # one matmul gives both C q (first dv columns) and q.kbar (last column)
        self.projection = torch.cat([cov, kbar[:, None, :]], dim=1).transpose(1, 2).contiguous()  # [Hkv, d, dv+1]
        self.log_n = torch.where(self.active, torch.log(safe), torch.full_like(safe, float("-inf")))  # [Hkv]
        # what the matmul's result is added to: vbar (first dv columns) and log n (last column)
        self.offset = torch.cat([self.vbar, self.log_n[:, None]], dim=1).unsqueeze(1)  # [Hkv, 1, dv+1]

    def refill(self, other: PreparedMoments) -> None:
        """Take ``other``'s quantities (the same heads and head dim) into this one's tensors, in place:
        a decode step captured as a graph reads these tensors (:mod:`runtime.serve.decode_graph`)."""
        for name in ("active", "vbar", "projection", "log_n", "offset"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype or mine.device != theirs.device:
                raise ValueError(f"cannot refill {name} {tuple(mine.shape)} from {tuple(theirs.shape)}")
            mine.copy_(theirs)
        self.version = other.version

    @property
    def any_active(self) -> bool:
        """Whether any head is corrected (a read of the device: not for a decode step)."""
        return bool(self.active.any())

    def estimates(self, query: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``o_E [Hkv, ..., d]`` and ``lse_E [Hkv, ...]`` (float32) for ``query [Hkv, ..., d]``: ``[Hkv,
        G, q, d]``, or the same flat, ``[Hkv, G*q, d]`` (a decode step's layout: no reshape).

        Inactive heads get ``o_E = 0`` and ``lse_E = -inf``.
        """
        heads, dim = query.shape[0], query.shape[-1]
        if query.dim() < 3 or heads != self.num_kv_heads or dim != self.head_dim:
            raise ValueError(
                f"query [Hkv, ..., d] = {tuple(query.shape)} does not match the sums' "
                f"{self.num_kv_heads} heads of dim {self.head_dim}"
            )
        q = query.float()
        if q.device != self.projection.device:  # a decode step's query is on the sums' device already
            q = q.to(self.projection.device)
        flat = q if q.dim() == 3 else q.reshape(heads, -1, dim)  # [Hkv, G*q, d]
        # [vbar, log n] + s q [C, kbar]: o_E in the first dv columns, lse_E in the last  [Hkv, G*q, dv+1]
        estimate = torch.baddbmm(self.offset, flat, self.projection, alpha=float(scaling))
        out_E, lse_E = estimate[..., : self.value_dim], estimate[..., self.value_dim]
        if q.dim() == 3:
            return out_E, lse_E
        return out_E.view(*query.shape[:-1], self.value_dim), lse_E.view(query.shape[:-1])

    def corrected(self, query: torch.Tensor, out_R: torch.Tensor, lse_R: torch.Tensor, scaling: float) -> torch.Tensor:
        """Merged output ``[Hkv, G, q, d]`` float32 from the retained ``out_R [Hkv, G, q, d]`` and
        ``lse_R [Hkv, G, q]`` (finite: the retained set is never empty while decoding)."""
        out_E, lse_E = self.estimates(query, scaling)
        weight = torch.sigmoid(lse_R.float() - lse_E).unsqueeze(-1)  # 1 exactly where lse_E = -inf
        return out_E + weight * (out_R.float() - out_E)


def _host_values(values, dtype=None) -> np.ndarray | None:
    """A numpy copy of host ``values`` (a number, list, array or CPU tensor) as ``dtype`` (None: its
    own); None for a tensor on another device."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            return None
        values = values.detach().numpy()
    return np.array(values, dtype=dtype)


def evicted_estimates(
    query: torch.Tensor, sums: MomentSums, scaling: float, orders, tau=0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`evicted_estimate` for all KV heads of a layer at once (no per-head Python loop).

    ``query [Hkv, G, q, d]``; ``orders``: per-head codes ``[Hkv]`` in {-1, 0, 1}; ``tau``: a
    float or ``[Hkv]``.  Returns ``o_E [Hkv, G, q, d]`` and ``lse_E [Hkv, G, q]`` (float32);
    heads with order -1 or nothing evicted get ``o_E = 0``, ``lse_E = -inf``, so
    :func:`merge_outputs` returns their retained output unchanged.
    """
    return PreparedMoments(sums, orders, tau).estimates(query, scaling)


def merge_outputs(out_R: torch.Tensor, lse_R: torch.Tensor, out_E: torch.Tensor, lse_E: torch.Tensor) -> torch.Tensor:
    """``w o_R + (1 - w) o_E`` with ``w = sigmoid(lse_R - lse_E)``: outputs ``[..., q, d]``, lse ``[..., q]``; float32.

    ``lse_E = -inf`` gives ``o_R`` exactly, ``lse_R = -inf`` gives ``o_E``.
    """
    both_empty = torch.isinf(lse_R) & torch.isinf(lse_E) & (lse_R < 0) & (lse_E < 0)
    weight = torch.sigmoid(lse_R - lse_E)  # [G, q]
    weight = torch.where(both_empty, torch.ones_like(weight), weight).unsqueeze(-1)
    return weight * out_R.float() + (1 - weight) * out_E.float()


def corrected_attention(
    query: torch.Tensor,
    keys_R: torch.Tensor,
    values_R: torch.Tensor,
    sums: MomentSums,
    head: int,
    scaling: float,
    order: int,
    tau: float = 0.0,
    mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalization-corrected attention of ``query [G, q, d]`` (one KV head's query group).

    ``keys_R/values_R [n_R, d]`` are the retained tokens (``mask`` as in
    :func:`attention_with_lse`, over them).  Order -1, or an empty evicted set, returns
    plain attention over the retained tokens exactly.  ``sinks [G]``: the query heads' learned
    attention sinks (:mod:`runtime.math.sinks`: their ``e^s`` joins ``Z_R + Z_E``).  Output ``[G, q, d]``
    in query dtype.
    """
    order = _check_order(order)
    out_R, lse_R = attention_with_lse(query, keys_R, values_R, scaling, mask)
    if order == ORDER_NONE or sums.count(head) == 0:
        out, lse = out_R, lse_R
    else:
        out_E, lse_E = evicted_estimate(query, sums, head, scaling, order, tau)
        lse_R = lse_R.to(out_E.device)
        out = merge_outputs(out_R, lse_R, out_E, lse_E)
        lse = torch.logaddexp(lse_R.float(), lse_E.float()) if sinks is not None else None
    if sinks is not None:
        out = out.float() * sink_weight(lse, sinks.reshape(-1, 1)).unsqueeze(-1)  # [G, q, d]
    return out.to(query.dtype)


def moment_residuals(
    keys: torch.Tensor, values: torch.Tensor, sums: MomentSums, head: int, scaling: float, tau: float = 0.0
) -> torch.Tensor:
    """``r_j = v_j - (vbar + s C_vk k_j)`` for ``keys/values [n, d]``: ``[n, d]`` float32."""
    k = keys.float().to(sums.s_k.device)
    v = values.float().to(sums.s_k.device)
    prediction = sums.mean_value(head) + float(scaling) * (k @ sums.cross_cov(head, tau).T)  # [n, d]
    return v - prediction


def moment_scores(
    attention: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sums: MomentSums,
    head: int,
    scaling: float,
    tau: float = 0.0,
) -> torch.Tensor:
    """Moment-informed eviction scores ``a_j ||r_j||`` ``[n]`` (higher = keep; lowest evicted first).

    ``attention [n]`` is any scorer's attention estimate of the tokens (e.g. EA's ``a_j``).
    """
    if (
        attention.dim() != 1
        or keys.dim() != 2
        or values.dim() != 2
        or not attention.shape[0] == keys.shape[0] == values.shape[0]
    ):
        raise ValueError(
            f"moment_scores expects attention [n] and keys/values [n, d], got "
            f"{tuple(attention.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    residual = moment_residuals(keys, values, sums, head, scaling, tau)
    return attention.float().to(residual.device) * residual.norm(dim=-1)


def evict_in_rounds(
    attention: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sums: MomentSums,
    head: int,
    scaling: float,
    budget: int,
    rounds: int = 4,
    protected: torch.Tensor | None = None,
    tau: float = 0.0,
) -> torch.Tensor:
    """Evict ``head``'s tokens down to ``budget`` by moment-informed scores, in ``rounds`` rounds.

    Each round evicts an equal share of the remaining excess (the lowest ``a_j ||r_j||``
    among unprotected tokens), folds them into ``sums`` (in place), then re-scores the rest
    against the updated moments.  ``protected [n]`` bool marks tokens never evicted (sinks,
    recent window); the budget is raised to their count if needed.  Returns the kept row
    indices, sorted, int64.
    """
    n = keys.shape[0]
    if attention.shape != (n,) or values.dim() != 2 or values.shape[0] != n:
        raise ValueError(
            f"evict_in_rounds expects attention [n], keys [n, d] and values [n, dv], got "
            f"{tuple(attention.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    if rounds <= 0:
        raise ValueError(f"rounds must be positive, got {rounds}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    device = keys.device
    if protected is None:
        protected = torch.zeros(n, dtype=torch.bool, device=device)
    if protected.shape != (n,) or protected.dtype != torch.bool:
        raise ValueError(f"protected must be bool [{n}], got {protected.dtype} {tuple(protected.shape)}")
    budget = max(int(budget), int(protected.sum()))
    alive = torch.ones(n, dtype=torch.bool, device=device)
    for round_index in range(rounds):
        excess = int(alive.sum()) - budget
        if excess <= 0:
            break
        take = math.ceil(excess / (rounds - round_index))
        rows = torch.nonzero(alive & ~protected).squeeze(1)  # candidates [c]
        scores = moment_scores(attention[rows], keys[rows], values[rows], sums, head, scaling, tau)
        evicted = rows[torch.topk(scores.to(device), take, largest=False, sorted=False).indices]
        sums.add(head, keys[evicted], values[evicted])
        alive[evicted] = False
    return torch.nonzero(alive).squeeze(1)
