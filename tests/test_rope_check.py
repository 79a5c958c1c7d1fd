"""RoPE read off the model (``runtime.plan.rope_check``): a policy that un-rotates keys or averages RoPE is
served exactly where each layer rotates in a form of ``runtime.math.rope`` (Llama's rotate_half, Cohere's
and Ernie 4.5's interleaved pairs, SmolLM3's and EXAONE 4's layers without RoPE) and refused by name
elsewhere (issue 41: the leverage scorer un-rotated all but Llama's wrongly, silently).  HunYuan's RMS
norm after the rotation is read too: its weight is divided out before un-rotating, applied after the
averaged rotation; a norm after it that centres (a LayerNorm) stays refused."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from tiny_architectures import NAMES, build

from runtime import CompressionPolicy, bind, compress_prompt
from runtime.math.geometry import ModelGeometry, UnsupportedModelError
from runtime.math.rope import RopeForms
from runtime.plan.rope_check import rope_mismatches
from runtime.scorers import AveragedRope, KeyRope

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
        (),
    ),
    # HunYuan with a LayerNorm after the rotation: it subtracts each vector's mean, which the rotation does
    # not keep, so no un-rotation gives a fixed read back (build_other swaps the norms in)
    "hunyuan with LayerNorms after RoPE (a norm that centres)": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        {"head_dim": 16},
        (0, 1, 2, 3),
    ),
    # norms before RoPE with weights per head: a LayerNorm per head on [B, H, T, d] (StableLM 2 12B), one
    # weight [H, d] on [B, T, H, d] (Command R+)
    "stablelm qk_layernorm (a LayerNorm per head)": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {"qk_layernorm": True, "partial_rotary_factor": 1.0},
        (0, 1, 2, 3),
    ),
    "cohere use_qk_norm (norm weights per head)": (
        "CohereConfig",
        "CohereForCausalLM",
        {"use_qk_norm": True},
        (0, 1, 2, 3),
    ),
    "exaone 4 (full-attention layers without RoPE)": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        {"sliding_window": 16, "sliding_window_pattern": 2},
        (1, 3),
    ),
    "smollm3 (every fourth layer without RoPE)": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, (3,)),
    # partial RoPE: the first r of a head's 16 dimensions turn, the rest pass (rotate_half within the r for
    # Phi-4-mini's 0.75 and StableLM's 0.25, interleaved pairs within them for GLM-4's 0.5)
    "phi3 (RoPE on 12 of 16 dimensions)": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, ()),
    "stablelm (RoPE on 4 of 16 dimensions)": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {"partial_rotary_factor": 0.25},
        (),
    ),
    "glm4 (interleaved RoPE on 8 of 16 dimensions)": (
        "Glm4Config",
        "Glm4ForCausalLM",
        {"partial_rotary_factor": 0.5, "head_dim": 16},
        (0, 1, 2, 3),
    ),
}


def build_other(name: str):
    config_class, model_class, options, _ = OTHER_ROPE[name]
    if not hasattr(T, config_class):
        pytest.skip(f"transformers {T.__version__} has no {config_class}")
    torch.manual_seed(0)
    model = getattr(T, model_class)(getattr(T, config_class)(**COMMON, **options)).eval()
    if "LayerNorms after RoPE" in name:
        for layer in model.model.layers:
            layer.self_attn.query_layernorm = torch.nn.LayerNorm(16)
            layer.self_attn.key_layernorm = torch.nn.LayerNorm(16)
    return model


@pytest.mark.parametrize("name", NAMES)
def test_the_rotation_of_every_supported_architecture_is_runtime_ropes(name):
    found = rope_mismatches(build(name))
    assert found.keys == () and found.queries == ()
    assert max(found.key_errors) < 1e-4 and max(found.query_errors) < 1e-4


# the architectures of OTHER_ROPE whose layers follow another form of runtime.math.rope: the rotation of
# interleaved pairs, or none (the identity); each layer's form, for keys and queries alike
OTHER_FORMS = {
    "cohere (interleaved RoPE)": ("interleaved, paired frequencies",) * 4,
    "ernie 4.5 (interleaved RoPE)": ("interleaved",) * 4,
    "exaone 4 (full-attention layers without RoPE)": ("rotate_half", "none") * 2,
    "smollm3 (every fourth layer without RoPE)": ("rotate_half",) * 3 + ("none",),
    "phi3 (RoPE on 12 of 16 dimensions)": ("rotate_half",) * 4,
    "stablelm (RoPE on 4 of 16 dimensions)": ("rotate_half",) * 4,
    "glm4 (interleaved RoPE on 8 of 16 dimensions)": ("interleaved",) * 4,
    "stablelm qk_layernorm (a LayerNorm per head)": ("rotate_half",) * 4,
    "cohere use_qk_norm (norm weights per head)": ("interleaved, paired frequencies",) * 4,
    "hunyuan (a norm after RoPE)": ("rotate_half",) * 4,  # also test_a_norm_after_rope_is_served_exactly_...
}


@pytest.mark.parametrize("name", sorted(set(OTHER_ROPE) - set(OTHER_FORMS)))
@torch.no_grad()
def test_another_rotation_refuses_the_scorers_that_need_ropes_and_serves_the_others(name):
    model = build_other(name)
    found = rope_mismatches(model)
    assert found.keys == OTHER_ROPE[name][3], found.key_errors
    assert min(found.key_errors[i] for i in found.keys) > 0.1  # not rounding (float32: 1e-6): another rotation
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


def _pre_and_post_rope(model, ids):
    """Per layer, the keys and the queries as the geometry reads them before RoPE and as the attention
    receives them: ``{layer: ([B, T, Hkv, d] keys, [B, T, Hq, d] queries)}`` twice (float32), from one
    forward pass of ``ids``."""
    from runtime.kv_store.attention_interface import attention_implementation
    from runtime.kv_store.eager_attention import eager_attention_forward
    from runtime.math.geometry import ModelGeometry

    geometry = ModelGeometry.of(model)
    pre_keys, pre_queries, post = {}, {}, {}
    handles = []
    for layer in range(geometry.num_layers):
        for store, projection in (
            (pre_keys, geometry.key_projections[layer]),
            (pre_queries, geometry.query_projections[layer]),
        ):
            handles.append(
                projection.module.register_forward_hook(
                    lambda _m, _i, output, store=store, projection=projection, layer=layer: store.__setitem__(
                        layer, projection.take(output).float()
                    )
                )
            )
    layer_of = {id(module): index for index, module in enumerate(geometry.attention_modules)}

    def recording(module, query, key, value, attention_mask, **kwargs):
        post[layer_of[id(module)]] = (key.transpose(1, 2).float(), query.transpose(1, 2).float())
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    try:
        with attention_implementation(model, "test_pre_post_rope", recording):
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: (pre_keys[layer], pre_queries[layer]) for layer in pre_keys}, post


def _provider(plan, need_type, need=None):
    """The provider of the plan's scorer's need of type ``need_type`` (or ``need``), given the plan's
    RoPE forms as :class:`runtime.scorers.ScorerInputs` gives them in the eviction."""
    from runtime.scorers.providers import PROVIDERS

    need = need or next(need for need in plan.scorer.needs if isinstance(need, need_type))
    return PROVIDERS[need_type](need, plan.scorer, plan.geometry, rope_forms=plan.rope_forms)


def _layer_inputs(layer, keys, next_position):
    """One row's inputs to a provider: ``keys [1, Hkv, T, d]`` at positions 0..T-1."""
    from runtime.scorers import LayerInputs

    where = torch.arange(keys.shape[2]).expand(1, keys.shape[1], -1)
    return LayerInputs(
        layer, keys, keys, where, where >= 0, torch.full(keys.shape[:2], keys.shape[2]), 1.0, [next_position]
    )


def _assert_query_rotation_is_the_models(model, queries, positions, tokens: int = 80) -> None:
    """Expected Attention's RoPE averaged over one position, applied to the queries before RoPE, is the query
    the model's attention received there, in every layer at each of ``positions``; and it compresses.
    ``queries(model, ids)``: ``{layer: [B, T, Hq, d]}`` of the model's forward pass over ``tokens`` ids (None:
    the geometry's reads)."""
    ids = torch.randint(3, 200, (1, tokens), generator=torch.Generator().manual_seed(4))
    pre, post = _pre_and_post_rope(model, ids)
    reads = queries(model, ids) if queries else {layer: query for layer, (_, query) in pre.items()}
    expected_attention = bind(
        CompressionPolicy(keep_ratio=0.25, scorer="expected_attention", statistics="prompt"), None, model
    )
    one_position = _provider(expected_attention, AveragedRope, AveragedRope(1))
    for layer in range(len(post)):
        for position in positions:
            matrix = one_position(_layer_inputs(layer, post[layer][0].transpose(1, 2), position)).matrices()[0]
            torch.testing.assert_close(
                reads[layer][0, position] @ matrix.T, post[layer][1][0, position], rtol=1e-4, atol=1e-5
            )
    cache, report = compress_prompt(model, ids, expected_attention, context_columns=tokens - 4)
    assert report.kv_bytes_after < report.kv_bytes_before


@pytest.mark.parametrize("name", sorted(OTHER_FORMS))
@torch.no_grad()
def test_the_other_forms_of_rope_are_served_exactly_by_the_scorers_that_read_rope(name):
    """Cohere and Ernie 4.5 rotate interleaved pairs (their rotary modules lay the frequencies out two
    ways), SmolLM3 and EXAONE 4 leave layers without RoPE (the identity), Phi-4-mini, StableLM and GLM-4
    turn only a head's first dimensions (in rotate_half's form or in pairs): each layer's form is read off
    the model, and the scorers that read RoPE, refused there before, follow it.  The keys the flagship's
    leverage scorer scores are every layer's pre-RoPE keys; the rotation Expected Attention averages is,
    over one position, the one the model applies to its pre-RoPE queries; both compress."""
    model = build_other(name)
    forms = OTHER_FORMS[name]
    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)  # uniform budgets, leverage scores
    assert plan.scorer.name == "leverage" and plan.rope_forms == RopeForms(forms, forms)
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(4))
    pre, post = _pre_and_post_rope(model, ids)
    key_rope = _provider(plan, KeyRope)
    for layer in range(len(pre)):
        keys = post[layer][0].transpose(1, 2)  # [1, Hkv, T, d]
        rotation = key_rope(_layer_inputs(layer, keys, 40))
        assert rotation.interleaved == forms[layer].startswith("interleaved")
        torch.testing.assert_close(rotation.undo(keys), pre[layer][0].transpose(1, 2), rtol=1e-4, atol=1e-5)
        if forms[layer] != "none":  # a rotating layer: the keys it received differ from the pre-RoPE ones
            assert float((post[layer][0] - pre[layer][0]).abs().max()) > 0.1
    cache, report = compress_prompt(model, ids, plan, context_columns=36)
    assert report.kv_bytes_after < report.kv_bytes_before
    _assert_query_rotation_is_the_models(model, None, (0, 7, 33), tokens=40)  # R(p) q_pre: the model's query at p


# the partial RoPE of OTHER_ROPE: how many of a head's first dimensions turn
PARTIAL = {
    "phi3 (RoPE on 12 of 16 dimensions)": 12,
    "stablelm (RoPE on 4 of 16 dimensions)": 4,
    "glm4 (interleaved RoPE on 8 of 16 dimensions)": 8,
}


@pytest.mark.parametrize("name", sorted(PARTIAL))
@torch.no_grad()
def test_partial_rope_turns_the_first_dimensions_the_geometry_reads(name):
    """A model that turns only a head's first ``r`` dimensions (refused whole before: "partial rotary
    embeddings are not supported") passes the others to its attention as the pre-RoPE read has them:
    the geometry's ``rotary_dims`` is that ``r``."""
    model = build_other(name)
    rotary = PARTIAL[name]
    assert ModelGeometry.of(model).rotary_dims == (rotary,) * 4
    pre, post = _pre_and_post_rope(model, torch.randint(3, 200, (1, 20), generator=torch.Generator().manual_seed(2)))
    for layer in range(4):
        for before, after in zip(pre[layer], post[layer], strict=True):  # keys, queries
            assert torch.equal(after[..., rotary:], before[..., rotary:])
            assert float((after[..., :rotary] - before[..., :rotary]).abs().max()) > 0.1


def test_a_pre_rope_read_that_cannot_be_made_is_refused_by_name():
    """A query norm kvcal's read cannot apply (here a LayerNorm over [d, H] the model's own forward
    never calls) is refused naming the read (issue 41 item 3: a raw traceback before; Cohere's norm
    weights per head, the case then, are now read)."""
    from tiny_architectures import build

    model = build("llama")
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.LayerNorm((16, 4))
    with pytest.raises(UnsupportedModelError, match="pre-RoPE queries and keys cannot be read"):
        bind(CompressionPolicy(keep_ratio=0.25), None, model)


def test_the_embedded_model_rotates_as_runtime_rope(embedded_model):
    found = rope_mismatches(embedded_model)
    assert found.keys == () and found.queries == ()
    assert len(found.key_errors) == 30 and max(found.key_errors) < 1e-4


# the embedded weights in another architecture with Llama's weight names: (config, model, options, layer forms)
EMBEDDED_IN = {
    "smollm3 (every fourth layer without RoPE)": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {"no_rope_layer_interval": 4},
        tuple("none" if layer % 4 == 3 else "rotate_half" for layer in range(30)),
    ),
    "ernie 4.5 (interleaved RoPE)": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}, ("interleaved",) * 30),
    # queries, keys and values fused in one qkv_proj, gate and up in one gate_up_proj (the weights are fused)
    "phi3 with Phi-4-mini's partial RoPE (48 of 64 dimensions turn)": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"partial_rotary_factor": 0.75},
        ("rotate_half",) * 30,
    ),
}


def _fused(weights: dict) -> dict:
    """Llama's ``q_proj, k_proj, v_proj`` and ``gate_proj, up_proj`` weights as Phi-3's ``qkv_proj``
    and ``gate_up_proj``."""
    weights = dict(weights)
    for layer in range(30):
        attention, mlp = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        weights[attention + "qkv_proj.weight"] = torch.cat([weights.pop(f"{attention}{p}_proj.weight") for p in "qkv"])
        weights[mlp + "gate_up_proj.weight"] = torch.cat([weights.pop(f"{mlp}{p}_proj.weight") for p in ("gate", "up")])
    return weights


@pytest.mark.parametrize("name", sorted(EMBEDDED_IN))
@torch.no_grad()
def test_the_embedded_weights_in_another_form_of_rope_are_unrotated_exactly(name, embedded_model, embedded_tokenizer):
    """The real embedded weights in SmolLM3's architecture (every fourth layer without RoPE), in
    Ernie 4.5's (interleaved RoPE), both with Llama's weight names, and in Phi-3's with Phi-4-mini's
    partial RoPE: the keys the leverage scorer scores are every layer's pre-RoPE keys, at the real
    weights' scale, and the compression serves."""
    config_class, model_class, options, forms = EMBEDDED_IN[name]
    if not hasattr(T, config_class):
        pytest.skip(f"transformers {T.__version__} has no {config_class}")
    own = {k: v for k, v in embedded_model.config.to_dict().items() if k not in ("architectures", "model_type")}
    model = getattr(T, model_class)(getattr(T, config_class)(**own, **options)).eval()
    weights = embedded_model.state_dict()
    model.load_state_dict(_fused(weights) if hasattr(model.model.layers[0].self_attn, "qkv_proj") else weights)
    assert ModelGeometry.of(model).rotary_dims == (int(64 * options.get("partial_rotary_factor", 1)),) * 30
    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)
    assert plan.rope_forms == RopeForms(forms, forms)
    ids = _embedded_prompt(embedded_tokenizer)
    _assert_scored_keys_and_served(
        model, plan, ids, {layer: keys for layer, (keys, _) in _pre_and_post_rope(model, ids)[0].items()}
    )


def _embedded_prompt(tokenizer) -> torch.Tensor:
    return tokenizer("The passcode is 4817. " * 6 + "What is the passcode?", return_tensors="pt").input_ids


def _assert_scored_keys_and_served(model, plan, ids, expected: dict) -> None:
    """The keys the plan's leverage scorer scores (its un-rotation of what each layer's attention received) are
    ``expected[layer] [B, T, Hkv, d]``, at the real weights' scale, and the compression serves."""
    _, post = _pre_and_post_rope(model, ids)
    key_rope = _provider(plan, KeyRope)
    for layer in range(len(post)):
        keys = post[layer][0].transpose(1, 2)
        unrotated = key_rope(_layer_inputs(layer, keys, ids.shape[1])).undo(keys)
        torch.testing.assert_close(unrotated, expected[layer].transpose(1, 2), rtol=1e-4, atol=1e-4)
    cache, report = compress_prompt(model, ids, plan, context_columns=ids.shape[1] - 6)
    assert report.kv_bytes_after < report.kv_bytes_before


# norms after the rotation: HunYuan's query_layernorm / key_layernorm (an RMSNorm with a weight of d) and
# Llama 4's qk_norm (an L2 norm without a weight, on its RoPE layers)
NORM_AFTER_ROPE = {
    "hunyuan dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16}),
    "hunyuan moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"head_dim": 16, "num_experts": 2, "moe_topk": 1}),
}


def _norm_weights_that_matter(model) -> None:
    """Norm weights of both signs and magnitudes 0.5-1.5 (transformers starts them at one, where dividing
    by them would go untested)."""
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        for norm in (layer.self_attn.query_layernorm, layer.self_attn.key_layernorm):
            size = norm.weight.shape
            sign = torch.where(torch.rand(size, generator=generator) < 0.3, -1.0, 1.0)
            norm.weight.copy_(sign * (0.5 + torch.rand(size, generator=generator)))


def _normalised_projections(model, ids):
    """Per layer, the raw ``k_proj`` / ``q_proj`` outputs of one forward pass of ``ids``, each head divided by
    its root mean square (with the norm's epsilon) where the layer has a norm after RoPE, computed here from
    the linear's output: ``{layer: (keys
    [B, T, Hkv, d], queries [B, T, Hq, d])}`` float32.  A norm after RoPE normalises the rotated vector, whose
    root mean square is the unrotated one's, so these are what the attention's vectors are before RoPE,
    less the norm's weight."""
    raw, handles = {}, []
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        for side, linear in (("k", attention.k_proj), ("q", attention.q_proj)):
            handles.append(
                linear.register_forward_hook(
                    lambda _m, _i, out, index=index, side=side: raw.__setitem__((index, side), out.float())
                )
            )
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    result = {}
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        norm = getattr(attention, "key_layernorm", None) or getattr(attention, "qk_norm", None)  # HunYuan, Llama 4
        pair = []
        for side in ("k", "q"):
            values = raw[(index, side)]
            values = values.reshape(*values.shape[:2], -1, model.config.head_dim)
            if norm is not None:  # Llama 4's layers without RoPE have none
                eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
                values = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
            pair.append(values)
        result[index] = tuple(pair)
    return result


def _normalised_queries(model, ids) -> dict:
    """:func:`_normalised_projections`' queries alone."""
    return {layer: queries for layer, (_, queries) in _normalised_projections(model, ids).items()}


@pytest.mark.parametrize("name", sorted(NORM_AFTER_ROPE))
@torch.no_grad()
def test_a_norm_after_rope_is_served_exactly_by_the_scorers_that_read_rope(name):
    """HunYuan normalises each head after the rotation: its attention receives ``w * R(p) k / rms(k)``.
    The rotation keeps the root mean square, so dividing by the norm's weight and un-rotating gives
    ``k / rms(k)`` exactly: the keys the leverage scorer scores (leverage does not change when the key
    space is scaled per dimension, so the weight's place does not matter to it).  For the queries,
    ``diag(w_q) R(p)`` applied to ``q / rms(q)`` (the profiler's pre-RoPE read) is what the attention
    received: Expected Attention's and the prototypes' averaged rotation carries ``diag(w_q)``.  Both
    were refused before ("a norm after it")."""
    config_class, model_class, options = NORM_AFTER_ROPE[name]
    if not hasattr(T, config_class):
        pytest.skip(f"transformers {T.__version__} has no {config_class}")
    torch.manual_seed(0)
    model = getattr(T, model_class)(getattr(T, config_class)(**COMMON, **options)).eval()
    _norm_weights_that_matter(model)
    found = rope_mismatches(model)
    assert found.keys == () and found.queries == (), found.describe()
    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)  # uniform budgets, leverage scores
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(4))
    normalised = _normalised_projections(model, ids)
    _, post = _pre_and_post_rope(model, ids)
    key_rope = _provider(plan, KeyRope)
    for layer in range(4):
        keys = post[layer][0].transpose(1, 2)  # [1, Hkv, T, d], what the attention received
        unrotated = key_rope(_layer_inputs(layer, keys, 40)).undo(keys)
        torch.testing.assert_close(unrotated, normalised[layer][0].transpose(1, 2), rtol=1e-4, atol=1e-5)
    cache, report = compress_prompt(model, ids, plan, context_columns=36)
    assert report.kv_bytes_after < report.kv_bytes_before
    _assert_query_rotation_is_the_models(model, _normalised_queries, (0, 7, 33), tokens=40)


@torch.no_grad()
def test_the_embedded_weights_with_a_norm_after_rope_are_unrotated_exactly(embedded_model, embedded_tokenizer):
    """The real embedded weights in HunYuan's architecture (Llama's weight names; the norms after the
    rotation HunYuan adds get weights of both signs): the keys the leverage scorer scores are every
    layer's keys before RoPE divided by their root mean square, at the real weights' scale."""
    own = {k: v for k, v in embedded_model.config.to_dict().items() if k not in ("architectures", "model_type")}
    model = T.HunYuanDenseV1ForCausalLM(T.HunYuanDenseV1Config(**own)).eval()
    missing, unexpected = model.load_state_dict(embedded_model.state_dict(), strict=False)
    assert not unexpected and all("layernorm" in key for key in missing) and len(missing) == 60, missing
    _norm_weights_that_matter(model)
    plan = bind(CompressionPolicy(keep_ratio=0.25), None, model)
    ids = _embedded_prompt(embedded_tokenizer)
    _assert_scored_keys_and_served(
        model, plan, ids, {layer: keys for layer, (keys, _) in _normalised_projections(model, ids).items()}
    )


@pytest.mark.parametrize("weights", ["tiny random", "the embedded model's"])
@torch.no_grad()
def test_queries_scaled_by_their_position_are_rotated_with_their_scale(weights, request):
    """Ministral 3 multiplies its rotated queries by ``1 + beta * log(1 + floor(p / original))``
    (``llama_4_scaling_beta`` 0.1; ``original_max_position_embeddings``, 16384 in its checkpoints, 16 here):
    1 below ``original``, so kvcal's 8-token RoPE probe cannot see it, and Expected Attention's averaged
    rotation missed it past there (silently: 1.16x at position 70 here, 1.11x at 32K in the checkpoints).
    The rotation now carries each position's scale; on a tiny random model and on the embedded weights in
    Ministral 3's architecture (Llama's weight names)."""
    if not hasattr(T, "Ministral3Config"):
        pytest.skip(f"transformers {T.__version__} has no Ministral3Config")
    rope = dict(T.Ministral3Config().rope_parameters, original_max_position_embeddings=16)
    assert rope["llama_4_scaling_beta"] == 0.1
    torch.manual_seed(0)
    if weights == "tiny random":
        model = T.Ministral3ForCausalLM(T.Ministral3Config(**COMMON, head_dim=16, rope_parameters=rope)).eval()
    else:
        embedded = request.getfixturevalue("embedded_model")
        own = {k: v for k, v in embedded.config.to_dict().items() if k not in ("architectures", "model_type")}
        model = T.Ministral3ForCausalLM(T.Ministral3Config(**{**own, "rope_parameters": rope})).eval()
        model.load_state_dict(embedded.state_dict())
    _assert_query_rotation_is_the_models(model, None, (0, 7, 15, 16, 33, 70))
