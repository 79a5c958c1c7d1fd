"""Tensors that kvcal makes without ``device=`` land on 'meta': a CPU stand-in for a GPU model.

On a GPU, a tensor that kvcal makes without ``device=`` lands on the CPU while the model's are on
``cuda:0``, and the first operation that mixes them raises (issue 40: the evaluation's input ids,
"Expected all tensors to be on the same device").  No test can run on a GPU, so
:func:`stray_tensors_on_meta` turns it around: the model stays on the CPU and every tensor that code
in ``profiler/`` or ``runtime/`` makes *without a device* goes to 'meta' instead, which holds no
data.  Such a tensor that meets the model's (its embedding's index, a mask, positions) or whose
values are read (``.item()``, ``.tolist()``, ``int()``) raises, as it would on a GPU; code that
makes its tensors on the device of those they meet (``device=ids.device``,
``device=input_device(model)``, ``torch.zeros_like(x)``) runs as it does without the mode.

What it catches: constructors (``torch.tensor``, ``zeros``, ``ones``, ``full``, ``arange``,
``empty``, ``randn``, ``as_tensor`` of a list or an array, ... : torch's own list of factory
functions) called from a line of ``profiler/`` or ``runtime/`` that the test runs, without
``device=`` (or with ``device=None``), whose tensor then meets a tensor on the model's device or has
its values read.

What it cannot catch:

* code the tests do not run (each test names the paths it runs);
* a stray tensor that meets only other stray tensors and is never read;
* tensors made inside transformers or torch (called for kvcal, e.g. by ``model.generate``): the
  mode leaves every constructor alone whose caller is not in ``profiler/`` or ``runtime/``;
* host-side bookkeeping named in ``HOST_SIDE`` below: those functions keep tables on the CPU on
  purpose and move what meets the model themselves (``.to(device)``); a stray tensor added there
  that meets the model is not seen;
* ``.to()`` / ``.cpu()`` / ``.cuda()`` with an explicit device: explicit devices are trusted, and
  e.g. ``next(model.parameters()).device`` is not the input device under ``device_map="auto"``;
* ``torch.tensor(t)`` / ``as_tensor(t)`` of an existing tensor ``t``: they keep ``t``'s device (as
  without a default device; ``torch.device("meta")`` as a context manager would move them).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

REPO = Path(__file__).resolve().parents[1]
CHECKED = tuple(str(REPO / package) + "/" for package in ("profiler", "runtime"))

# Host-side bookkeeping: (file, function) whose constructors stay on the CPU on purpose.  Each keeps
# small tables (per-head lengths, offsets, budgets, token windows) on the host, where Python reads
# them, and moves what meets the model's tensors itself.  Add a function here only when that holds.
HOST_SIDE = {
    # the packed store's host mirror of per-head offsets / lengths / capacities, and index tables
    # built from it that are moved with .to(self.device) before they index the key/value buffer
    ("runtime/kv_store/segments.py", "__init__"),
    ("runtime/kv_store/segments.py", "append"),
    ("runtime/kv_store/segments.py", "padded_rows"),
    ("runtime/kv_store/segments.py", "drop_outside_window"),
    ("runtime/kv_store/layout.py", "segment_rows"),  # index arithmetic on host tables; callers move the result
    ("runtime/kv_store/layout.py", "build"),  # the page tables, from the host tables, moved to the buffer's device
    # per-head masks from the host lengths (layer.length), moved to the scores' device at once;
    # budgets [R, Hkv] from numpy, compared with the host lengths
    ("runtime/compression/eviction.py", "layer_scores"),
    ("runtime/compression/eviction.py", "evict_layer"),
    ("runtime/compression/keep_rule.py", "global_budgets"),  # budgets: host numbers
    # which rows are due for eviction while decoding: host lengths against the plans' budgets
    ("runtime/compression/driver.py", "due_evictions"),
    # a row's correction orders / tau from the artifact's numpy, moved by CorrectionCache.get
    ("runtime/kv_store/cache.py", "set_correction"),
    # `next(rotary.buffers(), torch.empty(0))`: the default is built even when a buffer is there
    ("runtime/math/geometry.py", "_rotary_dims"),
    ("runtime/math/rope.py", "rope_cos_sin"),
    # a CPU generator draws the sketch (the same numbers on every device); moved before use
    ("runtime/scorers/leverage.py", "sketch_matrix"),
    # the artifact's learned weights, from numpy; moved to the keys' device when used
    ("runtime/scorers/providers.py", "__init__"),
    # query sums on the host (device=None), moved to the queries' device on the first add;
    # queries handed over as numpy arrays
    ("runtime/compression/prompt_statistics.py", "__init__"),
    ("runtime/compression/prompt_statistics.py", "add"),
    # token windows kept on the host; each forward moves its window to the model's input device
    ("profiler/calibration_text.py", "calibration_windows"),
    ("profiler/budget_curves.py", "measure_curves"),
    ("profiler/moments.py", "measure_correction_errors_by_selection"),
    ("profiler/stages/learned_scorer.py", "__init__"),  # record_window moves the ids
    ("profiler/stages/learned_scorer.py", "compute"),
    # per-head lengths [1, Hkv] of a scorer's inputs: the runtime keeps lengths on the host
    ("profiler/budget_curves.py", "layer_ranks"),
    ("profiler/moments.py", "_heads"),
}

_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


def _caller():
    """(file relative to the repository, function) of the code that called the constructor, or None
    when that is not in ``profiler/`` or ``runtime/`` (torch's own frames skipped, and a
    comprehension's frame counted as its function's)."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(str(Path(torch.__file__).parent)) or __file__ == frame.f_code.co_filename
    ):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(CHECKED):
        return None
    while frame.f_code.co_name.startswith("<") and frame.f_code.co_name != "<module>" and frame.f_back is not None:
        frame = frame.f_back  # a list comprehension or generator: the function it runs in
    return str(Path(frame.f_code.co_filename).relative_to(REPO)), frame.f_code.co_name


class _StrayToMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            keeps_device = func in _FROM_DATA and args and isinstance(args[0], torch.Tensor)
            if not keeps_device:
                caller = _caller()
                if caller is not None and caller not in HOST_SIDE:
                    kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


def _refuse_meta_inputs(module, args, kwargs):
    """A module's forward refuses meta inputs: the embedding would otherwise take meta indices into
    its CPU weight and answer on the CPU, where a CUDA embedding raises."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_meta:
            raise RuntimeError(
                f"a tensor made without device= (on 'meta' here, on the CPU beside a GPU model) reached "
                f"{type(module).__name__}.forward"
            )


@contextlib.contextmanager
def stray_tensors_on_meta():
    """Inside the block, kvcal's tensor constructors called without ``device=`` make meta tensors,
    and every module's forward refuses a meta input."""
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: _refuse_meta_inputs(module, args, {})
    )
    try:
        with _StrayToMeta():
            yield
    finally:
        handle.remove()
