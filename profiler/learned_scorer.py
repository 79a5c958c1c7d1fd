"""A learned per-head token scorer: reconstruction importance as teacher, ridge regression as student.

Teacher.  KVzip ("KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
arXiv 2505.23416) rates a context token by how much the model needs it to *repeat* the
context: after the context ``c [C]`` the model reads a repeat instruction and then ``c``
again (teacher-forced); a KV pair's importance is the largest attention weight any
reconstruction query pays it, maximised over the query heads of its GQA group.  On
calibration text this is one causal forward pass over ``[c; instruction; c]``
(:func:`reconstruction_input`): the context tokens' keys are exactly those a plain prefill of
``c`` computes, and :func:`reconstruction_importance` reads the weights from the same logits
the attention kernel uses.  The target is its logarithm.

Student.  KVzap ("KVzap", arXiv 2601.07891) fits a per-layer map from what serving already
computes to the log KVzip score per KV head.  Here, per (layer, KV head), a ridge regression
``y ~ w . z + b`` in closed form from float64 sums (``Z^T Z``, ``Z^T y``) that add up across
windows, processes and resumed runs, on one of two feature sets:

* ``kv``: the head's own pre-RoPE key and value ``z = [k, v] [2d]``.  The runtime recovers
  the pre-RoPE key from the cached (rotated) one, so the scorer needs nothing but the cache;
  sums are ``[Hkv, 2d+1, 2d+1]`` per layer (small at any model size);
* ``hidden``: the layer's attention input (the normed hidden state) ``z = x [D]``, shared by
  the layer's KV heads; more expressive (``[k, v]`` is a linear function of ``x``), but its
  sums are ``[D+1, D+1]`` per layer (~0.5 GB per layer at D = 8192) and the runtime would
  have to keep each token's score beside the cache.

The ridge penalty is ``lambda * n * var(z_f)`` per feature (ridge on standardised features;
the intercept is not penalised); ``lambda`` is chosen per head on held-out windows by the
rank correlation of predicted and teacher scores (what eviction uses is the order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.compression.kvzip import REPEAT_FIRST

RECONSTRUCTION_INSTRUCTION = REPEAT_FIRST + "\n\n"  # KVzip's repeat request, as runtime.compression.kvzip sends it
FEATURE_KINDS = ("kv", "hidden")
RIDGE_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
MIN_LOG_SCORE = -30.0  # log of an attention weight that underflowed


def reconstruction_input(context: torch.Tensor, instruction: torch.Tensor) -> torch.Tensor:
    """``[c; instruction; c]`` token ids ``[2C + I]`` for a context ``c [C]``."""
    return torch.cat([context, instruction, context])


# Logits held at once by the teacher, at most (float32 numbers): 256 MiB, whatever the context (a chunk
# of 256 queries over the 64K keys of a 32K window's reconstruction pass held 2 GiB per copy, 32 query
# heads; docs/results.md R-profiler-scale-2026-11-27).
TEACHER_LOGITS = 2**26


@torch.no_grad()
def reconstruction_importance(
    query: torch.Tensor,
    key: torch.Tensor,
    context_len: int,
    scaling: float,
    chunk: int = 256,
    max_logits: int = TEACHER_LOGITS,
) -> torch.Tensor:
    """Log KVzip importance ``[Hkv, C]`` of the first ``C`` keys.

    ``query [Hq, T, d]`` and ``key [Hkv, T, d]`` (post-RoPE) of one causal forward pass over
    ``[c; instruction; c]``; every query after the context (positions ``C .. T-1``) is a
    reconstruction query.  Its causal softmax over all the keys it sees is computed in float32,
    at most ``chunk`` queries at a time and fewer where their logits ``[Hq, rows, keys]`` would
    pass ``max_logits`` numbers (one query at least), and the weight on each context key is
    maximised over the queries and over the GQA group's query heads.
    """
    num_q_heads, total, dim = query.shape
    num_kv_heads = key.shape[0]
    group = num_q_heads // num_kv_heads
    keys = key.float()  # [Hkv, T, d]: each KV head's group of queries reads it, no repeat
    best = torch.zeros(num_kv_heads, group, context_len, device=query.device)
    start = context_len
    while start < total:
        rows = max(1, min(chunk, max_logits // (num_q_heads * total)))
        stop = min(start + rows, total)
        grouped = query[:, start:stop].float().reshape(num_kv_heads, group * (stop - start), dim)
        logits = torch.matmul(grouped, keys[:, :stop].transpose(1, 2)).mul_(scaling)  # [Hkv, G*rows, stop]
        logits = logits.view(num_kv_heads, group, stop - start, stop)
        future = (
            torch.arange(stop, device=query.device)[None, :] > torch.arange(start, stop, device=query.device)[:, None]
        )  # [rows, stop]
        weights = torch.softmax(logits.masked_fill_(future, float("-inf")), dim=-1)
        best = torch.maximum(best, weights[..., :context_len].amax(dim=2))
        start = stop
    per_kv_head = best.amax(dim=1)  # [Hkv, C]
    return per_kv_head.clamp_min(float(np.exp(MIN_LOG_SCORE))).log()


def kv_features(pre_rope_keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[Hkv, n, 2d]`` student features of the ``kv`` kind (float32)."""
    return torch.cat([pre_rope_keys.float(), values.float()], dim=-1)


class RidgeSums:
    """Float64 normal-equation sums of one layer: ``groups`` feature sets, ``targets`` heads each.

    ``kv`` features: ``groups = Hkv``, one target per group; ``hidden``: one group shared by
    ``Hkv`` targets.  ``zz [G, F+1, F+1]``, ``zy [G, F+1, M]`` with ``z = [features, 1]``.
    """

    def __init__(self, groups: int, features: int, targets: int):
        self.zz = np.zeros((groups, features + 1, features + 1))
        self.zy = np.zeros((groups, features + 1, targets))

    def add(self, features: torch.Tensor, targets: torch.Tensor) -> None:
        """``features [G, n, F]``, ``targets [G, n, M]`` (any float dtype; summed in float64)."""
        z = torch.cat(
            [features.double(), torch.ones(*features.shape[:2], 1, dtype=torch.float64, device=features.device)], dim=-1
        )  # [G, n, F+1]
        self.zz += (z.transpose(1, 2) @ z).cpu().numpy()
        self.zy += (z.transpose(1, 2) @ targets.double()).cpu().numpy()

    def state(self) -> dict[str, np.ndarray]:
        return {"zz": self.zz, "zy": self.zy}

    def restore(self, state: dict[str, np.ndarray]) -> None:
        self.zz[...] = state["zz"]
        self.zy[...] = state["zy"]

    def solve(self, ridge: float) -> np.ndarray:
        """Weights ``[G, F+1, M]`` (last row: intercept) minimising squared error + penalty."""
        n = self.zz[:, -1, -1]  # [G]
        if np.any(n <= 1):
            raise ValueError("too few calibration tokens to fit the scorer")
        mean = self.zz[:, -1, :-1] / n[:, None]  # [G, F]
        variance = np.maximum(np.diagonal(self.zz, axis1=1, axis2=2)[:, :-1] / n[:, None] - mean**2, 0.0)
        penalty = np.zeros_like(self.zz)
        features = self.zz.shape[1] - 1
        penalty[:, np.arange(features), np.arange(features)] = ridge * n[:, None] * np.maximum(variance, 1e-12)
        return np.linalg.solve(self.zz + penalty, self.zy)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation of two vectors (average ranks for ties are not needed: continuous scores)."""
    ra, rb = np.argsort(np.argsort(a)).astype(np.float64), np.argsort(np.argsort(b)).astype(np.float64)
    ra -= ra.mean()
    rb -= rb.mean()
    denominator = np.sqrt((ra**2).sum() * (rb**2).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else 0.0


def r_squared(prediction: np.ndarray, target: np.ndarray) -> float:
    total = ((target - target.mean()) ** 2).sum()
    return float(1.0 - ((prediction - target) ** 2).sum() / total) if total > 0 else 0.0


@dataclass
class WindowRecord:
    """One layer of one window: teacher and features of the ``C`` context tokens."""

    teacher: torch.Tensor  # [Hkv, C] log importance
    kv: torch.Tensor  # [Hkv, C, 2d] pre-RoPE keys and values
    hidden: torch.Tensor | None = None  # [C, D] attention input (record_window(..., hidden=True))


def predict(weights: np.ndarray, features: np.ndarray) -> np.ndarray:
    """``features [G, n, F]`` and ``weights [G, F+1, M]`` -> predictions ``[G, n, M]``."""
    return features @ weights[:, :-1] + weights[:, -1:]


def held_out_choice(sums: list[RidgeSums], windows, ridge_grid=RIDGE_GRID) -> dict[str, np.ndarray]:
    """Each head's ridge strength, chosen by the held-out rank correlation of prediction and teacher.

    ``sums``: every layer's reduced :class:`RidgeSums` (``kv`` features, one target); ``windows``: an
    iterable of held-out windows, each a list of per-layer :class:`WindowRecord`, consumed one at a
    time: only each window's teacher ``[Hkv, C]`` and its predictions under every ridge ``[N, Hkv, C]``
    are kept, never its features ``[Hkv, C, 2d]`` (8.6 GB per 32K-token window at 32 layers of 8 KV
    heads; docs/results.md R-profiler-scale-2026-11-27).  Returns ``weights [L, Hkv, F]``, ``bias``,
    ``ridge``, ``r2`` and ``rank_correlation`` ``[L, Hkv]`` (float64), and ``tokens``, the held-out
    tokens per layer.
    """
    layers = len(sums)
    solutions = [[layer_sums.solve(ridge) for ridge in ridge_grid] for layer_sums in sums]  # [L][N] x [Hkv, F+1, 1]
    teachers: list[list[np.ndarray]] = [[] for _ in range(layers)]  # per layer, per window [Hkv, C]
    predictions: list[list[np.ndarray]] = [[] for _ in range(layers)]  # per layer, per window [N, Hkv, C]
    for records in windows:
        for layer, record in enumerate(records):
            features = record.kv.double().numpy()  # [Hkv, C, F]
            teachers[layer].append(record.teacher.double().numpy())
            predictions[layer].append(np.stack([predict(w, features)[:, :, 0] for w in solutions[layer]]))
        del records, record, features  # let the window go before the next one is recorded
    heads, features = solutions[0][0].shape[0], solutions[0][0].shape[1] - 1
    best = {name: np.zeros((layers, heads)) for name in ("ridge", "r2", "rank_correlation", "bias")}
    best["rank_correlation"][:] = -2.0
    best["weights"] = np.zeros((layers, heads, features))
    for layer in range(layers):
        teacher = np.concatenate(teachers[layer], axis=1)  # [Hkv, n]
        prediction = np.concatenate(predictions[layer], axis=2)  # [N, Hkv, n]
        for r, ridge in enumerate(ridge_grid):
            solution = solutions[layer][r]
            for head in range(heads):
                rho = spearman(prediction[r, head], teacher[head])
                if rho > best["rank_correlation"][layer, head]:
                    best["rank_correlation"][layer, head] = rho
                    best["r2"][layer, head] = r_squared(prediction[r, head], teacher[head])
                    best["ridge"][layer, head] = ridge
                    best["weights"][layer, head] = solution[head, :-1, 0]
                    best["bias"][layer, head] = solution[head, -1, 0]
    best["tokens"] = sum(part.shape[1] for part in teachers[0])
    return best


TEACHER_ATTENTION = "kvcal_reconstruction_teacher"


def context_rows(tensor: torch.Tensor, context_len: int) -> torch.Tensor:
    """A float32 host copy of the first ``context_len`` positions of ``tensor [1, T, ...]``: its own
    storage, not a view that keeps the layer's whole projection output ``[1, 2C + I, ...]`` alive until
    the pass ends (every layer's: 8 GiB on the GPU for a 32K window at 32 layers of 8 KV heads, bf16)."""
    return tensor[0, :context_len].detach().to(device="cpu", dtype=torch.float32, copy=True)


@torch.no_grad()
def record_window(model, context: torch.Tensor, instruction: torch.Tensor, hidden: bool = False) -> list[WindowRecord]:
    """Run ``[c; instruction; c]`` through ``model`` once; per layer, the teacher and the features
    of the context tokens ``c [C]`` (see the module docstring), read from the pass itself: the
    pre-RoPE keys and the values (``runtime.math.geometry``'s key and value projections: ``k_proj``
    after ``k_norm`` where the model has one, ``v_proj``, or the slices of a fused ``qkv_proj``),
    and with ``hidden`` the attention input too (the input of the value projection)."""
    from runtime.kv_store.attention_interface import attention_implementation
    from runtime.kv_store.eager_attention import attention_forward as model_attention
    from runtime.math.geometry import ModelGeometry, input_device

    geometry = ModelGeometry.of(model)
    context_len = int(context.shape[0])
    ids = reconstruction_input(context, instruction).unsqueeze(0)  # [1, T]
    teacher: dict[int, torch.Tensor] = {}
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        layer = geometry.layer_of(module)  # None: a layer held apart, never measured (Gemma 4's sliding ones)
        if layer is not None:
            teacher[layer] = reconstruction_importance(query[0], key[0], context_len, scale).cpu()
        return model_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    def keep(layer: int, name: str, projection=None):
        def hook(_module, args, output):
            tensor = args[0] if projection is None else projection.take(output)  # [B, T, hidden] / [B, T, Hkv, d]
            captured[layer, name] = context_rows(tensor, context_len)

        return hook

    handles = []
    for layer in range(geometry.num_layers):
        keys, values = geometry.key_projections[layer], geometry.value_projections[layer]
        handles.append(keys.module.register_forward_hook(keep(layer, "keys", keys)))
        handles.append(values.module.register_forward_hook(keep(layer, "values", values)))
        if hidden:  # the value projection's input: the normed state
            handles.append(values.module.register_forward_hook(keep(layer, "hidden")))
    try:
        with attention_implementation(model, TEACHER_ATTENTION, attention_forward):
            model.model(input_ids=ids.to(input_device(model)), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    shape = (context_len, geometry.num_kv_heads, geometry.head_dim)
    value_shape = (context_len, geometry.num_kv_heads, geometry.value_head_dim)
    return [
        WindowRecord(
            teacher=teacher[layer],
            kv=kv_features(
                captured[layer, "keys"].reshape(shape).transpose(0, 1),
                captured[layer, "values"].reshape(value_shape).transpose(0, 1),
            ),
            hidden=captured[layer, "hidden"] if hidden else None,
        )
        for layer in range(geometry.num_layers)
    ]
