"""Every tensor that meets the model is made on the model's input device (issue 40).

No test runs on a GPU; ``stray_tensors.stray_tensors_on_meta`` stands in for one: kvcal's tensors
made without ``device=`` go to 'meta' while the model stays on the CPU, so each that meets the
model's tensors (or is read) raises, as a CPU tensor does against a ``cuda:0`` model.  Each test
names the paths it runs; what the check cannot see is in stray_tensors' docstring.  kvpress's press
runs here only where kvpress is installed.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from stray_tensors import stray_tensors_on_meta

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

# artifact-free policies whose scorers read every kind of input: keys, values, recent queries,
# chunked attention, the prompt statistics (leverage), KVzip's reconstruction pass
POLICIES = ("baseline", "uniform/keydiff", "uniform/snapkv", "uniform/leverage", "uniform/kvzip")


def smoke_probes(tokenizer, count=1):
    from needles import PRESETS, generate_probes

    spec = PRESETS["smoke"].replace(families=("retrieval",), count=count, seed=11)
    return list(generate_probes(spec, tokenizer))


def evaluate_under_check(model, tokenizer, names, ratios=(0.5,), calibration=None):
    from profiler.evaluation import evaluate
    from runtime.plan.policy_spec import parse_policy

    with stray_tensors_on_meta():
        return evaluate(
            model,
            tokenizer,
            smoke_probes(tokenizer),
            [parse_policy(name) for name in names],
            list(ratios),
            calibration=calibration,
            max_new_tokens=3,
            progress=False,
            is_correct=lambda text, probe: True,
        )


def test_the_evaluation_makes_its_inputs_on_the_models_device(embedded_tokenizer):
    """evaluate-artifact's and the recommendation stage's path (prefill for several policies, KVzip's
    reconstruction, shared scores, compression, the batched decode) on a tiny random Llama."""
    model = make_tiny_llama(vocab_size=len(embedded_tokenizer), seed=3)
    result = evaluate_under_check(model, embedded_tokenizer, POLICIES)
    assert len(result["results"]) == len(POLICIES) - 1


def test_the_evaluation_runs_on_the_embedded_model(embedded_model, embedded_tokenizer):
    result = evaluate_under_check(embedded_model, embedded_tokenizer, ("baseline", "uniform/keydiff"))
    assert len(result["results"]) == 1


def test_the_runtime_entry_points_make_their_inputs_on_the_models_device(embedded_tokenizer):
    """answer() with several questions (one context compressed once) and with one, generate() with
    beams, several returned sequences and sampling, compress_prompt() block by block (a padded row too); eviction
    while decoding and moment eviction with the MomentKV correction."""
    from runtime import CompressionPolicy, answer, compress_prompt, generate
    from runtime.math.geometry import input_device

    model = make_tiny_llama(vocab_size=len(embedded_tokenizer), seed=3)
    policy = CompressionPolicy(compression_ratio=0.5)
    context = "The heron waited by the mill pond while the barges passed. " * 6
    device = input_device(model)
    ids = torch.tensor([embedded_tokenizer(context)["input_ids"]] * 2, device=device)
    with stray_tensors_on_meta():
        assert len(answer(model, embedded_tokenizer, context, ["Where?", "Who waited?"], policy, max_new_tokens=2)) == 2
        answer(model, embedded_tokenizer, [context, context[:100]], ["Where?", "Who?"], policy, max_new_tokens=2)
        answer(model, embedded_tokenizer, context, "Where?", policy, max_new_tokens=2, question_aware=True)
        for options in ({"num_beams": 2}, {"num_beams": 2, "num_return_sequences": 2}, {"do_sample": True}):
            generate(model, ids, policy, context_columns=ids.shape[1] - 3, max_new_tokens=2, **options)
        compress_prompt(model, ids, policy, block_size=16)
        padded = torch.ones_like(ids)
        padded[1, :9] = 0  # a padded row in blocks: each row's own blocks, laid out on the host
        compress_prompt(model, ids, policy, attention_mask=padded, block_size=16)
        # eviction while decoding (under beams), and moment eviction with the correction
        for options in ({"evict_every": 1}, {"evict_every": 2, "scorer": "snapkv", "moment_eviction": True}):
            evicting = CompressionPolicy(compression_ratio=0.5, correction="order1", **options)
            answer(model, embedded_tokenizer, context, ["Where?", "Who?"], evicting, max_new_tokens=3, num_beams=2)


def test_the_profiler_stages_and_the_artifacts_policies_make_their_inputs_on_the_models_device(
    tmp_path, embedded_tokenizer
):
    """profile-model, every stage but the recommendation (whose path is the evaluation's, above), on a
    tiny random Llama; then the evaluation under the policies that need its artifact (every
    recommendation candidate and the flagship: INF and curve budgets, learned scores, the
    MomentKV correction while decoding)."""
    from conftest import tiny_profile_args, write_tiny_model_dir

    from common.models import load_model
    from profiler.cli import main
    from profiler.evaluation_results import RECOMMENDATION_CANDIDATES
    from profiler.stages import STAGE_NAMES
    from runtime import load_calibration

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    write_tiny_model_dir(model_dir, embedded_tokenizer, probes=4)
    stages = ",".join(name for name in STAGE_NAMES if name != "recommendation")
    out = tmp_path / "out.h5"
    with stray_tensors_on_meta():
        assert main(tiny_profile_args(model_dir, out, "--stages", stages, calib_samples=4)) == 0
    model = load_model(str(model_dir))
    calibration = load_calibration(model, embedded_tokenizer, path=out)
    names = ("baseline", "flagship", *RECOMMENDATION_CANDIDATES)
    result = evaluate_under_check(model, embedded_tokenizer, names, calibration=calibration)
    assert len(result["results"]) == len(names) - 1


def test_every_host_side_exception_names_a_function_that_exists():
    """A stale entry of ``stray_tensors.HOST_SIDE`` (a function moved or renamed) would let its new
    home make tensors on the CPU unseen, or leave an exception nothing uses."""
    import ast

    from stray_tensors import HOST_SIDE, REPO

    for path, function in sorted(HOST_SIDE):
        tree = ast.parse((REPO / path).read_text())
        names = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert function in names, f"{path} defines no function {function}"
