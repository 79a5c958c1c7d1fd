"""Correction orders per selection scorer (issue 26): the artifact's /moments datasets of schema 1.5,
read by 1.4 readers and reading 1.4 files, and a runtime that serves each policy its own scorer's orders."""

from __future__ import annotations

import warnings

import h5py
import numpy as np
import pytest
from conftest import make_random_artifact, make_tiny_llama
from test_runtime_policy import write_tiny_artifact

from artifacts import Artifact, ArtifactError, Section, open_artifact, reader, write_artifact
from artifacts.schema import SECTIONS
from runtime import bind, load_calibration
from runtime.plan.policy_spec import FLAGSHIP, parse_policy

OPTIONAL = SECTIONS["moments"].optional


@pytest.fixture
def artifact(tmp_path):
    return write_artifact(tmp_path / "a.h5", make_random_artifact(sections=("budgets", "moments")))


def test_the_orders_of_every_selection_round_trip(artifact):
    written = make_random_artifact(sections=("budgets", "moments")).sections["moments"]
    with open_artifact(artifact) as opened:
        assert opened.schema_version == "1.6" and set(opened.datasets("moments")) == set(SECTIONS["moments"].datasets)
        section = opened.section("moments")
        for name, array in written.arrays.items():
            np.testing.assert_array_equal(section[name], array)
        assert section["selections"].tolist() == [b"leverage", b"keydiff"]


def test_a_1_4_reader_ignores_them_verifies_both_digests_and_reads_the_first_selections_orders(artifact, monkeypatch):
    spec = SECTIONS["moments"]
    old = type(spec)(spec.description, {k: v for k, v in spec.datasets.items() if k not in OPTIONAL})
    monkeypatch.setattr(reader, "SCHEMA_MINOR", 4)
    monkeypatch.setattr(reader, "SECTIONS", {**SECTIONS, "moments": old})
    with reader.open_artifact(artifact) as opened:
        assert opened.datasets("moments") == ("order", "errors", "reference_ratios", "tau")
        order = opened.read("moments", "order")
    with h5py.File(artifact, "r") as h5:
        np.testing.assert_array_equal(order, h5["moments"]["selection_orders"][0])
        assert dict(h5["moments"].attrs) == {}  # no attribute: no digest covers the new datasets


def test_a_1_4_file_reads_as_one_selection(artifact):
    with h5py.File(artifact, "r+") as h5:
        for name in OPTIONAL:
            del h5["moments"][name]
        h5.attrs["schema_version"] = "1.4"
    with open_artifact(artifact) as opened:
        assert set(opened.section("moments").arrays) == {"order", "errors", "reference_ratios", "tau"}
        with pytest.raises(ArtifactError, match="optional dataset"):
            opened.read("moments", "selection_orders")


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda a: a["selection_orders"].__setitem__((0, 0, 0), (a["order"][0, 0] + 2) % 3 - 1), "first selection"),
        (lambda a: a["selection_errors"].__imul__(1.5), "selection_errors: the first selection's is not"),
        (lambda a: a.__setitem__("selections", np.array([b"keydiff", b"keydiff"], "S128")), "repeated"),
        (lambda a: a.__setitem__("selection_allocations", np.array([b"uniform", b"inf"], "S128")), "uniform or global"),
        (lambda a: a.pop("selection_errors"), r"\['selection_errors'\] missing"),
    ],
)
def test_inconsistent_selections_are_refused(tmp_path, damage, message):
    built = make_random_artifact(sections=("moments",))
    damage(built.sections["moments"].arrays)
    with pytest.raises(ArtifactError, match=message):
        write_artifact(tmp_path / "bad.h5", built)


def _per_selection_artifact(path, model, orders: dict[str, np.ndarray]):
    """A tiny Llama's artifact (budgets, moments) with the given orders per selection, the first the default."""
    base = write_tiny_artifact(path.with_suffix(".base.h5"), model, ("budgets", "moments"))
    with open_artifact(base) as opened:
        sections = {name: opened.section(name) for name in opened.sections}
        identity, config = opened.model, opened.config
    moments = sections["moments"].arrays
    names = list(orders)
    stacked = np.stack([orders[name] for name in names]).astype(np.int8)  # [S, L, Hkv]
    errors = np.stack([moments["errors"]] * len(names))  # [S, R, 3, L, Hkv]
    sections["moments"] = Section(
        {
            **moments,
            "order": stacked[0],
            "selections": np.array([name.encode() for name in names], dtype="S128"),
            "selection_allocations": np.array([b"uniform"] * len(names), dtype="S128"),
            "selection_orders": stacked,
            "selection_errors": errors,
        }
    )
    return write_artifact(path, Artifact(identity, {**config, "moments": {"selection": names[0]}}, sections))


def test_each_policy_is_served_the_orders_of_its_own_scorer_without_a_warning(tmp_path):
    model = make_tiny_llama()
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    leverage, keydiff = np.full((layers, kv), 1, np.int8), np.full((layers, kv), 0, np.int8)
    keydiff[0, 0] = -1
    calibration = load_calibration(
        model, path=_per_selection_artifact(tmp_path / "s.h5", model, {"leverage": leverage, "keydiff": keydiff})
    )
    assert calibration.moment_selection == "leverage" and set(calibration.moment_selection_orders) == {
        "leverage",
        "keydiff",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flagship = bind(FLAGSHIP.policy(0.75), calibration, model)
        other = bind(parse_policy("inf/keydiff+correction").policy(0.75), calibration, model)
    np.testing.assert_array_equal(flagship.corrections[0], leverage)
    np.testing.assert_array_equal(other.corrections[0], keydiff)
    # a scorer not calibrated: the default (first) selection's orders, and the warning, once
    with pytest.warns(UserWarning, match=r"keeps \(it holds orders for leverage, keydiff\), but the policy evicts"):
        snapkv = bind(parse_policy("inf/snapkv+correction").policy(0.75), calibration, model)
    np.testing.assert_array_equal(snapkv.corrections[0], leverage)


def test_a_file_with_one_selection_still_warns_for_another_scorer(tmp_path):
    model = make_tiny_llama()
    path = write_tiny_artifact(
        tmp_path / "one.h5", model, ("budgets", "moments"), job_config={"moments": {"selection": "keydiff"}}
    )
    calibration = load_calibration(model, path=path)
    assert calibration.moment_selection_orders.keys() == {"keydiff"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        served = bind(parse_policy("inf/keydiff+correction").policy(0.75), calibration, model)
    with pytest.warns(
        UserWarning, match="measured on the tokens 'keydiff' keeps, but the policy evicts with 'leverage'"
    ):
        flagship = bind(FLAGSHIP.policy(0.75), calibration, model)
    np.testing.assert_array_equal(flagship.corrections[0], served.corrections[0])
    np.testing.assert_array_equal(served.corrections[0], calibration.moment_orders)


def test_the_summary_names_the_selections(artifact):
    from artifacts.summary import format_summary, summarize

    with open_artifact(artifact) as opened:
        summary = summarize(opened)
    assert summary["sections"]["moments"]["selections"] == ["leverage", "keydiff"]
    assert "calibrated under leverage, keydiff" in format_summary(summary)
