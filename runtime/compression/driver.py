"""When eviction runs during a forward pass: the one driver, at prefill and while decoding.

The storage (:mod:`runtime.kv_store.cache`) stores and attends; it never evicts and never calls up.  What
evicts is a :class:`DecodeEvictionHook` (the runtime's is :class:`runtime.compression.eviction.HeadEvictor`),
and this module says when:

* **while decoding**, after each layer's attention: the ragged attention function
  (:func:`runtime.compression.ragged_attention.ragged_attention_forward`) calls :func:`after_attention`, which asks
  :func:`due_evictions` which batch rows hold a head grown ``every`` tokens past its budget (their
  :class:`DecodePlan`, data the cache carries per row so that it follows beams and copies), hands
  each group of rows sharing one hook to :meth:`DecodeEvictionHook.evict_decoded`, then tells every
  hook of the layer's rows that the layer is done (:meth:`DecodeEvictionHook.layer_done`: a hook
  finishes its round after the last layer, one host synchronisation per round, issue 39), and only
  then lets a sliding-window layer drop what its next query cannot see (the order the budgets of
  sliding-window layers assume);
* **in the prefill**, right after each layer's attention module: :func:`evicting_each_layer`
  registers forward hooks on the model's attention modules for one forward pass, as kvpress's
  presses do, so that at most one layer's full cache exists at a time
  (:func:`runtime.compression.prefill.prefill_and_compress`).

:func:`due_after_step` tells a replayed decode step (:mod:`runtime.serve.decode_graph`) that the next
step must run eagerly, because an eviction falls due after it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from runtime.kv_store.profiling import label
from runtime.kv_store.shared_scope import this_thread_only
from runtime.math.geometry import ModelGeometry


@runtime_checkable
class DecodeEvictionHook(Protocol):
    """Cuts heads back to their budgets while decoding (called by :func:`after_attention`)."""

    def evict_decoded(
        self,
        layer,  # runtime.kv_store.cache.RaggedLayer
        layer_idx: int,
        rows: list[int],
        budgets: torch.Tensor,
        next_positions: list[int],
        stats_rows: list[int],
    ) -> None:
        """Cut every KV head of batch rows ``rows`` of ``layer`` (a :class:`runtime.kv_store.cache.RaggedLayer`,
        index ``layer_idx``) down to ``budgets`` int64 ``[R, Hkv]`` tokens (a head's own length: leave
        it), keeping the capacity for the tokens that follow (``layer.keep_rows(..., shrink=False)``).
        ``next_positions[i]``: the RoPE position of row ``rows[i]``'s next token; ``stats_rows[i]``: its
        row in the hook's prompt statistics."""

    def layer_done(self, layer_idx: int) -> None:
        """Layer ``layer_idx`` of a decode step has attended and evicted where due; after the last
        layer the hook checks what its calls of the step deferred (raising as they would have), at
        most one read back from the device, and refuses a round left unfinished."""


@dataclass
class DecodePlan:
    """Decode-time eviction of one batch element: ``hook`` cuts a head back to ``budgets[layer, head]``
    once it holds ``every`` tokens more; ``stats_row`` is the element's row in the hook's prompt
    statistics.  Rows whose plans share one hook are evicted in one call."""

    hook: DecodeEvictionHook
    budgets: np.ndarray  # int64 [L, Hkv]
    every: int
    stats_row: int

    def __post_init__(self):
        if not isinstance(self.hook, DecodeEvictionHook):
            raise TypeError(
                f"a decode plan's hook needs evict_decoded and layer_done methods, got {type(self.hook).__name__}"
            )


class DueEviction(NamedTuple):
    """One :meth:`DecodeEvictionHook.evict_decoded` call."""

    hook: DecodeEvictionHook
    rows: list[int]
    budgets: torch.Tensor  # int64 [R, Hkv]: the budget where a head is due, else its length
    next_positions: list[int]
    stats_rows: list[int]


def due_evictions(states, lengths, layer_idx: int) -> list[DueEviction]:
    """The hook calls decoding owes layer ``layer_idx`` whose rows are ``states``
    (:class:`runtime.kv_store.row_state.RowState`) with live tokens ``lengths`` int64 ``[B, Hkv]`` (host: the
    store's numpy mirror or a CPU tensor): one per hook whose rows hold a head ``every`` tokens past
    its budget.  Decided on the host, in numpy: a decode step with nothing due runs no torch op here."""
    lengths = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths, dtype=np.int64)
    groups: dict[int, list[int]] = {}
    for b, state in enumerate(states):
        if state.decode_plan is not None:
            groups.setdefault(id(state.decode_plan.hook), []).append(b)
    due = []
    for rows in groups.values():
        plans = [states[b].decode_plan for b in rows]
        budgets = np.stack([np.asarray(plan.budgets[layer_idx], dtype=np.int64) for plan in plans])
        held = lengths[rows]
        over = held - budgets >= np.array([plan.every for plan in plans], dtype=np.int64)[:, None]
        if not over.any():
            continue
        due.append(
            DueEviction(
                plans[0].hook,
                rows,
                torch.from_numpy(np.where(over, budgets, held)),
                [states[b].real_seen for b in rows],
                [plan.stats_row for plan in plans],
            )
        )
    return due


def after_attention(layer) -> None:
    """What follows layer ``layer``'s attention of a chunk (a :class:`runtime.kv_store.cache.RaggedLayer`,
    called by the ragged attention function): the decode-time evictions due, every hook told the
    layer is done, then the sliding-window drop (see the module docstring)."""
    plans = [row.decode_plan for row in layer.rows]
    if any(plans):
        with label("kvcal.eviction"):
            for hook, rows, budgets, next_positions, stats_rows in due_evictions(
                layer.rows, layer.store.host_length, layer.layer_idx
            ):
                hook.evict_decoded(layer, layer.layer_idx, rows, budgets, next_positions, stats_rows)
            for hook in {id(plan.hook): plan.hook for plan in plans if plan is not None}.values():
                hook.layer_done(layer.layer_idx)
    layer.drop_outside_window()


def due_after_step(cache) -> bool:
    """Whether a decode-time eviction falls due after the next one-token decode step of ``cache``
    (a :class:`runtime.kv_store.cache.RaggedCache`): that step must run eagerly, not be replayed from a graph.
    Host tables only: no torch op."""
    for layer in cache.attention_layers:
        if layer.store is not None and any([row.decode_plan is not None for row in layer.rows]):
            if due_evictions(layer.rows, layer.store.host_length + 1, layer.layer_idx):
                return True
    return False


@contextmanager
def evicting_each_layer(model, cache, evict: Callable[[object], None]):
    """``with evicting_each_layer(model, cache, evict):`` a forward pass of ``model`` into ``cache``
    calls ``evict(cache.attention_layers[i])`` right after attention module ``i`` ran (forward hooks, removed
    when the block ends, also on error)."""
    modules = ModelGeometry.of(model).attention_modules
    if len(modules) != len(cache.attention_layers):
        raise ValueError(
            f"the model has {len(modules)} attention modules, the cache {len(cache.attention_layers)} attention layers"
        )
    handles = []
    try:
        for module, layer in zip(modules, cache.attention_layers, strict=True):
            hook = this_thread_only(lambda _module, _args, _output, layer=layer: evict(layer))
            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
