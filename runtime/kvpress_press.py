"""kvcal's calibrated per-head eviction as a press of NVIDIA's kvpress (the ``kvpress`` extra).

    from kvpress import pipeline                     # kvpress 0.5.5: pip install -e ".[kvpress]"
    from runtime import load_calibration
    from runtime.kvpress_press import CalibratedPress

    calibration = load_calibration(model, tokenizer, path="out/kv_calibration.h5")
    press = CalibratedPress(calibration, compression_ratio=0.75)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question=question, press=press)["answer"]

This module is the only one that imports kvpress; nothing in kvcal's core imports it
(``tests/test_kvpress_press.py`` checks both).  See :class:`CalibratedPress` for what kvpress can
and cannot express.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch
from kvpress.presses.base_press import BasePress

from artifacts.fingerprint import attention_chunk, kv_shared_layers
from common.checks import is_number
from runtime.compression.eviction import HeadEvictor
from runtime.compression.keep_rule import keep_mask
from runtime.math.chunk_attention import ChunkAttention
from runtime.math.geometry import past_the_chunk, text_config
from runtime.plan.policy import CompressionPolicy
from runtime.plan.recommendation import recommended_spec
from runtime.plan.serving_plan import ServingPlan, bind
from runtime.scorers import chunk_specs, query_statistics, recent_query_window

_USE_THE_RUNTIME = "serve it with kvcal's own runtime (runtime.answer / runtime.generate) instead"


def policy_for_kvpress(calibration, compression_ratio: float) -> CompressionPolicy:
    """The policy the artifact serves at ``compression_ratio`` (``calibration.policy``), less its
    MomentKV correction, which kvpress cannot apply: ``inf/leverage+correction`` becomes
    ``inf/leverage``."""
    policy = recommended_spec(calibration, compression_ratio).policy(compression_ratio)
    if policy.correction != "none":
        policy = replace(policy, correction="none", tau=None)
    return policy


def kvpress_refusal(policy: CompressionPolicy) -> str | None:
    """Why kvpress cannot serve ``policy`` (one sentence naming what to use instead), or None."""
    if policy.correction != "none":
        what = f"the MomentKV correction (correction={policy.correction!r})"
    elif policy.moment_eviction:
        what = "moment-informed eviction (moment_eviction=True)"
    elif policy.evict_every is not None:
        what = f"decode-time eviction (evict_every={policy.evict_every}): kvpress compresses the prefill only"
    elif policy.allocation == "global":
        what = "allocation 'global' (one ranking over every layer's heads before any layer is cut)"
    elif policy.compression_ratio is None:
        what = "a token or keep-ratio budget: a kvpress press takes a compression_ratio"
    else:
        scorer = policy.build_scorer()
        if query_statistics(scorer) == "prompt":
            what = f"{scorer!r} (the prompt's own query statistics, gathered over the whole prefill)"
        elif getattr(scorer, "name", "") == "kvzip":
            what = "KVzip (a reconstruction pass per prompt)"
        else:
            return None
    return f"kvpress cannot apply {what}; {_USE_THE_RUNTIME}"


@dataclass
class CalibratedPress(BasePress):
    """A kvpress press that evicts per KV head exactly as kvcal's runtime does for one policy.

    ``calibration``: what :func:`runtime.load_calibration` returns; ``compression_ratio``: the
    fraction of the context's KV cache evicted (kvpress's meaning, and kvcal's); ``policy``: a
    :class:`~runtime.plan.policy.CompressionPolicy` (its ``compression_ratio`` replaced by this one), by
    default what the artifact serves at that ratio without the correction
    (:func:`policy_for_kvpress`; the flagship ``inf/leverage+correction`` becomes ``inf/leverage``).

    At the end of the context's prefill, in each attention layer's forward hook, every KV head
    gets the budget kvcal's runtime gives it (:meth:`runtime.plan.serving_plan.ServingPlan.head_budgets`
    for the context's length: INF weights or the budget curve, ``[L, Hkv]`` tokens, together
    ``(1 - compression_ratio)`` of the layer's rows up to rounding), the policy's scorer scores the
    layer's keys (:class:`runtime.scorers.ScorerInputs`, from the artifact's tensors as
    :func:`runtime.plan.serving_plan.bind` loads them), and :func:`runtime.compression.keep_rule.keep_mask` keeps the
    sinks, the recent window and the best-scored rows: the same rows the runtime keeps.  What the
    runtime records during its own prefill is recomputed in the hook from what kvpress hands it:
    the layer's post-RoPE queries (``q_proj`` or a fused ``qkv_proj``'s query rows, the model's norm
    before RoPE and its own RoPE, as
    kvpress's presses recompute them) for Compactor's chunked attention
    (:class:`runtime.math.chunk_attention.ChunkAttention`, the runtime's accumulation) and SnapKV's
    last queries.

    What kvpress cannot express, refused with a ``ValueError`` (use kvcal's runtime for these):
    the MomentKV correction (kvpress's attention has no per-head correction term), decode-time
    eviction (kvpress presses compress the prefill), moment-informed eviction, ``global``
    allocation, the prompt's own query statistics, KVzip's reconstruction pass.  And what it does
    differently: kvpress's head-wise mechanism (its AdaKV press's) *masks* the evicted rows of each
    head (``module.masked_key_indices``: their keys are replaced by a fake key whose attention
    weight underflows to zero) and keeps every row in memory, so the answers are those of the
    per-head budgets but the memory is the uncompressed cache's; kvcal's ``RaggedCache`` frees it.
    The masking works in kvpress's patched attention functions (sdpa, flash...), not in
    transformers' eager attention, so an eager model is refused.
    """

    calibration: object = None
    compression_ratio: float = 0.75
    policy: CompressionPolicy | None = None
    plan: ServingPlan | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.calibration is None:
            raise ValueError("CalibratedPress needs a calibration: runtime.load_calibration(model, tokenizer, path=..)")
        if self.policy is not None and not isinstance(self.policy, CompressionPolicy):
            raise TypeError(f"policy must be a CompressionPolicy, got {type(self.policy).__name__}")
        self._requested = self.policy  # None: the artifact's own at each ratio
        self._resolve_policy()

    def _resolve_policy(self) -> None:
        """The policy served at the press's ``compression_ratio`` (checked, refused where kvpress cannot
        serve it); called again when kvpress (or a user) sets ``compression_ratio`` after construction."""
        ratio = self.compression_ratio
        if not is_number(ratio) or not 0.0 <= float(ratio) < 1.0:  # np.float32(0.5) is a number; True is not
            raise ValueError(f"compression_ratio (the fraction evicted) must be a number in [0, 1), got {ratio!r}")
        requested = self._requested
        if requested is None:
            policy = policy_for_kvpress(self.calibration, float(ratio))
        elif requested.compression_ratio is None:
            raise ValueError(kvpress_refusal(requested))
        else:
            policy = replace(requested, compression_ratio=float(ratio))
        reason = kvpress_refusal(policy)
        if reason:
            raise ValueError(reason)
        missing = policy.missing(self.calibration)
        if missing:
            raise ValueError(missing[0])
        self.policy, self.plan = policy, None

    def post_init_from_model(self, model):
        """Bind the policy to the calibration and this model (kvpress calls this on entering the press)."""
        if kv_shared_layers(model.config):  # Gemma 3n, Gemma 4 E2B / E4B
            raise ValueError(
                "kvpress masks evicted rows per attention module, and this model's last layers attend to an earlier "
                f"layer's cache, which they would read whole; {_USE_THE_RUNTIME}"
            )
        if model.config._attn_implementation == "eager":
            if getattr(type(model), "_supports_sdpa", True) is False:  # gpt-oss: its learned sinks
                raise ValueError(
                    "kvpress masks evicted rows per head only in its patched attention functions, and transformers "
                    f"gives {type(model).__name__} no sdpa attention (it runs eager); {_USE_THE_RUNTIME}"
                )
            raise ValueError(
                "kvpress masks evicted rows per head only in its patched attention functions, not in eager "
                "attention: load the model with attn_implementation='sdpa'"
            )
        if self.policy.compression_ratio != self.compression_ratio:  # set after construction (kvpress's harness does)
            self._resolve_policy()
        if self.plan is None or self.plan.geometry.num_layers != text_config(model.config).num_hidden_layers:
            self.plan = bind(self.policy, self.calibration, model)
        else:
            self.plan.check_model(model)
        if any(window is not None for window in self.plan.geometry.sliding_windows):
            raise ValueError(f"kvpress's cache holds every token of a sliding-window layer; {_USE_THE_RUNTIME}")
        self._evictor = HeadEvictor(self.plan)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """Mark, per KV head, the rows kvcal's runtime would evict (``module.masked_key_indices``).

        ``hidden_states [B, T, D]``; ``keys, values [B, Hkv, T, d]`` (post-RoPE, the whole context);
        the keys and values are returned unchanged (kvpress masks; see the class docstring)."""
        if self.compression_ratio == 0 or self.plan.geometry.layer_of(module) is None:  # None: a layer held
            return keys, values  # apart from the artifact's, never evicted (Gemma 4's sliding ones)
        chunk = attention_chunk(self.plan.geometry.text_config)
        if chunk is not None and keys.shape[2] > chunk:
            raise ValueError(
                f"a context of {keys.shape[2]} tokens is past {past_the_chunk(chunk)}, which the press does not "
                f"score as they attend; {_USE_THE_RUNTIME}, or shorten the context"
            )
        keep = self.kept_rows(module, hidden_states, keys, values, kwargs)  # [B, Hkv, T]
        module.masked_key_indices = torch.nonzero(~keep, as_tuple=True)  # (batch, head, row), as AdaKV's
        return keys, values

    @torch.no_grad()
    def kept_rows(self, module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        """bool ``[B, Hkv, T]``: the rows of layer ``module.layer_idx`` kvcal's runtime keeps."""
        plan, policy = self.plan, self.policy
        layer = plan.geometry.layer_of(module)
        batch, heads, length, _ = keys.shape
        scorer = plan.scorer
        queries = None
        window, specs = recent_query_window(scorer), chunk_specs(scorer)
        if window or specs:
            geometry = plan.geometry
            queries = _post_rope_queries(
                geometry.query_projections[layer], geometry.query_scales[layer], module, hidden_states, kwargs
            )
        scaling = plan.geometry.scalings[layer]
        chunk_attention = None
        if specs:
            chunk_attention = []
            for b in range(batch):
                accumulated = {}
                for spec in specs:  # the runtime's accumulation over the context's one forward pass
                    accumulated[spec] = ChunkAttention(spec)
                    accumulated[spec].add(queries[b], keys[b], scaling)
                chunk_attention.append(accumulated)
        positions = torch.arange(length, device=keys.device).expand(batch, heads, length)  # [B, Hkv, T]
        valid = torch.ones(batch, heads, length, dtype=torch.bool, device=keys.device)
        inputs = self._evictor.inputs.layer(
            layer,
            keys,
            values,
            positions,
            valid,
            torch.full((batch, heads), length, dtype=torch.int64),
            [length] * batch,
            queries=None if queries is None else [queries[b] for b in range(batch)],
            chunk_attention=chunk_attention,
            stats_rows=list(range(batch)),
        )
        scores = self._evictor.checked_scores(scorer.score(inputs), valid, layer)  # [B, Hkv, T]
        budgets = torch.as_tensor(plan.head_budgets(length)[layer]).expand(batch, heads)  # int64 [B, Hkv]
        return keep_mask(scores, valid, budgets, policy.n_sink, policy.window)

    def head_budgets(self, context_length: int):
        """int64 ``[L, Hkv]``: the rows each KV head keeps of a context of ``context_length`` tokens."""
        if self.plan is None:
            raise ValueError("the press is bound to a model when kvpress enters it (with press(model): ...)")
        return self.plan.head_budgets(context_length)


def _post_rope_queries(projection, scale, module, hidden_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """The layer's post-RoPE queries ``[B, Hq, T, d]`` from its input ``hidden_states [B, T, D]``: the
    geometry's pre-RoPE read of them (``projection``: the layer's ``q_proj``, or the query rows of a fused
    ``qkv_proj`` as Phi-3's, through the norm the model applies before RoPE, in the model's layout,
    :class:`runtime.math.geometry.Projection`), rotated by
    the model's own ``apply_rotary_pos_emb`` with the ``position_embeddings`` the forward pass was given,
    on the dimensions they turn (a partial RoPE passes the others: Phi-2 and StableLM split them in the
    attention's forward, not in ``apply_rotary_pos_emb``), times the weight of a norm the model applies
    after RoPE (HunYuan; :attr:`runtime.math.geometry.Projection.weight_after_rope`) and the factor it scales
    a query by at its position (``scale``, :class:`runtime.math.geometry.QueryScale`: Ministral 3; the
    context's prefill starts at position 0)."""
    queries = projection.take(projection.module(hidden_states)).transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
    turned, passed = queries[..., : cos.shape[-1]], queries[..., cos.shape[-1] :]
    rotated = torch.cat([rotate(turned, turned, cos, sin)[0], passed], dim=-1)
    weight = projection.weight_after_rope  # HunYuan normalises after RoPE: the read is normalised, weighted here
    if weight is not None:
        rotated = rotated * weight.to(rotated.dtype)
    if scale is not None:
        positions = torch.arange(rotated.shape[2], device=rotated.device)
        rotated = rotated * scale(positions).to(rotated.dtype)[:, None]
    return rotated
