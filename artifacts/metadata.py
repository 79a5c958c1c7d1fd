"""Root and ``/model`` attributes, and the digest that protects them.

HDF5 attributes are not covered by the per-dataset fletcher32 checksums, so the writer stores
``metadata_sha256``: the SHA-256 of the canonical JSON (``schema.canonical_json``) of

    {"root": {"config_json", "created", "toolkit_version"},
     "model": {every ModelIdentity field, query_norm as true/false},
     "sections": {section: {its schema attributes}}}

with values as the schema types them.  The reader recomputes it from what it read.
"""

from __future__ import annotations

import dataclasses
import hashlib

from .schema import Artifact, canonical_json

ROOT_TEXT_ATTRS = ("toolkit_version", "created", "config_json")


def root_attrs(artifact: Artifact, *, created: str, version: str) -> dict:
    """The attribute values to write: ``{"root": {...}, "model": {...}}``."""
    model = dataclasses.asdict(artifact.model)
    return {
        "root": {"toolkit_version": version, "created": created, "config_json": canonical_json(artifact.config)},
        "model": model,
    }


def metadata_digest(root: dict, model: dict, section_attrs: dict) -> str:
    document = {
        "root": {name: root[name] for name in ROOT_TEXT_ATTRS},
        "model": {name: (bool(v) if name == "query_norm" else v) for name, v in model.items()},
        "sections": section_attrs,
    }
    return hashlib.sha256(canonical_json(document).encode("ascii")).hexdigest()
