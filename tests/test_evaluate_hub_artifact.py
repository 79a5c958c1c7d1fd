"""evaluate-artifact with a hub model id and no ``--artifact`` (issue 30): the artifact's places
(the hub snapshot, kvcal's cache: ``runtime.plan.calibration.artifact_locations``) depend on the model
id alone, so the artifact is found, read and checked, or its absence reported, before the model
loads.  The hub id is served offline from a hub cache in tmp_path holding the embedded model's
``config.json`` only: a run that began loading weights or a tokenizer would fail differently, and a
tripwire on the shared loader (as in tests/test_cli_campaign.py) says so by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HUB_ID = "some-org/tiny-model"

# evaluate-artifact's main with a tripwire on the loader: a model or tokenizer load exits 99
RUN = """
import sys
import common.models
original = common.models._from_pretrained
def tripwire(auto_class, model, **kwargs):
    if auto_class.__name__ != "AutoConfig":
        print(f"began loading {auto_class.__name__} {model}", file=sys.stderr)
        sys.exit(99)
    return original(auto_class, model, **kwargs)
common.models._from_pretrained = tripwire
from profiler.evaluate_cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def hub_env(tmp_path) -> dict[str, str]:
    """An offline hub cache holding ``some-org/tiny-model``'s config.json (the embedded model's), and
    an empty kvcal cache (XDG_CACHE_HOME)."""
    from common.models import embedded_model_dir

    snapshot = tmp_path / "hub" / "models--some-org--tiny-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(Path(embedded_model_dir()) / "config.json", snapshot / "config.json")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    return {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_HUB_OFFLINE": "1",
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "OMP_NUM_THREADS": "1",
    }


def _evaluate(env, tmp_path, *args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", RUN, HUB_ID, "--preset", "smoke", "--no-progress", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _cached_artifact(tmp_path) -> Path:
    return tmp_path / "xdg" / "kvcal" / "artifacts" / "some-org--tiny-model" / "kv_calibration.h5"


def test_no_artifact_for_a_hub_id_is_reported_before_the_model_loads(hub_env, tmp_path):
    done = _evaluate(hub_env, tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "began loading" not in done.stderr, done.stderr
    assert "no kv_calibration.h5 found" in lines[0] and str(_cached_artifact(tmp_path)) in lines[0], lines[0]


def test_the_artifact_in_kvcals_cache_is_read_and_checked_before_the_model_loads(hub_env, tmp_path, smoke_artifact):
    """The embedded model's smoke artifact (conftest's ``smoke_run``) in kvcal's cache, under the hub
    id's name."""
    cached = _cached_artifact(tmp_path)
    cached.parent.mkdir(parents=True)
    shutil.copy(smoke_artifact, cached)
    before = cached.read_bytes()
    # a combination only the artifact's sections can refuse: a policy whose section it lacks is
    # refused once the artifact is read, and --write-recommendation with only the baseline
    done = _evaluate(hub_env, tmp_path, "--policies", "baseline", "--write-recommendation")
    assert done.returncode == 2 and "began loading" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "--write-recommendation needs" in done.stderr
    assert cached.read_bytes() == before
