"""Root and ``/model`` attributes, and the digest that protects them.

HDF5 attributes are not covered by the per-dataset fletcher32 checksums, so the writer stores
``metadata_sha256``: the SHA-256 of the canonical JSON (``schema.canonical_json``) of

    {"root": {"config_json", "created", "toolkit_version"},
     "model": {every ModelIdentity field of schema 1.1, query_norm as true/false},
     "sections": {section: {its schema attributes}}}

with values as the schema types them.  The reader recomputes it from what it read.  The
/model attributes and the sections added after 1.1 (``schema.OPTIONAL_MODEL_ATTRS``,
``schema.SECTIONS_AFTER_1_1``) are left out of it, so that a 1.1 reader, which does not know
them, can still verify it; when a file has any of them, ``extended_metadata_sha256`` is the
digest of the same document with them included.  Sections added after 1.2
(``schema.SECTIONS_AFTER_1_2``) have no attributes and are in neither digest (a 1.2 reader
skips them; their datasets carry their own checksums).
"""

from __future__ import annotations

import dataclasses
import hashlib

from .schema import OPTIONAL_MODEL_ATTRS, SECTIONS_AFTER_1_1, SECTIONS_AFTER_1_2, Artifact, canonical_json

ROOT_TEXT_ATTRS = ("toolkit_version", "created", "config_json")


def root_attrs(artifact: Artifact, *, created: str, version: str) -> dict:
    """The attribute values to write: ``{"root": {...}, "model": {...}}``."""
    model = dataclasses.asdict(artifact.model)
    return {
        "root": {"toolkit_version": version, "created": created, "config_json": canonical_json(artifact.config)},
        "model": model,
    }


def _before_1_3(section_attrs: dict) -> dict:
    """The sections of ``section_attrs`` that a 1.2 reader knows (those added after 1.2 have no attributes)."""
    return {name: v for name, v in section_attrs.items() if name not in SECTIONS_AFTER_1_2}


def metadata_digest(root: dict, model: dict, section_attrs: dict) -> str:
    """``metadata_sha256``: over what schema 1.1 has (not the /model attributes and sections added later)."""
    section_attrs = _before_1_3(section_attrs)
    return _digest(
        root,
        {name: v for name, v in model.items() if name not in OPTIONAL_MODEL_ATTRS},
        {name: v for name, v in section_attrs.items() if name not in SECTIONS_AFTER_1_1},
    )


def extended_metadata_digest(root: dict, model: dict, section_attrs: dict) -> str | None:
    """``extended_metadata_sha256``: the same document with the /model attributes and the sections
    added after 1.1 that are present included (not those added after 1.2); None when there are none."""
    section_attrs = _before_1_3(section_attrs)
    extra = {name: model[name] for name in OPTIONAL_MODEL_ATTRS if model.get(name)}
    if not extra and not any(name in SECTIONS_AFTER_1_1 for name in section_attrs):
        return None
    base = {name: v for name, v in model.items() if name not in OPTIONAL_MODEL_ATTRS}
    return _digest(root, {**base, **extra}, section_attrs)


def _digest(root: dict, model: dict, section_attrs: dict) -> str:
    document = {
        "root": {name: root[name] for name in ROOT_TEXT_ATTRS},
        "model": {name: (bool(v) if name == "query_norm" else v) for name, v in model.items()},
        "sections": section_attrs,
    }
    return hashlib.sha256(canonical_json(document).encode("ascii")).hexdigest()
