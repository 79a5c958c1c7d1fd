"""Per-head budget curves: how a head's loss falls as its budget grows, and the allocation per ratio.

LU-KV (arXiv 2602.08585; title not in our notes, docs/design.md section 8) precomputes, per (model,
compression ratio), per-head budgets from each head's marginal utility and ships them as a
``[ratio, L, H]`` curve: at 90% compression the right split is not the 50% split scaled.
This module measures, per KV head and on a grid of kept fractions ``f`` of the context, two
losses, under one token selection (``selection``: KeyDiff by default, the scorer of
``inf/keydiff``; the serving engine's rule: the first ``n_sink`` and last ``window`` tokens,
then the best-scored, ties to the newer token: :func:`runtime.compression.keep_rule.priority_ranks`):

* ``output_error[f]`` on calibration text (as :mod:`profiler.moments` measures it):
  each window ``[T]`` is split into a prefix of ``P = T - W`` tokens, compressed per KV head to
  ``round(f P)`` tokens, and the last ``W = query_window`` tokens, whose queries (every query
  head of the group) attend to the kept prefix plus the tail (causally); the relative error
  ``||o_hat - o|| / ||o||`` against full causal attention, averaged over the group's query
  heads, the ``W`` queries and the windows (no MomentKV correction);
* ``retention_loss[f]`` on the behaviour stage's needle probes (question-agnostic, as served):
  the context ``[0, context_end)`` is compressed per KV head to ``round(f context_end)``
  tokens with the scores of the context alone; the question's queries (every token after
  ``context_end``, every query head of the group, full causal attention over the uncompressed
  prompt) tell how much attention the head pays to the needle's R span (the answer tokens,
  REAL's retrieval label); the loss is the part of that attention mass whose R tokens were
  evicted, averaged over the group, the question's queries and the probes.  A head that does
  not read the needle has no retention loss at any budget.  With ``answers`` (the stage's
  ``--curve-retention answer``) the probe's answer is appended and the loss follows REAL's
  retrieval hits instead (REAL, "REtrieval-reAsoning and Logic-constructed Attention Behaviors
  for Long-Context KV Cache Compression"): per (query head of the group, answer step), the
  step's most attended token; the loss is the share of those that are R tokens of the context
  the budget evicts.

Attention here is the layer's own: soft-capped logits (Gemma 2) and, on a sliding-window layer,
only the keys within the window of each query (``runtime.math.geometry``'s ``softcaps`` and
``sliding_windows``); evicting a token the window has left changes nothing.

Both are 0 at ``f = 1`` (nothing evicted).  The curve the allocation uses is
``loss = output_error / mean_h output_error[f_0] + retention_weight * retention_loss /
mean_h retention_loss[f_0]`` (each part normalised by its mean over heads at the smallest
grid fraction ``f_0``, so that with weight 1 the two have the same total stake).

Allocation (:func:`allocate_fractions`): for a kept fraction ``k`` (``1 - compression ratio``)
every head first gets the floor ``floor * k``; the rest of the total ``k L Hkv`` goes by
marginal utility, greedily on the lower convex hull of each head's piecewise-linear loss curve
(the segments with the steepest loss decrease per unit of budget first; on convex curves this
greedy is optimal for the sum of the losses), the last level of equal utility shared in
proportion to the segments' lengths, so the total is conserved exactly and no head passes 1.
Below ``f_0`` nothing was measured: a head's curve is flat there (no utility).

Measured on 54 held-out tasks (docs/results.md): with the retention loss taken from the answer's
retrieval hits, ``curve`` beats ``inf`` for keydiff, keydiff+correction and leverage and trails it
by one task at each ratio for leverage+correction (R-budget-curves-2026-11-22); taken from the
question's attention mass it was far below ``inf`` everywhere (R-budget-curves-question-2026-11-22);
curves measured under leverage selection did worse for the leverage policies, so KeyDiff stays the
default selection (R-budget-curves-leverage-selection-2026-11-22).
"""

from __future__ import annotations

import numpy as np

# kept fractions of the context at which the losses are measured (1.0: nothing evicted, loss 0)
CURVE_GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)
# compression ratios (fractions evicted) the section allocates; the runtime interpolates between them
CURVE_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.975)
CURVE_FLOOR = 0.25  # every head keeps at least this share of the average kept fraction
RETENTION_WEIGHT = 1.0
SELECTIONS = ("keydiff", "leverage")


# -- allocation (numpy only) -------------------------------------------------------------------


def _lower_hull(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vertices of the lower convex hull of the points ``(x, y)`` (x strictly increasing)."""
    hull: list[int] = []
    for i in range(len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or above the segment a -> i
            if (y[b] - y[a]) * (x[i] - x[a]) >= (y[i] - y[a]) * (x[b] - x[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return x[hull], y[hull]


def _loss_at(grid: np.ndarray, curve: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """A head's piecewise-linear loss at ``fractions``; flat below the grid (nothing measured there)."""
    return np.interp(fractions, grid, curve, left=curve[0], right=curve[-1])


def allocate_fractions(loss: np.ndarray, grid, keep_fractions, floor: float = CURVE_FLOOR) -> np.ndarray:
    """Kept fraction per head ``[NR, L, Hkv]`` for every kept fraction in ``keep_fractions``.

    ``loss [NG, L, Hkv]``: each head's loss at the kept fractions ``grid [NG]`` (strictly
    increasing, in (0, 1]).  Row ``r`` sums to ``keep_fractions[r] x L x Hkv`` (to rounding),
    every head holds at least ``floor x keep_fractions[r]`` and at most 1.  See the module
    docstring.
    """
    loss = np.asarray(loss, dtype=np.float64)
    grid = np.asarray(grid, dtype=np.float64)
    keeps = np.asarray(keep_fractions, dtype=np.float64).reshape(-1)
    if loss.ndim != 3 or grid.ndim != 1 or loss.shape[0] != grid.shape[0] or grid.size < 1:
        raise ValueError(f"loss must be [NG, L, Hkv] over a grid [NG], got {loss.shape} and {grid.shape}")
    if not np.all(np.isfinite(loss)) or np.any(loss < 0):
        raise ValueError("losses must be finite and non-negative")
    if np.any(np.diff(grid) <= 0) or grid[0] <= 0 or grid[-1] > 1:
        raise ValueError(f"the grid must be strictly increasing in (0, 1], got {grid.tolist()}")
    if np.any(keeps <= 0) or np.any(keeps > 1):
        raise ValueError(f"kept fractions must lie in (0, 1], got {keeps.tolist()}")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"the floor (share of the average kept fraction) must lie in [0, 1], got {floor}")
    _, layers, heads = loss.shape
    curves = loss.reshape(grid.size, -1).T  # [N, NG]
    count = curves.shape[0]
    out = np.zeros((keeps.size, count))
    for r, keep in enumerate(keeps):
        low = floor * keep
        total = keep * count
        fractions = np.full(count, low)
        # every head's hull segments above the floor: (utility per unit budget, length, head, order)
        utilities, lengths, owners = [], [], []
        for h, curve in enumerate(curves):
            x = np.concatenate([[low], grid[grid > low]])
            if x[-1] < 1.0:
                x = np.concatenate([x, [1.0]])
            hx, hy = _lower_hull(x, _loss_at(grid, curve, x))
            dx = np.diff(hx)
            utilities.append(-np.diff(hy) / dx)
            lengths.append(dx)
            owners.append(np.full(dx.size, h))
        utility, length, owner = (np.concatenate(a) for a in (utilities, lengths, owners))
        remaining = total - fractions.sum()
        # convex hulls: each head's segments come in falling utility, so a stable sort keeps their order
        order = np.argsort(-utility, kind="stable")
        i = 0
        while remaining > 0 and i < order.size:
            level = utility[order[i]]
            j = i
            while j < order.size and utility[order[j]] == level:
                j += 1
            members = order[i:j]
            available = float(length[members].sum())
            share = 1.0 if available <= remaining else remaining / available
            np.add.at(fractions, owner[members], length[members] * share)
            remaining -= available * share
            i = j
        fractions = np.minimum(fractions, 1.0)
        out[r] = fractions
    return out.reshape(keeps.size, layers, heads)


def combined_loss(output_error: np.ndarray, retention_loss: np.ndarray, retention_weight: float) -> np.ndarray:
    """``output_error / mean(output_error[0]) + retention_weight * retention_loss / mean(retention_loss[0])``
    (``[NG, L, Hkv]``; a part whose mean is 0 contributes nothing)."""
    if retention_weight < 0:
        raise ValueError(f"retention_weight must be >= 0, got {retention_weight}")
    parts = []
    for part, weight in ((output_error, 1.0), (retention_loss, retention_weight)):
        part = np.asarray(part, dtype=np.float64)
        scale = float(part[0].mean())
        parts.append(weight * part / scale if scale > 0 else np.zeros_like(part))
    return parts[0] + parts[1]


# -- measuring (torch) -------------------------------------------------------------------------


def budgets_for(length: int, grid) -> list[int]:
    """Tokens kept of ``length`` at each grid fraction: ``min(length, max(round(f length), 1))``."""
    return [min(length, max(int(round(float(f) * length)), 1)) for f in grid]


def selection_scorer(name: str):
    """The ``runtime.scorers`` scorer a selection name stands for (leverage: blend 0.75, its
    serving value at 75% compression)."""
    from runtime.scorers import KeyDiffScorer, LeverageScorer

    if name == "keydiff":
        return KeyDiffScorer()
    if name == "leverage":
        return LeverageScorer(blend=0.75)
    raise ValueError(f"unknown selection {name!r}; choose one of {', '.join(SELECTIONS)}")


class _CurveMeasurer:
    """Captures one forward pass's post-RoPE queries / keys / values per layer and accumulates the
    losses of every KV head at every grid fraction."""

    def __init__(self, geometry, grid, scorer, n_sink: int, window: int, rope_forms=None):
        from runtime.scorers import ScorerInputs

        self.grid = tuple(float(f) for f in grid)
        self.scorer = scorer
        # what the scorer needs, from the captured pass (its RoPE in each layer's form)
        self.inputs = ScorerInputs(scorer, geometry, rope_forms=rope_forms)
        self.softcaps, self.sliding_windows = geometry.softcaps, geometry.sliding_windows
        self.n_sink, self.window = n_sink, window
        shape = (len(self.grid), geometry.num_layers, geometry.num_kv_heads)
        self.sums = np.zeros(shape)
        self.calls = np.zeros(geometry.num_layers, dtype=np.int64)
        self.target = None  # (kind, prefix length, extra) for the pass in progress

    def layer_ranks(self, layer, query, key, value, prefix, scale):
        """Keep order int64 ``[Hkv, prefix]`` of the first ``prefix`` tokens of every KV head under the
        selection scorer (``query [1, Hq, T, d]``, ``key/value [1, Hkv, T, d]``, post-RoPE)."""
        import torch

        from runtime.compression.keep_rule import priority_ranks

        heads = key.shape[1]
        inputs = self.inputs.layer(
            layer,
            key[:, :, :prefix].float(),
            value[:, :, :prefix].float(),
            torch.arange(prefix, device=key.device).expand(1, heads, prefix),
            torch.ones(1, heads, prefix, dtype=torch.bool, device=key.device),
            torch.full((1, heads), prefix, dtype=torch.int64),
            [prefix],
            queries=[query[0, :, :prefix].float()],  # every prefix query [Hq, prefix, d]; the scorer's window of it
            scaling=scale,
        )
        return priority_ranks(self.scorer.score(inputs)[0], None, self.n_sink, self.window)

    def measure(self, layer, query, key, value, scaling, sinks=None):
        import torch

        from runtime.kv_store.eager_attention import soft_cap
        from runtime.math.sinks import softmax_with_sinks

        kind, prefix, extra = self.target
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        num_kv = key.shape[1]
        group = query.shape[1] // num_kv
        total = key.shape[2]
        budgets = torch.tensor(budgets_for(prefix, self.grid), device=key.device)  # [NG]
        tail = total - prefix
        tail_causal = torch.ones(tail, tail, dtype=torch.bool, device=key.device).tril()
        sliding = self.sliding_windows[layer]
        if sliding is not None:  # key t is within query p's window when p - t < sliding
            distance = torch.arange(prefix, total, device=key.device)[:, None] - torch.arange(total, device=key.device)
            outside = distance >= sliding  # [W, T]
        layer_ranks = self.layer_ranks(layer, query, key, value, prefix, scale)  # [Hkv, prefix]
        for h in range(num_kv):
            ranks = layer_ranks[h]
            q = query[0, h * group : (h + 1) * group, prefix:].float()  # [G, W, d]
            k, v = key[0, h].float(), value[0, h].float()  # [T, d]
            logits = soft_cap(torch.einsum("gwd,td->gwt", q, k) * scale, self.softcaps[layer])  # [G, W, T]
            # the query heads' learned sinks, one more logit in each softmax (runtime.math.sinks)
            sink = None if sinks is None else sinks[h * group : (h + 1) * group].reshape(group, 1, 1)
            logits[..., prefix:] = logits[..., prefix:].masked_fill(~tail_causal, float("-inf"))
            if sliding is not None:
                logits = logits.masked_fill(outside, float("-inf"))
            if kind == "text":
                reference = softmax_with_sinks(logits, sink) @ v  # [G, W, d]
                kept = ranks[None, :] < budgets[:, None]  # [NG, prefix]
                masked = logits[None].expand(len(self.grid), -1, -1, -1).clone()  # [NG, G, W, T]
                masked[..., :prefix] = masked[..., :prefix].masked_fill(~kept[:, None, None, :], float("-inf"))
                estimate = softmax_with_sinks(masked, sink) @ v  # [NG, G, W, d]
                error = (estimate - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)
                self.sums[:, layer, h] += error.mean(dim=(1, 2)).double().cpu().numpy()
            elif kind == "probe":  # the question's attention mass on evicted R tokens
                mass = softmax_with_sinks(logits, sink)[..., :prefix].mean(dim=(0, 1))  # [prefix]
                needle = extra  # bool [prefix]
                lost = (ranks[None, :] >= budgets[:, None]) & needle[None, :]  # [NG, prefix]
                self.sums[:, layer, h] += (lost.float() * mass[None, :]).sum(dim=1).double().cpu().numpy()
            else:  # "answer": REAL's retrieval hits of the answer's steps whose token the budget evicts
                needle, answer = extra  # bool [prefix], answer tokens at the end of the tail
                top = logits[:, tail - answer :].argmax(dim=-1)  # [G, A]: each step's most attended token
                hit = (top < prefix) & needle[top.clamp_max(prefix - 1)]  # [G, A]
                evicted = ranks[top.clamp_max(prefix - 1)][None] >= budgets[:, None, None]  # [NG, G, A]
                lost = (evicted & hit[None]).float().mean(dim=(1, 2))  # [NG]
                self.sums[:, layer, h] += lost.double().cpu().numpy()
        self.calls[layer] += 1


def measure_curves(
    model,
    windows,
    probes,
    *,
    grid=CURVE_GRID,
    selection: str = "keydiff",
    query_window: int = 32,
    n_sink: int = 4,
    window: int = 32,
    answers=None,
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """``output_error`` and ``retention_loss`` ``[NG, L, Hkv]`` (float64), see the module docstring.

    ``windows``: calibration token ids ``[N, T]``; ``probes``: ``needles.probe.Probe`` objects
    (those without an R span in their context are skipped; at least one must have one).
    ``n_sink`` / ``window``: the tokens the engine keeps unconditionally (CompressionPolicy's).
    ``answers``: token ids of each probe's answer, or None.  Given, each probe is run with its
    answer appended (teacher forcing) and ``retention_loss`` counts REAL's retrieval hits at the
    answer's steps instead of the question's attention mass: per KV head, the share of (query
    head, answer step) pairs whose most attended token is an R token of the context that the
    budget evicts.
    """
    import torch
    from tqdm.auto import tqdm

    from runtime.kv_store.attention_interface import attention_implementation
    from runtime.kv_store.eager_attention import attention_forward as model_attention
    from runtime.math.geometry import ModelGeometry, input_device
    from runtime.plan.rope_check import rope_forms

    grid = tuple(float(f) for f in grid)
    if not grid or any(not 0.0 < f <= 1.0 for f in grid) or any(np.diff(grid) <= 0):
        raise ValueError(f"the grid must be strictly increasing kept fractions in (0, 1], got {grid}")
    if query_window < 1 or n_sink < 0 or window < 0:
        raise ValueError("query_window must be >= 1; n_sink and window >= 0")
    ids = torch.as_tensor(np.asarray(windows), dtype=torch.long)
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] <= query_window + n_sink + window:
        raise ValueError(
            f"calibration windows must be [N >= 1, T > query_window + n_sink + window = "
            f"{query_window + n_sink + window}], got {tuple(ids.shape)}"
        )
    if answers is not None and len(answers) != len(probes):
        raise ValueError(f"got {len(answers)} answers for {len(probes)} probes")
    usable = []
    for index, probe in enumerate(probes):
        needle = np.zeros(probe.context_end, dtype=bool)
        for span in probe.spans:
            if span.label == "R":
                needle[span.start : min(span.end, probe.context_end)] = True
        answer = [] if answers is None else [int(token) for token in answers[index]]
        if needle.any() and probe.context_end < len(probe.input_ids) and (answers is None or answer):
            usable.append((probe, needle, answer))
    if not usable:
        raise ValueError("no probe has an R span in its context and a question after it")
    geometry = ModelGeometry.of(model)
    scorer = selection_scorer(selection)
    forms = rope_forms(model, scorer)
    text = _CurveMeasurer(geometry, grid, scorer, n_sink, window, forms)
    needles = _CurveMeasurer(geometry, grid, scorer, n_sink, window, forms)
    current = [text]

    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        output = model_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer = geometry.layer_of(module)
        if layer is not None:  # None: a layer held apart, never measured (Gemma 4's sliding ones)
            current[0].measure(layer, query, key, value, scaling, kwargs.get("s_aux"))
        return output

    device = input_device(model)  # the embedding's: under device_map="auto" not necessarily the first parameter's
    bar = tqdm(total=ids.shape[0] + len(usable), desc="budget curves", unit="pass", disable=not progress)
    with torch.no_grad(), attention_implementation(model, "kvcal_budget_curves", attention_forward), bar:
        for index in range(ids.shape[0]):
            text.target = ("text", ids.shape[1] - query_window, None)
            # the decoder only: the vocabulary logits [1, T, V] are never read (R-profiler-scale-2026-11-27)
            model.model(input_ids=ids[index : index + 1].to(device), use_cache=False)
            bar.update()
        current[0] = needles
        for probe, needle, answer in usable:
            needle = torch.as_tensor(needle, device=device)
            if answers is None:
                needles.target = ("probe", probe.context_end, needle)
            else:
                needles.target = ("answer", probe.context_end, (needle, len(answer)))
            model.model(input_ids=torch.tensor([[*probe.input_ids, *answer]], device=device), use_cache=False)
            bar.update()
    for measurer, passes in ((text, ids.shape[0]), (needles, len(usable))):
        if not np.all(measurer.calls == passes):
            raise RuntimeError(
                f"the capture attention saw layers {measurer.calls.tolist()} times, expected {passes} each "
                "(does the model route attention through AttentionInterface?)"
            )
    return {
        "output_error": text.sums / ids.shape[0],
        "retention_loss": needles.sums / len(usable),
        "probes": len(usable),
    }
