"""Several threads serving one model at once, as a web server's worker threads share the model it loaded: every
call answers as it answers alone, and the model is left as it was.

kvcal switches the model's attention for a call and hooks its attention modules during a prefill; another
thread's forward pass in between ran through those hooks (a cache evicted by another call's forward pass:
"the prompt's chunked attention was not accumulated", an IndexError) or found the attention switched back under
it ("RaggedCache needs the model to run attn_implementation='kvcal_ragged'"), and the model could be left on
kvcal's attention.  A barrier in the first layer's forward makes the threads' prefills overlap every time."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_tiny_llama
from test_inference_mode import ARTIFACT_FREE_POLICIES
from tiny_architectures import make_tiny

from runtime import CompressionPolicy, RaggedCache, answer, generate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread

# keydiff, and the two whose prefill hooks the attention modules (chunk mass, the prompt's query statistics)
POLICIES = {
    name: ARTIFACT_FREE_POLICIES[name]
    for name in ("keydiff", "leverage + order-1 correction", "expected attention, the prompt's statistics")
}


def _prompts(count: int):
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(3, 128, (1, 60 + 17 * i), generator=generator) for i in range(count)]


def _overlapping(model, parties: int):
    """A forward pre-hook on the first decoder layer that holds each thread's first pass until ``parties``
    threads are inside a forward pass (a timeout: the test fails rather than hangs)."""
    barrier, seen = threading.Barrier(parties, timeout=60), set()

    def wait(module, args):
        if threading.get_ident() not in seen:
            seen.add(threading.get_ident())
            barrier.wait()

    return model.model.layers[0].register_forward_pre_hook(wait)


def _run_threads(jobs, reraise: bool = False):
    """Each job in its own thread; their results in order.  An error fails the test (``reraise``: raised here)."""
    results, errors = [None] * len(jobs), []

    def run(index, job):
        try:
            results[index] = job()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc if reraise else f"job {index}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(index, job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if reraise and errors:
        raise errors[0]
    assert not errors, errors
    return results


@pytest.mark.parametrize("name", POLICIES)
@torch.no_grad()
def test_threads_compressing_on_one_model_answer_as_alone(name):
    model = make_tiny_llama(num_layers=3).eval()
    policy, prompts = POLICIES[name], _prompts(3)
    options = dict(max_new_tokens=8, pad_token_id=0)
    alone = [generate(model, ids, policy, context_columns=ids.shape[1] - 3, **options).sequences for ids in prompts]
    plain_ids = _prompts(4)[3]
    plain_alone = model.generate(plain_ids, do_sample=False, **options)
    handle = _overlapping(model, parties=4)
    jobs = [
        lambda ids=ids: generate(model, ids, policy, context_columns=ids.shape[1] - 3, **options).sequences
        for ids in prompts
    ]
    jobs.append(lambda: model.generate(plain_ids, do_sample=False, **options))  # a plain call beside them
    results = _run_threads(jobs)
    handle.remove()
    for index, (result, reference) in enumerate(zip(results, [*alone, plain_alone], strict=True)):
        assert torch.equal(result, reference), f"job {index}"
    assert model.config._attn_implementation == "sdpa"  # the model's own, once every call is done


@torch.no_grad()
def test_a_plain_call_beside_kvcal_on_a_soft_capping_model_is_transformers_own():
    """Gemma 2 soft-caps its attention logits; a plain call made while kvcal's attention is switched on for
    another thread's call runs transformers' eager attention, not a refusal."""
    model = make_tiny("gemma2").eval()
    prompts = _prompts(2)
    options = dict(max_new_tokens=6, pad_token_id=0)
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    alone = generate(model, prompts[0], policy, context_columns=prompts[0].shape[1] - 3, **options).sequences
    plain_alone = model.generate(prompts[1], do_sample=False, **options)
    handle = _overlapping(model, parties=2)
    results = _run_threads(
        [
            lambda: generate(model, prompts[0], policy, context_columns=prompts[0].shape[1] - 3, **options).sequences,
            lambda: model.generate(prompts[1], do_sample=False, **options),
        ]
    )
    handle.remove()
    assert torch.equal(results[0], alone)
    assert torch.equal(results[1], plain_alone)
    assert model.config._attn_implementation == "eager"


@torch.no_grad()
def test_embedded_model_answers_two_threads_as_alone(embedded_model, embedded_tokenizer):
    context = "The meeting moved from room 4 to room 9 on Tuesday. Bring the signed forms. " * 4
    questions = ["Which room is the meeting in?", "What should you bring?"]
    policy = CompressionPolicy(keep_ratio=0.5, scorer="leverage", correction="order1")
    alone = [answer(embedded_model, embedded_tokenizer, context, q, policy, max_new_tokens=10) for q in questions]
    handle = _overlapping(embedded_model, parties=2)
    results = _run_threads(
        [
            lambda q=q: answer(embedded_model, embedded_tokenizer, context, q, policy, max_new_tokens=10)
            for q in questions
        ]
    )
    handle.remove()
    assert results == alone
    assert embedded_model.config._attn_implementation == "sdpa"


@torch.no_grad()
def test_captured_decode_steps_serve_one_generation_at_a_time_per_model(monkeypatch):
    """A generation replaying captured steps wraps the model's forward for its length; a second one on the
    same model, from another thread, is refused by name (not stacked on the first's wrapper, which one of them
    would leave on the model), and the model's forward is its own afterwards."""
    from step_replay import RecordedStep

    from runtime.kv_store.flex_decode import DECODE_KERNEL_VARIABLE
    from runtime.serve import decode_graph

    monkeypatch.setenv(DECODE_KERNEL_VARIABLE, "pages")  # a step the CPU can replay (tests/test_decode_graph.py)
    model = make_tiny_llama(num_layers=2).eval()
    ids = _prompts(1)[0]
    policy = CompressionPolicy(keep_ratio=0.5, scorer="keydiff")
    cache = RaggedCache.for_model(model)
    with decode_graph.decode_graphs(model, cache, RecordedStep):
        with pytest.raises(ValueError, match="decode_graphs: another generation on this model"):
            _run_threads(
                [
                    lambda: generate(
                        model,
                        ids,
                        policy,
                        context_columns=ids.shape[1] - 3,
                        max_new_tokens=4,
                        decode_graphs=RecordedStep,
                    )
                ],
                reraise=True,
            )
    assert "forward" not in vars(model)
    served = generate(
        model, ids, policy, context_columns=ids.shape[1] - 3, max_new_tokens=4, decode_graphs=RecordedStep
    )
    assert served.graphs.replayed > 0
