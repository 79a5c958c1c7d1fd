"""Every option of transformers' ``generate()`` through ``runtime.generate``: served as transformers serves it,
or refused by name before any forward pass; never a silently other result, never a crash from inside.

One case per attribute of ``GenerationConfig`` and per parameter of ``generate()`` (``test_generate_options.py``
fails when a transformers release adds one the table does not name), plus the model inputs a caller may hand
generate() beside the prompt.  A case is

* **served**: on two left-padded rows with nothing evicted, ``runtime.generate`` returns what
  ``model.generate`` returns with the same option and seed (sequences; scores and logits within 1e-4; hidden
  states of the columns generate() fed, see ``compare``), or raises the same error type transformers raises;
  and with half the context evicted its cache holds one column per token it was fed (a cache fed the prompt
  again, as ``use_cache=False`` did, holds far more);
* **refused**: ``runtime.generate`` raises ``ValueError`` or ``TypeError`` with a one-line message matching
  the case's pattern, before the model runs any forward pass (no prefill wasted).

Run this file to count them (docs/results.md R-generate-options-2026-11-29):

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tests/generate_options_cases.py
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_tiny_llama  # noqa: E402

SERVED, REFUSED = "served", "refused"
_TRANSFORMERS = tuple(int(part) for part in transformers.__version__.split(".")[:2])
NEW_TOKENS = 6


@dataclass(frozen=True)
class Option:
    name: str  # the GenerationConfig attribute or generate() parameter the case is about
    options: Callable[[], dict]  # generate()'s keyword arguments (built when the case runs)
    verdict: str  # SERVED or REFUSED
    match: str = ""  # REFUSED: a regular expression the message must contain
    note: str = ""  # what the option does to kvcal's generation


@dataclass(frozen=True)
class Outcome:
    handled: bool
    what: str


# -- inputs ---------------------------------------------------------------------------------------

_CACHE: dict[str, object] = {}


def model():
    """A tiny random Llama (built once; no case changes its weights)."""
    if "model" not in _CACHE:
        _CACHE["model"] = make_tiny_llama(num_layers=2).eval()
    return _CACHE["model"]


def tokenizer():
    """The embedded tokenizer (stop strings and token healing read a vocabulary)."""
    if "tokenizer" not in _CACHE:
        from common.models import load_tokenizer

        _CACHE["tokenizer"] = load_tokenizer()
    return _CACHE["tokenizer"]


def prompts():
    """Two left-padded rows ``[pad, context, pad, question]``: ``input_ids``, ``attention_mask``, context columns."""
    from runtime.serve.generation import build_inputs

    generator = torch.Generator().manual_seed(11)
    contexts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (30, 22)]
    questions = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (4, 7)]
    return build_inputs(contexts, questions, pad_token_id=0)


class _Streamer:
    def __init__(self):
        self.chunks = 0

    def put(self, value):
        self.chunks += 1

    def end(self):
        pass


def _penalise_odd_tokens(input_ids, scores):
    scores = scores.clone()
    scores[:, 1::2] -= 2.0
    return scores


def _stop_after_four(input_ids, scores, **kwargs):
    return torch.full((input_ids.shape[0],), input_ids.shape[1] >= _CACHE["columns"] + 4, dtype=torch.bool)


def _logits_processor():
    from transformers import LogitsProcessorList

    return LogitsProcessorList([_penalise_odd_tokens])


def _stopping_criteria():
    from transformers import StoppingCriteriaList

    return StoppingCriteriaList([_stop_after_four])


def _negative_prompt():
    generator = torch.Generator().manual_seed(3)
    return torch.randint(3, 128, (2, 5), generator=generator)


def _compile_config():
    from transformers import CompileConfig

    return CompileConfig()


def _watermarking():
    from transformers import WatermarkingConfig

    return WatermarkingConfig(greenlist_ratio=0.25)


def _assistant():
    if "assistant" not in _CACHE:
        _CACHE["assistant"] = make_tiny_llama(num_layers=1, seed=1).eval()
    return _CACHE["assistant"]


def _embeddings():
    ids, _, _ = prompts()
    return model().get_input_embeddings()(ids)


def _user_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _sample(**more):
    return lambda: dict(do_sample=True, **more)


def _beams(**more):
    return lambda: dict(num_beams=3, **more)


def _given(**options):
    return lambda: dict(options)


ASSISTED = "assisted|speculative"
HUB = "Hub|custom_generate"

# GenerationConfig's attributes
CONFIG_OPTIONS: tuple[Option, ...] = (
    Option("assistant_confidence_threshold", _given(assistant_confidence_threshold=0.3), SERVED, note="assisted only"),
    Option("assistant_early_exit", _given(assistant_early_exit=1), REFUSED, ASSISTED),
    Option("assistant_ensemble_weight", _given(assistant_ensemble_weight=0.5), SERVED, note="assisted only"),
    Option("assistant_lookbehind", _given(assistant_lookbehind=5), SERVED, note="assisted only"),
    Option("bad_words_ids", _given(bad_words_ids=[[5], [6, 7]]), SERVED),
    Option("begin_suppress_tokens", _given(begin_suppress_tokens=[4, 5]), SERVED),
    Option("bos_token_id", _given(bos_token_id=1), SERVED),
    Option("cache_config", _given(cache_config={"max_cache_len": 256}), SERVED, note="with cache_implementation only"),
    Option("cache_implementation", _given(cache_implementation="static"), REFUSED, "cache_implementation"),
    Option("compile_config", lambda: dict(compile_config=_compile_config()), SERVED, note="static caches only"),
    Option("constraints", _given(constraints=[object()]), REFUSED, "constraints"),
    Option("continuous_batching_config", _given(continuous_batching_config=None), SERVED, note="generate_batch only"),
    Option("decoder_start_token_id", _given(decoder_start_token_id=3), SERVED, note="encoder-decoders only"),
    Option("disable_compile", _given(disable_compile=True), SERVED),
    Option("diversity_penalty", _beams(diversity_penalty=0.5), SERVED, note="group beams only"),
    Option("do_sample", _sample(), SERVED),
    Option("dola_layers", _given(dola_layers="low"), REFUSED, "dola_layers"),
    Option("early_stopping", _beams(early_stopping=True), SERVED),
    Option("encoder_no_repeat_ngram_size", _given(encoder_no_repeat_ngram_size=2), SERVED),
    Option("encoder_repetition_penalty", _given(encoder_repetition_penalty=1.5), SERVED),
    Option("eos_token_id", _given(eos_token_id=[7, 9, 11]), SERVED),
    Option("epsilon_cutoff", _sample(epsilon_cutoff=3e-4), SERVED),
    Option("eta_cutoff", _sample(eta_cutoff=3e-4), SERVED),
    Option(
        "exponential_decay_length_penalty", _given(exponential_decay_length_penalty=(2, 1.5), eos_token_id=7), SERVED
    ),
    Option("force_words_ids", _beams(force_words_ids=[[5]]), REFUSED, "force_words_ids"),
    Option("forced_bos_token_id", _given(forced_bos_token_id=3), SERVED),
    Option("forced_eos_token_id", _given(forced_eos_token_id=3), SERVED),
    Option("guidance_scale", _given(guidance_scale=1.5), SERVED),
    Option("is_assistant", _given(is_assistant=True), SERVED),
    Option("length_penalty", _beams(length_penalty=-1.0), SERVED),
    Option("low_memory", _given(low_memory=True), SERVED),
    Option("max_cache_len", _given(max_cache_len=256), SERVED, note="with cache_implementation only"),
    Option("max_length", lambda: dict(max_length=_CACHE["columns"] + 5, max_new_tokens=None), SERVED),
    Option("max_matching_ngram_size", _given(max_matching_ngram_size=2), SERVED, note="assisted only"),
    Option("max_new_tokens", _given(max_new_tokens=3), SERVED),
    Option("max_time", _given(max_time=600.0), SERVED),
    Option("min_length", lambda: dict(min_length=_CACHE["columns"] + 4, eos_token_id=7), SERVED),
    Option("min_new_tokens", _given(min_new_tokens=4, eos_token_id=7), SERVED),
    Option("min_p", _sample(min_p=0.1), SERVED),
    Option("no_repeat_ngram_size", _given(no_repeat_ngram_size=2), SERVED),
    Option("num_assistant_tokens", _given(num_assistant_tokens=3), SERVED, note="assisted only"),
    Option("num_assistant_tokens_schedule", _given(num_assistant_tokens_schedule="constant"), SERVED),
    Option(
        "num_beam_groups", _given(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), REFUSED, "num_beam_groups"
    ),
    Option("num_beams", _beams(), SERVED),
    Option("num_return_sequences", _sample(num_return_sequences=2), SERVED),
    Option("output_attentions", _given(output_attentions=True, return_dict_in_generate=True), REFUSED, "attention"),
    Option("output_hidden_states", _given(output_hidden_states=True, return_dict_in_generate=True), SERVED),
    Option("output_logits", _given(output_logits=True, return_dict_in_generate=True), SERVED),
    Option("output_scores", _beams(output_scores=True, return_dict_in_generate=True), SERVED),
    Option("pad_token_id", _given(pad_token_id=0), SERVED),
    Option("penalty_alpha", _given(penalty_alpha=0.6, top_k=4), REFUSED, "penalty_alpha|contrastive"),
    Option(  # transformers before 5.21 prefills the chunks from the prompt's first column whatever the cache holds
        "prefill_chunk_size",
        _given(prefill_chunk_size=2),
        SERVED if _TRANSFORMERS >= (5, 21) else REFUSED,
        "prefill_chunk_size",
    ),
    Option("prompt_lookup_num_tokens", _given(prompt_lookup_num_tokens=2), REFUSED, ASSISTED),
    Option("remove_invalid_values", _given(remove_invalid_values=True), SERVED),
    Option("renormalize_logits", _sample(renormalize_logits=True), SERVED),
    Option("repetition_penalty", _given(repetition_penalty=1.5), SERVED),
    Option("return_dict_in_generate", _given(return_dict_in_generate=True), SERVED),
    Option("sequence_bias", _given(sequence_bias={(5,): 10.0}), SERVED),
    Option("speculation_type", _given(speculation_type="dflash"), SERVED, note="assisted only"),
    Option("stop_strings", lambda: dict(stop_strings=["a", "the"], tokenizer=tokenizer()), SERVED),
    Option("suppress_tokens", _given(suppress_tokens=[1, 2, 3]), SERVED),
    Option("target_lookbehind", _given(target_lookbehind=5), SERVED, note="assisted only"),
    Option("temperature", _sample(temperature=0.7), SERVED),
    Option("token_healing", lambda: dict(token_healing=True, tokenizer=tokenizer()), REFUSED, "token_healing"),
    Option("top_h", _sample(top_h=0.5), SERVED),
    Option("top_k", _sample(top_k=5), SERVED),
    Option("top_p", _sample(top_p=0.5), SERVED),
    Option("typical_p", _sample(typical_p=0.5), SERVED),
    Option("use_cache", _given(use_cache=False), REFUSED, "use_cache"),
    Option("use_mtp", _given(use_mtp=True), REFUSED, ASSISTED),
    Option("watermarking_config", lambda: dict(watermarking_config=_watermarking()), SERVED),
)
# generate()'s parameters
PARAMETER_OPTIONS: tuple[Option, ...] = (
    Option("generation_config", lambda: dict(generation_config=_generation_config()), SERVED),
    Option("logits_processor", lambda: dict(logits_processor=_logits_processor()), SERVED),
    Option("stopping_criteria", lambda: dict(stopping_criteria=_stopping_criteria()), SERVED),
    Option("prefix_allowed_tokens_fn", _given(prefix_allowed_tokens_fn=lambda row, ids: list(range(40, 90))), SERVED),
    Option("synced_gpus", _given(synced_gpus=False), SERVED),
    Option("assistant_model", lambda: dict(assistant_model=_assistant()), REFUSED, ASSISTED),
    Option("streamer", lambda: dict(streamer=_Streamer()), SERVED),
    Option("negative_prompt_ids", lambda: dict(guidance_scale=1.5, negative_prompt_ids=_negative_prompt()), SERVED),
    Option(
        "negative_prompt_attention_mask",
        lambda: dict(
            guidance_scale=1.5,
            negative_prompt_ids=_negative_prompt(),
            negative_prompt_attention_mask=torch.ones(2, 5, dtype=torch.long),
        ),
        SERVED,
    ),
    Option("custom_generate", _given(custom_generate=lambda *args, **kwargs: None), REFUSED, "custom_generate"),
)
# model inputs a caller may hand generate() beside the prompt
INPUT_OPTIONS: tuple[Option, ...] = (
    Option("past_key_values", lambda: dict(past_key_values=_user_cache()), REFUSED, "past_key_values|cache"),
    Option("inputs_embeds", lambda: dict(inputs_embeds=_embeddings()), REFUSED, "inputs_embeds"),
    Option("position_ids", _given(position_ids=torch.arange(37).expand(2, 37)), REFUSED, "position_ids"),
)
OPTIONS = CONFIG_OPTIONS + PARAMETER_OPTIONS + INPUT_OPTIONS


def _generation_config():
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, num_beams=2)


# -- judging --------------------------------------------------------------------------------------


def compare(ours, reference, attention_mask: torch.Tensor) -> str | None:
    """None when ``runtime.generate``'s result is transformers' own, else what differs.  The hidden
    states of generate()'s first step are those of the columns it fed: the compressed prompt's were
    computed in the prefill, so kvcal's first step covers the last columns of transformers' (compared
    where the mask is 1: a padding column's hidden state is nobody's)."""
    theirs = reference if isinstance(reference, torch.Tensor) else reference.sequences
    if ours.sequences.shape != theirs.shape or not torch.equal(ours.sequences, theirs):
        return f"sequences differ: {ours.sequences[:, -NEW_TOKENS:].tolist()} vs {theirs[:, -NEW_TOKENS:].tolist()}"
    if isinstance(reference, torch.Tensor):
        return None if ours.output is None else "a dict where transformers returns the sequences"
    if ours.output is None:
        return "no output dict"
    for field in ("scores", "logits"):
        mine, their = getattr(ours.output, field, None), getattr(reference, field, None)
        if (mine is None) != (their is None):
            return f"{field}: {'missing' if mine is None else 'given where transformers gives none'}"
        for step, (a, b) in enumerate(zip(mine or (), their or (), strict=True)):
            if a.shape != b.shape or not torch.allclose(a, b, atol=1e-4, rtol=0):
                return f"{field} of step {step} differ"
    mine, their = getattr(ours.output, "hidden_states", None), getattr(reference, "hidden_states", None)
    if (mine is None) != (their is None):
        return f"hidden_states: {'missing' if mine is None else 'given where transformers gives none'}"
    for step, (layers, reference_layers) in enumerate(zip(mine or (), their or (), strict=True)):
        for a, b in zip(layers, reference_layers, strict=True):
            if a.shape[1] > b.shape[1]:
                return f"hidden_states of step {step}: {a.shape[1]} columns, transformers' {b.shape[1]}"
            real = attention_mask[:, attention_mask.shape[1] - a.shape[1] :].bool() if step == 0 else slice(None)
            if not torch.allclose(a[real], b[:, b.shape[1] - a.shape[1] :][real], atol=1e-4, rtol=0):
                return f"hidden_states of step {step} differ"
    return None


def _forward_passes(network):
    calls = []
    handle = network.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


def run(option: Option) -> Outcome:
    """Run ``option`` through ``runtime.generate`` and judge it (see the module docstring)."""
    from runtime import CompressionPolicy, generate

    network = model()
    input_ids, attention_mask, columns = prompts()
    _CACHE["columns"] = input_ids.shape[1]
    base = dict(max_new_tokens=NEW_TOKENS, pad_token_id=0, do_sample=False)
    options = option.options()
    if "generation_config" in options:
        base = {}
    arguments = {k: v for k, v in (base | options).items() if v is not None or k not in base}
    if arguments.get("max_new_tokens", 0) is None:
        arguments.pop("max_new_tokens")
    calls, handle = _forward_passes(network)
    try:
        torch.manual_seed(3)
        ours = generate(network, input_ids, None, attention_mask=attention_mask, context_columns=columns, **arguments)
    except Exception as exc:  # noqa: BLE001 - judged below
        handle.remove()
        return _judge_error(option, exc, calls, network, input_ids, attention_mask, arguments)
    handle.remove()
    if option.verdict == REFUSED:
        return Outcome(False, f"accepted: {option.name} should be refused ({option.match})")
    torch.manual_seed(3)
    try:
        reference = network.generate(input_ids, attention_mask=attention_mask, **(arguments | _fresh(option)))
    except Exception as exc:  # noqa: BLE001
        return Outcome(False, f"served where transformers raises {type(exc).__name__}: {str(exc)[:120]}")
    difference = compare(ours, reference, attention_mask)
    if difference is not None:
        return Outcome(False, f"silently other: {difference}")
    evicting = CompressionPolicy(keep_ratio=0.5)
    torch.manual_seed(3)
    evicted = generate(
        network, input_ids, evicting, attention_mask=attention_mask, context_columns=columns, **arguments
    )
    held, expected = evicted.cache.get_seq_length(), evicted.sequences.shape[1] - 1
    if held != expected:
        return Outcome(False, f"silently other: with eviction the cache holds {held} columns, not {expected}")
    return Outcome(True, "served as transformers serves it")


def _fresh(option: Option) -> dict:
    """Stateful arguments a second call needs anew (a streamer counts what it was given)."""
    return {"streamer": _Streamer()} if option.name == "streamer" else {}


def _judge_error(option, exc, calls, network, input_ids, attention_mask, arguments) -> Outcome:
    message = str(exc).strip()
    if option.verdict == REFUSED:
        if not isinstance(exc, ValueError | TypeError):
            return Outcome(False, f"wrong error {type(exc).__name__}: {message[:160]!r}")
        if "\n" in message or not re.search(option.match, message):
            return Outcome(False, f"unclear {type(exc).__name__}: {message[:160]!r}")
        if calls:
            return Outcome(False, f"refused after {len(calls)} forward passes: {message[:120]!r}")
        return Outcome(True, f"refused: {message[:160]}")
    try:  # served: transformers' own refusal is an answer too
        torch.manual_seed(3)
        network.generate(input_ids, attention_mask=attention_mask, **arguments)
    except type(exc):
        return Outcome(True, f"transformers' own refusal: {type(exc).__name__}: {message[:120]}")
    except Exception:  # noqa: BLE001
        pass
    return Outcome(False, f"crashed where transformers serves it: {type(exc).__name__}: {message[:160]!r}")


def main() -> int:
    torch.set_num_threads(1)
    from transformers import GenerationConfig

    present = set(GenerationConfig().to_dict())
    handled = total = 0
    for option in OPTIONS:
        if option in CONFIG_OPTIONS and option.name not in present:
            continue  # an attribute this transformers release does not have
        outcome = run(option)
        total += 1
        handled += outcome.handled
        print(f"{'ok ' if outcome.handled else 'BAD'} {option.verdict:8s} {option.name}: {outcome.what}")
    print(f"{handled} of {total} handled, {total - handled} mishandled")
    return 0 if handled == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
