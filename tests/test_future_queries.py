"""Future-query statistics (section ``future_queries``) and the ``prototype_attention`` scorer:
against direct float64 references, through the artifact, the policy grammar and the runtime."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from scorer_oracles import Head, head_from_cache, oracle_score, score_one
from test_runtime_scorers import direct_expected_attention, explicit_rope

from profiler.future_queries import kmeans_centres, probe_future_queries
from runtime import CompressionPolicy, RaggedCache
from runtime.compression.prefill import prefill
from runtime.kv_store.transformers_compat import cache_argument
from runtime.math.geometry import ModelGeometry
from runtime.math.rope import averaged_rope
from runtime.plan.calibration import Calibration
from runtime.plan.policy_spec import parse_policy
from runtime.scorers import ExpectedAttentionScorer, PrototypeAttentionScorer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


# -- k-means ------------------------------------------------------------------------------------


def test_kmeans_recovers_separated_clusters_with_their_weights():
    rng = np.random.default_rng(0)
    true = np.array([[10.0, 0, 0], [0, 10.0, 0], [0, 0, 10.0]])
    sizes = [50, 30, 20]
    points = np.concatenate([c + 0.1 * rng.standard_normal((m, 3)) for c, m in zip(true, sizes, strict=True)])
    heads = np.stack([points, points[::-1] * 2.0])  # two heads at once, different data
    centres, weights = kmeans_centres(heads, 3, seed=1)
    for h, scale in ((0, 1.0), (1, 2.0)):
        for c, m in zip(true * scale, sizes, strict=True):
            nearest = int(np.argmin(((centres[h] - c) ** 2).sum(-1)))
            assert np.linalg.norm(centres[h, nearest] - c) < 0.1 * scale
            assert weights[h, nearest] == pytest.approx(m / 100)
    np.testing.assert_allclose(weights.sum(-1), 1.0)


def test_kmeans_with_one_centre_is_the_mean_and_is_deterministic():
    x = np.random.default_rng(3).standard_normal((4, 40, 5))
    centres, weights = kmeans_centres(x, 1)
    np.testing.assert_allclose(centres[:, 0], x.mean(1), atol=1e-12)
    np.testing.assert_array_equal(weights, np.ones((4, 1)))
    again = kmeans_centres(x, 3, seed=5)
    np.testing.assert_array_equal(kmeans_centres(x, 3, seed=5)[0], again[0])


def test_kmeans_refuses_bad_input():
    with pytest.raises(ValueError, match="heads, N, d"):
        kmeans_centres(np.zeros((3, 4)), 2)
    with pytest.raises(ValueError, match="at least one query"):
        kmeans_centres(np.zeros((1, 0, 4)), 2)
    with pytest.raises(ValueError, match="positive integer"):
        kmeans_centres(np.zeros((1, 5, 4)), 0)


def test_kmeans_with_more_centres_than_distinct_queries_keeps_weights_summing_to_one():
    x = np.zeros((1, 6, 2))
    x[0, 3:] = 1.0
    centres, weights = kmeans_centres(x, 4)
    assert np.all(np.isfinite(centres))
    assert weights.sum() == pytest.approx(1.0)


# -- the scorer -----------------------------------------------------------------------------------


def direct_prototypes(keys, values, centres, weights, start, horizon, theta, scaling, reduce, group, epsilon=0.0):
    """The scorer's definition written out in float64: explicit RoPE matrices, one softmax per
    (query head, centre), max or weighted mean over centres, then mean or max over the group."""
    d = keys.shape[1]
    rbar = sum(explicit_rope(p, d, theta) for p in range(start, start + horizon)) / horizon
    keys, values = keys.double(), values.double()
    per_head = []
    for g in range(centres.shape[0]):
        per_centre = []
        for k in range(centres.shape[1]):
            c = rbar @ centres[g, k].double()
            per_centre.append(torch.softmax(torch.stack([scaling * c @ key for key in keys]), dim=0))
        stacked = torch.stack(per_centre)  # [K, n]
        if reduce == "max":
            per_head.append(stacked.max(0).values)
        else:
            per_head.append((stacked * weights[g].double()[:, None]).sum(0))
    heads = torch.stack(per_head)
    attention = heads.max(0).values if group == "max" else heads.mean(0)
    return (attention + epsilon) * values.norm(dim=-1)


@pytest.mark.parametrize("reduce,group", [("max", "mean"), ("mean", "mean"), ("max", "max")])
def test_prototype_attention_equals_direct_formula(reduce, group):
    model = make_tiny_llama(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    theta = model.config.rope_parameters["rope_theta"]
    generator = torch.Generator().manual_seed(4)
    n, d, groups, k = 23, 16, 2, 3
    keys, values = torch.randn(n, d, generator=generator), torch.randn(n, d, generator=generator)
    centres = 2 * torch.randn(groups, k, d, generator=generator)
    weights = torch.softmax(torch.randn(groups, k, generator=generator), -1)
    start, horizon, scaling = 40, 16, 1 / math.sqrt(d)
    cos, sin = averaged_rope(model, start, horizon)
    head = Head(
        layer=0,
        kv_head=0,
        keys=keys,
        values=values,
        positions=torch.arange(n),
        scaling=scaling,
        next_position=start,
        rope_cos=cos,
        rope_sin=sin,
        query_centres=centres,
        centre_weights=weights,
    )
    scorer = PrototypeAttentionScorer(horizon=horizon, centres=reduce, group=group, epsilon=1e-2)
    expected = direct_prototypes(keys, values, centres, weights, start, horizon, theta, scaling, reduce, group, 1e-2)
    torch.testing.assert_close(score_one(scorer, head).double(), expected, rtol=1e-4, atol=1e-6)


def test_one_centre_with_mixture_reduction_is_expected_attention_without_covariance():
    model = make_tiny_llama(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    theta = model.config.rope_parameters["rope_theta"]
    generator = torch.Generator().manual_seed(8)
    keys, values = torch.randn(19, 16, generator=generator), torch.randn(19, 16, generator=generator)
    mean = torch.randn(2, 16, generator=generator)
    cos, sin = averaged_rope(model, 30, 8)
    head = Head(0, 0, keys, values, torch.arange(19), 0.25, 30, rope_cos=cos, rope_sin=sin)
    head.query_centres, head.centre_weights = mean[:, None], torch.ones(2, 1)
    expected = direct_expected_attention(keys, values, mean, torch.zeros(2, 16, 16), 30, 8, theta, 0.25, epsilon=0.0)
    torch.testing.assert_close(
        score_one(PrototypeAttentionScorer(horizon=8, centres="mean", group="mean"), head).double(),
        expected,
        rtol=1e-4,
        atol=1e-6,
    )


def test_prototype_attention_refuses_bad_options_and_missing_centres():
    with pytest.raises(ValueError, match="'max' or 'mean'"):
        PrototypeAttentionScorer(centres="median")
    with pytest.raises(ValueError, match="'max' or 'mean'"):
        PrototypeAttentionScorer(group="sum")
    with pytest.raises(ValueError, match="future_queries"):
        score_one(PrototypeAttentionScorer(), Head(0, 0, torch.zeros(3, 4), torch.zeros(3, 4), torch.arange(3), 1, 3))
    with pytest.raises(ValueError, match="'calibrated', 'future' or 'prompt'"):
        ExpectedAttentionScorer(statistics="question")


def _future_calibration(model, centres: int = 3, seed: int = 0) -> Calibration:
    """A calibration holding only a ``future_queries`` section of random (valid) statistics."""
    geometry = ModelGeometry.of(model)
    rng = np.random.default_rng(seed)
    L, H, d = geometry.num_layers, geometry.num_q_heads, geometry.head_dim
    factor = rng.standard_normal((L, H, d, d)) / d
    weights = rng.random((L, H, centres)) + 0.1
    future = {
        "mean": rng.standard_normal((L, H, d)).astype(np.float32),
        "cov": (factor @ np.swapaxes(factor, -1, -2)).astype(np.float32),
        "centres": (2 * rng.standard_normal((L, H, centres, d))).astype(np.float32),
        "centre_weights": weights / weights.sum(-1, keepdims=True),
    }
    return Calibration("memory.h5", None, {}, ("future_queries",), future=future)  # no identity: arrays only


@torch.no_grad()
@pytest.mark.parametrize(
    "scorer,options",
    [
        ("prototype_attention", {}),
        ("prototype_attention", {"scorer_options": {"centres": "mean", "group": "max", "pool": 3}}),
        ("expected_attention", {"statistics": "future"}),
    ],
)
def test_layer_scores_equal_the_per_head_oracles(scorer, options):
    """As tests/test_runtime_scorers.py checks for the other scorers: two left-padded rows of
    different lengths, heads made ragged by a first eviction, batched == the per-head oracle."""
    from runtime.compression.eviction import HeadEvictor
    from runtime.plan.serving_plan import bind

    model = make_tiny_llama(num_layers=2, num_heads=6, num_kv_heads=3)
    calibration = _future_calibration(model)
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 128, (2, 48), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    policy = CompressionPolicy(keep_ratio=0.5, scorer=scorer, **options)
    cache = RaggedCache.for_model(model)
    prefill(model, cache, ids, mask, policy=policy)
    evictor = HeadEvictor(bind(policy, calibration, model))
    positions = cache.layers[0].real_seen
    for index, layer in enumerate(cache.layers):
        evictor.evict_layer(layer, index, [0, 1], torch.tensor([[40, 31, 44], [35, 39, 22]]), positions)
    for index, layer in enumerate(cache.layers):
        batched = evictor.layer_scores(layer, index, [0, 1], positions)
        for b in range(2):
            for h in range(3):
                head = head_from_cache(evictor.scorer, model, layer, index, b, h, positions[b], calibration=calibration)
                single = oracle_score(evictor.scorer, head)
                n = single.shape[0]
                torch.testing.assert_close(batched[b, h, :n], single.float(), atol=1e-5, rtol=1e-4)
                assert bool(torch.isneginf(batched[b, h, n:]).all())


def test_policies_spell_future_statistics_and_prototypes_and_refuse_without_the_section():
    spec = parse_policy("uniform/expected_attention:future")
    assert spec.policy(0.5).build_scorer().statistics == "future"
    assert isinstance(parse_policy("inf/prototype_attention").policy(0.75).build_scorer(), PrototypeAttentionScorer)
    with pytest.raises(ValueError, match="statistics applies to the expected_attention scorer only"):
        parse_policy("uniform/prototype_attention:future")
    other = Calibration("other.h5", SimpleNamespace(num_layers=2, num_q_heads=4), {}, ("query_stats",))
    other._query_mean = np.zeros(1)  # has query_stats, not future_queries
    for text in ("uniform/expected_attention:future", "uniform/prototype_attention"):
        policy = parse_policy(text).policy(0.5)
        assert any("future_queries" in need for need in policy.needs_calibration())
        (reason,) = policy.missing(other)
        assert re.search("no 'future_queries' section.*future-queries stage", reason)
        (reason,) = policy.missing(None)
        assert "needs a calibration artifact" in reason


# -- recording the future queries -------------------------------------------------------------------


def test_probe_future_queries_are_the_queries_after_the_context_and_of_the_answer():
    """Against an independent capture: one forward pass over the prompt and the greedy answer."""
    from needles.probe import Probe

    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    geometry = ModelGeometry.of(model)
    ids = torch.randint(1, 128, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    probe = Probe("p", "retrieval", 30, 50.0, 0, "q?", "a", ids, [], context_end=22)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    queries = probe_future_queries(model, tokenizer, geometry, probe, max_new_tokens=5)
    with torch.no_grad():
        answer = model.generate(
            torch.tensor([ids]), max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=None
        )[0]
    fed = answer[:-1]  # the last generated token is never fed back
    seen = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: seen.append(out.detach())) for m in _model_query_modules(model)
    ]
    try:
        with torch.no_grad():
            model(fed[None])
    finally:
        for handle in handles:
            handle.remove()
    direct = torch.stack([q[0].reshape(len(fed), 4, 16) for q in seen], dim=1)[22:]  # [T, L, Hq, d]
    assert queries.shape == (len(fed) - 22, 2, 4, 16) == tuple(direct.shape)
    np.testing.assert_allclose(queries, direct.numpy(), rtol=1e-4, atol=1e-5)


# -- the artifact section ------------------------------------------------------------------------------


def test_future_queries_section_round_trips_and_a_1_2_reader_skips_it(tmp_path, monkeypatch):
    """The section is read back bit for bit; a reader of schema 1.2 (which knows no future_queries)
    opens the 1.3 file and verifies both metadata digests, since no digest covers the section."""
    import h5py
    from conftest import make_random_artifact

    from artifacts import open_artifact, reader, write_artifact
    from artifacts.schema import SECTIONS

    artifact = make_random_artifact()
    path = write_artifact(tmp_path / "f.h5", artifact)
    with open_artifact(path) as opened:
        assert opened.schema_version == "1.6" and "future_queries" in opened.sections  # the newest; 1.3 added it
        for name, array in artifact.sections["future_queries"].arrays.items():
            np.testing.assert_array_equal(opened.read("future_queries", name), array)
    with h5py.File(path, "r") as h5:
        assert dict(h5["future_queries"].attrs) == {}
    monkeypatch.setattr(reader, "SCHEMA_MINOR", 2)
    monkeypatch.setattr(reader, "SECTIONS", {k: v for k, v in SECTIONS.items() if k != "future_queries"})
    with reader.open_artifact(path) as old:
        assert "future_queries" not in old.sections and "recommendation" in old.sections


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda s: s["centre_weights"].__imul__(0.5), r"centre_weights: layer 0, query head 0 sums to 0.5"),
        (lambda s: s["cov"].__setitem__((0, 1, 0, 0), -50.0), r"/future_queries/cov: layer 0, query head 1 is not"),
        (lambda s: s["centres"].__setitem__((1, 0, 0, 0), np.inf), r"NaN or infinite"),
    ],
)
def test_a_damaged_future_queries_section_is_refused(tmp_path, damage, message):
    from conftest import make_random_artifact

    from artifacts import ArtifactError, write_artifact

    artifact = make_random_artifact()
    damage(artifact.sections["future_queries"].arrays)
    with pytest.raises(ArtifactError, match=message):
        write_artifact(tmp_path / "bad.h5", artifact)


# -- the real embedded model --------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_keeps_the_needle_under_prototype_attention(embedded_model, embedded_tokenizer):
    """Centres fitted on the future queries of four profiling-seed retrieval probes (what the
    future-queries stage records) let a 1K-token probe of an unseen seed keep its answer at half
    the cache with uniform budgets, question-agnostic."""
    from needles import PRESETS, answer_is_correct, generate_probes
    from runtime import ragged_attention
    from runtime.compression.prefill import compress
    from runtime.compression.prompt_statistics import QueryMoments

    model, tokenizer = embedded_model, embedded_tokenizer
    geometry = ModelGeometry.of(model)
    seen = PRESETS["quick"].replace(families=("retrieval",), lengths=(1024,), depths=(25.0, 75.0), count=2, seed=0)
    queries = np.concatenate(
        [probe_future_queries(model, tokenizer, geometry, probe, 24) for probe in generate_probes(seen, tokenizer)]
    )  # [N, L, Hq, d]
    L, H, d = queries.shape[1:]
    moments = QueryMoments(L, H, d)
    for layer in range(L):
        moments.add(layer, queries[:, layer])
    stats = moments.finalize()
    centres, weights = kmeans_centres(queries.reshape(-1, L * H, d).transpose(1, 0, 2), 4)
    future = {**stats, "centres": centres.reshape(L, H, 4, d), "centre_weights": weights.reshape(L, H, 4)}
    calibration = Calibration("memory.h5", None, {}, ("future_queries",))
    calibration._future = {key: future[key] for key in ("mean", "cov", "centres", "centre_weights")}

    spec = PRESETS["quick"].replace(families=("retrieval",), seed=1000)
    probe = next(p for p in generate_probes(spec, tokenizer) if p.length <= 1024 and p.depth == 50.0)
    ids = torch.tensor([probe.input_ids])
    policy = parse_policy("uniform/prototype_attention").policy(0.5)
    with ragged_attention(model):
        cache = RaggedCache.for_model(model)
        prefill(model, cache, ids[:, : probe.context_end], policy=policy)
        report = compress(model, cache, policy, calibration)
        assert report.kv_bytes_after <= 0.55 * report.kv_bytes_before
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **cache_argument(model, cache),
            do_sample=False,
            max_new_tokens=20,
            pad_token_id=tokenizer.eos_token_id,
        )
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer_is_correct(text, probe), (probe.answer, text)


def _model_query_modules(model):
    """Each layer's module whose output is the pre-RoPE query in [B, T, ...] order, read off the model
    itself (q_norm where there is one, Llama / Qwen3), independently of runtime.math.geometry."""
    return [
        layer.self_attn.q_norm if hasattr(layer.self_attn, "q_norm") else layer.self_attn.q_proj
        for layer in model.model.layers
    ]
