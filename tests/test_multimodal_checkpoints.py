"""The language model of a multimodal checkpoint, served on text as kvcal serves that language model alone.

Many checkpoints users deploy are multimodal: Gemma 3 from 4B up, Mistral Small 3.1 / 3.2, the LLaVA family,
SmolVLM, Aya Vision, InternVL.  transformers loads them whole (``Gemma3ForConditionalGeneration``: a vision
tower, a projector and the language model at ``model.model.language_model``).  kvcal serves their text: on
each type of :data:`SERVED` (tiny random weights, 4 layers, a tiny vision tower never run), the wrapper's
logits are its language model's alone (checked first), nothing evicted is exact on a left-padded batch, and
with tokens evicted the compressed cache (every head's kept positions, keys and values) and the greedy tokens
are those of the language model alone, built as a causal LM with the same weights.  Image inputs are
refused by name (the compressed prompt holds text only); so are the multimodal types whose text path kvcal
has not checked (PaliGemma numbers positions from 1 and attends both ways over its prompt) and multimodal
RoPE (Qwen2-VL's position sections).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from packaging.version import Version
from test_architecture_matrix import EXACT, TOLERANCE, built, nothing_evicted_difference

from artifacts.fingerprint import decoder_stack, weights_fingerprints
from runtime import CompressionPolicy, compress_prompt, generate
from runtime.math.geometry import MULTIMODAL_SERVED, ModelGeometry, UnsupportedModelError
from runtime.plan.rope_check import rope_mismatches

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

VOCABULARY = 256
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCABULARY,
    max_position_embeddings=512,
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
IMAGE = dict(image_token_index=255)
PINPOINTS = dict(image_grid_pinpoints=[[28, 28]])
# a Qwen2.5-VL-style vision tower (Qwen2.5-VL, Qwen3-VL, GLM-4V), tiny
MROPE_VISION = dict(depth=1, hidden_size=32, out_hidden_size=64, num_heads=2, intermediate_size=64)


def _mrope_config(*, vision_config=MROPE_VISION, **rope) -> dict:
    """The arguments of a tiny multimodal config with multimodal RoPE (Qwen2-VL's three position sections)."""
    rope_parameters = dict(rope_type="default", mrope_section=[2, 3, 3], **rope)
    return dict(
        text_config=dict(**TEXT, rope_parameters=rope_parameters),
        vision_config=vision_config,
        image_token_id=255,
        video_token_id=254,
    )


# Qwen3.5's language model, hybrid: Gated DeltaNet layers 0 and 2, gated attention layers 1 and 3 with partial
# RoPE (4 of 16 dims), its multimodal RoPE's sections interleaved over those
QWEN3_5_TEXT = dict(
    **TEXT,
    layer_types=["linear_attention", "full_attention"] * 2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[1, 1, 0],
        mrope_interleaved=True,
    ),
)
QWEN3_5_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _clip_llama(**extra) -> dict:
    """The arguments of a tiny LLaVA-family config: a Llama beside a CLIP tower, and ``extra``."""
    return dict(
        text_config=dict(model_type="llama", **TEXT),
        vision_config=dict(model_type="clip_vision_model", **VISION),
        **IMAGE,
        **extra,
    )


# Gemma 4's language model: sliding layers 0 and 2 of 2 KV heads x 16, full-attention layers 1 and 3 of head dim 32
GEMMA4_TEXT = dict(
    **TEXT, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=32
)
GEMMA4_VISION = dict(VISION, num_key_value_heads=2, head_dim=16, image_size=None)


def _gemma4(text: dict) -> dict:
    """The arguments of a tiny Gemma 4 (or Gemma 4 unified) config: ``text`` beside a tiny vision tower, no audio."""
    tokens = dict(image_token_id=255, boi_token_id=253, eoi_token_id=254, video_token_id=252)
    return dict(text_config=text, vision_config=GEMMA4_VISION, audio_config=None, **tokens)


# model type: (its config's arguments, the model type of its language model, as in EXACT)
SERVED = {
    "gemma3": (
        dict(
            text_config=dict(**TEXT, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2),
            vision_config=VISION,
            mm_tokens_per_image=4,
            image_token_index=255,
            boi_token_index=253,
            eoi_token_index=254,
        ),
        "gemma3_text",
    ),
    # full-attention layers of another geometry than the sliding ones (tests/test_gemma4.py)
    "gemma4": (_gemma4(dict(GEMMA4_TEXT, attention_k_eq_v=True, num_global_key_value_heads=1)), "gemma4_text"),
    "gemma4_unified": (_gemma4(GEMMA4_TEXT), "gemma4_unified_text"),
    "mistral3": (
        dict(
            text_config=dict(model_type="mistral", **TEXT, sliding_window=32),
            vision_config=dict(model_type="pixtral", **VISION, head_dim=16),
            **IMAGE,
        ),
        "mistral",
    ),
    "llava": (_clip_llama(), "llama"),
    "llava_next": (
        dict(
            text_config=dict(model_type="mistral", **TEXT),
            vision_config=dict(model_type="clip_vision_model", **VISION),
            **IMAGE,
            **PINPOINTS,
        ),
        "mistral",
    ),
    "llava_onevision": (
        dict(
            text_config=dict(model_type="qwen2", **TEXT),
            vision_config=dict(model_type="siglip_vision_model", **VISION),
            video_token_index=254,
            **IMAGE,
            **PINPOINTS,
        ),
        "qwen2",
    ),
    "idefics3": (dict(text_config=dict(model_type="llama", **TEXT), vision_config=VISION, image_token_id=255), "llama"),
    "smolvlm": (dict(text_config=dict(model_type="llama", **TEXT), vision_config=VISION, image_token_id=255), "llama"),
    "aya_vision": (
        dict(
            # Aya Vision's head does not scale the logits by the text config's logit_scale, Cohere 2's own does:
            # at 1 the language model alone is the wrapper's text path
            text_config=dict(model_type="cohere2", **TEXT, sliding_window=32, logit_scale=1.0),
            vision_config=dict(model_type="siglip_vision_model", **VISION),
            **IMAGE,
        ),
        "cohere2",
    ),
    "qwen2_vl": (
        _mrope_config(vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)),
        "qwen2",
    ),
    "qwen2_5_vl": (_mrope_config(), "qwen2"),
    "qwen3_vl": (
        _mrope_config(
            mrope_interleaved=True,
            vision_config=dict(MROPE_VISION, deepstack_visual_indexes=[0]),
        ),
        "qwen3",
    ),
    "qwen3_5": (
        dict(text_config=QWEN3_5_TEXT, vision_config=MROPE_VISION, image_token_id=255, video_token_id=254),
        "qwen3_5_text",
    ),
    "qwen3_5_moe": (
        dict(
            text_config=dict(QWEN3_5_TEXT, **QWEN3_5_MOE),
            vision_config=MROPE_VISION,
            image_token_id=255,
            video_token_id=254,
        ),
        "qwen3_5_moe_text",
    ),
    "lfm2_vl": (
        dict(
            text_config=dict(model_type="lfm2", **TEXT, full_attn_idxs=[1, 3]),  # hybrid: convolution layers 0, 2
            vision_config=dict(model_type="siglip2_vision_model", **VISION),
            image_token_id=255,
        ),
        "lfm2",
    ),
    "cohere2_vision": (
        dict(
            text_config=dict(model_type="cohere2", **TEXT, sliding_window=32, logit_scale=1.0),  # as Aya Vision's
            vision_config=dict(model_type="siglip_vision_model", **VISION),
            image_token_id=255,
        ),
        "cohere2",
    ),
    "llava_next_video": (_clip_llama(video_token_index=254, **PINPOINTS), "llama"),
    "video_llava": (_clip_llama(video_token_index=254), "llama"),
    "vipllava": (_clip_llama(), "llama"),
    "ovis2": (dict(text_config=dict(model_type="qwen2", **TEXT), image_token_id=255), "qwen2"),
    "lighton_ocr": (dict(text_config=dict(model_type="qwen3", **TEXT), image_token_id=255), "qwen3"),
    "exaone4_5": (  # its generate() numbers positions by column (test_exaone_4_5_is_served_as_its_text_model)
        dict(
            text_config=dict(model_type="exaone4", **TEXT, sliding_window=32),
            vision_config=dict(MROPE_VISION, num_key_value_heads=2),
            image_token_id=255,
            video_token_id=254,
        ),
        "exaone4",
    ),
    "internvl": (
        dict(
            text_config=dict(model_type="qwen2", **TEXT),
            vision_config={**VISION, "image_size": [28, 28], "patch_size": [14, 14]},
            image_token_id=255,
        ),
        "qwen2",
    ),
}
REFUSED = {
    "glm4v": (
        _mrope_config(),
        r"multimodal RoPE \(mrope_section=\[2, 3, 3\].* not supported on a model kvcal has not checked",
    ),
    "paligemma": (
        dict(
            text_config=dict(model_type="gemma", **TEXT),
            vision_config=dict(model_type="siglip_vision_model", **VISION),
            **IMAGE,
        ),
        r"the language model of a multimodal checkpoint \(paligemma\) kvcal has not checked: .*gemma3, .*mistral3",
    ),
}


_SPECIAL_TOKENS = frozenset(
    ("image_token_index", "image_token_id", "boi_token_index", "eoi_token_index", "video_token_index", "video_token_id")
)


# transformers 5.2's Qwen2-VL / Qwen2.5-VL / Qwen3-VL rotary modules take only [3, B, T] positions: refused there
# by that name (5.24's take one position per token, as every other kvcal serves); its Qwen3.5 and LFM2 keep their
# recurrent states in cache classes of their own (hybrid models: tests/test_architecture_matrix.py)
OLDER_TRANSFORMERS = Version(T.__version__) < Version("5.3")
QWEN_VL = ("qwen2_vl", "qwen2_5_vl")
REFUSED_ON_OLDER = {
    **dict.fromkeys(QWEN_VL, r"its rotary embedding does not take one position per token"),
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe", "lfm2_vl"), r"a hybrid model \(linear attention"),
}


def refused_on_older(model_type: str) -> bool:
    """Whether ``model_type`` is refused under transformers 5.2 (:data:`REFUSED_ON_OLDER`), after checking that
    it is refused there by that name."""
    if not (OLDER_TRANSFORMERS and model_type in REFUSED_ON_OLDER):
        return False
    with pytest.raises(UnsupportedModelError, match=REFUSED_ON_OLDER[model_type]):
        ModelGeometry.of(multimodal_model(model_type))
    return True


def _class(model_type: str):
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    if name is None or not hasattr(T, name):
        pytest.skip(f"transformers {T.__version__} has no {model_type}")
    return getattr(T, name)


def multimodal_model(model_type: str, *, meta: bool = False, vocab_size: int = VOCABULARY):
    """The tiny multimodal ``model_type`` (:data:`SERVED` or :data:`REFUSED`), seed 0, float32, eval mode."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_class = _class(model_type)
    arguments = (SERVED.get(model_type) or REFUSED[model_type])[0]
    arguments = {**arguments, "text_config": {**arguments["text_config"], "vocab_size": vocab_size}}
    for name in _SPECIAL_TOKENS.intersection(arguments):  # the image tokens at the vocabulary's end, wherever it is
        arguments[name] += vocab_size - VOCABULARY
    return built(model_class, CONFIG_MAPPING[model_type](**arguments), meta=meta)


def language_model_alone(wrapper):
    """The wrapper's language model as a causal LM of its own (its text config, its decoder stack's and LM
    head's weights); Qwen2-VL / Qwen2.5-VL / Qwen3-VL's, which transformers has no causal LM of, as the Qwen2 /
    Qwen3 they are on text (their multimodal RoPE turns a text token's three sections by one position)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = wrapper.config.get_text_config()
    model_type = wrapper.config.model_type
    if model_type.startswith("qwen") and model_type.endswith("_vl"):
        own = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures", "rope_parameters")}
        theta = text.rope_parameters["rope_theta"]
        text = CONFIG_MAPPING[SERVED[model_type][1]](**own, rope_parameters=dict(rope_type="default", rope_theta=theta))
    alone = T.AutoModelForCausalLM.from_config(text).eval()
    alone.model.load_state_dict(decoder_stack(wrapper).state_dict())
    alone.lm_head.load_state_dict(wrapper.lm_head.state_dict())
    alone.generation_config.pad_token_id = 0
    return alone


def test_the_served_types_are_the_checked_ones():
    assert set(SERVED) == set(MULTIMODAL_SERVED)
    assert all(text in EXACT for _, text in SERVED.values())


@pytest.mark.parametrize("model_type", sorted(SERVED))
@torch.no_grad()
def test_the_language_model_of_a_multimodal_checkpoint_is_served_as_it_alone(model_type):
    if refused_on_older(model_type):
        return
    if OLDER_TRANSFORMERS and model_type == "qwen3_vl":
        pytest.skip("transformers 5.2's own Qwen3-VL forward fails on this tiny config's text (mat1 and mat2 shapes)")
    wrapper = multimodal_model(model_type)
    alone = language_model_alone(wrapper)
    ids = torch.randint(3, 250, (1, 80), generator=torch.Generator().manual_seed(3))
    assert (wrapper(ids).logits - alone(ids).logits).abs().max() < 1e-5  # the reference is the wrapper's text path

    assert nothing_evicted_difference(wrapper) < TOLERANCE
    assert rope_mismatches(wrapper).describe() == rope_mismatches(alone).describe() == EXACT[SERVED[model_type][1]]
    geometry = ModelGeometry.of(wrapper)
    layers = decoder_stack(wrapper).layers
    assert geometry.attention_modules == tuple(layers[index].self_attn for index in geometry.layer_indices)

    # an artifact of the language model alone is the checkpoint's: the same weights fingerprint, every dtype
    assert weights_fingerprints(wrapper) == weights_fingerprints(alone)

    policy = CompressionPolicy(keep_ratio=0.25)  # leverage: un-rotates the keys with the model's RoPE
    (cache, report), (own_cache, _) = (
        compress_prompt(model, ids, policy, context_columns=70) for model in (wrapper, alone)
    )
    assert report.lengths_after.sum() < report.lengths_before.sum() / 2  # tokens were evicted
    for served, own in zip(cache.attention_layers, own_cache.attention_layers, strict=True):
        for head in range(served.store.num_heads):
            keys, values, positions = served.head(0, head)
            assert torch.equal(positions, own.head(0, head)[2])
            assert torch.allclose(keys, own.head(0, head)[0], atol=1e-5)
            assert torch.allclose(values, own.head(0, head)[1], atol=1e-5)
    results = [generate(model, ids, policy, context_columns=70, max_new_tokens=6) for model in (wrapper, alone)]
    assert torch.equal(results[0].sequences, results[1].sequences)
    assert np.array_equal(results[0].report.lengths_after, results[1].report.lengths_after)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_other_multimodal_checkpoints_are_refused_by_name(model_type):
    model = multimodal_model(model_type, meta=True)
    with pytest.raises(UnsupportedModelError, match=REFUSED[model_type][1]):
        ModelGeometry.of(model)


@torch.no_grad()
def test_image_inputs_are_refused_by_name():
    """The compressed prompt holds what the language model computed from the text: an image given to the
    generation would be dropped (or fail inside transformers), so it is refused before anything runs."""
    model = multimodal_model("llava")
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(3))
    pixels = torch.zeros(1, 3, 28, 28)
    for policy in (None, CompressionPolicy(keep_ratio=0.5)):
        with pytest.raises(ValueError, match=r"pixel_values.*text only"):
            generate(model, ids, policy, max_new_tokens=2, pixel_values=pixels)
    assert generate(model, ids, None, max_new_tokens=2).sequences.shape == (1, 42)


def test_a_multimodal_checkpoint_profiles_as_its_language_model_alone(tmp_path, embedded_tokenizer, capsys):
    """``profile-model`` on a saved Mistral 3 checkpoint (which transformers has no causal LM class for: it
    loads whole), and on its language model saved alone: every section of the two artifacts is the same."""
    from conftest import single_thread, tiny_profile_args, write_tiny_model_dir

    from artifacts import open_artifact
    from profiler.cli import main

    wrapper = multimodal_model("mistral3", vocab_size=len(embedded_tokenizer))
    artifacts = {}
    for name, model in (("wrapper", wrapper), ("alone", language_model_alone(wrapper))):
        model_dir = write_tiny_model_dir(tmp_path / name, embedded_tokenizer, probes=3, model=model, probe_length=64)
        artifacts[name] = tmp_path / f"{name}.h5"
        with single_thread():
            assert main(tiny_profile_args(model_dir, artifacts[name], calib_samples=4)) == 0, capsys.readouterr().err
    with open_artifact(artifacts["wrapper"]) as served, open_artifact(artifacts["alone"]) as own:
        assert served.model.name != own.model.name and served.sections == own.sections
        assert served.model.arch_fingerprint == own.model.arch_fingerprint
        for section in served.sections:
            for name, values in served.section(section).arrays.items():
                expected = own.section(section).arrays[name]
                if np.issubdtype(values.dtype, np.number):
                    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6, err_msg=f"{section}/{name}")
                else:  # names (probe ids)
                    assert np.array_equal(values, expected), f"{section}/{name}"


@torch.no_grad()
def test_the_embedded_model_inside_smolvlm_answers_as_itself(embedded_model, embedded_tokenizer, smoke_artifact):
    """SmolVLM's language model is SmolLM2 (SmolVLM-256M's is SmolLM2-135M): the embedded weights in
    SmolVLM's layout, a tiny vision tower beside them.  The smoke artifact, profiled on the embedded model
    alone, is this checkpoint's (the weights fingerprint is its language model's); served with the flagship
    from it, every head keeps the positions it keeps in the embedded model and the answers are the same."""
    from runtime import answer, load_calibration
    from runtime.plan.policy_spec import FLAGSHIP

    if not hasattr(T, "SmolVLMConfig"):
        pytest.skip(f"transformers {T.__version__} has no SmolVLM")
    vocabulary = embedded_model.config.vocab_size
    torch.manual_seed(0)
    text = {k: v for k, v in embedded_model.config.to_dict().items() if k not in ("architectures",)}
    config = T.SmolVLMConfig(text_config=text, vision_config=VISION, image_token_id=vocabulary - 1)
    wrapper = T.SmolVLMForConditionalGeneration(config).eval()
    wrapper.model.text_model.load_state_dict(embedded_model.model.state_dict())
    wrapper.lm_head.load_state_dict(embedded_model.lm_head.state_dict())
    wrapper.generation_config = embedded_model.generation_config

    policy = FLAGSHIP.policy(0.75)
    calibrations = {
        "alone": load_calibration(embedded_model, embedded_tokenizer, path=smoke_artifact),
        "wrapper": load_calibration(wrapper, embedded_tokenizer, path=smoke_artifact),  # refused if it differed
    }
    models = {"wrapper": wrapper, "alone": embedded_model}
    context = "The vault code is 4417. " + "Grass is green and the sky is blue. " * 20 + "The boat is called Heron. "
    questions = ["What is the vault code?", "What is the boat called?"]
    answers = {
        name: answer(
            model, embedded_tokenizer, context, questions, policy, calibration=calibrations[name], max_new_tokens=8
        )
        for name, model in models.items()
    }
    assert answers["wrapper"] == answers["alone"]

    ids = embedded_tokenizer(context, return_tensors="pt").input_ids
    caches = {
        name: compress_prompt(model, ids, policy, calibration=calibrations[name])[0] for name, model in models.items()
    }
    evicted = 0
    for served, own in zip(caches["wrapper"].layers, caches["alone"].layers, strict=True):
        for head in range(served.store.num_heads):
            positions = served.head(0, head)[2]
            assert torch.equal(positions, own.head(0, head)[2])
            evicted += ids.shape[1] - len(positions)
    assert evicted > 0.5 * ids.shape[1] * len(caches["wrapper"].layers) * served.store.num_heads


def test_an_unchecked_multimodal_checkpoint_is_refused_before_its_weights_load(tmp_path, monkeypatch, capsys):
    """The commands check config.json first (runtime.math.geometry.check_config): a PaliGemma checkpoint is
    refused by name without loading its weights; an image-text model kvcal serves passes that check."""
    from conftest import forbid_model_loading

    from profiler.cli import main
    from runtime.math.geometry import check_config

    model_dir = tmp_path / "paligemma"
    multimodal_model("paligemma").save_pretrained(model_dir)
    forbid_model_loading(monkeypatch)
    assert main([str(model_dir), "--out", str(tmp_path / "out.h5"), "--preset", "smoke", "--no-progress"]) == 2
    assert "the language model of a multimodal checkpoint (paligemma) kvcal has not checked" in capsys.readouterr().err
    assert not (tmp_path / "out.h5").exists()
    check_config(multimodal_model("gemma3", meta=True).config)  # served: no error


@torch.no_grad()
def test_paligemma_served_as_a_causal_language_model_would_be_wrong(monkeypatch):
    """Why an unchecked type is refused: PaliGemma's text path (positions from 1, the prompt attended both
    ways) is not its language model's, and served as kvcal serves a causal LM, with nothing evicted, its
    logits are off by far more than the matrix's tolerance (2.7e-2 at seed 0)."""
    import runtime.math.geometry as geometry

    monkeypatch.setattr(geometry, "MULTIMODAL_SERVED", geometry.MULTIMODAL_SERVED | {"paligemma"})
    assert nothing_evicted_difference(multimodal_model("paligemma")) > 100 * TOLERANCE


@torch.no_grad()
def test_the_prompt_checks_read_the_language_models_config():
    """A multimodal config keeps the vocabulary and the context in its text config: a token outside the
    vocabulary and a prompt past the context are refused before anything runs, as for the model alone."""
    from runtime.serve.generation import context_limit

    model = multimodal_model("llava")
    assert context_limit(model.config) == TEXT["max_position_embeddings"] == 512
    with pytest.raises(ValueError, match=r"token id 300 in input_ids is outside the model's vocabulary of 256 ids"):
        generate(model, torch.tensor([[5, 300]]), None, max_new_tokens=1)
    with pytest.raises(ValueError, match=r"the prompt has 600 tokens .* more than the model's context of 512"):
        generate(model, torch.randint(3, 250, (1, 600)), None, max_new_tokens=1)


@torch.no_grad()
def test_the_vision_towers_attention_is_left_as_it_was():
    """kvcal switches the attention function for its calls only: afterwards every part of the model
    attends as before, the vision tower's own choice included (it was left as the language model's)."""
    model = multimodal_model("llava")
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": "eager"})
    before = [module.config._attn_implementation for module in model.modules() if isinstance(module, T.PreTrainedModel)]
    assert set(before) == {"sdpa", "eager"}
    generate(model, torch.randint(3, 250, (1, 30)), CompressionPolicy(keep_ratio=0.5), max_new_tokens=2)
    after = [module.config._attn_implementation for module in model.modules() if isinstance(module, T.PreTrainedModel)]
    assert after == before
    assert model.config.vision_config._attn_implementation == "eager"


@pytest.mark.parametrize(
    ("model_type", "says"),
    [
        ("deepseek_v3", r"multi-head latent attention \(MLA"),
        ("mistral", r"the language model of a multimodal checkpoint \(llava\) kvcal has not checked"),
    ],
)
def test_a_multimodal_config_is_refused_by_what_its_language_model_does_first(model_type, says, monkeypatch):
    """A multimodal checkpoint whose language model kvcal cannot compute is refused by that, not only as
    unchecked (the commands read config.json before loading): a LLaVA around DeepSeek V3's language model
    names its multi-head latent attention."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import runtime.math.geometry as geometry

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {T.__version__} has no {model_type}")
    monkeypatch.setattr(geometry, "MULTIMODAL_SERVED", geometry.MULTIMODAL_SERVED - {"llava"})
    config = T.LlavaConfig(text_config=dict(model_type=model_type, **TEXT), vision_config=VISION)
    with pytest.raises(UnsupportedModelError, match=says):
        geometry.check_config(config)


@torch.no_grad()
@pytest.mark.parametrize("model_type", ["llama4", "qwen3_5"])
def test_a_checkpoint_transformers_loads_as_its_language_model_is_that_model(model_type, tmp_path):
    """Llama 4's and Qwen3.5's checkpoints are multimodal, but transformers' causal LM for them is the language
    model alone (``Llama4ForCausalLM``, ``Qwen3_5ForCausalLM``, the vision tower's weights left unread):
    config.json passes the multimodal check and the loaded model is served as that language model (Qwen3.5 keeps
    the wrapper's multimodal RoPE in its text config)."""
    from common.models import load_model
    from runtime.math.geometry import check_config

    if model_type == "llama4":
        text = dict(TEXT, intermediate_size_mlp=128, num_local_experts=4, attention_chunk_size=512, pad_token_id=0)
        vision = dict(VISION, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
        torch.manual_seed(0)
        whole = T.Llama4ForConditionalGeneration(T.Llama4Config(text_config=text, vision_config=vision, **IMAGE))
    else:
        if refused_on_older(model_type):
            return
        torch.manual_seed(0)
        whole = multimodal_model(model_type)
    whole.eval().save_pretrained(tmp_path)
    check_config(whole.config)
    model = load_model(tmp_path)
    assert type(model).__name__ == {"llama4": "Llama4ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}[model_type]
    ids = torch.randint(3, 250, (1, 60), generator=torch.Generator().manual_seed(3))
    assert torch.equal(
        model(ids).logits, whole.language_model(ids).logits if model_type == "llama4" else whole(ids).logits
    )
    model.generation_config.pad_token_id = 0
    assert nothing_evicted_difference(model) < TOLERANCE
    assert generate(model, ids, CompressionPolicy(keep_ratio=0.25), max_new_tokens=3).report.kv_bytes_after > 0


@pytest.mark.parametrize("model_type", ["llava", "smolvlm", "internvl", "qwen2_5_vl"])
@torch.no_grad()
def test_the_decode_steps_of_a_multimodal_checkpoint_are_replayed(model_type, monkeypatch):
    """A wrapper's decode steps pass generate() nothing a captured step cannot take (its modality inputs are
    None after the prompt): with the page kernel a GPU runs, they are replayed from a graph (the recorder of
    tests/step_replay.py on the CPU) and generate what eager steps generate.  (A model with sliding-window
    layers is never replayed, multimodal or not: runtime.kv_store.cache.RaggedLayer.replay_key.)"""
    from step_replay import RecordedStep
    from test_decode_graph import NEW_TOKENS, _generate

    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE

    if refused_on_older(model_type):
        return
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    model = multimodal_model(model_type)
    ids = torch.randint(3, 250, (2, 120), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    policy = CompressionPolicy(keep_ratio=0.25)
    eager = _generate(model, ids, mask, policy, False)
    replayed = _generate(model, ids, mask, policy, RecordedStep)
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.output.logits[1:], replayed.output.logits[1:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert replayed.graphs.captured == 1 and replayed.graphs.replayed == NEW_TOKENS - 3


@torch.no_grad()
def test_a_generation_does_not_read_the_positions_an_earlier_one_left():
    """Qwen2.5-VL keeps its rows' position shifts (``rope_deltas``) on the model between calls and reuses them
    while the cache is not empty, which kvcal's compressed cache never is when generate() starts: a
    generation after one of another batch size failed ("RaggedCache holds 1 batch row, the model fed 2
    rows"), and after one of the same size would have read that call's shifts.  Each now gets its own: a
    1-row generation after a 2-row one is a fresh model's."""
    if refused_on_older("qwen2_5_vl"):
        return
    model = multimodal_model("qwen2_5_vl")
    ids = torch.randint(3, 250, (2, 60), generator=torch.Generator().manual_seed(3))
    policy = CompressionPolicy(keep_ratio=0.25)
    options = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    fresh = generate(multimodal_model("qwen2_5_vl"), ids[1:], policy, **options)
    generate(model, ids, policy, max_new_tokens=2)
    after = generate(model, ids[1:], policy, **options)
    assert torch.equal(after.sequences, fresh.sequences)
    for a, b in zip(after.output.logits, fresh.output.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_exaone_4_5_is_served_as_its_text_model():
    """EXAONE 4.5's generate() drops the position ids it computes from the mask (its prepare_inputs_for_generation
    sets them None) and its forward numbers a step's tokens by the cache's columns, padding included.  kvcal's
    prefill numbers a left-padded row's tokens from its first real one, so its first decode step was 10 positions
    off its stored keys (logits 0.05 - 0.23 off on this tiny model).  kvcal's generation hands the wrapper the
    positions from the mask: a padded row is generated as it is alone (and as the wrapper's own generate(), whose
    columns and positions differ by a constant, which RoPE does not see)."""
    from test_architecture_matrix import STEPS, _prompt

    model = multimodal_model("exaone4_5")
    ids, mask = _prompt()
    options = dict(max_new_tokens=STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, attention_mask=mask, **options)
    got = generate(model, ids, None, attention_mask=mask, **options)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.output.logits, expected.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert model.prepare_inputs_for_generation.__func__ is type(model).prepare_inputs_for_generation  # restored
