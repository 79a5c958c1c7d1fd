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
from conftest import make_random_artifact, make_random_identity, single_thread

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


def test_disk_full_during_the_final_artifact_write_exits_2_and_keeps_the_old_artifact(outputs_model_dir, tmp_path):
    from artifacts import open_artifact, write_artifact

    out = tmp_path / "kv_calibration.h5"
    write_artifact(out, make_random_artifact(sections=("moments",)))  # another model's, replaced with --force
    before = out.read_bytes()
    # 8 KiB: the behaviour work file (~3 KiB) fits, the final artifact (~15 KiB) does not
    args = _profile_args(outputs_model_dir, out, "--stages", "behaviour,budgets", "--force")
    done = _python(["-m", "profiler.cli", *args], limit_bytes=8 << 10)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"cannot write the artifact {out}: File too large (the existing {out} is unchanged)" in done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert out.read_bytes() == before
    with open_artifact(out) as reader:
        reader.validate()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


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


@pytest.mark.parametrize("option", ["--json", "--html"])
@pytest.mark.parametrize("kind", ["directory", "device", "under-a-file"])
def test_evaluate_artifact_output_paths_are_checked_before_any_model_work(tmp_path, capsys, option, kind):
    from profiler.evaluate_cli import main

    (tmp_path / "file").write_text("x")
    target = {"directory": str(tmp_path), "device": "/dev/full", "under-a-file": str(tmp_path / "file" / "out")}
    # a model that does not exist: the output error must come first, before anything is loaded
    assert main([str(tmp_path / "no-such-model"), option, target[kind]]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the {'JSON results' if option == '--json' else 'HTML report'} {target[kind]}" in err
    assert "no such model directory" not in err


def test_profile_model_refuses_to_overwrite_a_file_that_is_not_an_artifact(outputs_model_dir, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_bytes(os.urandom(4096))
    before = out.read_bytes()
    for extra in ((), ("--force",)):
        assert _profile(_profile_args(outputs_model_dir, out, "--stages", "query-stats", *extra)) == 2
        err = capsys.readouterr().err
        assert f"{out} exists and is not a kvcal artifact" in err
        assert out.read_bytes() == before
    assert not list(tmp_path.glob("*.work*"))


def test_profile_model_refuses_to_replace_another_models_artifact_unless_forced(outputs_model_dir, tmp_path, capsys):
    from artifacts import open_artifact, write_artifact

    out = tmp_path / "kv_calibration.h5"
    write_artifact(out, make_random_artifact(make_random_identity(name="another-model")))
    before = out.read_bytes()
    assert _profile(_profile_args(outputs_model_dir, out, "--stages", "query-stats")) == 2
    err = capsys.readouterr().err
    assert f"{out} is the artifact of another model (another-model)" in err and "--force" in err
    assert out.read_bytes() == before
    assert _profile(_profile_args(outputs_model_dir, out, "--stages", "query-stats", "--force")) == 0
    with open_artifact(out) as reader:
        assert set(reader.sections) == {"query_stats"}


@pytest.mark.parametrize(
    "option",
    [
        ("--keep-ratios", "1.5"),
        ("--keep-ratios", "0"),
        ("--beta", "nan"),
        ("--beta", "0.5"),
        ("--budgets", "0,64"),
        ("--min-budget", "-1"),
        ("--recommend-compression-ratios", "1"),
        ("--recommend-policies", ","),
        ("--keep-ratios", ","),
    ],
    ids=" ".join,
)
def test_profile_model_later_stage_options_are_refused_before_any_model_work(tmp_path, capsys, option):
    from profiler.cli import main

    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "no-such-model"), "--stages", "behaviour,budgets", *option])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}:" in err and "no such model directory" not in err


def test_profile_job_api_validates_every_setting_before_loading(tmp_path):
    from profiler.job import JobOptions, ProfileJob

    bad = {
        "keep_ratios": (1.5,),
        "beta": float("nan"),
        "token_budgets": (0,),
        "min_budget": -1,
        "calib_samples": 0,
        "max_new_tokens": 0,
        "batch_size": 0,
        "recommend_count": 0,
    }
    for name, value in bad.items():
        options = JobOptions(model=str(tmp_path / "no-such-model"), preset="quick", settings={name: value})
        with pytest.raises(ValueError):
            ProfileJob(options)


def test_resume_accepts_a_changed_option_of_a_later_unsharded_stage(outputs_model_dir, tmp_path, capsys):
    from artifacts import open_artifact

    out = tmp_path / "kv_calibration.h5"
    work = Path(str(out) + ".work.npz")
    args = _profile_args(outputs_model_dir, out, "--stages", "behaviour,budgets", "--checkpoint-every", "1")
    proc = _start_profile(args, work)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130 and work.exists() and not out.exists()
    # the budgets options were wrong: corrected, the behaviour work is kept
    assert _profile([*args, "--beta", "3", "--keep-ratios", "0.25,0.5", "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out
    with open_artifact(out) as reader:
        assert reader.config["budgets"]["beta"] == 3.0 and reader.config["budgets"]["ratios"] == [0.25, 0.5]
    # a changed option of the checkpointed (sharded) work is still refused
    proc = _start_profile(args, work)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert (
        _profile(
            [
                *_profile_args(outputs_model_dir, out, "--stages", "behaviour,budgets", "--max-new-tokens", "3"),
                "--resume",
            ]
        )
        == 2
    )
    assert "different job" in capsys.readouterr().err and work.exists()


def test_a_second_run_on_the_same_output_is_refused_and_a_dead_runs_lock_does_not_block(
    outputs_model_dir, tmp_path, capsys
):
    out = tmp_path / "kv_calibration.h5"
    work = Path(str(out) + ".work.npz")
    args = _profile_args(outputs_model_dir, out, "--stages", "behaviour", "--checkpoint-every", "1")
    first = _start_profile(args, work)
    try:
        first.send_signal(signal.SIGSTOP)  # still running (it holds its lock), just not progressing
        assert _profile(args) == 2
        err = capsys.readouterr().err
        assert f"another profile-model run (pid {first.pid}) is writing {out}" in err
        assert work.exists()  # its work file was left alone
    finally:
        first.kill()
        first.communicate(timeout=60)
    # killed: its lock died with it; --resume continues its work
    assert _profile([*args, "--resume"]) == 0
    assert "resuming from" in capsys.readouterr().out and out.is_file()
    assert not Path(str(out) + ".lock").exists()


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


@pytest.mark.parametrize(
    "option",
    [
        ("--calib-samples", "0"),
        ("--max-new-tokens", "0"),
        ("--batch-size", "0"),
        ("--calib-tokens", "0"),
        ("--batch-size", "-2"),
        ("--checkpoint-every", "0"),
        ("--recommend-count", "0"),
        ("--n-sink", "-1"),
        ("--scorer-probes", "-1"),
    ],
    ids=" ".join,
)
def test_profile_model_zero_or_negative_counts_are_refused_by_the_parser(capsys, option):
    from profiler.cli import main

    with pytest.raises(SystemExit) as exited:
        main([*option])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}: expected an integer >= " in err


@pytest.mark.parametrize(
    "option",
    [("--policies", ","), ("--tasks", ","), ("--count", "0"), ("--max-new-tokens", "0"), ("--tolerance", "nan")],
    ids=" ".join,
)
def test_evaluate_artifact_empty_lists_and_zero_counts_are_refused_by_the_parser(capsys, option):
    from profiler.evaluate_cli import main

    with pytest.raises(SystemExit) as exited:
        main([*option])
    assert exited.value.code == 2
    assert f"argument {option[0]}:" in capsys.readouterr().err
