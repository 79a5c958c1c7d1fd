"""A CUDA graph's semantics on a CPU, for tests of :mod:`runtime.serve.decode_graph`.

:class:`RecordedStep` is a :class:`runtime.serve.decode_graph.StepGraph` that records, while a step runs,
every aten op it dispatches, and replays exactly those: the same ops with the same non-tensor
arguments, on the same tensors that existed before the step (parameters, cache buffers, the
step's input copies: read and written in place, as a graph reads and writes the same memory),
and on fresh results of the replayed ops where the step made its own.  The Python that ran at
capture does not run at replay, as with a CUDA graph.  So a step that sizes an op by a host
value (a length read from the host mirror), bakes a changing number into an argument, or leaves
its bookkeeping to Python replays wrong here as it would on a GPU.

While it records, ``torch.cuda.is_current_stream_capturing()`` answers True, as during a CUDA
capture, so that libraries that change course while a graph is captured (transformers' mask
builders) do here too.  It also refuses at capture what a CUDA capture refuses: an op that reads device data back to the
host (``.item()``, ``nonzero``, boolean-mask indexing, tensor-repeats ``repeat_interleave``), and a
tensor the step made outside torch's dispatcher that nothing keeps (``torch.from_numpy`` of host
data, copied to the device at every step: a graph would replay the copy of the captured data).
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

_READS_BACK = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive"}


class CaptureRefused(RuntimeError):
    """The step did what a CUDA graph capture cannot record."""


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.program: list[tuple] = []  # (op, argument specs, tree)
        self.externals: list[torch.Tensor] = []  # tensors the step found (by position)
        self.refs: dict[int, tuple] = {}  # id(tensor) -> ("ext", k) or ("op", i, j)
        self.keep: list[torch.Tensor] = []  # every tensor seen, alive while recording (ids stay unique)

    def ref(self, tensor: torch.Tensor) -> tuple:
        key = id(tensor)
        if key not in self.refs:
            self.refs[key] = ("ext", len(self.externals))
            self.externals.append(tensor)
            self.keep.append(tensor)
        return self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat, tree = tree_flatten((args, kwargs))
        if name in _READS_BACK:
            raise CaptureRefused(f"{func} reads device data back to the host")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                raise CaptureRefused(f"{func} indexes by a boolean mask")
        if name == "repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None:
            raise CaptureRefused(f"{func} with tensor repeats and no output_size")
        specs = [("tensor", self.ref(item)) if isinstance(item, torch.Tensor) else ("value", item) for item in flat]
        out = func(*args, **kwargs)
        index = len(self.program)
        self.program.append((func, specs, tree))
        for j, item in enumerate(tree_flatten(out)[0]):
            if isinstance(item, torch.Tensor) and id(item) not in self.refs:
                self.refs[id(item)] = ("op", index, j)
                self.keep.append(item)
        return out


class RecordedStep:
    """A :class:`runtime.serve.decode_graph.StepGraph` of recorded aten ops (see the module docstring)."""

    def __init__(self, pool=None):
        self.program: list[tuple] = []
        self.externals: list[torch.Tensor] = []
        self.results: list[tuple[torch.Tensor, tuple]] = []  # (output tensor, its producer)

    @staticmethod
    def new_pool():
        return None

    @staticmethod
    def warm_up(step):
        return step()

    def capture(self, step):
        recorder = _Recorder()
        capturing = torch.cuda.is_current_stream_capturing
        # what a CUDA capture tells the libraries it runs (transformers' masks take their tracing path)
        torch.cuda.is_current_stream_capturing = lambda: True
        try:
            with recorder:
                outputs = step()
        finally:
            torch.cuda.is_current_stream_capturing = capturing
        self.program, self.externals = recorder.program, recorder.externals
        self.results = [
            (item, recorder.refs[id(item)])
            for item in tree_flatten(_tensors(outputs))[0]
            if isinstance(item, torch.Tensor) and recorder.refs.get(id(item), ("ext",))[0] == "op"
        ]
        recorder.keep.clear()
        for k in range(len(self.externals)):
            tensor = self.externals[k]
            # held by self.externals, this variable and getrefcount's argument only: made during the step
            if sys.getrefcount(tensor) <= 3:
                raise CaptureRefused(
                    f"the step read a tensor {tuple(tensor.shape)} {tensor.dtype} (input {k}) that it made outside "
                    "torch's dispatcher and nothing keeps: a graph would replay the data of the capture"
                )
        return outputs

    def replay(self) -> None:
        made: dict[tuple, torch.Tensor] = {}
        for index, (func, specs, tree) in enumerate(self.program):
            flat = [
                (self.externals[ref[1]] if ref[0] == "ext" else made[ref]) if kind == "tensor" else ref
                for kind, ref in specs
            ]
            args, kwargs = tree_unflatten(flat, tree)
            out = func(*args, **kwargs)
            for j, item in enumerate(tree_flatten(out)[0]):
                if isinstance(item, torch.Tensor):
                    made[("op", index, j)] = item
        with torch.no_grad():
            for target, ref in self.results:
                target.copy_(made[ref])


def _tensors(outputs):
    """The tensors a step returned (a ModelOutput's values, tuples, a tensor)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if hasattr(outputs, "keys"):
        return [_tensors(outputs[name]) for name in outputs.keys()]
    if isinstance(outputs, (tuple, list)):
        return [_tensors(item) for item in outputs]
    return []
