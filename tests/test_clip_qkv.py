"""OLMo's ``clip_qkv`` (OLMo 1.7: ``OLMo-7B-0424-hf`` writes 8.0): the attention clamps its query, key and
value projections to ``[-clip, clip]``, in place, after the linears' forward hooks have run.

kvcal reads the pre-RoPE queries in a hook on ``q_proj`` (Expected Attention's prompt statistics, the
profiler's query statistics and future queries, the query prototypes).  Read there, a query is the
linear's output before the clamp: an entry past ``clip`` is one the attention never receives.  The
geometry reads the clamp off the config and applies it (``Projection.clip``), so the read is the
attention's own whatever the dtype (in float32 ``.float()`` is the linear's own tensor, clamped later
in place; in bfloat16 it is a copy taken before the clamp).
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_rope_check import COMMON

from runtime import CompressionPolicy, compress_prompt
from runtime.compression.prompt_statistics import QueryMoments
from runtime.math.geometry import ModelGeometry

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread


def _reads_at_hook_time(model, ids):
    """Per layer ``(the read of the pre-RoPE queries and keys, copied as the hook runs, the linears' own
    outputs clamped by hand)``, from one forward pass of ``ids``."""
    geometry = ModelGeometry.of(model)
    clip = model.config.clip_qkv
    reads, expected, handles = {}, {}, []
    for layer in range(geometry.num_layers):
        for side, projection in (("q", geometry.query_projections[layer]), ("k", geometry.key_projections[layer])):

            def hook(module, inputs, output, layer=layer, side=side, projection=projection):
                reads[layer, side] = projection.take(output).float().clone()
                clamped = torch.nn.functional.linear(inputs[0], module.weight, module.bias).clamp(-clip, clip)
                expected[layer, side] = clamped.reshape(reads[layer, side].shape).float()

            handles.append(projection.module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return reads, expected


def _clamped_reads(model, ids) -> int:
    """Asserts every read is the clamped projection; returns how many of their entries sit at the bound."""
    reads, expected = _reads_at_hook_time(model, ids)
    for key, read in reads.items():
        torch.testing.assert_close(read, expected[key], rtol=0, atol=1e-6)
    return sum(int((value.abs() >= model.config.clip_qkv).sum()) for value in expected.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pre_rope_reads_are_the_clamped_projections(dtype):
    torch.manual_seed(0)
    model = T.OlmoForCausalLM(T.OlmoConfig(**COMMON, clip_qkv=0.05)).eval().to(dtype)
    ids = torch.randint(3, 200, (2, 40), generator=torch.Generator().manual_seed(1))
    assert _clamped_reads(model, ids) > 1000  # the clamp takes effect: the test would see a read taken before it


def test_prompt_statistics_are_of_the_queries_the_attention_receives():
    """Expected Attention's prompt statistics (the mean of the pre-RoPE queries) in bfloat16, where the
    hook's read is a copy taken before the model clamps in place."""
    torch.manual_seed(0)
    model = T.OlmoForCausalLM(T.OlmoConfig(**COMMON, clip_qkv=0.05)).eval().to(torch.bfloat16)
    ids = torch.randint(3, 200, (1, 60), generator=torch.Generator().manual_seed(1))
    reads, expected = _reads_at_hook_time(model, ids)
    moments = QueryMoments.for_model(model)
    with moments.collect(model), torch.no_grad():
        model(ids)
    mean = torch.from_numpy(moments.finalize()["mean"][0])  # [Hq, d], layer 0
    torch.testing.assert_close(mean, expected[0, "q"][0].mean(0), rtol=1e-3, atol=1e-3)
    _, report = compress_prompt(
        model, ids, CompressionPolicy(keep_ratio=0.25, scorer="expected_attention", statistics="prompt")
    )
    assert report.kv_bytes_after < report.kv_bytes_before


@torch.no_grad()
def test_the_embedded_weights_with_olmos_clip_are_read_clamped(embedded_model):
    """The real embedded weights in OLMo's architecture with a clip that takes effect on them."""
    own = {k: v for k, v in embedded_model.config.to_dict().items() if k not in ("architectures", "model_type")}
    model = T.OlmoForCausalLM(T.OlmoConfig(**own, clip_qkv=1.0)).eval()
    missing, _ = model.load_state_dict(embedded_model.state_dict(), strict=False)
    assert not [name for name in missing if "self_attn" in name]
    ids = torch.randint(3, 40000, (1, 48), generator=torch.Generator().manual_seed(1))
    assert _clamped_reads(model, ids) > 100
