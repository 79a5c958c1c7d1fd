"""Issue 13: bad input or a fault must give a clear refusal (exit 2), never a crash, a hang, or
destroyed output.  One test per case; each section belongs to one part of the toolkit.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import make_random_artifact, single_thread

REPO = Path(__file__).resolve().parents[1]

# -- outputs and options (profile-model, evaluate-artifact, inspect-artifact) --
#
# Every file the tools write goes through one writer (artifacts.atomic: atomic, a clear
# OutputError); every option and output path is checked before any model work.  "Disk full"
# is a real write failure: the child process runs under RLIMIT_FSIZE with SIGXFSZ ignored, so
# write() fails with EFBIG ("File too large") as it would with ENOSPC.

OUTPUTS_PROBES = 12


def _outputs_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def _limited(limit_bytes: int):
    """preexec_fn: files this child writes may not grow beyond ``limit_bytes`` (EFBIG, not SIGXFSZ)."""

    def apply():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))

    return apply


def _python(args: list[str], limit_bytes: int | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=_outputs_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=None if limit_bytes is None else _limited(limit_bytes),
        **kwargs,
    )


@pytest.fixture(scope="module")
def outputs_model_dir(tmp_path_factory, embedded_tokenizer):
    """A tiny random Llama with the embedded tokenizer, hand-built probes and calibration text."""
    from conftest import make_tiny_llama

    from needles.probe import Probe, Span

    directory = tmp_path_factory.mktemp("outputs-tiny-model")
    model = make_tiny_llama(vocab_size=len(embedded_tokenizer), seed=11)
    model.save_pretrained(directory)
    embedded_tokenizer.save_pretrained(directory)
    rng = random.Random(0)
    with open(directory / "probes.jsonl", "w") as fh:
        for i in range(OUTPUTS_PROBES):
            n = 48 + 4 * i
            ids = [rng.randrange(100, 40000) for _ in range(n)]
            spans = [Span("R", 10, 13), Span("B", 20, 22), Span("D", 30, 34)]
            probe = Probe(f"p{i}", "hand", n, 25.0 + i, i, "q?", "zebra", ids, spans, context_end=n - 6)
            fh.write(probe.to_json() + "\n")
    (directory / "calib.txt").write_text("A heron waited by the mill pond while the barges passed. " * 150)
    return directory


def _profile_args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        str(model_dir),
        "--out",
        str(out),
        "--preset",
        "smoke",
        "--probes",
        str(model_dir / "probes.jsonl"),
        "--calib-dataset",
        str(model_dir / "calib.txt"),
        "--calib-samples",
        "4",
        "--batch-size",
        "1",
        "--max-new-tokens",
        "5",
        "--no-progress",
        *extra,
    ]


def _profile(args: list[str]) -> int:
    from profiler.cli import main

    with single_thread():
        return main(args)


def _start_profile(args: list[str], wait_for: Path) -> subprocess.Popen:
    """Start profile-model in a child; return once ``wait_for`` exists (its first checkpoint)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "profiler.cli", *args],
        cwd=REPO,
        env=_outputs_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while not wait_for.exists():
        assert proc.poll() is None, f"run ended early: {proc.communicate()}"
        assert time.time() < deadline, f"no {wait_for.name} within 120 s"
        time.sleep(0.02)
    return proc


def test_every_output_writer_on_a_full_disk_raises_one_clear_error_and_keeps_the_old_file(tmp_path):
    """Artifact, work file, JSON and HTML report: one writer, one error, the old file intact."""
    script = """
import json, sys
sys.path.insert(0, "tests")
import numpy as np
from conftest import make_random_artifact
from artifacts import open_artifact, write_artifact
from artifacts.atomic import OutputError, write_atomic
from artifacts.report import write_report
from profiler.checkpoint import save_work

directory = sys.argv[1]
writers = {
    "artifact": lambda p: write_artifact(p, make_random_artifact()),
    "work": lambda p: save_work(p, "job", {"behaviour": 1}, {"behaviour.W_R": np.zeros(1 << 17)}),
    "json": lambda p: write_atomic(p, json.dumps(list(range(1 << 16)))),
    "report": lambda p: write_report(p, open_artifact(directory + "/full.h5")),
}
for name, write in writers.items():
    try:
        write(f"{directory}/{name}.out")
    except OutputError as exc:
        print(name, exc)
    else:
        print(name, "written")
"""
    from artifacts import write_artifact

    write_artifact(tmp_path / "full.h5", make_random_artifact())
    for name in ("artifact", "work", "json", "report"):
        (tmp_path / f"{name}.out").write_bytes(b"previous " + name.encode())
    done = _python(["-c", script, str(tmp_path)], limit_bytes=64 << 10)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    for name in ("artifact", "work", "json", "report"):
        target = tmp_path / f"{name}.out"
        assert lines[name].startswith("cannot write the ") and "File too large" in lines[name], lines[name]
        assert f"the existing {target} is unchanged" in lines[name]
        assert target.read_bytes() == b"previous " + name.encode()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_inspect_artifact_html_on_a_full_disk_keeps_the_previous_report(tmp_path):
    from artifacts import write_artifact

    artifact = write_artifact(tmp_path / "a.h5", make_random_artifact())
    report = tmp_path / "report.html"
    report.write_text("<p>the previous report</p>")
    done = _python(["-m", "artifacts.cli", str(artifact), "--html", str(report)], limit_bytes=16 << 10)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"inspect-artifact: cannot write the HTML report {report}: File too large" in done.stderr
    assert report.read_text() == "<p>the previous report</p>"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("kind", ["directory", "device", "under-a-file"])
def test_inspect_artifact_html_to_a_directory_or_device_is_refused(tmp_path, capsys, kind):
    from artifacts import write_artifact
    from artifacts.cli import main

    artifact = write_artifact(tmp_path / "a.h5", make_random_artifact(sections=("moments",)))
    (tmp_path / "file").write_text("x")
    target = {"directory": str(tmp_path), "device": "/dev/full", "under-a-file": str(tmp_path / "file" / "r.html")}
    assert main([str(artifact), "--html", target[kind]]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the HTML report {target[kind]}" in err and "Traceback" not in err
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")  # the device is still a device


def test_a_killed_writers_temp_file_is_removed_by_the_next_write(tmp_path):
    from artifacts import write_artifact
    from artifacts.atomic import STALE_TEMP_SECONDS

    out = tmp_path / "kv_calibration.h5"
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom artifacts.atomic import atomic_path\n"
            "with atomic_path(sys.argv[1]) as tmp:\n"
            "    tmp.write_bytes(b'x' * 100000); print(tmp.name, flush=True); time.sleep(600)\n",
            str(out),
        ],
        cwd=REPO,
        env=_outputs_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    name = writer.stdout.readline().strip()
    writer.kill()
    writer.wait(timeout=60)
    dead = tmp_path / name
    assert dead.exists() and f".{out.name}.{writer.pid}." in name
    live = tmp_path / f".{out.name}.{os.getpid()}.abc123.tmp"  # a live writer's (this process)
    fresh_dead = tmp_path / f".{out.name}.{writer.pid}.fresh1.tmp"  # dead, but modified just now
    other = tmp_path / f".other.h5.{writer.pid}.abc123.tmp"  # another destination's
    for path in (live, fresh_dead, other):
        path.write_bytes(b"x")
    old = time.time() - STALE_TEMP_SECONDS - 60
    for path in (dead, live, other):
        os.utime(path, (old, old))
    write_artifact(out, make_random_artifact(sections=("moments",)))
    assert not dead.exists()
    assert live.exists() and fresh_dead.exists() and other.exists()
