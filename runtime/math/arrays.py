"""Host tables and their device copies: the two conversions every layer of the runtime makes.

The runtime keeps its per-head lengths, offsets and budgets on the host (numpy) and copies a table
to the device only when it changes, never to ask the device a question (issue 39).
"""

from __future__ import annotations

import numpy as np
import torch


def host_array(values) -> np.ndarray:
    """int64 numpy array of host ``values`` (a CPU tensor, shared without a copy, an array or a list)."""
    if isinstance(values, torch.Tensor):
        return values.numpy().astype(np.int64, copy=False)
    return np.asarray(values, dtype=np.int64)


def to_device(host, device) -> torch.Tensor:
    """A host table (numpy array or CPU tensor) on ``device`` without making the host wait for it: on
    CUDA staged in pinned memory and copied with ``non_blocking=True`` (PyTorch's pinned-memory
    allocator keeps the staging block until the copy has run), elsewhere an ordinary copy (a CPU
    "copy" to the CPU is the tensor itself).  Called when the storage changes, never per decode step."""
    if isinstance(host, np.ndarray):
        host = np.ascontiguousarray(host)
        tensor = torch.from_numpy(host if host.flags.writeable else host.copy())  # (a broadcast view is read-only)
    else:
        tensor = host
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def version_counter(tensor: torch.Tensor) -> int | None:
    """``tensor``'s version counter (bumped by every in-place change), the key of a memo that must see such a
    change; None for a tensor made under ``torch.inference_mode()``, which keeps none (reading it raises): a memo
    then keys on the tensor's identity alone."""
    return None if tensor.is_inference() else tensor._version
