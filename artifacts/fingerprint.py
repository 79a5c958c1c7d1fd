"""Model fingerprints: which architecture, which weights, which tokenizer an artifact is for.

All three are SHA-256 hex digests of canonical text, so they are stable across machines,
devices and library versions.

* **architecture** (:func:`architecture_fingerprint`): the attention-relevant config numbers
  (model type, layers, query/KV heads, head dim, hidden size, vocab size, max positions, RoPE
  theta and parameters, query norm), and, only for a model that has any, what its attention
  does beyond them (:func:`attention_variant`: sliding windows, logit soft-capping, per-layer
  RoPE), so a model of the same shapes without them does not match.
* **weights** (:func:`weights_fingerprint`): for every parameter and buffer of the state dict
  (of a multimodal checkpoint, its language model's: :func:`language_model_tensors`), in name order:
  its name, shape, and
    - ``bitsum``: the wrap-around (mod 2^64) sum of the float32 bit patterns of all its values,
      read as signed 32-bit integers.  Exact integer arithmetic, so the summation order (CPU,
      GPU, sharded) does not matter; every value takes part, so changing any single weight
      changes it.  It runs on the device holding the tensor; only one int64 per tensor crosses
      to the host.
    - ``sample``: the float32 bit patterns of up to 64 values at evenly spaced flat positions,
      which makes permutations and swaps visible.
  Values are compared as float32, so a bf16/fp16 checkpoint loaded in float32 has the same
  fingerprint as loaded in its own dtype (the up-cast is exact).  Nothing is hashed on the
  host but these few numbers: a 70B model costs one device reduction per tensor, not a hash of
  140 GB.
* **weights under a dtype** (:func:`weights_fingerprints`): the same, with every floating
  tensor first cast to that dtype (``tensor.to(dtype)``: round to nearest even, exactly what
  transformers does when it loads a float32 checkpoint with ``dtype=torch.bfloat16``).  The
  profiler records it for each of :data:`FINGERPRINT_DTYPES`; the runtime computes only the
  one for the dtype the served model is in (:func:`serving_dtype`) and compares like with
  like, so a float32-profiled checkpoint loaded in bfloat16 or float16 is recognised, and a
  weight that differs after the rounding is still seen.  The float32 entry is the plain
  weights fingerprint above.
* **tokenizer** (:func:`tokenizer_fingerprint`): the vocabulary (token -> id), the added and
  special tokens, and the chat template.

Importing this module does not import torch; the functions that take a model do.
"""

from __future__ import annotations

import functools
import hashlib
import json

from .schema import ModelIdentity, canonical_json

SAMPLES_PER_TENSOR = 64
# The dtypes a checkpoint is commonly served in; the artifact records the weights fingerprint
# under each (``/model`` attribute ``weights_fingerprints``, schema 1.2).
FINGERPRINT_DTYPES = ("float32", "bfloat16", "float16")
_CHUNK_ELEMENTS = 1 << 24  # bound the temporary float32 copy per step


def _sha256(document) -> str:
    return hashlib.sha256(canonical_json(document).encode("ascii")).hexdigest()


def text_config(config):
    """The text model's config (``get_text_config()`` of a multimodal config, else ``config`` itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# where a multimodal checkpoint's model (``model.model``) keeps its language model (Gemma 3 and Mistral 3:
# ``language_model``; Idefics3 and SmolVLM: ``text_model``)
LANGUAGE_MODEL_ATTRIBUTES = ("language_model", "text_model")


def decoder_stack(model):
    """The module holding a causal LM's decoder layers: ``model.model`` (a Llama-family causal LM), else
    the language model inside it (``model.model.language_model`` or ``.text_model``: a multimodal
    checkpoint loaded whole, as transformers loads Gemma 3 or Mistral 3); None when neither has ``layers``.
    Whether kvcal serves the language model of a multimodal checkpoint is
    ``runtime.math.geometry.ModelGeometry``'s to say."""
    backbone = getattr(model, "model", None)
    if getattr(backbone, "layers", None) is not None:
        return backbone
    for name in LANGUAGE_MODEL_ATTRIBUTES:
        inner = getattr(backbone, name, None)
        if getattr(inner, "layers", None) is not None:
            return inner
    return None


def attention_numbers(config) -> dict:
    """``num_layers``, ``num_q_heads``, ``num_kv_heads``, ``head_dim`` of a transformers config.
    ``num_layers`` counts the layers with a KV cache: every decoder layer, but of a hybrid model (Qwen3.5,
    Qwen3-Next, LFM2) its attention layers alone (:func:`attention_layer_indices`).

    The one place these numbers are read from a config: the architecture fingerprint records
    them, and ``runtime.math.geometry.ModelGeometry`` checks the model's modules against them.
    ``num_key_value_heads`` defaults to the query heads (no GQA), ``head_dim`` to
    ``hidden_size // num_attention_heads``.  Raises ``ValueError("config lacks ...")``.
    """
    config = text_config(config)
    missing = [name for name in ("num_hidden_layers", "num_attention_heads") if getattr(config, name, None) is None]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)}")
    indices = attention_layer_indices(config)
    shapes = held_layer_config(config)
    if getattr(shapes, "head_dim", None) is None and getattr(shapes, "hidden_size", None) is None:
        raise ValueError("config lacks head_dim (or hidden_size)")
    num_q_heads = int(config.num_attention_heads)
    return {
        "num_layers": len(indices),
        "num_q_heads": num_q_heads,
        "num_kv_heads": int(getattr(shapes, "num_key_value_heads", None) or num_q_heads),
        "head_dim": int(getattr(shapes, "head_dim", None) or shapes.hidden_size // num_q_heads),
    }


def value_head_dim(config) -> int:
    """The head dim of the values kvcal caches: ``v_head_dim`` where the config gives one (MiMo-V2-Flash's values
    are narrower than its keys), else the keys' ``head_dim`` (:func:`attention_numbers`)."""
    shapes = held_layer_config(config)
    value = getattr(shapes, "v_head_dim", None)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return attention_numbers(config)["head_dim"]


def held_layer_config(config):
    """The config to read the attention geometry of the layers kvcal evicts from (head dim, KV heads): of a model
    whose sliding layers are held apart (:func:`sliding_layers_apart`, Gemma 4), its first
    full-attention layer's (transformers' ``per_layer_config``, where a heterogeneous config keeps what varies:
    reading ``config.head_dim`` there raises), else ``config`` (its text config) itself."""
    config = text_config(config)
    if sliding_layers_apart(config) and getattr(config, "is_heterogeneous", False) is True:
        return config.per_layer_config[attention_layer_indices(config)[0]]
    return config


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # config.layer_types the toolkit knows
# config.layer_types of a hybrid model's layers that keep a state of fixed size instead of a KV cache (Gated DeltaNet
# in Qwen3.5 and Qwen3-Next, gated short convolutions in LFM2): kvcal leaves them, and their state, to transformers
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")
# config.layer_types of layers without a token mixer (Nemotron-H's MoE and MLP layers): nothing to cache
MIXERLESS_LAYER_TYPES = ("moe", "mlp")
# config.layer_types of layers that attend (a KV cache, full attention) and run a recurrent mixer beside it, on
# the same input (Falcon-H1: Mamba 2 and attention in every layer)
STATEFUL_ATTENTION_LAYER_TYPES = ("hybrid",)


def attention_layer_indices(config) -> tuple[int, ...]:
    """The decoder layers whose KV cache kvcal profiles and evicts, in order: every layer, but of a hybrid model
    (``config.layer_types`` naming :data:`RECURRENT_LAYER_TYPES` or :data:`MIXERLESS_LAYER_TYPES`) only the others,
    of a model whose sliding layers have another attention geometry (Gemma 4:
    :func:`sliding_layers_apart`) its full-attention layers alone, and never a layer that attends to an earlier
    layer's cache instead of its own (:func:`kv_shared_layers`).  Position ``i`` of this tuple is
    layer ``i`` of everything kvcal computes (the artifact's ``L`` axis, ``ModelGeometry``'s tuples); of a model
    without such layers the two numberings are one."""
    config = text_config(config)
    layers = int(config.num_hidden_layers)
    readers = kv_shared_layers(config)
    types = getattr(config, "layer_types", None)
    if types is None:
        return tuple(index for index in range(layers) if index not in readers)
    without = (*RECURRENT_LAYER_TYPES, *MIXERLESS_LAYER_TYPES)
    if sliding_layers_apart(config):
        without += ("sliding_attention",)
    return tuple(index for index, kind in enumerate(types) if kind not in without and index not in readers)


def kv_shared_layers(config) -> dict[int, int]:
    """``{decoder layer: decoder layer whose cache it attends to}`` of a model whose last
    ``config.num_kv_shared_layers`` layers compute no keys and values of their own (Gemma 3n, Gemma 4 E2B / E4B):
    each attends with its own queries to the cache of the last earlier layer of its layer type, as transformers'
    models compute it (``kv_sharing_modes``: those sources "store", the layers after them "reuse").  Empty for
    a model without such layers.  kvcal profiles and evicts the sources alone; a layer reading a source's cache
    attends over what the source holds (``runtime.kv_store.cache.RaggedLayer.attend_shared``).  Raises
    ``ValueError`` where no layer of a reader's type precedes the shared ones (every layer shared: a draft model's
    config, which reads another model's cache)."""
    config = text_config(config)
    shared = getattr(config, "num_kv_shared_layers", None)
    if not isinstance(shared, int) or isinstance(shared, bool) or shared <= 0:
        return {}
    types = getattr(config, "layer_types", None)
    return dict(_kv_sources(int(config.num_hidden_layers), shared, None if types is None else tuple(types)))


@functools.lru_cache(maxsize=64)
def _kv_sources(layers: int, shared: int, types: tuple | None) -> tuple[tuple[int, int], ...]:
    """:func:`kv_shared_layers` as ``((reader, source), ...)`` (cached: the attention function asks at every
    call of a Gemma 3n / Gemma 4 layer)."""
    first = layers - shared
    kinds = types if types is not None else ("full_attention",) * layers
    if len(kinds) != layers:
        raise ValueError(f"config has {len(kinds)} layer types for {layers} layers")
    pairs = []
    for reader in range(max(first, 0), layers):
        earlier = [index for index in range(max(first, 0)) if kinds[index] == kinds[reader]]
        if not earlier:
            raise ValueError(
                f"keys and values shared across layers (num_kv_shared_layers={shared} of {layers}): layer {reader} "
                f"({kinds[reader]}) would attend to the cache of no earlier layer of its type"
            )
        pairs.append((reader, earlier[-1]))
    return tuple(pairs)


# the attributes a heterogeneous config (transformers' ``per_layer_config``) may vary between its sliding and its
# full-attention layers for kvcal to serve it (Gemma 4: a wider head dim and fewer KV heads on the full layers)
PER_LAYER_GEOMETRY = frozenset({"head_dim", "num_key_value_heads"})
# the model types whose sliding-window layers have another attention geometry than their full-attention ones by
# the model's code, not a heterogeneous config: MiMo-V2-Flash's have twice the KV heads (and learned sinks)
SLIDING_GEOMETRY_APART = frozenset({"mimo_v2_flash"})


def sliding_layers_apart(config) -> bool:
    """Whether kvcal holds ``config``'s sliding-window layers apart from the layers it profiles and evicts, its
    full-attention ones: a heterogeneous config (``is_heterogeneous``, Gemma 4) whose layers differ only in
    :data:`PER_LAYER_GEOMETRY`, or a model of :data:`SLIDING_GEOMETRY_APART` (MiMo-V2-Flash).  Those sliding
    layers are of another head dim or KV heads than the full ones (the artifact's axes are one geometry) and
    bounded by their window: ``runtime.kv_store.cache.RaggedCache`` keeps
    each in a layer of its own geometry, its window of real tokens, never evicted; the full layers, whose caches
    grow with the context, are what the artifact covers.  Whether the full layers share one geometry is
    ``runtime.math.geometry.check_config``'s to check."""
    config = text_config(config)
    types = getattr(config, "layer_types", None) or ()
    if getattr(config, "model_type", None) in SLIDING_GEOMETRY_APART:
        return "sliding_attention" in types
    if getattr(config, "is_heterogeneous", False) is not True:
        return False
    varying = set(getattr(config, "per_layer_attributes", None) or ())
    return bool(varying) and varying <= PER_LAYER_GEOMETRY and "sliding_attention" in types


def layer_attention(config) -> tuple[tuple[int | None, ...], tuple[float | None, ...]]:
    """Per attention layer (:func:`attention_layer_indices`), the sliding window (None: the layer attends to
    every earlier token) and the attention-logit soft-cap (None: none) of a transformers config, as the
    models' attention modules apply them: with ``config.layer_types`` the ``"sliding_attention"`` layers slide
    (Qwen2, Gemma 2/3), without it every layer slides when ``config.sliding_window`` is set
    (Mistral, Phi-3); ``config.attn_logit_softcapping`` caps every layer (Gemma 2).

    The one place these are read: the architecture fingerprint records them
    (:func:`attention_variant`) and ``runtime.math.geometry.ModelGeometry`` carries them.  Raises
    ``ValueError`` for a layer type other than full or sliding attention, or chunked attention with a
    chunk size (Llama 4's ``chunked_attention`` layers, :func:`attention_chunks`).
    """
    config = text_config(config)
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    window = int(window) if window else None
    types = getattr(config, "layer_types", None)
    if types is None:
        windows = (window,) * layers
    else:
        known = {
            *ATTENTION_LAYER_TYPES,
            *RECURRENT_LAYER_TYPES,
            *MIXERLESS_LAYER_TYPES,
            *STATEFUL_ATTENTION_LAYER_TYPES,
            *(("chunked_attention",) if attention_chunk(config) else ()),
        }
        unknown = sorted({str(kind) for kind in types} - known)
        if unknown:
            raise ValueError(
                f"layer type(s) {', '.join(unknown)} are not supported (only full and sliding attention, and beside "
                f"them {', '.join((*RECURRENT_LAYER_TYPES, *MIXERLESS_LAYER_TYPES))} layers, which keep no KV cache, "
                f"and {', '.join(STATEFUL_ATTENTION_LAYER_TYPES)} layers, attention beside a recurrent mixer)"
            )
        if len(types) != layers:
            raise ValueError(f"config has {len(types)} layer types for {layers} layers")
        indices = attention_layer_indices(config)
        if not indices:
            raise ValueError(
                "no attention layer (every layer type is linear attention, convolution or MLP): no KV cache"
            )
        windows = tuple(window if types[index] == "sliding_attention" else None for index in indices)
    cap = getattr(config, "attn_logit_softcapping", None)
    return windows, (float(cap) if cap else None,) * len(windows)


def attention_chunk(config) -> int | None:
    """The attention chunk of a model with chunked attention (Llama 4's ``attention_chunk_size``, 8192 in its
    checkpoints: a chunked layer's query at position ``p`` attends only to the keys at ``k <= p`` of its own
    chunk of that many positions, ``k // C == p // C``), else None.  A size without ``chunked_attention``
    layers (a Llama's config carrying one) is ignored, as the model's own mask ignores it."""
    config = text_config(config)
    size = getattr(config, "attention_chunk_size", None)
    if "chunked_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    return int(size) if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def attention_chunks(config) -> tuple[int | None, ...]:
    """Per attention layer (:func:`attention_layer_indices`): the chunk its queries attend within
    (:func:`attention_chunk`) for a ``chunked_attention`` layer, else None (Llama 4: three layers in four)."""
    chunk = attention_chunk(config)
    types = getattr(text_config(config), "layer_types", None)
    indices = attention_layer_indices(config)
    if chunk is None or types is None:
        return (None,) * len(indices)
    return tuple(chunk if types[index] == "chunked_attention" else None for index in indices)


def attention_variant(config) -> dict:
    """What a model's attention does beyond the architecture numbers, for the fingerprint: a hybrid model's
    attention layers (``attention_layers``: decoder layer indices, :func:`attention_layer_indices`), the layers
    attending to another's cache (``kv_shared_layers``: ``[reader, source]`` pairs, :func:`kv_shared_layers`), the
    sliding window and which (attention) layers slide (``sliding_window``, ``sliding_layers``), the logit
    soft-cap (``attn_logit_softcapping``), the attention chunk (``attention_chunk_size``), per-layer-type
    RoPE parameters (``rope_parameters_by_layer_type``, Gemma 3) and the values' head dim where it is not the
    keys' (``value_head_dim``, :func:`value_head_dim`), each only when the model has it: empty for a
    model that has none of them, whose fingerprint is then what it always was."""
    config = text_config(config)
    windows, caps = layer_attention(config)
    variant = {}
    indices = attention_layer_indices(config)
    if len(indices) != int(config.num_hidden_layers):  # a hybrid model: which decoder layers are attention
        variant["attention_layers"] = list(indices)
    readers = kv_shared_layers(config)
    if readers:  # which decoder layer attends to which one's cache
        variant["kv_shared_layers"] = [[reader, source] for reader, source in sorted(readers.items())]
    sliding = [layer for layer, window in enumerate(windows) if window is not None]
    if sliding:
        variant["sliding_window"] = windows[sliding[0]]
        variant["sliding_layers"] = sliding
    if caps and caps[0] is not None:
        variant["attn_logit_softcapping"] = caps[0]
    if attention_chunk(config) is not None:
        variant["attention_chunk_size"] = attention_chunk(config)
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and rope and all(isinstance(value, dict) for value in rope.values()):
        variant["rope_parameters_by_layer_type"] = _jsonable(rope)
    value = value_head_dim(config)
    if value != attention_numbers(config)["head_dim"]:
        variant["value_head_dim"] = value
    return variant


def architecture_numbers(config) -> dict:
    """The attention-relevant numbers of a transformers config (text config for multimodal), with
    ``attention_variant`` (canonical JSON of :func:`attention_variant`) only when it is not empty."""
    config = text_config(config)
    missing = [
        name
        for name in ("num_hidden_layers", "num_attention_heads", "hidden_size")
        if getattr(config, name, None) is None
    ]
    if missing:
        raise ValueError(f"config of model type {getattr(config, 'model_type', '?')!r} lacks {missing}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and all(isinstance(value, dict) for value in rope.values()) and rope:
        rope = rope.get("full_attention", next(iter(rope.values())))  # per-layer-type parameters
    rope = dict(rope) if isinstance(rope, dict) else {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError(f"config of model type {config.model_type!r} has no RoPE theta")
    numbers = {
        "model_type": str(config.model_type),
        **attention_numbers(config),
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(config.vocab_size),
        "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0),
        "rope_theta": float(theta),
        "rope_parameters": canonical_json(_jsonable(rope)),
    }
    variant = attention_variant(config)
    if variant:  # only then: a model without a window, a soft-cap or per-layer RoPE keeps its fingerprint
        numbers["attention_variant"] = canonical_json(variant)
    return numbers


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    return str(value)


def architecture_fingerprint(numbers: dict, query_norm: bool) -> str:
    return _sha256({**numbers, "query_norm": bool(query_norm)})


def weights_fingerprint(model, dtype: str = "float32") -> str:
    """The weights fingerprint of ``model`` as loaded in ``dtype`` (see the module docstring).

    ``model`` is any ``torch.nn.Module``.  ``dtype="float32"`` (the default) is the recorded
    ``weights_fingerprint``; see :func:`weights_fingerprints` for the others.
    """
    return weights_fingerprints(model, (dtype,))[dtype]


def weights_fingerprints(model, dtypes: tuple[str, ...] = FINGERPRINT_DTYPES) -> dict[str, str]:
    """``{dtype: fingerprint}``: the weights fingerprint of ``model`` as if each floating tensor
    were cast to ``dtype`` first (``tensor.to(dtype)``, round to nearest even: what transformers
    does to a float32 checkpoint loaded with that dtype).  One pass over the weights for all of
    ``dtypes``; a tensor already in ``dtype`` (or of lower precision) is not changed by the cast.
    """
    return tensors_fingerprints(language_model_tensors(model), dtypes)


def language_model_tensors(model) -> list:
    """``(name, tensor)`` of what the weights fingerprint covers: ``model``'s state dict; of a multimodal
    checkpoint loaded whole (:func:`decoder_stack` inside ``model.model``), its language model's alone,
    named as that model alone names them (``model.layers.0...``, ``lm_head.weight``).  What kvcal computes
    reads the language model only, so an artifact profiled on it alone serves the checkpoint and the
    reverse; and the vision tower's names change between transformers versions (5.2's CLIP tower keeps
    a ``vision_model.`` level that 5.24's drops), which would tell one checkpoint from itself."""
    stack = decoder_stack(model)
    if stack is None or stack is getattr(model, "model", None):
        return list(model.state_dict(keep_vars=False).items())
    named = [(f"model.{name}", tensor) for name, tensor in stack.state_dict(keep_vars=False).items()]
    head = model.get_output_embeddings()
    if head is not None:
        named += [(f"lm_head.{name}", tensor) for name, tensor in head.state_dict(keep_vars=False).items()]
    return named


def tensors_fingerprints(named_tensors, dtypes: tuple[str, ...] = FINGERPRINT_DTYPES) -> dict[str, str]:
    """:func:`weights_fingerprints` of ``(name, tensor)`` pairs (a state dict's items, in any order),
    whatever holds them: a loaded model, or a checkpoint's tensors read one by one."""
    import torch

    targets = {name: getattr(torch, name) for name in dtypes}
    entries: dict[str, list] = {name: [] for name in dtypes}
    with torch.no_grad():
        for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
            floating = tensor.is_floating_point()
            if not floating and tensor.dtype not in (torch.int8, torch.uint8, torch.int32):
                # integer buffers other than quantised weights (e.g. position ids) carry no identity
                continue
            flat = tensor.detach().reshape(-1)
            count = min(SAMPLES_PER_TENSOR, flat.numel())
            positions = (torch.arange(count, dtype=torch.int64) * (flat.numel() - 1) // max(count - 1, 1)).to(
                flat.device
            )
            bitsums = dict.fromkeys(dtypes, 0)
            for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
                chunk = flat[start : start + _CHUNK_ELEMENTS]
                for key, target in targets.items():
                    bitsums[key] += _bitsum(chunk.to(target) if floating else chunk)
            for key, target in targets.items():
                picked = flat[positions]
                picked = picked.to(target) if floating else picked
                sample = picked.to(torch.float32).view(torch.int32).tolist() if count else []
                entries[key].append([name, list(tensor.shape), bitsums[key] % (1 << 64), sample])
    return {key: _sha256(value) for key, value in entries.items()}


def serving_dtype(model) -> str | None:
    """The dtype ``model``'s weights are compared under: its lowest-precision floating dtype.

    ``"bfloat16"`` when any floating tensor of the state dict is bfloat16, else ``"float16"``
    when any is float16, else ``"float32"`` (float32 and float64 tensors); ``None`` for other
    floating dtypes (float8...), which have no recorded entry.  A model loaded in bfloat16 that
    keeps some modules in float32 is compared under bfloat16: casting those to bfloat16 is what
    the profile-time entry did too.
    """
    import torch

    seen = {tensor.dtype for tensor in model.state_dict(keep_vars=False).values() if tensor.is_floating_point()}
    if seen - {torch.float64, torch.float32, torch.float16, torch.bfloat16}:
        return None
    for dtype in (torch.bfloat16, torch.float16):
        if dtype in seen:
            return str(dtype).removeprefix("torch.")
    return "float32"


def _bitsum(chunk) -> int:
    """Sum of the float32 bit patterns of ``chunk`` (a 1-D tensor), as a Python int."""
    import numpy as np
    import torch

    bits = chunk.to(torch.float32).view(torch.int32)
    if bits.device.type == "cpu":  # numpy's integer reduction is ~10x faster than torch's here
        return int(bits.numpy().sum(dtype=np.int64))
    return int(bits.to(torch.int64).sum().item())


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    added = sorted((str(token), int(index)) for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items())
    special = {key: str(value) for key, value in sorted(tokenizer.special_tokens_map.items())}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return _sha256({"vocab": vocab, "added": added, "special": special, "chat_template": template or ""})


def has_query_norm(model) -> bool:
    """True when the attention modules normalise queries before RoPE (Qwen3-style ``q_norm``).

    The one place this is decided: the first module with a ``q_proj`` in the decoder stack's attention layers
    (:func:`decoder_stack`, :func:`attention_layer_indices`: the first attention layer's, not a vision tower's nor
    a hybrid model's linear attention's) has a ``q_norm``.  ``runtime.math.geometry.ModelGeometry`` refuses models
    whose layers disagree with it.
    """
    stack = decoder_stack(model)
    if stack is None:
        scopes = [model]
    else:
        scopes = [stack.layers[index] for index in attention_layer_indices(model.config) if index < len(stack.layers)]
    for scope in scopes:
        for module in scope.modules():
            if hasattr(module, "q_proj"):
                return hasattr(module, "q_norm")
    return False


def model_identity(model, tokenizer, name: str) -> ModelIdentity:
    """Everything the artifact's ``/model`` group records, computed from a loaded model."""
    numbers = architecture_numbers(model.config)
    query_norm = has_query_norm(model)
    fingerprints = weights_fingerprints(model)
    return ModelIdentity(
        name=str(name),
        query_norm=query_norm,
        arch_fingerprint=architecture_fingerprint(numbers, query_norm),
        weights_fingerprint=fingerprints["float32"],
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        weights_fingerprints=canonical_json(fingerprints),
        **numbers,
    )
