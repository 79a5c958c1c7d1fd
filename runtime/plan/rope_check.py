"""Whether a model rotates its queries and keys as :mod:`runtime.math.rope` assumes, read off the model itself.

kvcal's RoPE math (un-rotating cached keys for the leverage and learned scorers, RoPE averaged over
a horizon for Expected Attention and the query prototypes, the profiler's pre-RoPE query
statistics) assumes transformers' Llama rotation ``x cos + rotate_half(x) sin``, with ``cos, sin``
from the model's rotary module, applied to what :class:`~runtime.math.geometry.ModelGeometry` reads as
the pre-RoPE queries and keys.  Models differ: interleaved RoPE (Cohere, Ernie 4.5), layers without
RoPE (SmolLM3, EXAONE 4), a norm after the rotation (HunYuan, read since), a norm before it the pre-RoPE read
could miss (StableLM's ``qk_layernorm``, read since).  Rather than a second, drifting implementation of each, one short
forward pass (:func:`rope_mismatches`) compares, layer by layer, what the attention function
receives with the rotation of what the geometry reads; a policy that needs the rotation is refused
on a model where they differ, by name (:func:`check_rope_for`), and served exactly elsewhere.

What the layers that differ do is read the same way, and two such differences are served too:
runtime.math.rope's forms (:data:`runtime.math.rope.FORMS`) include the interleaved rotation of
adjacent pairs (Cohere, Ernie 4.5, Helium) and the identity of a layer without RoPE (SmolLM3's every
fourth layer, EXAONE 4's full-attention layers, AfMoE's), whose keys and queries are their own
pre-RoPE reads.  Per layer, the first form whose un-rotation of what the attention received gives
back the pre-RoPE read (:class:`runtime.math.rope.Rotation`, the scorers' own code) is the layer's
form (:func:`rope_forms`); the scorers' RoPE inputs follow it (:mod:`runtime.scorers.providers`), and
only a layer no form explains refuses (a norm after the rotation that centres, one the pre-RoPE read
misses).  An RMS norm after the rotation (HunYuan) is read by the geometry
(:class:`runtime.math.geometry.RootMeanSquare`; :class:`runtime.math.rope.Rotation` carries its weight),
so its layers follow their form like any other.  A factor by position on the rotated queries
(Ministral 3, Llama 4's layers without RoPE: :class:`runtime.math.geometry.QueryScale`) is 1 at the
probe's positions; the geometry reads it off the attention and :func:`runtime.math.rope.averaged_rope`
applies it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from runtime.kv_store.eager_attention import eager_attention_forward
from runtime.kv_store.shared_scope import this_thread_only
from runtime.math.geometry import ModelGeometry, UnsupportedModelError, input_device
from runtime.math.rope import (
    FORMS,
    HALVES,
    INTERLEAVED,
    INTERLEAVED_PAIRED,
    NO_ROPE,
    REVERSED,
    ROTATE_HALF,
    RopeForms,
    form_applies,
    rope_cos_sin,
    rotation,
)

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
    # per layer, the form of runtime.math.rope its keys and its queries follow (None: none)
    forms: RopeForms
    # per layer in keys or queries, what it does instead: "no RoPE", "interleaved RoPE", or OTHER
    features: dict[int, str] = field(default_factory=dict)
    # per layer, its decoder layer (ModelGeometry.layer_indices: another number in a hybrid model), which the
    # words name; None: the same
    layer_indices: tuple[int, ...] | None = None

    def named(self, layers) -> tuple[int, ...]:
        """The decoder layers (transformers' ``layer_idx``, what a user counts) of ``layers``."""
        return tuple(layers if self.layer_indices is None else (self.layer_indices[i] for i in layers))

    def rotated_otherwise(self, *, keys: bool, queries: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The layers whose keys (when ``keys``) and queries (when ``queries``) no form of
        runtime.math.rope reproduces: ``(key layers, query layers)``."""
        return (
            tuple(i for i in self.keys if keys and self.forms.keys[i] is None),
            tuple(i for i in self.queries if queries and self.forms.queries[i] is None),
        )

    def describe(self) -> str:
        """What the layers do instead, grouped: ``"interleaved RoPE in layers 0, 1"`` (decoder layers)."""
        grouped: dict[str, list[int]] = {}
        for layer, feature in sorted(self.features.items()):
            grouped.setdefault(feature, []).append(self.named([layer])[0])
        return "; ".join(
            f"{feature} in layer{'s' if len(layers) > 1 else ''} {_layers(tuple(layers))}"
            for feature, layers in grouped.items()
        )


OTHER = "another rotation, a norm after it other than an RMS norm, or one the pre-RoPE read misses"
# what a layer that differs does, by its form (the refusal's and describe()'s words)
FEATURES = {
    NO_ROPE: "no RoPE",
    INTERLEAVED: "interleaved RoPE",
    INTERLEAVED_PAIRED: "interleaved RoPE",
    REVERSED: "the inverse RoPE rotation",
    HALVES: "rotate_half from frequencies given once",
    None: OTHER,
}


def _error(
    rotations: dict,
    geometry,
    layer: int,
    positions: torch.Tensor,
    form: str,
    keys: bool,
    pre: torch.Tensor,
    post: torch.Tensor,
) -> float:
    """How far ``form``'s un-rotation (the scorers' own, :class:`runtime.math.rope.Rotation`) of what layer
    ``layer``'s attention received as its keys (``keys``) or queries, ``post [B, T, H, d]`` at ``positions
    [T]``, is from its pre-RoPE read ``pre``, relative.  ``rotations``: the layer's ``cos, sin`` by form,
    made once for its keys and its queries."""
    if form not in rotations:
        cos, sin = rope_cos_sin(geometry, positions, layer, form=form)
        rotations[form] = cos.to(post.device)[None, :, None], sin.to(post.device)[None, :, None]
    return _relative_error(pre, rotation(geometry, layer, form, *rotations[form], keys=keys).undo(post))


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
        handles.append(key.module.register_forward_hook(this_thread_only(keep(pre_keys, key, layer))))
        handles.append(query.module.register_forward_hook(this_thread_only(keep(pre_queries, query, layer))))
    layer_of = {id(module): index for index, module in enumerate(geometry.attention_modules)}

    def recording(module, query, key, value, attention_mask, **kwargs):
        index = layer_of.get(id(module))
        if index is not None:  # [B, H, T, d] -> [B, T, H, d]
            post[index] = (query.transpose(1, 2).float(), key.transpose(1, 2).float())
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    try:
        with attention_implementation(model, "kvcal_rope_probe", recording):
            # the decoder without its output head: the vocabulary's logits are not needed
            getattr(model, "base_model", model)(input_ids=ids, position_ids=positions, use_cache=False)
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
    key_errors, query_errors, features, key_forms, query_forms = [], [], {}, [], []
    for layer in range(geometry.num_layers):
        if layer not in post or layer not in pre_keys or layer not in pre_queries:
            raise UnsupportedModelError(
                f"{type(model).__name__}: layer {layer}'s queries and keys could not be read in a forward pass"
            )
        query, key = post[layer]
        rotations = {}
        for forms, errors, keys, pre, got in (
            (key_forms, key_errors, True, pre_keys[layer], key),
            (query_forms, query_errors, False, pre_queries[layer], query),
        ):
            errors.append(
                _error(rotations, geometry, layer, positions[0], ROTATE_HALF, keys, pre, got)
                if form_applies(geometry, layer, ROTATE_HALF)
                else float("inf")  # no rotary module: rotate_half cannot be the model's
            )
            others = (form for form in FORMS if form != ROTATE_HALF and form_applies(geometry, layer, form))
            fits = (
                form
                for form in others
                if _error(rotations, geometry, layer, positions[0], form, keys, pre, got) <= TOLERANCE
            )
            forms.append(ROTATE_HALF if errors[-1] <= TOLERANCE else next(fits, None))
        if key_errors[-1] > TOLERANCE:
            features[layer] = FEATURES[key_forms[-1]]
        elif query_errors[-1] > TOLERANCE:
            features[layer] = FEATURES[query_forms[-1]]
    result = RopeMismatches(
        keys=tuple(i for i, e in enumerate(key_errors) if e > TOLERANCE),
        queries=tuple(i for i, e in enumerate(query_errors) if e > TOLERANCE),
        key_errors=tuple(key_errors),
        query_errors=tuple(query_errors),
        features=features,
        forms=RopeForms(tuple(key_forms), tuple(query_forms)),
        layer_indices=geometry.layer_indices,
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


def rope_forms(model, scorer=None) -> RopeForms | None:
    """Each layer's RoPE form for its keys and its queries (see the module docstring; one short forward
    pass, cached per model), for a scorer's RoPE inputs (:class:`runtime.scorers.ScorerInputs`); with
    ``scorer``, None when it reads no RoPE (no forward pass then)."""
    if scorer is not None and not any(rope_needs(scorer)):
        return None
    return rope_mismatches(model).forms


def rope_problems(model, *, keys: bool, queries: bool) -> str | None:
    """Which of the keys / queries ``model`` rotates otherwise than every form of runtime.math.rope, and
    how (one clause), or None when none does."""
    found = rope_mismatches(model)
    key_layers, query_layers = found.rotated_otherwise(keys=keys, queries=queries)
    problems = []
    if key_layers:
        problems.append(f"the keys of layers {_layers(found.named(key_layers))}")
    if query_layers:
        problems.append(f"the queries of layers {_layers(found.named(query_layers))}")
    if not problems:
        return None
    return f"{' and '.join(problems)} are not ({found.describe()})"


def check_rope_for(model, what: str, *, keys: bool, queries: bool) -> None:
    """Refuse ``what`` (a policy or stage that needs RoPE's rotation of the keys, of the queries, or
    both) on a model whose layers rotate them otherwise (see the module docstring)."""
    problems = rope_problems(model, keys=keys, queries=queries)
    if problems:
        raise UnsupportedModelError(
            f"{type(model).__name__}: {what} needs RoPE applied as x cos + P(x) sin (P: rotate_half, its inverse "
            f"or the interleaved pairs' turn; or no RoPE) to the pre-RoPE projections, but {problems}: serve a "
            "scorer that reads no RoPE (keydiff, snapkv, knorm, streaming) on this model"
        )


def check_passes_rotate_alike(name: str, geometry, scorer, pass_ends, what: str, remedy: str) -> None:
    """Refuse ``what`` when ``scorer`` un-rotates keys (leverage, learned) that model ``name`` (of
    ``geometry``, a :class:`~runtime.math.geometry.ModelGeometry`) rotated in forward
    passes ending on both sides of a layer's RoPE switch (:attr:`ModelGeometry.rope_switches`: transformers'
    longrope turns each pass with its short factors up to ``original_max_position_embeddings`` positions and
    with its long ones beyond, Phi-3.5 and Phi-4-mini; :attr:`ModelGeometry.rope_limits`: dynamic NTK re-scales
    each pass past its original context by its length), since the keys of one side would be un-rotated with
    the other's frequencies.  ``pass_ends``: the largest position + 1 of each pass whose keys are
    un-rotated together (None: unknown in advance, refused wherever the RoPE switches)."""
    if scorer is None or not rope_needs(scorer)[0]:
        return
    turns = {
        switch: "where the model's longrope RoPE turns from its short to its long factors (each pass by its longest "
        "position)"
        for switch in geometry.rope_switches
        if switch is not None
    }
    turns.update(
        {
            limit: "the model's original context, past which its dynamic NTK RoPE re-scales each pass by its length"
            for limit in geometry.rope_limits
            if limit is not None
        }
    )
    for switch in sorted(turns):
        if pass_ends is None or min(pass_ends) <= switch < max(pass_ends):
            raise UnsupportedModelError(
                f"{name}: {what} un-rotates with the {scorer.name} scorer keys of forward passes "
                f"on both sides of {switch} positions, {turns[switch]}, so the keys of one side would be un-rotated "
                f"with the other's: {remedy}, or serve a scorer that reads no RoPE (keydiff, snapkv, knorm, streaming)"
            )
