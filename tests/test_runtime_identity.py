"""Identity checks that survive the dtype a checkpoint is loaded in.

An artifact profiled from a float32 checkpoint is accepted by float32, bfloat16 and float16
loads of that checkpoint, and refused by a checkpoint with one weight changed.
"""

from __future__ import annotations

import dataclasses
import json

import h5py
import numpy as np
import pytest
import torch
from conftest import make_tiny_llama

from artifacts import Artifact, ArtifactError, Section, open_artifact, write_artifact
from artifacts.fingerprint import FINGERPRINT_DTYPES, model_identity, serving_dtype, weights_fingerprint
from artifacts.schema import SCHEMA_VERSION, canonical_json
from common.models import load_model
from runtime import load_calibration

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _moments_section(identity) -> Section:
    L, Hkv = identity.num_layers, identity.num_kv_heads
    return Section(
        {
            "order": np.zeros((L, Hkv), np.int8),
            "errors": np.ones((1, 3, L, Hkv)),
            "reference_ratios": np.array([0.5]),
            "tau": np.zeros((L, Hkv)),
        }
    )


def _write(path, identity):
    return write_artifact(path, Artifact(model=identity, config={}, sections={"moments": _moments_section(identity)}))


@pytest.fixture(scope="module")
def fp32_artifact(embedded_model, embedded_tokenizer, tmp_path_factory):
    """An artifact profiled (identity taken) from the float32 embedded model."""
    identity = model_identity(embedded_model, embedded_tokenizer, "embedded")
    return _write(tmp_path_factory.mktemp("identity") / "kv_calibration.h5", identity)


# -- unit: tiny random-weight model -------------------------------------------------------------


def test_profile_records_one_fingerprint_per_serving_dtype(embedded_tokenizer):
    model = make_tiny_llama(seed=3)
    identity = model_identity(model, embedded_tokenizer, "tiny")
    entries = identity.dtype_fingerprints()
    assert set(entries) == set(FINGERPRINT_DTYPES) == {"float32", "bfloat16", "float16"}
    assert entries["float32"] == identity.weights_fingerprint == weights_fingerprint(model)
    for name in ("bfloat16", "float16"):
        dtype = getattr(torch, name)
        cast = make_tiny_llama(seed=3).to(dtype)  # the same rounding transformers applies on load
        assert serving_dtype(cast) == name
        assert weights_fingerprint(cast, name) == entries[name]
        assert weights_fingerprint(cast) != entries["float32"]  # rounded values: the float32 view differs
    assert serving_dtype(model) == "float32"


def test_bf16_checkpoint_served_in_float32_matches_the_float32_entry(tmp_path, embedded_tokenizer):
    bf16 = make_tiny_llama(seed=5).to(torch.bfloat16)
    entries = model_identity(bf16, embedded_tokenizer, "tiny").dtype_fingerprints()
    assert entries["float32"] == entries["bfloat16"]  # the up-cast is exact
    path = _write(tmp_path / "a.h5", model_identity(bf16, embedded_tokenizer, "tiny"))
    load_calibration(bf16, path=path)
    load_calibration(make_tiny_llama(seed=5).to(torch.bfloat16).to(torch.float32), path=path)


# -- the real embedded model ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp32_artifact_is_accepted_by_every_dtype_load_of_the_checkpoint(
    fp32_artifact, embedded_tokenizer, dtype, recwarn
):
    model = load_model(dtype=dtype)
    assert next(model.parameters()).dtype == dtype
    calibration = load_calibration(model, embedded_tokenizer, path=fp32_artifact)
    assert calibration.moment_orders.shape == (30, 3)
    assert not [w for w in recwarn if "fingerprint" in str(w.message)]


def test_one_changed_weight_is_refused_in_bf16_and_fp32(fp32_artifact, embedded_tokenizer):
    bf16 = load_model(dtype=torch.bfloat16)
    load_calibration(bf16, embedded_tokenizer, path=fp32_artifact)
    with torch.no_grad():
        weight = bf16.model.layers[7].mlp.down_proj.weight
        weight[11, 13] = weight[11, 13] * 1.5 + 0.01  # survives bf16 rounding
    with pytest.raises(ArtifactError, match="different weights"):
        load_calibration(bf16, embedded_tokenizer, path=fp32_artifact)

    fp32 = load_model(dtype=torch.float32)
    load_calibration(fp32, embedded_tokenizer, path=fp32_artifact)
    with torch.no_grad():
        weight = fp32.model.layers[7].mlp.down_proj.weight
        before = weight[11, 13].clone()
        weight[11, 13] = torch.nextafter(before, torch.tensor(float("inf")))  # one float32 ulp
        assert weight[11, 13].to(torch.bfloat16) == before.to(torch.bfloat16)  # invisible in bf16
    with pytest.raises(ArtifactError, match="different weights"):
        load_calibration(fp32, embedded_tokenizer, path=fp32_artifact)


# -- older artifacts -----------------------------------------------------------------------------


def test_schema_1_1_artifact_without_dtype_fingerprints_still_loads(tmp_path, embedded_tokenizer):
    model = make_tiny_llama(seed=2)
    identity = model_identity(model, embedded_tokenizer, "tiny")
    old = dataclasses.replace(identity, weights_fingerprints="")
    path = _write(tmp_path / "old.h5", old)
    with h5py.File(path, "r+") as h5:
        assert "weights_fingerprints" not in h5["model"].attrs
        h5.attrs["schema_version"] = "1.1"
    with open_artifact(path) as reader:
        assert reader.model.weights_fingerprints == "" and reader.model.dtype_fingerprints() == {}
    load_calibration(model, path=path)  # the single float32 fingerprint, compared as before
    with pytest.raises(ArtifactError, match="different weights"):
        load_calibration(make_tiny_llama(seed=2).to(torch.bfloat16), path=path)


def test_dtype_fingerprints_are_protected_by_the_extended_digest(tmp_path, embedded_tokenizer):
    model = make_tiny_llama(seed=2)
    path = _write(tmp_path / "a.h5", model_identity(model, embedded_tokenizer, "tiny"))
    with open_artifact(path) as reader:
        assert reader.schema_version == SCHEMA_VERSION  # 1.2 added the fingerprints; files are written as the newest
        assert reader.model.dtype_fingerprints()["float32"] == reader.model.weights_fingerprint
    with h5py.File(path, "r+") as h5:
        entries = json.loads(h5["model"].attrs["weights_fingerprints"])
        entries["bfloat16"] = "0" * 64
        h5["model"].attrs["weights_fingerprints"] = canonical_json(entries)
    with pytest.raises(ArtifactError, match="metadata checksum mismatch"):
        open_artifact(path)
