"""Captured decode-step attention equals an eager-attention reference (tiny and embedded model)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from profiler.attention_capture import DecodeAttentionRecorder, capture_attention_implementation


def _capture(model, prompt: torch.Tensor, max_new_tokens: int):
    """Greedy generate with the capture active: (generated ids [N], recorder results)."""
    config = model.config
    recorder = DecodeAttentionRecorder(
        config.num_hidden_layers, config.num_attention_heads, prompt.shape[1], max_new_tokens, keep_rows=True
    )
    with torch.no_grad(), capture_attention_implementation(model, recorder):
        out = model.generate(
            prompt, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens, pad_token_id=0
        )
    return out[0, prompt.shape[1] :], recorder.results()


def _eager_rows(model, prompt: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """Reference: eager attention over prompt + generated[:-1]; rows of the queries that
    produced each generated token, restricted to the prompt: [N, L, Hq, C]."""
    context = prompt.shape[1]
    full = torch.cat([prompt[0], generated[:-1]])[None]
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(full, output_attentions=True).attentions  # L x [1, Hq, T, T]
    finally:
        model.set_attn_implementation(previous)
    rows = torch.stack([a[0, :, context - 1 :, :context] for a in attentions])  # [L, Hq, N, C]
    return rows.permute(2, 0, 1, 3)


def _check_against_eager(model, prompt, steps, atol):
    generated, captured = _capture(model, prompt, steps)
    assert captured["max_weight"].shape == (steps, model.config.num_hidden_layers, model.config.num_attention_heads)
    reference = _eager_rows(model, prompt, generated)
    torch.testing.assert_close(captured["rows"], reference.float(), atol=atol, rtol=1e-4)
    ref_max, ref_arg = reference.max(dim=-1)
    torch.testing.assert_close(captured["max_weight"], ref_max.float(), atol=atol, rtol=1e-4)
    # Argmax may only differ where the top two weights tie within tolerance.
    differs = captured["argmax"] != ref_arg
    if differs.any():
        picked = torch.gather(reference, -1, captured["argmax"][..., None])[..., 0]
        assert torch.all((ref_max - picked)[differs] < atol)
    return generated


def test_capture_matches_eager_on_tiny_gqa_model():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=3)
    prompt = torch.randint(1, 128, (1, 37), generator=torch.Generator().manual_seed(0))
    _check_against_eager(model, prompt, steps=6, atol=1e-5)


def _tiny(kind: str):
    import transformers

    classes = {
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }
    config_class, model_class = (getattr(transformers, name) for name in classes[kind])
    config = config_class(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )
    torch.manual_seed(4)
    return model_class(config).eval()


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3"])
def test_capture_matches_eager_on_other_llama_family_models(kind):
    from runtime.math.geometry import ModelGeometry

    model = _tiny(kind)
    assert ModelGeometry.of(model).query_norm == (kind == "qwen3")
    prompt = torch.randint(1, 96, (1, 23), generator=torch.Generator().manual_seed(2))
    _check_against_eager(model, prompt, steps=4, atol=1e-5)


@pytest.mark.parametrize("name", ["mistral-sw", "qwen2-sw", "gemma2", "gemma3"])
def test_capture_matches_eager_with_sliding_windows_and_soft_capping(name):
    """A prompt past the 64-token window: a sliding layer's decode step sees the window's keys only,
    which the record maps back to context positions (0 before the window); Gemma 2 soft-caps (a
    cap the scaled-up logits reach)."""
    from tiny_architectures import WINDOW, build

    model = build(name, seed=1)
    if name == "gemma2":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(40)
                layer.self_attn.attn_logit_softcapping = 2.0
    prompt = torch.randint(1, 512, (1, WINDOW + 36), generator=torch.Generator().manual_seed(5))
    _check_against_eager(model, prompt, steps=5, atol=1e-5)


def test_capture_leaves_generation_unchanged():
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, seed=5)
    prompt = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    generated, _ = _capture(model, prompt, 5)
    assert torch.equal(plain[0, 20:], generated)
    assert model.config._attn_implementation == "sdpa"  # restored after the block


def test_recorder_rejects_too_many_steps():
    model = make_tiny_llama(num_layers=1)
    recorder = DecodeAttentionRecorder(1, 4, 10, max_steps=2)
    with pytest.raises(RuntimeError, match="max_steps"):
        with torch.no_grad(), capture_attention_implementation(model, recorder):
            model.generate(
                torch.ones(1, 10, dtype=torch.long), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0
            )


@pytest.mark.slow
def test_capture_matches_eager_on_embedded_model(embedded_model, embedded_tokenizer, one_thread):
    text = ("The special magic number for Paris is 4821. " * 6) + "What is the special magic number for Paris?"
    prompt = embedded_tokenizer(text, return_tensors="pt").input_ids
    generated = _check_against_eager(embedded_model, prompt, steps=4, atol=2e-4)
    assert generated.shape == (4,)


def test_nested_scopes_record_into_their_own_recorder_only():
    """As in the behaviour stage: one outer scope, a nested scope (and recorder) per probe."""
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=6)
    prompts = [torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 17)]
    recorders = [DecodeAttentionRecorder(2, 4, p.shape[1], max_steps=3) for p in prompts]
    generate = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad(), capture_attention_implementation(model):
        for prompt, recorder in zip(prompts, recorders, strict=True):
            with capture_attention_implementation(model, recorder):
                model.generate(prompt, **generate)
            assert model.config._attn_implementation == "kvcal_decode_capture"
        model.generate(prompts[0], **generate)  # outside a probe scope: plain sdpa, nothing recorded
    assert model.config._attn_implementation == "sdpa"
    assert [r.steps for r in recorders] == [3, 3]
    _, alone = _capture(model, prompts[1], 3)  # the same probe recorded on its own
    torch.testing.assert_close(recorders[1].results()["max_weight"], alone["max_weight"], rtol=0, atol=0)


def test_capture_matches_eager_with_learned_attention_sinks():
    """gpt-oss (sinks between 2 and 7, sliding layers of 32 tokens under a 45-token prompt): every recorded
    weight is the model's own, the sink's logit in its normaliser, and generation is unchanged."""
    from test_attention_sinks import gpt_oss

    model = gpt_oss()
    prompt = torch.randint(3, 256, (1, 45), generator=torch.Generator().manual_seed(6))
    generated = _check_against_eager(model, prompt, steps=5, atol=1e-5)
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(plain[0, 45:], generated)
