"""RoPE read off the model (``runtime.plan.rope_check``): a policy that un-rotates keys or averages RoPE is
served exactly where the model rotates as ``runtime.math.rope`` assumes and refused by name elsewhere
(issue 41: the leverage scorer un-rotated Cohere's interleaved, SmolLM3's and EXAONE 4's missing and
HunYuan's post-norm RoPE wrongly, silently)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from tiny_architectures import NAMES, build

from runtime import CompressionPolicy, bind, compress_prompt
from runtime.math.geometry import UnsupportedModelError
from runtime.plan.rope_check import rope_mismatches

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

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
# name: (config class, model class, its options, the layers whose keys / queries rotate otherwise)
OTHER_ROPE = {
    "cohere (interleaved RoPE)": ("CohereConfig", "CohereForCausalLM", {}, (0, 1, 2, 3)),
    "ernie 4.5 (interleaved RoPE)": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}, (0, 1, 2, 3)),
    "hunyuan (a norm after RoPE)": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        {"head_dim": 16},
        (0, 1, 2, 3),
    ),
    "stablelm qk_layernorm (a norm the pre-RoPE read missed)": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {"qk_layernorm": True, "partial_rotary_factor": 1.0},
        (0, 1, 2, 3),
    ),
    "exaone 4 (full-attention layers without RoPE)": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        {"sliding_window": 16, "sliding_window_pattern": 2},
        (1, 3),
    ),
    "smollm3 (every fourth layer without RoPE)": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, (3,)),
}


def build_other(name: str):
    config_class, model_class, options, _ = OTHER_ROPE[name]
    if not hasattr(T, config_class):
        pytest.skip(f"transformers {T.__version__} has no {config_class}")
    torch.manual_seed(0)
    return getattr(T, model_class)(getattr(T, config_class)(**COMMON, **options)).eval()


@pytest.mark.parametrize("name", NAMES)
def test_the_rotation_of_every_supported_architecture_is_runtime_ropes(name):
    found = rope_mismatches(build(name))
    assert found.keys == () and found.queries == ()
    assert max(found.key_errors) < 1e-4 and max(found.query_errors) < 1e-4


@pytest.mark.parametrize("name", sorted(OTHER_ROPE))
@torch.no_grad()
def test_another_rotation_refuses_the_scorers_that_need_ropes_and_serves_the_others(name):
    model = build_other(name)
    found = rope_mismatches(model)
    assert found.keys == OTHER_ROPE[name][3], found.key_errors
    assert min(found.key_errors[i] for i in found.keys) > 0.3  # not rounding: another rotation
    for policy in (
        CompressionPolicy(keep_ratio=0.25),  # leverage of un-rotated keys
        CompressionPolicy(keep_ratio=0.25, scorer="expected_attention", statistics="prompt"),  # averaged RoPE
    ):
        with pytest.raises(UnsupportedModelError, match=r"needs RoPE applied as .* reads no RoPE \(keydiff"):
            bind(policy, None, model)
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(1))
    cache, report = compress_prompt(
        model, ids, CompressionPolicy(keep_ratio=0.25, scorer="keydiff"), context_columns=50
    )
    assert report.kv_bytes_after < report.kv_bytes_before


def test_a_pre_rope_read_that_cannot_be_made_is_refused_by_name():
    """Cohere with use_qk_norm: the norm's [heads, d] weight does not fit kvcal's pre-RoPE read
    (issue 41 item 3: a raw traceback before)."""
    torch.manual_seed(0)
    model = T.CohereForCausalLM(T.CohereConfig(**COMMON, use_qk_norm=True)).eval()
    with pytest.raises(UnsupportedModelError, match="pre-RoPE queries and keys cannot be read"):
        bind(CompressionPolicy(keep_ratio=0.25), None, model)


def test_the_embedded_model_rotates_as_runtime_rope(embedded_model):
    found = rope_mismatches(embedded_model)
    assert found.keys == () and found.queries == ()
    assert len(found.key_errors) == 30 and max(found.key_errors) < 1e-4
