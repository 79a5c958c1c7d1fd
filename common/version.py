"""The toolkit's version, from the installed distribution's metadata, and every command's ``--version``."""

from __future__ import annotations

import argparse
import importlib.metadata

DISTRIBUTION = "kvcal"  # [project] name in pyproject.toml
UNKNOWN = "0+unknown"  # running from a source tree that was never installed


def toolkit_version() -> str:
    """The installed ``kvcal`` distribution's version (``0+unknown`` when it is not installed)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def add_version_argument(parser: argparse.ArgumentParser) -> None:
    """``--version``: prints ``PROG VERSION`` (e.g. ``profile-model 0.1.0``) and exits 0."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {toolkit_version()}")
