"""bind(policy, calibration, model) -> ServingPlan: one check, one load, one warning, before any forward pass."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from test_runtime_policy import write_tiny_artifact

from runtime import CompressionPolicy, RaggedCache, bind, compress_prompt, generate
from runtime.compression.prefill import compress, prefill
from runtime.plan.calibration import Calibration, load_calibration
from runtime.plan.policy import REQUIREMENTS
from runtime.plan.serving_plan import _LOADERS, ServingPlan

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

L, HQ, HKV, D, K = 2, 4, 2, 16, 3  # make_tiny_llama()'s shape; K future-query centres


def _arrays(layers=L, q_heads=HQ, kv_heads=HKV, d=D, seed=0) -> dict:
    """Every section's serving arrays, valid for a model of the given shape."""
    rng = np.random.default_rng(seed)
    factor = rng.standard_normal((layers, q_heads, d, d)) / d
    cov = (factor @ np.swapaxes(factor, -1, -2)).astype(np.float32)
    weights = rng.random((layers, kv_heads))
    centre_weights = rng.random((layers, q_heads, K)) + 0.1
    return {
        "inf_weights": weights / weights.sum(),
        "budget_curve": (np.array([0.5, 0.75]), np.stack([np.full((layers, kv_heads), 0.5)] * 2)),
        "query_mean": rng.standard_normal((layers, q_heads, d)).astype(np.float32),
        "query_cov": cov,
        "future": {
            "mean": rng.standard_normal((layers, q_heads, d)).astype(np.float32),
            "cov": cov,
            "centres": rng.standard_normal((layers, q_heads, K, d)).astype(np.float32),
            "centre_weights": centre_weights / centre_weights.sum(-1, keepdims=True),
        },
        "moment_orders": rng.integers(-1, 2, (layers, kv_heads)).astype(np.int8),
        "moment_tau": np.zeros((layers, kv_heads)),
        "scorer_weights": rng.standard_normal((layers, kv_heads, 2 * d)),
        "scorer_bias": rng.standard_normal((layers, kv_heads)),
    }


# section -> (a policy that reads it, the Calibration fields that hold it)
NEEDS = {
    "budgets": (CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="keydiff"), ("inf_weights",)),
    "budget_curves": (CompressionPolicy(keep_ratio=0.5, allocation="curve", scorer="keydiff"), ("budget_curve",)),
    "query_stats": (
        CompressionPolicy(keep_ratio=0.5, scorer="expected_attention", statistics="calibrated"),
        ("query_mean", "query_cov"),
    ),
    "future_queries": (CompressionPolicy(keep_ratio=0.5, scorer="prototype_attention"), ("future",)),
    "moments": (
        CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="calibrated"),
        ("moment_orders", "moment_tau"),
    ),
    "learned_scorer": (CompressionPolicy(keep_ratio=0.5, scorer="learned"), ("scorer_weights", "scorer_bias")),
}


def _calibration(fields: dict, sections=()) -> Calibration:
    return Calibration("memory.h5", None, {}, tuple(sections), **fields)


def test_every_section_a_policy_can_need_is_stated_once_and_loaded_by_bind():
    assert [requirement.section for requirement in REQUIREMENTS] == list(NEEDS)
    assert set(_LOADERS) == set(NEEDS)


@pytest.mark.parametrize("section", list(NEEDS))
def test_missing_names_each_absent_section_and_nothing_when_it_is_there(section):
    policy, fields = NEEDS[section]
    arrays = _arrays()
    others = {name: value for name, value in arrays.items() if name not in fields}
    without = _calibration(others, sections=("behaviour",))
    (reason,) = policy.missing(without)
    assert f"'{section}'" in reason and "memory.h5" in reason and "present: behaviour" in reason
    (reason,) = policy.missing(None)
    assert "needs a calibration artifact for" in reason and f"'{section}'" in reason
    assert policy.needs_calibration() == [next(r.need for r in REQUIREMENTS if r.section == section)]
    assert policy.missing(_calibration(arrays, sections=(section,))) == []
    model = make_tiny_llama()
    with pytest.raises(ValueError) as refused:  # bind refuses with missing()'s first sentence, verbatim
        bind(policy, without, model)
    assert str(refused.value) == policy.missing(without)[0]


def test_missing_lists_every_absent_section_in_order_and_the_default_policy_needs_none():
    policy = CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="learned", correction="calibrated")
    reasons = policy.missing(_calibration({}, sections=()))
    assert [r.split(" needs")[0] for r in reasons] == [
        "allocation='inf'",
        "correction='calibrated'",
        "the learned scorer",
    ]
    assert CompressionPolicy(compression_ratio=0.75).missing(None) == []


def test_bind_loads_every_tensor_the_policy_reads_shaped_for_the_model():
    model = make_tiny_llama()
    calibration = _calibration(_arrays(), sections=tuple(NEEDS))
    policy = CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="learned", correction="calibrated", tau=0.5)
    plan = bind(policy, calibration, model)
    assert isinstance(plan, ServingPlan) and plan.policy is policy and plan.calibration is calibration
    assert plan.inf_weights.shape == (L, HKV) and plan.budget_curve is None and plan.query_stats is None
    weights, bias = plan.learned
    assert tuple(weights.shape) == (L, HKV, 2 * D) and weights.dtype == torch.float32 and bias.shape == (L, HKV)
    orders, tau = plan.corrections
    np.testing.assert_array_equal(orders, calibration.moment_orders)
    assert orders.dtype == np.int8 and tau.dtype == np.float32 and np.all(tau == 0.5)  # the policy's tau wins
    np.testing.assert_array_equal(plan.head_budgets(100), policy.head_budgets(100, L, HKV, calibration.inf_weights))
    centres = bind(NEEDS["future_queries"][0], calibration, model).query_centres
    assert tuple(centres[0].shape) == (L, HKV, HQ // HKV, K, D) and tuple(centres[1].shape) == (L, HKV, HQ // HKV, K)
    mean, cov = bind(NEEDS["query_stats"][0], calibration, model).query_stats
    assert tuple(mean.shape) == (L, HQ, D) and tuple(cov.shape) == (L, HQ, D, D)
    order1 = bind(CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="order1"), None, model)
    assert np.all(order1.corrections[0] == 1) and np.all(order1.corrections[1] == 0)
    assert bind(CompressionPolicy(keep_ratio=0.5), None, model).corrections is None


class ForwardCounter:
    """Counts the model's forward passes (a forward pre-hook on the decoder)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1


# section -> what a calibration of a 3-layer model holds there, and the error bind gives a 2-layer one
OTHER_SHAPE = {
    "budgets": "INF weights have shape \\(3, 2\\), the model has \\[2, 2\\] KV heads",
    "budget_curves": "the budget curve has shape \\(3, 2\\), the model \\[2, 2\\] KV heads",
    "query_stats": "calibration statistics do not match the model's layers / query heads",
    "future_queries": "future-query centres of shape \\(3, 4, 3, 16\\) do not fit the model",
    "moments": "the artifact's moments section has shape \\(3, 2\\), the model \\(2, 2\\)",
    "learned_scorer": "learned scorer weights of shape \\(3, 2, 32\\).*do not fit the model",
}


@pytest.mark.parametrize("section", list(NEEDS))
def test_a_calibration_of_another_model_shape_is_refused_before_any_forward_pass(section):
    model = make_tiny_llama()
    other = _calibration(_arrays(layers=3), sections=tuple(NEEDS))  # no identity: only the arrays tell
    policy = NEEDS[section][0]
    with pytest.raises(ValueError, match=OTHER_SHAPE[section]):
        bind(policy, other, model)
    counter = ForwardCounter(model)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=OTHER_SHAPE[section]):
        compress_prompt(model, ids, policy, calibration=other, context_columns=36, block_size=8)
    assert counter.calls == 0


def test_an_artifact_of_another_architecture_is_refused_before_any_forward_pass(tmp_path):
    profiled = make_tiny_llama(num_layers=3)
    calibration = load_calibration(profiled, path=write_tiny_artifact(tmp_path / "x.h5", profiled, ("budgets",)))
    model = make_tiny_llama()
    counter = ForwardCounter(model)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    policy = CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="keydiff")
    with pytest.raises(ValueError, match="was made for another architecture.*num_layers: artifact 3 vs model 2"):
        generate(model, ids, policy, calibration=calibration, context_columns=36, max_new_tokens=2, pad_token_id=0)
    with pytest.raises(ValueError, match="was made for another architecture"):
        bind(policy, calibration, model)
    assert counter.calls == 0


def _selection_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "MomentKV orders" in str(w.message)]


def test_the_moment_selection_warning_comes_once_from_bind_and_never_from_serving_a_plan(tmp_path):
    model = make_tiny_llama()
    path = write_tiny_artifact(tmp_path / "m.h5", model, ("moments",), job_config={"moments": {"selection": "snapkv"}})
    calibration = load_calibration(model, path=path)
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff", correction="calibrated", evict_every=2)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))

    options = {"context_columns": 36, "block_size": 8, "max_new_tokens": 4, "pad_token_id": 0}

    def serve(policy, calibration=None):
        return lambda: generate(model, ids, policy, calibration=calibration, **options)

    # a policy: bound once for the whole call (5 prefill blocks, decode-time eviction), one warning
    assert len(_selection_warnings(serve(policy, calibration))) == 1
    calibration._warned_selections.clear()  # as fresh as a newly loaded artifact
    plans = []
    assert len(_selection_warnings(lambda: plans.append(bind(policy, calibration, model)))) == 1
    calibration._warned_selections.clear()
    assert _selection_warnings(serve(plans[0])) == []  # serving a plan checks nothing again
    assert _selection_warnings(lambda: compress_prompt(model, ids, plans[0], context_columns=36)) == []


@pytest.mark.parametrize(
    "policy",
    [
        CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="keydiff", correction="calibrated", evict_every=2),
        CompressionPolicy(budget=12, scorer="expected_attention", statistics="prompt", evict_every=1),
        CompressionPolicy(keep_ratio=0.4, scorer="snapkv", moment_eviction=True, correction="order1", evict_every=3),
    ],
)
def test_a_plan_serves_exactly_what_its_policy_and_calibration_serve(policy, tmp_path):
    """generate() given the plan, or the policy and calibration: the same tokens, the same cache,
    decode-time eviction included (two left-padded rows of different lengths)."""
    model = make_tiny_llama()
    calibration = load_calibration(model, path=write_tiny_artifact(tmp_path / "a.h5", model, ("budgets", "moments")))
    ids = torch.randint(1, 128, (2, 44), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    options = {"attention_mask": mask, "context_columns": 38, "max_new_tokens": 8, "pad_token_id": 0}
    direct = generate(model, ids, policy, calibration=calibration, **options)
    plan = bind(policy, calibration, model)
    served = generate(model, ids, plan, **options)
    assert torch.equal(direct.sequences, served.sequences)
    assert torch.equal(direct.cache.head_lengths(), served.cache.head_lengths())
    np.testing.assert_array_equal(direct.report.budgets, served.report.budgets)
    for mine, theirs in zip(direct.cache.layers, served.cache.layers, strict=True):
        keys, _, _, valid = mine.padded_rows([0, 1])
        other, _, _, other_valid = theirs.padded_rows([0, 1])
        assert torch.equal(valid, other_valid) and torch.equal(keys[valid], other[valid])
    grown = direct.cache.head_lengths().numpy() - direct.report.lengths_after  # [L, B, Hkv]
    assert int(grown.max()) < 8  # decode-time eviction cut the heads back while generating


def test_a_plan_is_served_only_with_its_own_calibration_and_model_shape(tmp_path):
    model = make_tiny_llama()
    calibration = load_calibration(model, path=write_tiny_artifact(tmp_path / "a.h5", model, ("budgets",)))
    plan = bind(CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="keydiff"), calibration, model)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(3))
    other = load_calibration(model, path=write_tiny_artifact(tmp_path / "b.h5", model, ("budgets",), seed=1))
    with pytest.raises(ValueError, match="served with the calibration it was bound to"):
        compress_prompt(model, ids, plan, calibration=other, context_columns=36)
    compress_prompt(model, ids, plan, calibration=calibration, context_columns=36)  # the same one: fine
    bigger = make_tiny_llama(num_layers=3)
    cache = RaggedCache.for_model(bigger)
    prefill(bigger, cache, ids)
    with pytest.raises(ValueError, match="bound to a model with .* \\(2, 4, 2, 16\\), not \\(3, 4, 2, 16\\)"):
        compress(bigger, cache, plan)
    with pytest.raises(TypeError, match="already a ServingPlan"):
        bind(plan, calibration, model)
