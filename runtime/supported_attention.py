"""Which attention the ragged cache computes exactly, and what it refuses by name (docs/design.md
section 10): full and sliding-window attention, with or without logit soft-capping.  Read when a
cache is made (:meth:`runtime.cache.RaggedCache.for_model`) and by the attention function
(:mod:`runtime.attention`) for what a model passes it."""

from __future__ import annotations

# What a model passes its attention function that the ragged attention cannot compute: learned
# attention sinks (gpt-oss's ``s_aux``, ``sinks``) and additive position biases (T5-style).
UNSUPPORTED_ARGUMENTS = {
    "s_aux": "learned attention sinks (s_aux)",
    "sinks": "learned attention sinks",
    "position_bias": "an additive position bias",
}
# Layer types (``config.layer_types``) the ragged attention computes exactly.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported_attention(config) -> str | None:
    """Why the ragged attention cannot serve a model of ``config`` exactly (None: it can): layer
    types other than full and sliding-window attention (linear, chunked, compressed attention...)
    and Llama 4's chunked attention, named in the message."""
    config = getattr(config, "text_config", None) or config
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted({str(kind) for kind in layer_types} - set(SUPPORTED_LAYER_TYPES))
    if other:
        return (
            f"its layers use {', '.join(other)}; the ragged attention computes only "
            f"{' and '.join(SUPPORTED_LAYER_TYPES)}"
        )
    if getattr(config, "attention_chunk_size", None):
        return "it uses chunked attention (attention_chunk_size), which the ragged attention does not compute"
    return None
