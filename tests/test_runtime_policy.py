"""Policy validation, artifact loading and identity checks, and the embedded model end to end."""

from __future__ import annotations

import hashlib
import time
import warnings

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from artifacts import Artifact, ArtifactError, ModelIdentity, Section, write_artifact
from artifacts.fingerprint import architecture_fingerprint, architecture_numbers, tokenizer_fingerprint
from runtime import CompressionPolicy, RaggedCache, answer, generate, load_calibration
from runtime.compression.prefill import prefill
from runtime.compression.prompt_statistics import QueryMoments
from runtime.plan.budgets import allocate_budgets
from runtime.plan.calibration import Calibration, model_weights_fingerprint
from runtime.plan.serving_plan import bind

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def identity_for(model, tokenizer=None, name="tiny") -> ModelIdentity:
    numbers = architecture_numbers(model.config)
    tokenizer_fp = tokenizer_fingerprint(tokenizer) if tokenizer is not None else hashlib.sha256(b"none").hexdigest()
    return ModelIdentity(
        name=name,
        query_norm=False,
        arch_fingerprint=architecture_fingerprint(numbers, False),
        weights_fingerprint=model_weights_fingerprint(model),
        tokenizer_fingerprint=tokenizer_fp,
        **numbers,
    )


def budgets_section(inf_kv: np.ndarray) -> Section:
    tokens = np.array([64, 128], dtype=np.int64)
    tables = np.stack([allocate_budgets(inf_kv, b, 10_000) for b in tokens])
    ratios = np.array([0.25, 0.5])
    ratio_tables = np.stack([r * (0.5 + 0.5 * inf_kv * inf_kv.size) for r in ratios])
    return Section(
        arrays={
            "inf_kv": inf_kv,
            "token_budgets": tokens,
            "token_tables": tables,
            "ratios": ratios,
            "ratio_tables": ratio_tables,
        },
        attrs={"beta": 2.0, "min_budget": 1},
    )


def query_stats_section(mean: np.ndarray, cov: np.ndarray, count: int = 100) -> Section:
    n = np.full(mean.shape[:2], count, dtype=np.int64)
    return Section(arrays={"n": n, "mean": mean.astype(np.float32), "cov": cov.astype(np.float32)}, attrs={"n_sink": 4})


def write_tiny_artifact(path, model, sections=("query_stats", "budgets"), seed=0, job_config=None):
    config = model.config
    layers, heads, kv = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim
    rng = np.random.default_rng(seed)
    parts = {}
    if "query_stats" in sections:
        factor = rng.standard_normal((layers, heads, d, d)) / d
        parts["query_stats"] = query_stats_section(
            rng.standard_normal((layers, heads, d)), factor @ factor.transpose(0, 1, 3, 2)
        )
    if "budgets" in sections:
        weights = rng.random((layers, kv))
        parts["budgets"] = budgets_section(weights / weights.sum())
    if "moments" in sections:
        parts["moments"] = Section(
            arrays={
                "order": rng.integers(-1, 2, (layers, kv)).astype(np.int8),
                "errors": rng.random((1, 3, layers, kv)),
                "reference_ratios": np.array([0.25]),
                "tau": np.zeros((layers, kv)),
            }
        )
    if "learned_scorer" in sections:
        parts["learned_scorer"] = Section(
            arrays={
                "weights": rng.standard_normal((layers, kv, 2 * d)),
                "bias": rng.standard_normal((layers, kv)),
                "ridge": np.full((layers, kv), 0.01),
                "r2": rng.random((layers, kv)),
                "rank_correlation": rng.random((layers, kv)),
            },
            attrs={"features": "kv", "teacher": "kvzip", "fit_tokens": 4096, "held_out_tokens": 1024},
        )
    write_artifact(path, Artifact(model=identity_for(model), config=job_config or {"purpose": "test"}, sections=parts))
    return path


# -- policy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"budget": 0}, r"budget \(tokens per KV head\) must be a positive integer"),
        ({"budget": -5}, r"budget \(tokens per KV head\) must be a positive integer"),
        ({"budget": 2.5}, r"budget \(tokens per KV head\) must be a positive integer, got 2.5"),
        ({"keep_ratio": 0.0}, r"keep_ratio \(fraction kept\) must be in \(0, 1\]"),
        ({"keep_ratio": 1.2}, r"keep_ratio \(fraction kept\) must be in \(0, 1\]"),
        ({"compression_ratio": 1.0}, r"compression_ratio \(fraction evicted\) must be in \[0, 1\)"),
        ({"compression_ratio": -0.1}, r"compression_ratio \(fraction evicted\) must be in \[0, 1\)"),
        ({"compression_ratio": "0.5"}, "compression_ratio must be a number"),
        ({}, "exactly one of compression_ratio"),
        ({"budget": 10, "keep_ratio": 0.5}, "exactly one of compression_ratio.*got budget, keep_ratio"),
        ({"compression_ratio": 0.5, "keep_ratio": 0.5}, "exactly one of compression_ratio"),
        (
            {"keep_ratio": 0.5, "scorer": "h2o"},
            "unknown scorer 'h2o'; known scorers: expected_attention, keydiff, knorm, kvzip, learned, leverage, "
            "prototype_attention, snapkv, streaming",
        ),
        ({"keep_ratio": 0.5, "allocation": "pyramid"}, "unknown allocation"),
        ({"keep_ratio": 0.5, "beta": 0.5}, "beta must be a finite number >= 1"),
        ({"keep_ratio": 0.5, "scorer": "keydiff", "statistics": "prompt"}, "expected_attention scorer only"),
        ({"keep_ratio": 0.5, "statistics": "oracle"}, "unknown statistics"),
        (
            {"keep_ratio": 0.5, "scorer": "snapkv", "scorer_options": {"window": 0}},
            "observation window must be a positive integer",
        ),
        ({"keep_ratio": 0.5, "scorer": "knorm", "scorer_options": {"bogus": 1}}, "bad options"),
        ({"keep_ratio": 0.5, "window": -1}, "window must be an integer >= 0, got -1"),
    ],
)
def test_bad_policies_get_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressionPolicy(**kwargs)


def test_policy_needing_a_missing_section_is_refused(tmp_path):
    model = make_tiny_llama()
    budgets_only = load_calibration(model, path=write_tiny_artifact(tmp_path / "b.h5", model, ("budgets",)))
    stats_only = load_calibration(model, path=write_tiny_artifact(tmp_path / "q.h5", model, ("query_stats",)))
    calibrated = CompressionPolicy(scorer="expected_attention", keep_ratio=0.5, statistics="calibrated")
    with pytest.raises(ValueError, match="needs a calibration artifact"):
        bind(calibrated, None, model)
    with pytest.raises(ValueError, match="has no 'query_stats' section"):
        bind(calibrated, budgets_only, model)
    assert bind(calibrated, stats_only, model).query_stats is not None
    inf = CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="keydiff")
    with pytest.raises(ValueError, match="neither a 'budgets' nor a 'behaviour' section"):
        bind(inf, stats_only, model)
    assert bind(inf, budgets_only, model).inf_weights is not None
    prompt = CompressionPolicy(scorer="expected_attention", keep_ratio=0.5, statistics="prompt")
    assert prompt.missing(None) == [] and bind(prompt, None, model).query_stats is None  # needs nothing


def test_uniform_and_inf_budgets():
    uniform = CompressionPolicy(keep_ratio=0.25, scorer="knorm").head_budgets(1000, 3, 2)
    assert uniform.tolist() == [[250, 250]] * 3
    weights = np.array([[0.5, 0.1], [0.1, 0.1], [0.1, 0.1]])
    inf = CompressionPolicy(budget=100, allocation="inf", beta=2.0, scorer="knorm").head_budgets(1000, 3, 2, weights)
    assert inf.sum() == 600 and inf[0, 0] == 50 + 300 * 0.5  # b_base + B_pool * INF
    tight = CompressionPolicy(budget=100, allocation="inf", min_budget=40, scorer="knorm").head_budgets(
        1000, 3, 2, weights
    )
    assert tight.min() >= 40 and tight.sum() == 600


# -- artifact loading ---------------------------------------------------------------------------


def test_load_calibration_reads_sections_and_finds_the_file_next_to_the_weights(tmp_path):
    model = make_tiny_llama()
    model.save_pretrained(tmp_path / "model")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with pytest.raises(ArtifactError, match="no kv_calibration.h5 found next to the weights"):
        load_calibration(reloaded)
    write_tiny_artifact(tmp_path / "model" / "kv_calibration.h5", reloaded)
    calibration = load_calibration(reloaded)
    assert calibration.path == tmp_path / "model" / "kv_calibration.h5"
    assert calibration.query_mean.shape == (2, 4, 16) and calibration.query_cov.shape == (2, 4, 16, 16)
    assert calibration.inf_weights.shape == (2, 2) and abs(calibration.inf_weights.sum() - 1) < 1e-9
    explicit = load_calibration(reloaded, path=tmp_path / "model")  # a directory holding the file
    np.testing.assert_array_equal(explicit.query_cov, calibration.query_cov)


@pytest.mark.parametrize("given", ["kv_calibration.h5", None, 3])
def test_load_calibration_without_a_model_says_what_it_needs(tmp_path, given):
    """A path (or nothing) where the model goes: one clear TypeError, not an AttributeError from inside."""
    write_tiny_artifact(tmp_path / "kv_calibration.h5", make_tiny_llama())
    argument = str(tmp_path / given) if isinstance(given, str) else given
    with pytest.raises(TypeError, match=r"load_calibration\(model, tokenizer=None, path=...\) needs the loaded model"):
        load_calibration(argument)


def test_artifact_for_another_architecture_is_refused(tmp_path):
    path = write_tiny_artifact(tmp_path / "a.h5", make_tiny_llama(num_layers=2))
    with pytest.raises(ArtifactError, match="another architecture.*num_layers: artifact 2 vs model 3"):
        load_calibration(make_tiny_llama(num_layers=3), path=path)
    with pytest.raises(ArtifactError, match="another architecture"):
        load_calibration(make_tiny_llama(num_layers=2, num_kv_heads=4), path=path, allow_mismatch=True)


def test_weights_mismatch_refused_unless_overridden_then_warned_once(tmp_path):
    path = write_tiny_artifact(tmp_path / "a.h5", make_tiny_llama(seed=0))
    other = make_tiny_llama(seed=1)
    with pytest.raises(ArtifactError, match="different weights.*allow_mismatch=True"):
        load_calibration(other, path=path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_calibration(other, path=path, allow_mismatch=True)
        load_calibration(other, path=path, allow_mismatch=True)
    assert len([w for w in caught if "fingerprint differs" in str(w.message)]) == 1
    # an in-place weight change invalidates the remembered fingerprint
    model = make_tiny_llama(seed=0)
    load_calibration(model, path=path)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    with pytest.raises(ArtifactError, match="different weights"):
        load_calibration(model, path=path)


def test_calibrated_correction_with_another_selection_scorer_warns_once(tmp_path):
    """The moments stage records the selection its orders were calibrated under (job config
    ``moments.selection``); serving them with another scorer warns, once per scorer."""
    model = make_tiny_llama()
    path = write_tiny_artifact(tmp_path / "m.h5", model, ("moments",), job_config={"moments": {"selection": "snapkv"}})
    calibration = load_calibration(model, path=path)
    assert calibration.moment_selection == "snapkv"
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))

    def warnings_from(policy, runs=2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(runs):
                generate(
                    model, ids, policy, calibration=calibration, context_columns=36, max_new_tokens=2, pad_token_id=0
                )
        return [str(w.message) for w in caught if "MomentKV orders" in str(w.message)]

    keydiff = warnings_from(CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="calibrated"))
    assert len(keydiff) == 1
    assert "measured on the tokens 'snapkv' keeps, but the policy evicts with 'keydiff'" in keydiff[0]
    # the remedy keeps the orders there are and adds the policy's scorer
    assert "profile-model --stages moments --moments-selection snapkv,keydiff calibrates them" in keydiff[0]
    # a scorer the moments stage cannot select with: the warning names the ones it can, no call that fails
    (knorm,) = warnings_from(CompressionPolicy(keep_ratio=0.5, scorer="knorm", correction="calibrated"), runs=1)
    assert "--moments-selection" not in knorm and "snapkv, keydiff, learned or leverage" in knorm
    assert warnings_from(CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="calibrated")) == []  # once
    assert warnings_from(CompressionPolicy(keep_ratio=0.5, scorer="snapkv", correction="calibrated")) == []  # matching
    assert (
        warnings_from(CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="order1")) == []
    )  # not calibrated
    # an artifact that does not say which selection its orders came from: nothing to compare
    unknown = load_calibration(model, path=write_tiny_artifact(tmp_path / "u.h5", model, ("moments",)))
    assert unknown.moment_selection is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bind(CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="calibrated"), unknown, model)
    assert not caught
    given = Calibration(
        path="x.h5",
        identity=None,
        config={},
        sections=("moments",),
        moment_selection="keydiff",
        moment_orders=np.zeros((2, 2), np.int8),
        moment_tau=np.zeros((2, 2)),
    )
    with pytest.warns(UserWarning, match="evicts with 'expected_attention'"):
        policy = CompressionPolicy(
            scorer="expected_attention", keep_ratio=0.5, correction="calibrated", statistics="prompt"
        )
        bind(policy, given, model)


def test_compress_with_inf_calibration_needs_artifact_inf_weights():
    model = make_tiny_llama()
    cache = RaggedCache.for_model(model)
    policy = CompressionPolicy(budget=4, allocation="inf", scorer="knorm")
    prefill(model, cache, torch.arange(12).unsqueeze(0), policy=policy)
    from runtime.compression.prefill import compress

    with pytest.raises(ValueError, match="needs a calibration artifact"):
        compress(model, cache, policy, None)
    empty = Calibration(path="x.h5", identity=None, config={}, sections=())
    with pytest.raises(ValueError, match="neither a 'budgets' nor a 'behaviour'"):
        compress(model, cache, policy, empty)


# -- the embedded model end to end --------------------------------------------------------------

HAYSTACK = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ") * 12


@pytest.fixture(scope="module")
def embedded_artifact(embedded_model, embedded_tokenizer, tmp_path_factory):
    """A real artifact for the embedded model: query statistics measured on haystack text."""
    model, tokenizer = embedded_model, embedded_tokenizer
    ids = tokenizer(HAYSTACK * 2, return_tensors="pt")["input_ids"]
    stats = QueryMoments.for_prompt(model, 1)
    with stats.collect(model), torch.no_grad():
        model(ids)
    mean, cov = stats.mean_cov(0)
    config = model.config
    weights = np.random.default_rng(0).random((config.num_hidden_layers, config.num_key_value_heads)) + 0.5
    artifact = Artifact(
        model=identity_for(model, tokenizer, "SmolLM2-135M-Instruct"),
        config={"text": "haystack"},
        sections={
            "query_stats": query_stats_section(mean.numpy(), cov.numpy(), ids.shape[1]),
            "budgets": budgets_section(weights / weights.sum()),
        },
    )
    path = tmp_path_factory.mktemp("embedded") / "kv_calibration.h5"
    write_artifact(path, artifact)
    return path


def test_embedded_artifact_loads_fast_and_checks_identity(embedded_model, embedded_tokenizer, embedded_artifact):
    load_calibration(embedded_model, embedded_tokenizer, path=embedded_artifact)  # fingerprints computed once
    timings = []
    for _ in range(5):  # the fastest of five: the machine is shared, the file is not cached by us
        started = time.perf_counter()
        calibration = load_calibration(embedded_model, embedded_tokenizer, path=embedded_artifact)
        timings.append(time.perf_counter() - started)
    assert min(timings) < 0.05, f"loading took {min(timings) * 1000:.1f} ms at best"
    assert calibration.query_cov.shape == (30, 9, 64, 64)
    bad_tokenizer = type(
        "Tokenizer",
        (),
        {
            "get_vocab": lambda self: {"a": 0},
            "added_tokens_decoder": {},
            "special_tokens_map": {},
            "chat_template": None,
        },
    )()
    with pytest.raises(ArtifactError, match="different tokenizer"):
        load_calibration(embedded_model, bad_tokenizer, path=embedded_artifact)


@pytest.mark.slow
def test_embedded_model_answers_through_compressed_cache(embedded_model, embedded_tokenizer, embedded_artifact):
    """Question-agnostic compression on the real model: KeyDiff with INF budgets at half the
    context on a batch of two (same answers as one by one); EA with the artifact's calibrated
    statistics keeping 95% (at 90% the 135M model loses a digit of Bob's number with the probes'
    context/question split; it kept it with the split one token earlier, before the separator's
    first newline).  Question-aware: SnapKV observing the question, keeping 75%."""
    model, tokenizer = embedded_model, embedded_tokenizer
    calibration = load_calibration(model, tokenizer, path=embedded_artifact)
    previous = model.config._attn_implementation
    contexts = [
        HAYSTACK[:400] + "The special magic number for Alice is 4721. " + HAYSTACK[:300],
        HAYSTACK[:200] + "The special magic number for Bob is 3308. " + HAYSTACK[:500],
    ]
    questions = ["What is the special magic number for Alice?", "What is the special magic number for Bob?"]
    half = CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="keydiff")
    try:
        texts = answer(model, tokenizer, contexts, questions, half, calibration=calibration, max_new_tokens=12)
        single = answer(model, tokenizer, contexts[1], questions[1], half, calibration=calibration, max_new_tokens=12)
        calibrated = answer(
            model,
            tokenizer,
            contexts,
            questions,
            CompressionPolicy(scorer="expected_attention", keep_ratio=0.95, statistics="calibrated"),
            calibration=calibration,
            max_new_tokens=12,
        )
        aware = answer(
            model,
            tokenizer,
            contexts[0],
            questions[0],
            CompressionPolicy(keep_ratio=0.75, scorer="snapkv", scorer_options={"window": 16, "kernel": 1}),
            question_aware=True,
            max_new_tokens=12,
        )
    finally:
        model.set_attn_implementation(previous)
    assert "4721" in texts[0] and "3308" in texts[1], texts
    assert single == texts[1]
    assert "4721" in calibrated[0] and "3308" in calibrated[1], calibrated
    assert "4721" in aware, aware  # question-aware: the question's own queries pick the needle


def test_embedded_prompt_statistics_equal_direct_computation(embedded_model, embedded_tokenizer):
    """Prompt statistics (EA 'prompt'): per-row pre-RoPE query mean/covariance from q_proj,
    padding and the n_sink first tokens left out, equal float64 statistics computed directly."""
    model, tokenizer = embedded_model, embedded_tokenizer
    rows = [tokenizer(HAYSTACK[:300])["input_ids"], tokenizer(HAYSTACK[100:260])["input_ids"]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    captured = {}
    layer = 7

    def capture(module, inputs, output):
        captured["q"] = output.detach().double()

    hook = model.model.layers[layer].self_attn.q_proj.register_forward_hook(capture)
    policy = CompressionPolicy(scorer="expected_attention", keep_ratio=0.5, statistics="prompt", n_sink=4)
    previous = model.config._attn_implementation
    try:
        stats = prefill(model, RaggedCache.for_model(model), ids, mask, policy=policy)
    finally:
        hook.remove()
        model.set_attn_implementation(previous)
    for b, row in enumerate(rows):
        queries = captured["q"][b, width - len(row) + 4 :].reshape(-1, 9, 64)  # real tokens after the sinks
        mean, cov = stats.mean_cov(b)
        expected_mean = queries.mean(0)
        centred = queries - expected_mean
        expected_cov = torch.einsum("thd,the->hde", centred, centred) / queries.shape[0]
        torch.testing.assert_close(mean[layer], expected_mean, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cov[layer], expected_cov, atol=1e-3, rtol=1e-4)


def test_a_calibration_left_open_at_exit_prints_nothing(smoke_artifact):
    """Regression: the reader's __del__ ran h5py's close() during interpreter shutdown and
    printed 'Exception ignored ... TypeError' after every script that kept a Calibration."""
    import subprocess
    import sys

    script = (
        "from runtime import load_calibration\n"
        "from common.models import load_model, load_tokenizer\n"
        "model, tokenizer = load_model(), load_tokenizer()\n"
        f"calibration = load_calibration(model, tokenizer, path={str(smoke_artifact)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "field, value",
    [
        ("compression_ratio", np.int64(0)),
        ("compression_ratio", np.int32(0)),
        ("compression_ratio", np.float32(0.5)),
        ("compression_ratio", np.float16(0.25)),
        ("keep_ratio", np.int64(1)),
        ("keep_ratio", np.uint8(1)),
        ("keep_ratio", np.float32(0.5)),
    ],
    ids=repr,
)
def test_numpy_integer_and_float_ratios_are_numbers(field, value):
    """Issue 41: np.int64(0) and np.float32(0.5) were refused as "not a number" where float64 passed."""
    policy = CompressionPolicy(**{field: value}, scorer="knorm")
    assert policy == CompressionPolicy(**{field: float(value)}, scorer="knorm")
    assert type(getattr(policy, field)) is float


@pytest.mark.parametrize("value", [True, np.bool_(False), np.bool_(True), "0.5", [0.5]])
def test_a_bool_or_a_non_number_ratio_is_still_refused(value):
    for field in ("compression_ratio", "keep_ratio"):
        with pytest.raises(ValueError, match=f"{field} must be a number"):
            CompressionPolicy(**{field: value})


def test_the_old_ratio_spelling_is_refused_with_both_new_names():
    with pytest.raises(TypeError, match=r"keep_ratio=.*compression_ratio=.*ratio=0.25 is keep_ratio=0.25"):
        CompressionPolicy(ratio=0.25)


def test_compression_ratio_and_keep_ratio_are_complements():
    evict = CompressionPolicy(compression_ratio=0.75, scorer="knorm")
    keep = CompressionPolicy(keep_ratio=0.25, scorer="knorm")
    assert evict.kept_fraction == pytest.approx(0.25) and keep.evicted_fraction == pytest.approx(0.75)
    assert np.array_equal(evict.head_budgets(1000, 3, 2), keep.head_budgets(1000, 3, 2))
    assert np.all(evict.head_budgets(1000, 3, 2) == 250)
    assert "compression_ratio=0.75" in evict.describe()


def test_the_default_policy_needs_no_artifact_and_blends_leverage_by_the_compression_ratio():
    policy = CompressionPolicy(compression_ratio=0.75)
    assert policy.scorer == "leverage" and policy.allocation == "uniform" and policy.needs_calibration() == []
    assert policy.missing(None) == []
    assert policy.build_scorer().blend == pytest.approx(0.75)  # kvpress CompactorPress's choice
    assert CompressionPolicy(budget=64).build_scorer().blend == pytest.approx(0.5)  # no ratio: the paper's 0.5
    explicit = CompressionPolicy(compression_ratio=0.75, scorer_options={"blend": 0.2})
    assert explicit.build_scorer().blend == pytest.approx(0.2)
