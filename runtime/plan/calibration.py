"""Finding and loading the calibration artifact for a loaded model.

    calibration = load_calibration(model, tokenizer)              # found from model.name_or_path
    calibration = load_calibration(model, tokenizer, path="x.h5")  # explicit file

Without ``path`` the file is looked for (:func:`artifact_locations`) next to the weights (a
local model directory), in the local hub snapshot (a hub id: an artifact its publisher ships),
then in kvcal's cache, ``$XDG_CACHE_HOME/kvcal/artifacts/<org>--<name>/kv_calibration.h5``
(:func:`artifact_cache_path`), which is where ``profile-model`` writes by default when it cannot
write next to the weights (a hub id, a read-only directory: :func:`default_artifact_path`).

The file is validated by ``artifacts`` (structure, checksums, dtypes, shapes, ranges) and its
``/model`` identity compared with the loaded model:

* a different architecture (layers, heads, head dim, RoPE...) is always refused;
* different weights or a different tokenizer are refused unless ``allow_mismatch=True``,
  which warns once per (model, file) instead.

The weights are compared under the dtype the model is loaded in (:func:`weights_match`): the
artifact records the weights fingerprint of the profiled checkpoint cast to float32, bfloat16
and float16, so a float32-profiled checkpoint served in bfloat16 or float16 is recognised, while
a checkpoint with any weight changed is not.  The fingerprint
(``artifacts.fingerprint.weights_fingerprint``) reads every weight, which takes about a second
on CPU; it is computed once per model object (for the one dtype compared) and remembered on the
model together with the tensors' version counters, so an in-place weight change invalidates it.
The tokenizer fingerprint is remembered on the tokenizer the same way (keyed by its size and
chat template).
What a serving process uses is held: from load time the INF weights (``budgets/inf_kv``,
else derived from ``behaviour/INFsc``), the correction orders (``moments/order``,
``moments/tau``), the learned scorer's weights (``learned_scorer/weights``, ``/bias``), the
per-head budget curves (``budget_curves/compression_ratios``, ``/fractions``) and the
measured recommendation (section ``recommendation``, served by :meth:`Calibration.policy`);
the ``query_stats`` mean/cov and the ``future_queries`` mean/cov/centres from first use (the
covariance is the bulk of the file and the slowest to read: docs/results.md R-artifact-load-2026-11-21).
Each section is read and checked whole (every value and relation, ``ArtifactReader.section``) before
any of it is served: the small ones at load, ``query_stats`` / ``future_queries`` on first use, so
that a calibration that loads holds no value the reader would refuse.

The correction orders are the best per head for the tokens one scorer keeps.  An artifact of
schema 1.5 holds orders per selection scorer (``moments/selections``, ``/selection_orders``:
by default those of the flagship and of the recommendation candidates with ``+correction``); an
older one the orders of one scorer (the job configuration's ``moments.selection``).
:meth:`Calibration.correction_orders` gives a policy the orders of its own scorer; only when the
artifact has none for it does it give the default ones (``moments/order``) and warn, once per
scorer.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path

import numpy as np

from artifacts import ARTIFACT_FILENAME, ArtifactError, ModelIdentity, open_artifact
from artifacts.fingerprint import (
    architecture_fingerprint,
    architecture_numbers,
    has_query_norm,
    serving_dtype,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from common.names import MOMENT_SELECTIONS
from runtime.math.arrays import version_counter
from runtime.plan.budgets import kv_head_scores
from runtime.plan.recommendation import Recommendation, recommended_policy

_MEMO_ATTRIBUTE = "_kvcal_fingerprint_memo"
FUTURE_DATASETS = ("mean", "cov", "centres", "centre_weights")  # section future_queries, read on first use


class Calibration:
    """What the runtime uses from an artifact.

    ``inf_weights`` (float64 ``[L, Hkv]``, sums to 1) is read at load time; the query
    statistics (``query_mean`` float32 ``[L, Hq, d]`` and ``query_cov`` ``[L, Hq, d, d]``,
    pre-RoPE) are read from the still-open, already validated file on first use, so loading
    stays fast for policies that do not need them; so are the statistics of the queries after
    the context of needle probes (section ``future_queries``: ``future_mean``, ``future_cov``,
    ``future_centres [L, Hq, K, d]``, ``future_centre_weights [L, Hq, K]``).  Arrays may also be
    given directly (``future={"mean": ..., "cov": ..., "centres": ..., "centre_weights": ...}``).
    """

    def __init__(
        self,
        path,
        identity,
        config: dict,
        sections: tuple[str, ...],
        *,
        query_mean: np.ndarray | None = None,
        query_cov: np.ndarray | None = None,
        inf_weights: np.ndarray | None = None,
        moment_orders: np.ndarray | None = None,
        moment_tau: np.ndarray | None = None,
        moment_selection: str | None = None,
        moment_selection_orders: dict[str, np.ndarray] | None = None,
        scorer_weights: np.ndarray | None = None,
        scorer_bias: np.ndarray | None = None,
        recommendation=None,
        future: dict | None = None,
        budget_curve: tuple[np.ndarray, np.ndarray] | None = None,
        reader=None,
    ):
        self.path = Path(path)
        self.identity = identity
        self.config = config
        self.sections = tuple(sections)
        self.inf_weights = inf_weights
        self.moment_orders = moment_orders  # int8 [L, Hkv]: -1 none, 0, 1 (section 'moments')
        self.moment_tau = moment_tau  # float64 [L, Hkv]
        # name of the scorer (runtime.scorers) whose selection the default orders were calibrated under
        self.moment_selection = moment_selection if moment_selection is not None else _configured_selection(config)
        # scorer name -> int8 [L, Hkv]: the orders calibrated under each selection (1.5: every one the
        # artifact holds; older files: the one their configuration names, when it names one)
        orders = dict(moment_selection_orders or {})
        if not orders and moment_orders is not None and self.moment_selection is not None:
            orders = {self.moment_selection: moment_orders}
        self.moment_selection_orders = orders
        self._warned_selections: set[str] = set()
        # the learned scorer (section 'learned_scorer'): float64 [L, Hkv, 2d] and [L, Hkv]
        self.scorer_weights, self.scorer_bias = scorer_weights, scorer_bias
        # the measured best policy per compression ratio (section 'recommendation'), or None
        self.recommendation = recommendation
        # per-head budget curves (section 'budget_curves'): (compression_ratios [NR], fractions [NR, L, Hkv])
        self.budget_curve = budget_curve
        self._query_mean, self._query_cov = query_mean, query_cov
        self._future = dict(future) if future is not None else None
        self._reader = reader

    @classmethod
    def from_sections(cls, path, identity, config: dict, sections: dict) -> Calibration:
        """A calibration from in-memory sections (``artifacts.Section`` by name), e.g. those a
        profiling job has just built and not yet written; read exactly as :func:`load_calibration`
        reads a file's."""
        readers = {name: (lambda key, name=name: sections[name][key]) for name in sections}
        fields = _serving_fields(identity, readers, {name: tuple(sections[name].arrays) for name in sections})
        if "query_stats" in sections:
            fields.update(query_mean=sections["query_stats"]["mean"], query_cov=sections["query_stats"]["cov"])
        if "future_queries" in sections:
            fields["future"] = {key: sections["future_queries"][key] for key in FUTURE_DATASETS}
        if "recommendation" in sections:
            section = sections["recommendation"]
            fields["recommendation"] = Recommendation.from_section(section.arrays, section.attrs)
        return cls(path, identity, config, tuple(sections), **fields)

    def _read_query_stats(self) -> None:
        if self._query_mean is None and self._reader is not None and "query_stats" in self.sections:
            section = self._reader.section("query_stats")  # all of it checked, n included
            self._query_mean, self._query_cov = section["mean"], section["cov"]

    @property
    def query_mean(self) -> np.ndarray | None:
        self._read_query_stats()
        return self._query_mean

    @property
    def query_cov(self) -> np.ndarray | None:
        self._read_query_stats()
        return self._query_cov

    @property
    def has_query_stats(self) -> bool:
        return self._query_mean is not None or (self._reader is not None and "query_stats" in self.sections)

    def _read_future(self) -> dict | None:
        if self._future is None and self._reader is not None and "future_queries" in self.sections:
            section = self._reader.section("future_queries")  # all of it checked, n included
            self._future = {key: section[key] for key in FUTURE_DATASETS}
        return self._future

    @property
    def has_future_queries(self) -> bool:
        return self._future is not None or (self._reader is not None and "future_queries" in self.sections)

    @property
    def future_mean(self) -> np.ndarray | None:
        """Mean pre-RoPE query after the probes' context, float32 ``[L, Hq, d]`` (section ``future_queries``)."""
        future = self._read_future()
        return None if future is None else future["mean"]

    @property
    def future_cov(self) -> np.ndarray | None:
        """Their covariance, float32 ``[L, Hq, d, d]``."""
        future = self._read_future()
        return None if future is None else future["cov"]

    @property
    def future_centres(self) -> np.ndarray | None:
        """Their k-means centres, float32 ``[L, Hq, K, d]``."""
        future = self._read_future()
        return None if future is None else future["centres"]

    @property
    def future_centre_weights(self) -> np.ndarray | None:
        """The fraction of future queries nearest each centre, float64 ``[L, Hq, K]``."""
        future = self._read_future()
        return None if future is None else future["centre_weights"]

    def policy(self, compression_ratio: float):
        """The policy to serve evicting ``compression_ratio`` of the context: the one this artifact
        measured best (its ``recommendation`` section), else the flagship (runtime.plan.recommendation)."""
        return recommended_policy(self, compression_ratio)

    def correction_orders(self, scorer_name: str) -> np.ndarray | None:
        """The per-head correction orders (int8 ``[L, Hkv]``) to serve ``correction='calibrated'`` with a
        policy evicting with ``scorer_name``: those calibrated under that scorer when the artifact has
        them, else the default ones (``moment_orders``), warned about once per scorer
        (:meth:`check_moment_selection`)."""
        own = self.moment_selection_orders.get(scorer_name)
        if own is not None:
            return own
        self.check_moment_selection(scorer_name, stacklevel=5)  # via bind(): points at its caller
        return self.moment_orders

    def check_moment_selection(self, scorer_name: str, stacklevel: int = 2) -> None:
        """Warn (once per scorer) when the artifact holds no correction orders calibrated under
        ``scorer_name``'s selection, the scorer the serving policy evicts with (nothing to say when it
        does not record which selection its orders came from)."""
        if self.moment_selection is None or scorer_name in self.moment_selection_orders:
            return
        if scorer_name in self._warned_selections:
            return
        self._warned_selections.add(scorer_name)
        calibrated = list(self.moment_selection_orders) or [self.moment_selection]
        if scorer_name in MOMENT_SELECTIONS:
            selections = ",".join(calibrated + [scorer_name])
            remedy = f"profile-model --stages moments --moments-selection {selections} calibrates them for it"
        else:
            remedy = "the moments stage can calibrate them under " + ", ".join(MOMENT_SELECTIONS[:-1])
            remedy += f" or {MOMENT_SELECTIONS[-1]} only"
        others = f" (it holds orders for {', '.join(calibrated)})" if len(calibrated) > 1 else ""
        warnings.warn(
            f"{self.path}: correction='calibrated' serves per-head MomentKV orders measured on the tokens "
            f"{self.moment_selection!r} keeps{others}, but the policy evicts with {scorer_name!r}; the best "
            f"order per head may differ ({remedy})",
            stacklevel=stacklevel,
        )

    def close(self) -> None:
        """Close the artifact file (reading the query statistics first if they were never used)."""
        if self._reader is not None:
            try:
                self._read_query_stats()
                self._read_future()
            finally:  # closed even when what was never read turns out invalid
                self._reader.close()
                self._reader = None

    def __repr__(self) -> str:
        return f"Calibration({self.path}, model={getattr(self.identity, 'name', None)!r}, sections={self.sections})"


def _configured_selection(config) -> str | None:
    """``config["moments"]["selection"]`` of an artifact's job configuration, if recorded."""
    moments = config.get("moments") if isinstance(config, dict) else None
    selection = moments.get("selection") if isinstance(moments, dict) else None
    return str(selection) if selection is not None else None


# A hub model id: "name" or "org/name", of letters, digits, "-", "_", "." (as the hub allows).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def model_source(model) -> str:
    """The local directory or hub id ``model`` was loaded from (``name_or_path``), or ""."""
    return str(getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None) or "")


def _local_directory(source: str) -> Path | None:
    path = Path(source).expanduser() if source else None
    return path.resolve() if path is not None and path.is_dir() else None


def artifact_cache_path(source: str) -> Path | None:
    """kvcal's own place for the artifact of the model ``source``, under ``common.models.cache_root()``:

    * a hub id ``org/name`` (not a local directory): ``<cache>/artifacts/org--name/kv_calibration.h5``
      (``name`` alone: ``<cache>/artifacts/name/...``);
    * a local directory: ``<cache>/artifacts/local/<dir name>-<12 hex of SHA-256 of its resolved
      absolute path>/kv_calibration.h5``, so any path naming the same directory gives one place.

    ``None`` for anything else (a missing path, text that is no hub id).  profile-model writes
    here by default when it cannot write next to the weights (:func:`default_artifact_path`),
    and :func:`find_artifact` looks here last.
    """
    from common.models import cache_root

    directory = _local_directory(source)
    if directory is not None:
        digest = hashlib.sha256(str(directory).encode()).hexdigest()[:12]
        return cache_root() / "artifacts" / "local" / f"{directory.name}-{digest}" / ARTIFACT_FILENAME
    if not _HUB_ID.fullmatch(source) or ".." in source or "--" in source:
        return None
    return cache_root() / "artifacts" / source.replace("/", "--") / ARTIFACT_FILENAME


def default_artifact_path(source: str) -> Path:
    """Where profile-model writes the artifact of ``source`` by default: ``kv_calibration.h5`` in
    the model directory when it is a writable local directory, else :func:`artifact_cache_path`
    (a hub id, or a read-only directory).  :func:`find_artifact` looks in both places."""
    directory = _local_directory(source)
    if directory is not None and os.access(directory, os.W_OK):
        return Path(source).expanduser() / ARTIFACT_FILENAME
    place = artifact_cache_path(source)
    if place is None:
        raise ValueError(f"{source!r} is neither a local model directory nor a hub id; pass an output path")
    return place


def artifact_locations(source: str) -> list[Path]:
    """Where :func:`find_artifact` looks for the artifact of ``source``, in order:

    1. next to the weights (``source`` is a local directory);
    2. the local hub snapshot of a hub id, offline (an artifact the publisher ships);
    3. kvcal's cache, :func:`artifact_cache_path` (where profile-model writes by default when
       it cannot write next to the weights).
    """
    places = []
    directory = _local_directory(source)
    if directory is not None:
        places.append(Path(source).expanduser() / ARTIFACT_FILENAME)
    elif source:
        try:  # a hub id: look in the local hub snapshot, offline
            from transformers.utils.hub import cached_file

            found = cached_file(
                source,
                ARTIFACT_FILENAME,
                local_files_only=True,
                _raise_exceptions_for_missing_entries=False,
                _raise_exceptions_for_connection_errors=False,
            )
            if found:
                places.append(Path(found))
        except Exception:  # not a hub id, or no local snapshot
            pass
    cached = artifact_cache_path(source)
    if cached is not None:
        places.append(cached)
    return places


def find_artifact(model, path: str | os.PathLike | None = None) -> Path:
    """The artifact for ``model``: ``path`` itself (a file, or a directory holding
    ``kv_calibration.h5``), else the first of :func:`artifact_locations` of the model's source
    (``name_or_path``) that exists: next to the weights, the hub snapshot, kvcal's cache."""
    if path is not None:
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / ARTIFACT_FILENAME
        if not path.is_file():
            raise ArtifactError(f"{path}: no such calibration artifact")
        return path
    return artifact_of_source(model_source(model))


def artifact_of_source(source: str, give_path: str = "pass path=...") -> Path:
    """The first of :func:`artifact_locations` of ``source`` (a local directory or hub id) that
    exists, else :class:`ArtifactError` naming every place looked at (``give_path``: how the caller
    names an explicit path).  Depends on ``source`` alone, not on the loaded model: evaluate-artifact
    finds the artifact (or its absence) before the model loads."""
    candidates = artifact_locations(source)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    where = ", ".join(str(c) for c in candidates) or f"nowhere (model source {source!r} is no directory or hub id)"
    raise ArtifactError(
        f"no {ARTIFACT_FILENAME} found next to the weights, in the hub snapshot or in kvcal's cache for "
        f"{source or 'the model'}: looked at {where}. "
        f"Run profile-model, or {give_path}"
    )


def _memo(model) -> dict:
    memo = getattr(model, _MEMO_ATTRIBUTE, None)
    if memo is None:
        memo = {"warned": set()}
        object.__setattr__(model, _MEMO_ATTRIBUTE, memo)
    return memo


def model_weights_fingerprint(model, dtype: str = "float32") -> str:
    """``weights_fingerprint(model, dtype)``, remembered (per dtype) until a weight tensor changes."""
    memo = _memo(model)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    versions = tuple((name, tensor.data_ptr(), tensor.dtype, version_counter(tensor)) for name, tensor in tensors)
    if memo.get("versions") != versions:
        memo["weights"] = {}
        memo["versions"] = versions
    if dtype not in memo["weights"]:
        memo["weights"][dtype] = weights_fingerprint(model, dtype)
    return memo["weights"][dtype]


def weights_match(identity: ModelIdentity, model) -> tuple[bool, str]:
    """Whether ``model``'s weights are the ones ``identity`` was profiled from, and the dtype
    they were compared under.

    With the artifact's per-dtype fingerprints (schema 1.2) the model is compared under its own
    dtype (``serving_dtype``: bfloat16, float16 or float32) with the entry for that dtype, so
    any of those loads of the profiled checkpoint matches.  Without them (1.0 / 1.1 files), or
    for a dtype the artifact has no entry for, the float32 view is compared with
    ``weights_fingerprint``, which only a load with the profiled values matches.
    """
    entries = identity.dtype_fingerprints()
    dtype = serving_dtype(model)
    if dtype is not None and dtype in entries:
        return entries[dtype] == model_weights_fingerprint(model, dtype), dtype
    return identity.weights_fingerprint == model_weights_fingerprint(model), "float32"


def model_tokenizer_fingerprint(tokenizer) -> str:
    """``tokenizer_fingerprint(tokenizer)``, remembered while its vocabulary size and chat
    template stay the same (reading the whole vocabulary is slow: docs/results.md R-artifact-load-2026-11-21)."""
    memo = getattr(tokenizer, _MEMO_ATTRIBUTE, None)
    key = (len(tokenizer) if hasattr(tokenizer, "__len__") else None, str(getattr(tokenizer, "chat_template", None)))
    if memo is None or memo[0] != key:
        memo = (key, tokenizer_fingerprint(tokenizer))
        try:
            object.__setattr__(tokenizer, _MEMO_ATTRIBUTE, memo)
        except (AttributeError, TypeError):  # a tokenizer that takes no attributes: no memo
            return memo[1]
    return memo[1]


def architecture_mismatch(identity: ModelIdentity, model) -> str | None:
    """``"was made for another architecture (name): what differs"`` when ``identity`` does not
    describe ``model``'s architecture, else None (cheap: no weights are read)."""
    numbers = architecture_numbers(model.config)
    if identity.arch_fingerprint == architecture_fingerprint(numbers, has_query_norm(model)):
        return None
    differing = [
        f"{key}: artifact {getattr(identity, key)!r} vs model {value!r}"
        for key, value in numbers.items()
        if getattr(identity, key, None) != value
    ]
    detail = "; ".join(differing) or "query norm or RoPE parameters differ"
    return f"was made for another architecture ({identity.name}): {detail}"


def check_identity(
    identity: ModelIdentity, model, tokenizer=None, *, allow_mismatch: bool = False, source: str = "artifact"
) -> None:
    """Refuse an artifact made for another architecture / weights / tokenizer (see module doc)."""
    problem = architecture_mismatch(identity, model)
    if problem:
        raise ArtifactError(f"{source} {problem}")
    mismatches = []
    same_weights, compared_as = weights_match(identity, model)
    if not same_weights:
        mismatches.append(f"weights (compared as {compared_as})")
    if tokenizer is not None and identity.tokenizer_fingerprint != model_tokenizer_fingerprint(tokenizer):
        mismatches.append("tokenizer")
    if not mismatches:
        return
    what = " and ".join(mismatches)
    if not allow_mismatch:
        raise ArtifactError(
            f"{source} was calibrated for {identity.name} with different {what} than the loaded "
            "model; pass allow_mismatch=True to use it anyway"
        )
    warned = _memo(model)["warned"]
    key = (str(source), what)
    if key not in warned:
        warned.add(key)
        warnings.warn(
            f"{source}: {what} fingerprint differs from the loaded model; using it anyway (allow_mismatch=True)",
            stacklevel=3,
        )


LAZY_SECTIONS = ("query_stats", "future_queries")  # read on first use (Calibration.query_mean, future_mean...)


def load_calibration(
    model, tokenizer=None, path: str | os.PathLike | None = None, *, allow_mismatch: bool = False
) -> Calibration:
    """Find, validate and read the artifact for ``model`` (see the module docstring)."""
    if not hasattr(model, "config"):  # a path or a name where the model goes: say so before anything else
        raise TypeError(
            "load_calibration(model, tokenizer=None, path=...) needs the loaded model (a transformers "
            f"PreTrainedModel, to check the artifact against), got {type(model).__name__} {model!r:.80}; "
            "pass an artifact's location as path="
        )
    artifact_path = find_artifact(model, path)
    reader = open_artifact(artifact_path)
    try:
        check_identity(reader.model, model, tokenizer, allow_mismatch=allow_mismatch, source=str(artifact_path))
        # every section served from memory is read and checked whole now (values, relations), so that a
        # calibration that loads holds nothing invalid; query_stats / future_queries, the large ones,
        # are read and checked whole on first use
        for name in reader.sections:
            if name not in LAZY_SECTIONS:
                reader.section(name)
        readers = {name: (lambda key, name=name: reader.section(name)[key]) for name in reader.sections}
        fields = _serving_fields(reader.model, readers, {name: reader.datasets(name) for name in reader.sections})
        if reader.has("recommendation"):
            section = reader.section("recommendation")
            fields["recommendation"] = Recommendation.from_section(section.arrays, section.attrs)
    except BaseException:
        reader.close()
        raise
    return Calibration(
        artifact_path,
        reader.model,
        reader.config,
        tuple(reader.sections),
        **fields,
        reader=reader if reader.has("query_stats") or reader.has("future_queries") else None,
    )


def _serving_fields(identity, read: dict, present: dict) -> dict:
    """What a serving process reads at load time, given ``read[section](dataset)`` per present section
    and ``present[section]``, the datasets it holds (optional ones of a later minor may be absent)."""
    fields = {}
    if "budgets" in read:
        fields["inf_weights"] = read["budgets"]("inf_kv")
    elif "behaviour" in read:
        fields["inf_weights"] = kv_head_scores(read["behaviour"]("INFsc"), identity.num_kv_heads)
    if "moments" in read:
        fields.update(moment_orders=read["moments"]("order"), moment_tau=read["moments"]("tau"))
        if "selections" in present["moments"]:  # 1.5: the orders under every selection calibrated
            names = [name.decode("ascii") for name in read["moments"]("selections")]
            orders = read["moments"]("selection_orders")  # [S, L, Hkv]
            fields.update(moment_selection=names[0], moment_selection_orders=dict(zip(names, orders, strict=True)))
    if "learned_scorer" in read:
        fields.update(scorer_weights=read["learned_scorer"]("weights"), scorer_bias=read["learned_scorer"]("bias"))
    if "budget_curves" in read:
        fields["budget_curve"] = (read["budget_curves"]("compression_ratios"), read["budget_curves"]("fractions"))
    return fields
