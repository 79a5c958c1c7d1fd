"""The calibration artifact's schema: what may be in the file, with which dtype and shape.

This table is the single source of truth for the writer, the reader and
``docs/artifact-format.md``.  A section is an HDF5 group under the root; each of its
datasets has an exact dtype and a shape written in symbols:

* architecture symbols, fixed by the ``/model`` attributes: ``L`` layers, ``Hq`` query heads,
  ``Hkv`` KV heads, ``d`` head dimension;
* section symbols, free but equal across a section's datasets and capped: ``P`` probes,
  ``NT`` token budgets, ``NR`` ratio budgets, ``R`` reference ratios, ``F`` scorer features,
  ``NC`` recommended compression ratios, ``NP`` candidate policies, ``K`` query centres, ``NG``
  budget-curve grid points, ``T`` held-out tasks, ``S`` selection scorers; a literal digit is a fixed
  size (``1``: one value).

Every section is optional (``profile-model --stages`` may write a subset); a section that is
present must hold all of its datasets but its ``optional`` ones, datasets a later minor version
added, which are present all together or not at all (files of the older minor lack them).  A
consumer that needs a section asks the reader for it and gets a clear error when it is missing.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field

import numpy as np

FORMAT_NAME = "kvcal-calibration"
SCHEMA_MAJOR = 1
SCHEMA_MINOR = 6  # 1.1: the learned_scorer section; 1.2: the recommendation section, /model weights_fingerprints;
# 1.3: the future_queries and budget_curves sections; 1.4: the recommendation's paired evidence (optional datasets);
# 1.5: the moments' orders and errors per selection scorer (optional datasets); 1.6: /model attention_variant
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"

# Upper bounds on the architecture numbers and free dimensions a file may declare.  They keep
# a hostile file from making the reader allocate absurd amounts of memory (together with the
# reader's cap on the total declared size, artifacts.reader.check_declared_size).  The largest
# released models are far inside them (Llama-3.1-405B: L=126, Hq=128, Hkv=8, d=128; head
# dimensions go up to 256).
ARCH_LIMITS = {"L": 512, "Hq": 512, "Hkv": 512, "d": 512}
FREE_DIM_LIMITS = {
    "P": 1_000_000,
    "NT": 4096,
    "NR": 4096,
    "R": 256,
    "F": 4096,
    "NC": 256,
    "NP": 256,
    "K": 256,
    "NG": 256,
    "T": 1_000_000,
    "S": 64,
}
MAX_STRING_ATTR_CHARS = 1 << 20  # config JSON and friends: at most a million characters
MAX_CONFIG_DEPTH = 64  # config_json / rope_parameters: objects and lists nested at most this deep
MAX_TOKENS = 1 << 40  # token counts in budget tables: sums over every head stay exact in int64


@dataclass(frozen=True)
class DatasetSpec:
    dtype: str  # numpy dtype string, little-endian; compared exactly
    shape: tuple[str, ...]  # symbols, see module docstring
    unit: str  # human description of the values, for the format doc
    minimum: float | None = None  # every value must be >= minimum (after the finite check)
    maximum: float | None = None
    finite: bool = True  # floats must be finite
    magnitude: float | None = None  # every |value| must be <= magnitude (what serving computes with stays finite)


@dataclass(frozen=True)
class SectionSpec:
    description: str
    datasets: dict[str, DatasetSpec]
    attrs: dict[str, type] = field(default_factory=dict)  # required section attributes
    # (minimum, maximum) of numeric attributes, None = unbounded on that side
    attr_bounds: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    # datasets a later minor version added: present all together or not at all
    optional: tuple[str, ...] = ()


SECTIONS: dict[str, SectionSpec] = {
    "behaviour": SectionSpec(
        "REAL attention-behaviour accumulators and scores per (layer, query head), and the "
        "probe table they were measured on.",
        {
            "W_R": DatasetSpec(
                "<f8",
                ("L", "Hq"),
                "sum of max attention weight over decode steps whose dominant token is labelled R",
                0.0,
            ),
            "W_B": DatasetSpec("<f8", ("L", "Hq"), "same, dominant token labelled B (bias)", 0.0),
            "W_D": DatasetSpec("<f8", ("L", "Hq"), "same, dominant token labelled D (distraction)", 0.0),
            "W_W": DatasetSpec("<f8", ("L", "Hq"), "same, dominant token labelled W (widespread)", 0.0),
            "steps": DatasetSpec("<i8", ("L", "Hq"), "decode steps accumulated for the head", 0),
            "RAsc": DatasetSpec("<f8", ("L", "Hq"), "W_R / (W_R + W_D), 0 for empty heads", 0.0, 1.0),
            "LCsc": DatasetSpec("<f8", ("L", "Hq"), "W_R / (W_R + W_B), 0 for empty heads", 0.0, 1.0),
            "INFsc": DatasetSpec("<f8", ("L", "Hq"), "harmonic mean of RAsc and LCsc, 0 when both are 0", 0.0, 1.0),
            "probe_length": DatasetSpec("<i8", ("P",), "asked context length of the probe, tokens", 1),
            "probe_depth": DatasetSpec("<f8", ("P",), "needle depth, percent of the context", 0.0, 100.0),
            "probe_family": DatasetSpec("|S64", ("P",), "needle family name, ASCII, NUL-padded"),
            "probe_seed": DatasetSpec("<i8", ("P",), "seed the probe was generated from"),
            "probe_success": DatasetSpec("|u1", ("P",), "1 when the greedy answer contained the ground truth", 0, 1),
            "probe_steps": DatasetSpec("<i8", ("P",), "decode steps taken on the probe", 0),
        },
    ),
    "query_stats": SectionSpec(
        "Expected Attention statistics of pre-RoPE queries (after the query norm where the model "
        "has one) per (layer, query head), from calibration text.",
        {
            "n": DatasetSpec("<i8", ("L", "Hq"), "number of queries accumulated", 0),
            "mean": DatasetSpec("<f4", ("L", "Hq", "d"), "mean pre-RoPE query", magnitude=1e4),
            "cov": DatasetSpec(
                "<f4",
                ("L", "Hq", "d", "d"),
                "population covariance (divided by n) of pre-RoPE queries; symmetric positive semi-definite",
                magnitude=1e8,
            ),
        },
        {"n_sink": int},
        {"n_sink": (0, None)},
    ),
    "future_queries": SectionSpec(
        "Statistics of the pre-RoPE queries that read a cache compressed before the question: the queries "
        "after each needle probe's context (question, answer), per (layer, query head): mean, covariance, "
        "and k-means centres with their weights.",
        {
            "n": DatasetSpec("<i8", ("L", "Hq"), "number of future queries accumulated", 0),
            "mean": DatasetSpec("<f4", ("L", "Hq", "d"), "mean pre-RoPE future query", magnitude=1e4),
            "cov": DatasetSpec(
                "<f4",
                ("L", "Hq", "d", "d"),
                "population covariance (divided by n) of pre-RoPE future queries; symmetric positive semi-definite",
                magnitude=1e8,
            ),
            "centres": DatasetSpec(
                "<f4", ("L", "Hq", "K", "d"), "k-means centres of the pre-RoPE future queries", magnitude=1e4
            ),
            "centre_weights": DatasetSpec(
                "<f8", ("L", "Hq", "K"), "fraction of the head's future queries nearest each centre", 0.0, 1.0
            ),
        },
    ),
    "budgets": SectionSpec(
        "Per-KV-head budget tables from REAL's INF allocation (docs/design.md section 3).",
        {
            "inf_kv": DatasetSpec(
                "<f8", ("L", "Hkv"), "INFsc averaged over each GQA group, normalised to sum to 1", 0.0, 1.0
            ),
            "token_budgets": DatasetSpec("<i8", ("NT",), "average budget per KV head, tokens", 1, MAX_TOKENS),
            "token_tables": DatasetSpec(
                "<i8", ("NT", "L", "Hkv"), "budget of each KV head, tokens (sum = budget x L x Hkv)", 0, MAX_TOKENS
            ),
            "ratios": DatasetSpec("<f8", ("NR",), "average budget as a fraction of the sequence length", 0.0, 1.0),
            "ratio_tables": DatasetSpec(
                "<f8", ("NR", "L", "Hkv"), "unrounded budget of each KV head as a fraction of the sequence length", 0.0
            ),
        },
        {"beta": float, "min_budget": int},
        {"beta": (1.0, None), "min_budget": (0, MAX_TOKENS)},
    ),
    "moments": SectionSpec(
        "MomentKV calibration: per-KV-head choice of correction order and the measured errors (1.5: under "
        "each selection scorer a policy serves the correction with).",
        {
            "order": DatasetSpec("|i1", ("L", "Hkv"), "correction order: -1 none, 0 zeroth, 1 first", -1, 1),
            "errors": DatasetSpec(
                "<f8",
                ("R", "3", "L", "Hkv"),
                "relative attention-output error norm(o_hat - o) / norm(o) for none / 0th / 1st order",
                0.0,
            ),
            "reference_ratios": DatasetSpec(
                "<f8", ("R",), "kept fraction of the cache at which errors were measured", 0.0, 1.0
            ),
            "tau": DatasetSpec("<f8", ("L", "Hkv"), "threshold below which C_vk entries are zeroed; 0 = none", 0.0),
            "selections": DatasetSpec(
                "|S128", ("S",), "1.5: name of each selection scorer calibrated under, the first = order's, ASCII"
            ),
            "selection_allocations": DatasetSpec(
                "|S128", ("S",), "1.5: how each selection's budget was shared out: uniform or global, ASCII"
            ),
            "selection_orders": DatasetSpec(
                "|i1",
                ("S", "L", "Hkv"),
                "1.5: correction order under each selection: -1 none, 0 zeroth, 1 first",
                -1,
                1,
            ),
            "selection_errors": DatasetSpec(
                "<f8", ("S", "R", "3", "L", "Hkv"), "1.5: the relative errors under each selection", 0.0
            ),
        },
        optional=("selections", "selection_allocations", "selection_orders", "selection_errors"),
    ),
    "learned_scorer": SectionSpec(
        "A learned token scorer per (layer, KV head): ridge regression from the head's pre-RoPE key "
        "and value to the log KVzip reconstruction importance, fitted on calibration text.",
        {
            "weights": DatasetSpec(
                "<f8",
                ("L", "Hkv", "F"),
                "coefficients on the features [pre-RoPE key, value] (F = 2d; d + dv for values of head dim dv)",
                magnitude=1e12,
            ),
            "bias": DatasetSpec("<f8", ("L", "Hkv"), "intercept", magnitude=1e12),
            "ridge": DatasetSpec(
                "<f8", ("L", "Hkv"), "ridge strength chosen on held-out text (penalty lambda n var per feature)", 0.0
            ),
            "r2": DatasetSpec(
                "<f8", ("L", "Hkv"), "held-out coefficient of determination of the log teacher score", -1e9, 1.0
            ),
            "rank_correlation": DatasetSpec(
                "<f8", ("L", "Hkv"), "held-out Spearman correlation of prediction and teacher", -1.0, 1.0
            ),
        },
        {"features": str, "teacher": str, "fit_tokens": int, "held_out_tokens": int},
        {"fit_tokens": (0, None), "held_out_tokens": (0, None)},
    ),
    "recommendation": SectionSpec(
        "Which eviction policy to serve at which compression ratio, measured on held-out needle tasks "
        "(never the profiled probes): per ratio the policy served (runtime.plan.policy_spec grammar), every "
        "candidate's accuracy and (1.4) the paired evidence that decided it.",
        {
            "compression_ratios": DatasetSpec("<f8", ("NC",), "fraction of the context's cache evicted", 0.0, 1.0),
            "policy": DatasetSpec("|S128", ("NC",), "the policy served at that ratio, ASCII, NUL-padded"),
            "accuracy": DatasetSpec("<f8", ("NC",), "its accuracy: fraction of tasks answered correctly", 0.0, 1.0),
            "ci_low": DatasetSpec("<f8", ("NC",), "lower end of its 95% Wilson interval", 0.0, 1.0),
            "ci_high": DatasetSpec("<f8", ("NC",), "upper end of its 95% Wilson interval", 0.0, 1.0),
            "candidates": DatasetSpec("|S128", ("NP",), "every candidate policy measured, cheapest to serve first"),
            "candidate_accuracy": DatasetSpec(
                "<f8", ("NP", "NC"), "accuracy of each candidate at each ratio", 0.0, 1.0
            ),
            "rule": DatasetSpec("|S128", ("1",), "1.4: the decision rule's name, ASCII, NUL-padded"),
            "tolerance": DatasetSpec("<f8", ("1",), "1.4: accuracy a cheaper candidate may give up", 0.0, 1.0),
            "confidence": DatasetSpec("<f8", ("1",), "1.4: one-sided confidence of the rule's bound", 0.0, 1.0),
            "reference": DatasetSpec(
                "<i8", ("NC",), "1.4: index in candidates of the reference at that ratio, -1 for none", -1
            ),
            "task_ids": DatasetSpec("|S128", ("T",), "1.4: needles probe id of every held-out task, ASCII"),
            "baseline_outcomes": DatasetSpec(
                "|u1", ("T",), "1.4: 1 when the uncompressed model answered the task correctly", 0, 1
            ),
            "outcomes": DatasetSpec(
                "|u1", ("NC", "NP", "T"), "1.4: 1 when the candidate answered the task correctly at that ratio", 0, 1
            ),
            "wins": DatasetSpec("<i8", ("NC", "NP"), "1.4: tasks only the candidate answered (vs the reference)", 0),
            "losses": DatasetSpec("<i8", ("NC", "NP"), "1.4: tasks only the reference answered", 0),
            "bound": DatasetSpec(
                "<f8", ("NC", "NP"), "1.4: upper confidence bound on the accuracy the candidate gives up", -1.0, 1.0
            ),
        },
        {"tasks": int, "baseline_accuracy": float, "task_seed": int, "families": str},
        {"tasks": (1, None), "baseline_accuracy": (0.0, 1.0)},
        optional=(
            "rule",
            "tolerance",
            "confidence",
            "reference",
            "task_ids",
            "baseline_outcomes",
            "outcomes",
            "wins",
            "losses",
            "bound",
        ),
    ),
    "budget_curves": SectionSpec(
        "Per-KV-head budget curves (LU-KV, arXiv 2602.08585): each head's measured loss at a grid of kept "
        "fractions, and per compression ratio the kept fraction of every head allocated by marginal utility.",
        {
            "compression_ratios": DatasetSpec(
                "<f8", ("NR",), "fraction of the context's cache evicted, strictly increasing", 0.0, 1.0
            ),
            "fractions": DatasetSpec(
                "<f8",
                ("NR", "L", "Hkv"),
                "kept fraction of the context per KV head; row r sums to (1 - compression_ratios[r]) x L x Hkv",
                0.0,
                1.0,
            ),
            "grid": DatasetSpec(
                "<f8", ("NG",), "kept fractions the losses were measured at, strictly increasing", 0.0, 1.0
            ),
            "output_error": DatasetSpec(
                "<f8", ("NG", "L", "Hkv"), "relative attention-output error on calibration text", 0.0
            ),
            "retention_loss": DatasetSpec(
                "<f8",
                ("NG", "L", "Hkv"),
                "lost retrieval hits at the answer's steps (or the question's attention mass) on evicted R-span tokens",
                0.0,
                1.0,
            ),
            "loss": DatasetSpec("<f8", ("NG", "L", "Hkv"), "the combined loss the allocation minimised", 0.0),
        },
        # no attributes (sections added after 1.2 are in no metadata digest): the settings are in
        # config_json["budget_curves"], which the digest covers
        {},
        {},
    ),
}


# Sections added after schema 1.1: their attributes are protected by extended_metadata_sha256 only
# (artifacts.metadata), so that a 1.1 reader, which skips them, can still verify metadata_sha256.
SECTIONS_AFTER_1_1 = ("recommendation",)
# Sections added after schema 1.2.  They have no attributes (every value is a checksummed dataset), and
# no metadata digest covers them, so that a 1.2 reader, which skips them, still verifies both digests.
SECTIONS_AFTER_1_2 = ("future_queries", "budget_curves")


@dataclass(frozen=True)
class ModelIdentity:
    """Which model an artifact belongs to: architecture numbers and fingerprints."""

    name: str  # model name or path as given to the profiler
    model_type: str  # transformers config.model_type, e.g. "llama"
    num_layers: int  # L
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # d
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_parameters: str  # JSON of the config's RoPE parameters (type, scaling...)
    query_norm: bool  # queries pass through a norm before RoPE (e.g. Qwen3)
    arch_fingerprint: str  # sha256 hex, see artifacts.fingerprint
    weights_fingerprint: str
    tokenizer_fingerprint: str
    # 1.2, optional: canonical JSON {dtype name: weights fingerprint with the weights cast to that
    # dtype} for float32, bfloat16, float16 (artifacts.fingerprint.weights_fingerprints); "" when
    # absent (files of 1.0 / 1.1), then only weights_fingerprint can be compared.
    weights_fingerprints: str = ""
    # 1.6, optional: canonical JSON of what the model's attention does beyond the numbers above
    # (artifacts.fingerprint.attention_variant: sliding windows, logit soft-capping, per-layer-type
    # RoPE); "" when the model has none of them (and in older files), then not part of the fingerprint.
    attention_variant: str = ""

    def dims(self) -> dict[str, int]:
        return {"L": self.num_layers, "Hq": self.num_q_heads, "Hkv": self.num_kv_heads, "d": self.head_dim}

    @property
    def value_head_dim(self) -> int:
        """The values' head dim: ``d`` but where ``attention_variant`` records another (MiMo-V2-Flash's
        ``value_head_dim``, :func:`artifacts.fingerprint.value_head_dim`)."""
        try:  # a malformed attention_variant is artifacts.validation's to refuse, by name
            variant = json.loads(self.attention_variant) if self.attention_variant else {}
        except ValueError:
            variant = {}
        value = variant.get("value_head_dim") if isinstance(variant, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else self.head_dim

    def dtype_fingerprints(self) -> dict[str, str]:
        """``weights_fingerprints`` as a dict (empty when the file has none)."""
        return json.loads(self.weights_fingerprints) if self.weights_fingerprints else {}


MODEL_ATTR_TYPES: dict[str, type] = typing.get_type_hints(ModelIdentity)
# /model attributes added after 1.1, absent from older files (the field's default then).  They
# are not part of metadata_sha256, which a 1.1 reader must still be able to verify; the root
# attribute extended_metadata_sha256 covers them (docs/artifact-format.md section 5).
OPTIONAL_MODEL_ATTRS: tuple[str, ...] = ("weights_fingerprints", "attention_variant")


@dataclass
class Section:
    """One section's datasets (numpy arrays by name) and attributes."""

    arrays: dict[str, np.ndarray]
    attrs: dict[str, int | float | str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


@dataclass
class Artifact:
    """Everything a calibration file holds, in memory."""

    model: ModelIdentity
    config: dict  # the full probe / calibration configuration (JSON-serialisable)
    sections: dict[str, Section] = field(default_factory=dict)
    toolkit_version: str = ""  # filled in by the writer when empty
    created: str = ""  # ISO-8601 UTC, filled in by the writer when empty


def canonical_json(value) -> str:
    """Deterministic JSON used wherever text is hashed or stored."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def resolve_shape(spec: DatasetSpec, dims: dict[str, int]) -> tuple[int, ...]:
    """Shape of ``spec`` given architecture and section dimensions; literal digits stay as is."""
    return tuple(int(sym) if sym.isdigit() else dims[sym] for sym in spec.shape)
