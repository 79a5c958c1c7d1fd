"""Models whose RoPE or attention is not the Llama kind (issue 41 items 4-6): served exactly where the
runtime computes what the model computes, refused by name elsewhere.

* Llama 4 text without chunked attention (``attention_chunk_size=None``): its rotary module returns
  complex frequencies (one tensor, not ``cos, sin``), its layers rotate interleaved pairs, every
  fourth layer has no RoPE and scales its queries by position (attention temperature tuning,
  arXiv 2501.19399), the others normalise after the rotation.  Nothing evicted, it is served exactly;
  so are the scorers that read RoPE (the norm and the factor read by the geometry).  With
  ``attention_chunk_size`` set its RoPE layers attend within chunks: tests/test_chunked_attention.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

from runtime import CompressionPolicy, RaggedCache, bind, compress_prompt, generate
from runtime.math.geometry import ModelGeometry, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

TOLERANCE = 1e-4
PROMPT, STEPS = 300, 20
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _model(config_class: str, model_class: str, **options):
    if not hasattr(T, config_class):
        pytest.skip(f"transformers {T.__version__} has no {config_class}")
    torch.manual_seed(0)
    model = getattr(T, model_class)(getattr(T, config_class)(**COMMON, **options)).eval()
    model.generation_config.pad_token_id = 0
    return model


def _llama4(**options):
    # floor_scale 32 (Llama 4 Scout: 8192): the no-RoPE layers' query temperature changes every 32
    # positions, inside the prompt
    return _model("Llama4TextConfig", "Llama4ForCausalLM", head_dim=16, num_local_experts=4, floor_scale=32, **options)


def _llama4_without_chunks():
    """Llama 4 with ``attention_chunk_size=None``: full attention in every layer, where transformers
    says so; transformers 5.2 (the lowest supported) still types its layers ``chunked_attention``,
    which kvcal refuses by that name (tested here), so the tests of its serving are skipped there."""
    model = _llama4(attention_chunk_size=None)
    if "chunked_attention" in model.config.layer_types:
        with pytest.raises(UnsupportedModelError, match=r"layer type\(s\) chunked_attention are not supported"):
            RaggedCache.for_model(model)
        pytest.skip(f"transformers {T.__version__} types Llama 4's layers chunked_attention without a chunk size")
    return model


def _prompt(rows: int = 2, padding: int = 40):
    """``rows`` prompts of :data:`PROMPT` columns, the last left-padded by ``padding``."""
    ids = torch.randint(3, COMMON["vocab_size"], (rows, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[-1, :padding], mask[-1, :padding] = 0, 0
    return ids, mask


def assert_served_exactly(model):
    """Nothing evicted, runtime.generate (a left-padded batch, greedy) gives the unmodified model's
    own generate(): the same tokens and every step's logits within :data:`TOLERANCE`."""
    ids, mask = _prompt()
    options = dict(max_new_tokens=STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, **options)
        got = generate(model, ids, None, attention_mask=mask, **options)
    difference = max((a - b).abs().max().item() for a, b in zip(got.output.logits, expected.logits, strict=True))
    assert difference < TOLERANCE, difference
    assert torch.equal(got.sequences, expected.sequences)
    return difference


def test_llama4_without_chunked_attention_is_served_exactly():
    """Issue 41 item 4: every entry point raised ``not enough values to unpack`` from the geometry
    (the rotary module returns one complex tensor)."""
    model = _llama4_without_chunks()
    assert set(model.config.layer_types) == {"full_attention"}
    assert_served_exactly(model)


@torch.no_grad()
def test_llama4_serves_the_scorers_that_read_rope():
    """Llama 4's RoPE layers normalise keys and queries after the rotation (an L2 norm without a weight): the
    leverage scorer's un-rotated keys are each layer's keys before RoPE divided by their root mean square.
    Its layers without RoPE scale their queries by position (attention temperature tuning; 1 below
    ``floor_scale``, 32 here): Expected Attention's rotation carries that factor (positions 33 and 70).
    Both were refused before ("a norm after it")."""
    from test_rope_check import (
        _assert_query_rotation_is_the_models,
        _layer_inputs,
        _normalised_projections,
        _normalised_queries,
        _pre_and_post_rope,
        _provider,
    )

    from runtime.scorers import KeyRope

    model = _llama4_without_chunks()
    assert [scale is not None for scale in ModelGeometry.of(model).query_scales] == [False, False, False, True]
    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)  # the leverage scorer
    ids, mask = _prompt()
    normalised = _normalised_projections(model, ids[:1, :40])
    _, post = _pre_and_post_rope(model, ids[:1, :40])
    key_rope = _provider(plan, KeyRope)
    for layer in range(4):
        keys = post[layer][0].transpose(1, 2)
        unrotated = key_rope(_layer_inputs(layer, keys, 40)).undo(keys)
        torch.testing.assert_close(unrotated, normalised[layer][0].transpose(1, 2), rtol=1e-4, atol=1e-5)
    cache, report = compress_prompt(model, ids, plan, attention_mask=mask, context_columns=280)
    assert report.kv_bytes_after < report.kv_bytes_before

    _assert_query_rotation_is_the_models(model, _normalised_queries, (0, 7, 30, 31, 33, 70))


def _llama4_with_chunks(chunk: int):
    """Llama 4 with chunks of ``chunk`` positions in its RoPE layers (8192 in its checkpoints)."""
    model = _llama4(attention_chunk_size=chunk)
    assert "chunked_attention" in model.config.layer_types
    return model


def test_llama4_is_served_exactly_inside_its_first_attention_chunk():
    """Llama 4's RoPE layers attend within chunks of ``attention_chunk_size`` positions; inside the first chunk
    they attend to every earlier token: nothing evicted is transformers' own on a left-padded batch whose 300
    columns and 20 new tokens fit in a chunk of 320, and the flagship's leverage scorer evicts.  Past the first
    chunk: tests/test_chunked_attention.py."""
    model = _llama4_with_chunks(PROMPT + STEPS)
    assert_served_exactly(model)
    ids, mask = _prompt()
    with torch.no_grad():
        result = generate(model, ids, CompressionPolicy(keep_ratio=0.25), attention_mask=mask, max_new_tokens=STEPS)
    assert result.report.kv_bytes_after < result.report.kv_bytes_before


def test_the_attention_chunk_is_in_the_architecture_fingerprint():
    from artifacts.fingerprint import architecture_fingerprint, architecture_numbers

    configs = [_llama4_with_chunks(256).config, _llama4_with_chunks(512).config]
    chunkless = _llama4(attention_chunk_size=None).config
    if "chunked_attention" not in chunkless.layer_types:  # transformers 5.2 types it so (refused: above)
        configs.append(chunkless)
    fingerprints = {architecture_fingerprint(architecture_numbers(config), False) for config in configs}
    assert len(fingerprints) == len(configs)


# name: (config class, model class, its options, what the refusal must name)
REFUSED = {
    "deepseek v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
        r"multi-head latent attention \(MLA",
    ),
    "deepseek v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1),
        r"multi-head latent attention \(MLA",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_attention_kvcal_cannot_compute_is_refused_by_its_name(name):
    """Issue 41 item 6: DeepSeek's MLA was refused as "layer 0 q_proj gives 64 features, expected 4
    heads x 8" (V3: "no q_proj linear").  (gpt-oss, refused as "partial rotary" then by its learned sinks,
    is served: tests/test_attention_sinks.py.)"""
    config_class, model_class, options, feature = REFUSED[name]
    model = _model(config_class, model_class, **options)
    ids = _prompt(rows=1)[0][:, :40]
    for attempt in (
        lambda: ModelGeometry.of(model),
        lambda: generate(model, ids, None, max_new_tokens=2),
        lambda: bind(CompressionPolicy(keep_ratio=0.5, scorer="keydiff"), None, model),
    ):
        with pytest.raises(UnsupportedModelError, match=feature) as refused:
            attempt()
        assert "partial rotary" not in str(refused.value) and "features, expected" not in str(refused.value)


# HunYuan's checkpoints (Hunyuan-7B, Hunyuan-A13B) as their config.json writes RoPE: "dynamic" with an alpha
HUNYUAN_ROPE = {
    "alpha": 1000.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "type": "dynamic",
}


def _static_ntk_alpha(model_type: str) -> bool:
    """Whether this transformers' rotary module for ``model_type`` turns "dynamic" with an ``alpha`` into a
    fixed base (``compute_ntk_alpha_rope_parameters``; transformers 5.2 has none and re-scales by length)."""
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return any(hasattr(value, "compute_ntk_alpha_rope_parameters") for value in vars(modeling).values())


@pytest.mark.parametrize(
    "config_class, model_class, options",
    [
        ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {}),
        ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"num_experts": 2, "moe_topk": 1}),
    ],
    ids=["hunyuan dense", "hunyuan moe"],
)
def test_hunyuan_checkpoints_ntk_alpha_rope_is_served_where_transformers_fixes_it(config_class, model_class, options):
    """Every HunYuan checkpoint writes ``rope_scaling: {"type": "dynamic", "alpha": 1000, ...}``, which
    transformers' HunYuan rotary module turns into NTK-alpha: one base, ``theta * alpha ** (d / (d - 2))``,
    whatever the length (``rope_type`` "ntk_alpha").  kvcal refused it as dynamic NTK, by the config's
    string, before any weight loaded, so no HunYuan checkpoint was served at all.  Served exactly with
    nothing evicted (a left-padded batch), compressed by keydiff and by leverage (its norm after the
    rotation read).  Where the rotary module has no NTK-alpha (transformers 5.2: it re-scales by the
    longest position, as dynamic NTK) it is served as dynamic NTK, inside its original context
    (tests/test_dynamic_ntk.py)."""
    from runtime.math.geometry import check_config, original_context

    model = _model(config_class, model_class, head_dim=16, rope_scaling=HUNYUAN_ROPE, **options)
    static = _static_ntk_alpha(model.config.model_type)
    assert (model.model.rotary_emb.rope_type == "ntk_alpha") == static
    assert original_context(model.config) == (None if static else COMMON["max_position_embeddings"])
    check_config(model.config)  # profile-model and evaluate-artifact's check before the weights load
    ModelGeometry.of(model)
    assert_served_exactly(model)
    ids, mask = _prompt()
    _, report = compress_prompt(
        model, ids, CompressionPolicy(keep_ratio=0.25, scorer="keydiff"), attention_mask=mask, context_columns=280
    )
    assert report.kv_bytes_after < report.kv_bytes_before
    _, report = compress_prompt(
        model, ids, CompressionPolicy(keep_ratio=0.25), attention_mask=mask, context_columns=280
    )
    assert report.kv_bytes_after < report.kv_bytes_before  # leverage: its norm after RoPE read (test_rope_check.py)


# YaRN as Olmo 3's checkpoints write it (original 8192 positions, factor 8; here 256 and 4): transformers
# multiplies cos and sin by its attention factor, 1 + 0.1 ln(factor) = 1.139 here
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}


@torch.no_grad()
def test_yarn_rope_with_its_attention_factor_is_served_exactly():
    """YaRN (Olmo 3, Ministral 3 and Qwen3's long-context configs) scales the rotary module's cos and sin
    by an attention factor: the keys the attention receives are that factor times a rotation of the
    pre-RoPE keys.  Nothing evicted is transformers' own; the leverage scorer's keys are the pre-RoPE keys,
    Expected Attention's rotation the model's queries (positions 0, 7, 33)."""
    model = _model("LlamaConfig", "LlamaForCausalLM", rope_parameters=YARN)
    assert model.model.rotary_emb.attention_scaling > 1.1
    assert_served_exactly(model)
    _assert_reads_are_the_models(model, _prompt(rows=1)[0][:, :120])


def _assert_reads_are_the_models(model, ids) -> None:
    """The leverage scorer's keys are every layer's pre-RoPE keys as the geometry reads them, the compression
    serves, and Expected Attention's rotation is the model's queries (positions 0, 7, 33)."""
    from test_rope_check import _assert_query_rotation_is_the_models, _assert_scored_keys_and_served, _pre_and_post_rope

    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)
    pre, _ = _pre_and_post_rope(model, ids)
    _assert_scored_keys_and_served(model, plan, ids, {layer: keys for layer, (keys, _) in pre.items()})
    _assert_query_rotation_is_the_models(model, None, (0, 7, 33))


@torch.no_grad()
def test_nanochat_is_served_exactly_by_every_scorer():
    """NanoChat rotates with ``rotate_half(x) = cat(x2, -x1)``: the inverse rotation, ``R(-p)``
    (runtime.math.rope's ``REVERSED`` form), and then divides each head by its root mean square, without a
    weight: a norm that commutes with any rotation, read before RoPE.  Refused by name before ("a query or
    key norm without a weight")."""
    from runtime.math.rope import REVERSED, RopeForms

    model = _model("NanoChatConfig", "NanoChatForCausalLM", head_dim=16)
    assert_served_exactly(model)
    assert bind(CompressionPolicy(keep_ratio=0.25), None, model).rope_forms == RopeForms(
        (REVERSED,) * 4, (REVERSED,) * 4
    )
    _assert_reads_are_the_models(model, _prompt(rows=1)[0][:, :120])


@torch.no_grad()
def test_the_embedded_attention_weights_in_nanochats_architecture_are_read_exactly(embedded_model, embedded_tokenizer):
    """The real embedded weights' attention (its 30 layers' q, k, v, o projections) in NanoChat's
    architecture (its MLP of other names random, its norms without weights)."""
    if not hasattr(T, "NanoChatConfig"):
        pytest.skip(f"transformers {T.__version__} has no NanoChatConfig")
    config = embedded_model.config
    torch.manual_seed(0)
    model = T.NanoChatForCausalLM(
        T.NanoChatConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        )
    ).eval()
    own = embedded_model.state_dict()
    attention = {name: value for name, value in own.items() if ".self_attn." in name}
    missing, _ = model.load_state_dict(attention, strict=False)
    assert not [name for name in missing if ".self_attn." in name]
    ids = embedded_tokenizer("The passcode is 4817. " * 6 + "What is the passcode?", return_tensors="pt").input_ids
    _assert_reads_are_the_models(model, ids)


def test_a_rotation_other_than_runtime_ropes_is_named():
    """runtime.plan.rope_check says what a layer does instead, for the refusals (issue 41 item 7: the
    profiler's names the model's RoPE)."""
    from test_rope_check import OTHER_ROPE, build_other

    from runtime.plan.rope_check import OTHER, rope_mismatches

    expected = {
        "cohere (interleaved RoPE)": "interleaved RoPE in layers 0, 1, 2, 3",
        "ernie 4.5 (interleaved RoPE)": "interleaved RoPE in layers 0, 1, 2, 3",
        "exaone 4 (full-attention layers without RoPE)": "no RoPE in layers 1, 3",
        "smollm3 (every fourth layer without RoPE)": "no RoPE in layer 3",
        "hunyuan (a norm after RoPE)": "",  # an RMS norm: its weight applied after the rotation
        "hunyuan with LayerNorms after RoPE (a norm that centres)": f"{OTHER} in layers 0, 1, 2, 3",
        "stablelm qk_layernorm (a LayerNorm per head)": "",
        "cohere use_qk_norm (norm weights per head)": "interleaved RoPE in layers 0, 1, 2, 3",
        "phi3 (RoPE on 12 of 16 dimensions)": "",  # partial RoPE is the geometry's, not another form
        "stablelm (RoPE on 4 of 16 dimensions)": "",
        "glm4 (interleaved RoPE on 8 of 16 dimensions)": "interleaved RoPE in layers 0, 1, 2, 3",
    }
    assert set(expected) == set(OTHER_ROPE)
    for name, described in expected.items():
        assert rope_mismatches(build_other(name)).describe() == described, name
    if "chunked_attention" not in _llama4(attention_chunk_size=None).config.layer_types:  # see _llama4_without_chunks
        llama4 = rope_mismatches(_llama4(attention_chunk_size=None))  # an L2 norm after its rotation
        assert llama4.describe() == "interleaved RoPE in layers 0, 1, 2; no RoPE in layer 3"
    with pytest.raises(UnsupportedModelError, match=r"are not \(another rotation, a norm after it .* in layers 0, 1"):
        bind(
            CompressionPolicy(keep_ratio=0.25),
            None,
            build_other("hunyuan with LayerNorms after RoPE (a norm that centres)"),
        )


@pytest.mark.parametrize("chunk", [256, 60])
def test_llama4_is_profiled_inside_its_first_attention_chunk(chunk, tmp_path, embedded_tokenizer, capsys):
    """A smoke profile of Llama 4 whose probes (up to 56 tokens, 61 with their new ones) and calibration windows
    (56 tokens) fit in its attention chunk runs every default stage; with a chunk the probes do not fit in,
    it is refused before any stage runs, naming the chunk."""
    from conftest import single_thread, tiny_profile_args, write_tiny_model_dir

    from profiler.cli import main

    torch.manual_seed(0)
    config = T.Llama4TextConfig(
        **{**COMMON, "vocab_size": len(embedded_tokenizer)},
        head_dim=16,
        num_local_experts=4,
        floor_scale=32,
        attention_chunk_size=chunk,
    )
    model = T.Llama4ForCausalLM(config).eval()
    model_dir = write_tiny_model_dir(tmp_path / "llama4", embedded_tokenizer, probes=3, model=model, probe_length=48)
    out = tmp_path / "kv_calibration.h5"
    with single_thread():
        code = main(tiny_profile_args(model_dir, out, "--calib-tokens", "56", calib_samples=4))
    error = capsys.readouterr().err
    if chunk == 256:
        assert code == 0, error
        assert out.exists()
    else:
        assert code == 2 and not out.exists(), error
        assert "past the model's attention chunk of 60 positions" in error and "longest probe" in error, error
