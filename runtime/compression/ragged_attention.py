"""The ragged attention function: a model's forward pass over a :class:`~runtime.kv_store.cache.RaggedCache`.

``ragged_attention(model)`` switches a model to the ragged function ``"kvcal_ragged"`` for a
block and then restores the implementation the model had (eager, sdpa, flash...), through
:func:`runtime.kv_store.attention_interface.attention_implementation`: the runtime's own entry
points (``prefill``, ``compress_prompt``, ``generate``, ``answer``, KVzip scoring) all switch
this way, so a model handed to them comes back as it was.  Serving a compressed cache through
``model.generate`` yourself takes the same block (``with ragged_attention(model):
model.generate(..., **cache_argument(model, cache))``); ``enable(model)`` switches for good
instead.  Nothing is registered at import time.

The ragged function receives post-RoPE ``query [B, Hq, q, d]`` and the new chunk's un-repeated
``key/value [B, Hkv, q, d]``.  When the chunk was parked by a :class:`runtime.kv_store.cache.RaggedLayer`
it hands over to :meth:`RaggedLayer.attend` (each query head over its KV head's retained
tokens), then hands the layer to the eviction driver (:func:`runtime.compression.driver.after_attention`:
the decode-time evictions due); with any other cache (or none) it is exactly transformers' SDPA
attention, so an enabled model keeps working with ordinary caches.  A layer that reads an earlier layer's cache
(KV sharing: Gemma 3n, Gemma 4 E2B / E4B) is handed that layer's tagged chunk and attends as it did
(:meth:`RaggedLayer.attend_shared`); the eviction driver then runs after the last such layer.
"""

from __future__ import annotations

import numpy as np
import torch

from artifacts.fingerprint import kv_shared_layers
from runtime.compression.driver import after_attention
from runtime.kv_store.attention_interface import attention_implementation, register_attention, switch_attention
from runtime.kv_store.cache import ATTENTION_NAME, LAYER_TAG, RaggedLayer
from runtime.kv_store.eager_attention import attention_forward
from runtime.kv_store.shared_scope import shared_switch
from runtime.math.arrays import to_device

# What a model passes its attention function that the ragged attention cannot compute: a ``sinks``
# argument (Inkling's: not gpt-oss's learned logit per head, ``s_aux``, which is served) and additive
# position biases (T5-style).
UNSUPPORTED_ARGUMENTS = {
    "sinks": "attention sinks passed as sinks (only gpt-oss's learned logits, s_aux, are served)",
    "position_bias": "an additive position bias",
}


def _real_tokens(attention_mask: torch.Tensor | None, batch: int, q_len: int) -> torch.Tensor | None:
    """Which chunk tokens are real (not padding), bool ``[B, q]``; None when all are.

    The mask is the chunk's own causal + padding mask ``[B, 1, q, q]`` (see runtime.kv_store.cache):
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
    Gemma 2 / 3, Phi-3) and for Gemma 2's logit soft-capping, ``s_aux`` gpt-oss's learned attention
    sinks (a logit per query head)."""
    for name, feature in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"the ragged attention cannot compute {feature}: this model is not supported")
    sinks = kwargs.pop("s_aux", None)
    layer = getattr(key, LAYER_TAG, None)
    if layer is None:  # an ordinary cache (another thread's plain call while a kvcal call holds the switch):
        # transformers' sdpa, or the reference eager attention where sdpa cannot compute the soft-cap or sinks
        return attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            softcap=softcap,
            s_aux=sinks,
            **kwargs,
        )
    if dropout:
        raise ValueError("ragged attention does not implement attention dropout (use model.eval())")
    if sliding_window is None:  # a module that passes none where its model's mask slides (PhiMoE)
        sliding_window = layer.mask_window
    if _reads_another_layers_cache(module):  # KV sharing: the layer that computed these keys attended them first
        if sinks is not None:
            raise ValueError("the ragged attention cannot compute learned sinks in a layer reading another's cache")
        output, last = layer.attend_shared(query, window=sliding_window, softcap=softcap)
        if last:  # what follows the source layer's attention waited for the last of its readers
            after_attention(layer)
        return (output if output.is_contiguous() else output.contiguous()), None
    batch, _, q_len, dim = query.shape
    real = _real_tokens(attention_mask, batch, q_len)
    positions = kwargs.get("position_ids")
    if positions is None and q_len == 1 and real is None and layer.step_positions.given is not None:
        positions = layer.step_positions.given  # a captured step's (runtime.serve.decode_graph)
    if positions is None:  # no explicit positions (Llama 4's layers): the chunk's real tokens follow those seen
        base = to_device(np.array(layer.real_seen, dtype=np.int64), query.device).unsqueeze(1)  # no blocking copy
        positions = base + (torch.arange(q_len, device=query.device) if real is None else real.long().cumsum(1) - 1)
    if positions.shape != (batch, q_len):
        positions = positions.expand(batch, q_len)
    scale = float(scaling) if scaling is not None else dim**-0.5
    output = layer.attend(query, real, positions, scale, window=sliding_window, softcap=softcap, sinks=sinks)
    # not KVzip's scoring layer (runtime.compression.kvzip), which stores nothing; nor yet a layer whose readers
    # attend over its storage next (the last of them runs it)
    if isinstance(layer, RaggedLayer) and not layer.owes_readers:
        after_attention(layer)  # the decode-time evictions due, then the sliding-window drop
    # contiguous, as transformers' own attention functions return it (AfMoE's module views it)
    return (output if output.is_contiguous() else output.contiguous()), None


def _reads_another_layers_cache(module) -> bool:
    """Whether attention ``module`` attends to an earlier layer's keys and values instead of its own
    (``artifacts.fingerprint.kv_shared_layers``: Gemma 3n's and Gemma 4 E2B / E4B's last layers)."""
    config = getattr(module, "config", None)  # the text config: an attention module's own
    if not getattr(config, "num_kv_shared_layers", None):  # every other model, at every call: one attribute read
        return False
    return int(getattr(module, "layer_idx", -1)) in kv_shared_layers(config)


def register() -> None:
    """Register the ragged function and its mask builder with transformers (idempotent)."""
    register_attention(ATTENTION_NAME, ragged_attention_forward)


def enable(model) -> None:
    """Switch ``model`` to the ragged attention function for good (with ordinary caches it then
    computes SDPA attention, whatever the model used before); prefer ``ragged_attention(model)``."""
    switch_attention(model, ATTENTION_NAME, ragged_attention_forward)


def ragged_attention(model):
    """``with ragged_attention(model):`` enable for the block, then restore the previous one, once no other
    call (another thread's, serving the same model) is inside such a block (:func:`shared_switch`)."""
    return shared_switch(
        model, ATTENTION_NAME, lambda: attention_implementation(model, ATTENTION_NAME, ragged_attention_forward)
    )
