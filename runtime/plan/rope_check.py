"""Whether a model rotates its queries and keys as :mod:`runtime.math.rope` assumes, read off the model itself.

kvcal's RoPE math (un-rotating cached keys for the leverage and learned scorers, RoPE averaged over
a horizon for Expected Attention and the query prototypes, the profiler's pre-RoPE query
statistics) assumes transformers' Llama rotation ``x cos + rotate_half(x) sin``, with ``cos, sin``
from the model's rotary module, applied to what :class:`~runtime.math.geometry.ModelGeometry` reads as
the pre-RoPE queries and keys.  Models differ: interleaved RoPE (Cohere, Ernie 4.5), layers without
RoPE (SmolLM3, EXAONE 4), a norm after the rotation (HunYuan), a norm the pre-RoPE read misses
(StableLM's ``qk_layernorm``).  Rather than a second, drifting implementation of each, one short
forward pass (:func:`rope_mismatches`) compares, layer by layer, what the attention function
receives with the rotation of what the geometry reads; a policy that needs the rotation is refused
on a model where they differ, by name (:func:`check_rope_for`), and served exactly elsewhere.

A layer that applies no RoPE at all (SmolLM3's every fourth layer, EXAONE 4's full-attention layers,
AfMoE's) is not a difference: its keys and queries are their own pre-RoPE reads, so its rotation is
the identity, ``cos = 1, sin = 0`` at every position, and every formula of runtime.math.rope holds
with it.  :func:`no_rope_layers` names those layers; the scorers' RoPE inputs take the identity
there (:mod:`runtime.scorers.providers`), and only the other differences refuse.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from runtime.kv_store.eager_attention import eager_attention_forward
from runtime.math.geometry import ModelGeometry, UnsupportedModelError, input_device
from runtime.math.rope import rope_cos_sin

PROBE_TOKENS = 8
# relative error above which a layer does not rotate as runtime.math.rope does: float32 agrees to ~1e-6
# and bf16 to ~1e-2; another rotation is off by 0.3 and more (issue 41: 1-5)
TOLERANCE = 0.05
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class RopeMismatches:
    """Layers whose attention receives keys / queries other than runtime.math.rope's rotation of the
    geometry's pre-RoPE reads, with the relative error of each layer."""

    keys: tuple[int, ...]
    queries: tuple[int, ...]
    key_errors: tuple[float, ...]
    query_errors: tuple[float, ...]
    # per layer in keys or queries, what it does instead: "no RoPE", "interleaved RoPE", or OTHER
    features: dict[int, str] = field(default_factory=dict)

    @property
    def no_rope(self) -> frozenset[int]:
        """The layers that rotate neither their keys nor their queries (their rotation is the identity)."""
        return frozenset(layer for layer, feature in self.features.items() if feature == NO_ROPE)

    def rotated_otherwise(self, *, keys: bool, queries: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The layers whose keys (when ``keys``) and queries (when ``queries``) no formula of
        runtime.math.rope reproduces, the identity included: ``(key layers, query layers)``."""
        unrotated = self.no_rope
        return (
            tuple(i for i in self.keys if keys and i not in unrotated),
            tuple(i for i in self.queries if queries and i not in unrotated),
        )

    def describe(self) -> str:
        """What the layers do instead, grouped: ``"interleaved RoPE in layers 0, 1"``."""
        grouped: dict[str, list[int]] = {}
        for layer, feature in sorted(self.features.items()):
            grouped.setdefault(feature, []).append(layer)
        return "; ".join(
            f"{feature} in layer{'s' if len(layers) > 1 else ''} {_layers(tuple(layers))}"
            for feature, layers in grouped.items()
        )


def _rotated(pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``pre [B, T, H, d]`` rotated at each position: ``x cos + rotate_half(x) sin`` (``cos, sin [T, d]``)."""
    half = pre.shape[-1] // 2
    rotate_half = torch.cat([-pre[..., half:], pre[..., :half]], dim=-1)
    return pre * cos[None, :, None] + rotate_half * sin[None, :, None]


OTHER = "another rotation, a norm after it or one the pre-RoPE read misses"
NO_ROPE = "no RoPE"


def _interleaved(pre: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``pre [B, T, H, d]`` rotated in interleaved pairs ``(x0, x1), (x2, x3), ..`` (GPT-J's RoPE:
    Cohere, Ernie 4.5, Llama 4) at the frequencies of ``cos, sin [T, d]``, laid out either way
    (halves, as rotate_half takes them, or pairs); None when they are neither."""
    half = cos.shape[-1] // 2
    if torch.allclose(cos[:, :half], cos[:, half:]) and torch.allclose(sin[:, :half], sin[:, half:]):
        cos, sin = cos[:, :half], sin[:, :half]
    elif torch.allclose(cos[:, 0::2], cos[:, 1::2]) and torch.allclose(sin[:, 0::2], sin[:, 1::2]):
        cos, sin = cos[:, 0::2], sin[:, 0::2]
    else:
        return None
    cos, sin = cos.repeat_interleave(2, -1)[None, :, None], sin.repeat_interleave(2, -1)[None, :, None]
    turned = torch.stack([-pre[..., 1::2], pre[..., 0::2]], dim=-1).flatten(-2)
    return pre * cos + turned * sin


def _feature(pre: torch.Tensor, post: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """What a layer whose rotation is not runtime.math.rope's does to its pre-RoPE ``pre``: ``post``."""
    if _relative_error(pre, post) <= TOLERANCE:
        return NO_ROPE
    interleaved = _interleaved(pre, cos, sin)
    if interleaved is not None and _relative_error(interleaved, post) <= TOLERANCE:
        return "interleaved RoPE"
    return OTHER


def _relative_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    scale = got.abs().max().clamp_min(1e-12)
    return float((expected - got).abs().max() / scale)


@torch.no_grad()
def rope_mismatches(model) -> RopeMismatches:
    """One forward pass of :data:`PROBE_TOKENS` tokens through ``model``, comparing per layer the
    keys and queries its attention function receives with :mod:`runtime.math.rope`'s rotation of the
    geometry's pre-RoPE reads.  Cached per model."""
    if model in _CHECKED:
        return _CHECKED[model]
    from runtime.kv_store.attention_interface import attention_implementation

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
    key_errors, query_errors, features = [], [], {}
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
        key_feature = _feature(pre_keys[layer], key, cos, sin) if key_errors[-1] > TOLERANCE else None
        query_feature = _feature(pre_queries[layer], query, cos, sin) if query_errors[-1] > TOLERANCE else None
        if key_feature is not None or query_feature is not None:
            # no RoPE only where neither keys nor queries rotate; one rotating and the other not is OTHER
            if NO_ROPE in (key_feature, query_feature) and key_feature != query_feature:
                features[layer] = OTHER
            else:
                features[layer] = key_feature or query_feature
    result = RopeMismatches(
        keys=tuple(i for i, e in enumerate(key_errors) if e > TOLERANCE),
        queries=tuple(i for i, e in enumerate(query_errors) if e > TOLERANCE),
        key_errors=tuple(key_errors),
        query_errors=tuple(query_errors),
        features=features,
    )
    _CHECKED[model] = result
    return result


def _layers(indices: tuple[int, ...]) -> str:
    shown = ", ".join(str(i) for i in indices[:8])
    return shown + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")


def rope_needs(scorer) -> tuple[bool, bool]:
    """Whether ``scorer`` (a ``runtime.scorers`` scorer) needs RoPE's rotation of the keys (it
    un-rotates them or averages RoPE over them) and of the queries (it rotates query statistics)."""
    from runtime.scorers import AveragedRope, KeyRope

    keys = any(isinstance(need, (KeyRope, AveragedRope)) for need in scorer.needs)
    return keys, any(isinstance(need, AveragedRope) for need in scorer.needs)


def no_rope_layers(model, scorer=None) -> frozenset[int]:
    """The layers of ``model`` that apply no RoPE (see the module docstring; one short forward pass,
    cached per model), to give a scorer's RoPE inputs (:class:`runtime.scorers.ScorerInputs`); with
    ``scorer``, none when it reads no RoPE (no forward pass then)."""
    if scorer is not None and not any(rope_needs(scorer)):
        return frozenset()
    return rope_mismatches(model).no_rope


def rope_problems(model, *, keys: bool, queries: bool) -> str | None:
    """Which of the keys / queries ``model`` rotates otherwise than runtime.math.rope (layers without
    RoPE aside: their rotation is the identity), and how (one clause), or None when none does."""
    found = rope_mismatches(model)
    key_layers, query_layers = found.rotated_otherwise(keys=keys, queries=queries)
    problems = []
    if key_layers:
        problems.append(f"the keys of layers {_layers(key_layers)}")
    if query_layers:
        problems.append(f"the queries of layers {_layers(query_layers)}")
    if not problems:
        return None
    return f"{' and '.join(problems)} are not ({found.describe()})"


def check_rope_for(model, what: str, *, keys: bool, queries: bool) -> None:
    """Refuse ``what`` (a policy or stage that needs RoPE's rotation of the keys, of the queries, or
    both) on a model whose layers rotate them otherwise (see the module docstring)."""
    problems = rope_problems(model, keys=keys, queries=queries)
    if problems:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {what} needs RoPE applied as x cos + rotate_half(x) sin to the "
            f"pre-RoPE projections, but {problems}: serve a scorer that reads no RoPE (keydiff, snapkv, "
            "knorm, streaming) on this model"
        )
