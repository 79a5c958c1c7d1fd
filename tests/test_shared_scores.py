"""Scores computed once per scorer for several policies (the evaluation's saving) give the same
compressed caches as each policy scoring for itself."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from test_runtime_policy import write_tiny_artifact

from runtime import CompressionPolicy, RaggedCache, bind, load_calibration
from runtime.compression.prefill import compress, prefill, prefill_for_policies, shared_scores
from runtime.plan.policy_spec import parse_policy
from runtime.scorers import ALL_QUERIES, KeyDiffScorer, chunk_specs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _state(cache: RaggedCache) -> list:
    """Every layer's padded keys, values, positions and validity, and the moment sums."""
    state = []
    for layer in cache.layers:
        state.append(layer.padded_rows(list(range(layer.batch_size))))
        state.append(
            [None if m is None else (m.n.clone(), m.s_k.clone(), m.s_v.clone(), m.S_vk.clone()) for m in layer.moments]
        )
    return state


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_scores_key_says_when_two_policies_score_alike():
    leverage = parse_policy("inf/leverage")
    assert leverage.policy(0.75).scores_key() == parse_policy("curve/leverage+correction").policy(0.75).scores_key()
    # the blend (the compression ratio) only combines the parts: shared across ratios, not with 0 or None
    assert leverage.policy(0.75).scores_key() == leverage.policy(0.9).scores_key()
    for blend in (0.0, None):
        other = CompressionPolicy(compression_ratio=0.75, scorer="leverage", scorer_options={"blend": blend})
        assert other.scores_key() != leverage.policy(0.75).scores_key()
    sketched = CompressionPolicy(compression_ratio=0.75, scorer="leverage", scorer_options={"sketch": 16})
    assert sketched.scores_key() != leverage.policy(0.75).scores_key()
    keydiff = parse_policy("inf/keydiff+correction")
    assert keydiff.policy(0.5).scores_key() == parse_policy("curve/keydiff").policy(0.975).scores_key()
    assert keydiff.policy(0.5).scores_key() != leverage.policy(0.5).scores_key()
    assert CompressionPolicy(compression_ratio=0.5, scorer=KeyDiffScorer()).scores_key() is None
    assert CompressionPolicy(compression_ratio=0.5, scorer="snapkv", moment_eviction=True).scores_key() is None


@pytest.mark.parametrize(
    "names",
    [
        ("inf/leverage", "inf/leverage+correction", "uniform/leverage"),
        ("inf/keydiff+correction", "uniform/keydiff"),
        ("global/learned", "global/learned+correction"),
    ],
)
def test_shared_scores_compress_exactly_as_each_policy_alone(tmp_path, names):
    model = make_tiny_llama()
    sections = ("budgets", "moments", "learned_scorer")
    path = write_tiny_artifact(tmp_path / "a.h5", model, sections)
    calibration = load_calibration(model, path=path)
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # the second row is shorter: ragged rows, left padding
    plans = [bind(parse_policy(name).policy(ratio), calibration, model) for name in names for ratio in (0.5, 0.9)]
    base = RaggedCache.for_model(model)
    specs = tuple(spec for plan in plans for spec in chunk_specs(plan.scorer))  # what leverage reads
    stats = prefill(
        model, base, ids, mask, record_prompt_stats=True, observe_queries=ALL_QUERIES, accumulate=specs, n_sink=4
    )
    # one scorer's plans at two ratios (leverage: two blends) share one computation of the parts
    for plan, (scores, seconds) in zip(plans, shared_scores(base, plans, stats), strict=True):
        assert seconds >= 0 and len(scores) == len(base.layers)
        alone, shared = base.copy(), base.copy()
        expected = compress(model, alone, plan, prompt_stats=stats)
        report = compress(model, shared, plan, prompt_stats=stats, scores=scores)
        assert (report.budgets == expected.budgets).all()
        assert (report.lengths_after == expected.lengths_after).all() and (expected.lengths_after > 0).all()
        _assert_same(_state(shared), _state(alone))


def test_shared_scores_of_another_cache_are_refused(tmp_path):
    model = make_tiny_llama()
    plan = bind(parse_policy("uniform/keydiff").policy(0.5), None, model)
    short, long = RaggedCache.for_model(model), RaggedCache.for_model(model)
    prefill_for_policies(model, short, torch.arange(20).unsqueeze(0), [plan])
    prefill_for_policies(model, long, torch.arange(30).unsqueeze(0), [plan])
    ((scores, _),) = shared_scores(short, [plan])
    with pytest.raises(ValueError, match="computed on another cache"):
        compress(model, long, plan, scores=scores)
    with pytest.raises(ValueError, match="for 1 layers"):
        compress(model, long, plan, scores=scores[:1])
    other = bind(parse_policy("uniform/knorm").policy(0.5), None, model)
    with pytest.raises(ValueError, match="one scores_key"):
        shared_scores(short, [plan, other])
