"""Files the toolkit writes get the mode a plain ``open(path, "w")`` would give.

Artifacts and work files are written atomically through a temporary file; ``mkstemp`` makes
it 0600, which the rename used to carry to the destination.  Now the destination gets
``0666 & ~umask`` (0644 under umask 022, 0640 under 027), or keeps its mode when it exists.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from conftest import make_random_artifact

from artifacts import open_artifact, write_artifact
from artifacts.report import write_report
from common.atomic import atomic_path, current_umask
from profiler.checkpoint import load_work, save_work


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _plain_open_mode(directory, umask) -> int:
    reference = directory / "reference.txt"
    with open(reference, "w") as fh:
        fh.write("x")
    assert _mode(reference) == 0o666 & ~umask
    return _mode(reference)


def test_current_umask_reads_the_process_umask(umask):
    assert current_umask() == umask
    assert os.umask(umask) == umask  # reading it did not change it


def test_artifact_gets_the_mode_of_a_plain_open(tmp_path, umask):
    path = write_artifact(tmp_path / "kv_calibration.h5", make_random_artifact(sections=("moments",)))
    assert _mode(path) == _plain_open_mode(tmp_path, umask)
    with open_artifact(path) as reader:
        reader.validate()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_work_file_gets_the_mode_of_a_plain_open(tmp_path, umask):
    path = tmp_path / "kv_calibration.h5.work.npz"
    save_work(path, "job", {"behaviour": 3}, {"behaviour.W_R": np.arange(4.0)})
    assert _mode(path) == _plain_open_mode(tmp_path, umask)
    progress, arrays = load_work(path, "job")
    assert progress == {"behaviour": 3} and arrays["behaviour.W_R"].tolist() == [0, 1, 2, 3]


def test_report_gets_the_mode_of_a_plain_open(tmp_path, umask):
    artifact = write_artifact(tmp_path / "a.h5", make_random_artifact())
    with open_artifact(artifact) as reader:
        path = write_report(tmp_path / "report.html", reader)
    assert _mode(path) == _plain_open_mode(tmp_path, umask)


def test_an_existing_destination_keeps_its_mode(tmp_path, umask):
    path = tmp_path / "kv_calibration.h5"
    write_artifact(path, make_random_artifact(sections=("moments",)))
    os.chmod(path, 0o600)  # the owner made it private; rewriting it keeps it private
    write_artifact(path, make_random_artifact(sections=("moments",), seed=1))
    assert _mode(path) == 0o600
    os.chmod(path, 0o664)
    with atomic_path(path) as tmp:
        tmp.write_bytes(b"replaced")
    assert _mode(path) == 0o664 and path.read_bytes() == b"replaced"
