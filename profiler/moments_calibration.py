"""Calibration of the MomentKV correction (DESIGN.md section 4, "what calibration adds").

Whether the 0th- or 1st-order moment correction helps a head is an empirical property of the
head, so it is measured on calibration text.  For every window ``[T]`` of token ids:

* one forward pass of the model with a capture attention function (switched in with
  ``runtime.attention.attention_implementation``); the function computes the ordinary
  ``sdpa`` output and hands post-RoPE ``query [1, Hq, T, d]`` and un-repeated
  ``key/value [1, Hkv, T, d]`` to a per-call measurer (passed by closure, no module globals);
* the window is split into a *prefix* of ``P = T - W`` tokens (the prompt that gets
  compressed) and the last ``W = query_window`` tokens, whose queries play the role of
  future (decode) queries;
* per KV head the prefix is compressed to ``budget = round(keep_ratio * P)`` tokens: the
  first ``n_sink`` and last ``recent_window`` prefix tokens are always kept, the rest by a
  scorer:

  - ``"snapkv"`` (default): the mean attention of the last ``observation_window`` *prefix*
    queries (causal, averaged over the query heads of the group) - SnapKV's observation
    window, so the evaluated queries are never the ones used for selection;
  - ``"keydiff"``: ``-cos(k_i, mean_j k_j/||k_j||)`` (seed 001), attention-free;

  with ``moment_eviction=True`` the SnapKV attention ``a_j`` is combined with the moment
  residual, ``a_j ||r_j||``, evicting in ``eviction_rounds`` rounds (runtime.moments);
* the evicted tokens are folded into :class:`runtime.moments.MomentSums`; each of the ``W``
  queries (every query head of the group) attends to the retained prefix plus the ``W``
  tokens themselves (causally), with correction order none / 0 / 1
  (:func:`runtime.moments.corrected_attention`), and is compared to full causal attention::

      err = ||o_hat - o|| / ||o||     per (query head, query), averaged over the group's
                                      query heads, the W queries and the windows.

Result (the artifact's ``moments`` section): ``errors float64 [R, 3, L, Hkv]`` (index 0 =
none, 1 = order 0, 2 = order 1), ``order int8 [L, Hkv]`` = argmin over the ratio-averaged
errors, mapped to -1 / 0 / 1 (ties go to none, so ``-1`` when correction does not help),
``reference_ratios float64 [R]`` (the keep ratios), ``tau float64 [L, Hkv]`` (the uniform
clamp used for order 1; 0 = no clamp, the default; not tuned per head).
"""

from __future__ import annotations


import numpy as np
import torch
from tqdm.auto import tqdm

from runtime.attention import attention_implementation
from runtime.geometry import ModelGeometry
from runtime.moments import ORDERS, MomentSums, attention_with_lse, corrected_attention, evict_in_rounds
from runtime.scorers import select_rows

CALIBRATION_ATTENTION = "kvcal_moments_calibration"
SELECTION_SCORERS = ("snapkv", "keydiff")


def snapkv_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Mean causal attention ``[P]`` of the last ``w`` prefix queries ``[G, w, d]`` over ``keys [P, d]``."""
    prefix, w = keys.shape[0], queries.shape[1]
    query_positions = prefix - w + torch.arange(w, device=keys.device)  # [w]
    allowed = torch.arange(prefix, device=keys.device).unsqueeze(0) <= query_positions.unsqueeze(1)  # [w, P]
    logits = (scaling * queries.float() @ keys.float().T).masked_fill(~allowed, float("-inf"))  # [G, w, P]
    return torch.softmax(logits, dim=-1).mean(dim=(0, 1))


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    """KeyDiff ``-cos(k_i, mean_j k_j/||k_j||)`` ``[P]`` (higher = keep)."""
    keys = keys.float()
    anchor = torch.nn.functional.normalize(keys, dim=-1).mean(0)
    return -torch.nn.functional.cosine_similarity(keys, anchor.unsqueeze(0), dim=-1)


def relative_error(estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``||estimate - reference|| / ||reference||`` over the last dim, averaged: a scalar (float64)."""
    diff = (estimate.double() - reference.double()).norm(dim=-1)
    return (diff / reference.double().norm(dim=-1).clamp_min(1e-30)).mean()


class _CorrectionErrorMeasurer:
    """Accumulates the relative errors ``[R, 3, L, Hkv]`` of one or more forward passes."""

    def __init__(self, num_layers, num_kv_heads, head_dim, keep_ratios, query_window, scorer,
                 observation_window, n_sink, recent_window, moment_eviction, eviction_rounds, tau):
        self.keep_ratios = keep_ratios
        self.query_window = query_window
        self.scorer = scorer
        self.observation_window = observation_window
        self.n_sink = n_sink
        self.recent_window = recent_window
        self.moment_eviction = moment_eviction
        self.eviction_rounds = eviction_rounds
        self.tau = tau
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.error_sums = np.zeros((len(keep_ratios), len(ORDERS), num_layers, num_kv_heads))
        self.calls = np.zeros(num_layers, dtype=np.int64)

    def budget(self, prefix: int, ratio: float) -> int:
        return min(prefix, max(int(round(ratio * prefix)), 1))

    def kept_rows(self, head, prefix_queries, keys, values, budget, scaling, sums) -> torch.Tensor:
        """Kept prefix rows (sorted) for one KV head; the evicted ones are folded into ``sums``."""
        prefix = keys.shape[0]
        if self.scorer == "snapkv" or self.moment_eviction:
            attention = snapkv_attention(prefix_queries, keys, scaling)  # [P]
        if self.moment_eviction:
            protected = torch.zeros(prefix, dtype=torch.bool, device=keys.device)
            protected[:self.n_sink] = True
            protected[prefix - self.recent_window:] = True
            return evict_in_rounds(attention, keys, values, sums, head, scaling, budget,
                                   rounds=self.eviction_rounds, protected=protected, tau=self.tau)
        scores = attention if self.scorer == "snapkv" else keydiff_scores(keys)
        kept = select_rows(scores, budget, self.n_sink, self.recent_window)
        evicted = torch.ones(prefix, dtype=torch.bool, device=keys.device)
        evicted[kept] = False
        sums.add(head, keys[evicted], values[evicted])
        return kept

    @torch.no_grad()
    def measure(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> None:
        """One layer of one window: ``query [1, Hq, T, d]``, ``key/value [1, Hkv, T, d]`` (post-RoPE)."""
        _, num_q_heads, total, dim = query.shape
        num_kv_heads = key.shape[1]
        group = num_q_heads // num_kv_heads
        w = self.query_window
        prefix = total - w
        scale = float(scaling) if scaling is not None else dim ** -0.5
        device = query.device
        # causal masks of the W queries: over all T tokens (reference) and over the tail only
        tail_causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()  # [W, W]
        full_mask = torch.cat([torch.ones(w, prefix, dtype=torch.bool, device=device), tail_causal], dim=1)  # [W, T]
        sums = [MomentSums(num_kv_heads, dim, device=device) for _ in self.keep_ratios]
        for head in range(num_kv_heads):
            q = query[0, head * group:(head + 1) * group].float()  # [G, T, d]
            k, v = key[0, head].float(), value[0, head].float()  # [T, d]
            tail_q = q[:, prefix:]  # [G, W, d]
            reference, _ = attention_with_lse(tail_q, k, v, scale, mask=full_mask)  # [G, W, d]
            prefix_queries = q[:, prefix - self.observation_window:prefix]  # [G, obs, d]
            for r, ratio in enumerate(self.keep_ratios):
                kept = self.kept_rows(head, prefix_queries, k[:prefix], v[:prefix],
                                      self.budget(prefix, ratio), scale, sums[r])
                keys_R = torch.cat([k[:prefix][kept], k[prefix:]])  # [b + W, d]
                values_R = torch.cat([v[:prefix][kept], v[prefix:]])
                mask_R = torch.cat([torch.ones(w, kept.shape[0], dtype=torch.bool, device=device), tail_causal], 1)
                for o, order in enumerate(ORDERS):
                    estimate = corrected_attention(tail_q, keys_R, values_R, sums[r], head, scale, order,
                                                   tau=self.tau, mask=mask_R)
                    self.error_sums[r, o, layer, head] += float(relative_error(estimate, reference))
        self.calls[layer] += 1


def measure_correction_errors(model, windows, keep_ratios=(0.25, 0.5), query_window: int = 32,
                              scorer: str = "snapkv", observation_window: int = 32, n_sink: int = 4,
                              recent_window: int = 8, moment_eviction: bool = False, eviction_rounds: int = 4,
                              tau: float = 0.0, progress: bool = True) -> dict[str, np.ndarray]:
    """Per (layer, KV head) relative attention-output error of no / 0th / 1st-order correction.

    ``windows``: token ids ``[N, T]`` (tensor, array or list of equal-length lists), no
    padding.  ``keep_ratios``: fractions of the prefix ``T - query_window`` kept per head
    (e.g. 0.25 = 75% compression).  See the module docstring for the procedure.  Returns
    ``errors float64 [R, 3, L, Hkv]``, ``order int8 [L, Hkv]`` (-1 none, 0, 1),
    ``reference_ratios float64 [R]``, ``tau float64 [L, Hkv]``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    geometry = ModelGeometry.of(model)
    num_layers, num_kv_heads, head_dim = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
    ids = torch.as_tensor(np.asarray(windows), dtype=torch.long)
    if ids.dim() != 2 or ids.shape[0] == 0:
        raise ValueError(f"windows must be token ids [N, T] with N >= 1, got shape {tuple(ids.shape)}")
    total = ids.shape[1]
    prefix = total - query_window
    if scorer not in SELECTION_SCORERS:
        raise ValueError(f"unknown selection scorer {scorer!r}; choose one of {SELECTION_SCORERS}")
    if query_window <= 0 or observation_window <= 0 or n_sink < 0 or recent_window < 0 or tau < 0:
        raise ValueError("query_window and observation_window must be positive; n_sink, recent_window, tau >= 0")
    if prefix < max(observation_window, n_sink + recent_window + 1):
        raise ValueError(f"windows of {total} tokens leave a prefix of {prefix} after the {query_window}-token "
                         f"query window: too short for observation_window={observation_window}, "
                         f"n_sink={n_sink} + recent_window={recent_window}")
    ratios = tuple(float(r) for r in keep_ratios)
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"keep_ratios must be in (0, 1], got {keep_ratios}")

    measurer = _CorrectionErrorMeasurer(num_layers, num_kv_heads, head_dim, ratios, query_window, scorer,
                                        observation_window, n_sink, recent_window, moment_eviction,
                                        eviction_rounds, tau)

    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        output = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                        dropout=dropout, **kwargs)
        measurer.measure(module.layer_idx, query, key, value, scaling)
        return output

    device = next(model.parameters()).device
    with torch.no_grad(), attention_implementation(model, CALIBRATION_ATTENTION, attention_forward):
        for index in tqdm(range(ids.shape[0]), desc="moments calibration", unit="window", disable=not progress):
            model(input_ids=ids[index:index + 1].to(device), use_cache=False)
    if not np.all(measurer.calls == ids.shape[0]):
        raise RuntimeError(f"the calibration attention saw layers {measurer.calls.tolist()} times, expected "
                           f"{ids.shape[0]} each (does the model route attention through AttentionInterface?)")
    errors = measurer.error_sums / ids.shape[0]  # [R, 3, L, Hkv]
    order = (np.argmin(errors.mean(axis=0), axis=0) - 1).astype(np.int8)  # [L, Hkv]; ties -> none
    return {
        "errors": errors.astype(np.float64),
        "order": order,
        "reference_ratios": np.asarray(ratios, dtype=np.float64),
        "tau": np.full((num_layers, num_kv_heads), float(tau), dtype=np.float64),
    }
