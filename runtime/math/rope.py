"""RoPE as matrices, and RoPE averaged over a future horizon (docs/design.md section 1).

transformers applies RoPE as ``x * cos + rotate_half(x) * sin`` with ``cos, sin [d]`` per
position, so the rotation at position ``p`` is the matrix ``R_p = diag(cos_p) + diag(sin_p) P``
where ``P x = rotate_half(x)``.  Because that is linear in ``(cos, sin)``, the average
``Rbar = mean_{p=t0..t0+T-1} R_p`` is ``diag(mean cos) + diag(mean sin) P``.  ``cos`` and
``sin`` come from the model's own rotary module, so RoPE scaling variants are honoured.

Models rotate in one of these forms (:data:`FORMS`; which one each layer uses is read off the model
by :mod:`runtime.plan.rope_check`): :data:`ROTATE_HALF`, the above; :data:`INTERLEAVED`, GPT-J's
rotation of adjacent pairs ``(x0, x1), (x2, x3) ..`` (Cohere, Ernie 4.5, Helium), where ``P`` turns
each pair, ``P x = (-x1, x0, -x3, x2, ..)``, and ``cos, sin`` repeat each pair's frequency
(``[f0, f0, f1, f1, ..]``); :data:`REVERSED`, rotate_half's rotation by the opposite angle
(NanoChat's ``rotate_half`` returns ``cat(x2, -x1)``), ``R_p`` with ``sin`` negated; :data:`HALVES`,
rotate_half from frequencies given once (gpt-oss's rotary module returns ``cos, sin [d/2]`` and turns the
halves ``(x1 cos - x2 sin, x2 cos + x1 sin)``), which is rotate_half with ``cos, sin`` doubled, over all ``d``
dimensions where the module's width alone would read as half of them rotated (partial RoPE); and
:data:`NO_ROPE`, a layer that does not rotate (SmolLM3, EXAONE 4), whose rotation is the identity,
``cos = 1, sin = 0``.  Every formula here holds in each form with its ``P``: :class:`Rotation` carries
``cos, sin`` with the form's ``P``.

Partial RoPE (Phi-4-mini turns 48 of 64 dimensions, GLM-4 half of them, StableLM a quarter) turns a
head's first ``r`` dimensions in one of these forms and passes the others: ``cos, sin`` are 1 and 0
there, and ``P`` acts on the first ``r`` only (``rotary_dims``; rotate_half's halves are of the ``r``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.math.geometry import ModelGeometry

ROTATE_HALF = "rotate_half"
# adjacent pairs; the rotary module's cos, sin laid out as rotate_half takes them ([f, f]: Ernie 4.5,
# Helium) or already per pair ([f0, f0, f1, f1, ..]: Cohere), as INTERLEAVED_PAIRED
INTERLEAVED = "interleaved"
INTERLEAVED_PAIRED = "interleaved, paired frequencies"
# rotate_half with its signs flipped, cat(x2, -x1): the inverse rotation R(-p) (NanoChat); sin negated
REVERSED = "rotate_half, reversed"
# rotate_half whose rotary module gives each frequency once, cos, sin [d/2] for both halves (gpt-oss)
HALVES = "rotate_half, frequencies once"
NO_ROPE = "none"
FORMS = (ROTATE_HALF, INTERLEAVED, INTERLEAVED_PAIRED, REVERSED, HALVES, NO_ROPE)


@dataclass(frozen=True)
class RopeForms:
    """Each layer's form (:data:`FORMS`; None: none of them) for its keys and for its queries, as
    :func:`runtime.plan.rope_check.rope_forms` reads them off a model."""

    keys: tuple[str | None, ...]
    queries: tuple[str | None, ...]


def form_applies(geometry: ModelGeometry, layer: int, form: str) -> bool:
    """Whether layer ``layer`` can rotate in ``form``: :data:`HALVES` only where the rotary module's width
    is half the head dim (every other form anywhere); a model without a rotary module, :data:`NO_ROPE` only."""
    if geometry.rotary is None:
        return form == NO_ROPE
    return form != HALVES or 2 * geometry.rotary_dims[layer] == geometry.head_dim


def _form_rotary_dims(geometry: ModelGeometry, layer: int, form: str) -> int | None:
    """How many dimensions layer ``layer`` turns in ``form``: all in :data:`HALVES`, else the module's width."""
    return None if form == HALVES else geometry.rotary_dims[layer]


def interleaves(form: str) -> bool:
    """Whether ``form`` rotates adjacent pairs (its ``P`` is the pairs' turn, :func:`pair_rotation_matrix`)."""
    return form in (INTERLEAVED, INTERLEAVED_PAIRED)


def _rotated(head_dim: int, rotary_dims: int | None) -> int:
    """How many of a head's dimensions turn (``rotary_dims``; None: all; 0: none, a model without RoPE)."""
    rotated = head_dim if rotary_dims is None else rotary_dims
    if rotated % 2 or not 0 <= rotated <= head_dim:
        raise ValueError(f"RoPE turns an even number of a head's {head_dim} dimensions, got {rotated}")
    return rotated


def rotate_half_matrix(head_dim: int, dtype=torch.float32, device=None, rotary_dims: int | None = None) -> torch.Tensor:
    """``P [d, d]`` with ``P @ x == rotate_half(x) == cat(-x[d/2:], x[:d/2])``; with ``rotary_dims``
    ``r``, rotate_half of the first ``r`` dimensions and 0 for the others."""
    rotated = _rotated(head_dim, rotary_dims)
    half = rotated // 2
    matrix = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    eye = torch.eye(half, dtype=dtype, device=device)
    matrix[:half, half:rotated] = -eye
    matrix[half:rotated, :half] = eye
    return matrix


def pair_rotation_matrix(
    head_dim: int, dtype=torch.float32, device=None, rotary_dims: int | None = None
) -> torch.Tensor:
    """``P [d, d]`` of the interleaved form: ``P @ x == (-x1, x0, -x3, x2, ..)``; with ``rotary_dims``
    ``r``, the pairs of the first ``r`` dimensions and 0 for the others."""
    matrix = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    index = torch.arange(0, _rotated(head_dim, rotary_dims), 2, device=device)
    matrix[index, index + 1] = -1
    matrix[index + 1, index] = 1
    return matrix


def rope_matrix(
    cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, rotary_dims: int | None = None
) -> torch.Tensor:
    """``diag(cos) + diag(sin) P`` for ``cos, sin [d]`` (one position, or an average); ``P`` of the
    interleaved form with ``interleaved``, on the first ``rotary_dims`` dimensions (None: all)."""
    turn = pair_rotation_matrix if interleaved else rotate_half_matrix
    return torch.diag(cos) + sin.unsqueeze(1) * turn(cos.shape[0], cos.dtype, cos.device, rotary_dims)


def unrotate(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    rotary_dims: int | None = None,
) -> torch.Tensor:
    """Pre-RoPE keys from post-RoPE ``keys [..., n, d]`` and their own ``cos, sin [..., n, d]``.

    transformers applies ``k cos + P(k) sin`` (``R_p = diag(cos) + diag(sin) P``, ``P`` rotate_half
    or, ``interleaved``, the pairs' turn, of the first ``rotary_dims`` dimensions; ``cos = 1, sin = 0``
    on the others); ``R_p^T R_p = (cos^2 + sin^2) I``, so the inverse is
    ``R_p^T / (cos^2 + sin^2) = (k cos - P(k) sin) / (cos^2 + sin^2)`` (the denominator is 1 unless
    RoPE carries an attention factor).
    """
    # k cos - P(k) sin, written into one new tensor (0.80-0.82x the time of building P(k) first:
    # R-compression-cost-2026-11-27); rotate_half(k) = [-k2, k1], the pairs' turn (-k1, k0, ..)
    rotated = _rotated(keys.shape[-1], rotary_dims)
    out = keys * cos
    if interleaved:
        out[..., 0:rotated:2].addcmul_(keys[..., 1:rotated:2], sin[..., 0:rotated:2])
        out[..., 1:rotated:2].addcmul_(keys[..., 0:rotated:2], sin[..., 1:rotated:2], value=-1)
    else:
        half = rotated // 2
        out[..., :half].addcmul_(keys[..., half:rotated], sin[..., :half])
        out[..., half:rotated].addcmul_(keys[..., :half], sin[..., half:rotated], value=-1)
    return out.div_(cos * cos + sin * sin)


@dataclass(frozen=True)
class Rotation:
    """RoPE as a layer applies it at some positions (or averaged over a horizon): ``cos, sin [..., d]``
    float32 in the layout of the layer's form, whose ``P`` is the pairs' turn when ``interleaved``, on
    the first ``rotary_dims`` of the ``d`` dimensions (None: all; partial RoPE)."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False
    rotary_dims: int | None = None
    # the weight [d] of a norm the layer applies after the rotation (HunYuan): it receives weight * R x
    weight: torch.Tensor | None = None

    def undo(self, keys: torch.Tensor) -> torch.Tensor:
        """The pre-RoPE ``keys [..., n, d]`` (float32) of post-RoPE keys at these positions (:func:`unrotate`;
        divided by the norm's weight first where the layer normalises after the rotation)."""
        keys = keys.float()
        if self.weight is not None:
            keys = keys / self.weight.to(keys.device)
        return unrotate(keys, self.cos.float(), self.sin.float(), self.interleaved, self.rotary_dims)

    def matrices(self) -> torch.Tensor:
        """``R [R, d, d]``: :func:`rope_matrix` of each row of ``cos, sin [R, d]`` (``diag(weight) R``
        where the layer normalises after the rotation)."""
        matrices = torch.stack(
            [rope_matrix(c, s, self.interleaved, self.rotary_dims) for c, s in zip(self.cos, self.sin, strict=True)]
        )
        return matrices if self.weight is None else self.weight.to(matrices.device)[:, None] * matrices


def rotation(model, layer: int, form: str, cos: torch.Tensor, sin: torch.Tensor, *, keys: bool) -> Rotation:
    """The :class:`Rotation` of ``cos, sin`` (:func:`rope_cos_sin`'s or :func:`averaged_rope`'s) for the keys
    (``keys``) or the queries of layer ``layer`` of ``model`` (or its
    :class:`~runtime.math.geometry.ModelGeometry`) rotating in ``form``: with the weight of the norm the
    layer applies to them after the rotation, if any (HunYuan's differs for keys and queries)."""
    geometry = ModelGeometry.of(model)
    read = (geometry.key_projections if keys else geometry.query_projections)[layer]
    weight = None if read.weight_after_rope is None else read.weight_after_rope.detach().float()
    return Rotation(cos, sin, interleaves(form), _form_rotary_dims(geometry, layer, form), weight)


def rope_cos_sin(
    model, positions: torch.Tensor, layer: int | None = None, *, form: str = ROTATE_HALF
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s ``cos, sin [len(positions), d]`` (float32) at absolute ``positions``, laid out
    as the layer's ``form`` rotates (:data:`FORMS`; :data:`NO_ROPE`: ``cos = 1, sin = 0``), 1 and 0 on
    the dimensions a partial RoPE passes.

    ``model``: a loaded model or its :class:`~runtime.math.geometry.ModelGeometry` (whose ``rotary``
    module is used, given the layer's type where it takes one: Gemma 3's sliding layers use
    another RoPE base than its full ones).  ``layer=None`` serves a model whose layers share one
    RoPE; for one whose layers differ it raises ``ValueError``.  A rotary module that returns
    complex frequencies ``e^{i p f}`` (Llama 4) gives ``cos = cat(cos pf, cos pf)`` and the same
    for ``sin``: its frequencies in the layout ``rotate_half`` takes.  Llama 4 also normalises after
    the rotation, which :mod:`runtime.plan.rope_check` finds, refusing the scorers that read RoPE.
    """
    if form not in FORMS:
        raise ValueError(f"unknown RoPE form {form!r}; one of {', '.join(FORMS)}")
    geometry = ModelGeometry.of(model)
    rotary = geometry.rotary
    if rotary is None and form != NO_ROPE:
        raise ValueError(
            f"the model has no rotary module (model.model.rotary_emb): it rotates in no form but {NO_ROPE!r}"
        )
    device = positions.device if rotary is None else next(rotary.buffers(), torch.empty(0)).device
    positions = positions.to(device=device, dtype=torch.long).reshape(1, -1)
    if form == NO_ROPE:
        shape = (positions.shape[1], geometry.head_dim)
        return torch.ones(shape, device=device), torch.zeros(shape, device=device)
    layer_type = geometry.rope_layer_type(layer)
    limit = geometry.rope_limits[0 if layer is None else layer]
    if limit is not None and positions.numel() and int(positions.max()) >= limit:  # a pass past it would re-scale
        raise ValueError(
            f"position {int(positions.max())} is past the {limit} positions of the model's original context, where "
            "its dynamic NTK RoPE re-scales (and the rotary module keeps the scale): kvcal serves it inside that "
            "context only"
        )
    probe = torch.zeros(1, positions.shape[1], 1, dtype=torch.float32, device=device)
    with torch.no_grad():
        output = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    if isinstance(output, torch.Tensor):  # Llama 4: complex frequencies, laid out here as rotate_half takes them
        cos, sin = torch.cat([output.real, output.real], dim=-1), torch.cat([output.imag, output.imag], dim=-1)
    else:
        cos, sin = output
    cos, sin = cos[0].float(), sin[0].float()
    if form == REVERSED:  # R(-p): cos(-a) = cos(a), sin(-a) = -sin(a)
        sin = -sin
    if form == HALVES:  # [f] for both halves -> [f, f]
        if not form_applies(geometry, 0 if layer is None else layer, form):
            raise ValueError(
                f"{form!r} needs a rotary module of half the head dim, got {cos.shape[-1]} of {geometry.head_dim}"
            )
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    if form == INTERLEAVED:  # [f, f] -> [f0, f0, f1, f1, ..]
        half = cos.shape[-1] // 2
        cos, sin = cos[:, :half].repeat_interleave(2, -1), sin[:, :half].repeat_interleave(2, -1)
    passed = geometry.head_dim - cos.shape[-1]  # partial RoPE: the last dimensions pass as they are
    if passed:
        cos = torch.cat([cos, cos.new_ones(cos.shape[0], passed)], dim=-1)
        sin = torch.cat([sin, sin.new_zeros(sin.shape[0], passed)], dim=-1)
    return cos, sin


def averaged_rope(
    model, start: int, horizon: int, layer: int | None = None, *, form: str = ROTATE_HALF
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``cos, sin [d]`` of layer ``layer`` over absolute positions ``start .. start + horizon - 1``
    (``model``: a model or its :class:`~runtime.math.geometry.ModelGeometry`; ``layer`` and ``form``
    as in :func:`rope_cos_sin`), each position's RoPE the one a query decoded there alone gets (the
    frequencies of a longrope RoPE switch at ``original_max_position_embeddings``), times the factor the
    layer scales a query there by (:attr:`~runtime.math.geometry.ModelGeometry.query_scales`: the average
    is of the queries' own rotations, the RoPE of keys never scaled).  A dynamic NTK layer decodes no
    query past its original context (:attr:`~runtime.math.geometry.ModelGeometry.rope_limits`): the
    horizon stops there, and a start at or past it averages the last position inside it."""
    if horizon <= 0:
        raise ValueError(f"the RoPE averaging horizon must be positive, got {horizon}")
    if start < 0:
        raise ValueError(f"the start position must be >= 0, got {start}")
    geometry = ModelGeometry.of(model)
    limit = geometry.rope_limits[0 if layer is None else layer]
    if limit is not None:  # generate() refuses a generation past it: no query is decoded there
        end = min(start + horizon, limit)
        start = min(start, end - 1)
        horizon = end - start
    switch = geometry.rope_switches[0 if layer is None else layer]
    # longrope turns a pass by its longest position: a query decoded alone at p takes its short factors
    # while p < switch, its long ones from there on (rope_cos_sin rotates its positions as one pass)
    positions = torch.arange(start, start + horizon)
    parts = [positions]
    if switch is not None and start < switch < start + horizon:
        parts = [torch.arange(start, switch), torch.arange(switch, start + horizon)]
    cos, sin = (
        torch.cat(part) for part in zip(*(rope_cos_sin(geometry, p, layer, form=form) for p in parts), strict=True)
    )
    scale = _layer_query_scale(geometry, layer)
    if scale is not None:  # Ministral 3, Llama 4's layers without RoPE: queries scaled by position after RoPE
        factors = scale(positions).to(cos.device)[:, None]
        cos, sin = cos * factors, sin * factors
    return cos.mean(0), sin.mean(0)


def _layer_query_scale(geometry: ModelGeometry, layer: int | None):
    """Layer ``layer``'s :class:`~runtime.math.geometry.QueryScale` (None: none); ``layer=None`` serves only
    a model whose layers all scale alike."""
    if layer is not None:
        return geometry.query_scales[layer]
    if len(set(geometry.query_scales)) > 1:
        raise ValueError("this model's layers scale their queries differently by position: pass the layer")
    return geometry.query_scales[0] if geometry.query_scales else None
