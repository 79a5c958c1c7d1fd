"""The profiler at user scale (issue 28): no stage holds a term that grows with the context squared,
nor one it never reads (docs/design.md "The profiler at user scale").

Every chunked computation is checked against the unchunked one (or a direct reference) on tiny
inputs, with chunks of one row and a chunk boundary at the last token; the passes that only capture
attention are checked not to compute the vocabulary logits ``[T, V]`` they never read.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from needles.probe import Probe, Span


def _direct_reconstruction_importance(query, key, context, scale):
    """KVzip's teacher from the whole causal attention matrix ``[Hq, T, T]`` at once (float64)."""
    num_q, total, _ = query.shape
    group = num_q // key.shape[0]
    keys = key.double().repeat_interleave(group, dim=0)  # [Hq, T, d]
    logits = scale * query.double() @ keys.transpose(1, 2)  # [Hq, T, T]
    causal = torch.ones(total, total, dtype=torch.bool).tril()
    weights = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    best = weights[:, context:, :context].amax(dim=1)  # [Hq, C]: over the reconstruction queries
    return best.reshape(key.shape[0], group, context).amax(dim=1).log()  # [Hkv, C]


@pytest.mark.parametrize(
    "chunk, max_logits",
    [
        (256, 2**26),  # one chunk: every reconstruction query at once
        (4, 2**26),  # 13 queries in chunks of 4: a chunk of one at the last token
        (256, 1),  # the logits bound: one query per chunk
        (256, 6 * 30 * 5),  # the bound: 5 queries over the 30 keys of 6 heads, then 3 at the end
    ],
)
def test_the_teacher_in_bounded_chunks_equals_the_whole_attention_matrix(chunk, max_logits):
    from profiler.learned_scorer import reconstruction_importance

    generator = torch.Generator().manual_seed(4)
    num_q, num_kv, total, context, dim, scale = 6, 2, 30, 17, 8, 0.4
    query = torch.randn(num_q, total, dim, generator=generator)
    key = torch.randn(num_kv, total, dim, generator=generator)
    got = reconstruction_importance(query, key, context, scale, chunk=chunk, max_logits=max_logits)
    want = _direct_reconstruction_importance(query, key, context, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _lm_head_calls(model):
    """A list that grows by one at every call of ``model``'s output head (the logits ``[B, T, V]``)."""
    calls = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: calls.append(tuple(output.shape)))
    return calls


def test_the_moments_calibration_never_computes_the_vocabulary_logits():
    from profiler.moments import measure_correction_errors_by_selection

    model = make_tiny_llama(num_layers=2, seed=3)
    calls = _lm_head_calls(model)
    windows = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    measure_correction_errors_by_selection(
        model, windows, [("leverage", "uniform"), ("keydiff", "uniform")], query_window=16, progress=False
    )
    assert calls == []


def test_the_budget_curves_never_compute_the_vocabulary_logits():
    from profiler.budget_curves import measure_curves

    model = make_tiny_llama(num_layers=2, seed=3)
    calls = _lm_head_calls(model)
    windows = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    probe = Probe("p", "hand", 80, 50.0, 0, "q?", "zebra", ids, [Span("R", 30, 34)], context_end=70)
    measure_curves(model, windows, [probe], progress=False)
    measure_curves(model, windows, [probe], answers=[[5, 6]], progress=False)
    assert calls == []


def _attention_inputs(batch=2, q_heads=6, kv_heads=2, q_len=9, k_len=9, dim=8, seed=5):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, q_len, dim, generator=generator) * 3  # large logits: the cap bites
    key, value = (torch.randn(batch, kv_heads, k_len, dim, generator=generator) for _ in range(2))
    return query, key, value


def _padded_mask(batch, q_len, k_len):
    """bool ``[B, 1, q, k]``: causal (bottom-right aligned), row 1's first 3 tokens padding (its first
    queries see no real key: transformers' fully masked rows)."""
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
    mask = causal.expand(batch, 1, q_len, k_len).clone()
    mask[1, :, :, :3] = False
    return mask


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize(
    "kind, q_len, k_len",
    [
        ("causal", 9, 9),  # no mask: the causal pattern made per block
        ("bool", 9, 13),  # queries after a cached prefix, padding
        ("float", 9, 13),  # the same as an additive float mask
        ("decode", 1, 13),  # one query, a [B, 1, 1, k] mask
    ],
)
@pytest.mark.parametrize("max_logits", [1, 2 * 6 * 13 * 4, 2 * 6 * 9 * 8])
def test_the_reference_attention_in_query_blocks_equals_the_whole_matrix(kind, q_len, k_len, softcap, max_logits):
    """Blocks of one query, of 4 (a block of one at the last query of 9) and of 8 against one block."""
    from runtime.kv_store.eager_attention import eager_attention_forward

    query, key, value = _attention_inputs(q_len=q_len, k_len=k_len)
    mask = None if kind == "causal" else _padded_mask(2, q_len, k_len)
    if kind == "float":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    whole, _ = eager_attention_forward(None, query, key, value, mask, scaling=0.3, softcap=softcap, max_logits=2**30)
    blocks, _ = eager_attention_forward(
        None, query, key, value, mask, scaling=0.3, softcap=softcap, max_logits=max_logits
    )
    assert blocks.shape == (2, q_len, 6, 8)
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-6)
    if kind == "causal":  # and the whole matrix is the causal attention itself
        want = torch.ones(q_len, k_len, dtype=torch.bool).tril()
        weights = torch.softmax(
            _capped(0.3 * query @ key.repeat_interleave(3, dim=1).transpose(-1, -2), softcap).masked_fill(
                ~want, float("-inf")
            ),
            dim=-1,
        )
        direct = (weights @ value.repeat_interleave(3, dim=1)).transpose(1, 2)  # [B, q, Hq, d]
        torch.testing.assert_close(whole, direct, rtol=1e-5, atol=1e-6)


def _capped(logits, softcap):
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def _held_out_reference(sums, windows, ridge_grid):
    """The learned-scorer stage's choice as it was: every held-out window's features concatenated first."""
    import numpy as np

    from profiler.learned_scorer import predict, r_squared, spearman

    layers, heads = len(sums), windows[0][0].teacher.shape[0]
    best = {name: np.zeros((layers, heads)) for name in ("ridge", "r2", "rank_correlation", "bias")}
    best["rank_correlation"][:] = -2.0
    best["weights"] = np.zeros((layers, heads, windows[0][0].kv.shape[-1]))
    for layer in range(layers):
        teacher = torch.cat([w[layer].teacher for w in windows], dim=1).double().numpy()  # [Hkv, n]
        features = torch.cat([w[layer].kv for w in windows], dim=1).double().numpy()  # [Hkv, n, F]
        for ridge in ridge_grid:
            solution = sums[layer].solve(ridge)
            prediction = predict(solution, features)[:, :, 0]
            for head in range(heads):
                rho = spearman(prediction[head], teacher[head])
                if rho > best["rank_correlation"][layer, head]:
                    best["rank_correlation"][layer, head] = rho
                    best["r2"][layer, head] = r_squared(prediction[head], teacher[head])
                    best["ridge"][layer, head] = ridge
                    best["weights"][layer, head] = solution[head, :-1, 0]
                    best["bias"][layer, head] = solution[head, -1, 0]
    return best


def test_the_held_out_choice_streams_windows_and_equals_choosing_over_their_concatenation():
    import gc
    import weakref

    import numpy as np

    from profiler.learned_scorer import RIDGE_GRID, RidgeSums, WindowRecord, held_out_choice

    generator = torch.Generator().manual_seed(6)
    layers, heads, features = 2, 3, 8
    truth = torch.randn(layers, heads, features, generator=generator)

    def window(length):  # per layer: a teacher that a linear map of the features explains in part
        records = []
        for layer in range(layers):
            kv = torch.randn(heads, length, features, generator=generator)
            noise = torch.randn(heads, length, generator=generator)
            records.append(WindowRecord(teacher=(kv @ truth[layer].unsqueeze(-1))[..., 0] + 2 * noise, kv=kv))
        return records

    sums = [RidgeSums(heads, features, 1) for _ in range(layers)]
    for _ in range(3):
        for layer, record in enumerate(window(40)):
            sums[layer].add(record.kv, record.teacher.unsqueeze(-1))
    held_out = [window(length) for length in (17, 5, 23)]  # unequal windows
    want = _held_out_reference(sums, held_out, RIDGE_GRID)

    released = []

    def stream():  # each window's features must be let go before the next one is recorded
        for records in held_out:
            copy = [WindowRecord(teacher=r.teacher.clone(), kv=r.kv.clone()) for r in records]
            released.append([weakref.ref(r.kv) for r in copy])
            yield copy
            del copy
            gc.collect()
            assert all(ref() is None for ref in released[-1]), "a held-out window's features were kept"

    got = held_out_choice(sums, stream())
    assert got["tokens"] == 17 + 5 + 23
    for name in ("ridge", "r2", "rank_correlation", "bias", "weights"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-12, err_msg=name)
    assert len(set(got["ridge"].ravel().tolist())) >= 1 and got["rank_correlation"].min() > 0


def test_the_reconstruction_pass_keeps_copies_of_the_context_rows_not_views_of_the_whole_pass():
    """record_window keeps the context rows of each layer's keys and values in storage of their own,
    not views holding the layer's whole ``[1, 2C + I, Hkv d]`` projection outputs until the pass ends."""
    from profiler.learned_scorer import context_rows, record_window

    for dtype in (torch.float32, torch.bfloat16):
        projection = torch.randn(1, 90, 4, 8).to(dtype)  # [1, 2C + I, Hkv, d]
        rows = context_rows(projection, 40)
        assert rows.dtype == torch.float32 and rows.shape == (40, 4, 8)
        assert rows.untyped_storage().nbytes() == rows.numel() * 4
        torch.testing.assert_close(rows, projection[0, :40].float())
    model = make_tiny_llama(num_layers=2, seed=2)
    context = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    records = record_window(model, context, torch.tensor([5, 6, 7]), hidden=True)
    config = model.config
    assert records[0].kv.shape == (config.num_key_value_heads, 40, 2 * config.head_dim)
    assert records[1].hidden.shape == (40, config.hidden_size) and records[1].hidden.dtype == torch.float32
