"""End to end on the real embedded model: `profile-model --preset smoke` -> a valid artifact."""

from __future__ import annotations

import numpy as np
import pytest

from artifacts import ARTIFACT_FILENAME, open_artifact
from artifacts.cli import main as inspect_artifact
from profiler.job import default_output


@pytest.mark.slow
def test_smoke_preset_on_embedded_model_writes_a_valid_artifact(smoke_run):
    out, stdout = smoke_run  # `profile-model --preset smoke`, run once per session (conftest)
    for stage in (
        "behaviour:",
        "query-stats:",
        "future-queries:",
        "budgets:",
        "budget-curves:",
        "moments:",
        "learned-scorer:",
        "wrote",
    ):
        assert stage in stdout  # one summary line per stage
    assert inspect_artifact([str(out)]) == 0  # every dataset read and checked
    with open_artifact(out) as reader:
        assert (reader.model.num_layers, reader.model.num_q_heads, reader.model.num_kv_heads) == (30, 9, 3)
        behaviour = reader.section("behaviour")
        probes = len(behaviour["probe_success"])
        assert probes == reader.config["behaviour"]["num_probes"] > 0
        assert np.all(behaviour["steps"] == behaviour["probe_steps"].sum())  # every head, every step
        total = behaviour["W_R"] + behaviour["W_B"] + behaviour["W_D"] + behaviour["W_W"]
        assert np.all(total > 0) and np.all(total <= behaviour["steps"])  # weights are <= 1 per step
        assert np.all((behaviour["INFsc"] >= 0) & (behaviour["INFsc"] <= 1))
        stats = reader.section("query_stats")
        assert stats.attrs["n_sink"] == 4 and np.all(stats["n"] == stats["n"][0, 0])
        cov = stats["cov"].astype(np.float64)
        assert np.all(np.linalg.eigvalsh(cov[0, 0]) > -1e-3)  # a covariance: PSD up to rounding
        future = reader.section("future_queries")
        # every probe's question and answer tokens, the same count for every head
        assert reader.config["future_queries"]["num_probes"] == probes
        assert np.all(future["n"] == future["n"][0, 0]) and future["n"][0, 0] >= probes
        assert future["centres"].shape == (30, 9, reader.config["future_queries"]["centres"], 64)
        np.testing.assert_allclose(future["centre_weights"].sum(-1), 1.0)
        assert np.all(np.linalg.eigvalsh(future["cov"][0, 0].astype(np.float64)) > -1e-3)
        curves = reader.section("budget_curves")  # opt-in: the smoke fixture names every stage
        for ratio, row in zip(curves["compression_ratios"], curves["fractions"], strict=True):
            assert row.shape == (30, 3) and row.sum() == pytest.approx((1 - ratio) * 90, rel=1e-9)
        assert np.all(curves["output_error"][-1] < 1e-3)
        assert reader.config["budget_curves"]["selection"] == "keydiff"
        assert reader.config["budget_curves"]["retention"] == "answer"  # the default: REAL's hits at the answer
        budgets = reader.section("budgets")
        for b, table in zip(budgets["token_budgets"], budgets["token_tables"], strict=True):
            assert table.sum() == b * 30 * 3
        assert reader.config["query_stats"]["source"] == "needles prose haystack"
        moments = reader.section("moments")
        # the flagship's scorer first (order, errors), then the candidates' with +correction
        assert reader.config["moments"]["selection"] == "leverage"
        assert moments["selections"].tolist() == [b"leverage", b"keydiff", b"learned"]  # learned: global allocation
        assert moments["selection_allocations"].tolist() == [b"uniform", b"uniform", b"global"]
        assert moments["errors"].shape == (2, 3, 30, 3) and set(np.unique(moments["order"])) <= {-1, 0, 1}
        chosen = np.take_along_axis(moments["errors"], (moments["order"].astype(int) + 1)[None, None], axis=1)
        assert chosen.mean() < moments["errors"][:, 0].mean()  # correction helps on average
        fit = reader.section("learned_scorer")
        assert fit["weights"].shape == (30, 3, 128) and fit.attrs["held_out_tokens"] == 64
        # on one 64-token held-out window the student ranks tokens like the teacher (0.69 measured)
        assert fit["rank_correlation"].mean() > 0.5


def test_default_output_goes_next_to_the_weights_when_writable(tmp_path, monkeypatch):
    assert default_output(str(tmp_path)) == tmp_path / ARTIFACT_FILENAME
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    # a hub id: kvcal's cache, where load_calibration looks too (tests/test_artifact_location.py)
    expected = tmp_path / "cache" / "kvcal" / "artifacts" / "some-org--some-hub-model" / ARTIFACT_FILENAME
    assert default_output("some-org/some-hub-model") == expected
