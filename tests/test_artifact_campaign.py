"""A tampering campaign over every section of the calibration artifact (issue 30, the strict reader).

One valid artifact for a tiny llama (every section, written by ``write_artifact``) is edited with
h5py, one way per case, and its metadata digests re-signed (``test_hostile_inputs._resign``) so
that each edit is judged on its content, not refused as tampering.  Per section, per dataset:
an unknown attribute, a wrong dtype, a wrong shape, NaN, a value out of range; per section an
unknown dataset and the relations docs/artifact-format.md states, broken one at a time; the
root and ``/model`` likewise.  Every case must be refused three ways:

* ``open_artifact(path).validate()`` raises :class:`ArtifactError`;
* ``inspect-artifact PATH`` exits 2 with one line on stderr;
* ``load_calibration(model, path=...)`` raises :class:`ArtifactError`, at load or, for the two
  sections a calibration reads on demand (``query_stats``, ``future_queries``), when it reads them.

``python tests/test_artifact_campaign.py`` runs the campaign outside pytest and prints the count
(cases tried, mishandled) with the mishandled cases: docs/results.md R-reader-campaign-2026-11-27
has the count before and after issue 30's reader changes.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import make_random_artifact, make_tiny_llama  # noqa: E402
from test_hostile_inputs import _resign  # noqa: E402
from test_runtime_policy import identity_for  # noqa: E402

from artifacts import ArtifactError, open_artifact, write_artifact  # noqa: E402
from artifacts.cli import main as inspect_main  # noqa: E402
from artifacts.schema import SECTIONS  # noqa: E402

# -- editing a file -----------------------------------------------------------------------------


def _replace(h5: h5py.File, where: str, array: np.ndarray) -> None:
    """Write ``array`` at ``where`` as the writer stores datasets (chunked, fletcher32, shuffle, gzip)."""
    attrs = dict(h5[where].attrs) if where in h5 else {}
    if where in h5:
        del h5[where]
    dset = h5.create_dataset(where, data=array, chunks=True, compression="gzip", shuffle=True, fletcher32=True)
    for key, value in attrs.items():
        dset.attrs[key] = value


def _set(where: str, index, value) -> Callable:
    def edit(h5):
        array = h5[where][()]
        array[index] = value
        _replace(h5, where, array)

    return edit


def _other_dtype(dtype: np.dtype) -> np.dtype:
    """A dtype of the same kind the schema does not allow for the dataset (``<f8`` -> ``<f4``...)."""
    if dtype.kind == "S":
        return np.dtype(f"S{dtype.itemsize // 2}")
    return {"<f8": np.dtype("<f4"), "<f4": np.dtype("<f8"), "<i8": np.dtype("<i4"), "|i1": np.dtype("<i2")}.get(
        dtype.str, np.dtype("<i2")
    )


def _wrong_dtype(where: str) -> Callable:
    def edit(h5):
        array = h5[where][()]
        _replace(h5, where, array.astype(_other_dtype(array.dtype)))

    return edit


def _wrong_shape(where: str) -> Callable:
    """One more entry along the last axis (a copy of the last one)."""

    def edit(h5):
        array = h5[where][()]
        _replace(h5, where, np.concatenate([array, array[..., -1:]], axis=-1))

    return edit


def _out_of_range(spec) -> float | None:
    if spec.maximum is not None:
        return spec.maximum + 1
    if spec.minimum is not None and not (spec.dtype == "|u1" and spec.minimum == 0):
        return spec.minimum - 1
    if spec.magnitude is not None:
        return spec.magnitude * 10
    return None


def _attr(where: str, name: str, value) -> Callable:
    return lambda h5: h5[where].attrs.__setitem__(name, value)


# -- the cases ----------------------------------------------------------------------------------


def _schema_cases() -> list[tuple[str, Callable]]:
    """Per section and dataset: unknown attributes and datasets, dtype, shape, NaN, range."""
    cases = [
        ("root/unknown-attribute", _attr("/", "comment", "hello")),
        ("model/unknown-attribute", _attr("model", "comment", "hello")),
        ("model/num_layers-float", _attr("model", "num_layers", 2.0)),
        ("model/num_layers-zero", _attr("model", "num_layers", 0)),
        ("model/rope_theta-nan", _attr("model", "rope_theta", float("nan"))),
        ("model/attention_variant-not-json", _attr("model", "attention_variant", "{sliding")),
        ("model/attention_variant-edited", _attr("model", "attention_variant", '{"sliding_window":16}')),
        ("model/unknown-dataset", lambda h5: _replace(h5, "model/extra", np.zeros(3))),
        ("root/unknown-group", lambda h5: h5.create_group("extra")),
    ]
    for section, spec in SECTIONS.items():
        cases.append((f"{section}/unknown-attribute", _attr(section, "comment", "hello")))
        cases.append((f"{section}/unknown-dataset", lambda h5, s=section: _replace(h5, f"{s}/extra", np.zeros(3))))
        for name, dspec in spec.datasets.items():
            where = f"{section}/{name}"
            cases.append((f"{where}/unknown-attribute", _attr(where, "comment", "hello")))
            cases.append((f"{where}/dtype", _wrong_dtype(where)))
            cases.append((f"{where}/shape", _wrong_shape(where)))
            if dspec.dtype[1] == "f" and dspec.finite:
                cases.append((f"{where}/nan", _set(where, (0,) * len(dspec.shape), np.nan)))
            bad = _out_of_range(dspec)
            if bad is not None:
                cases.append((f"{where}/out-of-range", _set(where, (0,) * len(dspec.shape), bad)))
            if dspec.dtype[1] == "S" and where != "behaviour/probe_family":  # a family name is free text
                cases.append((f"{where}/unknown-name", _set(where, (0,) * len(dspec.shape), b"nonexistent")))
    return cases


def _swap_policy(index: int, text: bytes) -> Callable:
    """Name ``text`` as the policy served at ratio ``index`` and as the candidate it was (so that only
    the name itself is wrong)."""

    def edit(h5):
        policy, candidates = h5["recommendation/policy"][()], h5["recommendation/candidates"][()]
        old = policy[index]
        candidates[candidates == old] = text
        policy[policy == old] = text
        _replace(h5, "recommendation/candidates", candidates)
        _replace(h5, "recommendation/policy", policy)

    return edit


def _swap_heads(where: str) -> Callable:
    """Swap two heads' values in row 0: every sum stays, each head's value is another's."""

    def edit(h5):
        array = h5[where][()]
        array[0, 0, 0], array[0, 0, 1] = array[0, 0, 1], array[0, 0, 0]
        _replace(h5, where, array)

    return edit


def _flip_order(h5) -> None:
    """Another correction order for layer 0, KV head 0 in ``order`` only (not in ``selection_orders``)."""
    order = h5["moments/order"][()]
    order[0, 0] = 0 if order[0, 0] != 0 else 1
    _replace(h5, "moments/order", order)


def _drop_group(*names: str) -> Callable:
    def edit(h5):
        for name in names:
            del h5[name]

    return edit


def _served_not_by_the_rule(h5) -> None:
    """Serve another candidate than the rule picks at ratio 0, its accuracy and interval with it."""
    from common.formulas import wilson_interval

    policy, candidates = h5["recommendation/policy"][()], h5["recommendation/candidates"][()]
    accuracy = h5["recommendation/candidate_accuracy"][()]  # [NP, NC]
    tasks = int(h5["recommendation"].attrs["tasks"])
    chosen = next(i for i, name in enumerate(candidates) if name != policy[0])
    policy[0] = candidates[chosen]
    low, high = wilson_interval(round(accuracy[chosen, 0] * tasks), tasks)
    _replace(h5, "recommendation/policy", policy)
    for name, value in (("accuracy", accuracy[chosen, 0]), ("ci_low", low), ("ci_high", high)):
        _set(f"recommendation/{name}", 0, value)(h5)


def _relation_cases() -> list[tuple[str, Callable]]:
    """The relations docs/artifact-format.md states between values, broken one at a time."""
    return [
        ("behaviour/RAsc-not-its-formula", _set("behaviour/RAsc", (0, 0), 0.0)),
        ("behaviour/INFsc-not-the-harmonic-mean", _set("behaviour/INFsc", (0, 0), 0.0)),
        ("budgets/ratio_tables-sum-kept-formula-broken", _swap_heads("budgets/ratio_tables")),
        ("query_stats/cov-asymmetric", _set("query_stats/cov", (0, 0, 0, 1), 50.0)),
        ("future_queries/centre_weights-sum", _set("future_queries/centre_weights", (0, 0, 0), 0.999)),
        ("future_queries/cov-negative-variance", _set("future_queries/cov", (0, 0, 0, 0), -5.0)),
        ("budgets/inf_kv-sum", _set("budgets/inf_kv", (0, 0), 0.9)),
        ("budgets/token_tables-sum", _set("budgets/token_tables", (0, 0, 0), 1000)),
        ("budgets/ratio_tables-sum", _set("budgets/ratio_tables", (0, 0, 0), 0.99)),
        ("budget_curves/fractions-sum", _set("budget_curves/fractions", (0, 0, 0), 0.01)),
        ("budget_curves/grid-order", _set("budget_curves/grid", 1, 0.01)),
        ("budget_curves/compression_ratios-order", _set("budget_curves/compression_ratios", 1, 0.1)),
        ("moments/order-not-row-0", _flip_order),
        ("moments/selection_errors-not-row-0", _set("moments/selection_errors", (0, 0, 0, 0, 0), 0.123456)),
        ("moments/selections-repeated", _set("moments/selections", 1, b"leverage")),
        ("moments/selections-unknown-scorer", _set("moments/selections", 1, b"nonexistent")),
        ("moments/selection_allocations-unknown", _set("moments/selection_allocations", 0, b"curve")),
        ("learned_scorer/features-other", _attr("learned_scorer", "features", "q")),
        ("learned_scorer/teacher-other", _attr("learned_scorer", "teacher", "snapkv")),
        ("recommendation/policy-garbage", _swap_policy(0, b"@@garbage@@")),
        ("recommendation/policy-nonexistent-scorer", _swap_policy(0, b"inf/nonexistent")),
        ("recommendation/policy-repeated-suffix", _swap_policy(0, b"inf/keydiff+correction0+correction1")),
        ("recommendation/policy-global-kvzip", _swap_policy(0, b"global/kvzip")),
        ("recommendation/policy-baseline", _swap_policy(0, b"baseline")),
        ("recommendation/policy-global-keydiff", _swap_policy(0, b"global/keydiff")),
        ("recommendation/policy-not-a-candidate", _set("recommendation/policy", 0, b"uniform/streaming")),
        ("recommendation/ci_low-above-ci_high", _set("recommendation/ci_low", 0, 1.0)),
        ("recommendation/accuracy-not-the-candidates", _set("recommendation/accuracy", 0, 0.123)),
        ("recommendation/policy-not-the-rules-pick", _served_not_by_the_rule),
        ("recommendation/candidate_accuracy-not-the-outcomes", _set("recommendation/candidate_accuracy", (0, 0), 0.5)),
        ("recommendation/wins-not-the-outcomes", _set("recommendation/wins", (0, 1), 11)),
        ("recommendation/losses-not-the-outcomes", _set("recommendation/losses", (0, 1), 11)),
        ("recommendation/task_ids-repeated", _set("recommendation/task_ids", 1, b"retrieval-L1024-D50-S7-R0")),
        ("recommendation/reference-beyond", _set("recommendation/reference", 0, 9)),
        ("recommendation/tasks-not-T", _attr("recommendation", "tasks", 11)),
        ("recommendation/baseline_accuracy-not-the-outcomes", _attr("recommendation", "baseline_accuracy", 0.0123)),
        ("recommendation/candidates-repeated", _set("recommendation/candidates", 1, b"inf/leverage+correction")),
        ("recommendation/compression_ratios-repeated", _set("recommendation/compression_ratios", 1, 0.5)),
        ("recommendation/rule-unknown", _set("recommendation/rule", 0, b"coin-flip/1")),
    ]


def _section_dropping_cases() -> list[tuple[str, Callable]]:
    """A recommended policy whose section is gone (deleted after the recommendation was written)."""
    return [
        ("recommendation/needs-moments-which-is-gone", _drop_group("moments")),
        ("recommendation/needs-budgets-and-behaviour-which-are-gone", _drop_group("budgets", "behaviour")),
    ]


CASES = _schema_cases() + _relation_cases() + _section_dropping_cases()


# -- the base artifact and the three checks -----------------------------------------------------


def _sign(path: Path) -> None:
    """Re-sign the metadata digests, unless the edited attribute cannot even be typed (a float
    num_layers, a NaN rope_theta): the file then keeps its old digests, and must be refused anyway."""
    try:
        _resign(path)
    except ArtifactError:
        pass


def base_artifact(directory: Path, model) -> Path:
    """Every section, for ``model``'s architecture, recommending among policies the file serves."""
    artifact = make_random_artifact(identity_for(model), probes=5)
    return write_artifact(directory / "base.h5", artifact)


def _serve_everything(calibration) -> None:
    """What a serving process may read: the load, then the sections read on demand."""
    for name in ("query_mean", "query_cov", "future_mean", "future_cov", "future_centres", "future_centre_weights"):
        getattr(calibration, name)


def mishandled(path: Path, model) -> list[str]:
    """Which of the three refusals ``path`` did not get (empty: handled)."""
    from runtime import load_calibration

    failures = []
    try:
        with open_artifact(path) as reader:
            reader.validate()
        failures.append("reader accepted it")
    except ArtifactError:
        pass
    except Exception as exc:  # noqa: BLE001 - the campaign counts any other exception as mishandled
        failures.append(f"reader raised {type(exc).__name__}: {exc}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = inspect_main([str(path)])
        except Exception as exc:  # noqa: BLE001
            status = f"{type(exc).__name__}: {exc}"
    lines = err.getvalue().strip().splitlines()
    if status != 2 or len(lines) != 1:
        failures.append(f"inspect-artifact exit {status} with {len(lines)} line(s)")
    calibration = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calibration = load_calibration(model, path=path)
            _serve_everything(calibration)
            for ratio in (0.3, 0.5, 0.75, 0.9):
                calibration.policy(ratio)
        failures.append("load_calibration served it")
    except ArtifactError:
        pass
    except Exception as exc:  # noqa: BLE001
        failures.append(f"load_calibration raised {type(exc).__name__}: {exc}")
    finally:
        if calibration is not None:
            with contextlib.suppress(ArtifactError):  # close() reads what was never read
                calibration.close()
    return failures


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    model = make_tiny_llama()
    directory = tmp_path_factory.mktemp("campaign")
    return model, base_artifact(directory, model), directory


def test_the_untampered_base_artifact_is_valid_and_served(campaign):
    model, base, _ = campaign
    assert mishandled(base, model) == [
        "reader accepted it",
        "inspect-artifact exit 0 with 0 line(s)",
        "load_calibration served it",
    ]


@pytest.mark.parametrize("case, edit", CASES, ids=[case for case, _ in CASES])
def test_a_tampered_artifact_is_refused_by_the_reader_inspect_artifact_and_load_calibration(campaign, case, edit):
    model, base, directory = campaign
    path = directory / (case.replace("/", "__") + ".h5")
    shutil.copyfile(base, path)
    with h5py.File(path, "r+") as h5:
        edit(h5)
    _sign(path)
    assert mishandled(path, model) == []


def main() -> int:
    """The campaign's count: cases tried, cases mishandled (each with what went wrong)."""
    import tempfile

    model = make_tiny_llama()
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        base = base_artifact(directory, model)
        bad = {}
        for number, (case, edit) in enumerate(CASES):
            path = directory / f"case{number}.h5"
            shutil.copyfile(base, path)
            try:
                with h5py.File(path, "r+") as h5:
                    edit(h5)
                _sign(path)
            except Exception as exc:  # noqa: BLE001
                bad[case] = [f"could not build the case: {type(exc).__name__}: {exc}"]
                continue
            failures = mishandled(path, model)
            if failures:
                bad[case] = failures
    print(json.dumps({"tried": len(CASES), "mishandled": len(bad), "cases": bad}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
