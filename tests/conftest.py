"""Shared fixtures: the real embedded model (loaded once per session) and tiny random models."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

# Each command and the module that holds its main() and build_parser().
COMMAND_MODULES = {
    "profile-model": "profiler.cli",
    "evaluate-artifact": "profiler.evaluate_cli",
    "inspect-artifact": "artifacts.cli",
    "generate-probes": "needles.cli",
}


@contextlib.contextmanager
def single_thread():
    """One torch intra-op thread inside the block, the previous count restored after.

    On a shared 2-core machine two threads spin against other processes, and the many small
    per-head operations of the ragged cache wait on each other: one thread is several times
    faster.  Results do not depend on it (float32 sums may differ in the last bits).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """The test runs on one torch thread (see ``single_thread``)."""
    with single_thread():
        yield


@pytest.fixture(scope="session")
def embedded_model():
    """The real embedded SmolLM2-135M-Instruct, float32, eval mode (converted on first use)."""
    from common.models import load_model

    return load_model()


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from common.models import load_tokenizer

    return load_tokenizer()


def make_tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, seed=0, **overrides):
    """A random-weight Llama built in-process: fast, deterministic per seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=2 * num_heads * head_dim,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        **overrides,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()
    return model


def write_tiny_model_dir(directory, tokenizer, *, probes: int = 12, seed: int = 7, model=None, probe_length=48):
    """A profile-able model directory in seconds: a tiny random Llama (or ``model``) with ``tokenizer``
    (saved beside it), ``probes`` hand-built probes (``probes.jsonl``, ``probe_length``, + 4 each)
    and a calibration text (``calib.txt``)."""
    import random

    from needles.probe import Probe, Span

    if model is None:
        model = make_tiny_llama(
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=len(tokenizer), seed=seed
        )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    rng = random.Random(0)
    with open(directory / "probes.jsonl", "w") as fh:
        for i in range(probes):
            n = probe_length + 4 * i
            ids = [rng.randrange(100, 40000) for _ in range(n)]
            spans = [Span("R", 10, 13), Span("B", 20, 22), Span("D", 30, 34)]
            probe = Probe(f"p{i}", "hand", n, 25.0 + i, i, "q?", "zebra", ids, spans, context_end=n - 6)
            fh.write(probe.to_json() + "\n")
    (directory / "calib.txt").write_text("A heron waited by the mill pond while the barges passed. " * 150)
    return directory


def profile_env() -> dict:
    """The environment of a profile-model child: this checkout on the path, one thread."""
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": repo, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


class ModelLoadAttempted(BaseException):
    """Raised by :func:`forbid_model_loading`'s tripwire: a command began loading a model or a tokenizer
    (a ``BaseException``, which no command catches)."""


def forbid_model_loading(monkeypatch) -> None:
    """Replace the loader every command shares (``common.models._from_pretrained``) by a tripwire that
    raises :class:`ModelLoadAttempted` for anything but a config (``monkeypatch`` restores it)."""
    import common.models

    original = common.models._from_pretrained

    def tripwire(auto_class, model, **kwargs):
        if auto_class.__name__ != "AutoConfig":
            raise ModelLoadAttempted(f"{auto_class.__name__}.from_pretrained({model})")
        return original(auto_class, model, **kwargs)

    monkeypatch.setattr(common.models, "_from_pretrained", tripwire)


def kill_evaluation_after_its_first_task(arguments: list[str], journal) -> None:
    """Run ``evaluate-artifact ARGUMENTS`` in a child and SIGKILL it once its journal ``journal``
    records a task (the header and one line), within 300 s."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    child = subprocess.Popen(
        [sys.executable, "-m", "profiler.evaluate_cli", *arguments],
        cwd=Path(__file__).resolve().parents[1],
        env=profile_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 300
    while not (journal.exists() and journal.read_bytes().count(b"\n") >= 2):  # the header and one task
        assert child.poll() is None, child.communicate()
        assert time.time() < deadline, "no task recorded within 300 s"
        time.sleep(0.01)
    child.kill()
    child.communicate()


def start_profile(args: list[str], wait_for):
    """Start ``profile-model ARGS`` in a child; return the Popen once ``wait_for`` exists (e.g. its
    first checkpoint).  A runner started in the background (CI) may pass SIGINT on as *ignored*,
    which Python keeps; the child gets the default disposition so Ctrl-C reaches it as a user's."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    proc = subprocess.Popen(
        [sys.executable, "-m", "profiler.cli", *args],
        cwd=Path(__file__).resolve().parents[1],
        env=profile_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while not wait_for.exists():
        assert proc.poll() is None, f"run ended before {wait_for.name} appeared: {proc.communicate()}"
        assert time.time() < deadline, f"no {wait_for.name} within 120 s"
        time.sleep(0.02)
    return proc


def tiny_profile_args(model_dir, out, *extra: str, calib_samples: int = 8) -> list[str]:
    """``profile-model`` arguments for a :func:`write_tiny_model_dir` model (smoke preset, seconds)."""
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
        str(calib_samples),
        "--batch-size",
        "1",
        "--max-new-tokens",
        "5",
        "--no-progress",
        *extra,
    ]


def profile_every_stage(model, directory, tokenizer, capsys, *, probe_length: int = 96):
    """The path of an artifact of every stage of a smoke profile (retrieval probes, simple haystacks) on ``model``
    saved with ``tokenizer`` in ``directory`` (:func:`write_tiny_model_dir`, 3 probes), the command's exit checked;
    the model directory is ``directory / "model"``."""
    from profiler.cli import main
    from profiler.stages import STAGE_NAMES

    model_dir = write_tiny_model_dir(directory / "model", tokenizer, probes=3, model=model, probe_length=probe_length)
    out = directory / "kv_calibration.h5"
    families = ("--recommend-families", "retrieval", "--recommend-haystacks", "simple")
    with single_thread():
        code = main(tiny_profile_args(model_dir, out, "--stages", ",".join(STAGE_NAMES), *families, calib_samples=4))
    assert code == 0, capsys.readouterr().err
    return out


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


def make_random_identity(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, name="random"):
    """A ModelIdentity with the given shapes, its architecture fingerprint computed from them (a
    reader recomputes it) and made-up weights and tokenizer fingerprints (no model needed)."""
    from artifacts import ModelIdentity
    from artifacts.fingerprint import architecture_fingerprint

    numbers = dict(
        model_type="llama",
        num_layers=num_layers,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=num_q_heads * head_dim,
        vocab_size=1000,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rope_parameters='{"rope_theta":10000.0,"rope_type":"default"}',
    )
    return ModelIdentity(
        name=name,
        **numbers,
        query_norm=False,
        arch_fingerprint=architecture_fingerprint(numbers, False),
        weights_fingerprint="b" * 64,
        tokenizer_fingerprint="c" * 64,
    )


def make_random_artifact(
    identity=None,
    *,
    seed=0,
    probes=7,
    sections=(
        "behaviour",
        "query_stats",
        "future_queries",
        "budgets",
        "moments",
        "learned_scorer",
        "recommendation",
        "budget_curves",
    ),
):
    """An Artifact with every requested section filled with valid random values."""
    import numpy as np

    from artifacts import Artifact, Section

    identity = identity or make_random_identity()
    L, Hq, Hkv, d = identity.num_layers, identity.num_q_heads, identity.num_kv_heads, identity.head_dim
    rng = np.random.default_rng(seed)
    built = {}
    if "behaviour" in sections:
        w = {f"W_{k}": rng.random((L, Hq)) * 10 for k in "RBDW"}
        rng.random((L, Hq)), rng.random((L, Hq))  # drawn as before, so that the later sections stay the same
        ra, lc = w["W_R"] / (w["W_R"] + w["W_D"]), w["W_R"] / (w["W_R"] + w["W_B"])  # REAL Eq. 1-2
        built["behaviour"] = Section(
            {
                **w,
                "steps": rng.integers(0, 100, (L, Hq)),
                "RAsc": ra,
                "LCsc": lc,
                "INFsc": 2 * ra * lc / (ra + lc),
                "probe_length": rng.integers(100, 8000, probes),
                "probe_depth": rng.random(probes) * 100,
                "probe_seed": rng.integers(0, 2**40, probes),
                "probe_family": np.array([b"retrieval", b"multi_key"] * probes, dtype="S64")[:probes],
                "probe_success": rng.integers(0, 2, probes).astype(np.uint8),
                "probe_steps": rng.integers(1, 20, probes),
            }
        )
    if "query_stats" in sections:
        a = rng.standard_normal((L, Hq, d, d)).astype(np.float32)
        built["query_stats"] = Section(
            {
                "n": rng.integers(1, 10**6, (L, Hq)),
                "mean": rng.standard_normal((L, Hq, d)).astype(np.float32),
                "cov": (a @ a.transpose(0, 1, 3, 2) / d).astype(np.float32),
            },
            {"n_sink": 4},
        )
    if "future_queries" in sections:
        a = rng.standard_normal((L, Hq, d, d)).astype(np.float32)
        weights = rng.random((L, Hq, 3)) + 0.1
        built["future_queries"] = Section(
            {
                "n": rng.integers(1, 10**4, (L, Hq)),
                "mean": rng.standard_normal((L, Hq, d)).astype(np.float32),
                "cov": (a @ a.transpose(0, 1, 3, 2) / d).astype(np.float32),
                "centres": rng.standard_normal((L, Hq, 3, d)).astype(np.float32),
                "centre_weights": weights / weights.sum(-1, keepdims=True),
            }
        )
    if "budgets" in sections:
        from common.formulas import ideal_budgets
        from runtime.plan.budgets import allocate_budgets

        inf_kv = rng.random((L, Hkv))
        inf_kv /= inf_kv.sum()
        tokens = np.array([64, 128, 256])
        ratios = np.array([0.1, 0.5, 0.9])
        built["budgets"] = Section(
            {
                "inf_kv": inf_kv,
                "token_budgets": tokens,
                "token_tables": np.stack([allocate_budgets(inf_kv, t, 8192) for t in tokens]),
                "ratios": ratios,
                "ratio_tables": np.stack([ideal_budgets(inf_kv, r, 2.0) for r in ratios]),
            },
            {"beta": 2.0, "min_budget": 1},
        )
    if "moments" in sections:
        orders = rng.integers(-1, 2, (2, L, Hkv)).astype(np.int8)  # [S, L, Hkv]: leverage, keydiff
        errors = rng.random((2, 2, 3, L, Hkv))  # [S, R, 3, L, Hkv]
        built["moments"] = Section(
            {
                "order": orders[0].copy(),
                "errors": errors[0].copy(),
                "reference_ratios": np.array([0.25, 0.5]),
                "tau": rng.random((L, Hkv)) * 1e-3,
                "selections": np.array([b"leverage", b"keydiff"], dtype="S128"),
                "selection_allocations": np.array([b"uniform", b"uniform"], dtype="S128"),
                "selection_orders": orders,
                "selection_errors": errors,
            }
        )
    if "learned_scorer" in sections:
        built["learned_scorer"] = Section(
            {
                "weights": rng.standard_normal((L, Hkv, 2 * d)),
                "bias": rng.standard_normal((L, Hkv)),
                "ridge": np.full((L, Hkv), 0.01),
                "r2": rng.random((L, Hkv)),
                "rank_correlation": rng.random((L, Hkv)),
            },
            {"features": "kv", "teacher": "kvzip", "fit_tokens": 4096, "held_out_tokens": 1024},
        )
    if "recommendation" in sections:
        from profiler.recommendation import recommendation_section

        # candidates the file can serve, cheapest first; the flagship (the rule's reference) when it can
        inf = "budgets" in sections or "behaviour" in sections
        candidates = ["uniform/keydiff", "inf/keydiff+correction", "inf/leverage+correction"]
        if not (inf and "moments" in sections):
            candidates = ["uniform/keydiff", "inf/leverage"] if inf else ["uniform/keydiff", "uniform/leverage"]
        ratios = (0.5, 0.75, 0.9)
        outcomes = rng.integers(0, 2, (len(ratios), len(candidates), 12))  # [ratio, candidate, task]
        evaluation = {
            "task_ids": [f"retrieval-L1024-D50-S7-R{i}" for i in range(12)],
            "baseline": {"outcomes": rng.integers(0, 2, 12).tolist()},
            "results": [
                {"policy": name, "compression_ratio": ratio, "outcomes": outcomes[r, c].tolist()}
                for r, ratio in enumerate(ratios)
                for c, name in enumerate(candidates)
            ],
        }
        built["recommendation"] = recommendation_section(evaluation, candidates, 1_000_003, "retrieval,multi_key")
    if "budget_curves" in sections:
        grid = np.array([0.05, 0.1, 0.3, 1.0])
        ratios = np.array([0.5, 0.75, 0.9])
        error = np.sort(rng.random((4, L, Hkv)), axis=0)[::-1] * np.array([1.0, 1.0, 1.0, 0.0])[:, None, None]
        weights = rng.random((L, Hkv)) * 0.5 + 0.5
        shares = weights / weights.sum() * L * Hkv  # mean 1, at most 2: every fraction <= 1
        fractions = np.stack([(1 - r) * shares for r in ratios])  # row r sums to (1 - r) L Hkv, all <= 1
        built["budget_curves"] = Section(
            {
                "compression_ratios": ratios,
                "fractions": fractions,
                "grid": grid,
                "output_error": error,
                "retention_loss": error * 0.1,
                "loss": error * 1.1,
            },
        )
    config = {"preset": "test", "seed": seed}
    if "budget_curves" in built:  # the stage's settings, which the section does not repeat
        config["budget_curves"] = {
            "selection": "keydiff",
            "floor": 0.25,
            "retention_weight": 1.0,
            "probes": 7,
            "windows": 4,
        }
    return Artifact(model=identity, config=config, sections=built)


def _smoke_stages() -> str:
    """Every stage of the smoke profile but the recommendation (which needs held-out tasks), opt-in ones too."""
    from profiler.stages import STAGE_NAMES

    return ",".join(name for name in STAGE_NAMES if name != "recommendation")


def _smoke_profile(out) -> str:
    """Run `profile-model --preset smoke` into ``out``; its stdout."""
    import io

    from profiler.cli import main

    printed = io.StringIO()
    with single_thread(), contextlib.redirect_stdout(printed):
        assert main(["--preset", "smoke", "--out", str(out), "--no-progress", "--stages", _smoke_stages()]) == 0
    return printed.getvalue()


def _shared_smoke_directory(config):
    """Where the workers of one pytest-xdist run share the smoke profile (this run's temporary directory, all
    workers'), or None outside xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    return config._tmp_path_factory.getbasetemp().parent / "smoke_artifact"


def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist, start the smoke profile (``smoke_run``) in a child process as soon as a worker has
    collected a test that needs it, so that no worker idles on a lock while another runs it in-process: the
    workers run the other tests meanwhile, which come first.  The first worker to get here starts it; the child
    writes its stdout and stderr beside the artifact, then its exit status (``status``, written last, whole)."""
    shared = _shared_smoke_directory(config)
    needing = [item for item in items if "smoke_run" in item.fixturenames]
    if shared is None or not needing:
        return
    # the tests that need it last (in collection order otherwise, the same in every worker, as xdist requires):
    # each worker's first tests, and its first minute, go to the others
    items[:] = [item for item in items if "smoke_run" not in item.fixturenames] + needing
    import shlex
    import subprocess
    import sys

    from filelock import FileLock

    with FileLock(f"{shared}.lock"):
        if shared.exists():
            return
        shared.mkdir()
        command = [sys.executable, "-m", "profiler.cli", "--preset", "smoke", "--out", "kv_calibration.h5"]
        command = shlex.join([*command, "--no-progress", "--stages", _smoke_stages()])
        script = f"{command} > stdout.txt 2> stderr.txt; echo $? > status.partial; mv status.partial status"
        config._smoke_child = subprocess.Popen(["sh", "-c", script], env=profile_env(), cwd=shared)


def pytest_sessionfinish(session, exitstatus):
    """A smoke profile this worker started: waited for (another worker may still need it), or stopped when the
    run was interrupted or stopped early (``-x``)."""
    child = getattr(session.config, "_smoke_child", None)
    if child is None:
        return
    if child.poll() is None and (exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop):
        child.kill()
    child.wait()


def _wait_for_shared_smoke(shared) -> tuple:
    """The artifact and stdout of the smoke profile a worker started (``pytest_collection_modifyitems``), once
    its child has ended; the test fails with the child's stderr if it did not succeed."""
    import time

    status = shared / "status"
    deadline = time.monotonic() + 1800
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the smoke profile in {shared} did not end within 30 minutes")
        time.sleep(0.2)
    code = status.read_text().strip()
    if code != "0":
        pytest.fail(f"profile-model --preset smoke exited {code}: {(shared / 'stderr.txt').read_text()[-4000:]}")
    return shared / "kv_calibration.h5", (shared / "stdout.txt").read_text()


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, request):
    """`profile-model --preset smoke` on the embedded model, run once per test run: (path, stdout).
    Under pytest-xdist the workers share it: a child process started after collection
    (``pytest_collection_modifyitems``) runs it while the workers run other tests; outside xdist it runs
    here, in-process."""
    shared = _shared_smoke_directory(request.config)
    if shared is None:
        out = tmp_path_factory.mktemp("smoke_artifact") / "kv_calibration.h5"
        return out, _smoke_profile(out)
    return _wait_for_shared_smoke(shared)


@pytest.fixture(scope="session")
def smoke_artifact(smoke_run):
    """The path of the real smoke artifact (see ``smoke_run``)."""
    return smoke_run[0]
