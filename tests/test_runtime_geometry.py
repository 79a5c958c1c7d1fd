"""runtime.geometry: one checked description of a model's attention, shared by runtime, profiler and artifacts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_llama

from artifacts.fingerprint import architecture_numbers, has_query_norm
from runtime.geometry import ModelGeometry, UnsupportedModelError


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return Qwen3ForCausalLM(config).eval()


def test_llama_geometry_matches_the_config_and_the_modules():
    model = make_tiny_llama(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8)
    geometry = ModelGeometry.of(model)
    assert (geometry.num_layers, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim) == (3, 6, 2, 8)
    assert geometry.group_size == 3 and not geometry.query_norm
    layers = model.model.layers
    assert geometry.attention_modules == tuple(layer.self_attn for layer in layers)
    assert geometry.query_modules == tuple(layer.self_attn.q_proj for layer in layers)
    assert geometry.scalings == (8**-0.5,) * 3
    assert geometry.rotary is model.model.rotary_emb and geometry.text_config is model.config
    assert ModelGeometry.of(geometry) is geometry
    # the artifact's architecture numbers are read by the same function
    numbers = architecture_numbers(model.config)
    assert [numbers[key] for key in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim")] == [3, 6, 2, 8]


def test_qwen3_queries_are_taken_after_the_query_norm():
    model = _qwen3()
    geometry = ModelGeometry.of(model)
    assert geometry.query_norm and has_query_norm(model)
    assert geometry.query_modules == tuple(layer.self_attn.q_norm for layer in model.model.layers)


def test_unsupported_models_are_refused_with_a_message_naming_what_is_missing():
    def refused(change, match):
        model = make_tiny_llama(num_layers=2)
        change(model)
        with pytest.raises(UnsupportedModelError, match=match):
            ModelGeometry.of(model)

    refused(lambda m: delattr(m.model, "rotary_emb"), "no rotary embedding at model.model.rotary_emb")
    refused(
        lambda m: setattr(m.model.layers[1].self_attn, "q_proj", torch.nn.Identity()),
        "layer 1 attention has no q_proj linear",
    )
    refused(
        lambda m: setattr(m.model.layers[0].self_attn, "q_proj", torch.nn.Linear(64, 32, bias=False)),
        "layer 0 q_proj gives 32 features, expected 4 heads x 16",
    )
    refused(lambda m: delattr(m.model.layers[0], "self_attn"), "layer 0 has no self_attn module")
    refused(
        lambda m: setattr(m.model.layers[1].self_attn, "layer_idx", 0), "layer 1 attention has no matching layer_idx"
    )
    refused(lambda m: setattr(m.model, "layers", m.model.layers[:1]), "config says 2 layers, model has 1")
    refused(lambda m: setattr(m.config, "num_key_value_heads", 3), "4 query heads are not a multiple of 3 KV heads")
    refused(lambda m: setattr(m, "config", SimpleNamespace(num_hidden_layers=2)), "config lacks num_attention_heads")
    refused(lambda m: setattr(m, "model", torch.nn.Module()), "no decoder layers at model.model.layers")
    refused(
        lambda m: setattr(m.model.layers[1].self_attn, "q_norm", torch.nn.Identity()),
        "only some layers have a query norm",
    )
    with pytest.raises(UnsupportedModelError, match="Linear has no transformers config"):
        ModelGeometry.of(torch.nn.Linear(2, 2))


def test_runtime_entry_points_refuse_unsupported_models():
    from runtime import CompressionPolicy, RaggedCache, generate

    model = make_tiny_llama(num_layers=1)
    del model.model.rotary_emb
    with pytest.raises(UnsupportedModelError, match="rotary_emb"):
        RaggedCache.for_model(model)
    with pytest.raises(UnsupportedModelError, match="rotary_emb"):
        generate(
            model, torch.arange(10).unsqueeze(0), CompressionPolicy(keep_ratio=0.5, scorer="knorm"), max_new_tokens=1
        )
