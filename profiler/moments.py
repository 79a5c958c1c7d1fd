"""Calibration of the MomentKV correction: which order (none, 0th, 1st) helps each KV head.

Whether the 0th- or 1st-order moment correction of the evicted tokens' contribution (MomentKV:
Closing the Directional Gap in KV Cache Eviction for Long-Context Inference) helps a head is an
empirical property of the head, so it is measured on calibration text.  For every window
``[T]`` of token ids:

* one forward pass of the model with a capture attention function (switched in with
  ``runtime.kv_store.attention_interface.attention_implementation``); the function computes the ordinary
  attention output (``sdpa``; :mod:`runtime.kv_store.eager_attention` on a soft-capping layer) and hands
  post-RoPE ``query [1, Hq, T, d]`` and un-repeated
  ``key/value [1, Hkv, T, d]`` to a per-call measurer (passed by closure, no module globals);
* the window is split into a *prefix* of ``P = T - W`` tokens (the prompt that gets
  compressed) and the last ``W = query_window`` tokens, whose queries play the role of
  future (decode) queries;
* per KV head the prefix is compressed to ``budget = round(keep_ratio * P)`` tokens: the
  first ``n_sink`` and last ``recent_window`` prefix tokens are kept first (as far as the budget
  goes, :mod:`runtime.compression.keep_rule`'s rule, as in serving), the rest chosen
  by a ``runtime.scorers`` scorer, the one a serving policy would use, over the
  :class:`runtime.scorers.LayerInputs` of the prefix (every KV head's keys, values, positions
  ``0..P-1``, the layer's scaling, next position ``P``, and what the scorer needs: the last prefix
  queries for SnapKV, the keys' RoPE and the learned weights for the learned scorer):

  - ``"snapkv"`` (default): :class:`~runtime.scorers.SnapKVScorer` with window
    ``observation_window`` and no neighbour pooling (``kernel=1``): the mean causal
    attention of the last ``observation_window`` *prefix* queries, averaged over the query
    heads of the group (SnapKV: LLM Knows What You are Looking for Before Generation,
    arXiv 2404.14469), so the evaluated queries are never the ones used for selection;
  - ``"keydiff"``: :class:`~runtime.scorers.KeyDiffScorer`, ``-cos(k_i, mean_j k_j/||k_j||)``
    (KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
    Resource-Constrained Environments, arXiv 2504.15364), attention-free;
  - ``"learned"``: :class:`~runtime.scorers.LearnedScorer` on the artifact's learned_scorer weights,
    usually with the global allocation (below), as ``global/learned+correction`` serves it;
  - ``"leverage"``: :class:`~runtime.scorers.LeverageScorer` (Compactor: Calibrated Query-Agnostic KV
    Cache Compression with Approximate Leverage Scores, arXiv 2507.08143), the flagship's: every prefix
    query and the keys' RoPE from the captured pass, and at each reference ratio the blend
    :class:`runtime.plan.policy.CompressionPolicy` serves, the evicted fraction ``1 - keep_ratio``;
  - or a :class:`~runtime.scorers.Scorer` instance that needs neither query statistics,
    RoPE averages nor query centres (e.g. ``SnapKVScorer(window=32, kernel=5)``, the serving default);

  ``score()`` and :func:`runtime.compression.keep_rule.select_rows` choose the kept rows (as serving does); with
  ``moment_eviction=True`` the scorer's ``attention()`` estimate ``a_j`` is combined with the
  moment residual, ``a_j ||r_j||``, evicting in ``eviction_rounds`` rounds (runtime.math.momentkv);
* the evicted tokens are folded into :class:`runtime.math.momentkv.MomentSums`; each of the ``W``
  queries (every query head of the group) attends to the retained prefix plus the ``W``
  tokens themselves (causally), with correction order none / 0 / 1
  (:func:`runtime.math.momentkv.corrected_attention`), and is compared to full causal attention::

      err = ||o_hat - o|| / ||o||     per (query head, query), averaged over the group's
                                      query heads, the W queries and the windows.

Result (the artifact's ``moments`` section): ``errors float64 [R, 3, L, Hkv]`` (index 0 =
none, 1 = order 0, 2 = order 1), ``order int8 [L, Hkv]`` = argmin over the ratio-averaged
errors, mapped to -1 / 0 / 1 (ties go to none, so ``-1`` when correction does not help),
``reference_ratios float64 [R]`` (the keep ratios), ``tau float64 [L, Hkv]`` (the uniform
clamp used for order 1; 0 = no clamp, the default; not tuned per head).  The result is a
:class:`CorrectionErrors` dict whose ``selection`` names the scorer the orders were
calibrated under (the runtime serves a policy the orders of its own scorer, and warns when it
has only another's).  :func:`measure_correction_errors_by_selection` measures several selections
over one captured forward pass per window (one measurer each), as the ``moments`` stage does for
every scorer the flagship and the recommendation candidates serve with ``+correction``.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm.auto import tqdm

from common.names import MOMENT_SELECTIONS as SELECTION_SCORERS
from runtime.compression.keep_rule import global_budgets, protected_mask, select_rows
from runtime.kv_store.attention_interface import attention_implementation
from runtime.math.geometry import ModelGeometry, input_device
from runtime.math.momentkv import ORDERS, MomentSums, attention_with_lse, corrected_attention, evict_in_rounds
from runtime.math.sinks import sink_weight
from runtime.plan.rope_check import rope_forms
from runtime.scorers import (
    ALL_QUERIES,
    ChunkAttentionMass,
    KeyDiffScorer,
    KeyRope,
    LearnedScorer,
    LearnedWeights,
    LeverageScorer,
    RecentQueries,
    Scorer,
    ScorerInputs,
    SnapKVScorer,
    recent_query_window,
)

CALIBRATION_ATTENTION = "kvcal_moments_calibration"
# what a captured pass (its queries: recent ones, chunked attention from them) and learned=... supply
CAPTURED_NEEDS = (RecentQueries, ChunkAttentionMass, KeyRope, LearnedWeights)


def selection_scorer(scorer: str | Scorer, observation_window: int, keep_ratio: float | None = None) -> Scorer:
    """The ``runtime.scorers`` scorer behind a selection name (see the module docstring), at reference
    keep ratio ``keep_ratio`` where the served scorer depends on it (leverage's blend)."""
    if isinstance(scorer, Scorer):
        if any(not isinstance(need, CAPTURED_NEEDS) for need in scorer.needs):
            raise ValueError(
                f"{scorer!r} needs query statistics or RoPE averages, which the moments "
                "calibration does not provide; choose one of " + ", ".join(SELECTION_SCORERS)
            )
        return scorer
    if scorer == "snapkv":
        return SnapKVScorer(window=observation_window, kernel=1)
    if scorer == "keydiff":
        return KeyDiffScorer()
    if scorer == "learned":
        return LearnedScorer()
    if scorer == "leverage":
        if keep_ratio is None:
            return LeverageScorer()
        # as runtime.plan.policy.CompressionPolicy.build_scorer serves it: blend = the evicted fraction
        return LeverageScorer(blend=round(1.0 - float(keep_ratio), 6))
    raise ValueError(f"unknown selection scorer {scorer!r}; choose one of {SELECTION_SCORERS} or pass a Scorer")


class CorrectionErrors(dict):
    """The ``moments`` section's arrays (a plain dict of them), plus what they were measured under:
    ``selection``, the scorer's name (``runtime.scorers``), ``scorer``, its full repr, ``allocation``
    (``"uniform"`` or ``"global"``), and ``seconds``, the time spent on this selection (its scoring
    and error measurement; the shared forward passes not included)."""

    def __init__(
        self, arrays: dict[str, np.ndarray], selection: str, scorer: str, allocation: str = "uniform", seconds=0.0
    ):
        super().__init__(arrays)
        self.selection = selection
        self.scorer = scorer
        self.allocation = allocation
        self.seconds = float(seconds)


def relative_error(estimate: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``||estimate - reference|| / ||reference||`` over the last dim, averaged: a scalar (float64)."""
    diff = (estimate.double() - reference.double()).norm(dim=-1)
    return (diff / reference.double().norm(dim=-1).clamp_min(1e-30)).mean()


class _CorrectionErrorMeasurer:
    """Accumulates the relative errors ``[R, 3, L, Hkv]`` of one selection over one or more forward passes."""

    def __init__(
        self,
        num_layers,
        num_kv_heads,
        keep_ratios,
        query_window,
        inputs: list[ScorerInputs],
        n_sink,
        recent_window,
        moment_eviction,
        eviction_rounds,
        tau,
        allocation: str = "uniform",
    ):
        self.keep_ratios = keep_ratios
        self.query_window = query_window
        # per keep ratio, the selection scorer's inputs (built from each captured layer); ratios whose
        # scorer is the same share one object, so its scores are computed once
        self.inputs = inputs
        self.n_sink = n_sink
        self.recent_window = recent_window
        self.moment_eviction = moment_eviction
        self.eviction_rounds = eviction_rounds
        self.tau = tau
        self.allocation = allocation
        self.pending: dict[int, tuple] = {}  # layer -> captured (query, key, value, scaling): global allocation
        self.layer_sinks: dict[int, torch.Tensor | None] = {}  # layer -> its learned attention sinks [Hq]
        self.error_sums = np.zeros((len(keep_ratios), len(ORDERS), num_layers, num_kv_heads))
        self.calls = np.zeros(num_layers, dtype=np.int64)
        self.seconds = 0.0  # time spent scoring and measuring (not in the shared forward pass)

    def budget(self, prefix: int, ratio: float) -> int:
        return min(prefix, max(int(round(ratio * prefix)), 1))

    def kept_rows(
        self, h: int, keys: torch.Tensor, values: torch.Tensor, scale: float, estimate: torch.Tensor, budget: int, sums
    ) -> torch.Tensor:
        """Kept prefix rows (sorted) of KV head ``h`` (its prefix ``keys, values [P, d]``); the evicted
        ones are folded into ``sums``.  ``estimate [P]``: the scorer's ``attention()`` (moment
        eviction) or ``score()`` of the head."""
        prefix = keys.shape[0]
        if self.moment_eviction:
            every = torch.ones(prefix, dtype=torch.bool, device=keys.device)
            protected = protected_mask(every, budget, self.n_sink, self.recent_window)  # serving's
            return evict_in_rounds(
                estimate,
                keys,
                values,
                sums,
                h,
                scale,
                budget,
                rounds=self.eviction_rounds,
                protected=protected,
                tau=self.tau,
            )
        kept = select_rows(estimate, budget, self.n_sink, self.recent_window)
        evicted = torch.ones(prefix, dtype=torch.bool, device=keys.device)
        evicted[kept] = False
        sums.add(h, keys[evicted], values[evicted])
        return kept

    def _heads(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float):
        """Per KV head ``(q [G, T, d], k, v [T, d])``, and per keep ratio the estimates ``[Hkv, P]`` of
        every head of the prefix (one scorer call per distinct scorer)."""
        _, num_q_heads, total, dim = query.shape
        num_kv_heads = key.shape[1]
        group = num_q_heads // num_kv_heads
        prefix = total - self.query_window
        device = query.device
        computed: dict[int, torch.Tensor] = {}  # id(ScorerInputs) -> [Hkv, P]
        for inputs in self.inputs:
            if id(inputs) in computed:
                continue
            layer_inputs = inputs.layer(
                layer,
                key[:, :, :prefix].float(),
                value[:, :, :prefix].float(),
                torch.arange(prefix, device=device).expand(1, num_kv_heads, prefix),
                torch.ones(1, num_kv_heads, prefix, dtype=torch.bool, device=device),
                torch.full((1, num_kv_heads), prefix, dtype=torch.int64),
                [prefix],
                queries=[query[0, :, :prefix].float()],  # the prefix queries [Hq, P, d]; the scorer's window of them
                scaling=scale,
            )
            scorer = inputs.scorer
            estimate = scorer.attention(layer_inputs) if self.moment_eviction else scorer.score(layer_inputs)
            computed[id(inputs)] = estimate[0]  # [Hkv, P]
        estimates = [computed[id(inputs)] for inputs in self.inputs]  # [R] x [Hkv, P]
        heads = []
        for h in range(num_kv_heads):
            q = query[0, h * group : (h + 1) * group].float()  # [G, T, d]
            heads.append((q, key[0, h].float(), value[0, h].float()))
        return heads, estimates

    @torch.no_grad()
    def measure(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling, sinks=None
    ) -> None:
        """One layer of one window: ``query [1, Hq, T, d]``, ``key/value [1, Hkv, T, d]`` (post-RoPE), the
        layer's learned attention sinks ``sinks [Hq]`` (None: none; :mod:`runtime.math.sinks`: the exact and the
        corrected attention both take them).  Under the global allocation the layer is kept until
        :meth:`finish_window` has seen every layer."""
        started = time.perf_counter()
        self.layer_sinks[layer] = None if sinks is None else sinks.detach().float()
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        if self.allocation == "global":
            self.pending[layer] = (query.detach(), key.detach(), value.detach(), scale)
            return
        heads, estimates = self._heads(layer, query, key, value, scale)
        prefix = query.shape[2] - self.query_window
        budgets = [[self.budget(prefix, ratio) for ratio in self.keep_ratios] for _ in heads]
        self._measure_layer(layer, heads, estimates, budgets, scale)
        self.seconds += time.perf_counter() - started

    @torch.no_grad()
    def finish_window(self) -> None:
        """Global allocation: one ranking of every layer's and head's scores shares out each ratio's
        total (the uniform budgets' sum), then every captured layer is measured."""
        if self.allocation != "global":
            return
        started = time.perf_counter()
        layers = sorted(self.pending)
        captured = {layer: self.pending.pop(layer) for layer in layers}
        measured = {layer: self._heads(layer, *captured[layer]) for layer in layers}
        budgets = {layer: [[0] * len(self.keep_ratios) for _ in measured[layer][0]] for layer in layers}
        for r, ratio in enumerate(self.keep_ratios):
            scores = [list(measured[layer][1][r]) for layer in layers]  # [L] x [Hkv] x [P]
            total = sum(self.budget(int(estimate.shape[0]), ratio) for row in scores for estimate in row)
            table = global_budgets(scores, total, self.n_sink, self.recent_window)  # [L, Hkv]
            for i, layer in enumerate(layers):
                for h in range(len(measured[layer][0])):
                    budgets[layer][h][r] = int(table[i, h])
        for layer in layers:
            heads, estimates = measured[layer]
            self._measure_layer(layer, heads, estimates, budgets[layer], captured[layer][3])
        self.seconds += time.perf_counter() - started

    def _measure_layer(self, layer: int, heads, estimates, budgets: list[list[int]], scale: float) -> None:
        """The errors of one layer; ``estimates[r] [Hkv, P]``: the scores at keep ratio ``r``;
        ``budgets[h][r]``: head ``h``'s kept prefix rows at keep ratio ``r``."""
        w = self.query_window
        k0 = heads[0][1]
        total = k0.shape[0]
        prefix = total - w
        device = k0.device
        # causal masks of the W queries: over all T tokens (reference) and over the tail only
        tail_causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()  # [W, W]
        full_mask = torch.cat([torch.ones(w, prefix, dtype=torch.bool, device=device), tail_causal], dim=1)  # [W, T]
        value_dim = heads[0][2].shape[-1]  # the keys' head dim but for MiMo-V2-Flash's narrower values
        sums = [MomentSums(len(heads), k0.shape[1], device=device, value_dim=value_dim) for _ in self.keep_ratios]
        sinks, group = self.layer_sinks.get(layer), heads[0][0].shape[0]
        for h, (q, k, v) in enumerate(heads):
            tail_q = q[:, prefix:]  # [G, W, d]
            sink = None if sinks is None else sinks[h * group : (h + 1) * group].to(device)  # [G]
            reference, lse = attention_with_lse(tail_q, k, v, scale, mask=full_mask)  # [G, W, d]
            if sink is not None:
                reference = reference * sink_weight(lse, sink[:, None]).unsqueeze(-1)
            for r in range(len(self.keep_ratios)):
                kept = self.kept_rows(h, k[:prefix], v[:prefix], scale, estimates[r][h], budgets[h][r], sums[r])
                keys_R = torch.cat([k[:prefix][kept], k[prefix:]])  # [b + W, d]
                values_R = torch.cat([v[:prefix][kept], v[prefix:]])
                mask_R = torch.cat([torch.ones(w, kept.shape[0], dtype=torch.bool, device=device), tail_causal], 1)
                for o, order in enumerate(ORDERS):
                    estimate_o = corrected_attention(
                        tail_q, keys_R, values_R, sums[r], h, scale, order, tau=self.tau, mask=mask_R, sinks=sink
                    )
                    self.error_sums[r, o, layer, h] += float(relative_error(estimate_o, reference))
        self.calls[layer] += 1


def measure_correction_errors(
    model,
    windows,
    keep_ratios=(0.25, 0.5),
    query_window: int = 32,
    scorer: str | Scorer = "snapkv",
    observation_window: int = 32,
    n_sink: int = 4,
    recent_window: int = 8,
    moment_eviction: bool = False,
    eviction_rounds: int = 4,
    tau: float = 0.0,
    progress: bool = True,
    allocation: str = "uniform",
    learned=None,
) -> CorrectionErrors:
    """Per (layer, KV head) relative attention-output error of no / 0th / 1st-order correction.

    ``windows``: token ids ``[N, T]`` (tensor, array or list of equal-length lists), no
    padding.  ``keep_ratios``: fractions of the prefix ``T - query_window`` kept per head
    (e.g. 0.25 = 75% compression).  ``scorer``: the selection (a name in
    ``SELECTION_SCORERS`` or a ``runtime.scorers.Scorer``).  See the module docstring for the
    procedure.  Returns a :class:`CorrectionErrors` dict of ``errors float64 [R, 3, L, Hkv]``,
    ``order int8 [L, Hkv]`` (-1 none, 0, 1), ``reference_ratios float64 [R]``,
    ``tau float64 [L, Hkv]``, with ``.selection`` (the scorer's name) and ``.scorer`` (its repr).

    ``allocation``: ``"uniform"`` (every head keeps ``keep_ratio`` of the prefix) or ``"global"``
    (that total shared out by one ranking of every layer's and head's scores, as the runtime's
    ``allocation="global"``; for scorers whose scores compare across heads).  ``learned``: the
    artifact's ``learned_scorer`` weights ``[L, Hkv, 2d]`` and bias ``[L, Hkv]`` (arrays), needed by
    the ``"learned"`` selection.  Several selections at once, over shared forward passes:
    :func:`measure_correction_errors_by_selection`.
    """
    (result,) = measure_correction_errors_by_selection(
        model,
        windows,
        [(scorer, allocation)],
        keep_ratios=keep_ratios,
        query_window=query_window,
        observation_window=observation_window,
        n_sink=n_sink,
        recent_window=recent_window,
        moment_eviction=moment_eviction,
        eviction_rounds=eviction_rounds,
        tau=tau,
        progress=progress,
        learned=learned,
    )
    return result


def _selection_scorers(scorer, allocation, ratios, observation_window, moment_eviction, learned) -> list[Scorer]:
    """The scorer of one selection at each keep ratio, checked against the calibration's options."""
    scorers = [selection_scorer(scorer, observation_window, ratio) for ratio in ratios]
    selection = scorers[0]
    if moment_eviction and not selection.yields_attention:
        raise ValueError(
            f"moment_eviction needs a selection scorer that estimates attention (snapkv), not {selection!r}"
        )
    if allocation not in ("uniform", "global"):
        raise ValueError(f"allocation must be 'uniform' or 'global', got {allocation!r}")
    if allocation == "global" and not selection.comparable:
        raise ValueError(f"the global allocation ranks all heads' scores together; {selection!r} is not comparable")
    if allocation == "global" and moment_eviction:
        raise ValueError("the global allocation and moment_eviction cannot be combined")
    if LearnedWeights() in selection.needs and learned is None:
        raise ValueError("the learned selection needs the artifact's learned_scorer weights and bias (learned=...)")
    return scorers


def measure_correction_errors_by_selection(
    model,
    windows,
    selections,
    keep_ratios=(0.25, 0.5),
    query_window: int = 32,
    observation_window: int = 32,
    n_sink: int = 4,
    recent_window: int = 8,
    moment_eviction: bool = False,
    eviction_rounds: int = 4,
    tau: float = 0.0,
    progress: bool = True,
    learned=None,
) -> list[CorrectionErrors]:
    """:func:`measure_correction_errors` under each of ``selections``, a sequence of ``(scorer,
    allocation)`` pairs (a name in ``SELECTION_SCORERS`` or a Scorer; ``"uniform"`` or ``"global"``),
    from one captured forward pass per window shared by all of them (one measurer each).  Returns one
    :class:`CorrectionErrors` per selection, in order; each is exactly what
    :func:`measure_correction_errors` returns for that selection alone."""
    from runtime.kv_store.eager_attention import attention_forward as model_attention

    geometry = ModelGeometry.of(model)
    num_layers, num_kv_heads = geometry.num_layers, geometry.num_kv_heads
    ids = torch.as_tensor(np.asarray(windows), dtype=torch.long)
    if ids.dim() != 2 or ids.shape[0] == 0:
        raise ValueError(f"windows must be token ids [N, T] with N >= 1, got shape {tuple(ids.shape)}")
    selections = [tuple(selection) for selection in selections]
    if not selections:
        raise ValueError("no selection to calibrate the correction orders under")
    total = ids.shape[1]
    prefix = total - query_window
    ratios = tuple(float(r) for r in keep_ratios)
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"keep_ratios must be in (0, 1], got {keep_ratios}")
    scorers = [
        _selection_scorers(scorer, allocation, ratios, observation_window, moment_eviction, learned)
        for scorer, allocation in selections
    ]
    names = [(per_ratio[0].name, allocation) for per_ratio, (_, allocation) in zip(scorers, selections, strict=True)]
    if len(set(names)) != len(names):
        raise ValueError(f"a selection is given twice: {names}")
    if query_window <= 0 or observation_window <= 0 or n_sink < 0 or recent_window < 0 or tau < 0:
        raise ValueError("query_window and observation_window must be positive; n_sink, recent_window, tau >= 0")
    # the prefix holds the scorers' windows of prefix queries; one reading every query (ALL_QUERIES)
    # reads what there is
    windows_read = [recent_query_window(scorer) for per_ratio in scorers for scorer in per_ratio]
    window = max([observation_window] + [w for w in windows_read if w < ALL_QUERIES])
    if prefix < max(window, n_sink + recent_window + 1):
        raise ValueError(
            f"windows of {total} tokens leave a prefix of {prefix} after the {query_window}-token "
            f"query window: too short for observation_window={window}, "
            f"n_sink={n_sink} + recent_window={recent_window}"
        )

    measurers = []
    for per_ratio, (_, allocation) in zip(scorers, selections, strict=True):
        shared: dict[str, ScorerInputs] = {}  # repr -> inputs: ratios with the same scorer share them
        inputs = []
        for scorer in per_ratio:
            if repr(scorer) not in shared:
                weights = learned if LearnedWeights() in scorer.needs else None
                forms = rope_forms(model, scorer)  # its RoPE in each layer's form
                shared[repr(scorer)] = ScorerInputs(scorer, geometry, learned=weights, rope_forms=forms)
            inputs.append(shared[repr(scorer)])
        measurers.append(
            _CorrectionErrorMeasurer(
                num_layers,
                num_kv_heads,
                ratios,
                query_window,
                inputs,
                n_sink,
                recent_window,
                moment_eviction,
                eviction_rounds,
                tau,
                allocation=allocation,
            )
        )

    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        output = model_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer = geometry.layer_of(module)  # None: a layer held apart, never measured (Gemma 4's sliding ones)
        for measurer in measurers if layer is not None else ():
            measurer.measure(layer, query, key, value, scaling, kwargs.get("s_aux"))
        return output

    device = input_device(model)  # the embedding's: under device_map="auto" not necessarily the first parameter's
    with torch.no_grad(), attention_implementation(model, CALIBRATION_ATTENTION, attention_forward):
        for index in tqdm(range(ids.shape[0]), desc="moments calibration", unit="window", disable=not progress):
            # the decoder only: the vocabulary logits [1, T, V] are never read (6.3 GiB in float32 for a
            # 32K window at Llama-3's 128K vocabulary; docs/results.md R-profiler-scale-2026-11-27)
            model.model(input_ids=ids[index : index + 1].to(device), use_cache=False)
            for measurer in measurers:
                measurer.finish_window()
    results = []
    for measurer, per_ratio in zip(measurers, scorers, strict=True):
        if not np.all(measurer.calls == ids.shape[0]):
            raise RuntimeError(
                f"the calibration attention saw layers {measurer.calls.tolist()} times, expected "
                f"{ids.shape[0]} each (does the model route attention through AttentionInterface?)"
            )
        errors = measurer.error_sums / ids.shape[0]  # [R, 3, L, Hkv]
        order = (np.argmin(errors.mean(axis=0), axis=0) - 1).astype(np.int8)  # [L, Hkv]; ties -> none
        described = {repr(scorer) for scorer in per_ratio}
        if len(described) == 1:
            scorer_text = repr(per_ratio[0])
        else:
            scorer_text = "; ".join(f"keep {r:g}: {s!r}" for r, s in zip(ratios, per_ratio, strict=True))
        global_allocation = measurer.allocation == "global"
        results.append(
            CorrectionErrors(
                {
                    "errors": errors.astype(np.float64),
                    "order": order,
                    "reference_ratios": np.asarray(ratios, dtype=np.float64),
                    "tau": np.full((num_layers, num_kv_heads), float(tau), dtype=np.float64),
                },
                selection=per_ratio[0].name,
                scorer=scorer_text + (" with the global allocation" if global_allocation else ""),
                allocation=measurer.allocation,
                seconds=measurer.seconds,
            )
        )
    return results
