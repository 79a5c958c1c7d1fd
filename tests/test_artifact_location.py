"""Where profile-model writes the artifact by default and where load_calibration looks.

Both sides derive the place from the model source (a loaded model's ``name_or_path``) with the
same functions (``runtime.plan.calibration``), so a model profiled from a hub id or a read-only
directory is found again when served: next to the weights when that directory is writable,
else in kvcal's cache, ``$XDG_CACHE_HOME/kvcal/artifacts/<key>/kv_calibration.h5``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import make_tiny_llama

from artifacts import ARTIFACT_FILENAME, Artifact, ArtifactError, Section, write_artifact
from artifacts.fingerprint import model_identity
from profiler.job import default_output
from runtime import load_calibration
from runtime.plan.calibration import artifact_cache_path, artifact_locations, default_artifact_path, find_artifact

HUB_ID = "some-org/tiny-model"  # not a local directory (the tests run in a fresh tmp cwd)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty XDG cache, and a cwd without a directory named like the hub id."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return tmp_path / "xdg" / "kvcal" / "artifacts"


def _write(path, model, tokenizer):
    identity = model_identity(model, tokenizer, "tiny")
    L, Hkv = identity.num_layers, identity.num_kv_heads
    moments = Section(
        {
            "order": np.zeros((L, Hkv), np.int8),
            "errors": np.ones((1, 3, L, Hkv)),
            "reference_ratios": np.array([0.5]),
            "tau": np.zeros((L, Hkv)),
        }
    )
    return write_artifact(path, Artifact(model=identity, config={}, sections={"moments": moments}))


def test_a_hub_id_has_one_place_in_the_kvcal_cache(cache):
    expected = cache / "some-org--tiny-model" / ARTIFACT_FILENAME
    assert artifact_cache_path(HUB_ID) == expected
    assert default_artifact_path(HUB_ID) == expected
    assert default_output(HUB_ID) == expected  # profile-model's default --out
    assert artifact_cache_path("gpt2") == cache / "gpt2" / ARTIFACT_FILENAME
    assert artifact_locations(HUB_ID)[-1] == expected
    for not_an_id in ("../escape", "a/b/c", "org/..", "", "/abs/missing/dir"):
        assert artifact_cache_path(not_an_id) is None, not_an_id


def test_find_artifact_for_a_model_loaded_from_a_hub_id(cache, embedded_tokenizer):
    model = make_tiny_llama(seed=1)
    model.config._name_or_path = model.name_or_path = HUB_ID  # what from_pretrained(HUB_ID) records
    assert model.name_or_path == HUB_ID
    place = cache / "some-org--tiny-model" / ARTIFACT_FILENAME
    with pytest.raises(ArtifactError, match="no kv_calibration.h5 found") as error:
        load_calibration(model)
    assert str(place) in str(error.value)  # every place looked at is named
    _write(place, model, embedded_tokenizer)
    assert find_artifact(model) == place
    assert load_calibration(model, embedded_tokenizer).path == place


def test_local_directory_writable_and_read_only(cache, tmp_path, embedded_tokenizer, monkeypatch):
    directory = tmp_path / "model"
    make_tiny_llama(seed=2).save_pretrained(directory)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    next_to_weights = directory / ARTIFACT_FILENAME
    assert default_output(str(directory)) == next_to_weights
    assert artifact_locations(str(directory))[0] == next_to_weights

    # A directory the user cannot write (root can write anywhere, so the check is made to say no).
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: False if str(path) == str(directory) else real_access(path, mode, **kw)
    )
    out = default_output(str(directory))
    assert out.parent.parent == cache / "local" and out.parent.name.startswith("model-")
    assert artifact_locations(str(directory)) == [next_to_weights, out]
    _write(out, model, embedded_tokenizer)
    assert load_calibration(model, embedded_tokenizer).path == out
    # the same directory named by another (relative) path resolves to the same place
    monkeypatch.chdir(directory.parent)
    assert default_artifact_path("model") == out == artifact_cache_path("./model/")
