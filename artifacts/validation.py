"""Checks shared by the writer (refuse to write a bad artifact) and the reader (refuse to
return a bad value).  Each raises :class:`ArtifactError` with a message naming the object."""

from __future__ import annotations

import json

import numpy as np

from common.formulas import harmonic_mean, ideal_budgets, share, wilson_interval
from common.names import MOMENT_SELECTIONS, NAMED_POLICIES
from common.policy_grammar import serving_refusal
from common.probe_ids import PROBE_ID

from .errors import ArtifactError
from .fingerprint import architecture_fingerprint
from .schema import (
    ARCH_LIMITS,
    FREE_DIM_LIMITS,
    MAX_CONFIG_DEPTH,
    MAX_STRING_ATTR_CHARS,
    MODEL_ATTR_TYPES,
    OPTIONAL_MODEL_ATTRS,
    SECTIONS,
    ModelIdentity,
    canonical_json,
    resolve_shape,
)


def coerce_attr(where: str, name: str, value, kind: type):
    """An HDF5/numpy attribute value as the Python ``kind`` the schema asks for."""
    if kind is str:
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ArtifactError(f"{where}: attribute {name!r} is not UTF-8 text") from exc
        if not isinstance(value, str):
            raise ArtifactError(f"{where}: attribute {name!r} must be text, got {type(value).__name__}")
        if len(value) > MAX_STRING_ATTR_CHARS:
            raise ArtifactError(f"{where}: attribute {name!r} is longer than {MAX_STRING_ATTR_CHARS} characters")
        return value
    if isinstance(value, np.ndarray):
        if value.shape != ():
            raise ArtifactError(f"{where}: attribute {name!r} must be a scalar, got shape {value.shape}")
        value = value[()]
    if kind is bool:
        if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
            return bool(value)
        raise ArtifactError(f"{where}: attribute {name!r} must be 0/1, got {value!r}")
    if kind is int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ArtifactError(f"{where}: attribute {name!r} must be an integer, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ArtifactError(f"{where}: attribute {name!r} must be a number, got {value!r}")
        if not np.isfinite(value):
            raise ArtifactError(f"{where}: attribute {name!r} is not finite ({value})")
        return float(value)
    raise ArtifactError(f"{where}: attribute {name!r} has an unsupported schema type {kind}")


def model_identity_from_attrs(attrs) -> ModelIdentity:
    """Build and check a :class:`ModelIdentity` from a mapping of attribute values."""
    values = {}
    for name, kind in MODEL_ATTR_TYPES.items():
        if name not in attrs and name in OPTIONAL_MODEL_ATTRS:
            continue  # added after 1.1: absent from older files (the field's default)
        if name not in attrs:
            raise ArtifactError(f"/model: required attribute {name!r} is missing")
        values[name] = coerce_attr("/model", name, attrs[name], kind)
        if name in OPTIONAL_MODEL_ATTRS and values[name] == "":
            # the writer leaves an absent one out: empty text would read as absent, changing no digest
            raise ArtifactError(f"/model: attribute {name!r} is empty text (a file without one leaves it out)")
    identity = ModelIdentity(**values)
    check_model_identity(identity)
    return identity


def check_model_identity(identity: ModelIdentity) -> None:
    for symbol, value in identity.dims().items():
        if not 1 <= value <= ARCH_LIMITS[symbol]:
            raise ArtifactError(f"/model: {symbol} = {value} is outside [1, {ARCH_LIMITS[symbol]}]")
    if identity.num_q_heads % identity.num_kv_heads:
        raise ArtifactError(
            f"/model: {identity.num_q_heads} query heads are not a multiple of {identity.num_kv_heads} KV heads"
        )
    for name in ("hidden_size", "vocab_size", "max_position_embeddings"):
        if getattr(identity, name) < 1:
            raise ArtifactError(f"/model: {name} must be positive")
    if identity.rope_theta <= 0:
        raise ArtifactError("/model: rope_theta must be positive")
    parse_json_object("/model: rope_parameters", identity.rope_parameters)
    # The fingerprint is a digest of the numbers above: recomputed, not trusted, so that an edited
    # number (a head_dim changed to fit a model) cannot pass the identity check with the old digest.
    numbers = {name: getattr(identity, name) for name in ARCH_NUMBERS}
    if identity.attention_variant:  # 1.6: part of the fingerprint only when present
        parse_json_object("/model: attention_variant", identity.attention_variant)
        numbers["attention_variant"] = identity.attention_variant
    if architecture_fingerprint(numbers, identity.query_norm) != identity.arch_fingerprint:
        raise ArtifactError(
            "/model: arch_fingerprint does not match the recorded architecture numbers (they were edited, "
            "or the fingerprint was not computed by artifacts.fingerprint.architecture_fingerprint)"
        )
    if identity.weights_fingerprints:
        _check_dtype_fingerprints(identity)


# The /model numbers the architecture fingerprint is computed from (docs/artifact-format.md section 4).
ARCH_NUMBERS = (
    "model_type",
    "num_layers",
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "hidden_size",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
)


def _refuse_constant(constant: str):
    raise ValueError(f"{constant} is not JSON (the writer's canonical JSON never holds it)")


def _depth(value) -> int:
    """How deeply objects and lists nest in ``value`` (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_CONFIG_DEPTH:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_json_object(where: str, text: str) -> dict:
    """``text`` as strict JSON (no NaN / Infinity, which canonical JSON never writes), an object,
    nested at most ``MAX_CONFIG_DEPTH`` deep."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ArtifactError(f"{where} is nested deeper than {MAX_CONFIG_DEPTH} levels") from None
    except ValueError as exc:
        raise ArtifactError(f"{where} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ArtifactError(f"{where} must be a JSON object, got {type(value).__name__}")
    if _depth(value) > MAX_CONFIG_DEPTH:
        raise ArtifactError(f"{where} is nested deeper than {MAX_CONFIG_DEPTH} levels")
    return value


def check_config(config) -> None:
    """The writer's side of ``parse_json_object`` for the job configuration."""
    if not isinstance(config, dict):
        raise ArtifactError(f"config must be a JSON object (a dict), got {type(config).__name__}")
    try:
        text = canonical_json(config)
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"config cannot be stored as canonical JSON ({exc})") from None
    parse_json_object("config", text)


def _check_dtype_fingerprints(identity: ModelIdentity) -> None:
    """``weights_fingerprints``: a JSON object of SHA-256 hex digests by dtype name, whose float32
    entry is ``weights_fingerprint`` (unknown dtype names are allowed: a newer writer's)."""
    try:
        entries = json.loads(identity.weights_fingerprints)
    except ValueError as exc:
        raise ArtifactError("/model: weights_fingerprints is not valid JSON") from exc
    if not isinstance(entries, dict) or not all(
        isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")
        for value in entries.values()
    ):
        raise ArtifactError("/model: weights_fingerprints must map dtype names to SHA-256 hex digests")
    if entries.get("float32") != identity.weights_fingerprint:
        raise ArtifactError("/model: weights_fingerprints['float32'] differs from weights_fingerprint")


def section_dims(
    section: str, shapes: dict[str, tuple[int, ...]], arch: dict[str, int], value_dim: int | None = None
) -> dict[str, int]:
    """Architecture dims plus the section's free dims, inferred from dataset shapes and checked.

    ``shapes`` maps each of the section's dataset names to its shape; ``value_dim``: the values' head dim
    (:attr:`~artifacts.schema.ModelIdentity.value_head_dim`; None: ``d``).  Every dataset must be
    present (the section's ``optional`` ones all together or none), have the right rank, agree
    on free dims, and match the architecture exactly.
    """
    spec = SECTIONS[section]
    dims = dict(arch)
    value_dim = dims["d"] if value_dim is None else value_dim
    optional_present = [name for name in spec.optional if name in shapes]
    if optional_present and len(optional_present) != len(spec.optional):
        absent = [name for name in spec.optional if name not in shapes]
        raise ArtifactError(f"/{section}: dataset(s) {absent} missing (the optional ones come all together)")
    for name, dspec in spec.datasets.items():
        if name not in shapes:
            if name in spec.optional:
                continue
            raise ArtifactError(f"/{section}: required dataset {name!r} is missing")
        shape = tuple(shapes[name])
        if len(shape) != len(dspec.shape):
            raise ArtifactError(
                f"/{section}/{name}: expected {len(dspec.shape)} dimensions {dspec.shape}, got shape {shape}"
            )
        for symbol, size in zip(dspec.shape, shape, strict=True):
            if symbol in FREE_DIM_LIMITS and symbol not in dims:
                if not 1 <= size <= FREE_DIM_LIMITS[symbol]:
                    raise ArtifactError(
                        f"/{section}/{name}: {symbol} = {size} is outside [1, {FREE_DIM_LIMITS[symbol]}]"
                    )
                dims[symbol] = size
        expected = resolve_shape(dspec, dims)
        if shape != expected:
            named = ", ".join(f"{s}={v}" for s, v in zip(dspec.shape, expected, strict=True))
            raise ArtifactError(f"/{section}/{name}: shape {shape} does not match the recorded architecture ({named})")
    if section == "learned_scorer" and dims["F"] != dims["d"] + value_dim:
        raise ArtifactError(
            f"/learned_scorer/weights: F = {dims['F']} features, the format says d + dv = {dims['d'] + value_dim} "
            "(the pre-RoPE key and the value)"
        )
    return dims


_BLOCK_BYTES = 16 << 20  # value checks run over blocks of the leading axis: bounded temporaries


def _blocks(array: np.ndarray):
    """``array`` as views of whole leading-axis slices of about ``_BLOCK_BYTES`` each."""
    if array.ndim == 0 or array.nbytes <= _BLOCK_BYTES:
        yield array
        return
    step = max(1, _BLOCK_BYTES // max(1, array[0].nbytes))
    for start in range(0, array.shape[0], step):
        yield array[start : start + step]


def check_array(section: str, name: str, array: np.ndarray, dims: dict[str, int]) -> None:
    """dtype, shape, finiteness, range and magnitude of one dataset's values."""
    dspec = SECTIONS[section].datasets[name]
    where = f"/{section}/{name}"
    if array.dtype != np.dtype(dspec.dtype):
        raise ArtifactError(f"{where}: dtype {array.dtype.str} where the schema says {dspec.dtype}")
    expected = resolve_shape(dspec, dims)
    if array.shape != expected:
        raise ArtifactError(f"{where}: shape {array.shape}, expected {expected}")
    if array.dtype.kind in "fiu" and array.size:
        if array.dtype.kind == "f" and dspec.finite:
            bad = sum(int(block.size - np.count_nonzero(np.isfinite(block))) for block in _blocks(array))
            if bad:
                raise ArtifactError(f"{where}: {bad} value(s) are NaN or infinite")
        low, high = array.min(), array.max()
        if dspec.minimum is not None and low < dspec.minimum:
            raise ArtifactError(f"{where}: value {low} below the allowed minimum {dspec.minimum}")
        if dspec.maximum is not None and high > dspec.maximum:
            raise ArtifactError(f"{where}: value {high} above the allowed maximum {dspec.maximum}")
        if dspec.magnitude is not None and max(abs(float(low)), abs(float(high))) > dspec.magnitude:
            worst = low if abs(float(low)) > abs(float(high)) else high
            raise ArtifactError(f"{where}: value {worst:g} beyond the allowed magnitude {dspec.magnitude:g}")
    if array.dtype.kind == "S":
        for item in array.reshape(-1):
            try:
                item.decode("ascii")
            except UnicodeDecodeError as exc:
                raise ArtifactError(f"{where}: non-ASCII text") from exc


def check_section_attrs(section: str, attrs) -> dict:
    spec = SECTIONS[section]
    values = {}
    for name, kind in spec.attrs.items():
        if name not in attrs:
            raise ArtifactError(f"/{section}: required attribute {name!r} is missing")
        values[name] = value = coerce_attr(f"/{section}", name, attrs[name], kind)
        low, high = spec.attr_bounds.get(name, (None, None))
        if low is not None and value < low:
            raise ArtifactError(f"/{section}: attribute {name} = {value:g} is below the allowed minimum {low:g}")
        if high is not None and value > high:
            raise ArtifactError(f"/{section}: attribute {name} = {value:g} is above the allowed maximum {high:g}")
    return values


# -- relations between a section's values ------------------------------------------------------
#
# One function per section checks what the format says about its values together (sums,
# symmetry, membership): ``check_section_values(section, arrays, attrs)`` with whichever of
# the section's datasets ``arrays`` holds; a relation is checked when all its datasets are
# there.  The writer passes every dataset; the reader, reading one dataset, passes it with the
# siblings its relations need (``RELATED``, all small), so whatever a consumer reads was checked.

RELATED: dict[tuple[str, str], tuple[str, ...]] = {
    ("budgets", "token_tables"): ("token_budgets",),
    ("budgets", "ratio_tables"): ("ratios", "inf_kv"),
    ("budgets", "inf_kv"): ("ratios", "ratio_tables"),
    ("budgets", "ratios"): ("ratio_tables", "inf_kv"),
    ("behaviour", "RAsc"): ("W_R", "W_D", "LCsc", "INFsc"),
    ("behaviour", "LCsc"): ("W_R", "W_B", "RAsc", "INFsc"),
    ("behaviour", "INFsc"): ("RAsc", "LCsc"),
    ("behaviour", "W_R"): ("W_B", "W_D", "RAsc", "LCsc"),
    ("behaviour", "W_B"): ("W_R", "LCsc"),
    ("behaviour", "W_D"): ("W_R", "RAsc"),
    # every value of the recommendation takes part in the decision it records: each relates to all
    **{
        ("recommendation", name): tuple(other for other in SECTIONS["recommendation"].datasets if other != name)
        for name in SECTIONS["recommendation"].datasets
    },
    ("budget_curves", "fractions"): ("compression_ratios",),
    ("moments", "order"): ("selection_orders",),
    ("moments", "errors"): ("selection_errors",),
    ("moments", "selection_orders"): ("order",),
    ("moments", "selection_errors"): ("errors",),
}
SUM_TOLERANCE = 1e-6  # relative: inf_kv sums to 1, ratio_tables rows to ratio x L x Hkv
# a covariance entry may miss symmetry / Cauchy-Schwarz by this much, relative to the head's
# largest variance, plus COV_ATOL (float64 accumulation, then float32 storage, round both)
COV_RTOL, COV_ATOL = 1e-4, 1e-6


def check_section_values(section: str, arrays: dict, attrs: dict, sections=None) -> None:
    """``sections``: the names of the sections the file holds (what a recommended policy may read);
    None checks only what the section's own values say."""
    check = _SECTION_CHECKS.get(section)
    if check is not None:
        check(arrays, attrs, sections)


def _check_query_stats(arrays: dict, attrs: dict, sections=None, section: str = "query_stats") -> None:
    cov = arrays.get("cov")
    if cov is None:
        return
    heads_per_block = max(1, (_BLOCK_BYTES // 4) // (cov.shape[-1] * cov.shape[-1]))
    for layer in range(cov.shape[0]):
        for first in range(0, cov.shape[1], heads_per_block):  # temporaries of ~_BLOCK_BYTES
            _check_covariances(cov[layer, first : first + heads_per_block], layer, first, section)


def _check_future_queries(arrays: dict, attrs: dict, sections=None) -> None:
    _check_query_stats(arrays, attrs, sections, "future_queries")
    weights = arrays.get("centre_weights")
    if weights is not None and weights.size:
        totals = weights.sum(axis=-1)  # [L, Hq]
        bad = np.abs(totals - 1.0) > SUM_TOLERANCE
        if bad.any():
            layer, head = (int(i) for i in np.argwhere(bad)[0])
            raise ArtifactError(
                f"/future_queries/centre_weights: layer {layer}, query head {head} sums to "
                f"{float(totals[layer, head]):.9g}, not 1"
            )


def _check_covariances(block: np.ndarray, layer: int, first: int, section: str = "query_stats") -> None:
    """``block`` ``[heads, d, d]`` (magnitudes already checked): symmetric and positive semi-definite-ish."""
    variances = np.diagonal(block, axis1=-2, axis2=-1)  # [heads, d]
    scale = np.maximum(variances.max(axis=-1), 0.0)[:, None, None]  # [heads, 1, 1]
    slack = (COV_RTOL * scale + COV_ATOL).astype(block.dtype)
    asymmetric = (np.abs(block - block.swapaxes(-1, -2)) > slack).any(axis=(-1, -2))
    if asymmetric.any():
        head = first + int(np.flatnonzero(asymmetric)[0])
        raise ArtifactError(f"/{section}/cov: layer {layer}, query head {head} is not symmetric")
    # positive semi-definite, by its cheap necessary conditions: variances >= 0 and
    # |cov_ij| <= sqrt(cov_ii cov_jj) (Cauchy-Schwarz)
    std = np.sqrt(np.maximum(variances, 0.0))
    negative = (variances < -slack[:, :, 0]).any(axis=-1)
    correlated = (np.abs(block) > std[:, :, None] * std[:, None, :] + slack).any(axis=(-1, -2))
    bad = negative | correlated
    if bad.any():
        head = first + int(np.flatnonzero(bad)[0])
        raise ArtifactError(
            f"/{section}/cov: layer {layer}, query head {head} is not positive semi-definite "
            "(a negative variance, or a covariance larger than its variances allow)"
        )


def _check_budgets(arrays: dict, attrs: dict, sections=None) -> None:
    inf_kv = arrays.get("inf_kv")
    if inf_kv is not None:
        total = float(inf_kv.sum())
        if abs(total - 1.0) > SUM_TOLERANCE:
            raise ArtifactError(f"/budgets/inf_kv: sums to {total:.9g}, not 1")
    tables, budgets = arrays.get("token_tables"), arrays.get("token_budgets")
    if tables is not None and budgets is not None:
        heads = tables.shape[1] * tables.shape[2]
        min_budget = attrs.get("min_budget", 0)
        for row, (budget, table) in enumerate(zip(budgets, tables, strict=True)):
            total, want = int(table.sum()), int(budget) * heads
            # a row whose heads are all clipped to one bound (the profiled length, shorter than the
            # budget; or min_budget above it) holds that bound everywhere instead
            clipped = int(table.min()) == int(table.max())
            if total != want and not clipped:
                raise ArtifactError(
                    f"/budgets/token_tables: row {row} sums to {total}, not token_budgets[{row}] x L x Hkv = {want}"
                )
            if not clipped and int(table.min()) < min_budget:
                raise ArtifactError(f"/budgets/token_tables: row {row} has a head below min_budget {min_budget}")
    tables, ratios = arrays.get("ratio_tables"), arrays.get("ratios")
    if tables is not None and ratios is not None:
        heads = tables.shape[1] * tables.shape[2]
        for row, (ratio, table) in enumerate(zip(ratios, tables, strict=True)):
            total, want = float(table.sum()), float(ratio) * heads
            if abs(total - want) > SUM_TOLERANCE * max(want, 1.0):
                raise ArtifactError(
                    f"/budgets/ratio_tables: row {row} sums to {total:.9g}, not ratios[{row}] x L x Hkv = {want:.9g}"
                )
    inf_kv, beta = arrays.get("inf_kv"), attrs.get("beta")
    if tables is not None and ratios is not None and inf_kv is not None and beta is not None:
        # b_h = b (1 - 1/beta) + (b L Hkv / beta) inf_kv[h], as a fraction (the one formula the profiler wrote)
        for row, ratio in enumerate(ratios.tolist()):
            try:
                want = ideal_budgets(inf_kv, ratio, beta)  # [L, Hkv]
            except ValueError as error:  # beta < 1 or a ratio <= 0: no budget table is right
                raise ArtifactError(f"/budgets/ratio_tables: row {row}: {error}") from None
            if np.any(np.abs(tables[row] - want) > SUM_TOLERANCE * max(float(np.abs(want).max()), 1.0)):
                raise ArtifactError(
                    f"/budgets/ratio_tables: row {row} is not ratios[{row}] (1 - 1/beta) + ratios[{row}] L Hkv / beta "
                    "x inf_kv"
                )


# The decision rules a recommendation may name (1.4 `rule`; profiler.paired_decision) and the
# reference of the paired rule, the flagship, by name or by its policy.
PAIRED_RULE, MOST_ACCURATE_RULE = b"paired-exact-noninferiority/1", b"most-accurate/1"
FLAGSHIP_NAMES = (b"flagship", NAMED_POLICIES["flagship"].encode())
WILSON_SLACK = 1e-6  # recomputed intervals may differ by rounding (and a z written with fewer digits)


def _text(value: bytes) -> str:
    return value.decode("ascii", "replace")


def _check_recommended_policies(arrays: dict, sections) -> None:
    """Every policy named (served or measured) parses and, when ``sections`` is known, can be served
    from this file (common.policy_grammar.serving_refusal; issue 30 D2/D3)."""

    for name in ("policy", "candidates"):
        values = arrays.get(name)
        for value in [] if values is None else dict.fromkeys(values.tolist()):
            refusal = serving_refusal(_text(value), sections if sections is not None else _EVERY_SECTION)
            if refusal is not None:
                raise ArtifactError(f"/recommendation/{name}: {_text(value)!r} cannot be recommended: {refusal}")
    for name in ("candidates", "compression_ratios"):
        values = arrays.get(name)
        if values is not None and len(set(values.tolist())) != len(values):
            raise ArtifactError(f"/recommendation/{name}: a value is listed twice")


_EVERY_SECTION = frozenset(SECTIONS)


def _check_recommendation(arrays: dict, attrs: dict, sections=None) -> None:
    _check_recommended_policies(arrays, sections)
    policies, candidates = arrays.get("policy"), arrays.get("candidates")
    if policies is not None and candidates is not None:
        known = set(candidates.tolist())
        for policy in policies.tolist():
            if policy not in known:
                name = policy.decode("ascii", "replace")
                raise ArtifactError(f"/recommendation/policy: {name!r} is not one of the candidates measured")
    outcomes, reference = arrays.get("outcomes"), arrays.get("reference")  # [NC, NP, T] 0/1, [NC]
    if reference is not None and candidates is not None and np.any(reference >= len(candidates)):
        raise ArtifactError("/recommendation/reference: an index beyond the candidates")
    baseline = arrays.get("baseline_outcomes")
    if baseline is not None and "baseline_accuracy" in attrs and baseline.size:
        if abs(float(baseline.mean()) - attrs["baseline_accuracy"]) > 1e-9:
            raise ArtifactError(
                f"/recommendation: attribute baseline_accuracy = {attrs['baseline_accuracy']:g} is not the share of "
                f"baseline_outcomes answered ({float(baseline.mean()):g})"
            )
    if outcomes is not None:
        _check_recommended_outcomes(arrays, attrs)
    # then what was decided from them: the served values and the rule's pick
    _check_recommended_values(arrays, attrs)
    _check_recommended_rule(arrays)


def _check_recommended_outcomes(arrays: dict, attrs: dict) -> None:
    """1.4: the per-task outcomes are what every count and accuracy of the section was computed from."""
    outcomes, reference = arrays["outcomes"], arrays.get("reference")  # [NC, NP, T] 0/1, [NC]
    if "tasks" in attrs and outcomes.shape[2] != attrs["tasks"]:
        raise ArtifactError(f"/recommendation: {outcomes.shape[2]} task outcomes, attribute tasks = {attrs['tasks']}")
    ids = arrays.get("task_ids")
    if ids is not None and len(set(ids.tolist())) != len(ids):
        raise ArtifactError("/recommendation/task_ids: a task is listed twice")
    malformed = [] if ids is None else [task for task in ids.tolist() if not PROBE_ID.fullmatch(_text(task))]
    if malformed:
        raise ArtifactError(
            f"/recommendation/task_ids: {_text(malformed[0])!r} is no needles probe id "
            "(family-Llength-Ddepth-Sseed-Rreplicate)"
        )
    accuracy = arrays.get("candidate_accuracy")  # [NP, NC]
    if accuracy is not None and np.any(np.abs(outcomes.mean(axis=2).T - accuracy) > 1e-9):
        raise ArtifactError("/recommendation/candidate_accuracy: not the share of the outcomes answered correctly")
    wins, losses = arrays.get("wins"), arrays.get("losses")
    if reference is not None and wins is not None and losses is not None:
        for ratio, index in enumerate(reference.tolist()):
            if index < 0:
                continue
            mine, theirs = outcomes[ratio].astype(bool), outcomes[ratio, index].astype(bool)  # [NP, T], [T]
            if np.any((mine & ~theirs).sum(axis=1) != wins[ratio]) or np.any(
                (theirs & ~mine).sum(axis=1) != losses[ratio]
            ):
                raise ArtifactError(f"/recommendation: wins or losses at ratio {ratio} do not count the outcomes")


def _check_recommended_values(arrays: dict, attrs: dict) -> None:
    """Each ratio's served accuracy is its candidate's, a share of ``tasks``, inside its Wilson interval
    (issue 30 D4)."""
    accuracy, low, high = arrays.get("accuracy"), arrays.get("ci_low"), arrays.get("ci_high")
    if accuracy is not None and low is not None and high is not None:
        for ratio, (value, lo, hi) in enumerate(zip(accuracy.tolist(), low.tolist(), high.tolist(), strict=True)):
            if not lo - 1e-12 <= value <= hi + 1e-12:
                raise ArtifactError(
                    f"/recommendation: at ratio {ratio} the accuracy {value:g} lies outside its interval "
                    f"[ci_low {lo:g}, ci_high {hi:g}]"
                )
            tasks = attrs.get("tasks")
            if tasks:
                correct = value * tasks
                if abs(correct - round(correct)) > 1e-6:
                    raise ArtifactError(
                        f"/recommendation/accuracy: {value:g} at ratio {ratio} is no share of the {tasks} tasks"
                    )
                want = wilson_interval(round(correct), tasks)
                if abs(want[0] - lo) > WILSON_SLACK or abs(want[1] - hi) > WILSON_SLACK:
                    raise ArtifactError(
                        f"/recommendation: at ratio {ratio} [ci_low, ci_high] = [{lo:g}, {hi:g}] is not the 95% Wilson "
                        f"interval of {round(correct)} of {tasks} tasks ([{want[0]:g}, {want[1]:g}])"
                    )
    policies, candidates = arrays.get("policy"), arrays.get("candidates")
    table = arrays.get("candidate_accuracy")  # [NP, NC]
    if accuracy is None or policies is None or candidates is None or table is None:
        return
    names = candidates.tolist()
    for ratio, policy in enumerate(policies.tolist()):
        if policy in names and abs(table[names.index(policy), ratio] - accuracy[ratio]) > 1e-9:
            raise ArtifactError(
                f"/recommendation/accuracy: {accuracy[ratio]:g} at ratio {ratio} is not the candidate_accuracy "
                f"{table[names.index(policy), ratio]:g} of the policy served there, {_text(policy)!r}"
            )


def _check_recommended_rule(arrays: dict) -> None:
    """The policy served at each ratio is the one the recorded rule picks from the recorded evidence
    (section 6, "How policy was chosen"; issue 30 D4)."""
    policies, candidates, table = arrays.get("policy"), arrays.get("candidates"), arrays.get("candidate_accuracy")
    if policies is None or candidates is None or table is None:
        return
    rule = arrays.get("rule")
    if rule is None:  # 1.2 / 1.3: no rule nor evidence recorded, nothing to decide again from
        return
    rule = rule[0]
    if rule not in (PAIRED_RULE, MOST_ACCURATE_RULE):
        raise ArtifactError(
            f"/recommendation/rule: {_text(rule)!r} is no decision rule this reader knows "
            f"({_text(PAIRED_RULE)}, {_text(MOST_ACCURATE_RULE)})"
        )
    reference, bound = arrays.get("reference"), arrays.get("bound")
    tolerance = arrays.get("tolerance")
    names = candidates.tolist()
    for ratio, policy in enumerate(policies.tolist()):
        if rule == MOST_ACCURATE_RULE:
            if reference is not None and reference[ratio] != -1:
                raise ArtifactError(f"/recommendation/reference: {_text(rule)!r} has no reference, -1 expected")
            picked = min(range(len(names)), key=lambda i: (-round(float(table[i, ratio]), 9), i))
        else:
            if reference is None or bound is None or tolerance is None:
                return
            index = int(reference[ratio])
            if index < 0 or names[index] not in FLAGSHIP_NAMES:
                raise ArtifactError(
                    f"/recommendation/reference: the paired rule's reference at ratio {ratio} is not the flagship "
                    "(inf/leverage+correction)"
                )
            passing = [
                i
                for i in range(len(names))
                if i != index and (bound[ratio, i] <= tolerance[0] if i < index else bound[ratio, i] < 0.0)
            ]
            picked = passing[0] if passing else index
        if policy != names[picked]:
            raise ArtifactError(
                f"/recommendation/policy: {_text(policy)!r} at ratio {ratio} is not what the rule {_text(rule)!r} "
                f"picks from the recorded evidence ({_text(names[picked])!r})"
            )
    if rule == MOST_ACCURATE_RULE:
        wins, losses = arrays.get("wins"), arrays.get("losses")
        if (wins is not None and np.any(wins != 0)) or (losses is not None and np.any(losses != 0)):
            raise ArtifactError("/recommendation: wins and losses without a reference must be 0")
        if bound is not None and np.any(bound != 1.0):
            raise ArtifactError("/recommendation/bound: without a reference every bound is 1")


def _check_budget_curves(arrays: dict, attrs: dict, sections=None) -> None:
    for name in ("compression_ratios", "grid"):
        values = arrays.get(name)
        if values is not None and np.any(np.diff(values) <= 0):
            raise ArtifactError(f"/budget_curves/{name}: values are not strictly increasing")
    fractions, ratios = arrays.get("fractions"), arrays.get("compression_ratios")
    if fractions is not None and ratios is not None:
        heads = fractions.shape[1] * fractions.shape[2]
        for row, (ratio, table) in enumerate(zip(ratios, fractions, strict=True)):
            total, want = float(table.sum()), (1.0 - float(ratio)) * heads
            if abs(total - want) > SUM_TOLERANCE * max(want, 1.0):
                raise ArtifactError(
                    f"/budget_curves/fractions: row {row} sums to {total:.9g}, not "
                    f"(1 - compression_ratios[{row}]) x L x Hkv = {want:.9g}"
                )


MOMENT_ALLOCATIONS = (b"uniform", b"global")  # /moments/selection_allocations


def _check_moments(arrays: dict, attrs: dict, sections=None) -> None:
    """1.5: the first selection's orders and errors are the section's ``order`` and ``errors``; the
    selections are distinct names, each with a known allocation."""

    names = arrays.get("selections")
    if names is not None:
        if len(set(names.tolist())) != len(names) or any(not name for name in names.tolist()):
            raise ArtifactError("/moments/selections: an empty or repeated selection name")
        unknown = [_text(name) for name in names.tolist() if _text(name) not in MOMENT_SELECTIONS]
        if unknown:
            raise ArtifactError(
                f"/moments/selections: {unknown[0]!r} is no selection scorer ({', '.join(MOMENT_SELECTIONS)})"
            )
    allocations = arrays.get("selection_allocations")
    if allocations is not None and any(a not in MOMENT_ALLOCATIONS for a in allocations.tolist()):
        raise ArtifactError("/moments/selection_allocations: an allocation other than uniform or global")
    for first, every in (("order", "selection_orders"), ("errors", "selection_errors")):
        if arrays.get(first) is not None and arrays.get(every) is not None:
            if not np.array_equal(arrays[every][0], arrays[first]):
                raise ArtifactError(f"/moments/{every}: the first selection's is not /moments/{first}")


SCORE_TOLERANCE = 1e-9  # the scores are float64 quotients of the stored float64 weights


def _check_behaviour(arrays: dict, attrs: dict, sections=None) -> None:
    """REAL Eq. 1-3: RAsc = W_R / (W_R + W_D), LCsc = W_R / (W_R + W_B), INFsc their harmonic mean;
    0 where the denominator is empty (common.formulas, what the profiler computed them with)."""
    w_r, w_b, w_d = arrays.get("W_R"), arrays.get("W_B"), arrays.get("W_D")
    scores = {}
    if w_r is not None and w_d is not None:
        scores["RAsc"] = share(w_r, w_d)
    if w_r is not None and w_b is not None:
        scores["LCsc"] = share(w_r, w_b)
    rasc, lcsc = arrays.get("RAsc"), arrays.get("LCsc")
    if rasc is not None and lcsc is not None:
        scores["INFsc"] = harmonic_mean(rasc, lcsc)
    formulas = {"RAsc": "W_R / (W_R + W_D)", "LCsc": "W_R / (W_R + W_B)", "INFsc": "2 RAsc LCsc / (RAsc + LCsc)"}
    for name, want in scores.items():
        stored = arrays.get(name)
        if stored is not None and np.any(np.abs(stored - want) > SCORE_TOLERANCE):
            layer, head = (int(i) for i in np.argwhere(np.abs(stored - want) > SCORE_TOLERANCE)[0])
            raise ArtifactError(
                f"/behaviour/{name}: layer {layer}, query head {head} is {float(stored[layer, head]):.9g}, not "
                f"{formulas[name]} = {float(want[layer, head]):.9g}"
            )


LEARNED_SCORER_KIND = {"features": "kv", "teacher": "kvzip"}  # the only fit the format describes


def _check_learned_scorer(arrays: dict, attrs: dict, sections=None) -> None:
    for name, want in LEARNED_SCORER_KIND.items():
        if name in attrs and attrs[name] != want:
            raise ArtifactError(f"/learned_scorer: attribute {name} = {attrs[name]!r}, the format knows only {want!r}")


_SECTION_CHECKS = {
    "behaviour": _check_behaviour,
    "learned_scorer": _check_learned_scorer,
    "moments": _check_moments,
    "query_stats": _check_query_stats,
    "future_queries": _check_future_queries,
    "budgets": _check_budgets,
    "recommendation": _check_recommendation,
    "budget_curves": _check_budget_curves,
}
