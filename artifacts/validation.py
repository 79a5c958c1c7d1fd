"""Checks shared by the writer (refuse to write a bad artifact) and the reader (refuse to
return a bad value).  Each raises :class:`ArtifactError` with a message naming the object."""

from __future__ import annotations

import json

import numpy as np

from .errors import ArtifactError
from .schema import (
    ARCH_LIMITS,
    FREE_DIM_LIMITS,
    MAX_STRING_ATTR_CHARS,
    MODEL_ATTR_TYPES,
    OPTIONAL_MODEL_ATTRS,
    SECTIONS,
    ModelIdentity,
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
    try:
        json.loads(identity.rope_parameters)
    except ValueError as exc:
        raise ArtifactError("/model: rope_parameters is not valid JSON") from exc
    if identity.weights_fingerprints:
        _check_dtype_fingerprints(identity)


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


def section_dims(section: str, shapes: dict[str, tuple[int, ...]], arch: dict[str, int]) -> dict[str, int]:
    """Architecture dims plus the section's free dims, inferred from dataset shapes and checked.

    ``shapes`` maps each of the section's dataset names to its shape.  Every dataset must be
    present, have the right rank, agree on free dims, and match the architecture exactly.
    """
    spec = SECTIONS[section]
    dims = dict(arch)
    for name, dspec in spec.datasets.items():
        if name not in shapes:
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
    return dims


def check_array(section: str, name: str, array: np.ndarray, dims: dict[str, int]) -> None:
    """dtype, shape, finiteness and range of one dataset's values."""
    dspec = SECTIONS[section].datasets[name]
    where = f"/{section}/{name}"
    if array.dtype != np.dtype(dspec.dtype):
        raise ArtifactError(f"{where}: dtype {array.dtype.str} where the schema says {dspec.dtype}")
    expected = resolve_shape(dspec, dims)
    if array.shape != expected:
        raise ArtifactError(f"{where}: shape {array.shape}, expected {expected}")
    if array.dtype.kind == "f" and dspec.finite and not np.all(np.isfinite(array)):
        bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
        raise ArtifactError(f"{where}: {bad} value(s) are NaN or infinite")
    if array.dtype.kind in "fiu" and array.size:
        if dspec.minimum is not None and array.min() < dspec.minimum:
            raise ArtifactError(f"{where}: value {array.min()} below the allowed minimum {dspec.minimum}")
        if dspec.maximum is not None and array.max() > dspec.maximum:
            raise ArtifactError(f"{where}: value {array.max()} above the allowed maximum {dspec.maximum}")
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
        values[name] = coerce_attr(f"/{section}", name, attrs[name], kind)
    return values
