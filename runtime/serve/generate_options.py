"""What a call asks of ``model.generate``, and what kvcal lets through to it.

generate()'s options resolve as transformers resolves them (:func:`generation_config`: its arguments, or
``generation_config``, over the model's generation config over the library's defaults), and its decoding mode
is transformers' own ``GenerationConfig.get_generation_mode``.  :func:`check_generation_options` refuses, before
any forward pass, what kvcal would not serve as transformers serves it; :func:`served_cache_defaults` overrides
a checkpoint's own ``use_cache: false`` or ``cache_implementation`` for kvcal's calls.
``tests/generate_options_cases.py`` tries every option against the unmodified model (docs/results.md
R-generate-options-2026-11-29).
"""

from __future__ import annotations

import contextlib
import functools

import transformers

from runtime.kv_store.shared_scope import shared_switch

# generate()'s decoding modes served through the compressed cache: one token per row and step, the cache reordered
# with the beams.  The others read a cache otherwise: assisted decoding (an assistant model, prompt lookup, early
# exit, multi-token prediction) verifies drafts and crops the cache back; contrastive search, DoLa, group beams and
# constraints are loops transformers 5 moved to the Hub (custom_generate).
SERVED_MODES = frozenset(("greedy_search", "sample", "beam_search", "beam_sample"))
# the options that make generate() take another mode, by mode
_MODE_OPTIONS = {
    "assisted_generation": ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp"),
    "contrastive_search": ("penalty_alpha",),
    "dola_generation": ("dola_layers",),
    "constrained_beam_search": ("constraints", "force_words_ids"),
    "group_beam_search": ("num_beam_groups",),
}
_HUB_LOOP = "a loop transformers moved to the Hub, which re-reads the cache its own way"
_MODE_REASONS = {
    "assisted_generation": "it verifies drafted tokens and crops the cache back, which a compressed cache cannot undo",
    "contrastive_search": _HUB_LOOP,
    "dola_generation": _HUB_LOOP,
    "constrained_beam_search": _HUB_LOOP,
    "group_beam_search": _HUB_LOOP,
}
# generate()'s chunked prefill (``prefill_chunk_size``) feeds the prompt from its first column whatever the cache
# holds before transformers 5.21, behind kvcal's compressed cache the prompt again; from 5.21 on it feeds the columns
# after the cache's (read in 5.2, 5.10, 5.17 to 5.20: from the first; 5.21.0, 5.21.1, 5.23, 5.24: after the cache)
CHUNKED_PREFILL_AFTER_THE_CACHE = (5, 21)
# model inputs generate() hands the forward pass, which kvcal makes itself: the cache, the embeddings and
# positions of the prompt it compressed (positions numbered from each row's first real token)
_MADE_BY_KVCAL = ("past_key_values", "cache", "inputs_embeds", "position_ids", "cache_position")
# what a checkpoint's generation_config.json may set that kvcal overrides for its calls: it generates through its
# own compressed cache (generate_from_cache); transformers itself ignores "hybrid"
_CACHE_DEFAULTS = {"use_cache": True, "cache_implementation": None}


def check_generation_options(model, generate_kwargs: dict) -> None:
    """Refuse, before any forward pass, an option of ``model.generate`` that kvcal would not serve as transformers
    serves it (tests/generate_options_cases.py holds every option of generate() and what becomes of it): a
    cache, embeddings or positions of the caller's (:data:`_MADE_BY_KVCAL`), ``custom_generate``, a decoding mode
    outside :data:`SERVED_MODES`, ``use_cache=False`` or a ``cache_implementation`` asked for (generate() would
    re-read the whole prompt at every step, or build another cache), ``token_healing`` (it re-tokenises the
    prompt's last tokens inside generate(), after kvcal compressed them) and ``output_attentions`` (kvcal's
    attention computes no attention weights to return).  A checkpoint's own ``use_cache: false`` or
    ``cache_implementation`` (its ``generation_config``) is not the caller's: :func:`served_cache_defaults`."""
    given = [name for name in _MADE_BY_KVCAL if generate_kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"{given[0]}: kvcal makes the cache, embeddings and positions of the prompt it compresses; pass the "
            "prompt's input_ids and attention_mask alone"
        )
    if generate_kwargs.get("custom_generate") is not None:
        raise ValueError(
            "custom_generate: a decoding loop of its own reads and writes the cache in ways kvcal has not checked; "
            "kvcal serves generate()'s greedy, sampling and beam search"
        )
    asked = dict(generate_kwargs)
    if (config := generate_kwargs.get("generation_config")) is not None:  # its settings are the caller's too
        asked = {name: getattr(config, name, None) for name in _CACHE_DEFAULTS} | asked
    if asked.get("use_cache") is False:
        raise ValueError(
            "use_cache=False: generate() would feed the whole prompt again at every step, around the compressed "
            "cache; kvcal generates through its cache (leave use_cache unset)"
        )
    if asked.get("cache_implementation") not in (None, "hybrid"):
        raise ValueError(
            f"cache_implementation={asked['cache_implementation']!r}: kvcal generates through its own compressed "
            "cache (a RaggedCache), not one generate() builds; leave it unset (decode_graphs=True replays a CUDA "
            "model's decode steps from captured graphs)"
        )
    config = generation_config(model, generate_kwargs)
    if (
        getattr(config, "prefill_chunk_size", None) is not None
        and _transformers_version() < CHUNKED_PREFILL_AFTER_THE_CACHE
    ):
        raise ValueError(
            f"prefill_chunk_size: transformers {transformers.__version__}'s generate() prefills in chunks from the "
            "prompt's first column whatever the cache holds (the whole prompt again behind kvcal's compressed cache; "
            "5.21 on starts after the cache); leave it unset (kvcal's block_size prefills the context in blocks)"
        )
    if getattr(config, "token_healing", False):
        raise ValueError(
            "token_healing: generate() would re-tokenise the prompt's last tokens after kvcal compressed them; "
            "heal the prompt before calling kvcal"
        )
    if config.output_attentions:
        raise ValueError(
            "output_attentions: kvcal's attention kernels compute no attention weights to return (scores, "
            "logits and hidden states can be returned)"
        )
    mode = str(getattr(config.get_generation_mode(generate_kwargs.get("assistant_model")), "value", ""))
    if mode and mode not in SERVED_MODES:
        names = [n for n in _MODE_OPTIONS.get(mode, ()) if generate_kwargs.get(n) or getattr(config, n, None)]
        raise ValueError(
            f"{', '.join(names) or mode}: generate()'s {mode.replace('_', ' ')}, which kvcal does not serve: "
            f"{_MODE_REASONS.get(mode, 'not checked')}; kvcal serves greedy, sampling and beam search"
        )


def _transformers_version() -> tuple[int, int]:
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def served_cache_defaults(model):
    """For this block, ``model.generation_config`` says ``use_cache=True`` and no ``cache_implementation``
    (:data:`_CACHE_DEFAULTS`): a checkpoint saved with ``"use_cache": false`` (as training with gradient
    checkpointing leaves it) or a static cache in its generation_config.json would make generate() feed the
    whole prompt again at every step behind the compressed cache (a doubled context, the prompt held
    uncompressed), or refuse the cache kvcal hands it.  transformers' own result is the same tokens with or
    without a cache; the caller's own asking is refused by :func:`check_generation_options`.  Restored when
    the last call holding it ends (:func:`~runtime.kv_store.shared_scope.shared_switch`: threads serving one
    model)."""
    return shared_switch(model, "generation cache defaults", functools.partial(_cache_defaults, model))


@contextlib.contextmanager
def _cache_defaults(model):
    config = getattr(model, "generation_config", None)
    saved = {name: getattr(config, name) for name in _CACHE_DEFAULTS if config is not None and hasattr(config, name)}
    changed = {name: value for name, value in _CACHE_DEFAULTS.items() if name in saved and saved[name] != value}
    for name, value in changed.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name in changed:
            setattr(config, name, saved[name])


def generation_config(model, generate_kwargs: dict):
    """The generation config ``model.generate(**generate_kwargs)`` resolves (transformers' own
    ``_prepare_generation_config``: its arguments, or ``generation_config``, over
    ``model.generation_config`` over the library defaults)."""
    kwargs = dict(generate_kwargs)
    with served_cache_defaults(model):
        config, _ = model._prepare_generation_config(kwargs.pop("generation_config", None), **kwargs)
    return config
