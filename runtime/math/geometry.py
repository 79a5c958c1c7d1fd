"""A loaded model's attention geometry, worked out once and checked, with errors that name what is missing.

    geometry = ModelGeometry.of(model)      # raises UnsupportedModelError with the reason
    geometry.num_layers, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim
    geometry.query_modules[layer]           # hook it; geometry.pre_rope_queries(layer, output): [B, T, Hq, d]
                                            # (the query norm applied, if any; Phi-3: a slice of qkv_proj)
    geometry.key_projections[layer]         # hook target and output slice of the pre-RoPE keys (values alike)
    geometry.rope_layer_types[layer]        # what the rotary module takes for the layer (runtime.math.rope)
    geometry.sliding_windows[layer], geometry.softcaps[layer]

Supported: decoder-only transformers in the Llama family as transformers 5.x writes them
(Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, OLMo2, Phi-3, SmolLM, ...):
``model.model.layers[i].self_attn`` with a ``q_proj`` linear (and optionally a query norm,
``q_norm``, as in Qwen3, Gemma 3 and OLMo2) or a fused ``qkv_proj`` whose output is
``[.., (Hq + 2 Hkv) d]``, query first, then keys, then values (Phi-3, Phi-4), RoPE on the whole
head dimension applied by ``model.model.rotary_emb`` (one module for every layer, or one that
takes the layer's type, as Gemma 3's, whose sliding layers use another base), attention
dispatched through ``AttentionInterface``, and layers of full or sliding-window attention.
The language model of a multimodal checkpoint loaded whole (``model.model.language_model``,
:func:`~artifacts.fingerprint.decoder_stack`) is served on text where kvcal has checked the
wrapper's text path: the types of :data:`MULTIMODAL_SERVED` (tests/test_multimodal_checkpoints.py);
other multimodal checkpoints, and multimodal RoPE, are refused by name.

The config numbers (``L``, ``Hq``, ``Hkv``, ``d``) and the query-norm flag are read by
``artifacts.fingerprint`` (:func:`~artifacts.fingerprint.attention_numbers`,
:func:`~artifacts.fingerprint.has_query_norm`), the same functions that make the artifact's
architecture fingerprint, so the runtime, the profiler and the artifact identity cannot
disagree; this module checks the modules against them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass, field

import torch

from artifacts.fingerprint import (
    LANGUAGE_MODEL_ATTRIBUTES,
    PER_LAYER_GEOMETRY,
    RECURRENT_LAYER_TYPES,
    STATEFUL_ATTENTION_LAYER_TYPES,
    attention_chunk,
    attention_layer_indices,
    attention_numbers,
    decoder_stack,
    has_query_norm,
    kv_shared_layers,
    layer_attention,
    sliding_layers_apart,
    text_config,
    value_head_dim,
)

# The multimodal checkpoints whose language model kvcal serves on text (Gemma 3 from 4B, Gemma 4, Mistral Small 3.1 /
# 3.2, the LLaVA family (LLaVA-NeXT-Video, Video-LLaVA, ViP-LLaVA too), Idefics3 and SmolVLM, Aya Vision and
# Command A Vision, InternVL, Ovis2, LightOnOCR, LFM2-VL, Qwen2-VL / Qwen2.5-VL / Qwen3-VL, Qwen3.5 and its MoE):
# for each,
# tests/test_multimodal_checkpoints.py checks that the wrapper's text path is its language model's (positions,
# masks, logits) and that kvcal serves it as that language model alone (Qwen's multimodal RoPE turns a text
# token's three position sections by one position: 1-D RoPE, Qwen2's and Qwen3's).  Others may number positions
# or mask the prompt otherwise (PaliGemma counts positions from 1 and attends both ways over its prompt):
# refused until checked.
MULTIMODAL_SERVED = frozenset(
    (
        "aya_vision",
        "cohere2_vision",
        "exaone4_5",
        "gemma3",
        "gemma4",
        "gemma4_unified",
        "idefics3",
        "internvl",
        "lfm2_vl",
        "lighton_ocr",
        "llava",
        "llava_next",
        "llava_next_video",
        "llava_onevision",
        "mistral3",
        "ovis2",
        "qwen2_5_vl",
        "qwen2_vl",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_vl",
        "smolvlm",
        "video_llava",
        "vipllava",
    )
)
# the language models of multimodal checkpoints as transformers' causal LM loads them alone, keeping the wrapper's
# multimodal RoPE (a Qwen3.5 checkpoint loads as Qwen3_5ForCausalLM, its text config's mrope_section kept): on text
# its three sections turn by one position, checked as the wrappers of MULTIMODAL_SERVED are
MULTIMODAL_ROPE_SERVED = MULTIMODAL_SERVED | frozenset(("qwen3_5_text", "qwen3_5_moe_text"))


def input_device(model) -> torch.device:
    """The device the model's inputs go to: its input embedding's (under ``device_map="auto"`` the
    first layer's, not necessarily ``model.device``).  Every tensor that meets the model's own
    tensors (input ids, masks, positions) is made there; host-side bookkeeping stays on the CPU."""
    return model.get_input_embeddings().weight.device


class UnsupportedModelError(ValueError):
    """The model lacks a piece the toolkit relies on (the message says which)."""


@dataclass(frozen=True, eq=False)
class Projection:
    """Where one projection is read: a forward hook on the linear ``module``, whose output
    ``[B, T, F]`` holds it (all of it, or the ``features`` slice of the last axis: a fused
    ``qkv_proj``), then :meth:`take`.  ``norm``: the norm the model applies next (``q_norm`` /
    ``k_norm``, or ``q_layernorm`` / ``k_layernorm``), over each head's ``d`` features (Qwen3,
    Gemma 3; with a weight per head, ``[H, d]``: Command R+) or over all ``H d`` (OLMo2); :meth:`take`
    applies it, the same module to the same values, in the layout ``[B, T, H, d]``, or ``[B, H, T, d]``
    with ``heads_first`` (StableLM's LayerNorm per head splits the heads off axis 1); a norm of each
    head's ``d`` with one weight gives the model's whatever layout the model normalises in."""

    module: torch.nn.Module
    heads: int  # H
    head_dim: int  # d
    features: slice | None = None
    norm: torch.nn.Module | None = None
    norm_per_head: bool = True
    heads_first: bool = False
    # the weight ``[d]`` of a norm the model applies after RoPE (HunYuan's query_layernorm / key_layernorm):
    # the attention receives ``weight * R(p) take(output)``, the read being divided by its root mean square
    # (``norm``: :class:`RootMeanSquare`); None also for a norm after RoPE without a weight (Llama 4)
    weight_after_rope: torch.Tensor | None = None
    # the bound the attention clamps the projection to, ``[-clip, clip]``, in place after the hook has run
    # (OLMo's ``clip_qkv``: 8.0 in OLMo 1.7's checkpoints); None: no clamp
    clip: float | None = None
    # the width of each head's block in the output, of which the first ``head_dim`` are the head's: a query
    # projection that also computes the attention's output gate, ``2 d`` per head (Qwen3.5, Qwen3-Next); None: d
    head_width: int | None = None
    # the factor the attention multiplies the projection by before RoPE (Falcon-H1's key_multiplier); None: 1
    scale: float | None = None

    def take(self, output: torch.Tensor) -> torch.Tensor:
        """The projection ``[B, T, H, d]`` in the hooked module's output ``[B, T, F]``."""
        values = output.detach() if self.features is None else output.detach()[..., self.features]
        if self.head_width is not None:
            values = values.unflatten(-1, (self.heads, self.head_width))[..., : self.head_dim].flatten(-2)
        if self.scale is not None:
            values = values * self.scale
        if self.clip is not None:
            values = values.clamp(-self.clip, self.clip)
        batch, tokens = values.shape[0], values.shape[1]
        if self.norm is None:
            return values.reshape(batch, tokens, self.heads, self.head_dim)
        with torch.no_grad():
            if self.heads_first:
                heads = values.reshape(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
                return self.norm(heads).transpose(1, 2)
            if self.norm_per_head:
                return self.norm(values.reshape(batch, tokens, self.heads, self.head_dim))
            return self.norm(values).reshape(batch, tokens, self.heads, self.head_dim)


class RootMeanSquare(torch.nn.Module):
    """Each head's vector divided by its root mean square, ``x / sqrt(mean(x^2) + eps)`` (in float32, as
    transformers' RMS norms compute), without a weight: the pre-RoPE read of a model that normalises after
    the rotation.  A rotation keeps the mean square, so ``norm(R x) = w * R (x / sqrt(mean(x^2) + eps))``:
    what this reads, rotated, times the norm's weight (:attr:`Projection.weight_after_rope`)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = float(eps)

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        x = values.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(values.dtype)


@dataclass(frozen=True)
class QueryScale:
    """A factor a layer multiplies its rotated queries by, by position ``p``:
    ``1 + beta * log(1 + floor((p + offset) / period))``, 1 below ``period - offset``.  Ministral 3 and
    Mistral 4 on every layer (``llama_4_scaling_beta`` as ``beta``, ``original_max_position_embeddings``
    as ``period``, offset 0); Llama 4 on its layers without RoPE (attention temperature tuning, "Scalable-
    Softmax Is Superior for Attention", arXiv 2501.19399: ``attn_scale``, ``floor_scale``, offset 1)."""

    beta: float
    period: int
    offset: int = 0

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """float32 factors, the shape of ``positions``."""
        steps = torch.floor((positions.float() + self.offset) / self.period)
        return 1.0 + self.beta * torch.log1p(steps)


def _query_scale(attention, config) -> QueryScale | None:
    """The :class:`QueryScale` layer ``attention`` applies, read as transformers' attention applies it:
    Llama 4's ``attn_temperature_tuning`` on a layer without RoPE (``use_rope`` False), or the
    ``get_llama_4_attn_scale`` of Ministral 3 / Mistral 4's forward (from ``rope_parameters``; a Mistral
    whose config carries the parameters but whose attention does not read them has none)."""
    if getattr(attention, "attn_temperature_tuning", False) and not getattr(attention, "use_rope", True):
        return QueryScale(float(attention.attn_scale), int(attention.floor_scale), 1)
    parameters = getattr(config, "rope_parameters", None) or {}
    beta = parameters.get("llama_4_scaling_beta")
    if beta is None or not _forward_calls(type(attention), "llama_4_attn_scale"):
        return None
    return QueryScale(float(beta), int(parameters["original_max_position_embeddings"]))


@functools.cache
def _forward_calls(module_class: type, name: str) -> bool:
    """Whether ``module_class``'s forward names ``name`` in its source (read once per class: reading
    source is slow, and every entry point asks for the geometry); False without the source."""
    try:
        return name in inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return False


def _clip_qkv(attention, config) -> float | None:
    """The bound ``attention`` clamps its query, key and value projections to (OLMo's ``clip_qkv``, read
    where its forward reads it), None where it clamps nothing."""
    clip = getattr(config, "clip_qkv", None)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not _forward_calls(type(attention), "clip_qkv"):
        return None
    if not clip > 0:
        raise UnsupportedModelError(f"clip_qkv={clip}: the attention would clamp every projection to 0 or less")
    return float(clip)


def _rope_takes_layer_type(rotary) -> bool | None:
    """Whether the rotary module's forward takes the layer's type (Gemma 3: one RoPE per type):
    True when it must be given, None when it may (a default: PhiMoE's in transformers 5.2), False
    when it takes none."""
    parameter = inspect.signature(rotary.forward).parameters.get("layer_type")
    if parameter is None:
        return False
    return True if parameter.default is inspect.Parameter.empty else None


@dataclass(frozen=True, eq=False)
class ModelGeometry:
    """What the profiler and the runtime need to know about a model's attention (see module doc)."""

    num_layers: int  # L: the layers with a KV cache (of a hybrid model, its attention layers alone)
    # per layer: its index among the decoder layers (model.model.layers; transformers' layer_idx), which is the
    # layer's own but in a hybrid model (Qwen3.5: three Gated DeltaNet layers to one attention layer)
    layer_indices: tuple[int, ...]
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # d: the queries' and keys'
    value_head_dim: int  # the values' (d but for MiMo-V2-Flash's narrower values: artifacts.fingerprint.value_head_dim)
    scalings: tuple[float, ...]  # per layer: the attention scale s (module.scaling, else 1/sqrt(d))
    attention_modules: tuple[torch.nn.Module, ...]  # per layer: model.model.layers[i].self_attn
    query_projections: tuple[Projection, ...]  # per layer: the pre-RoPE query (q_proj [+ q_norm] or qkv_proj[:Hq d])
    key_projections: tuple[Projection, ...]  # per layer: the pre-RoPE keys (k_proj [+ k_norm] or a qkv_proj slice)
    value_projections: tuple[Projection, ...]  # per layer: the values (v_proj or a qkv_proj slice)
    # True when the queries pass through a q_norm before RoPE (Qwen3, Gemma 3, OLMo2), as the artifact's
    # identity records it (a q_layernorm, StableLM's, is read by query_projections but not counted here)
    query_norm: bool
    fused_qkv: bool  # True when one qkv_proj computes queries, keys and values (Phi-3)
    rope_layer_types: tuple[str | None, ...]  # per layer: the type the rotary module takes (None: it takes none)
    # per layer: how many of a head's first dimensions RoPE turns, the rest passing as they are (d; fewer:
    # partial RoPE, Phi-4-mini's 0.75, GLM-4's 0.5, StableLM's 0.25)
    rotary_dims: tuple[int, ...]
    # per layer: the forward pass length above which the layer's RoPE turns with other frequencies
    # (transformers' longrope: Phi-3.5, Phi-4-mini; original_max_position_embeddings), None: it never does
    rope_switches: tuple[int | None, ...]
    # per layer: the longest forward pass served (dynamic NTK: its original context, past which transformers
    # re-scales each pass by its length and keeps the scale, :func:`original_context`), None: no limit
    rope_limits: tuple[int | None, ...]
    # per layer: the factor the layer multiplies its rotated queries by, by position (None: none)
    query_scales: tuple[QueryScale | None, ...]
    sliding_windows: tuple[int | None, ...]  # per layer: the sliding window (None: full attention)
    softcaps: tuple[float | None, ...]  # per layer: the attention-logit soft-cap (None: none)
    # model.model.rotary_emb; None where the model has none (its attention takes no positions: Granite 4.0-H,
    # Nemotron-H, Jamba), every layer's rotary_dims then 0
    rotary: torch.nn.Module | None = field(repr=False)
    text_config: object = field(repr=False)  # the (text) transformers config

    def layer_of(self, module) -> int | None:
        """The layer (index into this geometry's tuples and the artifact's ``L`` axis) of an attention module
        transformers numbers ``module.layer_idx`` among the decoder layers: that index, but in a hybrid model;
        None for an attention module of a layer held apart from the artifact's (Gemma 4's sliding layers:
        ``artifacts.fingerprint.sliding_layers_apart``), which kvcal neither measures nor evicts, and for a layer
        attending to an earlier layer's cache (``artifacts.fingerprint.kv_shared_layers``), which has none."""
        index = int(module.layer_idx)
        if self.layer_indices[index : index + 1] == (index,):  # the first index + 1 decoder layers all attend
            return index
        try:
            return self.layer_indices.index(index)
        except ValueError:
            if sliding_layers_apart(self.text_config) or index in kv_shared_layers(self.text_config):
                return None
            raise ValueError(f"decoder layer {index} has no KV cache (a recurrent layer of a hybrid model)") from None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group), ``G = Hq / Hkv``."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def query_modules(self) -> tuple[torch.nn.Module, ...]:
        """Per layer: the module to hook for the pre-RoPE query (see :meth:`pre_rope_queries`)."""
        return tuple(projection.module for projection in self.query_projections)

    def pre_rope_queries(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """The pre-RoPE queries ``[B, T, Hq, d]`` in the output of ``query_modules[layer]``."""
        return self.query_projections[layer].take(output)

    def rope_layer_type(self, layer: int | None):
        """What the rotary module takes for ``layer`` (None: nothing); ``layer=None`` serves only a
        model whose layers all share one RoPE, else ``ValueError``."""
        if layer is not None:
            return self.rope_layer_types[layer]
        if len(set(self.rope_layer_types)) > 1:
            raise ValueError(
                "the layers of this model use different RoPE (per layer type: "
                f"{', '.join(sorted(set(self.rope_layer_types)))}): give the layer"
            )
        return self.rope_layer_types[0]

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
        _refuse_attention_kvcal_cannot_compute(name, config, model)
        try:
            numbers = {**attention_numbers(config), "value_head_dim": value_head_dim(config)}
        except ValueError as exc:
            raise UnsupportedModelError(f"{name}: {exc}") from None
        num_q_heads, num_kv_heads, head_dim = numbers["num_q_heads"], numbers["num_kv_heads"], numbers["head_dim"]
        backbone = decoder_stack(model)
        if backbone is None:
            raise UnsupportedModelError(
                f"{name}: no decoder layers at model.model.layers (not a Llama-family causal LM)"
            )
        at = "model.model"
        if backbone is not model.model:
            _refuse_unchecked_multimodal(name, model.config)
            at += next(
                f".{attribute}"
                for attribute in LANGUAGE_MODEL_ATTRIBUTES
                if getattr(model.model, attribute, None) is backbone
            )
        layers = backbone.layers
        # None: the model rotates nothing at model.model.rotary_emb (Granite 4.0-H, Nemotron-H, Jamba: attention
        # without positions); runtime.plan.rope_check then finds what its layers do (no RoPE, or another form)
        rotary = getattr(backbone, "rotary_emb", None)
        if num_q_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"{name}: {num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads"
            )
        if len(layers) != int(config.num_hidden_layers):
            raise UnsupportedModelError(
                f"{name}: config says {config.num_hidden_layers} layers, model has {len(layers)}"
            )
        indices = attention_layer_indices(config)
        types = getattr(config, "layer_types", None) or ()
        # (Gemma 4's sliding layers, left out as well, are held in kvcal's own layers: nothing of transformers needed)
        readers = kv_shared_layers(config)
        left = len(indices) + len(readers) != len(layers) and not sliding_layers_apart(config)
        if left or any(kind in STATEFUL_ATTENTION_LAYER_TYPES for kind in types):
            _refuse_recurrent_layers_kvcal_cannot_hold(name, layers, config)

        try:
            sliding_windows, softcaps = layer_attention(config)
        except ValueError as exc:
            raise UnsupportedModelError(f"{name}: {exc}") from None
        check_routes_attention(model)
        _check_kv_sharing(name, layers, readers)

        query_norm = has_query_norm(model)
        first = attention_of(layers[indices[0]]) if indices else None
        fused = getattr(first, "q_proj", None) is None and getattr(first, "qkv_proj", None) is not None
        attention_modules, scalings, query_scales = [], [], []
        projections: dict[str, list[Projection]] = {"query": [], "key": [], "value": []}
        for index in indices:
            layer = layers[index]
            # transformers 5.2's Falcon-H1 and Bamba: no layer types (newer ones type them hybrid, linear_attention)
            if getattr(layer, "mamba", None) is not None and not types:
                raise UnsupportedModelError(
                    f"{name}: a state-space (Mamba) mixer in layer {index} (as in Falcon-H1 and Bamba) is not "
                    "supported: kvcal evicts attention KV caches only"
                )
            attention = attention_of(layer)
            if attention is None:
                raise UnsupportedModelError(f"{name}: layer {index} has no self_attn module")
            if getattr(attention, "layer_idx", None) != index:
                raise UnsupportedModelError(f"{name}: layer {index} attention has no matching layer_idx")
            q_norm = getattr(attention, "q_norm", None)
            if (q_norm is not None) != query_norm:
                raise UnsupportedModelError(
                    f"{name}: only some layers have a query norm "
                    f"(layer {index} {'has' if q_norm is not None else 'has no'} q_norm)"
                )
            found = (
                _fused_projections(name, index, attention, numbers)
                if fused
                else _projections(name, index, attention, numbers)
            )
            clip = _clip_qkv(attention, config)
            for kind, projection in found.items():
                projections[kind].append(projection if clip is None else dataclasses.replace(projection, clip=clip))
            attention_modules.append(attention)
            scalings.append(float(getattr(attention, "scaling", head_dim**-0.5)))
            query_scales.append(_query_scale(attention, config))
        if rotary is None:
            rope_layer_types, rotary_dims = (None,) * len(indices), (0,) * len(indices)
        else:
            rope_layer_types = _rope_layer_types(name, rotary, config, indices)
            rotary_dims = _rotary_dims(name, rotary, rope_layer_types, head_dim)
        switches = {
            layer_type: _longrope_switch(config, parameters) for layer_type, parameters in _rope_parameters(config)
        }
        rope_switches = tuple(switches.get(kind, switches.get(None)) for kind in rope_layer_types)
        limit = original_context(config)
        dynamic = _dynamic_ntk_types(config) if limit is not None else []  # the layer types it limits
        rope_limits = tuple(
            limit if limit is not None and (kind is None or kind in dynamic or None in dynamic) else None
            for kind in rope_layer_types
        )
        return cls(
            num_layers=len(indices),
            layer_indices=indices,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            value_head_dim=numbers["value_head_dim"],
            scalings=tuple(scalings),
            attention_modules=tuple(attention_modules),
            query_projections=tuple(projections["query"]),
            key_projections=tuple(projections["key"]),
            value_projections=tuple(projections["value"]),
            query_norm=query_norm,
            fused_qkv=fused,
            rope_layer_types=rope_layer_types,
            rotary_dims=rotary_dims,
            rope_switches=rope_switches,
            rope_limits=rope_limits,
            query_scales=tuple(query_scales),
            sliding_windows=sliding_windows,
            softcaps=softcaps,
            rotary=rotary,
            text_config=config,
        )


def _check_kv_sharing(name: str, layers, readers: dict[int, int]) -> None:
    """The model's attention modules share keys and values as ``readers`` (:func:`kv_shared_layers`, from the
    config) says: each reader marked ``is_kv_shared_layer`` (and, in transformers 5.2, reading the source named),
    every other layer not."""
    for index, layer in enumerate(layers):
        attention = attention_of(layer)
        marked = getattr(attention, "is_kv_shared_layer", False) is True
        if marked != (index in readers):
            raise UnsupportedModelError(
                f"{name}: layer {index} {'attends' if marked else 'does not attend'} to an earlier layer's keys and "
                f"values, which its config (num_kv_shared_layers) says {'it does not' if marked else 'it does'}"
            )
        source = getattr(attention, "kv_shared_layer_index", None)
        if index in readers and source is not None and int(source) != readers[index]:
            raise UnsupportedModelError(
                f"{name}: layer {index} reads the keys and values of layer {source}, not of layer {readers[index]}, "
                "the last earlier layer of its type"
            )


def mask_windows(model, geometry: ModelGeometry) -> tuple[int | None, ...]:
    """Per layer, the window to attend with where the attention module passes no ``sliding_window``:
    the config's (``geometry.sliding_windows``) when the model's decoder stack builds a
    sliding-window mask from it (PhiMoE: its attention passes nothing, its mask slides), else None
    (a Llama whose config carries a ``sliding_window`` builds a causal mask and ignores it).  Read off
    the source of the decoder stack's forward, where transformers' models choose their mask; without
    the source, None (the window the attention passes, alone)."""
    nothing = (None,) * geometry.num_layers
    if all(window is None for window in geometry.sliding_windows):
        return nothing
    try:
        source = inspect.getsource(type(decoder_stack(model)).forward)
    except (OSError, TypeError):
        return nothing
    return geometry.sliding_windows if "sliding_window" in source else nothing


def check_config(config, name: str | None = None) -> None:
    """Refuse, from the transformers config alone (before any weight loads: the commands call it on
    config.json), attention kvcal does not compute: multi-head latent attention (DeepSeek V2 / V3
    cache one latent per token, ``kv_lora_rank`` wide, from which every head's keys and values are
    projected) and dynamic NTK RoPE without a ``max_position_embeddings`` (kvcal serves dynamic NTK
    inside that original context only: :func:`original_context`), multimodal RoPE (``mrope_section``, but
    on the types checked: :data:`MULTIMODAL_ROPE_SERVED`); also a heterogeneous
    config that varies more than Gemma 4's (per-layer attention geometry), layer types without RoPE parameters
    (Beam), keys and values shared across layers where a reader has no earlier layer of its type to read,
    layers run several times per token (Dory), and a multimodal checkpoint of a type kvcal has not checked
    (:data:`MULTIMODAL_SERVED`).  ``name``: the model's, for the message (default: the config's architecture)."""
    checkpoint, config = config, text_config(config)
    if name is None:
        name = (getattr(config, "architectures", None) or [getattr(config, "model_type", None) or "the model"])[0]
    if getattr(config, "is_heterogeneous", False) is True:
        _check_per_layer_geometry(name, config)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and any(isinstance(value, dict) for value in rope.values()):
        # per layer type (transformers 5.2's Gemma 3 also keeps a top-level rope_theta: None, no layer type)
        kinds = set(getattr(config, "layer_types", None) or rope)
        without = sorted(str(kind) for kind in kinds if kind in rope and rope[kind] is None)
        if without:
            raise UnsupportedModelError(
                f"{name}: {', '.join(without)} layers without RoPE parameters (rope_parameters[{without[0]!r}] is "
                "None, as in Beam) are not supported: the rotary embedding cannot be read for them"
            )
    try:  # Gemma 3n, Gemma 4 E2B / E4B: the last layers attend to an earlier layer's cache (served)
        kv_shared_layers(config)
    except ValueError as exc:
        raise UnsupportedModelError(f"{name}: {exc}: not supported") from None
    loops = getattr(config, "n_recurrent_loops", None)
    if isinstance(loops, int) and not isinstance(loops, bool) and loops > 1:
        raise UnsupportedModelError(
            f"{name}: recurrent layers (n_recurrent_loops={loops}: a section of layers run several times per token, "
            "each loop writing its own cache, as in Dory) are not supported: kvcal's cache holds one pass of each layer"
        )
    rank = getattr(config, "kv_lora_rank", None)
    if rank:
        raise UnsupportedModelError(
            f"{name}: multi-head latent attention (MLA, kv_lora_rank={rank}: keys and values projected from one "
            "cached latent per token, as in DeepSeek V2 / V3) is not supported"
        )
    sections = next(
        (parameters["mrope_section"] for _, parameters in _rope_parameters(config) if parameters.get("mrope_section")),
        None,
    )
    if sections is not None and getattr(checkpoint, "model_type", None) not in MULTIMODAL_ROPE_SERVED:
        raise UnsupportedModelError(
            f"{name}: multimodal RoPE (mrope_section={list(sections)}: each head's rotary dims in sections turned by "
            "a token's time, height and width positions, which the model computes from its inputs, as in GLM-4V) "
            "is not supported on a model kvcal has not checked"
        )
    if _dynamic_ntk_types(config) and original_context(config) is None:
        raise UnsupportedModelError(
            f"{name}: dynamic NTK RoPE (rope_type 'dynamic') without a max_position_embeddings is not supported: "
            "transformers re-scales it past that original context, and kvcal serves it only inside it"
        )
    if config is not checkpoint and _loads_whole(checkpoint):  # a multimodal checkpoint, vision tower and all
        try:  # what its language model's layers do first: that says more (Llama 4's chunks, Falcon-H1's hybrid layers)
            layer_attention(config)
        except ValueError as exc:
            raise UnsupportedModelError(f"{name}: {exc}") from None
        _refuse_unchecked_multimodal(name, checkpoint)


def _check_per_layer_geometry(name: str, config) -> None:
    """Refuse a heterogeneous config (transformers' ``per_layer_config``) kvcal cannot hold: one that varies more
    than :data:`~artifacts.fingerprint.PER_LAYER_GEOMETRY` between its layers, or whose layers kvcal evicts
    (:func:`~artifacts.fingerprint.attention_layer_indices`: the full-attention ones, its sliding layers held
    apart) differ among themselves."""
    varying = ", ".join(sorted(getattr(config, "per_layer_attributes", None) or ()))
    if not sliding_layers_apart(config):
        raise UnsupportedModelError(
            f"{name}: a heterogeneous config (attributes that vary per layer: {varying}) is not supported: kvcal "
            "serves one only where its sliding-window layers alone differ, in head dim and KV heads (as in Gemma 4)"
        )
    held = attention_layer_indices(config)
    if not held:
        raise UnsupportedModelError(f"{name}: no full-attention layer beside the sliding ones: nothing to evict")
    shapes = {
        index: tuple(
            getattr(config.per_layer_config[index], attribute, None) for attribute in sorted(PER_LAYER_GEOMETRY)
        )
        for index in held
    }
    if len(set(shapes.values())) != 1:
        raise UnsupportedModelError(
            f"{name}: its full-attention layers differ in {varying} ({shapes}): kvcal needs one attention geometry "
            "for the layers it holds"
        )


def position_limit(config, *, first_chunk: bool = False) -> tuple[int, str] | None:
    """``(positions, why)``: the most positions kvcal serves the model at, where it serves less than the model's
    own context (``runtime.serve.generation.context_limit``), else None.  Dynamic NTK RoPE: its original
    context (:func:`original_context`; a row's real tokens, as transformers numbers positions from the mask).
    ``first_chunk``: chunked attention inside its first chunk too (:func:`~artifacts.fingerprint.attention_chunk`),
    where every earlier token is seen: what the profiler's capture computes (the runtime serves every chunk)."""
    limits = []
    original = original_context(config)
    if original is not None:
        limits.append(
            (
                original,
                f"the model's original context of {original} positions (max_position_embeddings), where its dynamic "
                "NTK RoPE re-scales every forward pass by its length and keeps that scale for the next",
            )
        )
    chunk = attention_chunk(config) if first_chunk else None
    if chunk is not None:
        limits.append((chunk, past_the_chunk(chunk)))
    return min(limits, key=lambda limit: limit[0], default=None)


def past_the_chunk(chunk: int) -> str:
    """What a refusal past a model's first attention chunk says of it (:func:`position_limit`: the profiler's
    capture; kvpress's cache)."""
    return (
        f"the model's attention chunk of {chunk} positions (attention_chunk_size), past which its chunked layers "
        "attend within chunks"
    )


def _dynamic_ntk_types(config) -> list[str | None]:
    """The layer types (None: every layer) whose RoPE is transformers' dynamic NTK (not HunYuan's NTK-alpha
    where transformers fixes its base, :func:`_fixed_ntk_alpha`)."""
    config = text_config(config)
    return [
        layer_type
        for layer_type, parameters in _rope_parameters(config)
        if parameters.get("rope_type", parameters.get("type")) == "dynamic" and not _fixed_ntk_alpha(config, parameters)
    ]


def original_context(config) -> int | None:
    """For a model with dynamic NTK RoPE (in some layer type), its original context: the longest forward
    pass transformers rotates with the default RoPE (``max_position_embeddings``; a longer pass re-scales
    the base by its own length, and the rotary module keeps that scale for later passes: docs/design.md
    section 6), the longest kvcal serves; None for any other model (or one without the number)."""
    config = text_config(config)
    positions = getattr(config, "max_position_embeddings", None)
    if not _dynamic_ntk_types(config) or not isinstance(positions, int) or isinstance(positions, bool):
        return None
    return positions if positions > 0 else None


# where a hybrid model's decoder layer keeps its recurrent mixer (Qwen3.5, Qwen3-Next, OLMo hybrid: a Gated
# DeltaNet; LFM2: a gated short convolution; Bamba, Granite 4.0-H, Jamba: Mamba 2; Nemotron-H: every layer's
# mixer, whatever it is); MiniMax keeps its lightning attention at self_attn
RECURRENT_MIXERS = ("linear_attn", "conv", "mamba", "mixer", "self_attn")
# where a decoder layer keeps its attention (Nemotron-H: ``mixer``, its attention layers' one)
ATTENTION_ATTRIBUTES = ("self_attn", "mixer")


def attention_of(layer) -> torch.nn.Module | None:
    """Decoder layer ``layer``'s attention module (``self_attn``; Nemotron-H's ``mixer``), None if it has none."""
    return next((getattr(layer, a) for a in ATTENTION_ATTRIBUTES if getattr(layer, a, None) is not None), None)


def _refuse_recurrent_layers_kvcal_cannot_hold(name: str, layers, config) -> None:
    """A hybrid model's recurrent layers (``config.layer_types``: :data:`RECURRENT_LAYER_TYPES`; and the mixers
    beside attention of :data:`STATEFUL_ATTENTION_LAYER_TYPES`, Falcon-H1's) keep a state of fixed size, which
    kvcal's cache holds in transformers' own cache layers (``cache_utils.LinearAttentionLayer``), one per layer
    type as transformers' ``DynamicCache`` builds them (``get_layer_types_and_kwargs``: options per layer from
    transformers 5.19; checked on 5.19, 5.20, 5.23 and 5.24).  Refuse a transformers without that (5.2 keeps the
    states in each model's own cache class, 5.17 and 5.18 give one set of options for every layer) and a mixer
    that does not read and write its state through the cache's ``update_conv_state`` / ``update_recurrent_state``."""
    import transformers
    from transformers import cache_utils

    layout = getattr(cache_utils, "get_layer_types_and_kwargs", None)
    per_layer = False
    if layout is not None and hasattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING"):
        options = layout(config)[1]
        per_layer = isinstance(options, list) and len(options) == len(layers)
    if not per_layer:
        raise UnsupportedModelError(
            f"{name}: a hybrid model (linear attention, convolution or Mamba layers beside attention) needs a "
            "transformers whose Cache builds one layer per layer type, linear attention layers included "
            f"(cache_utils.get_layer_types_and_kwargs with options per layer: 5.19 on); transformers "
            f"{transformers.__version__} keeps their state otherwise"
        )
    for index, layer in enumerate(layers):
        if config.layer_types[index] not in (*RECURRENT_LAYER_TYPES, *STATEFUL_ATTENTION_LAYER_TYPES):
            continue
        mixer = next((getattr(layer, a) for a in RECURRENT_MIXERS if getattr(layer, a, None) is not None), layer)
        source = _forward_source(type(mixer))
        if "update_conv_state" not in source and "update_recurrent_state" not in source:
            raise UnsupportedModelError(
                f"{name}: layer {index} is a recurrent layer ({type(mixer).__name__}) that does not keep its state "
                "in transformers' Cache (update_conv_state / update_recurrent_state), where kvcal's cache holds it"
            )


def check_routes_attention(model, what: str = "kvcal's attention function") -> None:
    """Refuse ``model`` when its attention modules do not call transformers' ``AttentionInterface`` (``what``
    kvcal switches in would never run): transformers' own test, ``_can_set_attn_implementation`` (XGLM;
    transformers 5.2's Nemotron)."""
    if hasattr(model, "_can_set_attn_implementation") and not model._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route attention through transformers' "
            f"AttentionInterface, so {what} cannot be switched in"
        )


def _refuse_attention_kvcal_cannot_compute(name: str, config, model) -> None:
    """:func:`check_config`, then Doge's dynamic mask attention and DiffLlama's differential attention,
    each refused by its name before the checks of the projections'
    shapes and of the rotary (which they fail, saying less or something wrong)."""
    check_config(getattr(model, "config", config), name)  # the checkpoint's own: a multimodal one's type counts
    layers = getattr(decoder_stack(model), "layers", None) or ()
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        if getattr(attention, "dt_proj", None) is not None and getattr(attention, "A", None) is not None:
            raise UnsupportedModelError(
                f"{name}: dynamic mask attention (layer {index} self_attn.dt_proj, as in Doge: a bias per key "
                "computed from its values, added to the attention mask) is not supported: the ragged attention "
                "reads only which tokens are real from the mask"
            )
        if getattr(attention, "lambda_q1", None) is not None:
            raise UnsupportedModelError(
                f"{name}: differential attention (layer {index} self_attn.lambda_q1, as in DiffLlama: two "
                "attention maps per layer over one cache, subtracted) is not supported"
            )


def _loads_whole(config) -> bool:
    """Whether a multimodal ``config``'s checkpoint loads whole (``common.models.load_model``): its causal LM
    class is the multimodal model (Gemma 3), or it has none (Mistral 3, LLaVA: ``AutoModelForImageTextToText``);
    not where transformers' causal LM for it is its language model alone (Llama 4, Qwen3.5: a text config
    class), which is served or refused as that model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except Exception:  # noqa: BLE001 - no causal LM (or its module cannot import here): loaded whole
        return True
    return getattr(model_class, "config_class", None) is type(config)


def _refuse_unchecked_multimodal(name: str, config) -> None:
    """Refuse a multimodal checkpoint (``config``: its own, not its text model's) whose type is not one of
    :data:`MULTIMODAL_SERVED`, naming the types served."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MULTIMODAL_SERVED:
        raise UnsupportedModelError(
            f"{name}: the language model of a multimodal checkpoint ({model_type}) kvcal has not checked: "
            f"its text path may number positions or mask the prompt otherwise than its language model alone; "
            f"served on text: {', '.join(sorted(MULTIMODAL_SERVED))}"
        )


def _fixed_ntk_alpha(config, parameters: dict) -> bool:
    """Whether transformers' rotary module for the config's model type reads "dynamic" with an ``alpha``
    as NTK-alpha: one fixed base, ``rope_theta * alpha ** (d / (d - 2))``, whatever the length
    (``compute_ntk_alpha_rope_parameters``, ``rope_type`` "ntk_alpha").  Every HunYuan checkpoint writes
    its RoPE so (``{"type": "dynamic", "alpha": 1000, ...}``); transformers 5.24's HunYuan modules fix
    the base, 5.2's re-scale it by the longest position as dynamic NTK does (tests/test_rope_forms.py)."""
    if not parameters.get("alpha"):
        return False
    try:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        module = model_type_to_module_name(str(getattr(config, "model_type", "")))
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError:  # a model type transformers does not ship (remote code): its rotary is unknown
        return False
    return any(hasattr(value, "compute_ntk_alpha_rope_parameters") for value in vars(modeling).values())


def _rope_parameters(config) -> list[tuple[str | None, dict]]:
    """The config's RoPE parameters: ``[(None, parameters)]``, or one per layer type (Gemma 3)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    if rope and all(isinstance(value, dict) for value in rope.values()):
        return [(str(kind), value) for kind, value in rope.items()]
    return [(None, rope)]


def _longrope_switch(config, parameters: dict) -> int | None:
    """For transformers' longrope RoPE, the pass length above which it rotates with its long factors (a
    pass whose largest position + 1 is at most ``original_max_position_embeddings`` takes the short
    ones: ``dynamic_rope_update``); None for any other RoPE."""
    if parameters.get("rope_type", parameters.get("type")) != "longrope":
        return None
    switch = parameters.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return None if switch is None else int(switch)


def _linear(name: str, index: int, attention, attribute: str, features: int, expected: str) -> torch.nn.Linear:
    module = getattr(attention, attribute, None)
    if not isinstance(module, torch.nn.Linear):
        detail = " nor a fused qkv_proj" if attribute == "q_proj" else ""
        raise UnsupportedModelError(f"{name}: layer {index} attention has no {attribute} linear{detail}")
    if module.out_features != features:
        raise UnsupportedModelError(
            f"{name}: layer {index} {attribute} gives {module.out_features} features, expected {expected}"
        )
    return module


def _projections(name: str, index: int, attention, numbers: dict) -> dict[str, Projection]:
    """Separate ``q_proj``, ``k_proj``, ``v_proj`` (the query and keys after their norms, if any)."""
    heads, kv_heads, dim = numbers["num_q_heads"], numbers["num_kv_heads"], numbers["head_dim"]
    value_dim = numbers.get("value_head_dim", dim)
    gated = _output_gate_in_queries(attention, heads * dim)
    q_proj = _linear(name, index, attention, "q_proj", heads * dim * (2 if gated else 1), f"{heads} heads x {dim}")
    k_proj = _linear(name, index, attention, "k_proj", kv_heads * dim, f"{kv_heads} KV heads x {dim}")
    if getattr(attention, "v_proj", None) is None and _values_are_the_keys(attention):
        v_proj = k_proj  # Gemma 4's attention_k_eq_v: the values are k_proj's output, normed by v_norm alone
    else:
        v_proj = _linear(name, index, attention, "v_proj", kv_heads * value_dim, f"{kv_heads} KV heads x {value_dim}")
    query = _read(name, index, attention, "q", q_proj, heads, dim)
    key = _read(name, index, attention, "k", k_proj, kv_heads, dim)
    multiplier = getattr(attention, "key_multiplier", None)  # Falcon-H1: keys = k_proj(x) * key_multiplier
    if isinstance(multiplier, (int, float)) and not isinstance(multiplier, bool) and multiplier != 1:
        if key.norm is not None:
            raise UnsupportedModelError(f"{name}: layer {index} scales its keys and normalises them")
        key = dataclasses.replace(key, scale=float(multiplier))
    return {
        "query": dataclasses.replace(query, head_width=2 * dim) if gated else query,
        "key": key,
        # the values as cached: through the norm the model applies to them (Gemma 3n's and Gemma 4's v_norm), times
        # the factor it scales them by (MiMo-V2-Flash's v_scale, attention_value_scale)
        "value": _value_read(
            _normed(name, index, v_proj, kv_heads, value_dim, getattr(attention, "v_norm", None)), attention
        ),
    }


def _value_read(value: Projection, attention) -> Projection:
    """``value`` scaled by the factor ``attention`` multiplies its values by before caching them (MiMo-V2-Flash's
    ``v_scale``), where it has one other than 1."""
    factor = getattr(attention, "v_scale", None)
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor != 1:
        if value.norm is not None:
            raise UnsupportedModelError("a model that scales its values and normalises them is not supported")
        return dataclasses.replace(value, scale=float(factor))
    return value


def _values_are_the_keys(attention) -> bool:
    """Whether ``attention`` (without a ``v_proj``) takes its values from its key projection's output (Gemma 4's
    full-attention layers under ``attention_k_eq_v``: ``value_states = key_states`` before the key norm and
    RoPE, then ``v_norm``), read off its forward's source."""
    return "if self.v_proj is not None else key_states" in _forward_source(type(attention))


def _output_gate_in_queries(attention, features: int) -> bool:
    """Whether ``attention``'s ``q_proj`` computes, per head, its ``d`` query features and then ``d`` of an output
    gate (Qwen3.5, Qwen3-Next: ``torch.chunk`` of each head's ``2 d``, the attention's output times the gate's
    sigmoid): twice the query's ``features``, and a forward that splits a gate off them.  The read of the queries
    takes each head's first half; :mod:`runtime.plan.rope_check` checks it against what the attention receives."""
    q_proj = getattr(attention, "q_proj", None)
    if not isinstance(q_proj, torch.nn.Linear) or q_proj.out_features != 2 * features:
        return False
    source = _forward_source(type(attention))
    return "gate" in source and "torch.chunk(" in source and "head_dim * 2" in source


@functools.cache
def _forward_source(module_class: type) -> str:
    """The source of ``module_class.forward`` ("" where it cannot be read), read once per class: the geometry
    reads it per layer and is rebuilt at every call of an entry point."""
    try:
        return inspect.getsource(module_class.forward)
    except (OSError, TypeError):
        return ""


def _read(name: str, index: int, attention, side: str, linear, heads: int, dim: int) -> Projection:
    """The pre-RoPE read of the queries (``side`` "q") or keys ("k"): ``linear``'s output through the norm
    the model applies before RoPE (:func:`_normed`), or, where it normalises after RoPE, divided by its root
    mean square, the norm's weight kept to apply after the rotation (:func:`_norm_after_rope`)."""
    before, after = _pre_rope_norm(attention, side), _norm_after_rope(attention, side)
    if after is None:
        return _normed(name, index, linear, heads, dim, before)
    if before is not None:
        raise UnsupportedModelError(
            f"{name}: layer {index} normalises its {side} projection both before and after RoPE"
        )
    eps = getattr(after, "variance_epsilon", getattr(after, "eps", None))
    weight = getattr(after, "weight", None)
    if not isinstance(eps, (int, float)) or (weight is not None and tuple(weight.shape) != (dim,)):
        raise UnsupportedModelError(
            f"{name}: layer {index} normalises its {side} projection after RoPE with a "
            f"{type(after).__name__} kvcal cannot read (an RMS norm with an epsilon and a weight of {dim}, or none)"
        )
    if weight is not None and bool((weight == 0).any()):
        raise UnsupportedModelError(
            f"{name}: layer {index}'s norm after RoPE has a zero weight, which erases a dimension the RoPE "
            "scorers would have to un-rotate"
        )
    return Projection(linear, heads, dim, norm=RootMeanSquare(eps), weight_after_rope=weight)


def _norm_after_rope(attention, side: str) -> torch.nn.Module | None:
    """The norm ``attention`` applies to its rotated queries (``side`` "q") or keys ("k"): HunYuan's
    ``query_layernorm`` / ``key_layernorm``, Llama 4's ``qk_norm`` (one for both, on its RoPE layers).
    :mod:`runtime.plan.rope_check` checks the read against what the attention receives (a norm that
    centres, as a LayerNorm does, does not commute with the rotation and is refused there)."""
    for attribute in ({"q": "query_layernorm", "k": "key_layernorm"}[side], "qk_norm"):
        norm = getattr(attention, attribute, None)
        if norm is not None:
            return norm
    return None


def _pre_rope_norm(attention, side: str) -> torch.nn.Module | None:
    """The norm ``attention`` applies to its queries (``side`` "q") or keys ("k") before RoPE:
    ``q_norm`` (Qwen3, Gemma 3, OLMo2, Command R+), or ``q_layernorm`` (StableLM and Phi's
    ``qk_layernorm``, LFM2).  HunYuan's ``query_layernorm`` comes after the rotation
    (:func:`_norm_after_rope`)."""
    for attribute in (f"{side}_norm", f"{side}_layernorm"):
        norm = getattr(attention, attribute, None)
        if norm is not None:
            return norm
    return None


def _normed(name: str, index: int, linear, heads: int, dim: int, norm) -> Projection:
    """``linear``'s output, through ``norm`` when there is one: a norm with a weight of ``d`` (per
    head), ``[H, d]`` (per head, a weight each: Command R+), ``H d`` (over all heads) or 1 features, a
    module of one LayerNorm per head (StableLM's ``qk_layernorm``, on ``[B, H, T, d]``), or a norm
    without a weight, read as one of each head (NanoChat's, applied after RoPE: an RMS norm without a
    weight commutes with the rotation; :mod:`runtime.plan.rope_check` checks the read on the model)."""
    if norm is None:
        return Projection(linear, heads, dim)
    per_head = getattr(norm, "norms", None)  # StableLM: a LayerNorm of d per head, heads on axis 1
    if isinstance(per_head, torch.nn.ModuleList) and len(per_head) == heads:
        return Projection(linear, heads, dim, norm=norm, heads_first=True)
    weight = getattr(norm, "weight", None)
    # NanoChat: read as a norm of each head (runtime.plan.rope_check checks it on the model); a weight of one
    # element is a scale for every feature (transformers 5.2's Gemma 3n v_norm without a scale: a buffer of 1.0)
    if weight is None or weight.numel() == 1:
        return Projection(linear, heads, dim, norm=norm)
    size = weight.numel()
    if size not in (dim, heads * dim):
        raise UnsupportedModelError(
            f"{name}: layer {index} has a projection norm of {size} features, expected {dim} or {heads} x {dim}"
        )
    return Projection(linear, heads, dim, norm=norm, norm_per_head=size == dim or tuple(weight.shape) == (heads, dim))


def _fused_projections(name: str, index: int, attention, numbers: dict) -> dict[str, Projection]:
    """One ``qkv_proj`` whose output is ``[.., (Hq + 2 Hkv) d]``: queries, keys, values in that order
    (as Phi-3 splits it); a query or key norm after a fused projection is not supported."""
    heads, kv_heads, dim = numbers["num_q_heads"], numbers["num_kv_heads"], numbers["head_dim"]
    qkv = _linear(
        name,
        index,
        attention,
        "qkv_proj",
        (heads + 2 * kv_heads) * dim,
        f"({heads} + 2 x {kv_heads}) heads x {dim}",
    )
    if any(find(attention, side) is not None for find in (_pre_rope_norm, _norm_after_rope) for side in "qk"):
        raise UnsupportedModelError(f"{name}: layer {index} has a fused qkv_proj and a query or key norm")
    queries, keys = heads * dim, (heads + kv_heads) * dim
    return {
        "query": Projection(qkv, heads, dim, slice(0, queries)),
        "key": Projection(qkv, kv_heads, dim, slice(queries, keys)),
        "value": Projection(qkv, kv_heads, dim, slice(keys, None)),
    }


def _rope_layer_types(name: str, rotary, config, indices: tuple[int, ...]) -> tuple[str | None, ...]:
    """Per (attention) layer, what the rotary module takes (Gemma 3: the layer's type; None for one shared
    RoPE); ``indices``: the decoder layers they are."""
    takes = _rope_takes_layer_type(rotary)
    if takes is False:
        return (None,) * len(indices)
    types = getattr(config, "layer_types", None)
    if takes is None and types is None:  # an optional layer type and none per layer: one shared RoPE
        return (None,) * len(indices)
    if types is None or len(types) != int(config.num_hidden_layers):
        raise UnsupportedModelError(
            f"{name}: the rotary embedding takes a layer type, but the config has none per layer"
        )
    return tuple(str(types[index]) for index in indices)


def _rotary_dims(name: str, rotary, rope_layer_types, head_dim: int) -> tuple[int, ...]:
    """Per layer, how many of a head's ``head_dim`` dimensions RoPE turns: the rotary module's ``cos``
    width for the layer's type.  transformers turns the first ones and passes the rest (partial RoPE);
    :mod:`runtime.plan.rope_check` confirms it per layer."""
    device = next(rotary.buffers(), torch.empty(0)).device
    probe = torch.zeros(1, 1, 1, device=device)
    dims = {}
    for layer_type in sorted(set(rope_layer_types), key=str):
        extra = () if layer_type is None else (layer_type,)
        try:
            with torch.no_grad():
                output = rotary(probe, torch.zeros(1, 1, dtype=torch.long, device=device), *extra)
        except IndexError as exc:  # transformers 5.2's Qwen2-VL indexes the three sections of [3, B, T] positions
            raise UnsupportedModelError(
                f"{name}: its rotary embedding does not take one position per token ({type(exc).__name__}: {exc}); "
                "kvcal computes RoPE from [batch, tokens] positions"
            ) from None
        rotated = _rotary_dimensions(name, output)
        if rotated > head_dim or rotated % 2 or not rotated:
            raise UnsupportedModelError(
                f"{name}: rotary embeddings on {rotated} of {head_dim} dimensions are not supported "
                "(RoPE turns pairs of a head's dimensions)"
            )
        dims[layer_type] = rotated
    return tuple(dims[layer_type] for layer_type in rope_layer_types)


def _rotary_dimensions(name: str, output) -> int:
    """How many of a head's dimensions the rotary module's ``output`` turns: ``(cos, sin)`` of
    ``[.., d]`` (Llama), or one complex ``freqs_cis [.., d/2]`` (Llama 4: a pair per complex number)."""
    if isinstance(output, torch.Tensor):
        if not output.is_complex():
            raise UnsupportedModelError(
                f"{name}: the rotary embedding returns one real tensor {tuple(output.shape)}, neither "
                "(cos, sin) nor complex frequencies"
            )
        return 2 * output.shape[-1]
    cos, _ = output
    return cos.shape[-1]
