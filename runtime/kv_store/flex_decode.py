"""One decode step's attention over a layer's packed segments as one ``flex_attention`` call (opt-in).

PyTorch's ``torch.nn.attention.flex_attention`` computes a block-sparse attention in one fused
kernel (Triton on CUDA, an inductor C++ template on CPU, both through ``torch.compile``).  A
decode step over the packed buffer (:mod:`runtime.kv_store.segments`) maps onto it as::

    query          [1, S, G, d]   segment s's G query heads are flex head s (one query row each)
    key / value    [1, 1, C, d]   the whole packed buffer, one KV head shared by every query head
    block mask     head s visits only the KV blocks of ``_KV_BLOCK`` rows that overlap its segment's
                   capacity ``offset_s .. offset_s + capacity_s - 1`` (built once per storage
                   generation: appends and evictions change no capacity)
    mask_mod       offset_s <= row < ends_s: exactly the segment's live rows, ``ends`` copied from
                   the storage at every call (so a growing segment needs no new mask)
    score_mod      Gemma 2's soft-capping ``c tanh(s / c)`` when the layer caps

so every (batch row, KV head) is attended in one call, whatever the lengths.  Compiled with
``dynamic=True``: lengths and buffer sizes change without recompiling; a new segment count
(batch size) compiles once more (docs/results.md R-flex-decode-2026-11-27).

It is not the default: on this project's CPU it is slower than the runtime's own choice
(:func:`runtime.kv_store.layer_attention._decode_step_attention`) for equal segments and for few segments,
faster only for many unequal ones, and a new batch size compiles for seconds; compiled for CPU it
cannot return the log-sum-exp the MomentKV correction merges with (PyTorch: "torch.compile on CPU
only supports inference and ``return_lse`` is not supported yet").  ``KVCAL_DECODE_KERNEL=flex``
selects it where :func:`flex_serves`; elsewhere (a corrected layer on CPU included) the runtime
keeps its own kernels.  Uncompiled
(``compiled=False``) it runs PyTorch's reference implementation of the same block mask and
mask_mod, lse included: how the tests check the CUDA path's arithmetic on CPU.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass

import torch

# Environment variable naming the decode kernel: "flex" selects this module where it serves.
DECODE_KERNEL_VARIABLE = "KVCAL_DECODE_KERNEL"
_KV_BLOCK = 128  # rows per KV block of the block mask (flex_attention's default block size)
_Q_BLOCK = 128  # one query block holds a segment's G query rows
# the dtypes flex_attention compiles for on the CPU (torch 2.13: "`torch.float` , `torch.float16` and `torch.bfloat16`
# are supported in FlexAttention for CPU device"; a float64 model takes the runtime's own kernels)
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK_CACHE_SIZE = 512  # block masks kept (least recently used dropped), keyed by storage generation


def _flex_api():
    """``(flex_attention, BlockMask, AuxRequest)`` where this torch has what this module uses, else
    None: ``flex_attention`` with ``enable_gqa`` and a log-sum-exp output through
    ``return_aux=AuxRequest(lse=True)``, ``BlockMask.from_kv_blocks`` with ``seq_lengths``.  Feature
    detection, not version numbers.  torch 2.6 (the project's lowest) has only the older
    ``return_lse`` form, and its inductor failed to compile this module's call with dynamic shapes
    on CPU ("LoweringException: TypeError: cannot determine truth value of Relational", after
    another compiled batch size): there the runtime keeps its own kernels."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except ImportError:
        return None
    try:
        flex_parameters = set(inspect.signature(flex_attention).parameters)
        block_parameters = inspect.signature(BlockMask.from_kv_blocks).parameters
    except (TypeError, ValueError):
        return None
    if "enable_gqa" not in flex_parameters or "seq_lengths" not in block_parameters:
        return None
    if "return_aux" not in flex_parameters:  # torch 2.6: see the docstring
        return None
    from torch.nn.attention.flex_attention import AuxRequest

    return flex_attention, BlockMask, AuxRequest


FLEX_API = _flex_api()


def flex_available() -> bool:
    """Whether this torch has the ``flex_attention`` API this module uses."""
    return FLEX_API is not None


def selected_decode_kernel() -> str:
    """The decode kernel ``KVCAL_DECODE_KERNEL`` names (lower case; ``""`` when unset): ``flex`` asks
    for this module, ``pages`` for the page kernel the runtime runs on a GPU, even on a CPU
    (:func:`runtime.kv_store.layer_attention.decode_kernel`)."""
    return os.environ.get(DECODE_KERNEL_VARIABLE, "").strip().lower()


def flex_serves(query: torch.Tensor, key_buffer: torch.Tensor, head_dim: int, need_lse: bool) -> bool:
    """Whether the compiled call can run here: the API exists, the buffer holds rows, the head dim
    is a power of two >= 16 (flex_attention's kernels), and, on CPU, the buffer's dtype is one of
    :data:`CPU_DTYPES` and no log-sum-exp is needed."""
    if FLEX_API is None or key_buffer.shape[0] == 0 or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    if query.device.type == "cpu" and key_buffer.dtype not in CPU_DTYPES:
        return False
    return not (need_lse and query.device.type == "cpu")


@dataclass
class FlexDecodeMask:
    """The block mask of one storage generation and the ``ends`` tensor its mask_mod reads."""

    block_mask: object  # torch.nn.attention.flex_attention.BlockMask
    ends: torch.Tensor  # int64 [S], first free row of each segment (refreshed at every call)


def build_mask(offset: torch.Tensor, capacity: torch.Tensor, rows: int, group: int, device) -> FlexDecodeMask:
    """The block mask for segments at ``offset`` with ``capacity`` (int64 ``[S]``, host) in a buffer
    of ``rows`` rows, ``group`` query rows per segment: head ``s`` lists the KV blocks its capacity
    overlaps (none when it is 0)."""
    block_mask_type = FLEX_API[1]
    segments = offset.numel()
    num_blocks = (rows + _KV_BLOCK - 1) // _KV_BLOCK
    first = offset // _KV_BLOCK  # [S]
    count = torch.where(capacity > 0, (offset + capacity - 1) // _KV_BLOCK - first + 1, 0)  # [S]
    indices = (first.unsqueeze(1) + torch.arange(num_blocks)).clamp_max(num_blocks - 1)  # [S, nb]; past count unread
    starts = offset.to(device, copy=True)
    ends = (offset + capacity).to(device, copy=True)

    def live_rows(batch, head, query_row, key_row):
        return (key_row >= starts[head]) & (key_row < ends[head])

    block_mask = block_mask_type.from_kv_blocks(
        count.view(1, segments, 1).to(device, torch.int32),
        indices.view(1, segments, 1, num_blocks).to(device, torch.int32),
        BLOCK_SIZE=(_Q_BLOCK, _KV_BLOCK),
        mask_mod=live_rows,
        seq_lengths=(group, rows),
    )
    return FlexDecodeMask(block_mask, ends)


_MASKS: dict[tuple[int, int], FlexDecodeMask] = {}
_COMPILED = None


def _mask_for(store, group: int) -> FlexDecodeMask:
    """The block mask of ``store``'s current generation (built on its first decode step)."""
    key = (store.generation, group)
    mask = _MASKS.pop(key, None)
    if mask is None:
        if len(_MASKS) >= _MASK_CACHE_SIZE:
            _MASKS.pop(next(iter(_MASKS)))  # the least recently used
        mask = build_mask(
            store.offset.reshape(-1), store.capacity.reshape(-1), store.key_buffer.shape[0], group, store.device
        )
    _MASKS[key] = mask  # (re)inserted last: the dict's order is the order of use
    return mask


def _compiled_flex():
    """``torch.compile(flex_attention, dynamic=True)``, built once."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(FLEX_API[0], dynamic=True)
    return _COMPILED


def flex_decode_attention(
    query: torch.Tensor,
    store,
    scaling: float,
    *,
    softcap: float | None = None,
    need_lse: bool = True,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode-step attention of ``query [S, G, d]`` over every segment's live rows of ``store`` (a
    :class:`runtime.kv_store.segments.SegmentStore`), one ``flex_attention`` call: ``(out [S, G, d] float32,
    lse [S, G] float32 or None)``; a segment with no live row gets ``out = 0``, ``lse = -inf``.
    ``compiled=False``: PyTorch's unfused reference implementation (tests).  Where
    :func:`flex_serves` only."""
    segments, group, dim = query.shape
    mask = _mask_for(store, group)
    mask.ends.copy_(store.ends)
    score_mod = None
    if softcap is not None:
        cap = float(softcap)

        def score_mod(score, batch, head, query_row, key_row):
            return cap * torch.tanh(score / cap)

    function = _compiled_flex() if compiled else FLEX_API[0]
    lse_argument = {"return_aux": FLEX_API[2](lse=True)} if need_lse else {}
    keys = store.key_buffer.view(1, 1, -1, dim)  # [1, 1, C, d]
    values = store.value_buffer.view(1, 1, -1, store.value_dim)  # [1, 1, C, dv]
    # the soft-cap a constant of the compiled kernel: torch.compile otherwise traces a float the closure holds as a
    # graph input read back with .item(), which Inductor cannot lower inside flex_attention's score_mod
    # ("LoweringException: RuntimeError: unbacked_bindings", torch 2.13 on the CPU)
    constants = torch._dynamo.config.patch(specialize_float=True) if compiled else contextlib.nullcontext()
    with constants:
        result = function(
            query.to(keys.dtype).unsqueeze(0),  # [1, S, G, d]
            keys,
            values,
            score_mod=score_mod,
            block_mask=mask.block_mask,
            scale=float(scaling),
            enable_gqa=True,
            **lse_argument,
        )
    if not need_lse:
        return result[0].float(), None
    out, aux = result  # [1, S, G, d] and an AuxOutput holding the lse [1, S, G]
    return out[0].float(), aux.lse[0].float()
