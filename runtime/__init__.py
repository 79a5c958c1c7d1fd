"""Serving runtime: per-KV-head eviction inside ``model.generate`` (docs/design.md sections 1-3, 6).

    from runtime import CompressionPolicy, answer, bind, generate, load_calibration
    calibration = load_calibration(model, tokenizer)               # next to the weights, hub snapshot, kvcal cache
    policy = calibration.policy(compression_ratio=0.75)            # the artifact's measured best, 75% evicted
    policy = CompressionPolicy(compression_ratio=0.75)             # or any policy; this one needs no artifact
    plan = bind(policy, calibration, model)                        # optional: check and load once, serve many
    result = generate(model, input_ids, policy, context_columns=n, calibration=calibration,
                      max_new_tokens=32)

The package exports the names a serving user needs (:data:`__all__`, each in README.md's "API"
table): the entry points (``load_calibration``, ``answer``, ``generate``, ``compress_prompt``), the
policy (``CompressionPolicy``, ``parse_policy``, ``FLAGSHIP``, ``bind``), the cache for calling
``model.generate`` yourself (``RaggedCache``, ``ragged_attention``, ``cache_argument``) and the two
errors a caller catches (``CacheConsumedError``, ``UnsupportedModelError``).  Everything else is
imported from its module (``from runtime.compression import prefill, compress``, ``from
runtime.scorers import Scorer``, ``from runtime.serving_plan import ServingPlan``...).

Where a served decision is made, following one import chain from ``generate``:

* ``generation``: the entry points (``generate``, ``answer``, ``compress_prompt``, ``build_inputs``);
* ``serving_plan``: ``bind(policy, calibration, model)``, the one place a policy meets an artifact;
* ``policy``: the policy value and what it needs from an artifact (its torch-free vocabulary is
  the shared base's: ``common.names``, ``common.policy_grammar``); ``policy_spec``: policies by
  name (``inf/leverage``, the flagship...); ``recommendation``: which policy an artifact's measurements serve;
* ``compression``: prefill and per-prompt eviction; ``eviction``: a layer's heads down to their
  budgets (also called back while decoding); ``selection``: the one keep rule (priority ranks:
  sinks, window, scores, ties); ``budgets``: per-head budgets;
* ``scorers``: a package, one module per scorer, each scoring a whole layer, its inputs built by
  the package's providers;
* ``cache``: ``RaggedCache`` / ``RaggedLayer``, the adapter transformers sees, over
  ``segments`` (each layer's one packed buffer of every head's kept rows), ``layout`` (the decode
  pages derived from it), ``layer_attention`` (the attention computation), ``row_state`` (per-row
  MomentKV state and the decode-time eviction hook); ``paged_attention``: the kernel over pages;
  ``attention``: the registered attention function and its scoped switch;
  ``moments``: MomentKV math; ``kvzip``: KVzip's reconstruction pass;
* ``calibration``: artifact loading and identity checks; ``geometry``: the model's checked
  attention geometry; ``rope``; ``query_moments``: pre-RoPE query sums; ``checks``: argument
  checks; ``transformers_compat``: what differs between the supported transformers versions.
  Loading a model (the embedded one too) is the shared base's: ``common.models``.

Depends on ``common``, ``artifacts``, ``prompt_format``, torch, transformers, numpy and h5py only
(never on the profiler or the probe generator).  ``kvpress_press`` (:class:`CalibratedPress`, an
artifact's policy as a press of NVIDIA's kvpress) is the one module that imports kvpress (the
``kvpress`` extra); nothing here imports it: ``from runtime.kvpress_press import CalibratedPress``.
"""

from importlib import import_module

# Exports load their module on first use (PEP 562), so that ``import runtime`` loads no torch
# until a name is used.
_EXPORTS = {
    "answer": "generation",
    "bind": "serving_plan",
    "CacheConsumedError": "cache",
    "cache_argument": "transformers_compat",
    "compress_prompt": "generation",
    "CompressionPolicy": "policy",
    "FLAGSHIP": "policy_spec",
    "generate": "generation",
    "load_calibration": "calibration",
    "parse_policy": "policy_spec",
    "ragged_attention": "attention",
    "RaggedCache": "cache",
    "UnsupportedModelError": "geometry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
