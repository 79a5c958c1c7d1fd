"""How far a policy travels in one request: from answer() it is bound once, and the plan it becomes
carries everything compression and decode-time eviction need (issue 42's bar: at most 12 stops and
4 returns).

A *stop* is a function of ``runtime/`` called with the policy, or the plan bound from it, among its
arguments or the variables it closes over (the policy's and the plan's own methods, which are the
object answering about itself, and comprehensions do not count).  A *return* is a function of
``runtime/`` that returns one of them.  Counted with ``sys.setprofile`` over one real request.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from runtime import FLAGSHIP, answer, load_calibration
from runtime.plan.policy import CompressionPolicy

RUNTIME = str(Path(__file__).resolve().parents[1] / "runtime") + "/"


def _follow(policy, call):
    """Run ``call()`` and return the stops and returns of ``policy`` (see the module docstring)."""
    carriers = {id(policy)}
    held = [policy]  # every carrier kept alive: a freed one's id could be reused by an unrelated object
    stops, returns = [], []

    def carries(value) -> bool:
        return id(value) in carriers

    def profile(frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(RUNTIME) or code.co_name.startswith("<"):
            return
        name = f"{code.co_filename[len(RUNTIME) :]}:{code.co_qualname}"
        if event == "call":
            own = frame.f_locals.get("self")
            if own is not None and carries(own):
                return
            if any(carries(value) for value in frame.f_locals.values()) and name not in stops:
                stops.append(name)
        elif event == "return" and arg is not None:
            if getattr(arg, "policy", None) is policy and not isinstance(arg, CompressionPolicy):
                carriers.add(id(arg))  # the plan bound from it
                held.append(arg)
            if carries(arg) and name not in returns:
                returns.append(name)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stops, returns


def test_the_flagship_policy_from_answer_takes_at_most_12_stops_and_4_returns(
    embedded_model, embedded_tokenizer, smoke_artifact, one_thread
):
    calibration = load_calibration(embedded_model, embedded_tokenizer, path=smoke_artifact)
    policy = FLAGSHIP.policy(0.75)
    context = "The vault code is 4417. " + "Grass is green and the sky is blue. " * 12
    with torch.no_grad():
        stops, returns = _follow(
            policy,
            lambda: answer(
                embedded_model,
                embedded_tokenizer,
                context,
                "What is the vault code?",
                policy,
                calibration=calibration,
                max_new_tokens=2,
            ),
        )
    assert "plan/serving_plan.py:bind" in stops and stops[0] == "serve/generation.py:answer"  # it was followed
    assert len(stops) <= 12, stops
    assert len(returns) <= 4, returns
