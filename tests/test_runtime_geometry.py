"""runtime.math.geometry: one checked description of a model's attention, shared by runtime, profiler and artifacts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_llama

from artifacts.fingerprint import architecture_numbers, has_query_norm
from runtime.math.geometry import ModelGeometry, UnsupportedModelError


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
    assert geometry.query_modules == tuple(layer.self_attn.q_proj for layer in model.model.layers)
    assert all(
        p.norm is layer.self_attn.q_norm
        for p, layer in zip(geometry.query_projections, model.model.layers, strict=True)
    )
    seen = []
    handle = model.model.layers[1].self_attn.q_norm.register_forward_hook(lambda _m, _i, out: seen.append(out))
    hook = geometry.query_modules[1].register_forward_hook(
        lambda _m, _i, out: seen.append(geometry.pre_rope_queries(1, out))
    )
    with torch.no_grad():
        model(torch.arange(1, 9).unsqueeze(0))
    handle.remove(), hook.remove()
    assert seen[1].shape == (1, 8, 4, 8) and torch.equal(seen[0], seen[1])  # the model's q_norm output, bit for bit


def test_unsupported_models_are_refused_with_a_message_naming_what_is_missing():
    def refused(change, match):
        model = make_tiny_llama(num_layers=2)
        change(model)
        with pytest.raises(UnsupportedModelError, match=match):
            ModelGeometry.of(model)

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
    model.model.layers[0].self_attn.k_proj = torch.nn.Linear(64, 8)  # not the KV heads' width
    with pytest.raises(UnsupportedModelError, match="layer 0 k_proj gives 8 features"):
        RaggedCache.for_model(model)
    with pytest.raises(UnsupportedModelError, match="layer 0 k_proj gives 8 features"):
        generate(
            model, torch.arange(10).unsqueeze(0), CompressionPolicy(keep_ratio=0.5, scorer="knorm"), max_new_tokens=1
        )


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, Hq, T, d]`` rotated by ``cos, sin [T, d]`` as transformers does."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@pytest.mark.parametrize("name", ["llama", "qwen2-sw", "qwen3", "gemma2", "gemma3", "olmo2", "phi3"])
def test_the_pre_rope_query_under_the_layers_own_rope_is_the_query_attention_receives(name):
    """The geometry's query source (a hook target and, for Phi-3's fused qkv_proj, a slice of its
    output) gives the pre-RoPE query; rotated by runtime.math.rope's cos/sin of *that layer* (Gemma 3's
    sliding layers use another base) it is the query the attention function receives."""
    from tiny_architectures import build

    from runtime.kv_store.attention_interface import attention_implementation
    from runtime.kv_store.eager_attention import attention_forward
    from runtime.math.rope import rope_cos_sin

    model = build(name)
    geometry = ModelGeometry.of(model)
    assert geometry.fused_qkv == (name == "phi3")
    pre, post = {}, {}

    def hook(layer):
        return lambda _m, _i, out: pre.__setitem__(layer, geometry.pre_rope_queries(layer, out))

    def attention(module, query, key, value, attention_mask, **kwargs):
        post[module.layer_idx] = query.detach()  # [B, Hq, T, d]
        return attention_forward(module, query, key, value, attention_mask, **kwargs)

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(geometry.query_modules)]
    ids = torch.randint(1, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), attention_implementation(model, "kvcal_test_queries", attention):
        model(ids)
    for handle in handles:
        handle.remove()
    bases = set()
    for layer in range(geometry.num_layers):
        cos, sin = rope_cos_sin(geometry, torch.arange(40), layer=layer)  # [T, d]
        bases.add(round(float(cos[1, 1]), 6))
        queries = pre[layer].transpose(1, 2)  # [B, Hq, T, d]
        torch.testing.assert_close(_apply_rope(queries, cos, sin), post[layer], rtol=1e-5, atol=1e-5)
    assert len(bases) == (2 if name == "gemma3" else 1)  # Gemma 3: two RoPE bases


def test_rope_of_a_model_with_per_layer_type_rope_needs_the_layer():
    from tiny_architectures import build

    from runtime.math.rope import averaged_rope, rope_cos_sin

    geometry = ModelGeometry.of(build("gemma3"))
    assert geometry.rope_layer_types == ("sliding_attention", "full_attention") * 2
    with pytest.raises(ValueError, match="give the layer"):
        rope_cos_sin(geometry, torch.arange(4))
    local, full = (averaged_rope(geometry, 100, 8, layer=layer) for layer in (0, 1))
    assert not torch.allclose(local[0], full[0])
    llama = ModelGeometry.of(make_tiny_llama(num_layers=2))
    assert llama.rope_layer_types == (None, None)
    assert torch.equal(rope_cos_sin(llama, torch.arange(4))[0], rope_cos_sin(llama, torch.arange(4), layer=1)[0])


def test_fused_qkv_that_does_not_fit_is_refused_and_partial_rotary_is_read():
    from tiny_architectures import build

    model = build("phi3")
    model.model.layers[1].self_attn.qkv_proj = torch.nn.Linear(64, 100, bias=False)
    with pytest.raises(UnsupportedModelError, match=r"layer 1 qkv_proj gives 100 features, expected \(4 \+ 2 x 2\)"):
        ModelGeometry.of(model)
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        partial_rotary_factor=0.5,
    )
    assert ModelGeometry.of(Phi3ForCausalLM(config)).rotary_dims == (8,)  # RoPE turns 8 of 16 (refused before)


def test_sliding_windows_and_soft_capping_per_layer():
    from tiny_architectures import WINDOW, build

    expected = {
        "llama": ((None,) * 4, (None,) * 4),
        "mistral-sw": ((WINDOW,) * 4, (None,) * 4),
        "qwen2-sw": ((None, None, WINDOW, WINDOW), (None,) * 4),
        "gemma2": ((WINDOW, None) * 2, (50.0,) * 4),
        "gemma3": ((WINDOW, None) * 2, (None,) * 4),
    }
    for name, (windows, caps) in expected.items():
        geometry = ModelGeometry.of(build(name))
        assert (geometry.sliding_windows, geometry.softcaps) == (windows, caps), name


def test_scorer_rope_inputs_are_each_layers_own_rope():
    """The providers hand a scorer its layer's RoPE (the leverage scorer raised TypeError on Gemma 3:
    the rotary module takes the layer type), cached per RoPE so Gemma 3's two never mix."""
    from tiny_architectures import build

    from runtime.math.rope import averaged_rope, rope_cos_sin
    from runtime.scorers import AveragedRope, KeyRope, ScorerInputs

    class Needs:  # a scorer as ScorerInputs reads one: its needs
        needs = (KeyRope(), AveragedRope(16))

    geometry = ModelGeometry.of(build("gemma3"))
    inputs = ScorerInputs(Needs(), geometry)
    n, heads, dim = 5, geometry.num_kv_heads, geometry.head_dim
    positions = torch.arange(n).expand(1, heads, n)
    for layer in (0, 1, 2, 0, 3):  # sliding, full, sliding, sliding again (cached), full
        got = inputs.layer(
            layer,
            torch.zeros(1, heads, n, dim),
            torch.zeros(1, heads, n, dim),
            positions,
            torch.ones(1, heads, n, dtype=torch.bool),
            torch.full((1, heads), n),
            [n],
        )
        cos, sin = rope_cos_sin(geometry, torch.arange(n), layer=layer)
        key_rope = got[KeyRope()]  # cos, sin [R, Hkv, n, d]
        assert torch.equal(key_rope.cos[0, 1], cos) and torch.equal(key_rope.sin[0, 1], sin)
        assert not key_rope.interleaved
        mean_cos = got[AveragedRope(16)].cos  # [R, d]
        assert torch.equal(mean_cos[0], averaged_rope(geometry, n, 16, layer=layer)[0])
