"""Decode steps replayed from a captured graph: one launch per token instead of hundreds of kernels.

On a GPU an uncompressed model's decode step is bound by the host: on an NVIDIA H200, 8 layers of
Llama-3.1-8B's geometry take 7.5-11 ms a step whatever the cache holds, launching 426 kernels, and
the compressed cache's step, with 1.5-1.65x those launches, is 1.65-2.5x slower
(docs/results.md R-gpu-decode-2026-11-27).  Fewer bytes cannot win there; fewer launches can.  A
CUDA graph records a step's kernels once and replays them with one launch.

What makes a step replayable.  A graph replays the same kernels, with the same arguments, on the
same memory; the Python that ran at capture does not run again.  A compressed cache's one-token
decode step qualifies while its storage keeps its buffers: every op of it reads the lengths from
the device (the page kernel's ``row_bias``, the first-free-row table ``ends``), none from the host,
and its host bookkeeping (lengths, tokens seen) is a separate, pure-host update
(:meth:`runtime.kv_store.cache.RaggedCache.advance_replayed`).  :meth:`runtime.kv_store.cache.RaggedCache.replay_key`
says when the next step qualifies and what it depends on (storage generation, correction
quantities, kernel); a repack, a sliding-window layer, the CPU's live-rows kernel give None, as
does a decode-time eviction due after the step (:func:`runtime.compression.driver.due_after_step`),
and the step runs as usual.

:class:`DecodeGraphs` wraps the model's forward for one generation: a call that is a one-token
decode step with a replay key runs eagerly the first time the key is seen (a warm-up that also
builds what the graph will read), is captured the second time, and replayed while the key stays.
Inputs are copied into the captured step's own tensors (``input_ids``, ``position_ids``,
``cache_position``); ``attention_mask`` is not passed to a captured step: the ragged cache's mask
covers only the chunk fed (:mod:`runtime.kv_store.cache`), which in a decode step is the one real token
generate() appends, and the padding before it was never stored.  The outputs are copied out of the
graph's memory before they are returned.

:class:`CudaStepGraph` captures with ``torch.cuda.CUDAGraph``.  Tests on a CPU use a recorder of
the dispatched aten ops with the same semantics (tests/step_replay.py): what runs at replay is
only what was dispatched at capture, on the same tensors, with the same arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

import torch

from runtime.compression.driver import due_after_step
from runtime.kv_store.cache import RaggedCache
from runtime.kv_store.shared_scope import held_alone
from runtime.kv_store.transformers_compat import CACHE_NAME, cache_name

# the tensor inputs of a decode step a captured graph reads from its own copies
_STEP_INPUTS = ("input_ids", "position_ids", "cache_position")
# passed by generate() but not to a captured step (see the module docstring)
_DROPPED = ("attention_mask",)


class StepGraph(Protocol):
    """One captured step: :meth:`capture` runs ``step`` once, recording it, and returns its outputs;
    :meth:`replay` runs the recorded work again (on the same memory)."""

    def capture(self, step: Callable[[], object]) -> object: ...

    def replay(self) -> None: ...


class CudaStepGraph:
    """A step captured as a ``torch.cuda.CUDAGraph`` (its memory from ``pool``, shared by the
    captures of one generation)."""

    def __init__(self, pool=None):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    @staticmethod
    def new_pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def warm_up(step: Callable[[], object]) -> object:
        """Run ``step`` eagerly on a side stream, as PyTorch asks before a capture (libraries set up
        their per-stream state there, not inside the capture)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outputs = step()
        torch.cuda.current_stream().wait_stream(stream)
        return outputs

    def capture(self, step: Callable[[], object]) -> object:
        with torch.cuda.graph(self.graph, pool=self.pool):
            outputs = step()
        self.graph.replay()  # capturing recorded the step's kernels without running them
        return outputs

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """``forward`` (a model's) with its one-token decode steps over ``cache`` replayed from graphs
    of type ``graph`` (see the module docstring).  Counts: ``eager``, ``captured``, ``replayed``."""

    def __init__(self, forward, cache: RaggedCache, graph=CudaStepGraph, *, cache_keyword: str = CACHE_NAME):
        self.forward, self.cache, self.graph_type = forward, cache, graph
        self.cache_keyword = cache_keyword  # the name the model's forward takes its cache by
        self.pool = graph.new_pool()
        try:
            # generate() reads the forward's signature to choose what to pass (position_ids from the
            # mask, logits_to_keep): the wrapper shows the model's
            self.__signature__ = inspect.signature(forward)
            self.accepts = set(self.__signature__.parameters)
        except (TypeError, ValueError):
            self.accepts = set()
        self.warm_key = None  # the replay key of the last step run eagerly
        self.key = None  # the replay key the graph was captured under
        self.graph: StepGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}  # the captured step's own input tensors
        self.outputs = None  # what the captured step returned (its tensors in the graph's memory)
        self.numbered: tuple[str, ...] = ()  # the captured step's position inputs that are ours to advance
        self.eager = self.captured = self.replayed = 0

    def __call__(self, *args, **kwargs):
        signature = self._signature(args, kwargs)
        state = None if signature is None else self.cache.replay_key()
        if state is not None and due_after_step(self.cache):  # the step evicts: it runs eagerly
            state = None
        if state is None:
            self.eager += 1
            return self.forward(*args, **kwargs)
        key = (signature, state)
        inputs = {name: kwargs[name] for name in _STEP_INPUTS if name in kwargs}
        if key == self.key:
            for name, tensor in inputs.items():
                self.inputs[name].copy_(tensor)
            for name in self.numbered:
                self.inputs[name].fill_(self.cache.get_seq_length())
            self.graph.replay()
            self.cache.advance_replayed()
            self.replayed += 1
            return _copied(self.outputs)
        others = {name: value for name, value in kwargs.items() if name not in inputs and name not in _DROPPED}
        if key != self.warm_key:  # first step under this key: eagerly, on the capture's terms
            self.warm_key = key
            self.eager += 1
            with self._positions_given(inputs):
                return self.graph_type.warm_up(lambda: self.forward(**others, **inputs))
        self.graph, self.key = None, None  # the old graph's memory goes back to the pool first
        self.inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        # a model not told its step's position numbers it from the cache (transformers: the columns
        # the cache has seen), which a graph would bake in: the captured step is told, and advanced
        self.numbered = tuple(
            name for name in ("position_ids", "cache_position") if name not in self.inputs and name in self.accepts
        )
        for name in self.numbered:
            shape = (1, 1) if name == "position_ids" else (1,)
            position = torch.full(shape, self.cache.get_seq_length(), dtype=torch.int64)
            self.inputs[name] = position.to(inputs["input_ids"].device)
        graph = self.graph_type(self.pool)
        with self._positions_given(self.inputs if "position_ids" in inputs else {}):  # not ours, by column
            self.outputs = graph.capture(lambda: self.forward(**others, **self.inputs))
        self.graph, self.key = graph, key
        self.captured += 1
        return _copied(self.outputs)

    @contextmanager
    def _positions_given(self, inputs: dict[str, torch.Tensor]):
        """The step's ``position_ids`` handed to the cache's layers for the block (``StepPositions.given``): a
        model whose attention is not given them reads them there, from the graph's own input."""
        shared = self.cache.attention_layers[0].step_positions
        shared.given = inputs.get("position_ids")
        try:
            yield
        finally:
            shared.given = None

    def _signature(self, args, kwargs) -> tuple | None:
        """What a captured step is specialised to, for a call that is a one-token decode step of this
        cache given as keyword arguments; else None."""
        if args or kwargs.get(self.cache_keyword) is not self.cache:
            return None
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            return None
        entries = []
        for name, value in sorted(kwargs.items()):
            if name in _DROPPED or name == self.cache_keyword:
                continue
            if isinstance(value, torch.Tensor):
                if name not in _STEP_INPUTS:
                    return None
                entries.append((name, tuple(value.shape), value.dtype, value.device))
            elif value is None or isinstance(value, (bool, int, float, str)):
                entries.append((name, value))
            else:
                return None
        return tuple(entries)


# a second generation replaying captured steps on a model (:func:`decode_graphs`)
_ONE_GENERATION = (
    "decode_graphs: another generation on this model is replaying captured decode steps; captured steps serve one "
    "generation at a time per model (its forward is wrapped for the generation, and a CUDA graph capture must not "
    "overlap other work): generate without decode_graphs, or one at a time"
)


def _copied(outputs):
    """``outputs`` with every tensor in it copied out of the graph's memory (the next replay
    overwrites it; generate() may keep what a step returned)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    if isinstance(outputs, tuple) and not hasattr(outputs, "keys"):
        return type(outputs)(_copied(item) for item in outputs)
    if hasattr(outputs, "keys"):  # transformers' ModelOutput
        copy = type(outputs)(**{name: _copied(outputs[name]) for name in outputs.keys()})
        return copy
    return outputs


@contextmanager
def decode_graphs(model, cache: RaggedCache, graph=CudaStepGraph):
    """``with decode_graphs(model, cache) as graphs:`` inside the block, ``model``'s one-token decode
    steps over ``cache`` are replayed from captured graphs (:class:`DecodeGraphs`; ``graph``: how a
    step is captured).  The model's own ``forward`` is restored on exit.  One generation at a time per
    model: another thread's, while this one holds the model, is refused (the wrapped ``forward`` is the
    model's, and a graph capture must not overlap other work on the device)."""
    with held_alone(model, "decode graphs", _ONE_GENERATION):
        own = vars(model).get("forward")  # an instance attribute (accelerate's hooks set one), else None
        graphs = DecodeGraphs(model.forward, cache, graph, cache_keyword=cache_name(model))
        model.forward = graphs
        try:
            yield graphs
        finally:
            if own is None:
                del model.forward
            else:
                model.forward = own
