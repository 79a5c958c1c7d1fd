"""A smoke profile runs end to end on a tiny random model of every architecture the profiler accepts
(issue 27): sliding windows (Mistral, Qwen2, Gemma 2/3), soft-capping (Gemma 2), per-layer-type RoPE
(Gemma 3), query and key norms (Qwen3, Gemma 3, OLMo2), a fused QKV projection (Phi-3).  Each model is
saved with the embedded tokenizer and profiled from its directory as a user would, every stage; its
probes are longer than the 64-token window, so a sliding layer's decode steps see the window only."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import single_thread, tiny_profile_args, write_tiny_model_dir
from tiny_architectures import WINDOW, build

from artifacts import open_artifact
from profiler.cli import main
from profiler.stages import STAGE_NAMES

SMOKE_ARCHITECTURES = ("llama", "mistral-sw", "qwen2-sw", "qwen3", "gemma2", "gemma3", "olmo2", "phi3")
EVERY_STAGE = ",".join(STAGE_NAMES)
# the recommendation stage's held-out tasks: one family on one haystack (3 tasks), seconds
ONE_FAMILY = ("--recommend-families", "retrieval", "--recommend-haystacks", "simple")


def _model_dir(tmp_path, tokenizer, name: str, **options):
    model = build(name, num_layers=2, vocab_size=len(tokenizer), **options)
    return write_tiny_model_dir(tmp_path / name, tokenizer, probes=3, model=model, probe_length=WINDOW + 32)


def _profile(model_dir, out, *extra: str) -> int:
    with single_thread():
        return main(tiny_profile_args(model_dir, out, *extra, calib_samples=4))


@pytest.mark.parametrize("name", SMOKE_ARCHITECTURES)
def test_a_smoke_profile_runs_on_every_architecture(name, tmp_path, embedded_tokenizer, capsys):
    model_dir = _model_dir(tmp_path, embedded_tokenizer, name)
    out = tmp_path / "kv_calibration.h5"
    assert _profile(model_dir, out, "--stages", EVERY_STAGE, *ONE_FAMILY) == 0, capsys.readouterr().err
    with open_artifact(out) as reader:
        assert set(reader.sections) == {
            "behaviour",
            "query_stats",
            "future_queries",
            "budgets",
            "moments",
            "learned_scorer",
            "budget_curves",
            "recommendation",
        }
        loaded = reader.config["profiler"]
        assert (loaded["dtype"], loaded["attn_implementation"]) == ("float32", "eager" if name == "gemma2" else "sdpa")
        behaviour, stats = reader.section("behaviour"), reader.section("query_stats")
        assert behaviour["steps"].shape == (2, 4) and np.all(behaviour["steps"] > 0)
        weights = sum(behaviour[f"W_{label}"] for label in "RBDW")  # [L, Hq]: each step's dominant weight
        assert np.all(np.isfinite(weights)) and np.all(weights <= behaviour["steps"] + 1e-9)
        assert np.all(np.isfinite(stats["cov"])) and np.all(stats["n"] > 0)
        assert np.all(np.isfinite(reader.section("moments")["errors"]))
        # served through the runtime's cache, whose windows and soft-capping are the runtime's own
        # business (issue 27): here it runs
        assert reader.section("recommendation")["outcomes"].shape[-1] == 3


def test_a_bfloat16_profile_records_its_dtype(tmp_path, embedded_tokenizer):
    model_dir = _model_dir(tmp_path, embedded_tokenizer, "gemma3")
    out = tmp_path / "kv_calibration.h5"
    assert _profile(model_dir, out, "--stages", "behaviour,query-stats", "--dtype", "bfloat16") == 0
    with open_artifact(out) as reader:
        assert reader.config["profiler"]["dtype"] == "bfloat16"
        assert np.all(np.isfinite(reader.section("query_stats")["cov"]))


def test_sdpa_asked_for_on_a_soft_capping_model_is_refused(tmp_path, embedded_tokenizer, capsys):
    model_dir = _model_dir(tmp_path, embedded_tokenizer, "gemma2")
    out = tmp_path / "kv_calibration.h5"
    assert _profile(model_dir, out, "--stages", "query-stats", "--attn-implementation", "sdpa") == 2
    assert "soft-caps its attention logits (attn_logit_softcapping=50), which sdpa cannot do" in capsys.readouterr().err
