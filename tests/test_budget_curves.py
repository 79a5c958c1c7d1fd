"""Budget curves: measured per-head loss curves, marginal-utility allocation per
compression ratio, the artifact section, and allocation="curve" in the runtime."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from conftest import make_random_artifact, make_random_identity, single_thread, tiny_profile_args, write_tiny_model_dir
from scorer_oracles import oracle_score

from artifacts import ArtifactError, open_artifact, write_artifact
from profiler.budget_curves import (
    CURVE_FLOOR,
    CURVE_GRID,
    CURVE_RATIOS,
    RETENTION_WEIGHT,
    allocate_fractions,
    budgets_for,
    combined_loss,
    measure_curves,
)
from runtime.compression.keep_rule import priority_ranks, select_rows
from runtime.plan.budgets import curve_row
from runtime.plan.policy import CompressionPolicy
from runtime.scorers import KeyDiffScorer

# -- keep order --------------------------------------------------------------------------------


@pytest.mark.parametrize("n, n_sink, window", [(50, 4, 8), (12, 4, 32), (40, 0, 0), (9, 3, 3)])
def test_priority_ranks_keep_exactly_what_select_rows_keeps_at_every_budget(n, n_sink, window):
    scores = torch.randn(n, generator=torch.Generator().manual_seed(n))
    ranks = priority_ranks(scores, None, n_sink, window)
    assert sorted(ranks.tolist()) == list(range(n))
    for budget in range(0, n + 1):
        expected = select_rows(scores, budget, n_sink, window).tolist()
        assert torch.nonzero(ranks < budget).reshape(-1).tolist() == expected, budget


# -- allocation --------------------------------------------------------------------------------


def _total_loss(grid, loss, fractions):
    """Sum over heads of each head's piecewise-linear loss (flat below the grid) at ``fractions``."""
    curves = loss.reshape(len(grid), -1).T
    return sum(np.interp(f, grid, c, left=c[0]) for f, c in zip(fractions.reshape(-1), curves, strict=True))


def test_allocation_conserves_the_total_holds_the_floor_and_caps_at_one():
    rng = np.random.default_rng(0)
    grid = np.array(CURVE_GRID)
    loss = np.sort(rng.random((grid.size, 5, 3)), axis=0)[::-1].copy()
    loss[-1] = 0.0
    keeps = 1 - np.array(CURVE_RATIOS)
    table = allocate_fractions(loss, grid, keeps, floor=0.25)
    assert table.shape == (keeps.size, 5, 3)
    for keep, row in zip(keeps, table, strict=True):
        assert row.sum() == pytest.approx(keep * row.size, rel=1e-12)
        assert row.min() >= 0.25 * keep - 1e-12 and row.max() <= 1.0 + 1e-12


def test_allocation_is_optimal_on_convex_curves_against_a_brute_force_search():
    """Three heads with convex losses on a grid of 0.1: the greedy allocation's total loss equals
    the best of every allocation on a 0.05 lattice (which contains the optimum's breakpoints)."""
    grid = np.round(np.arange(1, 11) / 10, 10)
    x = grid[:, None]
    curves = np.stack([(1 - x[:, 0]) ** 2 * 3, (1 - x[:, 0]) ** 4, 0.5 * (1 - x[:, 0])], axis=1)  # [NG, 3]
    loss = curves[:, None, :]  # [NG, 1, 3]
    for keep in (0.2, 0.4, 0.6):
        fractions = allocate_fractions(loss, grid, [keep], floor=0.0)[0]
        assert fractions.sum() == pytest.approx(3 * keep)
        lattice = np.round(np.arange(0, 21) / 20, 10)
        best = min(
            _total_loss(grid, loss, np.array(combo))
            for combo in itertools.product(lattice, repeat=3)
            if abs(sum(combo) - 3 * keep) < 1e-9
        )
        assert _total_loss(grid, loss, fractions) <= best + 1e-9


def test_allocation_gives_a_head_with_no_utility_only_its_floor():
    grid = np.array([0.1, 0.5, 1.0])
    loss = np.zeros((3, 1, 2))
    loss[:, 0, 0] = [1.0, 0.5, 0.0]  # head 0 gains from budget, head 1 does not
    row = allocate_fractions(loss, grid, [0.5], floor=0.2)[0, 0]
    assert row[1] == pytest.approx(0.2 * 0.5)
    assert row.sum() == pytest.approx(1.0)


def test_allocation_uses_the_convex_hull_of_a_curve_with_a_late_drop():
    """A head whose loss only drops late (a step) must be judged by its hull, not its first segment."""
    grid = np.array([0.1, 0.2, 0.3, 0.4, 1.0])
    loss = np.zeros((5, 1, 2))
    loss[:, 0, 0] = [1.0, 1.0, 1.0, 0.0, 0.0]  # needs 0.4 to drop all its loss
    loss[:, 0, 1] = [0.5, 0.45, 0.4, 0.35, 0.0]  # small steady gains
    row = allocate_fractions(loss, grid, [0.35], floor=0.0)[0, 0]
    assert row[0] == pytest.approx(0.4)  # hull slope -1/0.3 beats -0.5 per unit
    assert row.sum() == pytest.approx(0.7)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss": -np.ones((2, 1, 1))}, "non-negative"),
        ({"grid": [0.5, 0.2]}, "strictly increasing"),
        ({"keep_fractions": [1.5]}, "kept fractions"),
        ({"floor": 2.0}, "floor"),
    ],
)
def test_allocation_refuses_bad_input(kwargs, message):
    args = {"loss": np.ones((2, 1, 1)), "grid": [0.2, 0.5], "keep_fractions": [0.5], "floor": 0.25, **kwargs}
    with pytest.raises(ValueError, match=message):
        allocate_fractions(**args)


def test_combined_loss_normalises_each_part_by_its_mean_at_the_smallest_fraction():
    error = np.array([[[2.0, 4.0]], [[0.0, 0.0]]])
    retention = np.array([[[0.1, 0.0]], [[0.0, 0.0]]])
    out = combined_loss(error, retention, 2.0)
    assert out[0, 0].tolist() == pytest.approx([2 / 3 + 2 * 2.0, 4 / 3])
    assert combined_loss(error, np.zeros_like(retention), 1.0)[0, 0].tolist() == pytest.approx([2 / 3, 4 / 3])


# -- runtime ----------------------------------------------------------------------------------


def _curve(seed=0, layers=3, heads=2):
    rng = np.random.default_rng(seed)
    ratios = np.array([0.5, 0.75, 0.9])
    rows = []
    for ratio in ratios:
        w = rng.random((layers, heads)) + 0.2
        rows.append(w / w.sum() * (1 - ratio) * layers * heads)
    return ratios, np.stack(rows)


def test_curve_row_is_a_grid_row_on_the_grid_and_interpolates_with_the_exact_sum_between():
    ratios, fractions = _curve()
    assert np.allclose(curve_row(ratios, fractions, 0.25), fractions[1])
    for keep in (0.05, 0.12, 0.2, 0.3, 0.45, 0.5, 0.8):
        row = curve_row(ratios, fractions, keep)
        assert row.sum() == pytest.approx(keep * 6, rel=1e-12)
    mid = curve_row(ratios, fractions, 0.175)  # halfway between keep 0.1 and 0.25
    assert np.allclose(mid, 0.5 * (fractions[1] + fractions[2]))
    with pytest.raises(ValueError, match="strictly increasing"):
        curve_row(ratios[::-1], fractions, 0.3)


@pytest.mark.parametrize("ratio", [0.5, 0.6, 0.75, 0.8, 0.9, 0.95, 0.2])
def test_curve_head_budgets_conserve_the_uniform_total_exactly(ratio):
    curve = _curve()
    policy = CompressionPolicy(compression_ratio=ratio, allocation="curve", scorer="keydiff", min_budget=2)
    uniform = CompressionPolicy(compression_ratio=ratio, scorer="keydiff").head_budgets(1000, 3, 2)
    budgets = policy.head_budgets(1000, 3, 2, curve=curve)
    assert budgets.dtype == np.int64 and budgets.shape == (3, 2)
    assert budgets.sum() == uniform.sum()
    assert budgets.min() >= 2 and budgets.max() <= 1000
    expected = curve_row(*curve, 1 - ratio) * 1000
    if expected.max() <= 1000:  # no head clipped (keep 0.8 scales the 0.5 row past 1 for some): rounding only
        assert np.abs(budgets - expected).max() <= 1.0 + 1e-9


def test_curve_allocation_needs_the_section_and_says_so():
    policy = CompressionPolicy(compression_ratio=0.75, allocation="curve", scorer="keydiff")
    assert any("budget_curves" in need for need in policy.needs_calibration())
    (reason,) = policy.missing(None)
    assert "needs a calibration artifact" in reason
    from runtime.plan.calibration import Calibration

    artifact = make_random_artifact(make_random_identity(4, 4, 2, 8), sections=("budgets",))
    calibration = Calibration.from_sections("x.h5", artifact.model, {}, artifact.sections)
    (reason,) = policy.missing(calibration)
    assert re.search("no 'budget_curves' section.*budget-curves stage", reason)
    with pytest.raises(ValueError, match="budget curve"):
        policy.head_budgets(100, 4, 2)


def test_the_policy_grammar_parses_curve_allocations():
    from runtime.plan.policy_spec import parse_policy

    spec = parse_policy("curve/keydiff+correction")
    policy = spec.policy(0.9)
    assert policy.allocation == "curve" and policy.scorer == "keydiff" and policy.correction == "calibrated"


# -- artifact ---------------------------------------------------------------------------------


def test_section_round_trips_and_serves_as_calibration(tmp_path):
    from runtime.plan.calibration import Calibration

    artifact = make_random_artifact(make_random_identity(4, 4, 2, 8), sections=("budget_curves",))
    path = write_artifact(tmp_path / "c.h5", artifact)
    with open_artifact(path) as reader:
        assert reader.schema_version == "1.6"  # written as the newest; the section came in 1.3
        section = reader.section("budget_curves")
        assert np.array_equal(section["fractions"], artifact.sections["budget_curves"]["fractions"])
        assert dict(section.attrs) == {} and reader.config["budget_curves"]["selection"] == "keydiff"
    calibration = Calibration.from_sections(path, artifact.model, {}, artifact.sections)
    policy = CompressionPolicy(compression_ratio=0.8, allocation="curve", scorer="keydiff")
    assert policy.missing(calibration) == []
    assert policy.head_budgets(500, 4, 2, curve=calibration.budget_curve).sum() == 100 * 8


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.__setitem__("fractions", a["fractions"] * 0.9), "sums to"),
        (lambda a: a.__setitem__("compression_ratios", a["compression_ratios"][::-1].copy()), "strictly increasing"),
        (lambda a: a.__setitem__("grid", np.array([0.05, 0.3, 0.1, 1.0])), "strictly increasing"),
    ],
)
def test_writer_refuses_a_section_that_breaks_its_relations(tmp_path, change, message):
    artifact = make_random_artifact(make_random_identity(4, 4, 2, 8), sections=("budget_curves",))
    change(artifact.sections["budget_curves"].arrays)
    with pytest.raises(ArtifactError, match=message):
        write_artifact(tmp_path / "bad.h5", artifact)


# -- measuring --------------------------------------------------------------------------------


def _reference_curves(model, windows, probes, grid, n_sink, window, query_window, layer_attention=True):
    """The losses computed directly: q/k/v from a plain capture, select_rows per budget, explicit
    masked attention in float64 (with the layer's soft-cap, sliding window and learned sinks as the
    model's eager attention has them; ``layer_attention=False``: plain causal attention, for contrast)."""
    from runtime.kv_store.attention_interface import attention_implementation
    from runtime.kv_store.eager_attention import attention_forward

    captured = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        captured[module.layer_idx] = (query[0].double(), key[0].double(), value[0].double(), float(scaling))
        cap, sliding, sinks = kwargs.get("softcap"), kwargs.get("sliding_window"), kwargs.get("s_aux")
        sinks = None if sinks is None else sinks.double()
        attend[module.layer_idx] = (cap, sliding, sinks) if layer_attention else (None, None, None)
        return attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    attend = {}

    def weights(layer, keys, query, scale, t, head, hidden=None):
        """Softmax of query head ``head``'s query at position t over ``keys [n, d]`` of positions ``0..n-1``
        (those within the layer's window, none of ``hidden`` bool [n]), as the layer computes it, the
        head's sink logit in the softmax and its weight dropped: ``[n]``."""
        cap, sliding, sinks = attend[layer]
        logits = scale * keys @ query
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        if sliding is not None:
            logits[: max(0, t - sliding + 1)] = float("-inf")
        if hidden is not None:
            logits = logits.masked_fill(hidden, float("-inf"))
        if sinks is None:
            return torch.softmax(logits, 0)
        return torch.softmax(torch.cat([logits, sinks[head : head + 1]]), 0)[:-1]

    def passes(ids):
        captured.clear()
        with torch.no_grad(), attention_implementation(model, "kvcal_test_capture", capture):
            model(input_ids=ids, use_cache=False)
        return dict(captured)

    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    error = np.zeros((len(grid), layers, heads))
    retention = np.zeros((len(grid), layers, heads))
    for ids in windows:
        for layer, (q, k, v, scale) in passes(ids[None]).items():
            group = q.shape[0] // heads
            total = k.shape[1]
            prefix = total - query_window
            for h in range(heads):
                scores = oracle_score(KeyDiffScorer(), _head(layer, h, k, v, prefix, scale))
                for g, budget in enumerate(budgets_for(prefix, grid)):
                    kept = select_rows(scores, budget, n_sink, window).tolist()
                    errs = []
                    for qh in range(h * group, (h + 1) * group):
                        for t in range(prefix, total):
                            full = list(range(t + 1))
                            hidden = torch.ones(t + 1, dtype=torch.bool)
                            hidden[kept + list(range(prefix, t + 1))] = False
                            o = weights(layer, k[h, full], q[qh, t], scale, t, qh) @ v[h, full]
                            o_hat = weights(layer, k[h, full], q[qh, t], scale, t, qh, hidden) @ v[h, full]
                            errs.append(float((o_hat - o).norm() / o.norm()))
                    error[g, layer, h] += np.mean(errs) / len(windows)
    for probe in probes:
        end = probe.context_end
        needle = [i for s in probe.spans if s.label == "R" for i in range(s.start, min(s.end, end))]
        for layer, (q, k, v, scale) in passes(torch.tensor([probe.input_ids])).items():
            group = q.shape[0] // heads
            for h in range(heads):
                scores = oracle_score(KeyDiffScorer(), _head(layer, h, k, v, end, scale))
                mass = torch.zeros(end, dtype=torch.float64)
                count = 0
                for qh in range(h * group, (h + 1) * group):
                    for t in range(end, len(probe.input_ids)):
                        mass += weights(layer, k[h, : t + 1], q[qh, t], scale, t, qh)[:end]
                        count += 1
                mass /= count
                for g, budget in enumerate(budgets_for(end, grid)):
                    kept = set(select_rows(scores, budget, n_sink, window).tolist())
                    retention[g, layer, h] += sum(float(mass[i]) for i in needle if i not in kept) / len(probes)
    return error, retention


def _head(layer, h, k, v, prefix, scale):
    from scorer_oracles import Head

    return Head(
        layer=layer,
        kv_head=h,
        keys=k[h, :prefix].float(),
        values=v[h, :prefix].float(),
        positions=torch.arange(prefix),
        scaling=scale,
        next_position=prefix,
    )


def _tiny_probe(seed, length=40, question=6):
    from needles.probe import Probe, Span

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128, length + question).tolist()
    start = int(rng.integers(8, length - 10))
    return Probe(
        id=f"p{seed}",
        family="retrieval",
        length=length,
        depth=50.0,
        seed=seed,
        question="q",
        answer="a",
        input_ids=ids,
        spans=[Span("R", start, start + 3), Span("D", 2, 4)],
        context_end=length,
    )


def test_measured_curves_match_a_direct_reference_on_a_tiny_llama(tiny_llama, one_thread):
    grid = (0.1, 0.3, 0.6, 1.0)
    windows = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    probes = [_tiny_probe(3), _tiny_probe(4)]
    measured = measure_curves(
        tiny_llama, windows, probes, grid=grid, selection="keydiff", query_window=6, n_sink=2, window=4, progress=False
    )
    error, retention = _reference_curves(tiny_llama, windows, probes, grid, n_sink=2, window=4, query_window=6)
    assert measured["probes"] == 2
    assert np.allclose(measured["output_error"], error, rtol=1e-4, atol=1e-6)
    assert np.allclose(measured["retention_loss"], retention, rtol=1e-4, atol=1e-7)
    assert np.all(measured["output_error"][-1] < 1e-5) and np.all(measured["retention_loss"][-1] == 0)
    assert retention[0].max() > 0  # the test exercises the needle part


def _reference_answer_hits(model, probes, answers, grid, n_sink, window):
    """REAL's retrieval hits lost, directly: per (KV head, query head of its group, answer step),
    the most attended token of the full causal attention; a hit when it is an R token of the
    context, lost at a budget when select_rows does not keep it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from runtime.kv_store.attention_interface import attention_implementation

    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    lost = np.zeros((len(grid), layers, heads))
    captured = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        captured[module.layer_idx] = (query[0].double(), key[0].double(), value[0].double(), float(scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    for probe, answer in zip(probes, answers, strict=True):
        ids = [*probe.input_ids, *answer]
        end = probe.context_end
        needle = {i for s in probe.spans if s.label == "R" for i in range(s.start, min(s.end, end))}
        captured.clear()
        with torch.no_grad(), attention_implementation(model, "kvcal_test_capture", capture):
            model(input_ids=torch.tensor([ids]), use_cache=False)
        for layer, (q, k, v, scale) in captured.items():
            group = q.shape[0] // heads
            for h in range(heads):
                scores = oracle_score(KeyDiffScorer(), _head(layer, h, k, v, end, scale))
                tops = [
                    int(torch.argmax(scale * k[h, : t + 1] @ q[qh, t]))
                    for qh in range(h * group, (h + 1) * group)
                    for t in range(len(ids) - len(answer), len(ids))
                ]
                for g, budget in enumerate(budgets_for(end, grid)):
                    kept = set(select_rows(scores, budget, n_sink, window).tolist())
                    misses = sum(1 for top in tops if top in needle and top not in kept)
                    lost[g, layer, h] += misses / len(tops) / len(probes)
    return lost


def test_measured_curves_follow_soft_capping_and_sliding_windows(one_thread):
    """Gemma 2 (soft-capped logits; layer 0 slides over 64 tokens): windows and probes longer than
    the window, so the tail's queries cannot see the first keys; the direct reference applies the
    cap and the window, and differs from plain attention's."""
    from tiny_architectures import build

    model = build("gemma2", num_layers=2, seed=3)
    with torch.no_grad():
        for layer in model.model.layers:  # logits of several units, and a cap they reach
            layer.self_attn.q_proj.weight.mul_(5)
            layer.self_attn.attn_logit_softcapping = 1.0
    windows = torch.randint(0, 128, (1, 90), generator=torch.Generator().manual_seed(1))
    _assert_curves_follow_the_layers_attention(model, windows, [_tiny_probe(3, length=80)], retention_atol=1e-5)


def _assert_curves_follow_the_layers_attention(model, windows, probes, retention_atol: float):
    """The measured curves (grid 0.1 / 0.5 / 1, keydiff, 2 sinks and a 4-token window kept, 6 queries) are
    the direct reference's with the layers' own attention (cap, window, sinks), which differs from plain
    attention's: returns the plain reference's ``(error, retention)``."""
    options = dict(grid=(0.1, 0.5, 1.0), n_sink=2, window=4)
    measured = measure_curves(model, windows, probes, selection="keydiff", query_window=6, progress=False, **options)
    error, retention = _reference_curves(model, windows, probes, query_window=6, **options)
    plain = _reference_curves(model, windows, probes, query_window=6, layer_attention=False, **options)
    assert np.allclose(measured["output_error"], error, rtol=1e-4, atol=1e-6)  # float32 against float64
    assert np.allclose(measured["retention_loss"], retention, rtol=1e-4, atol=retention_atol)
    assert retention[0].max() > 0 and not np.allclose(plain[0], error, rtol=1e-2, atol=1e-4)  # the layers' own matters
    return plain, retention


def test_measured_curves_follow_learned_attention_sinks(one_thread):
    """gpt-oss (sinks between 2 and 7; its sliding layers' 32-token window under 40- and 46-token passes):
    the output errors and the needle mass are those of its attention with the sink's logit in every
    softmax, which differ from plain attention's."""
    from test_attention_sinks import gpt_oss

    windows = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    probes = [_tiny_probe(3), _tiny_probe(4)]
    (_, plain_retention), retention = _assert_curves_follow_the_layers_attention(gpt_oss(), windows, probes, 1e-7)
    assert not np.allclose(plain_retention, retention, rtol=1e-2, atol=1e-4)  # the sinks scale the needle mass


def test_answer_retention_counts_lost_retrieval_hits_like_a_direct_reference(tiny_llama, one_thread):
    """With answers, the retention loss is REAL's retrieval hits at the answer's steps whose token
    the budget evicts (teacher forcing), equal to a per-step loop over query heads."""
    grid = (0.1, 0.3, 0.6, 1.0)
    windows = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    probes = [_tiny_probe(3), _tiny_probe(4)]
    # answers that copy the needle, so that some heads attend to it
    answers = [p.input_ids[s.start : s.end] for p in probes for s in p.spans if s.label == "R"]
    common = {"grid": grid, "selection": "keydiff", "query_window": 6, "n_sink": 2, "window": 4, "progress": False}
    measured = measure_curves(tiny_llama, windows, probes, answers=answers, **common)
    want = _reference_answer_hits(tiny_llama, probes, answers, grid, n_sink=2, window=4)
    np.testing.assert_allclose(measured["retention_loss"], want, atol=1e-12)
    assert want[0].max() > 0 and np.all(want[-1] == 0)  # some hit is lost at the smallest budget, none at 1
    question = measure_curves(tiny_llama, windows, probes, **common)
    np.testing.assert_allclose(measured["output_error"], question["output_error"])  # the text part is unchanged
    with pytest.raises(ValueError, match="2 answers for 1 probes"):
        measure_curves(tiny_llama, windows, probes[:1], answers=answers, **common)


def test_measure_curves_refuses_bad_input(tiny_llama):
    windows = torch.randint(0, 128, (1, 40))
    small = {"query_window": 6, "n_sink": 2, "window": 4, "progress": False}
    with pytest.raises(ValueError, match="no probe has an R span"):
        measure_curves(tiny_llama, windows, [], **small)
    with pytest.raises(ValueError, match="calibration windows"):
        measure_curves(tiny_llama, windows[:, :10], [_tiny_probe(1)], **small)
    with pytest.raises(ValueError, match="unknown selection"):
        measure_curves(tiny_llama, windows, [_tiny_probe(1)], selection="knorm", **small)
    with pytest.raises(ValueError, match="grid"):
        measure_curves(tiny_llama, windows, [_tiny_probe(1)], grid=(0.5, 0.2), **small)


def test_budget_curves_on_the_embedded_model(embedded_model, embedded_tokenizer, one_thread):
    """One window and one retrieval probe on the real model: both losses fall to 0 as the kept
    fraction grows to 1, the needle is read by some heads, and the allocation serves a compression."""
    from needles import make_probe
    from profiler.calibration_text import calibration_windows
    from profiler.stages.budget_curves import curve_section

    windows = calibration_windows(embedded_tokenizer, None, 1, 256)
    probe = make_probe(embedded_tokenizer, "retrieval", 512, 50.0, seed=5)
    measured = measure_curves(embedded_model, windows, [probe], progress=False)
    error, retention = measured["output_error"], measured["retention_loss"]
    assert error.shape == (len(CURVE_GRID), 30, 3)
    means = error.mean(axis=(1, 2))
    assert means[0] > 0.2 and means[-1] < 1e-4 and np.all(np.diff(means) <= 1e-9)
    assert retention[0].max() > 0.01 and np.all(retention[-1] == 0)  # 0.033 measured: some head reads the needle
    section = curve_section(measured, CURVE_GRID, CURVE_RATIOS, CURVE_FLOOR, RETENTION_WEIGHT)
    fractions = section["fractions"]
    for ratio, row in zip(section["compression_ratios"], fractions, strict=True):
        assert row.sum() == pytest.approx((1 - ratio) * 90, rel=1e-9)
    policy = CompressionPolicy(compression_ratio=0.9, allocation="curve", scorer="keydiff")
    budgets = policy.head_budgets(2000, 30, 3, curve=(section["compression_ratios"], fractions))
    assert budgets.sum() == 200 * 90


def test_inspect_artifact_and_the_report_show_the_section(tmp_path):
    from artifacts.report import render_report
    from artifacts.summary import format_summary, summarize

    artifact = make_random_artifact(make_random_identity(4, 4, 2, 8), sections=("budget_curves",))
    path = write_artifact(tmp_path / "c.h5", artifact)
    with open_artifact(path) as reader:
        summary = summarize(reader)
        text = format_summary(summary)
        html = render_report(reader)
    described = summary["sections"]["budget_curves"]
    assert not described.get("generic") and described["selection"] == "keydiff"
    assert set(described["fractions"]) == {"0.5", "0.75", "0.9"}
    assert "budget_curves  keydiff selection, 4 windows, 7 probes" in text
    assert "kept fraction per KV head at compression ratio 0.9" in html


def test_profile_model_runs_the_stage_into_an_existing_artifact(tmp_path, embedded_tokenizer):
    """``--stages budget-curves`` on a tiny model: the section is written next to the kept ones,
    its options are recorded, and the artifact serves allocation="curve"."""
    from profiler.cli import main
    from profiler.presets import PRESETS
    from profiler.stages import BudgetCurvesStage, default_stages

    model_dir = write_tiny_model_dir(tmp_path / "model", embedded_tokenizer, probes=4)
    out = tmp_path / "a.h5"
    with single_thread():
        assert main(tiny_profile_args(model_dir, out, "--stages", "behaviour,budgets")) == 0
        assert (
            main(
                tiny_profile_args(
                    model_dir, out, "--stages", "budget-curves", "--curve-floor", "0.5", "--curve-retention", "question"
                )
            )
            == 0
        )
    with open_artifact(out) as reader:
        assert {"behaviour", "budgets", "budget_curves"} <= set(reader.sections)
        section = reader.section("budget_curves")
        settings = reader.config["budget_curves"]
        assert dict(section.attrs) == {} and settings["floor"] == 0.5 and settings["selection"] == "keydiff"
        assert settings["retention"] == "question"
        for ratio, row in zip(section["compression_ratios"], section["fractions"], strict=True):
            assert row.sum() == pytest.approx((1 - ratio) * row.size, rel=1e-9)
            assert row.min() >= 0.5 * (1 - ratio) - 1e-9
    on = {name for name, preset in PRESETS.items() if BudgetCurvesStage.on_by_default(preset)}
    assert on == {"smoke", "standard", "paper"} and "budget-curves" in default_stages(PRESETS["standard"])
    assert "budget-curves" not in default_stages(PRESETS["quick"])  # make profile's time; --stages runs it
