"""Switches of a model and hooks on its modules, when several threads serve the one model at once.

A web server's worker threads share the model it loaded, and transformers' ``generate()`` runs in each
of them side by side.  kvcal changes the model for the length of a call (its attention function:
:func:`runtime.compression.ragged_attention.ragged_attention`; the generation config's cache defaults and
EXAONE 4.5's positions: :mod:`runtime.serve.generation`) and hooks its attention modules during a prefill
(the eviction inside the prefill, :func:`runtime.compression.driver.evicting_each_layer`; the prompt's
query statistics; the RoPE check).  Both are the model's, not the call's:

* :func:`shared_switch`: the first call into a switch applies it and the last one out undoes it (a count
  per model and switch, under a lock); a call entering while another holds the switch finds it applied,
  and a call that leaves early does not undo it under the others;
* :func:`held_alone`: a change only one call may hold at a time per model (a generation replaying captured
  decode steps wraps the model's ``forward``): a second call is refused by name;
* :func:`this_thread_only`: a forward hook acts only in the thread that registered it, as another
  thread's forward pass runs through the same modules (it evicted this call's cache, or summed its
  queries into this call's statistics).

A forward pass runs in the thread that called it (accelerate's ``device_map`` dispatch included).
tests/test_concurrent_calls.py makes the threads' prefills overlap every time.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

_LOCK = threading.Lock()
# model -> {switch name: [calls holding it, the ExitStack that undoes it]; a name held alone: None}
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def shared_switch(model, name: str, switch):
    """``with shared_switch(model, name, switch):`` the block runs with ``switch()`` (a context manager
    factory) applied to ``model``: entered by the first call to hold ``name`` on ``model``, exited when
    the last one leaves, whatever the threads."""
    with _LOCK:
        held = _HELD.setdefault(model, {})
        entry = held.get(name)
        if entry is None:
            stack = contextlib.ExitStack()
            stack.enter_context(switch())  # raises before anything is held
            entry = held[name] = [0, stack]
        entry[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del held[name]
                entry[1].close()


@contextlib.contextmanager
def held_alone(model, name: str, refusal: str):
    """``with held_alone(model, name, refusal):`` the block holds ``name`` on ``model`` alone: while another
    call (any thread's) holds it, ``ValueError(refusal)`` is raised instead."""
    with _LOCK:
        held = _HELD.setdefault(model, {})
        if name in held:
            raise ValueError(refusal)
        held[name] = None
    try:
        yield
    finally:
        with _LOCK:
            del held[name]


def this_thread_only(hook):
    """``hook`` (a forward hook or pre-hook), acting only in the thread calling this: elsewhere it
    returns None (the module's output unchanged)."""
    owner = threading.get_ident()

    @functools.wraps(hook)
    def in_owner_thread(*args, **kwargs):
        if threading.get_ident() == owner:
            return hook(*args, **kwargs)
        return None

    return in_owner_thread
