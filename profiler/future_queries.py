"""The queries that read a compressed cache: pre-RoPE queries of a probe's question and answer.

Expected Attention ("Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00636) scores a key by the attention that *future*
queries are expected to pay it.  Under question-agnostic compression those future queries are
the question's tokens and the answer's, which a mean and covariance measured on calibration
prose do not describe: they look a specific fact up.  This module measures them on needle
probes (``needles``): each probe's whole prompt (context, question, generation prompt) is
greedy-decoded with forward hooks on the pre-RoPE query modules, and the queries at positions
``>= probe.context_end`` are kept (the question, the template tail, and every generated token
that is fed back; the last generated token never is).

Two summaries of them:

* moments (``n``, ``sum q``, ``sum q q^T``, float64, as :class:`runtime.compression.prompt_statistics.QueryMoments`)
  for Expected Attention's Gaussian;
* a few query *centres* per head (:func:`kmeans_centres`: k-means++ seeding, Lloyd iterations),
  with their weights (the fraction of queries each holds), for a max over directions as
  Q-Filters ("Q-Filters: Leveraging QK Geometry for Efficient KV Cache Compression",
  arXiv 2503.02812), TriAttention (arXiv 2604.04921, pre-RoPE query centres) and DefensiveKV
  ("Taming the Fragility of KV Cache Eviction in LLM Inference", arXiv 2510.13334, a worst-case
  aggregation) suggest in place of one mean.
"""

from __future__ import annotations

import numpy as np
import torch

from profiler.greedy import greedy_generate
from runtime.math.geometry import ModelGeometry


@torch.no_grad()
def probe_future_queries(model, tokenizer, geometry: ModelGeometry, probe, max_new_tokens: int) -> np.ndarray:
    """Pre-RoPE queries ``[T, L, Hq, d]`` float32 of ``probe``'s tokens at positions ``>= context_end``
    and of its greedy answer (``max_new_tokens`` at most; the last generated token is never fed back,
    so it has no query), in position order."""
    geometry = ModelGeometry.of(geometry)
    heads, dim = geometry.num_q_heads, geometry.head_dim
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([probe.input_ids], dtype=torch.long, device=device)
    start = int(probe.context_end)
    seen = [0] * geometry.num_layers  # tokens each layer's hook has seen (prefill, then one per step)
    recorded: list[list[torch.Tensor]] = [[] for _ in range(geometry.num_layers)]

    def make_hook(layer: int):
        def hook(_module, _inputs, output):
            if output.shape[0] != 1:
                raise ValueError("future queries are recorded one probe at a time (batch 1)")
            queries = geometry.pre_rope_queries(layer, output)[0]  # [T, Hq, d]
            first = seen[layer]
            seen[layer] += queries.shape[0]
            keep = max(start - first, 0)
            if keep < queries.shape[0]:
                recorded[layer].append(queries[keep:].float().cpu())

        return hook

    handles = [module.register_forward_hook(make_hook(i)) for i, module in enumerate(geometry.query_modules)]
    try:
        greedy_generate(model, tokenizer, ids, max_new_tokens)
    finally:
        for handle in handles:
            handle.remove()
    per_layer = [torch.cat(parts) if parts else torch.zeros(0, heads, dim) for parts in recorded]
    counts = {part.shape[0] for part in per_layer}
    if len(counts) != 1:
        raise RuntimeError(f"layers recorded different numbers of future queries: {sorted(counts)}")
    return torch.stack(per_layer, dim=1).numpy()  # [T, L, Hq, d]


def kmeans_centres(
    queries: np.ndarray, clusters: int, *, seed: int = 0, iterations: int = 50
) -> tuple[np.ndarray, np.ndarray]:
    """K-means of every head's queries at once: ``queries [H, N, d]`` -> ``centres [H, K, d]`` and
    ``weights [H, K]`` (the fraction of the head's queries nearest each centre; sums to 1).

    Seeding: k-means++ (D^2 sampling, a fixed ``seed``), then ``iterations`` Lloyd steps in float64
    (stopping early when no assignment changes).  A centre that loses all its queries is moved to
    the query farthest from its own centre.  With fewer distinct queries than ``clusters``, centres
    repeat, each with its share of the weight.
    """
    x = np.asarray(queries, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"queries must be [heads, N, d], got shape {x.shape}")
    heads, n, dim = x.shape
    if n == 0:
        raise ValueError("k-means needs at least one query per head")
    if not isinstance(clusters, int) or isinstance(clusters, bool) or clusters < 1:
        raise ValueError(f"clusters must be a positive integer, got {clusters!r}")
    rng = np.random.default_rng(seed)
    rows = np.arange(heads)
    squared = (x * x).sum(-1)  # [H, N]

    def distances(centres):  # [H, N, K] squared distances
        cross = np.einsum("hnd,hkd->hnk", x, centres)
        return np.maximum(squared[:, :, None] - 2 * cross + (centres * centres).sum(-1)[:, None, :], 0.0)

    centres = np.empty((heads, clusters, dim))
    centres[:, 0] = x[rows, rng.integers(0, n, size=heads)]
    nearest = distances(centres[:, :1])[:, :, 0]  # [H, N]
    for k in range(1, clusters):
        total = nearest.sum(-1, keepdims=True)
        # D^2 sampling; all-equal queries (total 0) pick uniformly
        probs = np.where(total > 0, nearest / np.where(total > 0, total, 1.0), 1.0 / n)
        cumulative = np.cumsum(probs, axis=-1)
        pick = (cumulative < rng.random((heads, 1)) * cumulative[:, -1:]).sum(-1).clip(max=n - 1)
        centres[:, k] = x[rows, pick]
        nearest = np.minimum(nearest, distances(centres[:, k : k + 1])[:, :, 0])
    assign = None
    for _ in range(iterations):
        d2 = distances(centres)
        new = d2.argmin(-1)  # [H, N]
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        onehot = np.zeros((heads, n, clusters))
        np.put_along_axis(onehot, assign[:, :, None], 1.0, axis=-1)
        counts = onehot.sum(1)  # [H, K]
        sums = np.einsum("hnk,hnd->hkd", onehot, x)
        empty = counts == 0
        centres = np.where(empty[..., None], centres, sums / np.maximum(counts, 1)[..., None])
        for h, k in zip(*np.nonzero(empty), strict=True):  # rare: reseed at the worst-fitted query
            own = d2[h, np.arange(n), assign[h]]
            centres[h, k] = x[h, int(own.argmax())]
    d2 = distances(centres)
    assign = d2.argmin(-1)
    counts = np.stack([np.bincount(assign[h], minlength=clusters) for h in range(heads)]).astype(np.float64)
    return centres, counts / n
