"""The ragged attention function, and how a model is switched to an attention function.

:func:`attention_implementation` is the one way this toolkit swaps a model's attention for a
scope (the runtime's ragged attention, the profiler's decode-step capture and its MomentKV
calibration): it registers the function with transformers' ``AttentionInterface`` **and**
the ``sdpa`` mask builder with ``AttentionMaskInterface`` (without the mask registration
transformers silently passes ``attention_mask=None``), checks that the model dispatches
attention through the interface, selects it with ``model.set_attn_implementation``, and
afterwards restores the previous implementation and the function previously registered
under the name (so scopes nest, and a function built around per-scope state, e.g. a
recorder passed by closure, never outlives its scope as the active one).

``ragged_attention(model)`` switches a model to the ragged function ``"kvcal_ragged"`` for a
block and then restores the implementation the model had (eager, sdpa, flash...): the runtime's
own entry points (``prefill``, ``compress_prompt``, ``generate``, ``answer``, KVzip scoring) all
switch this way, so a model handed to them comes back as it was.  Serving a compressed cache
through ``model.generate`` yourself takes the same block (``with ragged_attention(model):
model.generate(..., **cache_argument(model, cache))``); ``enable(model)`` switches for good instead.
Nothing is registered at import time.

The ragged function receives post-RoPE ``query [B, Hq, q, d]`` and the new chunk's un-repeated
``key/value [B, Hkv, q, d]``.  When the chunk was parked by a :class:`runtime.cache.RaggedLayer`
it hands over to :meth:`RaggedLayer.attend` (each query head over its KV head's retained
tokens); with any other cache (or none) it is exactly transformers' SDPA attention, so an
enabled model keeps working with ordinary caches.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from .cache import ATTENTION_NAME, LAYER_TAG, RaggedLayer
from .eviction_driver import after_attention
from .layout import to_device
from .transformers_compat import query_length

# What a model passes its attention function that the ragged attention cannot compute: learned
# attention sinks (gpt-oss's ``s_aux``, ``sinks``) and additive position biases (T5-style).
UNSUPPORTED_ARGUMENTS = {
    "s_aux": "learned attention sinks (s_aux)",
    "sinks": "learned attention sinks",
    "position_bias": "an additive position bias",
}


def _real_tokens(attention_mask: torch.Tensor | None, batch: int, q_len: int) -> torch.Tensor | None:
    """Which chunk tokens are real (not padding), bool ``[B, q]``; None when all are.

    The mask is the chunk's own causal + padding mask ``[B, 1, q, q]`` (see runtime.cache):
    a token is real exactly when it may attend to itself, i.e. on the diagonal.
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4 or attention_mask.shape[-1] != q_len or attention_mask.shape[-2] != q_len:
        raise ValueError(
            f"ragged attention expects the chunk's own [B, 1, q, q] mask, got "
            f"{tuple(attention_mask.shape)} for q={q_len}"
        )
    diagonal = attention_mask[:, 0].diagonal(dim1=-2, dim2=-1)  # [B or 1, q]
    real = diagonal if diagonal.dtype == torch.bool else diagonal == 0
    return real.expand(batch, q_len)


def ragged_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """AttentionInterface function: ``(out [B, q, Hq, d], None)``.  ``sliding_window`` and
    ``softcap`` are what transformers' models pass for a sliding-window layer (Mistral, Qwen2,
    Gemma 2 / 3, Phi-3) and for Gemma 2's logit soft-capping."""
    for name, feature in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"the ragged attention cannot compute {feature}: this model is not supported")
    layer = getattr(key, LAYER_TAG, None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if softcap is not None:
            raise ValueError(
                "ragged attention over an ordinary cache cannot soft-cap attention logits: serve this model "
                "with a RaggedCache (runtime.generate / compress_prompt), or with its own eager attention"
            )
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout:
        raise ValueError("ragged attention does not implement attention dropout (use model.eval())")
    batch, _, q_len, dim = query.shape
    real = _real_tokens(attention_mask, batch, q_len)
    positions = kwargs.get("position_ids")
    if positions is None:  # no explicit positions: the chunk follows the real tokens seen
        base = to_device(np.array(layer.real_seen, dtype=np.int64), query.device).unsqueeze(1)  # no blocking copy
        positions = base + torch.arange(q_len, device=query.device)
    if positions.shape != (batch, q_len):
        positions = positions.expand(batch, q_len)
    scale = float(scaling) if scaling is not None else dim**-0.5
    if sliding_window is None:  # a module that passes none where its model's mask slides (PhiMoE)
        sliding_window = layer.mask_window
    output = layer.attend(query, real, positions, scale, window=sliding_window, softcap=softcap)
    if isinstance(layer, RaggedLayer):  # not KVzip's scoring layer (runtime.kvzip), which stores nothing
        after_attention(layer)  # the decode-time evictions due, then the sliding-window drop
    # contiguous, as transformers' own attention functions return it (AfMoE's module views it)
    return (output if output.is_contiguous() else output.contiguous()), None


def chunk_mask(**kwargs) -> torch.Tensor | None:
    """The mask builder registered with the ragged attention: transformers' ``sdpa_mask``, except for
    a one-token chunk without a padding mask, which is None (nothing hidden).

    The ragged cache's mask covers only the chunk fed (``get_mask_sizes``: kv length = the chunk's),
    so a one-token chunk's mask is that token against itself, visible under every pattern a model
    adds (causal, sliding window, packed sequences) unless a padding mask hides it.  ``sdpa_mask``
    skips it too, except while a CUDA graph is captured (transformers 5.2 builds it then, from the
    step's position tensor): the ragged attention would read that mask back to the host, which a
    capture cannot do (runtime.decode_graph)."""
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


def _switch(model, name: str, forward) -> str:
    """Register ``forward`` as ``name`` and select it on ``model``; returns the previous implementation."""
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise ValueError(
            f"{type(model).__name__} does not route attention through transformers' "
            f"AttentionInterface, so the attention function {name!r} cannot be switched in"
        )
    register_attention(name, forward)
    previous = model.config._attn_implementation
    if previous != name:
        model.set_attn_implementation(name)
    return previous


@contextmanager
def attention_implementation(model, name: str, forward):
    """``with attention_implementation(model, name, forward):`` run ``model``'s attention through
    ``forward`` (an ``AttentionInterface`` function) inside the block; see the module docstring."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    registered = ALL_ATTENTION_FUNCTIONS.get(name)
    try:
        previous = _switch(model, name, forward)
        try:
            yield model
        finally:
            if previous != name:
                model.set_attn_implementation(previous)
    finally:
        if registered is not None and registered is not forward:
            register_attention(name, registered)


def register() -> None:
    """Register the ragged function and its mask builder with transformers (idempotent)."""
    register_attention(ATTENTION_NAME, ragged_attention_forward)


def enable(model) -> None:
    """Switch ``model`` to the ragged attention function for good (with ordinary caches it then
    computes SDPA attention, whatever the model used before); prefer ``ragged_attention(model)``."""
    _switch(model, ATTENTION_NAME, ragged_attention_forward)


def ragged_attention(model):
    """``with ragged_attention(model):`` enable for the block, then restore the previous one."""
    return attention_implementation(model, ATTENTION_NAME, ragged_attention_forward)
