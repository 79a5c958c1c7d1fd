"""Every option of transformers' ``generate()`` through ``runtime.generate``: served as transformers serves it or
refused by name before any forward pass (the table: ``generate_options_cases.py``); and a checkpoint whose
``generation_config`` says ``use_cache: false`` or names a cache implementation (as fine-tuned checkpoints are
often saved) is served through the compressed cache, not around it."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import make_tiny_llama
from generate_options_cases import CONFIG_OPTIONS, OPTIONS, PARAMETER_OPTIONS, run
from transformers import AutoModelForCausalLM, GenerationConfig, GenerationMixin

from runtime import CompressionPolicy, answer, generate
from runtime.serve.generation import build_inputs, split_prompt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

# GenerationConfig's bookkeeping, not options
_NOT_OPTIONS = {"_from_model_config", "transformers_version"}


def test_every_generation_option_of_this_release_has_a_case():
    """A transformers release that adds an option to GenerationConfig or generate() fails here until the option
    is tried and put in the table (served, or refused by name)."""
    attributes = set(GenerationConfig().to_dict()) - _NOT_OPTIONS
    assert attributes - {option.name for option in CONFIG_OPTIONS} == set()
    parameters = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "inputs", "kwargs"}
    assert parameters == {option.name for option in PARAMETER_OPTIONS}
    names = [option.name for option in OPTIONS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("option", OPTIONS, ids=lambda option: option.name)
@torch.no_grad()
def test_generation_option_is_served_as_transformers_serves_it_or_refused_by_name(option):
    if option in CONFIG_OPTIONS and option.name not in GenerationConfig().to_dict():
        pytest.skip(f"transformers {__import__('transformers').__version__} has no {option.name}")
    outcome = run(option)
    assert outcome.handled, outcome.what


def _saved_without_cache(tmp_path, **generation):
    """A tiny Llama saved as training with gradient checkpointing leaves a checkpoint (``"use_cache": false`` in
    config.json, hence in the generation config transformers derives), loaded back, its generation config
    given ``generation`` on top (what a generation_config.json may say)."""
    model = make_tiny_llama(num_layers=2)
    model.config.use_cache = False
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.generation_config.use_cache is False
    for name, value in generation.items():
        setattr(loaded.generation_config, name, value)
    return loaded


def _rows():
    generator = torch.Generator().manual_seed(5)
    contexts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (26, 19)]
    questions = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (3, 6)]
    return build_inputs(contexts, questions, pad_token_id=0)


@pytest.mark.parametrize("generation", [{}, {"cache_implementation": "static"}], ids=["use_cache false", "static"])
@torch.no_grad()
def test_a_checkpoint_saved_without_a_cache_is_served_through_the_compressed_one(tmp_path, generation):
    """Before: generate() fed the whole prompt again at every step behind the compressed cache (a two-row batch
    answered otherwise than transformers, the cache held 324 columns for 43), or refused the cache kvcal handed
    it ("Passing both cache_implementation and cache")."""
    model = _saved_without_cache(tmp_path, **generation)
    ids, mask, columns = _rows()
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    reference = model.generate(ids, attention_mask=mask, **{**options, "cache_implementation": None})
    for policy in (None, CompressionPolicy(keep_ratio=0.5)):
        result = generate(model, ids, policy, attention_mask=mask, context_columns=columns, **options)
        assert result.cache.get_seq_length() == result.sequences.shape[1] - 1  # one column per token fed
        if policy is None:
            assert torch.equal(result.sequences, reference)
    # the checkpoint's own settings are back after the call
    assert model.generation_config.use_cache is False
    assert model.generation_config.cache_implementation == generation.get("cache_implementation")


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        (dict(use_cache=False), "use_cache=False"),
        (dict(cache_implementation="static"), "cache_implementation='static'"),
        (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    ],
)
@torch.no_grad()
def test_a_generation_config_the_caller_hands_over_is_checked_as_its_arguments_are(config, pattern):
    model = make_tiny_llama(num_layers=2)
    ids, mask, columns = _rows()
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    given = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0, **config)
    with pytest.raises(ValueError, match=pattern):
        generate(model, ids, None, attention_mask=mask, context_columns=columns, generation_config=given)
    handle.remove()
    assert calls == []  # refused before the prefill


@torch.no_grad()
def test_embedded_model_saved_without_a_cache_answers_as_transformers(embedded_model, embedded_tokenizer):
    """The embedded SmolLM2 with the generation config a fine-tune saved with gradient checkpointing has
    (``use_cache: false``): answer() and generate() serve it through the compressed cache, as transformers'
    own answers with nothing evicted, stop strings read with the tokenizer."""
    config = embedded_model.generation_config
    saved = config.use_cache
    config.use_cache = False
    try:
        context = "The courier left the parcel with the neighbour at number 14 because nobody was home. " * 3
        question = "Who has the parcel?"
        context_ids, rest = split_prompt(embedded_tokenizer, context, question)
        ids = torch.tensor([context_ids + rest])
        options = dict(max_new_tokens=12, do_sample=False, stop_strings=["."], tokenizer=embedded_tokenizer)
        reference = embedded_model.generate(ids, **options)
        served = generate(embedded_model, ids, None, context_columns=len(context_ids), **options)
        assert torch.equal(served.sequences, reference)
        assert served.cache.get_seq_length() == served.sequences.shape[1] - 1
        evicted = generate(
            embedded_model, ids, CompressionPolicy(keep_ratio=0.5), context_columns=len(context_ids), **options
        )
        assert evicted.cache.get_seq_length() == evicted.sequences.shape[1] - 1
        text = answer(embedded_model, embedded_tokenizer, context, question, CompressionPolicy(keep_ratio=0.5))
        assert isinstance(text, str) and text
        assert config.use_cache is False
    finally:
        config.use_cache = saved


@torch.no_grad()
def test_the_profilers_greedy_decoding_keeps_a_cache_on_a_checkpoint_saved_without_one(tmp_path):
    """profile-model's greedy passes (the behaviour stage, the held-out tasks) and the needles' uncompressed answer
    decode one token per step through a cache whatever the checkpoint's ``use_cache`` says.  Before, a checkpoint
    saved with ``"use_cache": false`` recomputed the whole sequence at every step (the same artifact within 2e-6,
    at the cost of a forward pass over the prompt for every new token)."""
    from needles.probe import Probe
    from needles.scoring import greedy_answer
    from profiler.greedy import greedy_generate

    model = _saved_without_cache(tmp_path)
    lengths = []
    handle = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )

    class Vocabulary:
        pad_token_id, eos_token_id = 0, 2

        def decode(self, tokens, skip_special_tokens=True):
            return " ".join(str(int(t)) for t in tokens)

    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    greedy_generate(model, Vocabulary(), ids, max_new_tokens=5)
    assert lengths == [20, 1, 1, 1, 1]
    lengths.clear()
    probe = Probe("p", "retrieval", 20, 50.0, 0, "q", "a", ids[0].tolist(), [], 20)
    greedy_answer(model, Vocabulary(), probe, max_new_tokens=4)
    handle.remove()
    assert lengths == [20, 1, 1, 1]
