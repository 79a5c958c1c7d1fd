"""Whether a model rotates its queries and keys as :mod:`runtime.rope` assumes, read off the model itself.

kvcal's RoPE math (un-rotating cached keys for the leverage and learned scorers, RoPE averaged over
a horizon for Expected Attention and the query prototypes, the profiler's pre-RoPE query
statistics) assumes transformers' Llama rotation ``x cos + rotate_half(x) sin``, with ``cos, sin``
from the model's rotary module, applied to what :class:`~runtime.geometry.ModelGeometry` reads as
the pre-RoPE queries and keys.  Models differ: interleaved RoPE (Cohere, Ernie 4.5), layers without
RoPE (SmolLM3, EXAONE 4), a norm after the rotation (HunYuan), a norm the pre-RoPE read misses
(StableLM's ``qk_layernorm``).  Rather than a second, drifting implementation of each, one short
forward pass (:func:`rope_mismatches`) compares, layer by layer, what the attention function
receives with the rotation of what the geometry reads; a policy that needs the rotation is refused
on a model where they differ, by name (:func:`check_rope_for`), and served exactly elsewhere.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .eager_attention import eager_attention_forward
from .geometry import ModelGeometry, UnsupportedModelError, input_device
from .rope import rope_cos_sin

PROBE_TOKENS = 8
# relative error above which a layer does not rotate as runtime.rope does: float32 agrees to ~1e-6
# and bf16 to ~1e-2; another rotation is off by 0.3 and more (issue 41: 1-5)
TOLERANCE = 0.05
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class RopeMismatches:
    """Layers whose attention receives keys / queries other than runtime.rope's rotation of the
    geometry's pre-RoPE reads, with the relative error of each layer."""

    keys: tuple[int, ...]
    queries: tuple[int, ...]
    key_errors: tuple[float, ...]
    query_errors: tuple[float, ...]


def _rotated(pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``pre [B, T, H, d]`` rotated at each position: ``x cos + rotate_half(x) sin`` (``cos, sin [T, d]``)."""
    half = pre.shape[-1] // 2
    rotate_half = torch.cat([-pre[..., half:], pre[..., :half]], dim=-1)
    return pre * cos[None, :, None] + rotate_half * sin[None, :, None]


def _relative_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    scale = got.abs().max().clamp_min(1e-12)
    return float((expected - got).abs().max() / scale)


@torch.no_grad()
def rope_mismatches(model) -> RopeMismatches:
    """One forward pass of :data:`PROBE_TOKENS` tokens through ``model``, comparing per layer the
    keys and queries its attention function receives with :mod:`runtime.rope`'s rotation of the
    geometry's pre-RoPE reads.  Cached per model."""
    if model in _CHECKED:
        return _CHECKED[model]
    from .attention import attention_implementation

    geometry = ModelGeometry.of(model)
    device = input_device(model)
    vocab = max(int(getattr(geometry.text_config, "vocab_size", 0) or 0), 3)
    positions = torch.arange(PROBE_TOKENS, device=device).unsqueeze(0)
    ids = (positions * 7919) % (vocab - 2) + 1  # fixed, varied ids: no random draw to seed
    pre_keys, pre_queries, post = {}, {}, {}
    handles = []
    for layer in range(geometry.num_layers):

        def keep(store, projection, index):
            def hook(_module, _inputs, output):
                store[index] = projection.take(output).float()

            return hook

        key, query = geometry.key_projections[layer], geometry.query_projections[layer]
        handles.append(key.module.register_forward_hook(keep(pre_keys, key, layer)))
        handles.append(query.module.register_forward_hook(keep(pre_queries, query, layer)))
    layer_of = {id(module): index for index, module in enumerate(geometry.attention_modules)}

    def recording(module, query, key, value, attention_mask, **kwargs):
        index = layer_of.get(id(module))
        if index is not None:  # [B, H, T, d] -> [B, T, H, d]
            post[index] = (query.transpose(1, 2).float(), key.transpose(1, 2).float())
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    try:
        with attention_implementation(model, "kvcal_rope_probe", recording):
            model(input_ids=ids, position_ids=positions, use_cache=False)
    except UnsupportedModelError:
        raise
    except (RuntimeError, ValueError) as error:  # e.g. a norm the pre-RoPE read applies with another shape
        raise UnsupportedModelError(
            f"{type(model).__name__}: its pre-RoPE queries and keys cannot be read as kvcal reads them "
            f"({type(error).__name__}: {error})"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    key_errors, query_errors = [], []
    for layer in range(geometry.num_layers):
        if layer not in post or layer not in pre_keys or layer not in pre_queries:
            raise UnsupportedModelError(
                f"{type(model).__name__}: layer {layer}'s queries and keys could not be read in a forward pass"
            )
        cos, sin = rope_cos_sin(geometry, positions[0], layer)
        cos, sin = cos.to(device), sin.to(device)
        query, key = post[layer]
        key_errors.append(_relative_error(_rotated(pre_keys[layer], cos, sin), key))
        query_errors.append(_relative_error(_rotated(pre_queries[layer], cos, sin), query))
    result = RopeMismatches(
        keys=tuple(i for i, e in enumerate(key_errors) if e > TOLERANCE),
        queries=tuple(i for i, e in enumerate(query_errors) if e > TOLERANCE),
        key_errors=tuple(key_errors),
        query_errors=tuple(query_errors),
    )
    _CHECKED[model] = result
    return result


def _layers(indices: tuple[int, ...]) -> str:
    shown = ", ".join(str(i) for i in indices[:8])
    return shown + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")


def check_rope_for(model, what: str, *, keys: bool, queries: bool) -> None:
    """Refuse ``what`` (a policy or stage that needs RoPE's rotation of the keys, of the queries, or
    both) on a model whose layers rotate them otherwise (see the module docstring)."""
    found = rope_mismatches(model)
    problems = []
    if keys and found.keys:
        problems.append(f"the keys of layers {_layers(found.keys)}")
    if queries and found.queries:
        problems.append(f"the queries of layers {_layers(found.queries)}")
    if problems:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {what} needs RoPE applied as x cos + rotate_half(x) sin to the "
            f"pre-RoPE projections, but {' and '.join(problems)} are not (interleaved RoPE, a layer "
            "without RoPE, or a norm after the rotation or one the pre-RoPE read misses): serve a scorer "
            "that reads no RoPE (keydiff, snapkv, knorm, streaming) on this model"
        )
