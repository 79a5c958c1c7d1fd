"""Writing a file so that it appears complete or not at all.

    with atomic_path("out/kv_calibration.h5") as tmp:
        write_everything_to(tmp)

The block writes to a temporary file in the destination's directory (same file system, so
the rename is atomic); when the block succeeds the file is fsynced, renamed over the
destination and the directory entry fsynced.  An exception in the block removes the
temporary file and leaves whatever was at the destination untouched.  A process killed in
the block leaves at most a hidden ``.<name>.<random>.tmp`` beside the destination.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Persist a rename (best effort: some platforms have no directory file descriptors)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
