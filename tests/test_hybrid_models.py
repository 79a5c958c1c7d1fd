"""Hybrid models (Qwen3.5, Qwen3-Next, OLMo hybrid, LFM2, Bamba): attention layers beside layers that keep a
state of fixed size (Gated DeltaNet, short convolutions, Mamba 2).  kvcal compresses the attention layers' KV
caches; the recurrent layers' states stay transformers' own cache layers inside the same ``RaggedCache``.

Every such model type is in tests/test_architecture_matrix.py (nothing evicted is exact, beams are transformers'
own, compressed serving runs).  Here, on a tiny Qwen3.5 whose attention layers are decoder layers 1 and 3 (so
that an attention layer's index among kvcal's layers is not its decoder index): the cache's layout and the
artifact fingerprint, eviction inside the prefill against prefill-then-compress, copies and stacks of a cache
that decoding does not write through, KVzip's reconstruction against the model's own attention, decode steps
replayed from a graph, and a whole profile served back.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers as T
from test_prefill_eviction import PARTIAL_LAYER_POLICIES, assert_prefill_eviction_is_prefill_then_compress
from test_runtime_leverage_kvzip import ToyTokenizer, naive_kvzip

from artifacts.fingerprint import architecture_numbers, attention_variant
from runtime import CompressionPolicy, RaggedCache, load_calibration
from runtime.compression.kvzip import kvzip_scores, reconstruction_chunks
from runtime.compression.prefill import prefill
from runtime.compression.ragged_attention import ragged_attention
from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE
from runtime.math.geometry import ModelGeometry, UnsupportedModelError
from runtime.plan.policy_spec import FLAGSHIP
from runtime.serve.generation import compress_prompt, generate, generate_from_cache

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def hybrid(vocab_size: int = 512):
    """A tiny Qwen3.5 (text; tests/test_architecture_matrix.py's shapes): Gated DeltaNet layers 0 and 2, gated
    attention layers 1 and 3 (their query projection also computes the output gate), partial RoPE; random weights
    of seed 0, float32."""
    from test_architecture_matrix import tiny_model

    linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
    return tiny_model("qwen3_5_text", vocab_size=vocab_size, layer_types=LAYER_TYPES, **linear)


def hybrid_refusal() -> str | None:
    """Why this transformers refuses hybrid models (runtime.math.geometry: 5.2 - 5.18 keep their recurrent states
    otherwise than kvcal's cache can hold them), None where they are served (5.19 on)."""
    try:
        ModelGeometry.of(hybrid())
    except UnsupportedModelError as error:
        return str(error)
    return None


def serves_hybrids() -> None:
    """Skip the calling test where this transformers refuses hybrid models (after checking it says why)."""
    refusal = hybrid_refusal()
    if refusal is not None:
        assert "a hybrid model (linear attention, convolution or Mamba layers beside attention) needs" in refusal
        pytest.skip(f"transformers {T.__version__} refuses hybrid models: {refusal}")


@pytest.fixture(autouse=True)
def _served():
    serves_hybrids()


def test_the_cache_holds_the_attention_layers_and_transformers_the_recurrent_states():
    model = hybrid()
    geometry = ModelGeometry.of(model)
    assert (geometry.num_layers, geometry.layer_indices, geometry.rotary_dims) == (2, (1, 3), (4, 4))
    assert [geometry.layer_of(module) for module in geometry.attention_modules] == [0, 1]
    assert geometry.query_projections[0].head_width == 32  # each head's query, then its output gate
    cache = RaggedCache.for_model(model)
    assert [type(layer).__name__ for layer in cache.layers] == [
        "LinearAttentionLayer",
        "RaggedLayer",
        "LinearAttentionLayer",
        "RaggedLayer",
    ]
    assert cache.attention_layers == [cache.layers[1], cache.layers[3]]
    assert [layer.layer_idx for layer in cache.attention_layers] == [0, 1]
    # the artifact: L counts the attention layers, and which decoder layers they are is in the fingerprint
    numbers = architecture_numbers(model.config)
    assert numbers["num_layers"] == 2
    assert attention_variant(model.config)["attention_layers"] == [1, 3]
    other = T.Qwen3_5TextConfig(**{**model.config.to_dict(), "layer_types": LAYER_TYPES[::-1]})
    assert architecture_numbers(other) != numbers


@pytest.mark.parametrize("policy", PARTIAL_LAYER_POLICIES, ids=repr)
@torch.no_grad()
def test_evicting_inside_the_prefill_keeps_what_prefill_then_compress_keeps(policy):
    assert_prefill_eviction_is_prefill_then_compress(hybrid(), policy, layers=2)


def _states(layer) -> list[torch.Tensor]:
    """A recurrent cache layer's state tensors (conv and recurrent), cloned; none for a stateless layer."""
    states = [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
    return [state.clone() for state in states if state is not None]


def padded_prompt():
    """Two rows of 120 columns, the second left-padded by 17."""
    ids = torch.randint(3, 500, (2, 120), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    return ids, mask


def decode_from_cache(model, ids, mask, cache, report, **kwargs):
    """``generate_from_cache``, greedy, 6 new tokens and their logits unless ``kwargs`` say otherwise."""
    options = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return generate_from_cache(model, ids, mask, cache, report, **{**options, **kwargs})


@pytest.mark.parametrize("model_type", ["qwen3_5", "nemotron_h", "lfm2", "jamba", "falcon_h1"])
@torch.no_grad()
def test_decoding_a_copy_leaves_the_recurrent_states_of_the_original(model_type):
    """transformers updates a recurrent layer's states in place: a copy of a compressed cache owns new ones, so a
    second generation from another copy of the same cache answers as the first; a stack of two caches (two
    policies) answers, row by row, as each alone.  Qwen3.5 here; Nemotron-H (Mamba 2, and MoE / MLP layers
    without a state), LFM2 (convolutions), Jamba (Mamba) and Falcon-H1 (Mamba 2 beside attention in every layer:
    the attention layers hold the states) as tests/test_architecture_matrix.py builds them."""
    from test_architecture_matrix import tiny_model

    model = hybrid() if model_type == "qwen3_5" else tiny_model(model_type)
    ids, mask = padded_prompt()
    ids = ids % model.config.vocab_size
    policy = CompressionPolicy(keep_ratio=0.25, scorer="keydiff")
    cache, report = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=110)
    holders = {**cache.recurrent_layers, **{-1 - i: cache.attention_layers[i] for i in cache.stateful}}
    assert holders, "no recurrent state"
    before = {index: _states(layer) for index, layer in holders.items()}
    first = decode_from_cache(model, ids, mask, cache.copy(), report)
    second = decode_from_cache(model, ids, mask, cache.copy(), report)
    assert torch.equal(first.sequences, second.sequences)
    for a, b in zip(first.output.logits, second.output.logits, strict=True):
        assert torch.equal(a, b)
    for index, layer in holders.items():
        assert all(torch.equal(a, b) for a, b in zip(_states(layer), before[index], strict=True))

    other, other_report = compress_prompt(
        model, ids, CompressionPolicy(keep_ratio=0.5), attention_mask=mask, context_columns=110
    )
    alone = decode_from_cache(model, ids, mask, other.copy(), other_report)
    stacked = RaggedCache.stack([cache, other])
    rows = decode_from_cache(model, torch.cat([ids, ids]), torch.cat([mask, mask]), stacked, report)
    assert torch.equal(rows.sequences[:2], first.sequences) and torch.equal(rows.sequences[2:], alone.sequences)


def assert_questions_answered_as_each_alone(model, vocabulary: int, context_length: int, question_length: int):
    """One context of ``context_length`` random tokens compressed once (keydiff, 25% kept) and copied to each of
    three questions' rows (``answer``'s path: the cache's rows repeated): each answer, greedy, is that of the
    question asked alone (``generate(..., context_columns=context_length)``)."""
    generator = torch.Generator().manual_seed(8)
    context = torch.randint(3, vocabulary, (1, context_length), generator=generator)
    questions = [torch.randint(3, vocabulary, (1, question_length), generator=generator) for _ in range(3)]
    policy = CompressionPolicy(keep_ratio=0.25, scorer="keydiff")
    # the context's columns compressed, as generate(..., context_columns=...) compresses them below (compress_prompt
    # of the context alone would leave its last column to generate())
    cache, report = compress_prompt(
        model, torch.cat([context, questions[0]], 1), policy, context_columns=context_length
    )
    cache.batch_repeat_interleave(len(questions))
    ids = torch.cat([torch.cat([context, question], dim=1) for question in questions])
    together = decode_from_cache(model, ids, torch.ones_like(ids), cache, report)
    for row, question in enumerate(questions):
        prompt = torch.cat([context, question], dim=1)
        alone = generate(model, prompt, policy, context_columns=context_length, max_new_tokens=6)
        assert torch.equal(together.sequences[row], alone.sequences[0])


@torch.no_grad()
def test_several_questions_about_one_context_are_answered_as_each_alone():
    """The recurrent states are repeated with the cache's rows."""
    assert_questions_answered_as_each_alone(hybrid(), 500, 100, 6)


@pytest.mark.parametrize("chunk_size", [64, 23])
def test_kvzip_scores_equal_the_models_attention_over_the_reconstruction(chunk_size):
    """Each reconstruction chunk follows the context in the recurrent layers too: the scores are those of one
    forward pass of context and chunk (the model's own eager attention of its two attention layers)."""
    model = hybrid()
    tokenizer = ToyTokenizer()
    context = [1] + torch.randint(3, 120, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    cache = RaggedCache.for_model(model)
    prefill(model, cache, torch.tensor([context]))
    states = {index: dict(layer.recurrent_states) for index, layer in cache.recurrent_layers.items()}
    scores = kvzip_scores(model, tokenizer, cache, context, chunk_size=chunk_size, overlap=4)
    assert scores.scores.shape == (2, 2, 51)
    for index, layer in cache.recurrent_layers.items():  # the cache is untouched
        assert all(torch.equal(layer.recurrent_states[i], state) for i, state in states[index].items())
    chunks = reconstruction_chunks(
        tokenizer, context, 1, tokenizer("\n", add_special_tokens=False)["input_ids"], chunk_size, 4
    )
    want = naive_kvzip(model, context, chunks, sink=1)
    torch.testing.assert_close(scores.scores.double(), want, rtol=1e-4, atol=1e-6)


def test_kvzip_on_attention_beside_a_recurrent_mixer_is_refused_by_name():
    """Falcon-H1's layers run Mamba 2 beside their attention: KVzip's reconstruction, which would restore each
    layer's state before every chunk, is not built for them and says so."""
    from test_architecture_matrix import tiny_model

    model = tiny_model("falcon_h1")
    cache = RaggedCache.for_model(model)
    prefill(model, cache, torch.tensor([[1] + list(range(3, 40))]))
    assert set(cache.stateful) == {0, 1, 2, 3} and not cache.recurrent_layers
    with pytest.raises(ValueError, match=r"not built for layers that run a recurrent mixer beside their attention"):
        kvzip_scores(model, ToyTokenizer(), cache, [1] + list(range(3, 40)))


@pytest.mark.parametrize("model_type", ["qwen3_5", "falcon_h1"])
@pytest.mark.parametrize("policy", [None, CompressionPolicy(compression_ratio=0.75, scorer="keydiff")], ids=repr)
def test_decode_steps_of_a_hybrid_model_are_replayed(policy, model_type, monkeypatch):
    """With the page kernel a GPU runs, a hybrid model's decode steps (the recurrent layers' states updated in
    place, at their addresses; Falcon-H1's in its attention layers) replay from a graph (tests/step_replay.py's
    recorder on the CPU) and generate what eager steps generate."""
    from test_architecture_matrix import tiny_model

    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    model = hybrid() if model_type == "qwen3_5" else tiny_model(model_type)
    assert_decode_steps_replayed(model, policy, new_tokens=16)


def assert_decode_steps_replayed(model, policy, new_tokens: int) -> None:
    """``new_tokens`` greedy steps from :func:`padded_prompt` compressed under ``policy`` (under the page kernel the
    caller sets), replayed from a graph (tests/step_replay.py's recorder), are the eager steps: the same sequences,
    logits within 1e-5, one capture replayed at every step but the first three."""
    from step_replay import RecordedStep

    ids, mask = padded_prompt()
    ids = ids % model.config.vocab_size
    runs = []
    for graphs in (False, RecordedStep):
        with ragged_attention(model):
            cache, report = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=110)
        runs.append(decode_from_cache(model, ids, mask, cache, report, max_new_tokens=new_tokens, decode_graphs=graphs))
    eager, replayed = runs
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.output.logits[1:], replayed.output.logits[1:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert replayed.graphs.captured == 1 and replayed.graphs.replayed == new_tokens - 3


def test_a_profile_of_a_hybrid_model_is_served_back(tmp_path, embedded_tokenizer, capsys):
    """Every stage of a smoke profile on the hybrid model saved with the embedded tokenizer, as a user runs
    it: the sections' layer axis is its two attention layers; ``evaluate-artifact`` runs on it; the flagship
    served from the artifact evicts in both and generates."""
    from conftest import profile_every_stage

    from artifacts import open_artifact
    from artifacts.summary import format_summary, summarize

    model = hybrid(vocab_size=len(embedded_tokenizer))
    out = profile_every_stage(model, tmp_path, embedded_tokenizer, capsys)
    model_dir = tmp_path / "model"
    assert "(qwen3_5_text, 2 attention layers, 4 query / 2 KV heads" in capsys.readouterr().out
    with open_artifact(out) as reader:
        assert len(reader.sections) == 8 and reader.model.num_layers == 2
        assert reader.section("behaviour")["steps"].shape == (2, 4)
        assert np.all(reader.section("behaviour")["steps"] > 0)
        assert reader.section("budgets")["inf_kv"].shape == (2, 2)
        assert "qwen3_5_text: 2 attention layers (decoder layers 1, 3)" in format_summary(summarize(reader))
        assert np.all(np.isfinite(reader.section("moments")["errors"]))
    assert_evaluate_artifact_runs(model_dir, out, tmp_path / "evaluation.json", capsys)
    calibration = load_calibration(model, embedded_tokenizer, path=out)
    ids = torch.randint(3, 500, (1, 200), generator=torch.Generator().manual_seed(4))
    policy = FLAGSHIP.policy(0.75)
    result = generate(model, ids, policy, calibration=calibration, context_columns=190, max_new_tokens=4)
    assert result.new_tokens.shape == (1, 4)
    assert result.report.kv_bytes_after < result.report.kv_bytes_before


def assert_profile_served_back(model, tmp_path, tokenizer, capsys, layers: int, check=None) -> None:
    """Every stage of a smoke profile on ``model`` saved with ``tokenizer`` (``conftest.profile_every_stage``):
    eight sections whose layer axis holds ``layers``, finite query statistics and moment errors, and ``check
    (reader)`` of the artifact where given; ``evaluate-artifact`` runs on it; the flagship served from it evicts and
    generates."""
    from conftest import profile_every_stage

    from artifacts import open_artifact

    out = profile_every_stage(model, tmp_path, tokenizer, capsys)
    with open_artifact(out) as reader:
        assert len(reader.sections) == 8 and reader.model.num_layers == layers
        assert np.all(np.isfinite(reader.section("query_stats")["cov"]))
        assert np.all(np.isfinite(reader.section("moments")["errors"]))
        if check is not None:
            check(reader)
    assert_evaluate_artifact_runs(tmp_path / "model", out, tmp_path / "evaluation.json", capsys)
    calibration = load_calibration(model, tokenizer, path=out)
    ids = torch.randint(3, 500, (1, 200), generator=torch.Generator().manual_seed(4))
    result = generate(model, ids, FLAGSHIP.policy(0.75), calibration=calibration, context_columns=190, max_new_tokens=4)
    assert result.new_tokens.shape == (1, 4)
    assert result.report.kv_bytes_after < result.report.kv_bytes_before


def assert_evaluate_artifact_runs(model_dir, artifact, evaluation, capsys) -> None:
    """``evaluate-artifact`` on ``model_dir``'s model with ``artifact`` (smoke preset, retrieval on simple
    haystacks, the flagship and uniform/keydiff at 50 and 90% evicted) exits 0, writes its four results to
    ``evaluation`` and keeps about what each ratio promises."""
    from conftest import single_thread

    from profiler.evaluate_cli import main as evaluate

    options = ["--preset", "smoke", "--tasks", "retrieval", "--haystacks", "simple", "--max-new-tokens", "4"]
    options += ["--policies", "flagship,uniform/keydiff", "--compression-ratios", "0.5,0.9"]
    with single_thread():
        code = evaluate(
            [str(model_dir), "--artifact", str(artifact), *options, "--json", str(evaluation), "--no-progress"]
        )
    assert code == 0, capsys.readouterr().err
    results = json.loads(evaluation.read_text())["results"]
    assert [(row["policy"], row["compression_ratio"]) for row in results] == [
        ("flagship", 0.5),
        ("flagship", 0.9),
        ("uniform/keydiff", 0.5),
        ("uniform/keydiff", 0.9),
    ]
    assert all(row["kv_fraction"] < 1.0 - row["compression_ratio"] + 0.1 for row in results)


@torch.no_grad()
def test_padding_between_a_rows_tokens_is_refused_by_name():
    """Recurrent layers run over every column: padding between a row's context and a shorter question than another
    row's (``[pad, context, pad, question]``) enters their state, and the row was answered otherwise than alone
    (logits 9e-4 to 6e-3 apart, benchmarks/row_alone_campaign.py).  Refused by name before any forward pass, by
    ``generate``, ``answer``'s several questions and ``generate_from_cache``; questions of one length, and left
    padding alone, are served."""
    from runtime.serve.generation import build_inputs

    serves_hybrids()
    model = hybrid()
    generator = torch.Generator().manual_seed(4)
    contexts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (60, 45)]
    questions = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (6, 9)]
    ids, mask, columns = build_inputs(contexts, questions, pad_token_id=0)
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    refusal = r"padding between the tokens of batch row 0 .* recurrent layers"
    with pytest.raises(ValueError, match=refusal):
        generate(model, ids, policy, attention_mask=mask, context_columns=columns, max_new_tokens=2)
    cache, report = compress_prompt(model, ids, policy, attention_mask=mask, context_columns=columns)
    with pytest.raises(ValueError, match=refusal):
        generate_from_cache(model, ids, mask, cache, report, max_new_tokens=2)
    # one context, questions of two lengths (answer's path): the shorter question's row is padded before it
    ids, mask, columns = build_inputs([contexts[0]] * 2, questions, pad_token_id=0)
    cache, report = compress_prompt(model, ids[:1], policy, attention_mask=mask[:1], context_columns=columns)
    cache.batch_repeat_interleave(2)
    with pytest.raises(ValueError, match=refusal):
        generate_from_cache(model, ids, mask, cache, report, max_new_tokens=2)
    # questions of one length: the contexts' left padding alone, served as each row alone
    ids, mask, columns = build_inputs(contexts, [q[:6] for q in questions], pad_token_id=0)
    together = generate(model, ids, policy, attention_mask=mask, context_columns=columns, max_new_tokens=4)
    for row, context in enumerate(contexts):
        alone_ids, alone_mask, alone_columns = build_inputs([context], [questions[row][:6]], pad_token_id=0)
        alone = generate(
            model, alone_ids, policy, attention_mask=alone_mask, context_columns=alone_columns, max_new_tokens=4
        )
        assert together.new_tokens[row].tolist() == alone.new_tokens[0].tolist()


@torch.no_grad()
def test_answer_groups_questions_of_one_length_on_a_hybrid_model(embedded_tokenizer):
    """``answer`` lays out no padding between a row's context and its question on a model with recurrent layers
    (refused there, above): it answers the questions of each length together, the context compressed once, and
    question-aware prompts are left-padded whole.  Each answer is the question's asked alone."""
    from runtime import answer

    serves_hybrids()
    model = hybrid(vocab_size=len(embedded_tokenizer))
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    context = "The harbour master logged every ship that came in, and the pilot boats too. " * 3
    questions = ["Who logged ships?", "What did the harbour master log, and since when did he keep it?", "Who?"]
    questions.append(questions[0].replace("ships", "boats"))  # the first's length: answered in its group
    options = dict(max_new_tokens=5)
    alone = [answer(model, embedded_tokenizer, context, question, policy, **options) for question in questions]
    assert answer(model, embedded_tokenizer, context, questions, policy, **options) == alone
    contexts = [context, context[:90], context[:140], context[:60]]
    alone = [
        answer(model, embedded_tokenizer, c, q, policy, **options) for c, q in zip(contexts, questions, strict=True)
    ]
    assert answer(model, embedded_tokenizer, contexts, questions, policy, **options) == alone
    aware = dict(options, question_aware=True)
    alone = [answer(model, embedded_tokenizer, c, q, policy, **aware) for c, q in zip(contexts, questions, strict=True)]
    assert answer(model, embedded_tokenizer, contexts, questions, policy, **aware) == alone
