"""CalibratedPress (runtime/kvpress_press.py) checked against kvpress itself (issue 29).

kvpress's own pipeline (``pipeline("kv-press-text-generation")``, greedy) runs the embedded model
with the press; kvcal's runtime (``runtime.generate``, question-agnostic: the context compressed,
the question fed through the compressed cache, as kvpress does) serves the same policy with the
same artifact on the same token ids.  They must keep the same rows of every (layer, KV head) (the
press's ``module.masked_key_indices`` against the ``RaggedCache``'s kept positions), keep exactly
the budgets the artifact assigns, and give the same greedy answer.

The token ids are kvpress's own (``pipe.preprocess``): kvpress splits the chat template at the
context's end and tokenizes the context and the question apart, while kvcal's ``answer()`` puts
``"\\n\\n"`` between them in one user message (prompt_format), so the two prompts differ by a
token or two; here both sides are fed kvpress's ids.

Skipped with a message where kvpress is not installed (the main environment); ``make
test-kvpress`` installs it (the ``kvpress`` extra) and sets KVCAL_REQUIRE_KVPRESS, which turns the
skip into a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

with warnings.catch_warnings():
    # kvpress 0.5.5 imports fire 0.6, which imports the standard library's deprecated `pipes`
    warnings.filterwarnings("ignore", message="'pipes' is deprecated", category=DeprecationWarning)
    if os.environ.get("KVCAL_REQUIRE_KVPRESS"):
        import kvpress  # noqa: F401  (make test-kvpress: a missing kvpress fails, never skips)
    pytest.importorskip(
        "kvpress", reason="kvpress is not installed: pip install -e '.[kvpress]' (make test-kvpress runs these tests)"
    )

from transformers import pipeline  # noqa: E402

from artifacts.fingerprint import decoder_stack, text_config  # noqa: E402
from runtime import CompressionPolicy, generate, load_calibration, parse_policy  # noqa: E402
from runtime.kvpress_press import CalibratedPress  # noqa: E402

FILLER = "The grass is green. The sky is blue. The sun is warm. Here we go. There and back again. "
README_CONTEXT = FILLER * 40 + "The passcode is 4821. Remember it. " + FILLER * 40  # README's example
QUESTION = "What is the passcode?"
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def calibration(embedded_model, embedded_tokenizer, smoke_artifact):
    return load_calibration(embedded_model, embedded_tokenizer, path=smoke_artifact)


@pytest.fixture(scope="module")
def kv_pipeline(embedded_model, embedded_tokenizer):
    return pipeline("kv-press-text-generation", model=embedded_model, tokenizer=embedded_tokenizer)


def kvpress_kept(model, context_length: int) -> list[torch.Tensor]:
    """Per layer, bool ``[Hkv, T]``: the context rows the press left unmasked (read, then cleared,
    from each attention module's ``masked_key_indices``, which kvpress leaves set)."""
    kept = []
    for layer in decoder_stack(model).layers:
        attention = layer.self_attn
        keep = torch.ones(1, text_config(model.config).num_key_value_heads, context_length, dtype=torch.bool)
        masked = attention.masked_key_indices
        assert masked is not None, "the press marked nothing: kvpress did not run its compress()"
        keep[masked] = False
        attention.masked_key_indices = None
        kept.append(keep[0])
    return kept


def runtime_kept(cache, context_length: int) -> list[torch.Tensor]:
    """Per layer, bool ``[Hkv, T]``: the context rows kvcal's RaggedCache holds (row 0)."""
    kept = []
    for layer in cache.layers:
        _, _, positions, valid = layer.padded_rows([0])  # [1, Hkv, n]
        keep = torch.zeros(positions.shape[1], context_length, dtype=torch.bool)
        for h in range(positions.shape[1]):
            held = positions[0, h][valid[0, h]]
            keep[h, held[held < context_length]] = True
        kept.append(keep)
    return kept


def run_both(model, tokenizer, pipe, press, context, question, max_new_tokens):
    """kvpress's pipeline with ``press`` and kvcal's runtime with ``press.policy`` on kvpress's token
    ids: (kvpress answer, its kept rows, kvcal answer, its kept rows, kvcal's report, context length)."""
    with torch.no_grad():
        answer = pipe(context, question=question, press=press, max_new_tokens=max_new_tokens)["answer"]
    inputs = pipe.preprocess(context, [question], "", 10**9)
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]  # [1, T], [1, q]
    length = context_ids.shape[1]
    pressed = kvpress_kept(model, length)
    result = generate(
        model,
        torch.cat([context_ids, question_ids], dim=1),
        press.policy,
        context_columns=length,
        calibration=press.calibration,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.eos_token_id,
    )
    ours = tokenizer.decode(result.new_tokens[0], skip_special_tokens=True)
    return answer, pressed, ours, runtime_kept(result.cache, length), result.report, length


def check_same(pressed, kept, press, report, length, ratio):
    budgets = press.head_budgets(length)  # int64 [L, Hkv]
    assert (report.budgets[0] == budgets).all(), "the press and the runtime give the heads other budgets"
    for index, (ours, theirs) in enumerate(zip(kept, pressed, strict=True)):
        for h in range(ours.shape[0]):
            differ = (ours[h] ^ theirs[h]).nonzero().flatten().tolist()
            assert not differ, f"layer {index}, KV head {h}: kept sets differ at context positions {differ[:10]}"
            assert int(theirs[h].sum()) == int(budgets[index, h]), f"layer {index}, head {h}: not its budget"
    layers, heads = budgets.shape
    assert abs(int(budgets.sum()) - (1 - ratio) * layers * heads * length) <= layers * heads  # rounding per head


@pytest.mark.slow
def test_readme_passcode_example_matches_kvcal_runtime(
    embedded_model, embedded_tokenizer, kv_pipeline, calibration, one_thread
):
    """The README's passcode example through kvpress's pipeline: answered, the artifact's INF budgets
    kept per head, the same rows and answer as kvcal's runtime serving inf/leverage."""
    press = CalibratedPress(calibration, compression_ratio=0.75)
    assert press.policy.describe() == parse_policy("inf/leverage").policy(0.75).describe()  # flagship less correction
    answer, pressed, ours, kept, report, length = run_both(
        embedded_model, embedded_tokenizer, kv_pipeline, press, README_CONTEXT, QUESTION, 16
    )
    assert "4821" in answer
    assert answer.strip() == ours.strip()
    budgets = press.head_budgets(length)
    assert len(set(budgets.flatten().tolist())) > 1, "INF budgets that are all equal test nothing per head"
    check_same(pressed, kept, press, report, length, 0.75)


@pytest.mark.parametrize(
    "name, ratio",
    [("curve/keydiff", 0.5), ("inf/snapkv", 0.9), ("uniform/leverage", 0.75)],
)
def test_same_rows_and_answers_as_kvcal_runtime(
    embedded_model, embedded_tokenizer, kv_pipeline, calibration, one_thread, name, ratio
):
    """Other allocations and scorers (the budget curve; SnapKV's last queries, recomputed in the hook;
    Compactor's chunked attention with uniform budgets) on a shorter context."""
    context = FILLER * 8 + "The passcode is 7315. Remember it. " + FILLER * 8
    press = CalibratedPress(calibration, compression_ratio=ratio, policy=parse_policy(name).policy(0.5))
    assert press.policy.compression_ratio == ratio  # the press's ratio replaces the policy's
    answer, pressed, ours, kept, report, length = run_both(
        embedded_model, embedded_tokenizer, kv_pipeline, press, context, QUESTION, 8
    )
    assert answer.strip() == ours.strip()
    check_same(pressed, kept, press, report, length, ratio)


@pytest.mark.parametrize(
    "policy, says",
    [
        ("inf/leverage+correction", "MomentKV correction"),
        ("global/learned", "global"),
        (CompressionPolicy(compression_ratio=0.5, evict_every=16), "decode-time eviction"),
        (CompressionPolicy(compression_ratio=0.5, scorer="snapkv", moment_eviction=True), "moment-informed"),
        (CompressionPolicy(budget=64), "compression_ratio"),
    ],
)
def test_policies_kvpress_cannot_express_are_refused(calibration, policy, says):
    if isinstance(policy, str):
        policy = parse_policy(policy).policy(0.5)
    with pytest.raises(ValueError, match=says) as refused:
        CalibratedPress(calibration, compression_ratio=0.5, policy=policy)
    message = str(refused.value)
    assert "\n" not in message and "kvcal's own runtime" in message


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, float("nan"), True, "0.5", None])
def test_bad_ratios_are_refused(calibration, ratio):
    with pytest.raises(ValueError, match=r"compression_ratio .* in \[0, 1\)"):
        CalibratedPress(calibration, compression_ratio=ratio)


def test_a_calibration_is_required():
    with pytest.raises(ValueError, match="load_calibration"):
        CalibratedPress(None, compression_ratio=0.5)


@pytest.mark.slow
def test_the_readme_kvpress_snippet_runs_verbatim(smoke_artifact, tmp_path):
    """README.md's "Using kvcal from kvpress" snippet, as written, where `make profile` leaves the artifact."""
    text = README.read_text()
    section = text[text.index("## Using kvcal from kvpress") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "CalibratedPress(calibration, compression_ratio=0.75)" in snippet
    (tmp_path / "out").mkdir()
    shutil.copyfile(smoke_artifact, tmp_path / "out" / "kv_calibration.h5")
    done = subprocess.run(
        [sys.executable, "-c", "import torch\ntorch.set_num_threads(1)\n" + snippet],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(README.parent), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4821" in done.stdout.splitlines()[-1], done.stdout
    assert "inf" in done.stdout and "LeverageScorer" in done.stdout  # the flagship less its correction


def test_an_eager_model_is_refused(embedded_model, calibration):
    """kvpress masks rows only in the attention functions it patches; transformers' eager attention
    is not one of them, so an eager model would silently keep every row."""
    press = CalibratedPress(calibration, compression_ratio=0.5)
    config = embedded_model.config
    before = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            press.post_init_from_model(embedded_model)
    finally:
        config._attn_implementation = before
    press.post_init_from_model(embedded_model)  # sdpa: bound
    assert press.head_budgets(100).shape == (config.num_hidden_layers, config.num_key_value_heads)


def test_a_model_without_sdpa_is_sent_to_the_runtime(calibration):
    """gpt-oss (learned attention sinks) has no sdpa attention in transformers: the refusal says to serve it
    with kvcal's runtime, which computes its sinks (tests/test_attention_sinks.py), not to load it with sdpa."""
    from test_attention_sinks import gpt_oss

    model = gpt_oss()
    assert model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"gives GptOssForCausalLM no sdpa attention .*runtime.generate"):
        CalibratedPress(calibration, compression_ratio=0.5).post_init_from_model(model)


def test_a_model_whose_layers_read_another_layers_cache_is_sent_to_the_runtime(calibration):
    """Gemma 3n and Gemma 4 E2B / E4B: their last layers attend to an earlier layer's cache, which kvpress's masks
    (per attention module) would leave whole for them; kvcal's runtime evicts it for every layer reading it
    (tests/test_kv_sharing.py)."""
    from test_architecture_matrix import tiny_model

    model = tiny_model("gemma3n_text", layer_types=["full_attention"] * 4, num_kv_shared_layers=2)
    with pytest.raises(ValueError, match=r"attend to an earlier layer's cache.*runtime.generate"):
        CalibratedPress(calibration, compression_ratio=0.5).post_init_from_model(model)


def test_a_ratio_set_after_construction_is_served(embedded_model, calibration):
    """kvpress's evaluation harness sets ``press.compression_ratio`` on a built press: the press
    serves the new ratio from the next time kvpress enters it, with the artifact's budgets for it."""
    press = CalibratedPress(calibration, compression_ratio=0.5)
    press.post_init_from_model(embedded_model)
    layers, heads = press.head_budgets(1000).shape
    assert abs(int(press.head_budgets(1000).sum()) - 0.5 * layers * heads * 1000) <= layers * heads
    press.compression_ratio = 0.9
    press.post_init_from_model(embedded_model)
    assert press.policy.compression_ratio == 0.9
    assert abs(int(press.head_budgets(1000).sum()) - 0.1 * layers * heads * 1000) <= layers * heads
    press.compression_ratio = 1.0
    with pytest.raises(ValueError, match=r"compression_ratio .* in \[0, 1\)"):
        press.post_init_from_model(embedded_model)


# tiny models whose pre-RoPE queries are not q_proj's alone: (config class, model class, options)
NOT_LLAMA_QUERIES = {
    "stablelm, RoPE on 4 of 16 dimensions": ("StableLmConfig", "StableLmForCausalLM", {"partial_rotary_factor": 0.25}),
    "stablelm qk_layernorm, a LayerNorm per head": (
        "StableLmConfig",
        "StableLmForCausalLM",
        {"partial_rotary_factor": 0.25, "qk_layernorm": True},
    ),
    "cohere use_qk_norm, norm weights per head": ("CohereConfig", "CohereForCausalLM", {"use_qk_norm": True}),
    "hunyuan, a norm after RoPE with a weight": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16}),
    # its checkpoints' RoPE with original_max_position_embeddings 64 (16384 in them): past it the queries are
    # scaled by position (made when the test runs: transformers is imported there)
    "ministral3, queries scaled by position": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        {"rope_parameters": lambda T: dict(T.Ministral3Config().rope_parameters, original_max_position_embeddings=64)},
    ),
    "phi3, queries from a fused qkv_proj": ("Phi3Config", "Phi3ForCausalLM", {}),
    "phi3 with Phi-4-mini's partial RoPE (0.75), fused qkv_proj": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"partial_rotary_factor": 0.75},
    ),
}


def _bias_the_queries(attention) -> None:
    """Give the layer's query rows a bias that grows along them: queries that share a direction, as a
    trained model's do (kvpress's masking needs a key every query ignores; random ones leave none).
    A fused ``qkv_proj`` (Phi-3) holds the queries in its first ``Hq * d`` rows."""
    fused = not hasattr(attention, "q_proj")
    projection = attention.qkv_proj if fused else attention.q_proj
    rows = attention.config.num_attention_heads * attention.head_dim if fused else projection.out_features
    bias = torch.zeros(projection.out_features)
    bias[:rows] = 3 * torch.linspace(-1, 1, rows)
    projection.bias = torch.nn.Parameter(bias)
    after_rope = getattr(attention, "query_layernorm", None)  # HunYuan: weights other than one, so they count
    if after_rope is not None:
        after_rope.weight.copy_(0.5 + torch.rand(after_rope.weight.shape, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("model_name", sorted(NOT_LLAMA_QUERIES))
@pytest.mark.parametrize("name", ["uniform/leverage", "inf/snapkv"])
def test_the_queries_of_a_model_unlike_llama_keep_the_runtimes_rows(embedded_tokenizer, one_thread, name, model_name):
    """StableLM turns a quarter of a head's dimensions and splits them off in its attention's forward,
    not in ``apply_rotary_pos_emb``; with ``qk_layernorm`` it normalises each head with its own
    LayerNorm on ``[B, H, T, d]``; Command R+ (Cohere ``use_qk_norm``) normalises with a weight per
    head on ``[B, T, H, d]``.  The queries the press's hook recomputes (Compactor's chunked attention,
    SnapKV's last queries) are the model's (the geometry's pre-RoPE read, rotated on the dimensions
    RoPE turns), so the press keeps the runtime's rows (tiny random-weight models; refused or
    mis-read before).  Phi-3 and Phi-4-mini project queries, keys and values in one ``qkv_proj``
    (refused before: the press asked for a ``q_proj``); HunYuan normalises after RoPE, its norm's
    weight applied to the rotated queries (refused before); Ministral 3 scales its rotated queries by
    position past ``original_max_position_embeddings`` (missed before)."""
    import numpy as np
    import transformers as T

    from runtime.plan.calibration import Calibration

    config_class, model_class, options = NOT_LLAMA_QUERIES[model_name]
    options = {key: value(T) if callable(value) else value for key, value in options.items()}
    torch.manual_seed(0)
    config = getattr(T, config_class)(
        vocab_size=len(embedded_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=embedded_tokenizer.eos_token_id,
        **options,
    )
    model = getattr(T, model_class)(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            _bias_the_queries(layer.self_attn)
    weights = np.random.default_rng(0).random((2, 2)) + 0.1
    calibration = Calibration("memory.h5", None, {}, ("budgets",), inf_weights=weights / weights.sum())
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=embedded_tokenizer)
    press = CalibratedPress(calibration, compression_ratio=0.75, policy=parse_policy(name).policy(0.5))
    context = FILLER * 4 + "The passcode is 7315. " + FILLER * 4
    answer, pressed, ours, kept, report, length = run_both(model, embedded_tokenizer, pipe, press, context, QUESTION, 4)
    assert answer.strip() == ours.strip()
    check_same(pressed, kept, press, report, length, 0.75)


def test_a_multimodal_checkpoint_keeps_the_runtimes_rows_call_after_call(embedded_tokenizer, one_thread):
    """kvpress runs a multimodal checkpoint's language model (a tiny LLaVA; kvpress names Gemma 3 among the
    models it tests): the press keeps the runtime's rows, and serves a second call with the same press (it
    read the layer count off the top-level config, which a multimodal config does not have: AttributeError)."""
    import numpy as np
    from test_multimodal_checkpoints import multimodal_model

    from runtime.plan.calibration import Calibration

    model = multimodal_model("llava", vocab_size=len(embedded_tokenizer))
    with torch.no_grad():
        for layer in decoder_stack(model).layers:
            _bias_the_queries(layer.self_attn)
    weights = np.random.default_rng(0).random((4, 2)) + 0.1
    calibration = Calibration("memory.h5", None, {}, ("budgets",), inf_weights=weights / weights.sum())
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=embedded_tokenizer)
    press = CalibratedPress(calibration, compression_ratio=0.75, policy=parse_policy("uniform/leverage").policy(0.5))
    for passcode in ("7315", "2290"):
        context = FILLER * 4 + f"The passcode is {passcode}. " + FILLER * 4
        answer, pressed, ours, kept, report, length = run_both(
            model, embedded_tokenizer, pipe, press, context, QUESTION, 4
        )
        assert answer.strip() == ours.strip()
        check_same(pressed, kept, press, report, length, 0.75)


def test_a_context_past_the_attention_chunk_is_refused(embedded_tokenizer, one_thread):
    """Llama 4's chunked layers attend within chunks of ``attention_chunk_size`` positions, which kvcal's
    scores do not compute: a context past the first chunk is refused by name (kvcal's runtime refuses it too)."""
    import numpy as np
    import transformers as T

    from runtime.plan.calibration import Calibration

    torch.manual_seed(0)
    config = T.Llama4TextConfig(
        vocab_size=len(embedded_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        attention_chunk_size=64,
        pad_token_id=embedded_tokenizer.eos_token_id,
    )
    model = T.Llama4ForCausalLM(config).eval()
    weights = np.random.default_rng(0).random((2, 2)) + 0.1
    calibration = Calibration("memory.h5", None, {}, ("budgets",), inf_weights=weights / weights.sum())
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=embedded_tokenizer)
    press = CalibratedPress(calibration, compression_ratio=0.5, policy=parse_policy("uniform/keydiff").policy(0.5))
    with torch.no_grad(), pytest.raises(ValueError, match=r"past the model's attention chunk of 64 positions"):
        pipe(FILLER * 4, question=QUESTION, press=press, max_new_tokens=2)
