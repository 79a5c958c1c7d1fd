"""The HDF5 calibration artifact: round trips, corruption, unsafe files, atomic writes, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import make_random_artifact, make_random_identity

from artifacts import SECTIONS, ArtifactError, Section, open_artifact, write_artifact
from artifacts.cli import main as inspect_main
from artifacts.schema import SCHEMA_VERSION

SHAPES = {
    "embedded": dict(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64),
    "32-layer GQA": dict(num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128),
}


@pytest.fixture
def artifact_path(tmp_path):
    path = tmp_path / "kv_calibration.h5"
    write_artifact(path, make_random_artifact())
    return path


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_round_trip_is_bit_identical(tmp_path, shape):
    artifact = make_random_artifact(make_random_identity(**SHAPES[shape]))
    path = write_artifact(tmp_path / "a.h5", artifact)
    with open_artifact(path) as reader:
        assert reader.model == artifact.model
        assert reader.config == artifact.config
        assert set(reader.sections) == set(SECTIONS)
        for name, section in artifact.sections.items():
            loaded = reader.section(name)
            assert loaded.attrs == section.attrs
            for key, array in section.arrays.items():
                expected = np.asarray(array).astype(SECTIONS[name].datasets[key].dtype)
                got = loaded[key]
                assert got.dtype == expected.dtype and got.shape == expected.shape
                assert got.tobytes() == expected.tobytes(), f"{name}/{key} changed"


def test_every_dataset_is_compressed_and_checksummed(artifact_path):
    with h5py.File(artifact_path) as h5:
        for section in SECTIONS:
            for name in SECTIONS[section].datasets:
                dset = h5[section][name]
                assert dset.fletcher32 and dset.compression == "gzip", dset.name


def test_sections_are_optional_and_missing_ones_are_named(tmp_path):
    path = write_artifact(tmp_path / "a.h5", make_random_artifact(sections=("behaviour",)))
    with open_artifact(path) as reader:
        assert reader.sections == ("behaviour",)
        with pytest.raises(ArtifactError, match="no 'query_stats' section.*calibrated statistics"):
            reader.require("query_stats", needed_for="calibrated statistics")


def test_reading_needs_neither_torch_nor_a_model(artifact_path):
    code = (
        "import sys; from artifacts import open_artifact; "
        f"r = open_artifact({str(artifact_path)!r}); r.validate(); "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- corruption ----------------------------------------------------------------------------


def _assert_invalid(path, match):
    """Both the API and the CLI refuse the file with a clear message."""
    with pytest.raises(ArtifactError, match=match):
        with open_artifact(path) as reader:
            reader.validate()
    assert inspect_main([str(path)]) == 2


def test_flipped_bytes_inside_a_dataset(artifact_path, capsys):
    with h5py.File(artifact_path) as h5:
        info = h5["query_stats/cov"].id.get_chunk_info(0)
    with open(artifact_path, "r+b") as fh:
        fh.seek(info.byte_offset + info.size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    _assert_invalid(artifact_path, "query_stats/cov cannot be read intact")
    assert "invalid artifact" in capsys.readouterr().err


def test_truncated_file(artifact_path):
    size = artifact_path.stat().st_size
    with open(artifact_path, "r+b") as fh:
        fh.truncate(size // 2)
    _assert_invalid(artifact_path, "not a readable HDF5 file|damaged|cannot be read")


def test_missing_required_dataset(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        del h5["behaviour/INFsc"]
    _assert_invalid(artifact_path, "required dataset 'INFsc' is missing")


def test_nan_value(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["query_stats/mean"][3, 2, 1] = np.nan
    _assert_invalid(artifact_path, r"query_stats/mean: 1 value\(s\) are NaN")


def test_value_out_of_range(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["behaviour/INFsc"][0, 0] = 1.5
    _assert_invalid(artifact_path, "INFsc: value 1.5 above the allowed maximum")


def test_newer_major_schema_version_is_refused_with_the_version_needed(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5.attrs["schema_version"] = "2.0"
    _assert_invalid(artifact_path, r"schema version 2\.0 is newer.*reader for schema 2\.x is needed")


def test_newer_minor_version_with_extra_dataset_is_accepted(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5.attrs["schema_version"] = "1.7"
        h5["budgets"].create_dataset("future", data=np.zeros(3), chunks=True, fletcher32=True)
    with open_artifact(artifact_path) as reader:
        reader.validate()


@pytest.mark.parametrize("where", ["/", "model", "budgets", "budgets/inf_kv"])
def test_unknown_attribute_in_current_version_is_refused(artifact_path, where):
    """Section 1, versioning: a file not newer than the reader holds no object the schema does not
    name, attributes included (issue 30 D1: they were accepted and the file served)."""
    with h5py.File(artifact_path, "r+") as h5:
        h5[where].attrs["comment"] = "hello"
    _assert_invalid(artifact_path, f"attribute\\(s\\) 'comment' not part of schema {SCHEMA_VERSION}")


def test_newer_minor_version_with_extra_attributes_is_accepted(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5.attrs["schema_version"] = "1.7"
        for where in ("/", "model", "budgets", "budgets/inf_kv"):
            h5[where].attrs["future"] = 1
    with open_artifact(artifact_path) as reader:
        reader.validate()


def test_dataset_under_model_is_refused(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["model"].create_dataset("extra", data=np.zeros(3), chunks=True, fletcher32=True)
    _assert_invalid(artifact_path, f"/model/extra: not part of schema {SCHEMA_VERSION}")


def test_unknown_dataset_in_current_version_is_refused(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["budgets"].create_dataset("surprise", data=np.zeros(3), chunks=True, fletcher32=True)
    _assert_invalid(artifact_path, f"surprise: not part of schema {SCHEMA_VERSION}")


def test_altered_metadata_attribute(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["model"].attrs["weights_fingerprint"] = "0" * 64
    _assert_invalid(artifact_path, "metadata checksum mismatch")


def test_wrong_shape_for_the_recorded_architecture(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["model"].attrs["num_layers"] = 31
    _assert_invalid(artifact_path, "does not match the recorded architecture")


@pytest.mark.parametrize("where", ["/", "/behaviour/"])
def test_external_link_is_refused(artifact_path, tmp_path, where):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as h5:
        h5.create_dataset("x", data=np.zeros(3))
    with h5py.File(artifact_path, "r+") as h5:
        h5[where + "evil"] = h5py.ExternalLink(str(other), "/x")
    _assert_invalid(artifact_path, "external link")


def test_soft_link_is_refused(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["behaviour/alias"] = h5py.SoftLink("/behaviour/RAsc")
    _assert_invalid(artifact_path, "soft link")


def test_external_storage_is_refused(artifact_path, tmp_path):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.zeros(30 * 9, dtype="<f8").tobytes())
    with h5py.File(artifact_path, "r+") as h5:
        del h5["behaviour/RAsc"]
        h5["behaviour"].create_dataset("RAsc", shape=(30, 9), dtype="<f8", external=[(str(raw), 0, 30 * 9 * 8)])
    _assert_invalid(artifact_path, "external storage")


def test_virtual_dataset_is_refused(artifact_path, tmp_path):
    source = tmp_path / "src.h5"
    with h5py.File(source, "w") as h5:
        h5.create_dataset("x", data=np.zeros((30, 9)))
    layout = h5py.VirtualLayout(shape=(30, 9), dtype="<f8")
    layout[:] = h5py.VirtualSource(str(source), "x", shape=(30, 9))
    with h5py.File(artifact_path, "r+") as h5:
        del h5["behaviour/LCsc"]
        h5["behaviour"].create_virtual_dataset("LCsc", layout)
    _assert_invalid(artifact_path, "virtual datasets are refused")


def test_dataset_without_checksum_is_refused(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        data = h5["behaviour/W_R"][()]
        del h5["behaviour/W_R"]
        h5["behaviour"].create_dataset("W_R", data=data, chunks=True)
    _assert_invalid(artifact_path, "W_R: no fletcher32 checksum")


def test_partly_allocated_dataset_is_refused(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        del h5["query_stats/cov"]
        dset = h5["query_stats"].create_dataset(
            "cov", shape=(30, 9, 64, 64), dtype="<f4", chunks=(1, 1, 64, 64), fletcher32=True
        )
        dset[0] = 1.0  # only the first layer's chunks exist; the rest would read as zeros
    _assert_invalid(artifact_path, "chunks stored")


def test_absurd_architecture_is_refused(artifact_path):
    with h5py.File(artifact_path, "r+") as h5:
        h5["model"].attrs["num_q_heads"] = 10**6
    _assert_invalid(artifact_path, "Hq = 1000000 is outside")


def test_not_an_artifact(tmp_path):
    path = tmp_path / "x.h5"
    with h5py.File(path, "w") as h5:
        h5.attrs["format"] = "something-else"
    _assert_invalid(path, "not a calibration artifact")
    _assert_invalid(tmp_path / "missing.h5", "no such file")


# -- writer --------------------------------------------------------------------------------


def test_writer_refuses_invalid_data(tmp_path):
    artifact = make_random_artifact(sections=("query_stats",))
    artifact.sections["query_stats"].arrays["mean"] = np.full((30, 9, 63), 0.5, np.float32)
    with pytest.raises(ArtifactError, match="does not match the recorded architecture"):
        write_artifact(tmp_path / "a.h5", artifact)
    artifact = make_random_artifact(sections=("query_stats",))
    artifact.sections["query_stats"].arrays["mean"][0, 0, 0] = np.inf
    with pytest.raises(ArtifactError, match="NaN or infinite"):
        write_artifact(tmp_path / "a.h5", artifact)
    artifact.sections = {"behaviuor": Section({})}
    with pytest.raises(ArtifactError, match="unknown section 'behaviuor'"):
        write_artifact(tmp_path / "a.h5", artifact)
    assert not list(tmp_path.iterdir())


def test_exception_mid_write_leaves_the_previous_file_intact(artifact_path, monkeypatch):
    before = artifact_path.read_bytes()
    import artifacts.writer as writer

    real_create = h5py.Group.create_dataset
    calls = {"n": 0}

    def failing_create(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full (simulated)")
        return real_create(self, *args, **kwargs)

    monkeypatch.setattr(writer.h5py.Group, "create_dataset", failing_create)
    with pytest.raises(OSError, match="disk full"):
        write_artifact(artifact_path, make_random_artifact(seed=1))
    assert artifact_path.read_bytes() == before
    assert [p.name for p in artifact_path.parent.iterdir()] == [artifact_path.name]  # no temp left


def test_killed_writer_leaves_the_previous_file_intact(artifact_path):
    """SIGKILL during a write (a large artifact, killed after it started) never half-writes."""
    before = artifact_path.read_bytes()
    code = (
        "import sys; sys.path.insert(0, 'tests'); from conftest import *; from artifacts import write_artifact;"
        "a = make_random_artifact(make_random_identity(num_layers=64, num_q_heads=32, num_kv_heads=8, head_dim=128));"
        f"print('go', flush=True); write_artifact({str(artifact_path)!r}, a)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "go"
    import time

    # kill once the temporary file exists (validation comes first and takes a moment), mid-write
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(".tmp") for p in artifact_path.parent.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert artifact_path.read_bytes() == before
    # The kill landed mid-write: the writer's temporary file is what is left behind.
    leftovers = [p.name for p in artifact_path.parent.iterdir() if p != artifact_path]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp"), leftovers


# -- inspect-artifact ----------------------------------------------------------------------


def test_inspect_artifact_text_and_json(artifact_path, capsys):
    assert inspect_main([str(artifact_path)]) == 0
    text = capsys.readouterr().out
    assert "valid calibration artifact" in text and "INFsc" in text and "budgets" in text
    assert inspect_main([str(artifact_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["valid"] and summary["model"]["num_layers"] == 30
    assert set(summary["sections"]) == set(SECTIONS)
    assert summary["sections"]["behaviour"]["probes"] == 7


def test_inspect_artifact_console_script(artifact_path):
    done = subprocess.run(
        [sys.executable, "-m", "artifacts.cli", str(artifact_path), "--json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["schema_version"] == SCHEMA_VERSION
    with open(artifact_path, "r+b") as fh:
        fh.truncate(100)
    done = subprocess.run([sys.executable, "-m", "artifacts.cli", str(artifact_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "invalid artifact" in done.stderr and not done.stdout


def test_format_doc_lists_every_dataset_and_attribute_of_the_schema():
    """docs/artifact-format.md must follow artifacts/schema.py."""
    from pathlib import Path

    from artifacts.schema import FORMAT_NAME, MODEL_ATTR_TYPES, SCHEMA_VERSION

    doc = (Path(__file__).parent.parent / "docs" / "artifact-format.md").read_text()
    assert f"format {SCHEMA_VERSION}" in doc and FORMAT_NAME in doc
    for section, spec in SECTIONS.items():
        assert f"### `/{section}`" in doc
        for name, dspec in spec.datasets.items():
            row = f"| `{name}` | `{dspec.dtype.replace('|', chr(92) + '|')}` | `[{', '.join(dspec.shape)}]` |"
            assert row in doc, f"format doc lacks or misdescribes /{section}/{name}: {row}"
        for attr in spec.attrs:
            assert f"`{attr}`" in doc
    for attr in MODEL_ATTR_TYPES:
        assert f"| `{attr}` |" in doc


def test_a_1_1_reader_can_verify_the_digest_of_a_file_with_a_recommendation(tmp_path):
    """Sections added after 1.1 are protected by extended_metadata_sha256 only (docs section 5)."""
    from artifacts.metadata import metadata_digest

    root = {"toolkit_version": "v", "created": "c", "config_json": "{}"}
    sections = {"budgets": {"beta": 2.0, "min_budget": 1}, "recommendation": {"tasks": 12}}
    without = {"budgets": sections["budgets"]}
    assert metadata_digest(root, {}, sections) == metadata_digest(root, {}, without)  # what a 1.1 reader computes
    path = write_artifact(tmp_path / "r.h5", make_random_artifact())
    with h5py.File(path, "r") as h5:
        assert h5.attrs["metadata_sha256"] != h5.attrs["extended_metadata_sha256"]
    with h5py.File(path, "r+") as h5:
        h5["recommendation"].attrs["tasks"] = 13
    _assert_invalid(path, r"metadata checksum mismatch.*\(extended digest\)")


def _identity_of(model, name: str):
    """The /model identity of ``model`` as the profiler records it (weights and tokenizer made up)."""
    from artifacts import ModelIdentity
    from artifacts.fingerprint import architecture_fingerprint, architecture_numbers, has_query_norm

    numbers = architecture_numbers(model.config)
    query_norm = has_query_norm(model)
    return ModelIdentity(
        name=name,
        **numbers,
        query_norm=query_norm,
        arch_fingerprint=architecture_fingerprint(numbers, query_norm),
        weights_fingerprint="b" * 64,
        tokenizer_fingerprint="c" * 64,
    )


def test_windows_soft_capping_and_per_layer_rope_are_part_of_the_architecture():
    """Same shapes, another attention: a sliding window, soft-capping or Gemma 3's per-layer-type
    RoPE changes the fingerprint; a model without any keeps the fingerprint it always had."""
    import hashlib

    from tiny_architectures import build

    from artifacts.fingerprint import architecture_numbers
    from artifacts.schema import canonical_json

    plain = _identity_of(build("mistral"), "mistral")
    assert plain.attention_variant == ""
    numbers = architecture_numbers(build("mistral").config)
    old_formula = hashlib.sha256(canonical_json({**numbers, "query_norm": False}).encode("ascii")).hexdigest()
    assert "attention_variant" not in numbers and plain.arch_fingerprint == old_formula

    windowed = _identity_of(build("mistral-sw"), "mistral-sw")
    assert json.loads(windowed.attention_variant) == {"sliding_window": 64, "sliding_layers": [0, 1, 2, 3]}
    assert windowed.arch_fingerprint != plain.arch_fingerprint

    gemma2 = build("gemma2")
    capped = _identity_of(gemma2, "gemma2")
    assert json.loads(capped.attention_variant)["attn_logit_softcapping"] == 50.0
    gemma2.config.attn_logit_softcapping = None
    assert _identity_of(gemma2, "gemma2").arch_fingerprint != capped.arch_fingerprint

    gemma3 = json.loads(_identity_of(build("gemma3"), "gemma3").attention_variant)
    assert gemma3["sliding_layers"] == [0, 2] and set(gemma3["rope_parameters_by_layer_type"]) == {
        "full_attention",
        "sliding_attention",
    }


def test_an_attention_variant_round_trips_and_an_edit_is_refused(tmp_path):
    from tiny_architectures import build

    identity = _identity_of(build("gemma2"), "gemma2")
    path = write_artifact(tmp_path / "a.h5", make_random_artifact(identity, sections=("query_stats",)))
    with open_artifact(path) as reader:
        assert reader.model == identity
        reader.validate()
    with h5py.File(path, "r+") as h5:
        h5["model"].attrs["attention_variant"] = identity.attention_variant.replace("50.0", "30.0")
    _assert_invalid(path, "arch_fingerprint does not match the recorded architecture")


def test_an_artifact_of_the_same_shapes_without_the_window_is_refused():
    from tiny_architectures import build

    from runtime.plan.calibration import architecture_mismatch

    identity = _identity_of(build("mistral"), "mistral")
    problem = architecture_mismatch(identity, build("mistral-sw"))
    assert problem is not None and "attention_variant: artifact '' vs model" in problem
    assert architecture_mismatch(identity, build("mistral")) is None
