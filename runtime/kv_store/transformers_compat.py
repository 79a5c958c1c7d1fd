"""The one place that knows how the transformers versions kvcal supports differ.

transformers 5.24 renamed the KV-cache argument of every model's ``forward``, of
``prepare_inputs_for_generation`` and therefore of ``generate`` from ``past_key_values`` to
``cache`` (the old name still works there until 5.40, with a ``FutureWarning`` at every call);
5.2 - 5.23 know only ``past_key_values``.  Callers pass the cache as
``model(ids, **cache_argument(model, cache))`` so that no version warns and none refuses.
And a cache layer's ``get_mask_sizes`` is handed the chunk's length from 5.3 on, its
``cache_position`` tensor in 5.2 (:func:`query_length` reads either).  A hybrid model's recurrent
states live in ``cache_utils.LinearAttentionLayer`` where transformers has it (not 5.2, whose hybrid
models keep them in cache classes of their own, refused: ``runtime.math.geometry``);
:data:`LinearAttentionLayer` is None there.

The name is read from the model's own ``forward`` signature (``deprecate_kwarg`` keeps the
wrapped signature visible through ``functools.wraps``), so a model class that still takes
``past_key_values`` (remote code) gets it too.
"""

from __future__ import annotations

import functools
import inspect

import torch

try:
    from transformers.cache_utils import LinearAttentionLayer
except ImportError:  # transformers 5.2
    LinearAttentionLayer = None

LEGACY_CACHE_NAME = "past_key_values"
CACHE_NAME = "cache"


@functools.cache
def _cache_name_for(forward_owner: type) -> str:
    parameters = inspect.signature(forward_owner.forward).parameters
    if CACHE_NAME in parameters:
        return CACHE_NAME
    return LEGACY_CACHE_NAME


def cache_name(model) -> str:
    """The keyword ``model.forward`` (and ``model.generate``) takes its KV cache by."""
    return _cache_name_for(type(model))


def cache_argument(model, cache_object) -> dict:
    """``{name: cache_object}`` for ``model(..., **cache_argument(model, cache))`` or ``generate``."""
    return {cache_name(model): cache_object}


def query_length(query: int | torch.Tensor) -> int:
    """The chunk length a cache layer's ``get_mask_sizes`` is asked about: newer transformers pass
    the length itself, 5.2 passes the chunk's ``cache_position`` tensor ``[q]``."""
    if isinstance(query, torch.Tensor):
        return int(query.shape[0])
    return int(query)
