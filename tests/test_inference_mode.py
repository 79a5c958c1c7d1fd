"""kvcal under ``torch.inference_mode()``, as serving code often wraps its calls: the same answers as under
``torch.no_grad()``.  Before, every call raised "Inference tensors do not track version counter" (the decode
step's positions memo and the weights fingerprint's memo read ``tensor._version``, which an inference tensor
does not have)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama
from test_runtime_policy import write_tiny_artifact

from runtime import CompressionPolicy, answer, generate, load_calibration
from runtime.plan.policy_spec import FLAGSHIP

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

# artifact-free policies, one of each way the runtime evicts (shared with test_concurrent_calls.py)
ARTIFACT_FREE_POLICIES = {
    "keydiff": CompressionPolicy(keep_ratio=0.5, scorer="keydiff"),
    "leverage + order-1 correction": CompressionPolicy(keep_ratio=0.5, scorer="leverage", correction="order1"),
    "expected attention, the prompt's statistics": CompressionPolicy(
        keep_ratio=0.5, scorer="expected_attention", statistics="prompt"
    ),
    "keydiff evicting while decoding": CompressionPolicy(keep_ratio=0.5, scorer="keydiff", evict_every=2),
    "snapkv": CompressionPolicy(keep_ratio=0.5, scorer="snapkv"),
}


def _generate(model, policy, **options):
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    return generate(model, ids, policy, attention_mask=mask, context_columns=30, max_new_tokens=6, **options)


@pytest.mark.parametrize("name", ARTIFACT_FREE_POLICIES)
def test_a_call_under_inference_mode_answers_as_under_no_grad(name):
    model = make_tiny_llama(num_layers=2).eval()
    with torch.no_grad():
        expected = _generate(model, ARTIFACT_FREE_POLICIES[name], pad_token_id=0).sequences
    with torch.inference_mode():
        served = _generate(model, ARTIFACT_FREE_POLICIES[name], pad_token_id=0).sequences
    assert torch.equal(served, expected)
    with torch.no_grad():  # and again outside it, after a call inside
        assert torch.equal(_generate(model, ARTIFACT_FREE_POLICIES[name], pad_token_id=0).sequences, expected)


def test_a_model_built_under_inference_mode_loads_its_calibration_and_serves_the_flagship(tmp_path):
    """Weights made under inference_mode are inference tensors: the weights fingerprint's memo reads them."""
    with torch.inference_mode():
        model = make_tiny_llama(num_layers=2).eval()
    with torch.no_grad():
        reference = make_tiny_llama(num_layers=2).eval()
        path = write_tiny_artifact(tmp_path / "tiny.h5", reference, ("query_stats", "budgets", "moments"))
        expected = _generate(reference, FLAGSHIP.policy(0.5), calibration=load_calibration(reference, path=path))
    with torch.inference_mode():
        calibration = load_calibration(model, path=path)
        served = _generate(model, FLAGSHIP.policy(0.5), calibration=calibration)
    assert torch.equal(served.sequences, expected.sequences)
    with torch.no_grad():  # the calibration loaded inside, served outside
        again = _generate(model, FLAGSHIP.policy(0.5), calibration=calibration)
    assert torch.equal(again.sequences, expected.sequences)


def test_embedded_model_answers_under_inference_mode(embedded_model, embedded_tokenizer):
    context = "The spare key is under the blue flowerpot by the back door. " * 4
    policy = CompressionPolicy(keep_ratio=0.5, scorer="leverage", correction="order1")
    with torch.no_grad():
        expected = answer(embedded_model, embedded_tokenizer, context, "Where is the spare key?", policy)
    with torch.inference_mode():
        served = answer(embedded_model, embedded_tokenizer, context, "Where is the spare key?", policy)
    assert served == expected
