"""A policy bound to one calibration and one model: what ``compress``, eviction and ``generate`` serve.

    plan = bind(policy, calibration, model)      # checks, loads, shape-checks and warns, once
    plan.head_budgets(seq_len)                   # int64 [L, Hkv]
    compress_prompt(model, ids, plan, context_columns=n)   # or the policy and calibration: bound there

:func:`bind` is the one place where a :class:`~runtime.plan.policy.CompressionPolicy` meets an
artifact.  In this order, before any forward pass:

1. the policy's requirements (:meth:`CompressionPolicy.missing`): the first missing piece is
   raised as a ``ValueError`` naming its section and the remedy;
2. the calibration's architecture against the model's (:func:`check_calibration_fits`: a
   calibration of another architecture is refused, no weights read);
3. every tensor the policy reads (one loader per section of :data:`runtime.plan.policy.REQUIREMENTS`),
   loaded once and shape-checked against the model's geometry (``L`` layers, ``Hq`` query heads,
   ``Hkv`` KV heads, head dim ``d``, ``G = Hq / Hkv``);
   a calibrated MomentKV correction takes the orders calibrated under the policy's own scorer
   (:meth:`runtime.plan.calibration.Calibration.correction_orders`), and only when the artifact has
   none for it the default ones, with a warning (once per calibration and scorer).

The plan then gives the per-head budgets, the correction orders, the loaded tensors the
scorer's context needs (:class:`runtime.compression.eviction.HeadEvictor` reads them) and decode-time
eviction's budgets (:meth:`ServingPlan.decode_budgets`).  Which policy to serve from an artifact's measured
recommendation (and the fallback) is :mod:`runtime.plan.recommendation`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.math.geometry import ModelGeometry
from runtime.math.rope import RopeForms
from runtime.plan.calibration import architecture_mismatch
from runtime.plan.policy import CompressionPolicy
from runtime.plan.rope_check import check_passes_rotate_alike, check_rope_for, rope_forms, rope_needs
from runtime.scorers import QueryCentres, Scorer, chunk_specs, query_statistics, recent_query_window


def check_calibration_fits(model, calibration) -> None:
    """Refuse a calibration loaded for a model of another architecture (cheap: no weights read)."""
    identity = getattr(calibration, "identity", None)
    if identity is None:
        return
    problem = architecture_mismatch(identity, model)
    if problem:
        raise ValueError(f"the calibration {getattr(calibration, 'path', '')} {problem}")


@dataclass(frozen=True, eq=False)
class ServingPlan:
    """One policy served with one calibration (None: an artifact-free policy) on one model's geometry.

    Every tensor is the one loaded and checked by :func:`bind`; a field a policy does not read is None.
    """

    policy: CompressionPolicy
    calibration: object | None
    geometry: ModelGeometry
    scorer: Scorer  # built once from the policy
    inf_weights: np.ndarray | None = None  # float64 [L, Hkv] (allocation 'inf')
    budget_curve: tuple[np.ndarray, np.ndarray] | None = None  # ratios [NR], fractions [NR, L, Hkv] ('curve')
    corrections: tuple[np.ndarray, np.ndarray] | None = None  # orders int8 [L, Hkv], tau float32 [L, Hkv]
    query_stats: tuple[torch.Tensor, torch.Tensor] | None = None  # mean [L, Hq, d], cov [L, Hq, d, d] (pre-RoPE)
    query_centres: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, Hkv, G, K, d], weights [L, Hkv, G, K]
    learned: tuple[torch.Tensor, np.ndarray] | None = None  # weights float32 [L, Hkv, 2d], bias float64 [L, Hkv]
    # each layer's RoPE form for its keys and queries, which the scorer's RoPE inputs follow (runtime.plan.rope_check)
    rope_forms: RopeForms | None = None

    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.geometry.num_kv_heads

    @property
    def evicts_in_prefill(self) -> bool:
        """Whether :func:`runtime.compression.prefill.prefill_and_compress` serves this plan: each layer's
        budgets and scores read that layer alone (its keys, recent queries and chunked attention, the
        artifact's tables), so the layer can be cut right after its attention in the prefill's
        forward pass.  Not with ``global`` allocation (one ranking of every layer's scores),
        moment-informed rounds (they re-score against sums of the whole prompt's eviction) or the
        prompt's own query statistics (the provider reads every layer's statistics at its first
        call, before the later layers ran): those prefill, then ``compress``."""
        policy = self.policy
        return (
            policy.allocation != "global" and not policy.moment_eviction and query_statistics(self.scorer) != "prompt"
        )

    @property
    def decoding_observes(self) -> bool:
        """Whether decode-time eviction reads the recorded prompt queries or the chunked attention."""
        scorer = self.scorer
        return self.policy.evict_every is not None and bool(recent_query_window(scorer) or chunk_specs(scorer))

    def head_budgets(
        self, seq_len: int, windows: list[int | None] | None = None, chunks: list[int | None] | None = None
    ) -> np.ndarray:
        """Integer tokens to keep per KV head, int64 ``[L, Hkv]``, for a context of ``seq_len`` tokens.

        ``windows``: each layer's sliding window (None: full attention; ``RaggedLayer.window``), ``chunks``
        its attention chunk (None: none; ``RaggedLayer.attention_chunk``).  A sliding-window layer holds at
        most ``W - 1`` tokens, a chunked layer those of its next query's chunk (``seq_len mod C``), so their
        heads get the budgets of a context of what they hold: a ratio is a ratio of what the layer holds.
        """
        seq_len = int(seq_len)
        windows = list(windows or ()) or [None] * self.num_layers
        chunks = list(chunks or ()) or [None] * self.num_layers
        held = [
            min(seq_len, seq_len if window is None else window - 1, seq_len if chunk is None else seq_len % chunk)
            for window, chunk in zip(windows, chunks, strict=True)
        ]
        budgets = self._budgets(seq_len)
        for length in sorted(set(held) - {seq_len}):
            layers = [index for index, n in enumerate(held) if n == length]
            budgets[layers] = self._budgets(max(length, 1))[layers]
        return budgets

    def _budgets(self, seq_len: int) -> np.ndarray:
        return self.policy.head_budgets(
            seq_len, self.num_layers, self.num_kv_heads, self.inf_weights, self.budget_curve
        )

    def decode_budgets(
        self, context_length: int, windows: list[int | None] | None = None, chunks: list[int | None] | None = None
    ) -> np.ndarray | None:
        """What decode-time eviction holds each head to, int64 ``[L, Hkv]``: its budget for a context
        of ``max(context_length, policy.budget)`` tokens (a token budget bounds each head while
        decoding even when the prompt was shorter), where a chunked layer holds up to ``C - 1`` tokens
        as a sliding window of ``C`` would.  None when the policy evicts only the prompt."""
        if self.policy.evict_every is None:
            return None
        windows = list(windows or ()) or [None] * self.num_layers
        spans = [
            window if chunk is None else min(chunk, window or chunk)
            for window, chunk in zip(windows, list(chunks or ()) or [None] * self.num_layers, strict=True)
        ]
        return self.head_budgets(max(int(context_length), self.policy.budget or 0), spans)

    def check_model(self, model) -> None:
        """Refuse serving this plan on a model of another attention shape than it was bound to."""
        theirs = ModelGeometry.of(model)
        mine = self.geometry
        if _shape(theirs) != _shape(mine):
            raise ValueError(
                f"this serving plan was bound to a model with (layers, query heads, KV heads, head dim) "
                f"{_shape(mine)}, not {_shape(theirs)}: bind the policy to this model"
            )


def _shape(geometry: ModelGeometry) -> tuple[int, int, int, int]:
    return (geometry.num_layers, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim)


def bind(policy: CompressionPolicy, calibration, model) -> ServingPlan:
    """Serve ``policy`` with ``calibration`` (None: none) on ``model`` (see the module docstring)."""
    if isinstance(policy, ServingPlan):
        raise TypeError("bind() takes a CompressionPolicy; this is already a ServingPlan")
    if not isinstance(policy, CompressionPolicy):
        hint = ""
        if isinstance(policy, str):
            hint = " (a policy's name: runtime.parse_policy(name).policy(compression_ratio))"
        raise TypeError(
            f"the policy must be a CompressionPolicy or a ServingPlan, got {type(policy).__name__} {policy!r:.60}{hint}"
        )
    scorer = policy.build_scorer()
    missing = policy.missing(calibration, scorer)
    if missing:
        raise ValueError(missing[0])
    check_calibration_fits(model, calibration)
    geometry = ModelGeometry.of(model)
    rope_keys, rope_queries = rope_needs(scorer)
    loaded = {}
    if (rope_keys or rope_queries) and isinstance(model, torch.nn.Module):  # the model's own rotation?
        check_rope_for(model, f"the {scorer.name} scorer", keys=rope_keys, queries=rope_queries)
        loaded["rope_forms"] = rope_forms(model)
        if policy.evict_every is not None:  # keys of the prefill and of decode steps, un-rotated together
            what = f"decode-time eviction (evict_every={policy.evict_every})"
            remedy = "evict only the prompt (evict_every=None)"
            check_passes_rotate_alike(type(model).__name__, geometry, scorer, None, what, remedy)
    for requirement in policy.requirements(scorer):
        loaded.update(_LOADERS[requirement.section](scorer, calibration, geometry))
    if policy.correction in ("order0", "order1"):
        loaded["corrections"] = _uniform_corrections(policy, geometry)
    if loaded.get("corrections") is not None and policy.tau is not None:
        orders, _ = loaded["corrections"]
        loaded["corrections"] = (orders, np.full(orders.shape, policy.tau, dtype=np.float32))
    return ServingPlan(policy, calibration, geometry, scorer, **loaded)


def as_plan(policy: CompressionPolicy | ServingPlan | None, calibration, model) -> ServingPlan | None:
    """What an entry point taking ``policy`` (a policy, a plan or None) and ``calibration`` serves:
    a plan as it is (its calibration is the one it was bound to), a policy bound here, None as None
    (a given calibration still has to fit the model)."""
    if policy is None:
        check_calibration_fits(model, calibration)
        return None
    if isinstance(policy, ServingPlan):
        if calibration is not None and calibration is not policy.calibration:
            raise ValueError(
                "a ServingPlan is served with the calibration it was bound to: pass calibration=None "
                "(or bind the policy to this calibration)"
            )
        policy.check_model(model)
        return policy
    return bind(policy, calibration, model)


# -- one loader per section of runtime.plan.policy.REQUIREMENTS: read it once, check it against the model --


def _load_inf(scorer, calibration, geometry) -> dict:
    weights = np.asarray(calibration.inf_weights, dtype=np.float64)  # [L, Hkv]
    L, Hkv = geometry.num_layers, geometry.num_kv_heads
    if weights.shape != (L, Hkv):
        raise ValueError(f"INF weights have shape {weights.shape}, the model has [{L}, {Hkv}] KV heads")
    return {"inf_weights": weights}


def _load_curve(scorer, calibration, geometry) -> dict:
    ratios, fractions = calibration.budget_curve  # [NR], [NR, L, Hkv]
    L, Hkv = geometry.num_layers, geometry.num_kv_heads
    if np.asarray(fractions).shape[1:] != (L, Hkv):
        raise ValueError(
            f"the budget curve has shape {np.asarray(fractions).shape[1:]}, the model [{L}, {Hkv}] KV heads"
        )
    return {"budget_curve": (ratios, fractions)}


def _load_statistics(mean, cov, geometry, section: str) -> tuple[torch.Tensor, torch.Tensor]:
    mean, cov = torch.from_numpy(np.asarray(mean)), torch.from_numpy(np.asarray(cov))  # [L, Hq, d], [L, Hq, d, d]
    L, Hq, d = geometry.num_layers, geometry.num_q_heads, geometry.head_dim
    if tuple(mean.shape) != (L, Hq, d) or tuple(cov.shape) != (L, Hq, d, d):
        raise ValueError(
            f"calibration statistics do not match the model's layers / query heads: section '{section}' holds "
            f"means {tuple(mean.shape)} and covariances {tuple(cov.shape)}, the model needs [{L}, {Hq}, {d}] "
            f"and [{L}, {Hq}, {d}, {d}]"
        )
    return mean, cov


def _load_query_stats(scorer, calibration, geometry) -> dict:
    return {"query_stats": _load_statistics(calibration.query_mean, calibration.query_cov, geometry, "query_stats")}


def _load_future(scorer, calibration, geometry) -> dict:
    loaded = {}
    if query_statistics(scorer) == "future":
        stats = _load_statistics(calibration.future_mean, calibration.future_cov, geometry, "future_queries")
        loaded["query_stats"] = stats
    if QueryCentres() in scorer.needs:
        centres = torch.from_numpy(np.asarray(calibration.future_centres, dtype=np.float32))  # [L, Hq, K, d]
        weights = torch.from_numpy(np.asarray(calibration.future_centre_weights, dtype=np.float32))  # [L, Hq, K]
        L, Hq, Hkv, d = geometry.num_layers, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim
        if tuple(centres.shape[:2]) != (L, Hq) or centres.shape[-1] != d or tuple(weights.shape) != centres.shape[:3]:
            raise ValueError(
                f"future-query centres of shape {tuple(centres.shape)} do not fit the model ({L} "
                f"layers, {Hq} query heads, d={d})"
            )
        k = centres.shape[2]
        loaded["query_centres"] = (
            centres.reshape(L, Hkv, geometry.group_size, k, d),
            weights.reshape(L, Hkv, geometry.group_size, k),
        )
    return loaded


def _load_moments(scorer, calibration, geometry) -> dict:
    # the orders calibrated under the policy's own scorer; without them the default ones (and a warning)
    by_scorer = getattr(calibration, "correction_orders", None)
    orders = by_scorer(scorer.name) if by_scorer is not None else calibration.moment_orders
    orders = np.asarray(orders, dtype=np.int8)  # [L, Hkv]
    tau = np.asarray(calibration.moment_tau, dtype=np.float32)  # [L, Hkv]
    shape = (geometry.num_layers, geometry.num_kv_heads)
    if orders.shape != shape or tau.shape != shape:
        raise ValueError(f"the artifact's moments section has shape {orders.shape}, the model {shape}")
    return {"corrections": (orders, tau)}


def _uniform_corrections(policy, geometry) -> tuple[np.ndarray, np.ndarray]:
    shape = (geometry.num_layers, geometry.num_kv_heads)
    return np.full(shape, 0 if policy.correction == "order0" else 1, dtype=np.int8), np.zeros(shape, dtype=np.float32)


def _load_learned(scorer, calibration, geometry) -> dict:
    weights = torch.from_numpy(np.asarray(calibration.scorer_weights, dtype=np.float32))  # [L, Hkv, d + dv]
    L, Hkv, d, dv = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, geometry.value_head_dim
    bias = np.asarray(calibration.scorer_bias, dtype=np.float64)  # [L, Hkv]
    if tuple(weights.shape) != (L, Hkv, d + dv) or bias.shape != (L, Hkv):
        raise ValueError(
            f"learned scorer weights of shape {tuple(weights.shape)} (bias {bias.shape}) do not fit the model "
            f"({L} layers, {Hkv} KV heads, d={d}, values of {dv})"
        )
    return {"learned": (weights, bias)}


_LOADERS = {
    "budgets": _load_inf,
    "budget_curves": _load_curve,
    "query_stats": _load_query_stats,
    "future_queries": _load_future,
    "moments": _load_moments,
    "learned_scorer": _load_learned,
}
