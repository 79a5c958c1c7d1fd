"""Serving runtime: per-KV-head eviction inside ``model.generate`` (docs/design.md sections 1-3, 6).

    from runtime import CompressionPolicy, load_calibration, generate, answer
    calibration = load_calibration(model, tokenizer)               # next to the weights, hub snapshot, kvcal cache
    policy = calibration.policy(compression_ratio=0.75)            # the artifact's measured best, 75% evicted
    policy = CompressionPolicy(compression_ratio=0.75)             # or any policy; this one needs no artifact
    plan = bind(policy, calibration, model)                        # optional: check and load once, serve many
    result = generate(model, input_ids, policy, context_columns=n, calibration=calibration,
                      max_new_tokens=32)

Modules: ``cache`` (the packed per-layer cache: every head's retained tokens in one buffer per
layer, MomentKV moment sums and correction), ``paged_attention`` (attention over that buffer for
all rows and heads at once), ``attention`` (the registered attention function and its scoped
switch), ``scorers`` (a package, one module per scorer: EA,
prototype attention, KeyDiff, SnapKV, KNorm, StreamingLLM, leverage, KVzip, learned; each scores a
whole layer, its inputs built by the package's providers), ``policy`` (the policy value and what it
needs from an artifact), ``serving_plan`` (``bind``: a policy checked against, and loaded from, one
calibration for one model), ``policy_spec`` (policies by name: the grammar
``inf/leverage``, ``global/learned+correction``..., the flagship), ``recommendation`` (the
artifact's measured best policy per compression ratio), ``compress`` (prefill and per-prompt
eviction), ``eviction`` (a layer's heads down to their budgets: layer-batched scores,
sinks/window, compaction; moment-informed rounds head by head; also used while decoding),
``moments`` (MomentKV math), ``generate`` (entry points), ``calibration`` (artifact loading and
identity checks), ``rope``; ``geometry`` (the model's checked attention geometry),
``query_moments`` (pre-RoPE query sums: a prompt's, or the calibration's), ``attention``'s
scoped swap, ``budgets`` and ``models`` are shared with the profiler.

Depends on ``artifacts``, ``prompt_format``, torch, transformers, numpy and h5py only (never on
the profiler or the probe generator).
"""

from .attention import enable, ragged_attention, register
from .cache import ATTENTION_NAME, RaggedCache, RaggedLayer
from .calibration import Calibration, find_artifact, load_calibration
from .compress import CompressionReport, compress, prefill
from .generate import GenerationResult, answer, build_inputs, compress_prompt, generate, split_prompt
from .geometry import ModelGeometry, UnsupportedModelError
from .policy import CompressionPolicy
from .policy_spec import FLAGSHIP, PolicySpec, parse_policy
from .query_moments import QueryMoments
from .recommendation import Recommendation
from .scorers import SCORERS, LayerInputs, Scorer, ScorerInputs, make_scorer
from .selection import select_rows
from .serving_plan import ServingPlan, bind
from .transformers_compat import cache_argument

__all__ = [
    "ATTENTION_NAME",
    "Calibration",
    "CompressionPolicy",
    "CompressionReport",
    "FLAGSHIP",
    "GenerationResult",
    "LayerInputs",
    "PolicySpec",
    "ModelGeometry",
    "QueryMoments",
    "RaggedCache",
    "RaggedLayer",
    "Recommendation",
    "SCORERS",
    "Scorer",
    "ScorerInputs",
    "ServingPlan",
    "UnsupportedModelError",
    "answer",
    "bind",
    "build_inputs",
    "cache_argument",
    "compress",
    "compress_prompt",
    "enable",
    "find_artifact",
    "generate",
    "load_calibration",
    "make_scorer",
    "parse_policy",
    "prefill",
    "ragged_attention",
    "register",
    "select_rows",
    "split_prompt",
]
