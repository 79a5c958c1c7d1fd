"""Shared fixtures: the real embedded model (loaded once per session) and tiny random models."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def embedded_model():
    """The real embedded SmolLM2-135M-Instruct, float32, eval mode (converted on first use)."""
    from runtime.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from runtime.models import load_tokenizer

    return load_tokenizer()


def make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128,
                    seed=0, **overrides):
    """A random-weight Llama built in-process: fast, deterministic per seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        **overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()
    return model


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()
