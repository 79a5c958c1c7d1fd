"""Writing a calibration artifact: validated, compressed, checksummed, atomic.

The HDF5 file is built in memory and then written through :func:`common.atomic.write_atomic`
(the one writer of every output): a temporary file in the destination directory, fsynced, then
renamed over the destination.  An exception at any point before the rename leaves whatever was
at the destination untouched; a failing write (disk full) is an ``common.atomic.OutputError``.
Building in memory keeps HDF5 away from a failing disk: libhdf5 handles a write error while it
flushes by leaving its objects half-closed, which printed "Exception ignored" tracebacks and
then crashed the interpreter at exit.  The compressed image costs memory about the size of
the file.
"""

from __future__ import annotations

import datetime as _dt
import io
import os
from pathlib import Path

import h5py
import numpy as np

from common.atomic import check_output_path, write_atomic
from common.version import toolkit_version

from .errors import ArtifactError
from .metadata import extended_metadata_digest, metadata_digest, root_attrs
from .schema import FORMAT_NAME, OPTIONAL_MODEL_ATTRS, SCHEMA_VERSION, SECTIONS, Artifact
from .validation import (
    check_array,
    check_config,
    check_model_identity,
    check_section_attrs,
    check_section_values,
    section_dims,
)

COMPRESSION = "gzip"
COMPRESSION_LEVEL = 4


def write_artifact(path: str | os.PathLike, artifact: Artifact) -> Path:
    """Validate ``artifact`` and write it atomically to ``path``; returns the final path."""
    path = Path(path)
    check_output_path(path, "artifact")
    check_model_identity(artifact.model)
    check_config(artifact.config)
    arch = artifact.model.dims()
    checked_attrs: dict[str, dict] = {}
    prepared: dict[str, dict[str, np.ndarray]] = {}
    for section_name, section in artifact.sections.items():
        if section_name not in SECTIONS:
            raise ArtifactError(f"unknown section {section_name!r}; known: {', '.join(SECTIONS)}")
        unknown = set(section.arrays) - set(SECTIONS[section_name].datasets)
        if unknown:
            raise ArtifactError(f"/{section_name}: unknown dataset(s) {sorted(unknown)}")
        arrays = {name: _as_schema_dtype(section_name, name, value) for name, value in section.arrays.items()}
        prepared[section_name] = arrays
        shapes = {n: a.shape for n, a in arrays.items()}
        dims = section_dims(section_name, shapes, arch, artifact.model.value_head_dim)
        for name, array in arrays.items():
            check_array(section_name, name, array, dims)
        checked_attrs[section_name] = check_section_attrs(section_name, section.attrs)
        check_section_values(section_name, arrays, checked_attrs[section_name], tuple(artifact.sections))

    created = artifact.created or _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    attrs = root_attrs(artifact, created=created, version=artifact.toolkit_version or toolkit_version())

    image = io.BytesIO()
    # libver v110+: metadata (superblock, object headers) carries its own checksums.
    with h5py.File(image, "w", libver=("v110", "latest")) as h5:
        _write_contents(h5, prepared, attrs, checked_attrs)
    write_atomic(path, image.getbuffer(), what="artifact")
    return path


def _as_schema_dtype(section: str, name: str, value) -> np.ndarray:
    """``value`` as the schema's dtype: text encoded as ASCII, numbers cast within their kind."""
    target = np.dtype(SECTIONS[section].datasets[name].dtype)
    array = np.asarray(value)
    if target.kind == "S":
        if array.dtype.kind == "U":
            try:
                array = np.char.encode(array, "ascii")
            except UnicodeEncodeError as exc:
                raise ArtifactError(f"/{section}/{name}: text must be ASCII") from exc
        if array.dtype.kind != "S" or array.dtype.itemsize > target.itemsize:
            raise ArtifactError(f"/{section}/{name}: expected ASCII text of at most {target.itemsize} bytes")
        return array.astype(target)
    if array.dtype.kind not in "biuf" or (target.kind in "iu" and array.dtype.kind == "f"):
        raise ArtifactError(f"/{section}/{name}: dtype {array.dtype} cannot be stored as {target.str}")
    converted = array.astype(target)
    if target.kind in "iu" and not np.array_equal(converted, array):
        raise ArtifactError(f"/{section}/{name}: values do not fit {target.str}")
    return converted


def _write_contents(h5: h5py.File, prepared: dict, attrs: dict, section_attrs: dict) -> None:
    model_group = h5.create_group("model")
    for name, value in attrs["model"].items():
        if name in OPTIONAL_MODEL_ATTRS and not value:
            continue  # an optional attribute the identity does not carry
        model_group.attrs[name] = int(value) if isinstance(value, bool) else value
    for section_name, arrays in prepared.items():
        group = h5.create_group(section_name)
        for name, value in section_attrs[section_name].items():
            group.attrs[name] = value
        for name, value in arrays.items():
            array = np.ascontiguousarray(value)
            group.create_dataset(
                name,
                data=array,
                chunks=True,
                compression=COMPRESSION,
                compression_opts=COMPRESSION_LEVEL,
                shuffle=True,
                fletcher32=True,
            )
    for name, value in attrs["root"].items():
        h5.attrs[name] = value
    h5.attrs["metadata_sha256"] = metadata_digest(attrs["root"], attrs["model"], section_attrs)
    extended = extended_metadata_digest(attrs["root"], attrs["model"], section_attrs)
    if extended is not None:
        h5.attrs["extended_metadata_sha256"] = extended
    h5.attrs["format"] = FORMAT_NAME
    h5.attrs["schema_version"] = SCHEMA_VERSION
