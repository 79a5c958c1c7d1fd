"""profile-model as a job: resume after SIGINT / SIGKILL, accelerate 2 processes == 1, CLI errors.

A tiny random Llama with the embedded model's tokenizer is saved as a model directory, with
hand-built probes (JSON lines) and a local calibration text file, so every run takes seconds.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import profile_env, single_thread, start_profile, tiny_profile_args, write_tiny_model_dir

from artifacts import open_artifact
from profiler.cli import main
from runtime.compression.prompt_statistics import QueryMoments

REPO = Path(__file__).resolve().parents[1]
NUM_PROBES = 12


@pytest.fixture(autouse=True, scope="module")
def one_thread_for_the_module():
    """In-process runs use one thread like the subprocesses (OMP_NUM_THREADS=1), so float32
    model arithmetic is the same everywhere and only the reduction order can differ."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, embedded_tokenizer):
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), embedded_tokenizer, probes=NUM_PROBES)


def _args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return tiny_profile_args(model_dir, out, *extra)


def _env():
    return profile_env()


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "profiler.cli", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def _read(path: Path) -> tuple[dict, dict]:
    with open_artifact(path) as reader:
        arrays = {
            f"{name}/{key}": value
            for name in ("behaviour", "query_stats", "budgets", "moments", "learned_scorer")
            for key, value in reader.section(name).arrays.items()
        }
        return arrays, dict(reader.config)


def _start_and_signal(args, work: Path, sig: int) -> subprocess.CompletedProcess:
    """Start a run, wait for its first checkpoint, send ``sig``; return the finished process."""
    proc = start_profile(args, work)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "kv_calibration.h5"
    assert main(_args(model_dir, out)) == 0  # in-process: an uninterrupted single-process run
    assert not Path(str(out) + ".work.npz").exists()
    return out


def test_interrupt_and_kill_then_resume_gives_the_same_artifact(model_dir, reference, tmp_path, capsys):
    out = tmp_path / "kv_calibration.h5"
    work = Path(str(out) + ".work.npz")
    args = _args(model_dir, out, "--checkpoint-every", "1")

    # Ctrl-C: clean stop, work file kept, the message says how to resume, no artifact.
    stopped = _start_and_signal(args, work, signal.SIGINT)
    assert stopped.returncode == 130, stopped.stderr
    assert "--resume" in stopped.stderr and work.exists() and not out.exists()

    # Resuming with other settings is refused (the work file is left alone).
    assert main([*_args(model_dir, out, "--max-new-tokens", "3"), "--resume"]) == 2
    assert "different job" in capsys.readouterr().err and work.exists()
    assert main([*args, "--dtype", "bfloat16", "--resume"]) == 2  # and with the model in another dtype
    err = capsys.readouterr().err  # refused before the model loads (tests/test_cli_campaign.py proves it)
    assert "whose model was loaded otherwise (dtype 'float32' there, 'bfloat16' now)" in err and work.exists()

    # SIGKILL during the resumed run: again no artifact, the work file stays readable.
    killed = _start_and_signal([*args, "--resume"], work, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists() and work.exists()

    assert main([*args, "--resume"]) == 0
    stdout = capsys.readouterr().out
    assert "resuming from" in stdout
    done_before = int(stdout.split("resuming from")[1].split("behaviour ")[1].split(" probes")[0])
    assert 1 <= done_before < NUM_PROBES  # it really was stopped mid-run
    assert not work.exists()

    got, got_config = _read(out)
    want, want_config = _read(reference)
    assert got.keys() == want.keys()
    for name in want:  # same order of float64 additions: bit-identical
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert got_config == want_config
    assert (want_config["profiler"]["dtype"], want_config["profiler"]["attn_implementation"]) == ("float32", "sdpa")


def test_interrupt_inside_a_forward_pass_resumes_exactly(model_dir, reference, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the query hooks run (mid-batch): the half-seen batch must not be counted."""
    out = tmp_path / "kv_calibration.h5"
    args = _args(model_dir, out, "--checkpoint-every", "1")
    calls = {"n": 0}
    original = QueryMoments.add

    def interrupted_add(self, layer, queries):
        calls["n"] += 1
        if calls["n"] == 7:  # 2 layers per batch: layer 0 of the 4th batch
            raise KeyboardInterrupt
        return original(self, layer, queries)

    monkeypatch.setattr(QueryMoments, "add", interrupted_add)
    assert main(args) == 130
    assert "--resume" in capsys.readouterr().err and not out.exists()
    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    done = "behaviour 12 probes, query-stats 3 batches, learned-scorer 0 windows done"
    assert done in capsys.readouterr().out
    got, _ = _read(out)
    want, _ = _read(reference)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_accelerate_two_processes_equal_single(model_dir, reference, tmp_path):
    out = tmp_path / "kv_calibration.h5"
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--cpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "-m",
        "profiler.cli",
        *_args(model_dir, out),
    ]
    result = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting 2 CPU worker processes" in result.stderr
    assert result.stdout.count("wrote ") == 1  # the main process alone writes
    got, got_config = _read(out)
    want, want_config = _read(reference)
    for name in want:
        if want[name].dtype.kind in "iuS":
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:  # float64 sums added in another order (the scorer's linear solve amplifies that ~1e3 times)
            rtol = 1e-6 if name.startswith("learned_scorer/") else 1e-9
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-12, err_msg=name)
    assert got_config["profiler"]["processes"] == 2 and want_config["profiler"]["processes"] == 1
    got_config.pop("profiler"), want_config.pop("profiler")
    assert got_config == want_config
    assert not list(tmp_path.glob("*.work*"))


def test_subset_of_stages_keeps_other_sections(model_dir, reference, tmp_path):
    out = tmp_path / "kv_calibration.h5"
    out.write_bytes(reference.read_bytes())
    assert main(_args(model_dir, out, "--stages", "budgets", "--budgets", "32,96", "--beta", "3")) == 0
    with open_artifact(out) as reader:
        budgets = reader.section("budgets")
        assert budgets.attrs["beta"] == 3.0 and budgets["token_budgets"].tolist() == [32, 96]
        assert reader.has("behaviour") and reader.has("query_stats")
        assert reader.config["budgets"]["beta"] == 3.0 and "behaviour" in reader.config


def test_moment_orders_are_calibrated_under_every_served_selector(model_dir, reference, tmp_path):
    """By default the moments stage measures the correction under the scorers of the flagship and of the
    recommendation candidates with +correction: leverage (first: order and errors), keydiff, and the
    learned scorer with the global allocation when the learned_scorer section is built or kept; the
    runtime then serves each of those policies its own orders without a warning."""
    from transformers import AutoModelForCausalLM

    from runtime import bind, load_calibration
    from runtime.plan.policy_spec import FLAGSHIP, parse_policy

    arrays, config = _read(reference)
    moments = config["moments"]
    assert moments["selections"] == ["leverage", "keydiff", "learned"] and moments["selection"] == "leverage"
    assert moments["allocations"] == ["uniform", "uniform", "global"] and moments["allocation"] == "uniform"
    assert arrays["moments/selections"].tolist() == [b"leverage", b"keydiff", b"learned"]
    assert arrays["moments/selection_allocations"].tolist() == [b"uniform", b"uniform", b"global"]
    keydiff = tmp_path / "kv_calibration.h5"
    keydiff.write_bytes(reference.read_bytes())
    assert main(_args(model_dir, keydiff, "--stages", "moments", "--moments-selection", "keydiff")) == 0
    again = tmp_path / "again.h5"
    again.write_bytes(keydiff.read_bytes())
    assert main(_args(model_dir, again, "--stages", "moments")) == 0  # the kept learned_scorer section decides
    got_keydiff, config_keydiff = _read(keydiff)
    got_again, config_again = _read(again)
    assert (
        config_keydiff["moments"]["selections"] == ["keydiff"] and config_keydiff["moments"]["selection"] == "keydiff"
    )
    assert config_again["moments"]["selections"] == ["leverage", "keydiff", "learned"]
    # keydiff alone measures what keydiff measured beside the others over the shared forward passes
    np.testing.assert_array_equal(got_keydiff["moments/errors"], arrays["moments/selection_errors"][1])
    for name in ("errors", "order", "selection_orders", "selection_errors"):
        np.testing.assert_array_equal(got_again[f"moments/{name}"], arrays[f"moments/{name}"])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    calibration = load_calibration(model, path=again)
    served = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for text in ("inf/keydiff+correction", "global/learned+correction"):
            served[text] = bind(parse_policy(text).policy(0.75), calibration, model).corrections[0]
        served["flagship"] = bind(FLAGSHIP.policy(0.75), calibration, model).corrections[0]
    for index, text in enumerate(("flagship", "inf/keydiff+correction", "global/learned+correction")):
        np.testing.assert_array_equal(served[text], arrays["moments/selection_orders"][index])
    with pytest.warns(UserWarning, match="snapkv"):
        calibration.check_moment_selection("snapkv")


def test_cli_errors_are_clear(model_dir, tmp_path, capsys):
    assert main(_args(model_dir, tmp_path / "x.h5", "--stages", "budgets")) == 2
    captured = capsys.readouterr()
    assert "the budgets stage needs INFsc, from the section(s) behaviour" in captured.err
    assert "loaded in" not in captured.out  # refused before the model loads
    assert main(_args(model_dir, tmp_path / "x.h5", "--stages", "moments", "--moments-selection", "learned")) == 2
    assert "the moments stage needs the learned scorer's weights" in capsys.readouterr().err
    assert not (tmp_path / "x.h5").exists()
    assert main([str(tmp_path), "--out", str(tmp_path / "y.h5")]) == 2
    assert "not a model directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--stages", "behaviour,sudoku"])


def test_learned_scorer_fits_on_probe_contexts_too(model_dir, tmp_path):
    """--scorer-probes N adds the N shortest probes' contexts (R spans as positives) to the fit."""
    plain, with_probes = tmp_path / "plain.h5", tmp_path / "probes.h5"
    assert main(_args(model_dir, plain, "--stages", "learned-scorer")) == 0
    assert main(_args(model_dir, with_probes, "--stages", "learned-scorer", "--scorer-probes", "3")) == 0
    with open_artifact(plain) as a, open_artifact(with_probes) as b:
        assert "probes" not in a.config["learned_scorer"]
        assert b.config["learned_scorer"]["probes"]["ids"] == ["p0", "p1", "p2"]  # the shortest three
        extra = b.section("learned_scorer").attrs["fit_tokens"] - a.section("learned_scorer").attrs["fit_tokens"]
        assert extra == (48 - 6) + (52 - 6) + (56 - 6)  # their context tokens (context_end = n - 6)
        assert not np.array_equal(a.section("learned_scorer")["weights"], b.section("learned_scorer")["weights"])
    with pytest.raises(SystemExit) as refused:  # a parser error (exit 2) before any model work
        main(_args(model_dir, tmp_path / "x.h5", "--stages", "learned-scorer", "--scorer-probes", "-1"))
    assert refused.value.code == 2


def test_hub_id_round_trip_profile_then_serve(model_dir, tmp_path):
    """`profile-model ORG/NAME` without --out, then `load_calibration(load_model("ORG/NAME"))`,
    both offline from a local hub cache: the artifact goes to kvcal's cache and is found there."""
    snapshot = tmp_path / "hub" / "models--some-org--tiny-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():  # the model and tokenizer files, as a hub snapshot holds them
        if file.is_file() and file.name not in ("probes.jsonl", "calib.txt"):
            (snapshot / file.name).write_bytes(file.read_bytes())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    env = {
        **_env(),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
    }
    args = _args(model_dir, tmp_path / "unused.h5")
    args = ["some-org/tiny-model", *args[3:]]  # no model dir, no --out
    done = subprocess.run(
        [sys.executable, "-m", "profiler.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    expected = tmp_path / "xdg" / "kvcal" / "artifacts" / "some-org--tiny-model" / "kv_calibration.h5"
    assert expected.is_file() and not (tmp_path / "kv_calibration.h5").exists()
    serve = (
        "from runtime import load_calibration; from common.models import load_model, load_tokenizer; "
        "m = load_model('some-org/tiny-model'); t = load_tokenizer('some-org/tiny-model'); "
        "print(load_calibration(m, t).path)"
    )
    served = subprocess.run(
        [sys.executable, "-c", serve], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert served.returncode == 0, served.stderr
    assert served.stdout.strip().splitlines()[-1] == str(expected)
