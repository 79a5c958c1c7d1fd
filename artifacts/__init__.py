"""The HDF5 calibration artifact: schema, writing, reading, validation.

Needs only h5py and numpy (``artifacts.fingerprint`` imports torch lazily, inside the
functions that take a model).  The format is specified in ``docs/artifact-format.md``;
``artifacts.schema`` is its machine-readable form.

    from artifacts import Artifact, Section, ModelIdentity, write_artifact, open_artifact
    write_artifact("kv_calibration.h5", Artifact(model=identity, config={...},
                                                 sections={"query_stats": Section(...)}))
    with open_artifact("kv_calibration.h5") as reader:
        stats = reader.section("query_stats")      # checked arrays: stats["mean"], ...
"""

from .errors import ArtifactError
from .reader import ArtifactReader, open_artifact
from .schema import SCHEMA_VERSION, SECTIONS, Artifact, ModelIdentity, Section
from .writer import write_artifact

ARTIFACT_FILENAME = "kv_calibration.h5"  # the name the runtime looks for next to the weights

__all__ = [
    "ARTIFACT_FILENAME",
    "Artifact",
    "ArtifactError",
    "ArtifactReader",
    "ModelIdentity",
    "SCHEMA_VERSION",
    "SECTIONS",
    "Section",
    "open_artifact",
    "write_artifact",
]
