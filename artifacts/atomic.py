"""Writing a file so that it appears complete or not at all.

    with atomic_path("out/kv_calibration.h5") as tmp:
        write_everything_to(tmp)

The block writes to a temporary file in the destination's directory (same file system, so
the rename is atomic); when the block succeeds the file is fsynced, renamed over the
destination and the directory entry fsynced.  An exception in the block removes the
temporary file and leaves whatever was at the destination untouched.  A process killed in
the block leaves at most a hidden ``.<name>.<random>.tmp`` beside the destination.

File mode: the temporary file is private (0600, from ``mkstemp``) while it is written; before
the rename it is given the mode a plain ``open(path, "w")`` would have created the file with,
``0666 & ~umask`` (0644 under umask 022, 0640 under 027), or, when the destination already
exists, the destination's current permission bits (replacing a file keeps its mode, as an
editor does).  The umask is read without changing it (:func:`current_umask`).
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
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
        os.chmod(tmp, _destination_mode(path))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def _destination_mode(path: Path) -> int:
    """The existing destination's permission bits, else those a plain ``open(path, "w")`` gives."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~current_umask()


_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the platform allows.

    Linux reports it in ``/proc/self/status`` (``Umask:`` line, since Linux 4.7).  Elsewhere the
    only way is ``os.umask`` set-and-restore, which for an instant leaves the umask at 0o077
    (more restrictive, so a file another thread creates meanwhile is at worst too private).
    """
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


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
