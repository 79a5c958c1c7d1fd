"""A loaded model's attention geometry, worked out once and checked, with errors that name what is missing.

    geometry = ModelGeometry.of(model)      # raises UnsupportedModelError with the reason
    geometry.num_layers, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim
    geometry.query_modules[layer]           # hook it: its output is the pre-RoPE query [B, T, Hq * d]
    geometry.rotary(x, position_ids)        # the model's own RoPE cos/sin

Supported: decoder-only transformers in the Llama family as transformers 5.x writes them
(Llama, Mistral, Qwen2, Qwen3, SmolLM, ...): ``model.model.layers[i].self_attn`` with a
``q_proj`` linear (and optionally a per-head ``q_norm``, as in Qwen3), RoPE applied by
``model.model.rotary_emb``, and attention dispatched through ``AttentionInterface``.

The config numbers (``L``, ``Hq``, ``Hkv``, ``d``) and the query-norm flag are read by
``artifacts.fingerprint`` (:func:`~artifacts.fingerprint.attention_numbers`,
:func:`~artifacts.fingerprint.has_query_norm`), the same functions that make the artifact's
architecture fingerprint, so the runtime, the profiler and the artifact identity cannot
disagree; this module checks the modules against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from artifacts.fingerprint import attention_numbers, has_query_norm, text_config


class UnsupportedModelError(ValueError):
    """The model lacks a piece the toolkit relies on (the message says which)."""


@dataclass(frozen=True, eq=False)
class ModelGeometry:
    """What the profiler and the runtime need to know about a model's attention (see module doc)."""

    num_layers: int  # L
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # d
    scalings: tuple[float, ...]  # per layer: the attention scale s (module.scaling, else 1/sqrt(d))
    attention_modules: tuple[torch.nn.Module, ...]  # per layer: model.model.layers[i].self_attn
    query_modules: tuple[torch.nn.Module, ...]  # per layer: the module whose output is the pre-RoPE query
    query_norm: bool  # True when query_modules are per-head norms (Qwen3 style q_norm)
    rotary: torch.nn.Module = field(repr=False)  # model.model.rotary_emb
    text_config: object = field(repr=False)  # the (text) transformers config

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group), ``G = Hq / Hkv``."""
        return self.num_q_heads // self.num_kv_heads

    @classmethod
    def of(cls, model) -> ModelGeometry:
        """Check ``model`` and return its geometry, or raise :class:`UnsupportedModelError`.

        A :class:`ModelGeometry` is returned as it is, so functions may take either.
        """
        if isinstance(model, ModelGeometry):
            return model
        name = type(model).__name__
        config = getattr(model, "config", None)
        if config is None:
            raise UnsupportedModelError(f"{name} has no transformers config")
        config = text_config(config)
        try:
            numbers = attention_numbers(config)
        except ValueError as exc:
            raise UnsupportedModelError(f"{name}: {exc}") from None
        num_q_heads, num_kv_heads, head_dim = numbers["num_q_heads"], numbers["num_kv_heads"], numbers["head_dim"]
        backbone = getattr(model, "model", None)
        layers = getattr(backbone, "layers", None)
        if backbone is None or layers is None:
            raise UnsupportedModelError(
                f"{name}: no decoder layers at model.model.layers (not a Llama-family causal LM)"
            )
        rotary = getattr(backbone, "rotary_emb", None)
        if rotary is None:
            raise UnsupportedModelError(f"{name}: no rotary embedding at model.model.rotary_emb (RoPE models only)")
        if num_q_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"{name}: {num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads"
            )
        if len(layers) != numbers["num_layers"]:
            raise UnsupportedModelError(f"{name}: config says {numbers['num_layers']} layers, model has {len(layers)}")

        query_norm = has_query_norm(model)
        attention_modules, query_modules, scalings = [], [], []
        for index, layer in enumerate(layers):
            attention = getattr(layer, "self_attn", None)
            if attention is None:
                raise UnsupportedModelError(f"{name}: layer {index} has no self_attn module")
            q_proj = getattr(attention, "q_proj", None)
            if not isinstance(q_proj, torch.nn.Linear):
                raise UnsupportedModelError(
                    f"{name}: layer {index} attention has no q_proj linear (fused QKV projections are not supported)"
                )
            if q_proj.out_features != num_q_heads * head_dim:
                raise UnsupportedModelError(
                    f"{name}: layer {index} q_proj gives {q_proj.out_features} features, "
                    f"expected {num_q_heads} heads x {head_dim}"
                )
            if getattr(attention, "layer_idx", None) != index:
                raise UnsupportedModelError(f"{name}: layer {index} attention has no matching layer_idx")
            q_norm = getattr(attention, "q_norm", None)
            if (q_norm is not None) != query_norm:
                raise UnsupportedModelError(
                    f"{name}: only some layers have a query norm "
                    f"(layer {index} {'has' if q_norm is not None else 'has no'} q_norm)"
                )
            attention_modules.append(attention)
            query_modules.append(q_norm if query_norm else q_proj)
            scalings.append(float(getattr(attention, "scaling", head_dim**-0.5)))
        return cls(
            num_layers=len(layers),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scalings=tuple(scalings),
            attention_modules=tuple(attention_modules),
            query_modules=tuple(query_modules),
            query_norm=query_norm,
            rotary=rotary,
            text_config=config,
        )
