"""Tiny random-weight models of every architecture the toolkit accepts (built in-process, seconds).

The same shapes as the architecture check of issue 27: 64-wide, 4 query / 2 KV heads, a
64-token sliding window where the architecture has one.  ``build(name)`` makes the model in
eval mode with a fixed seed; ``vocab_size`` lets it share a real tokenizer's vocabulary.
"""

from __future__ import annotations

import torch

NAMES = ("llama", "mistral", "mistral-sw", "qwen2", "qwen2-sw", "qwen3", "gemma2", "gemma3", "olmo2", "phi3")
WINDOW = 64  # the sliding window of the -sw, Gemma models


def config(name: str, *, vocab_size: int = 512, num_layers: int = 4):
    """The transformers config of the tiny ``name`` model."""
    import transformers as T

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    half = max(1, num_layers // 2)
    made = {
        "llama": lambda: T.LlamaConfig(**common),
        "mistral": lambda: T.MistralConfig(**common, sliding_window=None),
        "mistral-sw": lambda: T.MistralConfig(**common, sliding_window=WINDOW),
        "qwen2": lambda: T.Qwen2Config(**common),
        "qwen2-sw": lambda: T.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=half
        ),
        "qwen3": lambda: T.Qwen3Config(**common, head_dim=16),
        "gemma2": lambda: T.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW),
        "gemma3": lambda: T.Gemma3TextConfig(**common, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2),
        "olmo2": lambda: T.Olmo2Config(**common),
        "phi3": lambda: T.Phi3Config(**common, pad_token_id=0),
    }
    return made[name]()


def model_class(name: str):
    import transformers as T

    return {
        "llama": T.LlamaForCausalLM,
        "mistral": T.MistralForCausalLM,
        "mistral-sw": T.MistralForCausalLM,
        "qwen2": T.Qwen2ForCausalLM,
        "qwen2-sw": T.Qwen2ForCausalLM,
        "qwen3": T.Qwen3ForCausalLM,
        "gemma2": T.Gemma2ForCausalLM,
        "gemma3": T.Gemma3ForCausalLM,
        "olmo2": T.Olmo2ForCausalLM,
        "phi3": T.Phi3ForCausalLM,
    }[name]


def build(name: str, *, seed: int = 0, attn_implementation: str | None = None, **options):
    """The tiny ``name`` model, random weights from ``seed``, float32, eval mode; its attention
    ``attn_implementation`` (None: transformers' default, sdpa where the model supports it)."""
    made = config(name, **options)
    if attn_implementation is not None:
        made._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return model_class(name)(made).eval()


# issue 27's architecture matrix (tests/test_architectures.py) runs every one of them
ARCHITECTURES = NAMES
SLIDING = ("mistral-sw", "qwen2-sw", "gemma2", "gemma3")  # those with sliding-window layers
VOCAB = 512


def make_tiny(name: str, seed: int = 0):
    """The tiny ``name`` model with its own eager attention (transformers' reference, and the only
    implementation that soft-caps) and special tokens inside the vocabulary (generate() pads with
    them)."""
    model = build(name, seed=seed, attn_implementation="eager")
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    return model
