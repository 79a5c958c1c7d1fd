"""What the profiler needs from a model, checked up front with errors that name what is missing.

Supported: decoder-only transformers in the Llama family as transformers 5.x writes them
(Llama, Mistral, Qwen2, Qwen3, SmolLM, ...): ``model.model.layers[i].self_attn`` with a
``q_proj`` linear (and optionally a per-head ``q_norm``, as in Qwen3), RoPE applied by
``model.model.rotary_emb``, and attention dispatched through ``AttentionInterface``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedModelError(ValueError):
    """The model lacks a piece the profiler relies on (the message says which)."""


@dataclass(frozen=True)
class ModelGeometry:
    num_layers: int  # L
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # d
    query_modules: tuple[torch.nn.Module, ...]  # per layer: the module whose output is the pre-RoPE query
    query_norm: bool  # True when query_modules are per-head norms (Qwen3 style)

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def inspect_model(model) -> ModelGeometry:
    """Check ``model`` and return its attention geometry, or raise :class:`UnsupportedModelError`."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(f"{name} has no transformers config")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    missing = [attr for attr in ("num_hidden_layers", "num_attention_heads") if getattr(config, attr, None) is None]
    if missing:
        raise UnsupportedModelError(f"{name}: config lacks {', '.join(missing)}")
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    if backbone is None or layers is None:
        raise UnsupportedModelError(f"{name}: no decoder layers at model.model.layers (not a Llama-family causal LM)")
    if getattr(backbone, "rotary_emb", None) is None:
        raise UnsupportedModelError(f"{name}: no rotary embedding at model.model.rotary_emb (RoPE models only)")
    num_q_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_q_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_q_heads)
    if num_q_heads % num_kv_heads:
        raise UnsupportedModelError(f"{name}: {num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if len(layers) != config.num_hidden_layers:
        raise UnsupportedModelError(f"{name}: config says {config.num_hidden_layers} layers, model has {len(layers)}")

    query_modules, norms = [], []
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            raise UnsupportedModelError(f"{name}: layer {index} has no self_attn module")
        q_proj = getattr(attention, "q_proj", None)
        if not isinstance(q_proj, torch.nn.Linear):
            raise UnsupportedModelError(f"{name}: layer {index} attention has no q_proj linear "
                                        "(fused QKV projections are not supported)")
        if q_proj.out_features != num_q_heads * head_dim:
            raise UnsupportedModelError(f"{name}: layer {index} q_proj gives {q_proj.out_features} features, "
                                        f"expected {num_q_heads} heads x {head_dim}")
        if getattr(attention, "layer_idx", None) != index:
            raise UnsupportedModelError(f"{name}: layer {index} attention has no matching layer_idx")
        q_norm = getattr(attention, "q_norm", None)
        query_modules.append(q_norm if q_norm is not None else q_proj)
        norms.append(q_norm is not None)
    if len(set(norms)) > 1:
        raise UnsupportedModelError(f"{name}: only some layers have a query norm")
    return ModelGeometry(len(layers), num_q_heads, num_kv_heads, head_dim, tuple(query_modules),
                         bool(norms and norms[0]))
