"""The block-wise prefill (``compress_prompt(..., block_size=B)``) compresses each row of a left-padded batch as
it compresses that row alone: a row's blocks are its own tokens ``[0, B), [B, 2B), ...``, whatever padding
sits before them.

Blocks used to be cut at the batch's columns, so a row padded by ``p`` had its first block cut at ``B - p``
tokens: its later blocks attended to another compressed prefix than alone, and it kept other rows and
answered otherwise (benchmarks/row_alone_campaign.py found it: logits 0.05-0.4 apart on every architecture).
The reference is the row alone, prefilled and compressed by the same call."""

from __future__ import annotations

import pytest
import torch
from test_prefill_eviction import POLICIES
from tiny_architectures import make_tiny

from runtime import CompressionPolicy, bind, compress_prompt, generate
from runtime.serve.generation import build_inputs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

LENGTHS = (37, 150, 91)  # real context tokens of the three rows: none a multiple of the blocks below


def rows(vocab: int, lengths=LENGTHS, question_lengths=(5, 5, 5), seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
    questions = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in question_lengths]
    return contexts, questions


def assert_row_as_alone(batch_cache, row: int, alone_cache, tolerance: float = 1e-5) -> None:
    """Row ``row`` of ``batch_cache`` holds, in every head, the positions of row 0 of ``alone_cache``, and keys and
    values within ``tolerance`` (a batch and a row alone are computed with other shapes)."""
    layers = zip(batch_cache.attention_layers, alone_cache.attention_layers, strict=True)
    for index, (mine, theirs) in enumerate(layers):
        assert mine.real_seen[row] == theirs.real_seen[0], index
        for h in range(mine.num_heads):
            keys, values, positions = mine.head(row, h)
            alone_keys, alone_values, alone_positions = theirs.head(0, h)
            where = f"layer {index} row {row} head {h}"
            assert positions.tolist() == alone_positions.tolist(), where
            torch.testing.assert_close(keys, alone_keys, rtol=tolerance, atol=tolerance, msg=where)
            torch.testing.assert_close(values, alone_values, rtol=tolerance, atol=tolerance, msg=where)


@pytest.mark.parametrize("name", ["llama", "mistral-sw", "gemma2"])
@pytest.mark.parametrize("policy", sorted(POLICIES))  # tests/test_prefill_eviction.py's
@pytest.mark.parametrize("block_size", [16, 48])
@torch.no_grad()
def test_each_row_of_a_padded_batch_keeps_what_it_keeps_alone(name, policy, block_size):
    """Every head of every row holds the positions, keys and values it holds when the row is compressed alone
    (question-agnostic: the contexts of a ``[pad, context, pad, question]`` batch).  Failed before on every
    case: the padded rows' blocks were cut at the batch's columns."""
    model = make_tiny(name)
    plan = bind(POLICIES[policy], None, model)
    contexts, questions = rows(int(model.config.vocab_size))
    ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)
    cache, report = compress_prompt(
        model, ids, plan, attention_mask=mask, context_columns=columns, block_size=block_size
    )
    for row, context in enumerate(contexts):
        alone_ids, alone_mask, alone_columns = build_inputs([context], [questions[row]], pad_token_id=0)
        alone, alone_report = compress_prompt(
            model, alone_ids, plan, attention_mask=alone_mask, context_columns=alone_columns, block_size=block_size
        )
        assert_row_as_alone(cache, row, alone)
        assert (report.budgets[row] == alone_report.budgets[0]).all()


@pytest.mark.parametrize("agnostic", [True, False], ids=["question-agnostic", "question-aware"])
@torch.no_grad()
def test_each_row_is_answered_as_alone(agnostic):
    """``generate`` after a block-wise prefill: each row's tokens and every step's logits are its own alone (the
    generation reads the cache's columns as if the batch had been prefilled in its own layout)."""
    model = make_tiny("qwen2-sw")
    policy = CompressionPolicy(keep_ratio=0.3, scorer="keydiff", window=4)
    contexts, questions = rows(int(model.config.vocab_size), question_lengths=(4, 9, 6) if agnostic else (1, 1, 1))
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)

    def run(contexts, questions):
        if agnostic:
            ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)
        else:
            prompts = [c + q for c, q in zip(contexts, questions, strict=True)]
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            columns = None
        result = generate(
            model, ids, policy, attention_mask=mask, context_columns=columns, block_size=16, pad_token_id=0, **options
        )
        return result.new_tokens, torch.stack(result.logits, dim=1)

    tokens, logits = run(contexts, questions)
    for row in range(len(contexts)):
        alone_tokens, alone_logits = run(contexts[row : row + 1], questions[row : row + 1])
        assert tokens[row].tolist() == alone_tokens[0].tolist()
        torch.testing.assert_close(logits[row], alone_logits[0], rtol=0, atol=1e-4)


@torch.no_grad()
def test_an_unpadded_batch_is_cut_at_the_same_columns_as_before():
    """Rows of one length: the blocks are the batch's columns, as they always were (R-blockwise-quality-2026-11-28
    measured single rows, whose blocks this change keeps)."""
    model = make_tiny("llama")
    contexts, questions = rows(int(model.config.vocab_size), lengths=(70, 70, 70))
    ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)
    policy = CompressionPolicy(keep_ratio=0.25, scorer="keydiff")
    cache, _ = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=columns, block_size=16)
    assert cache.get_seq_length() == columns
    for row in range(3):
        alone, _ = compress_prompt(model, ids[row : row + 1], policy, context_columns=columns, block_size=16)
        assert_row_as_alone(cache, row, alone)


@torch.no_grad()
def test_a_padded_batch_of_a_hybrid_model_in_blocks_is_refused_by_name():
    """A hybrid model's recurrent layers (Qwen3.5's Gated DeltaNet) run over every column, padding included, so a
    row's blocks cannot be laid out on their own: padding would enter the recurrent state between them."""
    from test_hybrid_models import hybrid, serves_hybrids

    serves_hybrids()
    model = hybrid()
    contexts, questions = rows(int(model.config.vocab_size), lengths=(40, 70, 70))
    ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)
    policy = CompressionPolicy(keep_ratio=0.25, scorer="keydiff")
    with pytest.raises(ValueError, match=r"block-wise prefill of a padded batch .* recurrent layers"):
        compress_prompt(model, ids, policy, attention_mask=mask, context_columns=columns, block_size=16)
    # rows of one length need no layout of their own: served
    ids, mask, columns = build_inputs(contexts[1:], questions[1:], pad_token_id=0)
    cache, _ = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=columns, block_size=16)
    assert cache.get_seq_length() == columns


@torch.no_grad()
def test_rows_whose_compressed_prefix_is_empty_are_served():
    """A one-token prompt beside a long one leaves its row nothing to compress (generate() feeds the last column),
    and a batch of one-token prompts leaves every row so: the blocks lay out the rows that have tokens, and the long
    row keeps what it keeps alone."""
    model = make_tiny("llama")
    policy = CompressionPolicy(keep_ratio=0.3, scorer="keydiff")
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :39], mask[1, :39] = 0, 0
    cache, _ = compress_prompt(model, ids, policy, attention_mask=mask, block_size=16)
    alone, _ = compress_prompt(model, ids[:1], policy, block_size=16)
    assert_row_as_alone(cache, 0, alone)
    assert cache.attention_layers[0].real_seen == [39, 0]
    ones = torch.zeros_like(mask)
    ones[:, -1] = 1
    result = generate(model, ids, policy, attention_mask=ones, block_size=16, max_new_tokens=2)
    assert result.new_tokens.shape == (2, 2)


@torch.no_grad()
def test_the_embedded_model_keeps_each_padded_row_as_alone_in_blocks(embedded_model, embedded_tokenizer):
    """The embedded model, the artifact-free policy (leverage scores, its chunked attention accumulated across the
    blocks), two rows of a question-agnostic batch (61 and 37 context tokens) in blocks of 32: each row keeps, head
    by head, what it keeps alone (the padded row's blocks were cut at 11 and 26 tokens, alone at 32 and 5)."""
    policy = CompressionPolicy(keep_ratio=0.25)
    texts = ["The harbour master logged every ship that came in. " * 6, "A short note about the weather. " * 5]
    contexts = [embedded_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    questions = [embedded_tokenizer(" Who logged ships?", add_special_tokens=False)["input_ids"]] * 2
    ids, mask, columns = build_inputs(contexts, questions, pad_token_id=embedded_tokenizer.pad_token_id or 0)
    cache, _ = compress_prompt(embedded_model, ids, policy, attention_mask=mask, context_columns=columns, block_size=32)
    for row, context in enumerate(contexts):
        alone_ids, alone_mask, alone_columns = build_inputs([context], [questions[row]], pad_token_id=0)
        alone, _ = compress_prompt(
            embedded_model, alone_ids, policy, attention_mask=alone_mask, context_columns=alone_columns, block_size=32
        )
        assert_row_as_alone(cache, row, alone, tolerance=1e-4)  # 30 layers in float32
