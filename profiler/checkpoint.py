"""The resume work file: partial accumulators of an interrupted job, written atomically.

A job checkpoints its accumulators (float64 sums, counters, the per-probe table) into a
sibling of the output, ``<out>.work.npz`` (``<out>.work-rank<r>of<W>.npz`` per process under
``accelerate``), every few probes / batches.  Each write goes to a temporary file in the same
directory, is fsynced, and renamed over the previous one, so a SIGKILL at any moment leaves
either the previous or the new checkpoint, never a torn one.  The artifact itself is written
only at the very end (also atomically), so the output path never holds a partial artifact.

Resuming continues the same accumulation in the same order from the saved float64 sums, so a
resumed single-process run reproduces the uninterrupted result bit for bit.  Across a
different number of processes the sums are added in a different order (differences of the
order of 1e-16 relative).

A work file records a fingerprint of the checkpointed work (model, the sharded stages'
configuration and probe set, process count and rank; ``profiler.job``); ``--resume`` refuses a
work file with a different fingerprint.  Options of the unsharded stages (budgets,
budget-curves, moments, recommendation) are not part of it: their sections are rebuilt from the sums at the end.
"""

from __future__ import annotations

import json
import signal
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from common.atomic import atomic_path

WORK_FORMAT = "kvcal-profiler-work-2"  # 2: arrays keyed "<section>.<name>", progress per stage


class WorkFileMismatch(RuntimeError):
    """The work file belongs to another job (different model, configuration or process count)."""


def work_file_path(out: Path, rank: int = 0, world_size: int = 1) -> Path:
    suffix = ".work.npz" if world_size == 1 else f".work-rank{rank}of{world_size}.npz"
    return out.with_name(out.name + suffix)


def save_work(
    path: Path, fingerprint: str, progress: dict, arrays: dict[str, np.ndarray], load: dict | None = None
) -> None:
    """Atomically replace ``path`` with the given state.  ``progress``: JSON-able counters; ``load``:
    how the run asked for its model to be loaded (``--dtype``, ``--attn-implementation``), which a
    ``--resume`` compares before its model loads (:func:`work_load`)."""
    document = {"format": WORK_FORMAT, "fingerprint": fingerprint, "progress": progress}
    if load is not None:
        document["load"] = load
    meta = json.dumps(document, sort_keys=True)
    members = {"__meta__": np.frombuffer(meta.encode(), dtype=np.uint8), **arrays}
    # np.savez's layout (one .npy member per array, read back by np.load), written through a
    # ZipFile we close ourselves: NumPy 2.0's savez leaves its archive open when a write fails
    # (a full disk), and the archive's finaliser then prints a traceback at exit.
    with atomic_path(path, "work file") as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in members.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def work_load(path: Path) -> dict | None:
    """The ``load`` a work file recorded (:func:`save_work`), or None (no file, an unreadable one, or
    one written before the load was recorded: :func:`load_work` then says what is wrong)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["__meta__"]).decode())
    except Exception:  # noqa: BLE001 - load_work reports an unreadable file
        return None
    load = meta.get("load") if isinstance(meta, dict) else None
    return load if isinstance(load, dict) else None


def load_work(path: Path, fingerprint: str) -> tuple[dict, dict[str, np.ndarray]] | None:
    """``(progress, arrays)`` from ``path``, or None when it does not exist."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["__meta__"]).decode())
            arrays = {name: data[name] for name in data.files if name != "__meta__"}
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise WorkFileMismatch(f"cannot read the work file {path} ({exc}); delete it to start over") from exc
    if meta.get("format") != WORK_FORMAT:
        raise WorkFileMismatch(f"{path} is not a profiler work file of this version; delete it to start over")
    if meta.get("fingerprint") != fingerprint:
        raise WorkFileMismatch(
            f"{path} belongs to a different job (model, its dtype or attention implementation, configuration, "
            "probe set or number of processes changed); rerun with the original arguments, or delete it / drop "
            "--resume to start over"
        )
    return meta["progress"], arrays


def remove_work(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@contextmanager
def interrupts_deferred():
    """Hold SIGINT / SIGTERM until the block ends, then raise ``KeyboardInterrupt``.

    Wraps the commit of one finished probe / batch into the accumulators together with the
    progress counter, so that an interruption never leaves an item counted in the sums but
    not in the progress (it would be added twice after resuming).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def remember(signum, _frame):
        received.append(signum)

    previous = {sig: signal.signal(sig, remember) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise KeyboardInterrupt
