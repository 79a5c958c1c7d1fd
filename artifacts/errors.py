"""The one exception the artifact code raises for anything wrong with a file or its contents."""


class ArtifactError(Exception):
    """A calibration artifact is missing, malformed, corrupted, unsafe or of an unknown version."""
