"""Finding and loading the calibration artifact for a loaded model.

    calibration = load_calibration(model, tokenizer)              # kv_calibration.h5 next to the weights
    calibration = load_calibration(model, tokenizer, path="x.h5")  # explicit file

The file is validated by ``artifacts`` (structure, checksums, dtypes, shapes, ranges) and its
``/model`` identity compared with the loaded model:

* a different architecture (layers, heads, head dim, RoPE...) is always refused;
* different weights or a different tokenizer are refused unless ``allow_mismatch=True``,
  which warns once per (model, file) instead.

The weights fingerprint (``artifacts.fingerprint.weights_fingerprint``) reads every weight,
which takes seconds on CPU; it is computed once per model object and remembered on the model
together with the tensors' version counters, so an in-place weight change invalidates it.
Only the sections a serving process uses are read: ``query_stats`` mean/cov and the INF
weights (``budgets/inf_kv``, else derived from ``behaviour/INFsc``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from artifacts import ARTIFACT_FILENAME, ArtifactError, ModelIdentity, open_artifact
from artifacts.fingerprint import (architecture_fingerprint, architecture_numbers, has_query_norm,
                                   tokenizer_fingerprint, weights_fingerprint)

from .budgets import kv_head_scores

_MEMO_ATTRIBUTE = "_kvcal_fingerprint_memo"


@dataclass
class Calibration:
    """What the runtime uses from an artifact (numpy arrays, read once)."""

    path: Path
    identity: ModelIdentity
    config: dict
    sections: tuple[str, ...]
    query_mean: np.ndarray | None = None  # float32 [L, Hq, d] pre-RoPE
    query_cov: np.ndarray | None = None  # float32 [L, Hq, d, d]
    inf_weights: np.ndarray | None = None  # float64 [L, Hkv], sums to 1


def find_artifact(model, path: str | os.PathLike | None = None) -> Path:
    """The artifact for ``model``: ``path`` itself, or ``kv_calibration.h5`` next to its weights."""
    if path is not None:
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / ARTIFACT_FILENAME
        if not path.is_file():
            raise ArtifactError(f"{path}: no such calibration artifact")
        return path
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None) or ""
    candidates = []
    if source and Path(source).expanduser().is_dir():
        candidates.append(Path(source).expanduser() / ARTIFACT_FILENAME)
    elif source:
        try:  # a hub id: look in the local hub snapshot, offline
            from transformers.utils.hub import cached_file

            found = cached_file(source, ARTIFACT_FILENAME, local_files_only=True,
                                _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
            if found:
                candidates.append(Path(found))
        except Exception:  # not a hub id, or no local snapshot
            pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    where = ", ".join(str(c) for c in candidates) or f"(model source {source!r} is not a local directory)"
    raise ArtifactError(f"no {ARTIFACT_FILENAME} found next to the weights: looked at {where}. "
                        "Run profile-model, or pass path=...")


def _memo(model) -> dict:
    memo = getattr(model, _MEMO_ATTRIBUTE, None)
    if memo is None:
        memo = {"warned": set()}
        object.__setattr__(model, _MEMO_ATTRIBUTE, memo)
    return memo


def model_weights_fingerprint(model) -> str:
    """``weights_fingerprint(model)``, remembered until a weight tensor changes."""
    memo = _memo(model)
    versions = tuple((name, tensor.data_ptr(), tensor._version) for name, tensor in model.state_dict().items())
    if memo.get("versions") != versions:
        memo["weights"] = weights_fingerprint(model)
        memo["versions"] = versions
    return memo["weights"]


def check_identity(identity: ModelIdentity, model, tokenizer=None, *, allow_mismatch: bool = False,
                   source: str = "artifact") -> None:
    """Refuse an artifact made for another architecture / weights / tokenizer (see module doc)."""
    numbers = architecture_numbers(model.config)
    expected = architecture_fingerprint(numbers, has_query_norm(model))
    if identity.arch_fingerprint != expected:
        differing = [f"{key}: artifact {getattr(identity, key)!r} vs model {value!r}"
                     for key, value in numbers.items() if getattr(identity, key, None) != value]
        detail = "; ".join(differing) or "query norm or RoPE parameters differ"
        raise ArtifactError(f"{source} was made for another architecture ({identity.name}): {detail}")
    mismatches = []
    if identity.weights_fingerprint != model_weights_fingerprint(model):
        mismatches.append("weights")
    if tokenizer is not None and identity.tokenizer_fingerprint != tokenizer_fingerprint(tokenizer):
        mismatches.append("tokenizer")
    if not mismatches:
        return
    what = " and ".join(mismatches)
    if not allow_mismatch:
        raise ArtifactError(f"{source} was calibrated for {identity.name} with different {what} than the loaded "
                            "model; pass allow_mismatch=True to use it anyway")
    warned = _memo(model)["warned"]
    key = (str(source), what)
    if key not in warned:
        warned.add(key)
        warnings.warn(f"{source}: {what} fingerprint differs from the loaded model; using it anyway "
                      "(allow_mismatch=True)", stacklevel=3)


def load_calibration(model, tokenizer=None, path: str | os.PathLike | None = None, *,
                     allow_mismatch: bool = False) -> Calibration:
    """Find, validate and read the artifact for ``model`` (see the module docstring)."""
    artifact_path = find_artifact(model, path)
    with open_artifact(artifact_path) as reader:
        check_identity(reader.model, model, tokenizer, allow_mismatch=allow_mismatch, source=str(artifact_path))
        calibration = Calibration(path=artifact_path, identity=reader.model, config=reader.config,
                                  sections=tuple(reader.sections))
        if reader.has("query_stats"):
            calibration.query_mean = reader.read("query_stats", "mean")
            calibration.query_cov = reader.read("query_stats", "cov")
        if reader.has("budgets"):
            calibration.inf_weights = reader.read("budgets", "inf_kv")
        elif reader.has("behaviour"):
            infsc = reader.read("behaviour", "INFsc")
            calibration.inf_weights = kv_head_scores(infsc, reader.model.num_kv_heads)
    return calibration
