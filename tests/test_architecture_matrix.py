"""Issue 41: every causal LM transformers ships is served exactly or refused by name.

Each model type of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is in one table here, on a
tiny random-weight model of its own config class (64 wide, 4 layers, 4 query / 2 KV heads of 16,
a 32-token sliding window where the architecture has one, vocabulary 256):

* :data:`EXACT`: with nothing evicted, ``runtime.generate`` on a left-padded batch of two
  (60 columns, one row 10 of them padding, 8 greedy steps) gives each step's logits of the
  unmodified model run on that row alone, within 1e-4; the layers whose RoPE is not
  ``runtime.math.rope``'s (``runtime.plan.rope_check``, the un-rotation the leverage scorer and the profiler's
  pre-RoPE query reads rely on) are the ones the table names, and there the scorers that read RoPE
  are refused by name, unless those layers follow another form runtime.math.rope serves (interleaved
  pairs, no RoPE, the inverse rotation: the flagship serves); elsewhere the un-rotation and the query reads
  agree with the model's own.
* :data:`REFUSED`: ``ModelGeometry.of`` (every entry point's first check) refuses it naming the
  feature.
* :data:`SKIPPED`: not a text decoder with a KV cache transformers can build tiny here, with why.

:func:`test_every_causal_lm_of_transformers_is_in_the_matrix` fails when a transformers release
adds a causal LM, so that it is classified here.  Beam search is checked against transformers'
own, and compressed serving (decode-time eviction too) runs, on every exact architecture.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
import transformers as T
from packaging.version import Version

from runtime import CompressionPolicy, RaggedCache, bind, generate
from runtime.math.geometry import ModelGeometry, UnsupportedModelError
from runtime.plan.calibration import Calibration
from runtime.plan.policy_spec import FLAGSHIP
from runtime.plan.rope_check import rope_mismatches

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

TOLERANCE = 1e-4


def rope_reading_refused(model_type: str) -> bool:
    """Whether the scorers that read RoPE are refused on ``model_type``: some layer rotates otherwise than
    every form of runtime.math.rope (interleaved pairs and no RoPE are forms it serves)."""
    served = ("no RoPE", "interleaved RoPE", "the inverse RoPE rotation", "rotate_half from frequencies given once")
    return any(not clause.startswith(served) for clause in EXACT[model_type].split("; ") if clause)


PROMPT, PADDING, STEPS = 60, 10, 8
SMALL = dict(  # what each config class accepts of these is given (its own names for them, too)
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=32,
    max_window_layers=2,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    ffn_hidden_size=128,
    n_positions=1024,
    n_ctx=1024,
    kv_channels=16,
    num_kv_heads=2,
    # Mamba 2 mixers (Falcon-H1, Bamba, Granite 4 hybrid): their default 128 heads x 256 states in chunks of 256
    # made one forward pass of the tiny model 1.3-2.6 s on one thread, 200x these; chunks of 32 are crossed
    mamba_n_heads=8,
    mamba_d_ssm=64,
    mamba_d_state=16,
    mamba_chunk_size=32,
)
# model type: its own options over SMALL (the names its config class gives them)
OPTIONS = {
    "gemma3n_text": dict(  # without KV sharing (with it, as its checkpoints: tests/test_kv_sharing.py)
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
        laurel_rank=8,
        altup_num_inputs=2,
        num_kv_shared_layers=0,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    # as its checkpoints: sliding layers of head dim 16 and 2 KV heads, full-attention layers of 32 and 1 whose values
    # are their keys (attention_k_eq_v) and whose RoPE turns a quarter of the head (proportional); per-layer inputs
    "gemma4_text": dict(
        layer_types=["sliding_attention", "full_attention"] * 2,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=8,
    ),
    "gemma4_unified_text": dict(  # full-attention layers of head dim 32
        layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=32
    ),
    "dots3_note_text": dict(num_key_value_heads=4),  # its config wants as many as the query heads
    "lfm2": dict(full_attn_idxs=[1, 3]),  # as its checkpoints: convolution layers beside attention
    "bamba": dict(attn_layer_indices=[1, 3]),  # as its checkpoints: Mamba 2 layers beside attention
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 2),  # likewise
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),  # likewise
    "falcon_h1": dict(key_multiplier=0.5),  # its checkpoints' multipliers are not 1 (the keys' read scales)
    # as its checkpoints: values narrower than the keys (24 to 16 here, 128 to 192 there), full-attention layers first
    # and every few, sliding layers of twice the KV heads with learned sinks between them
    "mimo_v2_flash": dict(
        v_head_dim=24, layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    ),
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=4,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    ),
}
# model type: what runtime.plan.rope_check finds ("": every layer rotates as runtime.math.rope)
EXACT = {
    "afmoe": "no RoPE in layer 3",
    "apertus": "",
    "apertus1p5_text": "",
    "arcee": "",
    "aria_text": "",
    "bamba": "",  # hybrid: Mamba 2 layers 0, 2
    "bitnet": "",
    "cohere": "interleaved RoPE in layers 0, 1, 2, 3",
    "cohere2": "interleaved RoPE in layers 0, 1, 2; no RoPE in layer 3",
    "cohere2_moe": "interleaved RoPE in layers 0, 1, 2; no RoPE in layer 3",
    "cwm": "",
    "dots1": "",
    "ernie4_5": "interleaved RoPE in layers 0, 1, 2, 3",
    "ernie4_5_moe": "interleaved RoPE in layers 0, 1, 2, 3",
    "exaone": "",
    "exaone4": "no RoPE in layer 3",
    "exaone_moe": "no RoPE in layer 3",
    "falcon_h1": "",  # hybrid: attention beside Mamba 2 in every layer; keys scaled by key_multiplier (read)
    "flex_olmo": "",
    "flint": "no RoPE in layers 0, 1, 3",  # learned attention sinks (s_aux)
    "gemma": "",
    "gemma2": "",
    "gemma3_text": "",
    "gemma3n_text": "",  # altup, laurel, per-layer inputs; KV sharing in tests/test_kv_sharing.py
    # kvcal holds the full-attention layers alone; the sliding ones, of another geometry, stay transformers' own
    "gemma4_text": "",
    "gemma4_unified_text": "",
    "glm": "interleaved RoPE in layers 0, 1, 2, 3",
    "glm4": "interleaved RoPE in layers 0, 1, 2, 3",
    "glm4_moe": "",
    "gpt_oss": "rotate_half from frequencies given once in layers 0, 1, 2, 3",  # learned sinks, YaRN, sliding
    "granite": "",
    "granitemoe": "",
    "granitemoeshared": "",
    "granite_swa": "",  # learned attention sinks (s_aux)
    "granitemoehybrid": "no RoPE in layers 1, 3",  # hybrid: Mamba 2 layers 0, 2; no rotary module (Granite 4.0-H)
    "granitemoe_swa": "",  # learned attention sinks (s_aux)
    "helium": "interleaved RoPE in layers 0, 1, 2, 3",
    "hunyuan_v1_dense": "",  # a norm after RoPE, read: its weight applied after the rotation
    "hunyuan_v1_moe": "",
    "hy_v3": "",
    "hyperclovax": "",
    "internlm3": "",
    "jamba": "no RoPE in layers 1, 3",  # hybrid: Mamba layers 0, 2; no rotary module
    "iquestcoder": "",
    "jais2": "",
    "kolibri1": "",
    "laguna": "",
    "lara_mini": "no RoPE in layer 3",  # hybrid: Gated DeltaNet layers 0, 2; layer 1 slides
    "lfm2": "",  # hybrid: gated short convolutions in layers 0, 2; q_layernorm / k_layernorm read
    "lfm3": "",  # hybrid: convolutions in layers 0, 1, 3
    "llama": "",
    # chunked attention (chunks of 8192, the prompt 60: past them, tests/test_chunked_attention.py); a norm after RoPE
    "llama4_text": "interleaved RoPE in layers 0, 1, 2; no RoPE in layer 3",
    "mellum": "",
    "mimo_v2_flash": "",  # values narrower than the keys; sliding layers of other KV heads held apart
    "minimax_m2": "",
    "minimax_m3_vl_text": "",
    "ministral": "",
    "ministral3": "",
    "mistral": "",
    "mixtral": "",
    "nanochat": "the inverse RoPE rotation in layers 0, 1, 2, 3",
    "nemotron": "",
    "nemotron_h": "no RoPE in layer 2",  # hybrid: a Mamba 2 layer, an MoE and an MLP layer (no mixer); no rotary
    "olmo": "",
    "olmo2": "",
    "olmo3": "",
    "olmoe": "",
    "olmo_hybrid": "",  # hybrid: Gated DeltaNet layers 0, 1, 2
    "phi": "",
    "phi3": "",
    "phimoe": "",  # its attention passes no sliding_window; its mask slides (the ragged cache's window: config)
    "qwen2": "",
    "qwen2_moe": "",
    "qwen3": "",
    "qwen3_moe": "",
    # hybrid: Gated DeltaNet layers 0, 1, 2, the attention's query projection with its output gate; partial RoPE
    "qwen3_5_moe_text": "",
    "qwen3_5_text": "",
    "qwen3_next": "",
    "sarvam_moe": "",
    "seed_oss": "",
    "smollm3": "no RoPE in layer 3",
    "solar_open": "",
    "stablelm": "",
    "starcoder2": "",
    "vaultgemma": "",
}
# model type: its rotary module's width where not a head's 16 dimensions: partial RoPE turns only those (their
# default factors); gpt-oss turns all 16 from 8 frequencies given once (runtime.math.rope.HALVES)
PARTIAL = {
    **{"glm": 8, "glm4": 8, "glm4_moe": 8, "gpt_oss": 8, "laguna": 8, "nemotron": 8, "phi": 8, "stablelm": 4},
    **{"bamba": 8, "qwen3_5_moe_text": 4, "qwen3_5_text": 4, "qwen3_next": 4},
    **{"granitemoehybrid": 0, "jamba": 0, "nemotron_h": 0},  # no rotary module: nothing turns
    # proportional RoPE: frequencies over the whole head of 32, the last three quarters of them zero (nothing turns)
    **{"gemma4_text": 32, "gemma4_unified_text": 32},
    "mimo_v2_flash": 6,  # partial_rotary_factor 0.334 of 16: int(5.3) = 5 dims, 3 frequencies (checkpoints: 64 of 192)
}
NOT_LLAMA_FAMILY = r"no decoder layers at model\.model\.layers \(not a Llama-family causal LM\)"
# what the refusal names: the model types refused so
REFUSED = {
    r"multi-head latent attention \(MLA": (
        "axk1",
        "axk2",
        "bailing_hybrid",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "hy_v4",
        "kimi_linear",
        "longcat_flash",
        "minicpm3",
        "sarvam_mla",
        "youtu",
    ),
    r"layer type\(s\) compressed_sparse_attention, heavily_compressed_attention are not supported": ("deepseek_v4",),
    r"layer 1 is a recurrent layer \(MiniMaxLightningAttention\) that does not keep its state": ("minimax",),
    r"dynamic mask attention \(layer 0 self_attn\.dt_proj": ("doge",),
    r"differential attention \(layer 0 self_attn\.lambda_q1": ("diffllama",),
    r"full_attention layers without RoPE parameters": ("beam",),
    r"a heterogeneous config \(attributes that vary per layer: head_dim, kv_lora_rank": ("dots3_note_text",),
    r"recurrent layers \(n_recurrent_loops=2: a section of layers run several times": ("dory",),
    r"layer type\(s\) hybrid_sliding are not supported": ("inkling2_loop_text", "inkling2_text", "inkling_text"),
    r"layer 0 is a recurrent layer \(RecurrentGemmaDecoderLayer\) that does not keep its state": ("recurrent_gemma",),
    r"does not route attention through transformers' AttentionInterface": ("xglm",),
    r"layer 0 has no self_attn module": ("jetmoe", "modernbert-decoder"),  # mixture of attention heads; ModernBERT
    r"layer 0 attention has no q_proj linear nor a fused qkv_proj": ("moshi", "persimmon"),
    NOT_LLAMA_FAMILY: (
        "bart",
        "bert",
        "bert-generation",
        "big_bird",
        "bigbird_pegasus",
        "biogpt",
        "blenderbot",
        "blenderbot-small",
        "bloom",
        "camembert",
        "codegen",
        "cpmant",
        "ctrl",
        "data2vec-text",
        "dbrx",
        "electra",
        "ernie",
        "falcon",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neox",
        "gpt_neox_japanese",
        "gptj",
        "hrm_text",
        "marian",
        "mbart",
        "megatron-bert",
        "mpt",
        "mvp",
        "openai-gpt",
        "opt",
        "pegasus",
        "prophetnet",
        "rembert",
        "roberta",
        "roberta-prelayernorm",
        "roc_bert",
        "roformer",
        "trocr",
        "xlm",
        "xlm-roberta",
        "xlm-roberta-xl",
        "xlnet",
        "xmod",
    ),
    r"config lacks num_attention_heads": ("falcon_mamba", "mamba", "rwkv", "xlstm"),  # no attention at all
}
# model type: why it is not in the matrix
MULTIMODAL = "a multimodal model (its text model is in the matrix where transformers has one)"
SKIPPED = {
    "gemma3": MULTIMODAL,
    "gemma3n": MULTIMODAL,
    "gemma4": MULTIMODAL,
    "gemma4_unified": MULTIMODAL,
    "llama4": MULTIMODAL,
    "qwen3_5": MULTIMODAL,
    "qwen3_5_moe": MULTIMODAL,
    "qwen4_exp": MULTIMODAL,
    "dots3_note": MULTIMODAL,
    "emu3": "a multimodal (image-token) model",
    "fuyu": "a multimodal model (image patches fed as embeddings)",
    "git": "an image-to-text model",
    "got_ocr2": "an OCR (image-to-text) model",
    "mllama": "a multimodal model with cross-attention layers",
    "phi4_multimodal": "a multimodal model",
    "moss_transcribe_diarize": "a speech model",
    "musicgen": "an audio-token decoder (several codebooks)",
    "musicgen_melody": "an audio-token decoder (several codebooks)",
    "whisper": "the decoder of a speech encoder-decoder",
    "plbart": "the decoder of an encoder-decoder",
    "reformer": "a reversible LSH-attention model without a KV cache",
    "gpt_neo": "not a Llama-family model (local / global attention layers); its tiny config does not build",
    "blt": "a byte latent transformer (local encoder, global model, local decoder), no single decoder stack",
    "mamba2": "a state-space model, no attention KV cache",
    "zamba": "a hybrid state-space model (shared attention blocks); its tiny config does not build",
    "zamba2": "a hybrid state-space model (shared attention blocks); its tiny config does not build",
    "zaya": "a hybrid model (layer type 'hybrid', refused as such); its tiny config does not build",
    "lfm2_moe": "a hybrid convolution / attention model; its tiny config does not build",
    "cohere_compass_text": "transformers cannot build its tiny config (KeyError 'full_attention', as Beam's refusal)",
    "gemma4_assistant": "a draft model for assisted generation; its tiny config does not build",
    "gemma4_unified_assistant": "a draft model for assisted generation",
    "qwen4_exp_text": "its tiny config does not build here",
    "code_llama": "transformers 5.2's alias of llama (LlamaConfig, LlamaForCausalLM: the llama row)",
}


# The lowest transformers the project supports (5.2.0, `make test-lowest`) builds a few types otherwise:
# Falcon-H1 and Bamba have no layer types there (refused by their Mamba mixers instead), and the tiny
# GraniteMoeHybrid config does not build (transformers' own TypeError).
OLDER_TRANSFORMERS = Version(T.__version__) < Version("5.3")
REFUSED_ON_OLDER = {
    "minimax": r"a hybrid model \(linear attention",  # refused as every hybrid model there (HYBRID_ON_OLDER)
    # their attention modules bypass the AttentionInterface there
    **dict.fromkeys(("moshi", "recurrent_gemma"), r"does not route attention through transformers' AttentionInterface"),
    "bamba, no attention layer": r"a state-space \(Mamba\) mixer in layer 0",  # no layer types there
}
UNBUILT_ON_OLDER = {
    "granitemoehybrid": "its tiny config does not build in transformers 5.2 (TypeError in transformers)"
}
# served on newer transformers, refused by the runtime on 5.2, whose Nemotron has attention classes of its own
# (not through the AttentionInterface kvcal switches its attention function into)
NOT_ROUTED_ON_OLDER = ("nemotron",)
# hybrid models served on newer transformers, refused on 5.2: its Qwen3-Next and Qwen3.5 keep their linear
# attention state in a cache class of their own, so does its LFM2; its Bamba and Jamba have no layer types (a
# Mamba mixer refused), nor does its Falcon-H1
HYBRID_ON_OLDER = {
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lfm2"), r"a hybrid model \(linear attention"),
    **dict.fromkeys(("bamba", "falcon_h1", "jamba"), r"a state-space \(Mamba\) mixer in layer 0"),
}


def refused_on_older(model_type: str, model) -> bool:
    """Whether ``model_type`` is one of :data:`NOT_ROUTED_ON_OLDER` or :data:`HYBRID_ON_OLDER` under
    transformers 5.2, after checking that serving it is refused there by that name."""
    if OLDER_TRANSFORMERS and model_type in HYBRID_ON_OLDER:
        with pytest.raises(UnsupportedModelError, match=HYBRID_ON_OLDER[model_type]):
            ModelGeometry.of(model)
        return True
    if not (OLDER_TRANSFORMERS and model_type in NOT_ROUTED_ON_OLDER):
        return False
    with pytest.raises(ValueError, match=r"does not route attention through transformers' AttentionInterface"):
        generate(model, torch.ones(1, 8, dtype=torch.long), None, max_new_tokens=1)
    return True


def _classes(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {T.__version__} has no causal LM {model_type}")
    if OLDER_TRANSFORMERS and model_type in UNBUILT_ON_OLDER:
        pytest.skip(f"{model_type}: {UNBUILT_ON_OLDER[model_type]}")
    return CONFIG_MAPPING[model_type], getattr(T, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def tiny_config(model_type: str, **options):
    """The config of a tiny ``model_type``: :data:`SMALL`, what of it its config class takes, then
    :data:`OPTIONS` and ``options``."""
    config_class, _ = _classes(model_type)
    parameters = inspect.signature(config_class.__init__).parameters
    aliases = getattr(config_class, "attribute_map", None) or {}
    given = {}
    for name, value in SMALL.items():
        if name in parameters:
            given[name] = value
        elif aliases.get(name) in parameters:
            given[aliases[name]] = value
    return config_class(**{**given, **OPTIONS.get(model_type, {}), **options})


def tiny_model(model_type: str, *, meta: bool = False, **options):
    """The tiny ``model_type``, random weights of seed 0, float32, eval mode (``meta``: no weights)."""
    return built(_classes(model_type)[1], tiny_config(model_type, **options), meta=meta)


def built(model_class, config, *, meta: bool = False):
    """``model_class(config)``: random weights of seed 0, float32, eval mode, padding id 0 (``meta``: no weights)."""
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return model_class(config).eval()
    model = model_class(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _prompt():
    ids = torch.randint(3, 250, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :PADDING], mask[1, :PADDING] = 0, 0
    return ids, mask


def nothing_evicted_difference(model) -> float:
    """The largest difference of ``runtime.generate``'s logits with nothing evicted (a left-padded
    batch of two, greedy) from the unmodified model's on each row alone, unpadded, over the
    sequence kvcal generated."""
    ids, mask = _prompt()
    got = generate(
        model, ids, None, attention_mask=mask, max_new_tokens=STEPS, output_logits=True, return_dict_in_generate=True
    )
    difference = 0.0
    for row in range(2):
        real = mask[row].sum().item()
        sequence = got.sequences[row, PROMPT - real :]
        expected = model(sequence.unsqueeze(0)).logits[0, real - 1 : real - 1 + STEPS]
        steps = torch.stack([logits[row] for logits in got.output.logits])
        difference = max(difference, (steps - expected).abs().max().item())
    return difference


def test_every_causal_lm_of_transformers_is_in_the_matrix():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    refused = [model_type for types in REFUSED.values() for model_type in types]
    listed = [*EXACT, *refused, *SKIPPED]
    assert len(listed) == len(set(listed)), "a model type in two tables"
    missing = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(listed))
    assert not missing, f"causal LMs of transformers {T.__version__} not in the matrix: {missing}"


@pytest.mark.parametrize("model_type", sorted(EXACT))
@torch.no_grad()
def test_nothing_evicted_is_exact_and_the_rope_is_the_models(model_type):
    model = tiny_model(model_type)
    if refused_on_older(model_type, model):
        return
    difference = nothing_evicted_difference(model)
    assert difference < TOLERANCE, f"{model_type}: {difference:.2e}"

    found = rope_mismatches(model)
    assert found.describe() == EXACT[model_type]
    assert set(ModelGeometry.of(model).rotary_dims) == {PARTIAL.get(model_type, 16)}
    if rope_reading_refused(model_type):
        with pytest.raises(UnsupportedModelError, match=r"needs RoPE applied as .* reads no RoPE \(keydiff"):
            bind(CompressionPolicy(keep_ratio=0.25), None, model)  # leverage un-rotates the keys
    elif EXACT[model_type]:  # interleaved pairs or no RoPE: served, each layer in its form
        assert bind(CompressionPolicy(keep_ratio=0.25), None, model).rope_forms == found.forms
        assert set(found.forms.keys) != {"rotate_half"}
    else:  # the leverage un-rotation and the profiler's pre-RoPE query reads are the model's own
        assert max(found.key_errors) < TOLERANCE and max(found.query_errors) < TOLERANCE


@pytest.mark.parametrize(
    ("model_type", "reason"), sorted((model_type, reason) for reason, types in REFUSED.items() for model_type in types)
)
def test_refused_by_the_name_of_what_kvcal_cannot_compute(model_type, reason):
    if OLDER_TRANSFORMERS:
        reason = REFUSED_ON_OLDER.get(model_type, reason)
    model = tiny_model(model_type, meta=True)  # refused before any weight is read
    try:
        ModelGeometry.of(model)
    except UnsupportedModelError:
        pass
    # transformers 5.2's rotary (run to read its rotary dimensions) cannot autocast on meta
    except RuntimeError as error:
        if "autocast" not in str(error):
            raise
        model = tiny_model(model_type)
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelGeometry.of(model)
    with pytest.raises(UnsupportedModelError, match=reason):
        RaggedCache.for_model(model)


@pytest.mark.parametrize("model_type", sorted(EXACT))
@torch.no_grad()
def test_beams_are_transformers_own_and_compressed_serving_runs(model_type):
    """Beam search (``num_beams=2, num_return_sequences=2``) with nothing evicted is transformers'
    own on the unmodified model; compressed (leverage where the RoPE is the model's, keydiff
    elsewhere, decode-time eviction) it runs on a left-padded batch."""
    model = tiny_model(model_type)
    if refused_on_older(model_type, model):
        return
    ids, mask = _prompt()
    beams = dict(num_beams=2, num_return_sequences=2, max_new_tokens=5, do_sample=False)
    expected = model.generate(ids[:1], **beams)
    assert torch.equal(generate(model, ids[:1], None, **beams).sequences, expected)
    scorer = "keydiff" if rope_reading_refused(model_type) else "leverage"
    policy = CompressionPolicy(compression_ratio=0.75, scorer=scorer, evict_every=2)
    result = generate(model, ids, policy, attention_mask=mask, context_columns=50, max_new_tokens=4)
    assert result.new_tokens.shape == (2, 4)
    assert result.report.kv_bytes_after < result.report.kv_bytes_before


# a variant of an exact model type that real checkpoints have: (model type, options, what the refusal names)
REFUSED_VARIANTS = {
    # a Bamba of Mamba 2 layers alone has no KV cache to compress
    "bamba, no attention layer": (
        "bamba",
        dict(attn_layer_indices=None),
        r"no attention layer \(every layer type is linear attention, convolution or MLP\)",
    ),
}


@pytest.mark.parametrize("variant", sorted(REFUSED_VARIANTS))
def test_a_variant_real_checkpoints_have_is_refused_by_name(variant):
    model_type, options, reason = REFUSED_VARIANTS[variant]
    if OLDER_TRANSFORMERS:
        reason = REFUSED_ON_OLDER.get(variant, reason)
    with pytest.raises(UnsupportedModelError, match=reason):
        ModelGeometry.of(tiny_model(model_type, meta=True, **options))


def _flagship_calibration(model) -> Calibration:
    """An in-memory calibration with what the flagship reads: INF budgets and MomentKV orders
    (calibrated under the leverage selection), random but valid."""
    geometry = ModelGeometry.of(model)
    layers, heads = geometry.num_layers, geometry.num_kv_heads
    rng = np.random.default_rng(0)
    weights = rng.random((layers, heads)) + 0.1
    return Calibration(
        "memory.h5",
        None,  # no identity: arrays only
        {},
        ("budgets", "moments"),
        inf_weights=weights / weights.sum(),
        moment_orders=rng.integers(-1, 2, (layers, heads)).astype(np.int8),
        moment_tau=np.zeros((layers, heads)),
        moment_selection="leverage",
    )


@pytest.mark.parametrize("model_type", sorted(EXACT))
@torch.no_grad()
def test_the_flagship_serves_or_is_refused_by_name(model_type):
    """The flagship (INF budgets, leverage scores, MomentKV correction) from an in-memory
    calibration: served on a left-padded batch where the model rotates in a form of runtime.math.rope
    (rotate_half, its inverse, interleaved pairs, no RoPE), refused naming the model's RoPE elsewhere."""
    model = tiny_model(model_type)
    if refused_on_older(model_type, model):
        return
    calibration = _flagship_calibration(model)
    policy = FLAGSHIP.policy(0.75)
    ids, mask = _prompt()
    if rope_reading_refused(model_type):
        with pytest.raises(UnsupportedModelError, match=f"needs RoPE applied as .*{EXACT[model_type][:12]}"):
            generate(model, ids, policy, calibration=calibration, attention_mask=mask, context_columns=50)
        return
    result = generate(
        model, ids, policy, calibration=calibration, attention_mask=mask, context_columns=50, max_new_tokens=4
    )
    assert result.new_tokens.shape == (2, 4)
    assert result.report.kv_bytes_after < result.report.kv_bytes_before


# a smoke profile, every stage, on exact architectures the profiler's own matrix
# (tests/test_profiler_architectures.py) does not hold: MoE with Granite's multipliers, a window from
# the config alone, biases with a sliding window, OLMo 3's sliding layers
SMOKE = ("granitemoe", "phimoe", "starcoder2", "olmo3")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SMOKE)
def test_a_smoke_profile_runs_every_stage(model_type, tmp_path, embedded_tokenizer, capsys):
    from conftest import profile_every_stage

    from artifacts import open_artifact

    model = tiny_model(model_type, vocab_size=len(embedded_tokenizer))
    out = profile_every_stage(model, tmp_path, embedded_tokenizer, capsys, probe_length=64)
    with open_artifact(out) as reader:
        assert len(reader.sections) == 8
        assert np.all(np.isfinite(reader.section("query_stats")["cov"]))


@torch.no_grad()
def test_a_sliding_window_the_model_ignores_is_ignored():
    """A Llama whose config carries a ``sliding_window`` (config.json keeps what it is given) builds
    a causal mask and attends to everything; PhiMoE, whose attention passes no window either,
    builds a sliding one (in the matrix).  Both are served as the model computes."""
    model = tiny_model("llama", sliding_window=32)
    assert model.config.sliding_window == 32
    assert nothing_evicted_difference(model) < TOLERANCE
