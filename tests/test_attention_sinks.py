"""Learned attention sinks (gpt-oss's ``s_aux``: a logit per query head that takes part in every softmax, its
value dropped; "gpt-oss-120b & gpt-oss-20b Model Card", arXiv 2508.10925): served exactly.

kvcal refused every model passing them (gpt-oss, Granite SWA, MiMo-V2-Flash...).  The references here are
the unmodified model (nothing evicted; and one evicted row per head that the order-1 correction restores
exactly) and a masked full attention with the sink's logit (rows evicted per head, in a chunk and in decode
steps by each CPU kernel).  The sinks are drawn between 2 and 7 (about the log-sum-exp of a few hundred
rows), so that they move every output; transformers initialises them near 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T
from test_rope_forms import COMMON, TOLERANCE, _prompt, assert_served_exactly
from test_runtime_cache import evicted_context, inf_calibration, masked_reference_logits

from runtime import CompressionPolicy, compress_prompt, generate, ragged_attention
from runtime.kv_store.transformers_compat import cache_argument

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def gpt_oss(seed: int = 0, **options):
    """A tiny gpt-oss (sliding layers of a 32-token window and full ones alternate, YaRN, biased projections,
    MoE) with sinks in [2, 7)."""
    torch.manual_seed(seed)
    options = dict(COMMON, max_position_embeddings=131072, sliding_window=32) | options  # YaRN: 32 x 4096
    config = T.GptOssConfig(**options, head_dim=16, num_local_experts=4)
    model = T.GptOssForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    generator = torch.Generator().manual_seed(seed + 1)
    for layer in model.model.layers:
        layer.self_attn.sinks.data = 2.0 + 5.0 * torch.rand(config.num_attention_heads, generator=generator)
    return model


@torch.no_grad()
def test_gpt_oss_is_served_exactly_and_its_sinks_count():
    """A left-padded batch of 300 columns (every sliding layer's 32-token window moves), 20 greedy steps:
    every step's logits are the model's own within 1e-4; without its sinks the model's logits move by more
    than 100x that, so the runtime computes them."""
    model = gpt_oss()
    assert_served_exactly(model)
    ids, mask = _prompt()
    with_sinks = model(ids, attention_mask=mask).logits
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    without = model(ids, attention_mask=mask).logits
    assert (with_sinks - without)[mask.bool()].abs().max() > 100 * TOLERANCE


@torch.no_grad()
@pytest.mark.parametrize("kernel", ["live_rows", "pages"])
def test_rows_evicted_per_head_equal_masked_attention_with_the_sinks(kernel, monkeypatch):
    """KV heads keep different numbers of rows (INF budgets); a chunk of 6 tokens after the compressed
    context, then 5 decode steps of a batch of 3, by the live-row kernel and by the pages: every row's
    logits as the masked reference's (tests/test_runtime_cache.py's, the sink's logit in its softmax; the
    window of 1024 never slides here, so the window masks pass through the windowed kernels hiding no row)."""
    import runtime.kv_store.layer_attention

    if kernel == "pages":
        monkeypatch.setenv("KVCAL_DECODE_KERNEL", "pages")
    monkeypatch.setattr(runtime.kv_store.layer_attention, "LIVE_ROW_CALLS", 8 if kernel == "live_rows" else 0)
    chosen = []
    decode_kernel = runtime.kv_store.layer_attention.decode_kernel
    monkeypatch.setattr(
        runtime.kv_store.layer_attention,
        "decode_kernel",
        lambda *a, **k: chosen.append(decode_kernel(*a, **k)) or chosen[-1],
    )
    model = gpt_oss(sliding_window=1024)
    context, chunk, steps = 40, 6, 5
    ids = torch.randint(3, 256, (3, context + chunk + steps), generator=torch.Generator().manual_seed(5))
    policy = CompressionPolicy(budget=14, allocation="inf", scorer="keydiff", n_sink=2, window=4)
    with ragged_attention(model):
        cache, report = compress_prompt(model, ids, policy, context_columns=context, calibration=inf_calibration(4, 2))
        logits = [model(ids[:, context : context + chunk], **cache_argument(model, cache)).logits]
        for t in range(context + chunk, context + chunk + steps):
            logits.append(model(ids[:, t : t + 1], **cache_argument(model, cache)).logits)
    logits = torch.cat(logits, dim=1)
    assert set(chosen) == {kernel}
    assert len(np.unique(report.lengths_after[:, 0])) > 1  # heads keep different numbers of rows
    for row in range(3):
        reference = masked_reference_logits(model, ids[row : row + 1], evicted_context(cache, row, context), context)
        torch.testing.assert_close(logits[row], reference[0, context:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_the_correction_divides_by_both_sets_and_the_sink():
    """One row evicted per head and the order-1 correction (tau 0): the evicted set's estimate is that row's
    own exp(s q.k) and value, so the merged attention is the full attention, and with the sink in the
    softmax (Z_R + Z_E + e^s below) the runtime's logits are the unmodified model's.  Without the
    correction they are not (the row is missing).  Every layer full (a sliding layer is never corrected)."""
    model = gpt_oss(layer_types=["full_attention"] * 4)  # sliding layers keep no moment sums
    ids, mask = _prompt()
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, attention_mask=mask, **options)
    one_row = dict(budget=250, scorer="keydiff", n_sink=0, window=1)
    differences = {}
    for correction in ("order1", "none"):
        policy = CompressionPolicy(**one_row, correction=correction, tau=0.0)
        got = generate(model, ids, policy, attention_mask=mask, context_columns=251, **options)
        evicted = got.report.lengths_before - got.report.lengths_after  # [L, B, Hkv]
        assert (evicted[:, 0] == 1).all() and (evicted[:, 1] == 0).all()  # row 1 holds 211 context tokens
        differences[correction] = max(
            (a - b).abs().max().item() for a, b in zip(got.output.logits, expected.logits, strict=True)
        )
    assert differences["order1"] < 1e-5 and 100 * differences["order1"] < differences["none"], differences


@pytest.mark.slow
@torch.no_grad()
def test_the_embedded_weights_with_learned_sinks_are_served_exactly(embedded_model, embedded_tokenizer):
    """The real embedded weights in Granite SWA's architecture (Llama's weight names; its multipliers at 1 and
    its attention scale d^-1/2, so it is SmolLM2 plus what Granite SWA adds): learned sinks between 1 and 4,
    three of every four layers sliding over 128 tokens, a 300-token prompt.  Nothing evicted, the runtime's
    greedy answer and every step's logits are transformers' own; one row evicted per head of its full layers
    and restored by the order-1 correction, still its own."""
    if not hasattr(T, "GraniteSWAConfig"):
        pytest.skip(f"transformers {T.__version__} has no Granite SWA")
    own = {k: v for k, v in embedded_model.config.to_dict().items() if k not in ("architectures", "model_type")}
    own.update(attention_multiplier=own["head_dim"] ** -0.5, sliding_window=128)
    model = T.GraniteSWAForCausalLM(T.GraniteSWAConfig(**own)).eval()
    missing, unexpected = model.load_state_dict(embedded_model.state_dict(), strict=False)
    assert not unexpected and all(name.endswith("self_attn.sinks") for name in missing)
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        layer.self_attn.sinks.data = 1.0 + 3.0 * torch.rand(layer.self_attn.sinks.shape, generator=generator)
    assert {model.config.embedding_multiplier, model.config.residual_multiplier, model.config.logits_scaling} == {1.0}
    model.generation_config.pad_token_id = embedded_tokenizer.pad_token_id or 0
    text = "The passcode is 4817. " + "The grass is green and the sky is blue. " * 30 + "What is the passcode?"
    ids = embedded_tokenizer(text, return_tensors="pt").input_ids[:, :300]
    options = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, **options)
    sinks = [layer.self_attn.sinks.data.clone() for layer in model.model.layers]
    for layer in model.model.layers:  # without them the model's logits move: the comparison would see them missing
        layer.self_attn.sinks.data.fill_(-1e4)
    assert (model(ids).logits[0, -1] - expected.logits[0][0]).abs().max() > 100 * TOLERANCE
    for layer, own_sinks in zip(model.model.layers, sinks, strict=True):
        layer.self_attn.sinks.data = own_sinks
    for policy in (None, CompressionPolicy(budget=ids.shape[1] - 2, scorer="keydiff", correction="order1", tau=0.0)):
        got = generate(model, ids, policy, context_columns=ids.shape[1] - 1, **options)
        difference = max((a - b).abs().max().item() for a, b in zip(got.output.logits, expected.logits, strict=True))
        assert difference < TOLERANCE, (policy, difference)
        assert torch.equal(got.sequences, expected.sequences)
        if policy is not None:  # the full layers held one row fewer per head
            evicted = got.report.lengths_before - got.report.lengths_after  # [L, 1, Hkv]
            full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
            assert (evicted[full] == 1).all() and evicted.sum() == evicted[full].sum()


@torch.no_grad()
def test_a_first_chunk_with_sinks_takes_a_kernel_with_its_log_sum_exp(monkeypatch):
    """A full layer's first chunk with learned sinks goes to the segment kernels, which give each query's
    log-sum-exp (here the CPU's flash kernel), not to the chunk-only path's eager reference (4.3x slower at 4K
    tokens of gpt-oss-20b's geometry: R-sink-prefill-2026-11-29); a sliding layer's takes the eager reference,
    which masks its window.
    Both are the model's own attention (the first tests)."""
    import runtime.kv_store.layer_attention as layer_attention

    eager_layers = []
    masked = layer_attention._masked_chunk_attention
    monkeypatch.setattr(
        layer_attention,
        "_masked_chunk_attention",
        lambda *args: eager_layers.append(args[6]) or masked(*args),  # the window
    )
    model = gpt_oss()  # sliding, full, sliding, full
    ids, mask = _prompt()
    compress_prompt(model, ids, None, attention_mask=mask)
    assert eager_layers == [32, 32]  # the two sliding layers, padding or not
