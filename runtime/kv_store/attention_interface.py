"""How a model is switched to an attention function, for a scope.

:func:`attention_implementation` is the one way this toolkit swaps a model's attention for a
scope (the runtime's ragged attention, :mod:`runtime.compression.ragged_attention`; the
profiler's decode-step capture and its MomentKV calibration; the RoPE check): it registers the
function with transformers' ``AttentionInterface`` **and** the ``sdpa`` mask builder with
``AttentionMaskInterface`` (without the mask registration transformers silently passes
``attention_mask=None``), checks that the model dispatches attention through the interface,
selects it with ``model.set_attn_implementation``, and afterwards restores the previous
implementation of every part of the model (a multimodal checkpoint's vision tower may attend otherwise
than its language model) and the function previously registered under the name (so scopes nest, and a
function built around per-scope state, e.g. a recorder passed by closure, never outlives its
scope as the active one).  Nothing is registered at import time.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from runtime.kv_store.transformers_compat import query_length
from runtime.math.geometry import check_routes_attention


def chunk_mask(**kwargs) -> torch.Tensor | None:
    """The mask builder registered with the ragged attention: transformers' ``sdpa_mask``, except for
    a one-token chunk without a padding mask, which is None (nothing hidden).

    The ragged cache's mask covers only the chunk fed (``get_mask_sizes``: kv length = the chunk's),
    so a one-token chunk's mask is that token against itself, visible under every pattern a model
    adds (causal, sliding window, packed sequences) unless a padding mask hides it.  ``sdpa_mask``
    skips it too, except while a CUDA graph is captured (transformers 5.2 builds it then, from the
    step's position tensor): the ragged attention would read that mask back to the host, which a
    capture cannot do (runtime.serve.decode_graph)."""
    from transformers.masking_utils import sdpa_mask

    query = kwargs.get("q_length", kwargs.get("cache_position"))  # 5.3 on: the length; 5.2: positions [q]
    if kwargs.get("attention_mask") is None and kwargs.get("kv_length") == 1 and query is not None:
        if query_length(query) == 1:
            return None
    return sdpa_mask(**kwargs)


def register_attention(name: str, forward) -> None:
    """Register ``forward`` as attention function ``name`` together with its mask builder
    (:func:`chunk_mask`)."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, chunk_mask)


def switch_attention(model, name: str, forward) -> str:
    """Register ``forward`` as ``name`` and select it on ``model``; returns the previous implementation."""
    check_routes_attention(model, f"the attention function {name!r}")
    register_attention(name, forward)
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    return previous


def _implementations(model) -> list[tuple[object, str | None]]:
    """``(config, its attention implementation)`` of ``model``'s config, its sub-configs and the configs of
    its sub-models: a multimodal checkpoint's parts may each have their own (a vision tower eager, the
    language model sdpa), which ``set_attn_implementation(previous)`` would make one."""
    configs, pending = {}, [model.config]
    pending += [module.config for module in model.modules() if hasattr(module, "config") and module is not model]
    while pending:
        config = pending.pop()
        if id(config) in configs or not hasattr(config, "_attn_implementation_internal"):
            continue
        configs[id(config)] = config
        pending += [getattr(config, key, None) for key in getattr(config, "sub_configs", None) or ()]
    return [(config, config._attn_implementation_internal) for config in configs.values()]


@contextmanager
def attention_implementation(model, name: str, forward):
    """``with attention_implementation(model, name, forward):`` run ``model``'s attention through
    ``forward`` (an ``AttentionInterface`` function) inside the block; see the module docstring."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = ALL_ATTENTION_FUNCTIONS.get(name)
    chosen = _implementations(model)
    try:
        previous = switch_attention(model, name, forward)
        try:
            yield model
        finally:
            if previous != name:
                model.set_attn_implementation(previous)
            for config, implementation in chosen:  # each part's own, where they differed (a vision tower's)
                config._attn_implementation_internal = implementation
    finally:
        if registered is not None and registered is not forward:
            register_attention(name, registered)
