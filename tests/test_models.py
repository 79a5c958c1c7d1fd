"""The embedded model (cached conversion, real answers) and model fingerprints."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import make_tiny_llama

from artifacts.fingerprint import (
    architecture_fingerprint,
    architecture_numbers,
    model_identity,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from common.models import ModelNotFoundError, embedded_model_dir, load_model, resolve_model


def test_embedded_model_loads_fast_from_the_cache():
    embedded_model_dir()  # converted already (or now)
    start = time.perf_counter()
    model = load_model()
    elapsed = time.perf_counter() - start
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert elapsed < 5.0, f"cached load took {elapsed:.2f}s"  # ~0.3 s on an idle 2-core machine


def test_embedded_model_answers_a_magic_number_question(embedded_model, embedded_tokenizer):
    filler = " ".join(
        f"The {c} box is on shelf {n}."
        for c, n in zip(["red", "blue", "green", "grey", "pink"] * 20, range(100), strict=True)
    )
    half = len(filler) // 2
    cut = filler.index(". ", half) + 2
    context = filler[:cut] + "The special magic number for silver-harbor is 5902417. " + filler[cut:]
    messages = [{"role": "user", "content": context + "\n\nWhat is the special magic number for silver-harbor?"}]
    inputs = embedded_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = embedded_model.generate(**inputs, max_new_tokens=28, do_sample=False)
    answer = embedded_tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5902417" in answer, answer


def test_resolve_model_errors_and_passthrough(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path)
    assert resolve_model("org/some-model") == "org/some-model"
    assert resolve_model(None) == resolve_model("embedded") == str(embedded_model_dir())


def test_concurrent_first_use_builds_one_intact_cache(tmp_path):
    """Two processes converting at once into an empty cache both succeed; one copy survives.  Their
    stderr is a pipe, not a terminal: the conversion draws no progress bar into it (issue 41: the
    "Writing model shards" bar of the conversion's save did)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    code = (
        "from common.models import embedded_model_dir, load_model; d = embedded_model_dir(); m = load_model(); print(d)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    done = [p.communicate(timeout=300) for p in procs]
    outs = [out.strip() for out, _ in done]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in done]
    for _, err in done:
        assert "%|" not in err and "\r" not in err and "it/s" not in err and "Writing model shards" not in err, err
    assert outs[0] == outs[1]
    models_dir = tmp_path / "kvcal" / "models"
    assert [p.name for p in models_dir.iterdir()] == [os.path.basename(outs[0])]  # no temp dirs left
    converted = load_model(outs[0])
    reference = load_model()
    for (name, a), (_, b) in zip(converted.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_weights_fingerprint_is_stable_and_sees_one_changed_value():
    model = make_tiny_llama(seed=3)
    first = weights_fingerprint(model)
    assert weights_fingerprint(make_tiny_llama(seed=3)) == first
    assert weights_fingerprint(make_tiny_llama(seed=4)) != first
    with torch.no_grad():
        weight = model.model.layers[1].mlp.down_proj.weight
        weight[5, 7] += 1e-3  # one value, not at a sampled position
    assert weights_fingerprint(model) != first
    # Same values in bfloat16-representable form: float32 and bfloat16 copies agree.
    model = make_tiny_llama(seed=3).to(torch.bfloat16)
    assert weights_fingerprint(model) == weights_fingerprint(model.to(torch.float32))


def test_embedded_model_fingerprints(embedded_model, embedded_tokenizer):
    identity = model_identity(embedded_model, embedded_tokenizer, "embedded")
    again = model_identity(load_model(), embedded_tokenizer, "embedded")
    assert identity == again
    assert (identity.num_layers, identity.num_q_heads, identity.num_kv_heads, identity.head_dim) == (30, 9, 3, 64)
    assert identity.rope_theta == 100000.0 and not identity.query_norm
    start = time.perf_counter()
    weights_fingerprint(embedded_model)
    assert time.perf_counter() - start < 2.0
    tiny = make_tiny_llama()
    assert architecture_fingerprint(architecture_numbers(tiny.config), False) != identity.arch_fingerprint


def test_tokenizer_fingerprint_sees_the_chat_template(embedded_tokenizer):
    import copy

    first = tokenizer_fingerprint(embedded_tokenizer)
    changed = copy.deepcopy(embedded_tokenizer)
    changed.chat_template = (changed.chat_template or "") + " "
    assert tokenizer_fingerprint(changed) != first
    assert tokenizer_fingerprint(embedded_tokenizer) == first
