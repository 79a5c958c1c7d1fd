"""RoPE as matrices, and RoPE averaged over a future horizon (docs/design.md section 1).

transformers applies RoPE as ``x * cos + rotate_half(x) * sin`` with ``cos, sin [d]`` per
position, so the rotation at position ``p`` is the matrix ``R_p = diag(cos_p) + diag(sin_p) P``
where ``P x = rotate_half(x)``.  Because that is linear in ``(cos, sin)``, the average
``Rbar = mean_{p=t0..t0+T-1} R_p`` is ``diag(mean cos) + diag(mean sin) P``.  ``cos`` and
``sin`` come from the model's own rotary module, so RoPE scaling variants are honoured.
"""

from __future__ import annotations

import torch

from runtime.math.geometry import ModelGeometry


def rotate_half_matrix(head_dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """``P [d, d]`` with ``P @ x == rotate_half(x) == cat(-x[d/2:], x[:d/2])``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    half = head_dim // 2
    matrix = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    eye = torch.eye(half, dtype=dtype, device=device)
    matrix[:half, half:] = -eye
    matrix[half:, :half] = eye
    return matrix


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``diag(cos) + diag(sin) P`` for ``cos, sin [d]`` (one position, or an average)."""
    return torch.diag(cos) + sin.unsqueeze(1) * rotate_half_matrix(cos.shape[0], cos.dtype, cos.device)


def rope_cos_sin(
    model, positions: torch.Tensor, layer: int | None = None, *, rotated: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s ``cos, sin [len(positions), d]`` (float32) at absolute ``positions``;
    ``rotated=False``: a layer that applies no RoPE (:func:`runtime.plan.rope_check.no_rope_layers`),
    whose rotation is the identity, ``cos = 1, sin = 0``.

    ``model``: a loaded model or its :class:`~runtime.math.geometry.ModelGeometry` (whose ``rotary``
    module is used, given the layer's type where it takes one: Gemma 3's sliding layers use
    another RoPE base than its full ones).  ``layer=None`` serves a model whose layers share one
    RoPE; for one whose layers differ it raises ``ValueError``.  A rotary module that returns
    complex frequencies ``e^{i p f}`` (Llama 4) gives ``cos = cat(cos pf, cos pf)`` and the same
    for ``sin``: its frequencies in the layout ``rotate_half`` takes.  Llama 4 rotates interleaved
    pairs instead, which :mod:`runtime.plan.rope_check` finds, refusing the scorers that read RoPE.
    """
    geometry = ModelGeometry.of(model)
    rotary = geometry.rotary
    device = next(rotary.buffers(), torch.empty(0)).device
    if not rotated:
        shape = (positions.numel(), geometry.head_dim)
        return torch.ones(shape, device=device), torch.zeros(shape, device=device)
    layer_type = geometry.rope_layer_type(layer)
    positions = positions.to(device=device, dtype=torch.long).reshape(1, -1)
    probe = torch.zeros(1, positions.shape[1], 1, dtype=torch.float32, device=device)
    with torch.no_grad():
        output = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    if isinstance(output, torch.Tensor):  # Llama 4: complex frequencies, laid out here as rotate_half takes them
        cos, sin = torch.cat([output.real, output.real], dim=-1), torch.cat([output.imag, output.imag], dim=-1)
    else:
        cos, sin = output
    return cos[0].float(), sin[0].float()


def averaged_rope(
    model, start: int, horizon: int, layer: int | None = None, *, rotated: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``cos, sin [d]`` of layer ``layer`` over absolute positions ``start .. start + horizon - 1``
    (``model``: a model or its :class:`~runtime.math.geometry.ModelGeometry`; ``layer`` and ``rotated``
    as in :func:`rope_cos_sin`)."""
    if horizon <= 0:
        raise ValueError(f"the RoPE averaging horizon must be positive, got {horizon}")
    if start < 0:
        raise ValueError(f"the start position must be >= 0, got {start}")
    cos, sin = rope_cos_sin(model, torch.arange(start, start + horizon), layer, rotated=rotated)
    return cos.mean(0), sin.mean(0)
