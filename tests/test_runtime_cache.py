"""The ragged cache inside real forward passes and generate()."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from runtime import CompressionPolicy, RaggedCache, compress_prompt, generate, ragged_attention
from runtime.compression.prefill import compress, prefill
from runtime.kv_store.cache import ATTENTION_NAME
from runtime.kv_store.transformers_compat import cache_argument
from runtime.plan.calibration import Calibration

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def inf_calibration(layers: int, kv_heads: int, seed: int = 0) -> Calibration:
    """An in-memory calibration with only (skewed) INF weights: per-head budgets differ."""
    weights = np.random.default_rng(seed).random((layers, kv_heads)) ** 3
    return Calibration(
        path=Path("memory"), identity=None, config={}, sections=("budgets",), inf_weights=weights / weights.sum()
    )


@torch.no_grad()
def test_full_budget_matches_unmodified_tiny_model_logits_and_tokens():
    model = make_tiny_llama(num_layers=3)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    reference = model(ids).logits
    reference_tokens = model.generate(ids, max_new_tokens=12, do_sample=False)
    policy = CompressionPolicy(budget=1000, scorer="keydiff")
    with ragged_attention(model):
        cache, report = compress_prompt(model, ids, policy, context_columns=25)
        assert (report.lengths_after == 25).all()
        logits = model(ids[:, 25:], **cache_argument(model, cache)).logits
        result = generate(model, ids, policy, context_columns=25, max_new_tokens=12)
    assert model.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(logits, reference[:, 25:], atol=1e-5, rtol=0)
    assert torch.equal(result.sequences, reference_tokens)


@torch.no_grad()
def test_ragged_attention_falls_back_to_sdpa_without_ragged_cache():
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    reference = model(ids, attention_mask=mask).logits
    with ragged_attention(model):
        assert model.config._attn_implementation == ATTENTION_NAME
        logits = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[mask.bool()], reference[mask.bool()], atol=1e-6, rtol=0)


def masked_reference_logits(model, ids, evicted: dict[int, torch.Tensor], context: int):
    """Full attention over ``ids [1, T]`` where queries at positions >= ``context`` cannot see the
    evicted context positions of their KV head (``evicted[layer]``: bool ``[Hkv, context]``); with the
    layer's sliding window and each query head's learned sink logit in the softmax where the model passes
    them (``sliding_window``, gpt-oss's ``s_aux``)."""
    name = "kvcal_test_masked_reference"

    def masked_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        group = query.shape[1] // key.shape[1]
        total = key.shape[2]
        position = torch.arange(total)
        allowed = position[None, :] <= position[:, None]  # causal [T, T]
        if kwargs.get("sliding_window") is not None:
            allowed &= position[:, None] - position[None, :] < kwargs["sliding_window"]
        allowed = allowed.expand(key.shape[1], total, total).clone()  # [Hkv, T, T]
        allowed[:, context:, :context] &= ~evicted[module.layer_idx].unsqueeze(1)
        allowed = allowed.repeat_interleave(group, dim=0)  # [Hq, T, T]
        logits = (query @ key.repeat_interleave(group, 1).transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~allowed, float("-inf"))  # [1, Hq, T, T]
        if kwargs.get("s_aux") is None:
            weights = torch.softmax(logits, dim=-1)
        else:  # the sink's logit takes part in the softmax, its weight dropped
            sink = kwargs["s_aux"].reshape(1, -1, 1, 1).expand(1, query.shape[1], total, 1)
            weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        return (weights @ value.repeat_interleave(group, 1)).transpose(1, 2), None

    AttentionInterface.register(name, masked_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        return model(ids).logits
    finally:
        model.set_attn_implementation(previous)


def evicted_context(cache, row: int, context: int) -> dict[int, torch.Tensor]:
    """Per layer, which of the first ``context`` positions each KV head of batch row ``row`` no longer holds:
    bool ``[Hkv, context]`` (what :func:`masked_reference_logits` hides)."""
    evicted = {}
    for index, layer in enumerate(cache.layers):
        hidden = torch.ones(layer.store.num_heads, context, dtype=torch.bool)
        for head in range(layer.store.num_heads):
            kept = layer.head(row, head)[2].long()
            hidden[head, kept[kept < context]] = False
        evicted[index] = hidden
    return evicted


@torch.no_grad()
@pytest.mark.parametrize("scorer", ["keydiff", "snapkv"])
def test_pruned_cache_equals_masked_full_attention(scorer):
    model = make_tiny_llama(num_layers=3, num_heads=6, num_kv_heads=3)
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(2))
    context = 36
    calibration = inf_calibration(3, 3)
    policy = CompressionPolicy(budget=14, allocation="inf", scorer=scorer, n_sink=2, window=4)
    with ragged_attention(model):
        cache, report = compress_prompt(model, ids, policy, context_columns=context, calibration=calibration)
        logits = model(ids[:, context:], **cache_argument(model, cache)).logits
    lengths = report.lengths_after[:, 0]  # [L, Hkv]
    assert len(np.unique(lengths)) > 1  # heads really keep different numbers of tokens
    reference = masked_reference_logits(model, ids, evicted_context(cache, 0, context), context)
    torch.testing.assert_close(logits, reference[:, context:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("rows_alike", [True, False], ids=["heads-alike-across-rows", "rows-differ"])
def test_decode_steps_over_unequal_heads_equal_masked_full_attention(rows_alike, monkeypatch):
    """Decode steps of a batch whose heads keep different numbers of tokens (INF budgets): every
    row's logits as full attention with its evicted positions masked.  Rows of equal length give
    each KV head the same budget in every row (read as one strided view per head); with decode-time
    capacities made unequal between rows, each segment is read alone; with the live-row calls
    capped at 0, the masked pages."""
    import runtime.kv_store.layer_attention

    model = make_tiny_llama(num_layers=3, num_heads=6, num_kv_heads=3)
    generator = torch.Generator().manual_seed(5)
    context, steps = 40, 5
    ids = torch.randint(0, 128, (3, context + steps), generator=generator)
    policy = CompressionPolicy(budget=14, allocation="inf", scorer="keydiff", n_sink=2, window=4)
    for calls in (8, 0):  # live rows, then the pages
        monkeypatch.setattr(runtime.kv_store.layer_attention, "LIVE_ROW_CALLS", calls)
        with ragged_attention(model):
            cache, report = compress_prompt(
                model, ids, policy, context_columns=context, calibration=inf_calibration(3, 3)
            )
            if not rows_alike:  # row 1 keeps one token fewer in head 0 of every layer
                for layer in cache.layers:
                    keys = layer.head(1, 0)[0]
                    layer.store.keep(1, 0, torch.arange(keys.shape[0] - 1), shrink=False)
            logits = torch.cat(
                [
                    model(ids[:, t : t + 1], **cache_argument(model, cache)).logits
                    for t in range(context, context + steps)
                ],
                dim=1,
            )
        assert len(np.unique(report.lengths_after[:, 0])) > 1  # heads keep different numbers of tokens
        for row in range(3):
            reference = masked_reference_logits(
                model, ids[row : row + 1], evicted_context(cache, row, context), context
            )
            torch.testing.assert_close(logits[row], reference[0, context:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_per_head_lengths_differ_and_memory_matches_budget_formula():
    model = make_tiny_llama(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(3))
    policy = CompressionPolicy(keep_ratio=0.25, allocation="inf", scorer="knorm")
    with ragged_attention(model):
        cache, report = compress_prompt(model, ids, policy, context_columns=299, calibration=inf_calibration(4, 2))
        full_cache, _ = compress_prompt(model, ids, None, context_columns=299)
        budgets = report.budgets[0]  # [L, Hkv]
        assert budgets.sum() == round(0.25 * 299 * 4 * 2)  # REAL conserves the total exactly
        assert len(np.unique(budgets)) > 2
        assert np.array_equal(cache.head_lengths()[:, 0].numpy(), budgets)
        bytes_per_token = 2 * 32 * 4
        assert cache.bytes_per_token() == bytes_per_token
        assert cache.kv_bytes() <= 1.05 * budgets.sum() * bytes_per_token
        # right after eviction every head's capacity is its budget rounded up to the layer's page
        # (a power of two <= a sixteenth of the mean budget)
        for layer, row in zip(cache.layers, budgets, strict=True):
            page = layer.page_size
            assert page & (page - 1) == 0 and page <= max(1, row.mean() / 16)
            assert layer.capacity[0].tolist() == [-(-int(b) // page) * page for b in row]
        assert cache.kv_bytes() == int(sum(layer.capacity.sum() for layer in cache.layers)) * bytes_per_token
        assert cache.kv_bytes() <= 0.27 * full_cache.kv_bytes()
        # positions continue from the logical length, and decoding keeps the slack small
        assert cache.get_seq_length() == 299
        out = model.generate(ids, **cache_argument(model, cache), max_new_tokens=20, do_sample=False)
    assert out.shape[1] == 320
    assert cache.get_seq_length() == 319
    grown = budgets + 1 + 19  # the last prompt token and 19 generated ones were appended
    assert np.array_equal(cache.head_lengths()[:, 0].numpy(), grown)
    slack = sum(max(16, int(g) // 32) + 64 for g in grown.reshape(-1))  # + page rounding (pages <= 64 rows)
    assert cache.kv_bytes() <= (grown.sum() + slack) * bytes_per_token


@torch.no_grad()
def test_positions_continue_after_eviction():
    """A token fed after eviction is rotated at its true position: matches a manual check of
    the stored key against the unmodified model's key at that position."""
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(4))
    policy = CompressionPolicy(budget=6, scorer="streaming", n_sink=2, window=2)
    with ragged_attention(model):
        cache, _ = compress_prompt(model, ids, policy, context_columns=29)
        model(ids[:, 29:], **cache_argument(model, cache))
    reference = {}
    hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda module, inputs, output: reference.setdefault("k", output)
    )
    try:
        model(ids)
    finally:
        hook.remove()
    cos, sin = model.model.rotary_emb(ids[:, :1].float(), torch.tensor([[29]]))
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    raw = reference["k"][:, 29:30].view(1, 1, 2, 16).transpose(1, 2)
    rotated, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    keys, _, positions = cache.layers[0].head(0, 1)
    assert positions.tolist() == [0, 1, 25, 26, 27, 28, 29]
    torch.testing.assert_close(keys[-1], rotated[0, 1, 0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_left_padded_batch_gives_the_same_answers_as_one_by_one():
    model = make_tiny_llama(num_layers=2)
    generator = torch.Generator().manual_seed(5)
    contexts = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (30, 22, 27)]
    questions = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in (4, 7, 5)]
    calibration = inf_calibration(2, 2)
    from runtime.serve.generation import build_inputs

    for question_aware in (False, True):
        policy = CompressionPolicy(keep_ratio=0.5, allocation="inf", scorer="snapkv", window=4, n_sink=1)
        ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)
        batch = generate(
            model,
            ids,
            policy,
            attention_mask=mask,
            calibration=calibration,
            context_columns=None if question_aware else columns,
            max_new_tokens=6,
            pad_token_id=0,
        )
        for row, (context, question) in enumerate(zip(contexts, questions, strict=True)):
            single_ids = torch.tensor([context + question])
            single = generate(
                model,
                single_ids,
                policy,
                calibration=calibration,
                context_columns=None if question_aware else len(context),
                max_new_tokens=6,
            )
            assert batch.new_tokens[row].tolist() == single.new_tokens[0].tolist()
            lengths_batch = batch.report.lengths_after[:, row]
            assert np.array_equal(lengths_batch, single.report.lengths_after[:, 0])


@torch.no_grad()
def test_sampled_generation_runs_and_is_reproducible():
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(6))
    policy = CompressionPolicy(keep_ratio=0.3, scorer="keydiff")
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(
            generate(
                model, ids, policy, context_columns=32, max_new_tokens=10, do_sample=True, temperature=1.5, top_k=0
            ).new_tokens
        )
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (1, 10)


@torch.no_grad()
def test_cache_without_ragged_attention_is_an_error():
    model = make_tiny_llama()
    cache = RaggedCache.for_model(model)
    with pytest.raises(RuntimeError, match="it runs 'sdpa': wrap the call in `with runtime.ragged_attention"):
        model(torch.arange(5).unsqueeze(0), **cache_argument(model, cache))  # refused before attending anything
    assert cache.get_seq_length() == 0
    bare = RaggedCache(len(model.model.layers))  # built without the model: caught at the next chunk
    with pytest.raises(RuntimeError, match="never attended"):
        model(torch.arange(5).unsqueeze(0), **cache_argument(model, bare))
        model(torch.arange(5).unsqueeze(0), **cache_argument(model, bare))
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="cache is empty"):
        compress(model, RaggedCache.for_model(model), CompressionPolicy(budget=3, scorer="knorm"))


@torch.no_grad()
def test_embedded_model_full_budget_is_identical(embedded_model, embedded_tokenizer):
    """Budget >= length: the same logits as the unmodified model fed the same way (one pass,
    or prefix + chunk through a DynamicCache), and the same generated tokens."""
    model, tokenizer = embedded_model, embedded_tokenizer
    messages = [
        {
            "role": "user",
            "content": "The special magic number for Alice is 4721. Bob likes tea. "
            "What is the special magic number for Alice?",
        }
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    columns = ids.shape[1] - 12
    reference = model(ids).logits
    dynamic = DynamicCache(config=model.config)
    model(ids[:, :columns], **cache_argument(model, dynamic))
    reference_split = model(ids[:, columns:], **cache_argument(model, dynamic)).logits
    reference_tokens = model.generate(ids, max_new_tokens=12, do_sample=False)
    policy = CompressionPolicy(keep_ratio=1.0, scorer="keydiff")
    with ragged_attention(model):
        logits = model(ids, **cache_argument(model, RaggedCache.for_model(model))).logits
        cache, report = compress_prompt(model, ids, policy, context_columns=columns)
        assert (report.lengths_after == columns).all()
        logits_split = model(ids[:, columns:], **cache_argument(model, cache)).logits
        result = generate(model, ids, policy, context_columns=columns, max_new_tokens=12)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    # The second chunk attends through the packed pages (a different float32 summation order than
    # SDPA over one tensor): DynamicCache's own split-vs-whole difference here is 4.6e-5, and
    # both stay within 6e-5 of a float64 run of the model.
    torch.testing.assert_close(logits_split, reference_split, atol=1e-4, rtol=0)
    assert torch.equal(result.sequences, reference_tokens)
    assert "4721" in tokenizer.decode(result.new_tokens[0])
    # sampled decoding draws the same tokens as the unmodified model from the same seed
    torch.manual_seed(7)
    reference_sampled = model.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.3, top_k=0, top_p=1.0)
    torch.manual_seed(7)
    sampled = generate(
        model,
        ids,
        policy,
        context_columns=columns,
        max_new_tokens=8,
        do_sample=True,
        temperature=1.3,
        top_k=0,
        top_p=1.0,
    )
    assert torch.equal(sampled.sequences, reference_sampled)


@torch.no_grad()
def test_copies_of_one_prefill_compress_independently_and_stack_into_a_batch():
    """One prefill, several policies: copies evict independently; stacked into one batch they
    decode exactly like each copy on its own."""
    model = make_tiny_llama()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(8))
    base = RaggedCache.for_model(model)
    stats = prefill(model, base, ids[:, :32], record_prompt_stats=True, observe_queries=8, n_sink=2)
    policies = [
        CompressionPolicy(scorer="expected_attention", keep_ratio=0.5, statistics="prompt"),
        CompressionPolicy(budget=6, scorer="snapkv", scorer_options={"window": 8}),
    ]
    caches = []
    for policy in policies:
        cache = base.copy()
        compress(model, cache, policy, prompt_stats=stats)
        caches.append(cache)
    assert (base.head_lengths() == 32).all()  # the original is untouched
    assert (caches[0].head_lengths() == 16).all() and (caches[1].head_lengths() == 6).all()
    with ragged_attention(model):
        singles = [
            model.generate(ids, **cache_argument(model, cache.copy()), max_new_tokens=5, do_sample=False)
            for cache in caches + [base]
        ]
        batch = RaggedCache.stack(caches + [base])
        stacked = model.generate(ids.expand(3, -1), **cache_argument(model, batch), max_new_tokens=5, do_sample=False)
    for row, single in enumerate(singles):
        assert stacked[row].tolist() == single[0].tolist()


@torch.no_grad()
def test_blockwise_prefill_never_holds_more_than_budget_plus_block():
    model = make_tiny_llama()
    generator = torch.Generator().manual_seed(9)
    ids = torch.randint(1, 128, (2, 50), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    seen = []
    original = RaggedCache.head_lengths

    def spy(self):
        lengths = original(self)
        seen.append(lengths.clone())
        return lengths

    policy = CompressionPolicy(budget=10, scorer="keydiff", n_sink=2, window=3)
    RaggedCache.head_lengths = spy
    try:
        result = generate(
            model, ids, policy, attention_mask=mask, context_columns=45, block_size=8, max_new_tokens=3, pad_token_id=0
        )
    finally:
        RaggedCache.head_lengths = original
    assert max(int(lengths.max()) for lengths in seen) <= 10 + 8
    assert (result.report.lengths_after == 10).all()
    for row, real in ((0, 45), (1, 39)):
        positions = result.cache.layers[1].head(row, 0)[2].tolist()
        assert positions[:2] == [0, 1] and positions[7:10] == [real - 3, real - 2, real - 1]  # sinks, window
        assert positions[10:] == list(range(real, real + 7))  # question (5) + generated (2) follow
        assert positions == sorted(set(positions))


class _RecordingHook:
    """A decode-eviction hook that records its calls and cuts nothing."""

    def __init__(self):
        self.calls = []

    def evict_decoded(self, layer, layer_idx, rows, budgets, next_positions, stats_rows):
        self.calls.append((layer_idx, list(rows), budgets.clone(), list(next_positions), list(stats_rows)))

    def layer_done(self, layer_idx):
        self.calls.append(("done", layer_idx))


def test_decode_eviction_goes_through_the_typed_hook():
    """The eviction driver calls DecodeEvictionHook.evict_decoded once per hook, for the rows holding
    a head `every` tokens past its budget, with the budget where due and the head's length elsewhere,
    then tells the hook the layer is done; the storage itself never calls a hook."""
    from runtime.compression.driver import DecodePlan, due_evictions
    from runtime.kv_store.cache import RowState

    with pytest.raises(TypeError, match="evict_decoded and layer_done"):
        DecodePlan(object(), np.zeros((1, 2), dtype=np.int64), 2, 0)
    first, second = _RecordingHook(), _RecordingHook()
    budgets = np.array([[4, 6], [5, 5]], dtype=np.int64)  # [L, Hkv]
    states = [
        RowState(real_seen=30, decode_plan=DecodePlan(first, budgets, 2, 7)),
        RowState(real_seen=31),
        RowState(real_seen=32, decode_plan=DecodePlan(first, budgets, 2, 8)),
        RowState(real_seen=33, decode_plan=DecodePlan(second, budgets, 2, 9)),
    ]
    lengths = torch.tensor([[6, 7], [9, 9], [5, 8], [5, 7]])  # [B, Hkv]
    due = due_evictions(states, lengths, 0)
    assert [(d.hook, d.rows, d.budgets.tolist(), d.next_positions, d.stats_rows) for d in due] == [
        (first, [0, 2], [[4, 7], [5, 6]], [30, 32], [7, 8])
    ]
    assert due_evictions(states, lengths, 1)[0].rows == [0, 2]  # layer 1: budgets 5, 5
    # through a model: after every layer's attention, the hook evicts, then hears the layer is done
    model = make_tiny_llama(num_layers=2)
    hook = _RecordingHook()
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with ragged_attention(model):
        cache = RaggedCache.for_model(model)
        prefill(model, cache, ids)
        cache.set_decode_plan(DecodePlan(hook, np.full((2, 2), 3, dtype=np.int64), 1, 0), row=0)
        model(torch.tensor([[5]]), **cache_argument(model, cache))
    calls = [call if call[0] == "done" else (call[0], call[1], call[2].tolist(), call[3]) for call in hook.calls]
    assert calls == [(0, [0], [[3, 3]], [13]), ("done", 0), (1, [0], [[3, 3]], [13]), ("done", 1)]


def test_a_decode_round_is_finished_once_after_the_last_layer_and_never_left_open():
    """HeadEvictor.layer_done reads a round's deferred NaN checks back once, after the plan's last
    layer, and refuses a round that a step left before its last layer."""
    from runtime.compression.eviction import HeadEvictor
    from runtime.plan.serving_plan import bind

    model = make_tiny_llama(num_layers=3)
    evictor = HeadEvictor(bind(CompressionPolicy(scorer="keydiff", keep_ratio=0.5), None, model))
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    clean, poisoned = torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)
    poisoned[0, 1, 2] = float("nan")
    for layer in range(3):  # a clean round: nothing raised
        evictor.checked_scores(clean, valid, layer, defer=True)
        evictor.layer_done(layer)
    evictor.checked_scores(clean, valid, 0, defer=True)
    evictor.layer_done(0)
    evictor.checked_scores(poisoned, valid, 1, defer=True)  # deferred: not read back yet
    evictor.layer_done(1)
    with pytest.raises(ValueError, match="NaN scores for layer 1, KV head 1"):
        evictor.layer_done(2)
    evictor.checked_scores(poisoned, valid, 0, defer=True)
    evictor.layer_done(0)
    evictor.layer_done(1)  # the step ends here: layer 2 never attends
    with pytest.raises(RuntimeError, match="never finished"):
        evictor.layer_done(0)


@torch.no_grad()
def test_decode_steps_derive_the_page_layout_once_per_storage_generation(monkeypatch):
    """The page tables are derived from the storage when it is repacked, not on every decode step:
    over steps that fit in the segments' slack every layer reads the layout it already built."""
    import runtime.kv_store.cache
    from runtime.kv_store.layout import PageLayout

    built = []  # (layer_idx, store generation) of every PageLayout.build
    real_build = PageLayout.build

    def counting_build(offset, capacity, page_size, buffer_rows, device):
        layer = next(layer for layer in cache.layers if layer.store is not None and layer.store.offset is offset)
        built.append((layer.layer_idx, layer.store.generation))
        return real_build(offset, capacity, page_size, buffer_rows, device)

    model = make_tiny_llama(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    ids = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(4))
    policy = CompressionPolicy(keep_ratio=0.25, allocation="inf", scorer="keydiff")
    with ragged_attention(model):
        cache = RaggedCache.for_model(model)
        prefill(model, cache, ids)
        compress(model, cache, policy, inf_calibration(3, 2))
        monkeypatch.setattr(runtime.kv_store.cache.PageLayout, "build", staticmethod(counting_build))
        token = torch.tensor([[5], [7]])
        generations = []  # [step][layer]
        for _ in range(12):
            token = model(token, **cache_argument(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
            generations.append([layer.store.generation for layer in cache.layers])
    assert len(built) == len(set(built))  # no generation's layout built twice
    repacked = {(index, g) for step in generations for index, g in enumerate(step)}
    assert set(built) == repacked  # every generation decoded from was built once, nothing else
    # the first step repacks every layer (compress compacted to the budgets, no slack left); the
    # slack then carries the next steps without a repack: those steps build nothing
    assert all(generations[step] == generations[1] for step in range(2, 12))
