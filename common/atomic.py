"""Writing a file so that it appears complete or not at all: the one writer of every file the
tools write (artifacts, work files, JSON, HTML reports).

    with atomic_path("out/kv_calibration.h5") as tmp:
        write_everything_to(tmp)
    write_atomic("out/evaluation.json", text)  # the same, for text or bytes already in memory

The block writes to a temporary file in the destination's directory (same file system, so
the rename is atomic); when the block succeeds the file is fsynced, renamed over the
destination and the directory entry fsynced.  An exception in the block removes the
temporary file and leaves whatever was at the destination untouched; a failing write (disk
full, file too large, permission) is raised as :class:`OutputError` (an ``OSError``) with one
clear sentence naming the destination.

Destinations: an existing symbolic link is followed (its target is replaced); a directory, a
device or anything else that is not a regular file is refused (:func:`check_output_path`,
which the command lines also call before any model work, so a bad ``--json`` / ``--html`` /
``--out`` is reported at once, not after an hour).  The command lines also pass their inputs
(an output is never written over one, through a link neither) and whether the output is text
(a JSON, JSON-lines or HTML output replaces an HDF5 or other binary file only with ``--force``).

Temporary files are named ``.<name>.<pid>.<random>.tmp``.  A process killed in the block leaves
one behind; the next write to the same destination removes those whose writer ``pid`` is no
longer alive on this machine and that have not been modified for ``STALE_TEMP_SECONDS`` (a
writer in another PID namespace or on another host sharing the directory keeps modifying its
file while it writes, and a reused pid only makes a stale file look alive, which keeps it).

File mode: the temporary file is private (0600, from ``mkstemp``) while it is written; before
the rename it is given the mode a plain ``open(path, "w")`` would have created the file with,
``0666 & ~umask`` (0644 under umask 022, 0640 under 027), or, when the destination already
exists, the destination's current permission bits (replacing a file keeps its mode, as an
editor does).  The umask is read without changing it (:func:`current_umask`).
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

STALE_TEMP_SECONDS = 600  # a dead writer's temporary file untouched this long is removed
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)\.[A-Za-z0-9_]+\.tmp")


class OutputError(OSError):
    """A file the tools write could not be written (or would not be a file); the message says
    which and why, and whatever was at the destination is unchanged."""


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_text_file(path: str | os.PathLike) -> bool:
    """Whether the file at ``path`` looks like text (what a JSON, JSON-lines or HTML output may
    replace): not an HDF5 file (a kvcal artifact), no NUL byte in its first 8 KiB."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8192)
    except OSError:
        return False
    return not head.startswith(HDF5_SIGNATURE) and b"\0" not in head


def check_output_path(
    path: str | os.PathLike,
    what: str = "output",
    *,
    inputs: Iterable[str | os.PathLike | None] = (),
    text: bool = False,
    force: bool = False,
    atomic: bool = True,
    try_writing: bool = True,
) -> Path:
    """The destination a write to ``path`` would replace (a symbolic link's target), checked
    without changing anything: not a directory or other non-regular file, its directory exists
    and is writable or can be created (``try_writing``: a file, or a directory where one is still
    to be made, is created there and removed again, which ``os.access`` cannot tell for root or a
    read-only mount), and every name the write creates fits the file system's ``NAME_MAX``: the
    directories still to be made, the file, and (``atomic``, a write through :func:`atomic_path`)
    the temporary name beside it.  Raises :class:`OutputError` otherwise.

    The rule every command follows (issue 30): no output is written over one of the command's
    ``inputs`` (compared after following links, so a link to the input is the input; never, even
    with ``--force``), and a ``text`` output (JSON, JSON lines, HTML) replaces only a text file
    unless ``force`` (an artifact or another binary file is not its kind)."""
    destination = Path(os.path.realpath(os.fspath(path)))
    shown = os.fspath(path)
    if destination.exists() and not destination.is_file():
        kind = "a directory" if destination.is_dir() else "not a regular file"
        raise OutputError(f"cannot write the {what} {shown}: it is {kind}")
    for source in inputs:
        if source is not None and Path(os.path.realpath(os.fspath(source))) == destination:
            same = "" if os.fspath(source) == shown else f" ({shown} leads to {source})"
            raise OutputError(f"cannot write the {what} {shown}: it is an input of this command{same}")
    if text and not force and destination.is_file() and not is_text_file(destination):
        kind = "an HDF5 file (an artifact?)" if _starts_with(destination, HDF5_SIGNATURE) else "a binary file"
        raise OutputError(
            f"cannot write the {what} {shown}: it is {kind}, not a {what}; choose another path (or --force)"
        )
    ancestor = destination.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"cannot write the {what} {shown}: {ancestor} is not a directory")
    _check_name_lengths(destination, ancestor, what, shown, atomic)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write the {what} {shown}: the directory {ancestor} is not writable")
    if try_writing:
        _try_writing(destination, ancestor, what, shown)
    return destination


def _name_max(directory: Path) -> int:
    """The longest file name, in bytes, the file system of ``directory`` allows (255 where unknown)."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):
        return 255


def _pid_digits() -> int:
    """The most digits a process id has on this machine (the temporary name holds the writer's pid)."""
    try:
        with open("/proc/sys/kernel/pid_max", encoding="ascii") as fh:
            return len(str(int(fh.read().strip()) - 1))
    except (OSError, ValueError):
        return 7  # Linux's largest pid_max, 4194304, has 7 digits


def temporary_name_length(name: str) -> int:
    """The length in bytes of the temporary name :func:`atomic_path` writes ``name`` under,
    ``.<name>.<pid>.<8 random characters>.tmp``, for the longest pid of this machine."""
    return len(os.fsencode(name)) + len(".." + "." + ".tmp") + _pid_digits() + 8


def _check_name_lengths(destination: Path, ancestor: Path, what: str, shown: str, atomic: bool) -> None:
    """Every name the write creates fits the file system (``NAME_MAX`` of the directory it goes in):
    the directories still to be made, the file, and the temporary file beside it (``atomic``)."""
    limit = _name_max(ancestor)
    for part in destination.relative_to(ancestor).parts[:-1]:
        if len(os.fsencode(part)) > limit:
            raise OutputError(
                f"cannot write the {what} {shown}: the directory name {part[:40]}... is "
                f"{len(os.fsencode(part))} bytes, longer than the {limit} the file system allows in a name"
            )
    name = destination.name
    length = len(os.fsencode(name))
    if length > limit:
        raise OutputError(
            f"cannot write the {what} {shown}: its name is {length} bytes, longer than the {limit} the file "
            "system allows in a name; choose a shorter name"
        )
    if atomic and temporary_name_length(name) > limit:
        raise OutputError(
            f"cannot write the {what} {shown}: its name is {length} bytes, and the temporary file written beside "
            f"it first (.NAME.PID.RANDOM.tmp, {temporary_name_length(name)} bytes) would be longer than the "
            f"{limit} the file system allows in a name; choose a name of at most "
            f"{limit - temporary_name_length(name) + length} bytes"
        )


def _try_writing(destination: Path, ancestor: Path, what: str, shown: str) -> None:
    """Create and remove a file (or, where directories are still to be made, a directory) in
    ``ancestor``: what ``os.access`` cannot tell (a root process under ``/proc``, a read-only mount)."""
    try:
        if ancestor == destination.parent:
            fd, name = tempfile.mkstemp(prefix=".kvcal-write-check.", dir=ancestor)
            os.close(fd)
            os.unlink(name)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".kvcal-write-check.", dir=ancestor))
    except OSError as exc:
        raise OutputError(
            f"cannot write the {what} {shown}: nothing can be created in the directory {ancestor} ({_describe(exc)})"
        ) from None


def _starts_with(path: Path, signature: bytes) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(len(signature)) == signature
    except OSError:
        return False


@contextmanager
def atomic_path(path: str | os.PathLike, what: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it replaces ``path`` durably."""
    shown = os.fspath(path)
    path = check_output_path(path, what, try_writing=False)  # mkstemp below tries
    existed = path.exists()
    unchanged = f"the existing {shown} is unchanged" if existed else f"{shown} was not created"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(path)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
    except OSError as exc:
        raise OutputError(f"cannot write the {what} {shown}: {_describe(exc)}") from exc
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _destination_mode(path))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OutputError):
            raise
        raise OutputError(f"cannot write the {what} {shown}: {_describe(exc)} ({unchanged})") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes | memoryview | str, what: str = "output") -> Path:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically (see :func:`atomic_path`)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_path(path, what) as tmp, open(tmp, "wb") as fh:
        fh.write(payload)
    return Path(path)


def remove_stale_temp_files(path: Path, now: float | None = None) -> list[Path]:
    """Remove the temporary files of dead writers of ``path`` (see the module docstring)."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP.fullmatch(entry.name)
        if match is None or match["name"] != path.name or _pid_alive(int(match["pid"])):
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or now - entry.stat().st_mtime < STALE_TEMP_SECONDS:
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid a writer could have had: leave the file alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


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


class OutputLocked(OSError):
    """Another live process holds the lock of this output (see :func:`output_lock`)."""


def lock_file_path(path: str | os.PathLike, rank: int = 0) -> Path:
    """``<path>.lock`` (``<path>.lock-rank<r>`` for the other processes of a multi-process job)."""
    path = Path(path)
    return path.with_name(path.name + (".lock" if rank == 0 else f".lock-rank{rank}"))


@contextmanager
def output_lock(path: str | os.PathLike, program: str, rank: int = 0) -> Iterator[Path]:
    """Hold an exclusive lock on ``<path>.lock`` for the block (``filelock``: ``flock`` on POSIX,
    the Windows equivalent there), or raise :class:`OutputLocked` naming the holder's pid.  The
    lock dies with its process (a killed run never blocks the next).  While held the lock file
    reads ``pid program``; when the block ends it is emptied but stays in place: removing it would
    let a process that opened it just before and one that creates it anew both hold "the" lock
    (filelock keeps one file for everyone)."""
    from filelock import FileLock, Timeout

    lock = lock_file_path(path, rank)
    lock.parent.mkdir(parents=True, exist_ok=True)
    held = FileLock(str(lock), timeout=0)
    try:  # read before trying: filelock 3.x opens the lock file truncated, even when it then fails
        holder = lock.read_text(encoding="ascii", errors="replace")[:200].split()
    except OSError:
        holder = []
    try:
        held.acquire()
    except Timeout:
        who = f"{holder[1] if len(holder) > 1 else 'kvcal'} run (pid {holder[0]})" if holder else "kvcal run"
        raise OutputLocked(
            f"another {who} is writing {path} (lock {lock}); wait for it to finish or choose another output"
        ) from None
    try:
        _record_holder(lock, f"{os.getpid()} {program}\n")
        yield lock
    finally:
        _record_holder(lock, "")
        held.release()


def _record_holder(lock: Path, text: str) -> None:
    """Write who holds ``lock`` into it (best effort: a platform that refuses writes to a locked
    file only loses the holder's name in the refusal message)."""
    try:
        with open(lock, "w", encoding="ascii", errors="replace") as fh:
            fh.write(text)
    except OSError:
        pass
