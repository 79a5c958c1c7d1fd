"""Eviction inside the prefill (``runtime.compression.prefill.prefill_and_compress``): each layer cut to its
budgets right after its attention, so that at most one layer's full cache exists at a time.

The reference is the two-step path it replaces, prefill then :func:`runtime.compression.prefill.compress`: the same
kept rows in every head, the same moment sums, the same greedy tokens and logits afterwards."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from tiny_architectures import make_tiny

from runtime import CompressionPolicy, RaggedCache, bind, compress_prompt, load_calibration, ragged_attention
from runtime.compression.prefill import compress, prefill, prefill_and_compress
from runtime.kv_store.transformers_compat import cache_argument
from runtime.plan.policy_spec import FLAGSHIP
from runtime.serve.generation import build_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

POLICIES = {
    "uniform/keydiff": CompressionPolicy(keep_ratio=0.25, scorer="keydiff"),
    "uniform/leverage (chunked attention)": CompressionPolicy(keep_ratio=0.25),
    "uniform/snapkv (recent queries)": CompressionPolicy(keep_ratio=0.3, scorer="snapkv"),
    "uniform/keydiff+order1 (moment sums)": CompressionPolicy(keep_ratio=0.25, scorer="keydiff", correction="order1"),
    "uniform/leverage, decode-time eviction": CompressionPolicy(budget=24, evict_every=3),
}


def left_padded_batch():
    generator = torch.Generator().manual_seed(5)
    contexts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (90, 61)]
    questions = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 8)]
    return build_inputs(contexts, questions, pad_token_id=0)  # ids, mask, context columns


def two_step(model, ids, mask, plan):
    cache = RaggedCache.for_model(model)
    stats = prefill(model, cache, ids, mask, policy=plan)
    report = compress(model, cache, plan, prompt_stats=stats)
    return cache, report


def one_step(model, ids, mask, plan):
    cache = RaggedCache.for_model(model)
    return cache, prefill_and_compress(model, cache, ids, mask, plan)


def assert_same_cache(ours: RaggedCache, reference: RaggedCache) -> None:
    for index, (mine, theirs) in enumerate(zip(ours.attention_layers, reference.attention_layers, strict=True)):
        assert mine.lengths == theirs.lengths, f"layer {index}"
        assert mine.real_seen == theirs.real_seen
        for b in range(mine.batch_size):
            for h in range(mine.num_heads):
                for a, c in zip(mine.head(b, h), theirs.head(b, h), strict=True):
                    assert torch.equal(a, c), f"layer {index} head ({b}, {h})"
            sums, expected = mine.rows[b].moments, theirs.rows[b].moments
            assert (sums is None) == (expected is None)
            if sums is not None:
                for name in ("n", "s_k", "s_v", "S_vk"):
                    torch.testing.assert_close(getattr(sums, name), getattr(expected, name), rtol=1e-6, atol=1e-6)


@torch.no_grad()
def greedy_logits(model, cache, ids, mask, steps=6):
    with ragged_attention(model):
        out = model.generate(
            ids,
            attention_mask=mask,
            **cache_argument(model, cache),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_logits=True,
        )
    return out.sequences, torch.stack(out.logits)


# the policies a model whose layers kvcal holds only in part (a hybrid's attention layers, Gemma 4's full ones) is
# checked under: keydiff, leverage with Compactor's chunked attention, SnapKV, keydiff with the order-1 correction
PARTIAL_LAYER_POLICIES = [
    CompressionPolicy(keep_ratio=0.25, scorer="keydiff"),
    CompressionPolicy(keep_ratio=0.25),
    CompressionPolicy(keep_ratio=0.3, scorer="snapkv"),
    CompressionPolicy(keep_ratio=0.25, scorer="keydiff", correction="order1"),
]


def assert_prefill_eviction_is_prefill_then_compress(model, policy, layers: int) -> None:
    """Evicting each of ``model``'s ``layers`` layers inside the prefill keeps what prefilling and then compressing
    keeps, on a left-padded batch, and greedy decoding from either cache agrees (logits within 1e-5)."""
    ids, mask, columns = left_padded_batch()
    plan = bind(policy, None, model)
    reference, expected = two_step(model, ids[:, :columns], mask[:, :columns], plan)
    cache, report = one_step(model, ids[:, :columns], mask[:, :columns], plan)
    assert_same_cache(cache, reference)
    assert (report.budgets == expected.budgets).all() and report.budgets.shape[1] == layers
    assert report.kv_bytes_after < report.kv_bytes_before
    sequences, logits = greedy_logits(model, cache, ids, mask)
    expected_sequences, expected_logits = greedy_logits(model, reference, ids, mask)
    assert torch.equal(sequences, expected_sequences)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", sorted(POLICIES))
@torch.no_grad()
def test_evicting_inside_the_prefill_keeps_what_prefill_then_compress_keeps(name):
    model = make_tiny_llama(num_layers=3)
    ids, mask, columns = left_padded_batch()
    plan = bind(POLICIES[name], None, model)
    assert plan.evicts_in_prefill
    reference, expected = two_step(model, ids[:, :columns], mask[:, :columns], plan)
    cache, report = one_step(model, ids[:, :columns], mask[:, :columns], plan)
    assert_same_cache(cache, reference)
    assert (report.budgets == expected.budgets).all()
    assert (report.lengths_before == expected.lengths_before).all()
    assert (report.lengths_after == expected.lengths_after).all()
    assert report.kv_bytes_after == expected.kv_bytes_after
    sequences, logits = greedy_logits(model, cache, ids, mask)
    expected_sequences, expected_logits = greedy_logits(model, reference, ids, mask)
    assert torch.equal(sequences, expected_sequences)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["mistral-sw", "gemma3"])
@torch.no_grad()
def test_sliding_window_layers_keep_what_prefill_then_compress_keeps(name):
    """Sliding-window layers get the budgets of what they hold (W - 1 tokens), each layer its own
    (Gemma 3 mixes sliding and full layers)."""
    model = make_tiny(name)
    ids, mask, columns = left_padded_batch()
    ids = ids.clamp(max=model.config.vocab_size - 1)
    plan = bind(CompressionPolicy(keep_ratio=0.25, scorer="keydiff"), None, model)
    reference, expected = two_step(model, ids[:, :columns], mask[:, :columns], plan)
    cache, report = one_step(model, ids[:, :columns], mask[:, :columns], plan)
    assert (report.budgets == expected.budgets).all()
    assert_same_cache(cache, reference)


@torch.no_grad()
def test_at_most_one_layer_holds_its_full_cache_during_the_prefill():
    """When layer i is about to be cut, the layers before it hold only their budgets: the cache's
    bytes never exceed one full layer plus the compressed others (prefill-then-compress holds
    every layer in full)."""
    model = make_tiny_llama(num_layers=4)
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(1))
    plan = bind(CompressionPolicy(keep_ratio=0.25, scorer="keydiff"), None, model)
    cache = RaggedCache.for_model(model)
    report = prefill_and_compress(model, cache, ids, None, plan)
    full_layer = report.kv_bytes_before / len(cache.layers)
    compressed_layer = report.kv_bytes_after / len(cache.layers)
    assert report.kv_bytes_peak <= full_layer + (len(cache.layers) - 1) * compressed_layer * 1.01
    assert report.kv_bytes_peak < 0.5 * report.kv_bytes_before
    _, two_steps = two_step(model, ids, None, plan)
    assert two_steps.kv_bytes_peak == two_steps.kv_bytes_before  # every layer held in full


@pytest.mark.parametrize(
    "name", ["uniform/leverage (chunked attention)", "uniform/snapkv (recent queries)", "uniform/keydiff"]
)
@torch.no_grad()
def test_a_layer_cut_in_the_prefill_drops_what_only_its_scoring_read(name):
    """What a layer's scorer reads and decoding does not (its recorded prompt queries, its chunked
    attention) is dropped when the layer is cut, not at the end of the prefill: held until then, the
    flagship's recorded queries of every layer were 0.05 GiB of the CPU's peak at 4K x 2 on the
    embedded model (docs/results.md R-cpu-prefill-allocations-2026-11-27)."""
    model = make_tiny_llama(num_layers=3)
    ids = torch.randint(3, 128, (2, 120), generator=torch.Generator().manual_seed(2))
    plan = bind(POLICIES[name], None, model)
    cache = RaggedCache.for_model(model)
    held = []

    def record(module, args):  # at layer i's start: what layers before i still hold
        index = list(model.model.layers).index(module)
        observed = [
            row.recent_queries is not None or row.chunk_attention is not None
            for layer in cache.layers[:index]
            for row in layer.rows
        ]
        held.append(any(observed))

    hooks = [layer.register_forward_pre_hook(record) for layer in model.model.layers]
    try:
        prefill_and_compress(model, cache, ids, None, plan)
    finally:
        for hook in hooks:
            hook.remove()
    assert held == [False] * len(model.model.layers)


def test_policies_that_read_every_layer_prefill_then_compress():
    """Moment-informed rounds re-score against the whole prompt's sums, and the prompt's own query
    statistics are read for every layer at once: those keep the two-step path (and compress_prompt
    still serves them).  (global allocation, the third, needs the learned scorer's artifact.)"""
    model = make_tiny_llama(num_layers=2)
    for policy in (
        CompressionPolicy(keep_ratio=0.25, scorer="snapkv", moment_eviction=True),
        CompressionPolicy(keep_ratio=0.25, scorer="expected_attention", statistics="prompt"),
    ):
        plan = bind(policy, None, model)
        assert not plan.evicts_in_prefill, policy.describe()
        with pytest.raises(ValueError, match="cannot evict inside the prefill"):
            prefill_and_compress(model, RaggedCache.for_model(model), torch.ones(1, 20, dtype=torch.long), None, plan)
        ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(2))
        cache, report = compress_prompt(model, ids, plan, context_columns=50)
        assert report.kv_bytes_after < report.kv_bytes_before


@pytest.mark.slow
@torch.no_grad()
def test_the_flagship_on_the_embedded_model_keeps_what_prefill_then_compress_keeps(
    embedded_model, embedded_tokenizer, smoke_artifact
):
    """The real model, the real smoke artifact's INF budgets and correction orders, 75% evicted."""
    calibration = load_calibration(embedded_model, embedded_tokenizer, path=smoke_artifact)
    plan = bind(FLAGSHIP.policy(0.75), calibration, embedded_model)
    assert plan.evicts_in_prefill
    text = "The grass is green. The sky is blue. The passcode is 4821. " * 12
    ids = embedded_tokenizer(text, return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    columns = ids.shape[1] - 4
    reference, _ = two_step(embedded_model, ids[:, :columns], mask[:, :columns], plan)
    cache, report = one_step(embedded_model, ids[:, :columns], mask[:, :columns], plan)
    assert_same_cache(cache, reference)
    assert report.kv_bytes_after < 0.4 * report.kv_bytes_before
    sequences, logits = greedy_logits(embedded_model, cache, ids, mask)
    expected_sequences, expected_logits = greedy_logits(embedded_model, reference, ids, mask)
    assert torch.equal(sequences, expected_sequences)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-4)


def test_scoring_tiles_bound_the_transient_memory_on_a_gpu():
    """All rows at once on a GPU made the flagship's compression hold a padded copy of every row's
    keys and values plus float32 intermediates (2.3 GiB over uniform/keydiff at 32K x 8: docs/results.md
    R-gpu-prefill-2026-11-27); tiles of rows bound it there too, never below one row."""
    from runtime.compression.eviction import rows_per_tile

    one_row = 8 * 32768 * 128  # 8 KV heads x 32K tokens x d = 128
    assert rows_per_tile(torch.device("cuda"), one_row) == 1
    assert rows_per_tile(torch.device("cuda"), 8 * 4096 * 128) == 8
    assert rows_per_tile(torch.device("cuda"), 10 * one_row) == 1
    assert rows_per_tile(torch.device("cpu"), one_row) == 1
    assert rows_per_tile(torch.device("cpu"), 2 * 64 * 16) == 128


@pytest.mark.parametrize(
    "policy",
    [
        CompressionPolicy(compression_ratio=0.75, scorer="leverage", correction="order1"),  # the flagship's parts
        CompressionPolicy(compression_ratio=0.75, scorer="keydiff"),
    ],
    ids=["leverage+order1", "keydiff"],
)
def test_prefill_and_compression_synchronise_a_fixed_number_of_times_whatever_the_layers(policy):
    """On a GPU every read of device data to the host (``.item()``, ``nonzero``, ``torch.equal``...)
    drains the queue; a compression that read back once per layer (the scores' NaN check, the keys'
    RoPE memo) made the host wait on every layer's attention and scoring (issue 40).  Counted on the
    CPU by the decode test's dispatch counter (tests/test_decode_sync.py), the same prompt through 2
    and 4 layers must make the same number of synchronising ops: those of the call's input checks and
    of transformers' mask, and one read of every layer's NaN check at the end."""
    from test_decode_sync import SyncCounter

    counts = []
    for layers in (2, 4):
        model = make_tiny_llama(num_layers=layers)
        ids = torch.randint(3, 128, (2, 300), generator=torch.Generator().manual_seed(0))
        compress_prompt(model, ids, policy, context_columns=299)  # the first call checks the model's RoPE once
        counter = SyncCounter()
        with torch.no_grad(), counter:
            compress_prompt(model, ids, policy, context_columns=299)
        counts.append(dict(counter.syncs))
    assert counts[0] == counts[1], f"2 layers: {counts[0]}, 4 layers: {counts[1]}"
    assert sum(counts[1].values()) <= 8, counts[1]
