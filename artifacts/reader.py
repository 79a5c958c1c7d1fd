"""Reading a calibration artifact, strictly and safely.  Needs only h5py and numpy.

``open_artifact(path)`` checks the structure at once (format name, schema version, metadata
digest, model identity, every object's kind, links, storage and filters, every dataset's
shape against the recorded architecture) and reads no dataset values.  Values are read on
demand through :meth:`ArtifactReader.section` / :meth:`ArtifactReader.read`, each dataset
checked when read: fletcher32 checksum (by HDF5), all chunks present, dtype, shape, finite,
within range.  :meth:`ArtifactReader.validate` reads everything.

Safe on untrusted files: external links, soft links, external storage, virtual datasets,
named datatypes, unknown filters (which could load plugins) and partly allocated datasets
(whose missing chunks would read as silent zeros) are refused; shapes are capped by the
architecture, itself capped by ``schema.ARCH_LIMITS``, and the total size the datasets declare
by :func:`check_declared_size` (no decompression bombs).  Values that pass a range check but
would poison serving are refused too: magnitudes, and each section's relations
(``validation.check_section_values``: sums, symmetry, membership).  Every failure is an
:class:`ArtifactError`.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import h5py
import numpy as np

from .errors import ArtifactError
from .metadata import ROOT_TEXT_ATTRS, extended_metadata_digest, metadata_digest
from .schema import (
    FORMAT_NAME,
    MODEL_ATTR_TYPES,
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    SCHEMA_VERSION,
    SECTIONS,
    ModelIdentity,
    Section,
)
from .validation import (
    RELATED,
    check_array,
    check_section_attrs,
    check_section_values,
    coerce_attr,
    model_identity_from_attrs,
    parse_json_object,
    section_dims,
)

# HDF5 filter ids the writer uses; anything else is refused (a filter id can make HDF5 load a
# plugin library named by the environment).
ALLOWED_FILTERS = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32}

# What reading a whole file may hold in memory (docs/artifact-format.md section 7): the sum of
# every schema dataset's declared size is at most MAX_ARTIFACT_BYTES, and at most MAX_EXPANSION
# times the file's size once above DECLARED_SIZE_FLOOR.  Real artifacts store float statistics
# that deflate barely shrinks (the embedded model's: 1.1x); deflate on constant data shrinks
# ~1000x, which is how a small file would declare gigabytes.
MAX_ARTIFACT_BYTES = 8 << 30  # 8x the covariance of Llama-3.1-405B (126 x 128 x 128 x 128 float32)
MAX_EXPANSION = 64
DECLARED_SIZE_FLOOR = 64 << 20
MAX_DATASET_BYTES = MAX_ARTIFACT_BYTES  # also for datasets of a newer minor version, never read
# the root attributes of the schema (docs/artifact-format.md section 2)
KNOWN_ROOT_ATTRS = ("format", "schema_version", *ROOT_TEXT_ATTRS, "metadata_sha256", "extended_metadata_sha256")
MAX_CHUNK_SLACK = 1 << 20  # a chunk may exceed its dataset's size only up to this (h5py's own never does)


def _size(nbytes: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{int(nbytes)} bytes"


def check_declared_size(declared: int, file_size: int) -> None:
    """Refuse a file whose datasets would take more memory than a reader allows (see above)."""
    if declared > MAX_ARTIFACT_BYTES:
        raise ArtifactError(
            f"declares {_size(declared)} of data, more than the {_size(MAX_ARTIFACT_BYTES)} a reader holds"
        )
    if declared > max(DECLARED_SIZE_FLOOR, MAX_EXPANSION * file_size):
        raise ArtifactError(
            f"declares {_size(declared)} of data in a {_size(file_size)} file: more than {MAX_EXPANSION} times the "
            "file's size (calibration statistics do not compress like that; a decompression bomb does)"
        )


def open_artifact(path: str | os.PathLike) -> ArtifactReader:
    """Open and structurally validate an artifact; use as a context manager or call close()."""
    return ArtifactReader(path)


def is_artifact_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an HDF5 file whose format attribute says it is a kvcal artifact (valid
    or not): what a writer may replace, unlike any other file that happens to be at the path."""
    try:
        if not Path(path).is_file() or not h5py.is_hdf5(path):
            return False
        with h5py.File(path, "r") as h5:
            fmt = h5.attrs.get("format", "")
    except Exception:  # noqa: BLE001 - unreadable: not recognisably an artifact
        return False
    return (fmt.decode("ascii", "replace") if isinstance(fmt, bytes) else str(fmt)) == FORMAT_NAME


def _parse_version(text: str) -> tuple[int, int]:
    """``"MAJOR.MINOR"``, both non-negative integers in ASCII digits (``int()`` alone also reads "-1",
    "+6", " 1", "1_0" and other scripts' digits: "1.-1" validated)."""
    match = re.fullmatch(r"([0-9]+)\.([0-9]+)", text)
    if match is None:
        raise ArtifactError(f"schema_version {text!r} is not of the form MAJOR.MINOR (two non-negative integers)")
    return int(match[1]), int(match[2])


class ArtifactReader:
    """A validated, lazily read calibration file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ArtifactError(f"{self.path}: no such file")
        try:
            self._h5 = h5py.File(self.path, "r")
        except Exception as exc:  # truncated, not HDF5, damaged superblock...
            raise ArtifactError(f"{self.path}: not a readable HDF5 file ({exc})") from exc
        try:
            self._load_structure()
        except ArtifactError as exc:
            self.close()
            raise ArtifactError(f"{self.path}: {exc}") from None
        except Exception as exc:  # damaged object headers and the like
            self.close()
            raise ArtifactError(f"{self.path}: damaged file ({type(exc).__name__}: {exc})") from exc

    # -- structure -----------------------------------------------------------------------

    def _load_structure(self) -> None:
        attrs = self._h5.attrs
        fmt = coerce_attr("/", "format", attrs.get("format", ""), str)
        if fmt != FORMAT_NAME:
            raise ArtifactError(f"not a calibration artifact (format attribute {fmt!r}, expected {FORMAT_NAME!r})")
        version = coerce_attr("/", "schema_version", attrs.get("schema_version", ""), str)
        major, minor = _parse_version(version)
        if major > SCHEMA_MAJOR:
            raise ArtifactError(
                f"schema version {version} is newer than this toolkit understands "
                f"(it reads {SCHEMA_MAJOR}.x up to {SCHEMA_VERSION}); a reader for schema "
                f"{major}.x is needed: upgrade kvcal"
            )
        if major < SCHEMA_MAJOR:
            raise ArtifactError(f"schema version {version} is older than {SCHEMA_MAJOR}.0 and no longer supported")
        self.schema_version = version
        self._newer_minor = minor > SCHEMA_MINOR

        root = {name: coerce_attr("/", name, attrs[name], str) if name in attrs else None for name in ROOT_TEXT_ATTRS}
        missing = [name for name, value in root.items() if value is None]
        if missing:
            raise ArtifactError(f"required root attribute(s) {missing} missing")
        self.toolkit_version = root["toolkit_version"]
        self.created = root["created"]
        self.config = parse_json_object("config_json", root["config_json"])

        self._check_tree()
        if "model" not in self._h5 or not isinstance(self._h5["model"], h5py.Group):
            raise ArtifactError("the /model group is missing")
        self._refuse_unknown_attrs("/", attrs, KNOWN_ROOT_ATTRS)
        self._refuse_unknown_attrs("/model", self._h5["model"].attrs, MODEL_ATTR_TYPES)
        self.model: ModelIdentity = model_identity_from_attrs(self._h5["model"].attrs)
        arch = self.model.dims()

        self.sections: tuple[str, ...] = tuple(name for name in SECTIONS if name in self._h5)
        self._read_sections: dict[str, Section] = {}  # sections already read and checked
        self._dims: dict[str, dict[str, int]] = {}
        self._section_attrs: dict[str, dict] = {}
        declared = 0  # bytes the schema datasets take in memory once read
        for name in self.sections:
            group = self._h5[name]
            if not isinstance(group, h5py.Group):
                raise ArtifactError(f"/{name} must be a group")
            shapes = {key: obj.shape for key, obj in group.items() if isinstance(obj, h5py.Dataset)}
            self._dims[name] = section_dims(name, shapes, arch, self.model.value_head_dim)
            self._section_attrs[name] = check_section_attrs(name, group.attrs)
            self._refuse_unknown_attrs(f"/{name}", group.attrs, SECTIONS[name].attrs)
            for key, obj in group.items():
                if key not in SECTIONS[name].datasets and not self._newer_minor:
                    raise ArtifactError(f"/{name}/{key}: not part of schema {self.schema_version}")
                if key in SECTIONS[name].datasets and isinstance(obj, h5py.Dataset):
                    self._check_dataset_storage(obj)
                    self._refuse_unknown_attrs(f"/{name}/{key}", obj.attrs, ())
                    expected = np.dtype(SECTIONS[name].datasets[key].dtype)
                    if obj.dtype != expected:  # before any value is read: a consumer never gets another dtype
                        raise ArtifactError(
                            f"/{name}/{key}: dtype {obj.dtype.str} where the schema says {expected.str}"
                        )
                    declared += obj.dtype.itemsize * int(np.prod(obj.shape, dtype=np.float64))
        check_declared_size(declared, self.path.stat().st_size)

        stored = coerce_attr("/", "metadata_sha256", attrs.get("metadata_sha256", ""), str)
        model_attrs = {name: getattr(self.model, name) for name in self.model.__dataclass_fields__}
        if stored != metadata_digest(root, model_attrs, self._section_attrs):
            raise ArtifactError("metadata checksum mismatch: attributes were altered or corrupted")
        # the /model attributes added after 1.1 (weights_fingerprints) have their own digest; a
        # file that has either the attributes or the digest must have both, and they must agree
        extended = extended_metadata_digest(root, model_attrs, self._section_attrs)
        stored_extended = attrs.get("extended_metadata_sha256")
        if stored_extended is not None:
            stored_extended = coerce_attr("/", "extended_metadata_sha256", stored_extended, str)
        if stored_extended != extended:
            raise ArtifactError("metadata checksum mismatch: attributes were altered or corrupted (extended digest)")

    def _refuse_unknown_attrs(self, where: str, attrs, known) -> None:
        """Section 1, versioning: a file whose minor version is not newer than the reader's holds no
        attribute the schema does not name (a newer minor's are ignored)."""
        if self._newer_minor:
            return
        unknown = sorted(set(attrs.keys()) - set(known))
        if unknown:
            raise ArtifactError(
                f"{where}: attribute(s) {', '.join(map(repr, unknown))} not part of schema {self.schema_version}"
            )

    def _check_tree(self) -> None:
        """Walk every link in the file; refuse anything that could read outside it."""
        known_root = set(SECTIONS) | {"model"}

        def walk(group: h5py.Group, prefix: str, depth: int) -> None:
            if depth > 2:
                raise ArtifactError(f"{prefix}: nesting deeper than the schema allows")
            for key in group.keys():
                where = f"{prefix}{key}"
                link = group.get(key, getlink=True)
                if isinstance(link, h5py.ExternalLink):
                    raise ArtifactError(f"{where}: external link to {link.filename}:{link.path} refused")
                if isinstance(link, h5py.SoftLink):
                    raise ArtifactError(f"{where}: soft link refused")
                if not isinstance(link, h5py.HardLink):
                    raise ArtifactError(f"{where}: link of unknown kind refused")
                obj = group.get(key)
                if isinstance(obj, h5py.Datatype):
                    raise ArtifactError(f"{where}: named datatypes are not part of the schema")
                if (depth == 0 and key not in known_root or prefix == "/model/") and not self._newer_minor:
                    raise ArtifactError(f"{where}: not part of schema {SCHEMA_VERSION}")
                if isinstance(obj, h5py.Group):
                    walk(obj, where + "/", depth + 1)
                elif isinstance(obj, h5py.Dataset):
                    self._check_dataset_storage(obj)
                    if depth == 0:
                        raise ArtifactError(f"{where}: datasets belong inside a section group")

        walk(self._h5, "/", 0)

    def _check_dataset_storage(self, dset: h5py.Dataset) -> None:
        where = dset.name
        if dset.is_virtual:
            raise ArtifactError(f"{where}: virtual datasets are refused")
        if dset.external:
            raise ArtifactError(f"{where}: external storage is refused")
        if dset.chunks is None:
            raise ArtifactError(f"{where}: not chunked, so it carries no checksum")
        filters = set(self._filter_ids(dset))
        if h5py.h5z.FILTER_FLETCHER32 not in filters:
            raise ArtifactError(f"{where}: no fletcher32 checksum")
        unknown = filters - ALLOWED_FILTERS
        if unknown:
            raise ArtifactError(f"{where}: unsupported HDF5 filter(s) {sorted(unknown)}")
        nbytes = dset.dtype.itemsize * int(np.prod(dset.shape, dtype=np.float64))
        if nbytes > MAX_DATASET_BYTES:
            raise ArtifactError(f"{where}: larger than {MAX_DATASET_BYTES >> 30} GiB")
        # HDF5 inflates a whole chunk to read any of it: a chunk far beyond its (extendible) dataset
        # would allocate what the declared size never shows
        chunk_bytes = dset.dtype.itemsize * int(np.prod(dset.chunks, dtype=np.float64))
        if chunk_bytes > max(nbytes, MAX_CHUNK_SLACK):
            raise ArtifactError(f"{where}: chunks of {_size(chunk_bytes)}, larger than the dataset ({_size(nbytes)})")

    @staticmethod
    def _filter_ids(dset: h5py.Dataset) -> list[int]:
        plist = dset.id.get_create_plist()
        return [plist.get_filter(index)[0] for index in range(plist.get_nfilters())]

    # -- values --------------------------------------------------------------------------

    def has(self, section: str) -> bool:
        return section in self.sections

    def require(self, section: str, needed_for: str = "") -> None:
        """Raise a clear error when ``section`` is absent."""
        if section not in SECTIONS:
            raise ArtifactError(f"unknown section {section!r}; known: {', '.join(SECTIONS)}")
        if section not in self.sections:
            purpose = f" (needed for {needed_for})" if needed_for else ""
            present = ", ".join(self.sections) or "none"
            raise ArtifactError(
                f"{self.path}: has no {section!r} section{purpose}; "
                f"sections present: {present}. Re-run profile-model with that stage."
            )

    def read(self, section: str, name: str) -> np.ndarray:
        """One dataset's values, checked (checksum, completeness, dtype, shape, range, magnitude) and,
        with the small siblings they relate to, the section's relations (``validation.RELATED``:
        sums, symmetry, membership)."""
        array = self._read_one(section, name)
        present = self.datasets(section)
        related = {key: self._read_one(section, key) for key in RELATED.get((section, name), ()) if key in present}
        try:
            check_section_values(section, {name: array, **related}, self._section_attrs[section], self.sections)
        except ArtifactError as exc:
            raise ArtifactError(f"{self.path}: {exc}") from None
        return array

    def _read_one(self, section: str, name: str) -> np.ndarray:
        """One dataset's values with the per-dataset checks."""
        self.require(section)
        if name not in SECTIONS[section].datasets:
            raise ArtifactError(f"/{section} has no dataset {name!r} in schema {SCHEMA_VERSION}")
        if name not in self._h5[section]:
            raise ArtifactError(
                f"{self.path}: /{section} has no {name!r}: an optional dataset a file of schema "
                f"{self.schema_version} does not hold"
            )
        dset = self._h5[section][name]
        expected_chunks = int(np.prod([-(-size // chunk) for size, chunk in zip(dset.shape, dset.chunks, strict=True)]))
        try:
            allocated = dset.id.get_num_chunks()
            array = dset[()]
        except Exception as exc:  # fletcher32 mismatch, inflate error, damaged chunk index
            raise ArtifactError(f"{self.path}: /{section}/{name} cannot be read intact ({exc})") from exc
        if allocated != expected_chunks:
            raise ArtifactError(
                f"{self.path}: /{section}/{name} has {allocated} of {expected_chunks} "
                "chunks stored (the rest would read as fill values)"
            )
        try:
            check_array(section, name, array, self._dims[section])
        except ArtifactError as exc:
            raise ArtifactError(f"{self.path}: {exc}") from None
        return array

    def section(self, section: str) -> Section:
        """All of a section's datasets, read and checked, and its attributes.

        Read once per reader: later calls return the same arrays (do not modify them).
        """
        self.require(section)
        if section not in self._read_sections:
            arrays = {name: self._read_one(section, name) for name in self.datasets(section)}
            try:  # every relation at once (read() checks one dataset's with its siblings)
                check_section_values(section, arrays, self._section_attrs[section], self.sections)
            except ArtifactError as exc:
                raise ArtifactError(f"{self.path}: {exc}") from None
            self._read_sections[section] = Section(arrays=arrays, attrs=dict(self._section_attrs[section]))
        return self._read_sections[section]

    def datasets(self, section: str) -> tuple[str, ...]:
        """The schema datasets of ``section`` the file holds: all, but optional ones (added by a later
        minor version) a file of an older one lacks."""
        self.require(section)
        group = self._h5[section]
        return tuple(name for name in SECTIONS[section].datasets if name in group)

    def dims(self, section: str) -> dict[str, int]:
        """Architecture and free dimensions of a section (``P``, ``NT``...)."""
        self.require(section)
        return dict(self._dims[section])

    def validate(self) -> None:
        """Read and check every dataset of every section (without keeping them)."""
        for section in self.sections:
            if section not in self._read_sections:
                for name in self.datasets(section):
                    self.read(section, name)

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        h5 = getattr(self, "_h5", None)
        if h5 is not None:
            h5.close()
            self._h5 = None
        self._read_sections = {}

    def __enter__(self) -> ArtifactReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # At interpreter exit h5py's module state may already be torn down (its close() then
        # fails inside h5py); the HDF5 library closes its files on exit by itself.
        if not sys.is_finalizing():
            self.close()
