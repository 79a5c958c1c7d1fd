"""A sliding-window layer's decode step under the page kernel hides what leaves its window instead of dropping it.

Dropping reads the stored positions back (which rows left depends on them): one synchronisation per sliding
layer and step, and a step that changes the storage every time, which no graph can replay.  Under the page
kernel (a GPU's choice for sliding-window layers, ``KVCAL_DECODE_KERNEL=pages`` on the CPU) the step sets
those rows' bias to -inf on the device and leaves them stored; anything else that touches the layer drops
them first (runtime.kv_store.cache.RaggedLayer.drop_outside_window).  Checked here against the dropping
step of the CPU's own kernel: the same tokens and logits over 60 steps crossing a 64-token window many times,
left padding, eviction, beams, soft-capping and learned sinks; replayed from a graph (the CPU's recorder);
nothing hidden left once rows are read.  No synchronisation beyond plain transformers' step:
tests/test_decode_sync.py.
"""

from __future__ import annotations

import pytest
import torch
from step_replay import RecordedStep
from tiny_architectures import WINDOW, make_tiny

from runtime import CompressionPolicy
from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE
from runtime.serve.generation import generate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

NEW_TOKENS = 60
POLICIES = {
    "nothing evicted": None,
    "uniform/keydiff at 50%": CompressionPolicy(compression_ratio=0.5, scorer="keydiff"),
}


def _prompt(rows: int = 2, columns: int = 150, padding: int = 20):
    ids = torch.randint(3, 100, (rows, columns), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[-1, :padding] = 0
    return ids, mask


def _generate(model, ids, mask, policy, kernel: str, monkeypatch, **kwargs):
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, kernel)
    options = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        return generate(model, ids, policy, attention_mask=mask, **{**options, **kwargs})


def _assert_same(hiding, dropping):
    assert torch.equal(hiding.sequences, dropping.sequences)
    for a, b in zip(hiding.output.logits, dropping.output.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(hiding.cache.head_lengths(), dropping.cache.head_lengths())  # read: nothing hidden left
    sliding = [index for index, layer in enumerate(hiding.cache.layers) if layer.window is not None]
    assert sliding and int(hiding.cache.head_lengths()[sliding].max()) <= WINDOW - 1


@pytest.mark.parametrize("name", ["mistral-sw", "gemma2", "gemma3"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_hiding_step_generates_what_a_dropping_step_generates(name, policy, monkeypatch):
    """Mistral with a window on every layer; Gemma 2 (soft-capping) and Gemma 3 with sliding and full layers."""
    model = make_tiny(name)
    ids, mask = _prompt()
    dropping = _generate(model, ids, mask, POLICIES[policy], "", monkeypatch)
    hiding = _generate(model, ids, mask, POLICIES[policy], "pages", monkeypatch)
    _assert_same(hiding, dropping)


def test_heads_of_other_budgets(monkeypatch):
    """Per-head budgets of an INF allocation give the heads other lengths and capacities: each hides its own
    rows, at the front of its segment."""
    from test_runtime_cache import inf_calibration

    model = make_tiny("mistral-sw")
    ids, mask = _prompt()
    policy = CompressionPolicy(budget=40, allocation="inf", scorer="keydiff", n_sink=2, window=4)
    calibration = inf_calibration(4, 2)
    dropping = _generate(model, ids, mask, policy, "", monkeypatch, calibration=calibration)
    hiding = _generate(model, ids, mask, policy, "pages", monkeypatch, calibration=calibration)
    assert len(set(hiding.report.budgets[0].reshape(-1).tolist())) > 1  # the heads' budgets differ
    _assert_same(hiding, dropping)


def test_rows_are_hidden_while_decoding_and_dropped_when_read(monkeypatch):
    """Mid-generation the layer still stores what left its window (the host counts it), hidden; reading the
    rows drops it first, and the next step hides again."""
    model = make_tiny("mistral-sw")
    ids, mask = _prompt(rows=1, padding=0)
    result = _generate(model, ids, mask, None, "pages", monkeypatch, max_new_tokens=5)
    layer = result.cache.layers[0]
    assert layer._hidden and int(layer.store.host_length.max()) == WINDOW - 1 + 4  # 4 steps' rows, none dropped
    assert layer.store.free >= WINDOW // 4 - 4  # room made once for a quarter of the window
    keys, _, positions = layer.head(0, 0)  # a read: dropped first
    assert not layer._hidden and keys.shape[0] == WINDOW - 1
    assert int(positions.min()) == ids.shape[1] + 4 - (WINDOW - 1)


def test_beams_reorder_what_the_window_holds(monkeypatch):
    """A beam reorder between steps copies rows: what was hidden is dropped first, not revived."""
    model = make_tiny("mistral-sw")
    ids, mask = _prompt()
    beams = dict(num_beams=2, num_return_sequences=2, output_logits=False, return_dict_in_generate=True)
    dropping = _generate(model, ids, mask, POLICIES["uniform/keydiff at 50%"], "", monkeypatch, **beams)
    hiding = _generate(model, ids, mask, POLICIES["uniform/keydiff at 50%"], "pages", monkeypatch, **beams)
    assert torch.equal(hiding.sequences, dropping.sequences)


def test_learned_sinks_on_sliding_layers(monkeypatch):
    """gpt-oss: every other layer slides, each query's softmax has a learned sink, which takes the page
    kernel's log-sum-exp: a page counts where any row is visible, not only where its first is (the first
    rows are the hidden ones; the page kernel's CPU path read the first row alone)."""
    from test_attention_sinks import gpt_oss

    model = gpt_oss(0, sliding_window=WINDOW)
    ids, mask = _prompt()
    ids = ids % 256
    dropping = _generate(model, ids, mask, POLICIES["uniform/keydiff at 50%"], "", monkeypatch)
    hiding = _generate(model, ids, mask, POLICIES["uniform/keydiff at 50%"], "pages", monkeypatch)
    _assert_same(hiding, dropping)


def test_sliding_window_decode_steps_are_replayed(monkeypatch):
    """Replayed from a graph (the CPU's recorder of a CUDA capture), a sliding-window model generates what eager
    dropping steps generate; it was never replayed (every step eager)."""
    from test_decode_graph import _generate as _generate_from_cache

    model = make_tiny("mistral-sw")
    ids, mask = _prompt()
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "")
    eager = _generate_from_cache(model, ids, mask, POLICIES["uniform/keydiff at 50%"], False)
    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")
    replayed = _generate_from_cache(model, ids, mask, POLICIES["uniform/keydiff at 50%"], RecordedStep)
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.output.logits[1:], replayed.output.logits[1:], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    counts = replayed.graphs
    assert counts.captured == 1 and counts.replayed >= counts.eager + 10, counts
    assert torch.equal(replayed.cache.head_lengths(), eager.cache.head_lengths())
