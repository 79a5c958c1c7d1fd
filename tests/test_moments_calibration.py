"""profiler.moments: shapes, an independent masked-attention reference (tiny Llama),
and the correction on the embedded model at 75% compression."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from profiler.moments import measure_correction_errors
from runtime.scorers import ExpectedAttentionScorer, KeyDiffScorer, SnapKVScorer


def _projections(model, ids, pre_rope_keys: bool = False):
    """Post-RoPE q [L, Hq, T, d] and k, v [L, Hkv, T, d] recomputed from q/k/v_proj hooks, RoPE applied by
    the model's own module's ``apply_rotary_pos_emb`` (and, with ``pre_rope_keys``, the keys before RoPE
    [L, Hkv, T, d] as a fourth)."""
    import importlib

    apply_rotary_pos_emb = importlib.import_module(type(model).__module__).apply_rotary_pos_emb

    config = model.config
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    captured = {}
    hooks = []
    for layer, block in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            hooks.append(
                getattr(block.self_attn, name).register_forward_hook(
                    lambda mod, inp, out, key=(layer, name): captured.__setitem__(key, out.detach())
                )
            )
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    total = ids.shape[1]
    positions = torch.arange(total).unsqueeze(0)
    cos, sin = model.model.rotary_emb(captured[(0, "q_proj")], positions)
    qs, ks, vs, raw = [], [], [], []
    for layer in range(config.num_hidden_layers):
        q = captured[(layer, "q_proj")].view(1, total, hq, d).transpose(1, 2)
        k = captured[(layer, "k_proj")].view(1, total, hkv, d).transpose(1, 2)
        v = captured[(layer, "v_proj")].view(1, total, hkv, d).transpose(1, 2)
        raw.append(k[0])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        qs.append(q[0]), ks.append(k[0]), vs.append(v[0])
    out = torch.stack(qs), torch.stack(ks), torch.stack(vs)
    return (*out, torch.stack(raw)) if pre_rope_keys else out


def _reference_errors(q, k, v, kept_prefix, query_window, sinks=None):
    """Mean relative errors (none, 0th, 1st order) with the evicted prefix tokens masked out,
    the evicted moments computed directly from the evicted tokens (float64); ``sinks [G]``: the query
    heads' learned sink logits, whose ``e^s`` joins each softmax's normaliser (exact and estimated)."""
    total, d = k.shape
    prefix = total - query_window
    q, k, v = q[:, prefix:].double(), k.double(), v.double()  # q [G, W, d]
    s = d**-0.5
    logits = s * q @ k.T  # [G, W, T]
    causal = torch.arange(total).unsqueeze(0) <= torch.arange(prefix, total).unsqueeze(1)  # [W, T]
    retained = torch.ones(total, dtype=torch.bool)
    retained[:prefix] = False
    retained[kept_prefix] = True
    sink = torch.full((q.shape[0], 1, 1), float("-inf"), dtype=torch.float64) if sinks is None else sinks.double()
    sink = sink.reshape(-1, 1, 1).expand(-1, q.shape[1], 1)  # [G, W, 1]: e^-inf = 0 without sinks
    causal_logits = logits.masked_fill(~causal, float("-inf"))
    full = torch.softmax(torch.cat([causal_logits, sink], -1), -1)[..., :-1] @ v
    masked = logits.masked_fill(~(causal & retained), float("-inf"))
    out_R, lse_R = torch.softmax(masked, -1) @ v, torch.logsumexp(masked, -1)
    k_E, v_E = k[~retained], v[~retained]
    kbar, vbar = k_E.mean(0), v_E.mean(0)
    cov = (v_E - vbar).T @ (k_E - kbar) / k_E.shape[0]  # C_vk [d, d]
    lse_E = torch.log(torch.tensor(float(k_E.shape[0]))) + s * q @ kbar  # [G, W]
    z_R, z_E, z_sink = lse_R.exp().unsqueeze(-1), lse_E.exp().unsqueeze(-1), sink.exp()  # [G, W, 1]
    estimates = [
        z_R * out_R / (z_R + z_sink),
        (z_R * out_R + z_E * vbar) / (z_R + z_E + z_sink),
        (z_R * out_R + z_E * (vbar + s * q @ cov.T)) / (z_R + z_E + z_sink),
    ]
    return [float(((e - full).norm(dim=-1) / full.norm(dim=-1)).mean()) for e in estimates]


def _tiny_gpt_oss():
    """gpt-oss of the tiny Llama's geometry, every layer full, learned sinks between 2 and 7."""
    from test_attention_sinks import gpt_oss

    return gpt_oss(num_hidden_layers=2, layer_types=["full_attention"] * 2)


@pytest.mark.parametrize("name", ["llama", "gpt-oss"])
def test_tiny_llama_shapes_and_errors_match_independent_masked_reference(name, one_thread):
    """A tiny Llama, and a tiny gpt-oss: its learned sinks join the exact and the corrected attention."""
    if name == "llama":
        model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    else:
        model = _tiny_gpt_oss()
    # from token 3: gpt-oss's pad token 0 embeds to zeros, its key to a zero vector (bias 0) KeyDiff cannot score
    windows = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    w, n_sink, recent, ratios = 16, 2, 4, (0.25, 0.5)
    result = measure_correction_errors(
        model,
        windows,
        keep_ratios=ratios,
        query_window=w,
        scorer="keydiff",
        observation_window=8,
        n_sink=n_sink,
        recent_window=recent,
        progress=False,
    )
    assert set(result) == {"errors", "order", "reference_ratios", "tau"}
    assert result.selection == "keydiff" and result.scorer == "KeyDiffScorer()"
    assert result["errors"].shape == (2, 3, 2, 2) and result["errors"].dtype == np.float64
    assert result["order"].shape == (2, 2) and result["order"].dtype == np.int8
    assert set(np.unique(result["order"])) <= {-1, 0, 1}
    assert result["reference_ratios"].dtype == np.float64 and result["reference_ratios"].tolist() == [0.25, 0.5]
    assert result["tau"].shape == (2, 2) and result["tau"].dtype == np.float64 and np.all(result["tau"] == 0)
    assert np.all(np.isfinite(result["errors"])) and np.all(result["errors"] > 0)
    np.testing.assert_array_equal(result["order"], np.argmin(result["errors"].mean(0), axis=0) - 1)

    # independent reference: projections from hooks + RoPE, own KeyDiff selection, masked softmax
    prefix = 64 - w
    expected = np.zeros((2, 3, 2, 2))  # [R, 3, L, Hkv]
    for window in windows:
        q, k, v = _projections(model, window.unsqueeze(0))
        for layer in range(2):
            for head in range(2):
                keys = k[layer, head, :prefix]
                anchor = torch.nn.functional.normalize(keys, dim=-1).mean(0)
                score = -(keys @ anchor) / (keys.norm(dim=-1) * anchor.norm())
                for r, ratio in enumerate(ratios):
                    budget = round(ratio * prefix)
                    middle = torch.arange(n_sink, prefix - recent)
                    best = middle[torch.topk(score[middle], budget - n_sink - recent).indices]
                    kept = torch.cat([torch.arange(n_sink), best, torch.arange(prefix - recent, prefix)])
                    expected[r, :, layer, head] += (
                        np.array(
                            _reference_errors(
                                q[layer, 2 * head : 2 * head + 2],
                                k[layer, head],
                                v[layer, head],
                                kept,
                                w,
                                sinks=(
                                    None
                                    if name == "llama"
                                    else model.model.layers[layer].self_attn.sinks[2 * head : 2 * head + 2].detach()
                                ),
                            )
                        )
                        / 2
                    )
    np.testing.assert_allclose(result["errors"], expected, rtol=1e-4, atol=1e-6)

    # moment-informed eviction (SnapKV attention x moment residual, in rounds) and a uniform tau
    moment = measure_correction_errors(
        model,
        windows[:1],
        keep_ratios=(0.25,),
        query_window=w,
        scorer="snapkv",
        observation_window=8,
        n_sink=n_sink,
        recent_window=recent,
        moment_eviction=True,
        tau=0.01,
        progress=False,
    )
    assert moment["errors"].shape == (1, 3, 2, 2) and np.all(np.isfinite(moment["errors"]))
    assert np.all(moment["tau"] == 0.01)
    assert moment.selection == "snapkv" and moment.scorer == "SnapKVScorer(window=8, kernel=1)"

    keep_all = measure_correction_errors(
        model,
        windows[:1],
        keep_ratios=(1.0,),
        query_window=w,
        scorer="snapkv",
        observation_window=8,
        n_sink=n_sink,
        recent_window=recent,
        progress=False,
    )
    assert np.all(keep_all["errors"] < 1e-5) and np.all(keep_all["order"] == -1)  # nothing evicted -> exact
    with pytest.raises(ValueError, match="too short"):
        measure_correction_errors(model, windows[:, :20], query_window=16, progress=False)
    with pytest.raises(ValueError, match="scorer"):
        measure_correction_errors(model, windows, scorer="h2o", progress=False)
    with pytest.raises(ValueError, match="moment_eviction needs a selection scorer that estimates attention"):
        measure_correction_errors(model, windows, scorer="keydiff", moment_eviction=True, progress=False)
    with pytest.raises(ValueError, match="needs query statistics or RoPE averages"):
        measure_correction_errors(model, windows, scorer=ExpectedAttentionScorer(), progress=False)


def test_selection_is_the_runtime_scorer(one_thread):
    """The named selections are runtime.scorers scorers: "snapkv" is SnapKV's un-pooled window
    attention (kernel 1), "keydiff" KeyDiff; any attention-free Scorer instance may be given."""
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=1)
    windows = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(3))
    options = dict(keep_ratios=(0.3,), query_window=8, observation_window=8, n_sink=2, recent_window=4, progress=False)
    by_name = measure_correction_errors(model, windows, scorer="snapkv", **options)
    by_scorer = measure_correction_errors(model, windows, scorer=SnapKVScorer(window=8, kernel=1), **options)
    assert by_name.selection == by_scorer.selection == "snapkv"
    for key in by_name:
        np.testing.assert_array_equal(by_name[key], by_scorer[key])
    keydiff = measure_correction_errors(model, windows, scorer=KeyDiffScorer(), **options)
    assert keydiff.selection == "keydiff"
    pooled = measure_correction_errors(model, windows, scorer=SnapKVScorer(window=8, kernel=5), **options)
    assert pooled.scorer == "SnapKVScorer(window=8, kernel=5)" and pooled["errors"].shape == (1, 3, 2, 2)


def test_learned_selection_with_the_global_allocation_matches_an_independent_reference(one_thread):
    """The orders of global/learned+correction are calibrated under that selector: the learned score
    of each prefix token (its pre-RoPE key and value through the head's linear map), one ranking of
    every layer's and head's tokens sharing out the uniform total (sinks and recent rows first)."""
    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=4)
    windows = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(6)
    weights, bias = torch.randn(2, 2, 32, generator=generator), torch.randn(2, 2, generator=generator)
    w, n_sink, recent, ratios = 16, 2, 4, (0.25, 0.5)
    options = dict(keep_ratios=ratios, query_window=w, n_sink=n_sink, recent_window=recent, progress=False)
    result = measure_correction_errors(
        model, windows, scorer="learned", allocation="global", learned=(weights.numpy(), bias.numpy()), **options
    )
    assert result.selection == "learned" and result.scorer == "LearnedScorer() with the global allocation"
    prefix = 64 - w
    expected = np.zeros((2, 3, 2, 2))
    for window in windows:
        q, k, v, raw = _projections(model, window.unsqueeze(0), pre_rope_keys=True)
        scores = torch.einsum("lhtf,lhf->lht", torch.cat([raw, v], -1)[:, :, :prefix], weights) + bias[..., None]
        protected = scores.clone()
        protected[..., :n_sink] = protected[..., prefix - recent :] = float("inf")
        for r, ratio in enumerate(ratios):
            total = 2 * 2 * round(ratio * prefix)
            threshold = torch.sort(protected.reshape(-1), descending=True).values[total - 1]
            for layer in range(2):
                for head in range(2):
                    kept = (protected[layer, head] >= threshold).nonzero().squeeze(1)
                    errors = _reference_errors(
                        q[layer, 2 * head : 2 * head + 2], k[layer, head], v[layer, head], kept, w
                    )
                    expected[r, :, layer, head] += np.array(errors) / 2
    np.testing.assert_allclose(result["errors"], expected, rtol=1e-4, atol=1e-6)
    uniform = measure_correction_errors(model, windows, scorer="learned", learned=(weights, bias), **options)
    assert uniform.scorer == "LearnedScorer()" and not np.allclose(uniform["errors"], result["errors"])
    with pytest.raises(ValueError, match="learned_scorer weights"):
        measure_correction_errors(model, windows, scorer="learned", **options)
    with pytest.raises(ValueError, match="not comparable"):
        measure_correction_errors(model, windows, scorer="keydiff", allocation="global", **options)
    with pytest.raises(ValueError, match="do not fit"):
        measure_correction_errors(model, windows, scorer="learned", learned=(weights[:1], bias[:1]), **options)


def test_embedded_model_correction_beats_no_correction_at_75_percent_compression(
    embedded_model, embedded_tokenizer, one_thread
):
    from needles import prose_haystack

    windows, total = 2, 384
    text = prose_haystack(embedded_tokenizer, windows * total + 16, seed=1)
    ids = np.asarray(embedded_tokenizer(text, add_special_tokens=False)["input_ids"][: windows * total])
    result = measure_correction_errors(
        embedded_model,
        ids.reshape(windows, total),
        keep_ratios=(0.25, 0.5),
        query_window=32,
        scorer="snapkv",
        progress=False,
    )
    errors = result["errors"]  # [R, 3, L, Hkv]
    assert errors.shape == (2, 3, 30, 3)
    for r, ratio in enumerate(result["reference_ratios"]):
        none, zeroth, first = errors[r].mean(axis=(1, 2))
        best = errors[r].min(axis=0).mean()
        print(
            f"keep {ratio:.2f}: mean relative error none {none:.4f}, 0th {zeroth:.4f}, 1st {first:.4f}, "
            f"per-head best {best:.4f}"
        )
    uncorrected = errors[0, 0].mean()
    corrected = np.take_along_axis(errors[0], (result["order"].astype(np.int64) + 1)[None], axis=0)[0].mean()
    print(
        f"keep 0.25 (75% compression): corrected (calibrated order) {corrected:.4f} vs uncorrected {uncorrected:.4f}; "
        f"orders {dict(zip(*np.unique(result['order'], return_counts=True), strict=True))}"
    )
    assert corrected < uncorrected
    assert errors[0, 2].mean() < errors[0, 0].mean()  # 1st order alone helps on average too


def _kept_by_serving(model, window, policy, prefix: int) -> list[list[torch.Tensor]]:
    """Per layer and KV head, the prefix positions the runtime's compress_prompt keeps under
    ``policy`` (the first ``prefix`` columns compressed question-agnostically), sorted."""
    from runtime import compress_prompt

    cache, _ = compress_prompt(model, window.unsqueeze(0), policy, context_columns=prefix)
    kept = []
    for layer in cache.layers:
        _, _, positions, valid = layer.padded_rows([0])  # [1, Hkv, n]
        kept.append([positions[0, h][valid[0, h] & (positions[0, h] < prefix)].sort().values for h in range(2)])
    return kept


def test_leverage_selection_measures_on_the_tokens_serving_keeps(one_thread):
    """inf/leverage+correction's orders are calibrated under leverage: every prefix query and the keys'
    RoPE come from the captured pass, and the blend is the evicted fraction of each reference ratio, as
    CompressionPolicy serves it.  The errors equal the independent masked reference over the tokens the
    runtime's own compress_prompt keeps (ties: Compactor scores its first 8 and last 4 rows the middle's
    maximum, more rows than the sinks and the recent window protect)."""
    from runtime import CompressionPolicy

    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=7)
    windows = torch.randint(0, 128, (2, 96), generator=torch.Generator().manual_seed(8))
    w, n_sink, recent, ratios = 16, 2, 4, (0.25, 0.5)
    result = measure_correction_errors(
        model,
        windows,
        keep_ratios=ratios,
        query_window=w,
        scorer="leverage",
        n_sink=n_sink,
        recent_window=recent,
        progress=False,
    )
    assert result.selection == "leverage" and "blend=0.75" in result.scorer and "blend=0.5" in result.scorer
    prefix = 96 - w
    expected = np.zeros((2, 3, 2, 2))  # [R, 3, L, Hkv]
    for window in windows:
        q, k, v = _projections(model, window.unsqueeze(0))
        for r, ratio in enumerate(ratios):
            policy = CompressionPolicy(keep_ratio=ratio, scorer="leverage", n_sink=n_sink, window=recent)
            kept = _kept_by_serving(model, window, policy, prefix)
            for layer in range(2):
                for head in range(2):
                    assert kept[layer][head].numel() == round(ratio * prefix)
                    errors = _reference_errors(
                        q[layer, 2 * head : 2 * head + 2], k[layer, head], v[layer, head], kept[layer][head], w
                    )
                    expected[r, :, layer, head] += np.array(errors) / 2
    np.testing.assert_allclose(result["errors"], expected, rtol=1e-4, atol=1e-6)


def test_a_scorer_reading_every_prompt_query_needs_no_longer_prefix(one_thread):
    """LeverageScorer reads the chunked attention of every prompt query (computed from the captured
    queries here): the prefix only has to hold the observation window and the protected rows."""
    from runtime.scorers import LeverageScorer

    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=2)
    windows = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(9))
    options = dict(keep_ratios=(0.5,), query_window=8, observation_window=8, n_sink=2, recent_window=4, progress=False)
    result = measure_correction_errors(model, windows, scorer=LeverageScorer(blend=0.5), **options)
    assert result.selection == "leverage" and result["errors"].shape == (1, 3, 2, 2)
    with pytest.raises(ValueError, match="too short"):
        measure_correction_errors(model, windows[:, :15], scorer=LeverageScorer(), **options)  # prefix 7 < 8


def test_selections_sharing_one_forward_pass_measure_what_each_measures_alone(one_thread):
    """The moments stage measures every served selector over one captured pass per window: each
    selection's errors are bit for bit those of a run of its own; a selection given twice is refused."""
    from profiler.moments import measure_correction_errors_by_selection

    model = make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=3)
    windows = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(4))
    generator = torch.Generator().manual_seed(5)
    learned = (torch.randn(2, 2, 32, generator=generator).numpy(), torch.randn(2, 2, generator=generator).numpy())
    options = dict(keep_ratios=(0.25, 0.5), query_window=16, n_sink=2, recent_window=4, progress=False)
    selections = [("leverage", "uniform"), ("keydiff", "uniform"), ("learned", "global")]
    together = measure_correction_errors_by_selection(model, windows, selections, learned=learned, **options)
    assert [(r.selection, r.allocation) for r in together] == selections
    for (scorer, allocation), shared in zip(selections, together, strict=True):
        alone = measure_correction_errors(
            model, windows, scorer=scorer, allocation=allocation, learned=learned, **options
        )
        assert shared.scorer == alone.scorer and shared.seconds > 0
        for key in alone:
            np.testing.assert_array_equal(shared[key], alone[key])
    assert not np.array_equal(together[0]["errors"], together[1]["errors"])
    with pytest.raises(ValueError, match="given twice"):
        measure_correction_errors_by_selection(model, windows, [("keydiff", "uniform")] * 2, **options)
    with pytest.raises(ValueError, match="unknown selection scorer 'h2o'"):
        measure_correction_errors_by_selection(model, windows, [("keydiff", "uniform"), ("h2o", "uniform")], **options)


def test_embedded_model_orders_under_the_flagships_selector(embedded_model, embedded_tokenizer, one_thread):
    """On the real model, the flagship's selector (leverage, blend = the evicted fraction) and KeyDiff
    measured over shared forward passes: they keep different tokens, so their errors differ, and under
    leverage the calibrated orders still beat no correction at 75% compression."""
    from needles import prose_haystack
    from profiler.moments import measure_correction_errors_by_selection

    windows, total = 2, 256
    text = prose_haystack(embedded_tokenizer, windows * total + 16, seed=2)
    ids = np.asarray(embedded_tokenizer(text, add_special_tokens=False)["input_ids"][: windows * total])
    leverage, keydiff = measure_correction_errors_by_selection(
        embedded_model,
        ids.reshape(windows, total),
        [("leverage", "uniform"), ("keydiff", "uniform")],
        keep_ratios=(0.25, 0.5),
        query_window=32,
        progress=False,
    )
    assert leverage.selection == "leverage" and "blend=0.75" in leverage.scorer
    assert leverage["errors"].shape == keydiff["errors"].shape == (2, 3, 30, 3)
    assert np.all(np.isfinite(leverage["errors"])) and not np.allclose(leverage["errors"], keydiff["errors"])
    errors = leverage["errors"][0]  # keep 0.25: [3, L, Hkv]
    chosen = np.take_along_axis(errors, (leverage["order"].astype(np.int64) + 1)[None], axis=0)[0]
    print(
        f"leverage, keep 0.25: uncorrected {errors[0].mean():.4f}, calibrated orders {chosen.mean():.4f}; "
        f"keydiff: uncorrected {keydiff['errors'][0, 0].mean():.4f}; orders differ in "
        f"{int((leverage['order'] != keydiff['order']).sum())} of 90 heads"
    )
    assert chosen.mean() < errors[0].mean()
