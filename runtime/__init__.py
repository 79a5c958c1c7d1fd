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
imported from its module (``from runtime.compression.prefill import prefill, compress``, ``from
runtime.scorers import Scorer``, ``from runtime.plan.serving_plan import ServingPlan``...).

Where a served decision is made, following one import chain from ``generate``, in six
subpackages, each importing only those listed before it (tests/test_layering.py):

* ``math``: MomentKV's sums and corrected merge (``momentkv``), ``rope``, the model's checked
  attention ``geometry``, Compactor's ``chunk_attention``, host/device ``arrays``;
* ``kv_store``: ``cache`` (``RaggedCache`` / ``RaggedLayer``, the adapter transformers sees; it stores
  and attends, never evicts, never calls up), ``segments`` (each layer's one packed buffer of every
  head's kept rows), ``layout`` (the decode pages derived from it), ``row_state`` (what a layer keeps
  per batch row), the kernels (``layer_attention``, ``paged_attention``, ``eager_attention``,
  ``flex_decode``), ``attention_interface`` (the scoped switch of a model's attention function) and
  ``transformers_compat`` (what differs between the supported transformers versions);
* ``scorers``: one module per scorer, each scoring a whole layer, its inputs built by the
  package's providers;
* ``plan``: ``policy`` (the policy value and what it needs from an artifact; its torch-free
  vocabulary is the shared base's, ``common.names`` and ``common.policy_grammar``), ``policy_spec``
  (policies by name: ``inf/leverage``, the flagship...), ``calibration`` (artifact loading and
  identity checks), ``budgets`` (per-head budgets), ``recommendation`` (which policy an artifact's
  measurements serve), ``rope_check``, and ``serving_plan``: ``bind(policy, calibration, model)``,
  the one place a policy meets an artifact, once per call;
* ``compression``: ``prefill`` (prefill and per-prompt eviction), ``eviction`` (a layer's heads down
  to their budgets), ``keep_rule`` (priority ranks: sinks, window, scores, ties), ``driver`` (when
  eviction runs during a forward pass: in the prefill and while decoding), ``ragged_attention`` (the
  registered attention function), ``prompt_statistics`` (pre-RoPE query sums) and ``kvzip`` (KVzip's
  reconstruction pass);
* ``serve``: the entry points (``generation``: ``generate``, ``answer``, ``compress_prompt``,
  ``build_inputs``) and ``decode_graph`` (decode steps replayed from CUDA graphs).

Argument checks and model loading (the embedded model too) are the shared base's: ``common.checks``,
``common.models``.

Depends on ``common``, ``artifacts``, ``prompt_format``, torch, transformers, numpy and h5py only
(never on the profiler or the probe generator).  ``kvpress_press`` (:class:`CalibratedPress`, an
artifact's policy as a press of NVIDIA's kvpress) is the one module that imports kvpress (the
``kvpress`` extra); nothing here imports it: ``from runtime.kvpress_press import CalibratedPress``.
"""

from importlib import import_module

# Exports load their module on first use (PEP 562), so that ``import runtime`` loads no torch
# until a name is used.
_EXPORTS = {
    "answer": "serve.generation",
    "bind": "plan.serving_plan",
    "CacheConsumedError": "kv_store.cache",
    "cache_argument": "kv_store.transformers_compat",
    "compress_prompt": "serve.generation",
    "CompressionPolicy": "plan.policy",
    "FLAGSHIP": "plan.policy_spec",
    "generate": "serve.generation",
    "load_calibration": "plan.calibration",
    "parse_policy": "plan.policy_spec",
    "ragged_attention": "compression.ragged_attention",
    "RaggedCache": "kv_store.cache",
    "UnsupportedModelError": "math.geometry",
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
