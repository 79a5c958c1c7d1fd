"""profile-model on a model that rotates otherwise than kvcal's RoPE (issue 41 item 7).

The stages that calibrate a scorer reading RoPE (leverage and learned un-rotate the cached keys;
Expected Attention and the query prototypes rotate pre-RoPE query statistics) would calibrate it
with the wrong un-rotation on a model whose norm after the rotation centres (a LayerNorm) and
the runtime refuses to serve it there (runtime.plan.rope_check).  So ``profile-model`` refuses them,
exit 2 and one ``error:`` line naming the model's RoPE and the stages, once the model is loaded and
before any stage runs; the stages that read no RoPE run.  Interleaved RoPE (Cohere), layers
without RoPE (SmolLM3, EXAONE 4), partial RoPE (Phi-4-mini) and an RMS norm after RoPE (HunYuan) are
forms runtime.math.rope serves: every stage runs.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import transformers as T
from conftest import single_thread, tiny_profile_args, write_tiny_model_dir

from artifacts import open_artifact
from profiler.cli import main

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def _model_dir(tmp_path, tokenizer, config_class: str, model_class: str, **options):
    if not hasattr(T, config_class):
        pytest.skip(f"transformers {T.__version__} has no {config_class}")
    torch.manual_seed(0)
    config = getattr(T, config_class)(**{**COMMON, "vocab_size": len(tokenizer), **options})
    model = getattr(T, model_class)(config).eval()
    return write_tiny_model_dir(tmp_path / model_class, tokenizer, probes=3, model=model, probe_length=64)


def _profile(model_dir, out, *extra: str) -> int:
    with single_thread():
        return main(tiny_profile_args(model_dir, out, *extra, calib_samples=2))


def _one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and re.match(r"[a-z-]+: error:", errors[0]), lines
    return errors[0]


HUNYUAN = ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM")  # a norm after its rotation
DYNAMIC_NTK = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}  # InternLM3's: factor 6


@pytest.fixture
def centring_norm_dir(tmp_path, embedded_tokenizer, monkeypatch):
    """A HunYuan model directory whose loaded model normalises after RoPE with LayerNorms: they subtract the
    mean, which the rotation does not keep, so no form of runtime.math.rope explains its layers (every
    model type of transformers 5.24 now rotates in one; the swap is made on load, as a checkpoint cannot
    say it)."""
    import common.models

    load = common.models.load_model

    def load_with_centring_norms(*args, **kwargs):
        model = load(*args, **kwargs)
        for layer in model.model.layers:
            layer.self_attn.query_layernorm = torch.nn.LayerNorm(16)
            layer.self_attn.key_layernorm = torch.nn.LayerNorm(16)
        return model

    monkeypatch.setattr(common.models, "load_model", load_with_centring_norms)
    return _model_dir(tmp_path, embedded_tokenizer, *HUNYUAN, head_dim=16)


def test_the_stages_that_read_rope_are_refused_on_a_norm_after_rope_that_centres_before_any_stage(
    centring_norm_dir, tmp_path, capsys
):
    out = tmp_path / "kv_calibration.h5"
    assert _profile(centring_norm_dir, out) == 2  # the smoke preset's stages: query-stats, moments... read RoPE
    line = _one_error_line(capsys)
    assert "a norm after it other than an RMS norm, or one the pre-RoPE read misses in layers 0, 1" in line
    assert "runtime refuses those scorers" in line


def test_the_stages_the_refusal_names_run(centring_norm_dir, tmp_path, capsys):
    """The refusal names the recommendation's candidates that read RoPE (the flagship among them),
    and the stages and options it proposes instead profile the model."""
    model_dir = centring_norm_dir
    out = tmp_path / "kv_calibration.h5"
    one_family = ("--recommend-families", "retrieval", "--recommend-haystacks", "simple")
    stages = ("--stages", "behaviour,query-stats,budgets,moments,recommendation")
    assert _profile(model_dir, out, *stages, *one_family) == 2
    line = _one_error_line(capsys)
    assert "recommendation (" in line and "inf/leverage+correction" in line
    remedy = line.split("Profile what reads no RoPE: ")[1].split()
    assert remedy[:2] == ["--stages", "behaviour,budgets,moments,recommendation"], remedy
    assert _profile(model_dir, out, *remedy, *one_family) == 0, capsys.readouterr().err
    with open_artifact(out) as reader:
        assert set(reader.sections) == {"behaviour", "budgets", "moments", "recommendation"}


@pytest.mark.parametrize(
    "architecture, options",
    [
        (("SmolLM3Config", "SmolLM3ForCausalLM"), {"no_rope_layer_interval": 2, "pad_token_id": 0}),
        (("CohereConfig", "CohereForCausalLM"), {}),
        (("Phi3Config", "Phi3ForCausalLM"), {"partial_rotary_factor": 0.75, "pad_token_id": 0}),
        (HUNYUAN, {"head_dim": 16}),
        (HUNYUAN, {"head_dim": 16, "rope_scaling": "the checkpoints'"}),
        (("LlamaConfig", "LlamaForCausalLM"), {"rope_parameters": DYNAMIC_NTK, "pad_token_id": 0}),
        (("NanoChatConfig", "NanoChatForCausalLM"), {"pad_token_id": 0}),
    ],
    ids=[
        "smollm3 (the second of two layers without RoPE)",
        "cohere (interleaved RoPE)",
        "phi3 (Phi-4-mini's partial RoPE: 12 of 16 dimensions)",
        "hunyuan (a norm after RoPE)",
        "hunyuan with its checkpoints' NTK-alpha RoPE",
        "llama with dynamic NTK RoPE (InternLM3's checkpoints), inside its original context",
        "nanochat (the inverse rotation, norms without a weight after it)",
    ],
)
def test_a_model_in_another_form_of_rope_is_profiled_by_every_stage(
    architecture, options, tmp_path, embedded_tokenizer, capsys
):
    """SmolLM3 leaves every fourth layer without RoPE (``no_rope_layers``; here the second of two),
    Cohere rotates interleaved pairs, Phi-4-mini turns 3/4 of a head's dimensions (refused whole
    before): forms of runtime.math.rope that runtime.plan.rope_check reads off the model, so every
    stage runs, those that calibrate the leverage and learned scorers and Expected Attention included
    (they were refused), and the recommendation measures the flagship.  HunYuan normalises after the
    rotation (its norm's weight applied after it: refused before), also with the RoPE its checkpoints
    write ("dynamic" with an alpha, which transformers fixes: refused before any weight loaded as
    dynamic NTK).  Dynamic NTK itself was refused by name before the weights loaded: it is profiled
    inside its original context (tests/test_dynamic_ntk.py).  NanoChat rotates by the opposite angle and
    normalises without a weight after it (refused by name before)."""
    from test_rope_forms import HUNYUAN_ROPE

    from profiler.stages import STAGE_NAMES

    if options.get("rope_scaling") == "the checkpoints'":
        options = {**options, "rope_scaling": HUNYUAN_ROPE}  # transformers 5.2: dynamic NTK, inside 1024 positions
    model_dir = _model_dir(tmp_path, embedded_tokenizer, *architecture, **options)
    out = tmp_path / "kv_calibration.h5"
    one_family = ("--recommend-families", "retrieval", "--recommend-haystacks", "simple")
    assert _profile(model_dir, out, "--stages", ",".join(STAGE_NAMES), *one_family) == 0, capsys.readouterr().err
    with open_artifact(out) as reader:
        assert len(reader.sections) == len(STAGE_NAMES) == 8  # a section per stage
        candidates = [name.decode() for name in reader.section("recommendation").arrays["candidates"]]
    assert "inf/leverage+correction" in candidates  # the flagship measured held out


def test_probes_past_a_dynamic_ntk_models_original_context_are_refused_before_any_stage(
    tmp_path, embedded_tokenizer, capsys
):
    """Dynamic NTK RoPE re-scales every pass past the original context (``max_position_embeddings``) and
    keeps the scale: the probe stages would calibrate another model than the one served."""
    options = {"rope_parameters": DYNAMIC_NTK, "pad_token_id": 0, "max_position_embeddings": 64}
    model_dir = _model_dir(tmp_path, embedded_tokenizer, "LlamaConfig", "LlamaForCausalLM", **options)
    out = tmp_path / "kv_calibration.h5"
    assert _profile(model_dir, out, "--stages", "behaviour", "--calib-tokens", "32") == 2
    line = _one_error_line(capsys)
    assert "past the model's original context of 64 positions" in line and "dynamic NTK" in line, line
    assert not out.exists()


def test_learned_attention_sinks_are_profiled_by_every_stage(tmp_path, embedded_tokenizer, capsys):
    """Issue 41 item 6 from the command line: gpt-oss was refused as "partial rotary", then by its learned
    attention sinks; both are served now (tests/test_attention_sinks.py, its rotary module giving each
    frequency once).  A smoke profile of every stage completes on a tiny gpt-oss with sinks between 2 and 7,
    the RoPE-reading scorers' calibration included."""
    from test_attention_sinks import gpt_oss

    from artifacts import open_artifact
    from profiler.stages import STAGE_NAMES

    model = gpt_oss(vocab_size=len(embedded_tokenizer))
    model_dir = write_tiny_model_dir(tmp_path / "gpt_oss", embedded_tokenizer, probes=3, model=model, probe_length=64)
    out = tmp_path / "kv_calibration.h5"
    families = ("--recommend-families", "retrieval", "--recommend-haystacks", "simple")
    assert _profile(model_dir, out, "--stages", ",".join(STAGE_NAMES), *families) == 0, capsys.readouterr().err
    with open_artifact(out) as reader:
        assert len(reader.sections) == 8
        assert np.all(np.isfinite(reader.section("query_stats")["cov"]))
        assert reader.config["profiler"]["attn_implementation"] == "eager"  # auto: transformers has no sdpa for it
    sdpa = tmp_path / "sdpa.h5"
    assert _profile(model_dir, sdpa, "--stages", "behaviour", "--attn-implementation", "sdpa") == 2
    assert "gives GptOssForCausalLM no sdpa attention: use the eager" in _one_error_line(capsys)
    assert not sdpa.exists()


@pytest.mark.parametrize(
    "config, feature",
    [
        (T.DeepseekV2Config(**COMMON, vocab_size=128, kv_lora_rank=16), r"multi-head latent attention \(MLA"),
    ],
    ids=["MLA"],
)
@pytest.mark.parametrize("command", ["profile-model", "evaluate-artifact"])
def test_what_the_config_tells_is_refused_before_the_model_loads(command, config, feature, tmp_path, capsys):
    """MLA is read off config.json: a model directory with no weights at all is refused by name (the
    load would fail otherwise, saying something else)."""

    from profiler.evaluate_cli import main as evaluate

    model_dir = tmp_path / "model"
    config.save_pretrained(model_dir)
    if command == "profile-model":
        code = main([str(model_dir), "--out", str(tmp_path / "out.h5"), "--preset", "smoke", "--no-progress"])
    else:
        code = evaluate([str(model_dir), "--artifact", str(tmp_path / "a.h5"), "--no-progress"])
    assert code == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"{command}: error:") and re.search(feature, line), line
