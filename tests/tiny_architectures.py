"""Tiny random-weight models of every architecture the toolkit accepts (issue 27's matrix).

Each is built by transformers from a config (no download), float32, eager attention (the
reference transformers itself uses for soft-capping), 4 layers, 4 query heads over 2 KV heads of
16 dims, a 512-token vocabulary; the sliding-window ones use a window of 64 tokens so that a
prompt of a few hundred tokens crosses it.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 512
WINDOW = 64
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _configs() -> dict:
    t = transformers
    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, {}),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": None}),
        "mistral-sw": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": WINDOW}),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {}),
        # layers from max_window_layers on slide: two full layers, two sliding ones
        "qwen2-sw": (
            t.Qwen2Config,
            t.Qwen2ForCausalLM,
            {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
        ),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, {}),
        # Gemma 2: every other layer slides, attention logits soft-capped at 50
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, {"sliding_window": WINDOW}),
        # Gemma 3: sliding layers with their own RoPE base, one full layer in two here
        "gemma3": (
            t.Gemma3TextConfig,
            t.Gemma3ForCausalLM,
            {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"] * 2},
        ),
        "olmo2": (t.Olmo2Config, t.Olmo2ForCausalLM, {}),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, {"sliding_window": None}),
    }


ARCHITECTURES = tuple(_configs())
SLIDING = ("mistral-sw", "qwen2-sw", "gemma2", "gemma3")


def tiny_config(name: str):
    config_class, _, extra = _configs()[name]
    config = config_class(**_COMMON, **extra)
    config._attn_implementation = "eager"
    return config


def make_tiny(name: str, seed: int = 0):
    """A tiny random ``name`` model (see the module docstring), in eval mode."""
    _, model_class, _ = _configs()[name]
    torch.manual_seed(seed)
    return model_class(tiny_config(name)).eval()
