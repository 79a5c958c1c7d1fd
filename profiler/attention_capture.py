"""Capturing one query's attention over the context at each generation step, cheaply.

The behaviour stage needs, at every generated token and for every (layer, query head), the
attention distribution of that single query over the *context* (the prompt tokens), and in
fact only its maximum and argmax (:mod:`profiler.behaviour`).  Materialising prefill
attention matrices would cost ``O(prompt^2)`` memory; instead:

* a custom attention function, built around one :class:`DecodeAttentionRecorder` (passed by
  closure, :func:`capture_attention_forward`) and switched in for a scope with
  ``runtime.kv_store.attention_interface.attention_implementation`` (which also registers the ``sdpa`` mask
  builder), runs the prefill with the ordinary fused ``sdpa`` kernel (no attention matrix);
  a float32 decode step, whose attention matrix is a single ``[Hq, T]`` row anyway, is
  computed as matmul-softmax-matmul from the same logits the record needs (so they are
  computed once; the output equals ``sdpa``'s up to float rounding; other dtypes keep
  ``sdpa`` and compute the logits in float32 for the record);
* it also computes, for the *last* query of the call only, the logits ``s q.k_j`` against
  all cached keys ``[Hq, T]``, their log-sum-exp, and the max / argmax over the context
  positions ``j < C``.  The weight is ``exp(max - lse)``: the true attention weight
  (normalised over every key the query sees, generated tokens included) of the dominant
  context token.

The last query of the prefill call is the one that produces the first generated token; each
later call has a single query.  So ``generate()`` producing ``N`` tokens records ``N`` steps,
one per generated token.  Cost per step and layer: one ``[Hq, T]`` GEMV-sized matmul, a
log-sum-exp and a max.  Records stay on the layer's device until the probe ends (no per-step
host synchronisation).

Learned attention sinks (gpt-oss's ``s_aux``) join the log-sum-exp as one more logit, so a weight is
the model's own (:mod:`runtime.math.sinks`); the prefill then runs the reference eager attention.
Soft-capping (Gemma 2) is applied to the logits before the mask, as the model's own attention
does, and a soft-capping layer's prefill runs :func:`runtime.kv_store.eager_attention.attention_forward`
(``sdpa`` cannot soft-cap).  A sliding-window layer's cache hands over only the window's keys
at a decode step: the keys of a call are the last ``T`` positions up to the query's (the
prompt's last token at the prefill, one more each step), so the record maps them back to
context positions; when the window has moved past the whole context, the step's weight is 0.

Batch size must be 1 (probes have different lengths and are run one at a time).
"""

from __future__ import annotations

import math

import torch

from runtime.kv_store.attention_interface import attention_implementation
from runtime.kv_store.eager_attention import attention_forward, masked, soft_cap

CAPTURE_IMPLEMENTATION = "kvcal_decode_capture"


class DecodeAttentionRecorder:
    """Per-step dominant-context-token records for every (layer, query head).

    After the run, :meth:`results` gives ``max_weight [S, L, Hq]`` (float32) and
    ``argmax [S, L, Hq]`` (int64 context positions), ``S`` = recorded steps; with
    ``keep_rows=True`` also ``rows [S, L, Hq, C]``, the full distributions over the context
    (for tests; memory grows with the context).
    """

    def __init__(
        self,
        num_layers: int,
        num_q_heads: int,
        context_len: int,
        max_steps: int,
        keep_rows: bool = False,
        layer_of=None,
    ):
        """``layer_of``: the layer an attention module records as (``ModelGeometry.layer_of``: a hybrid model's
        attention layers are numbered among themselves); default its ``layer_idx``."""
        if context_len <= 0 or max_steps <= 0:
            raise ValueError(f"context_len ({context_len}) and max_steps ({max_steps}) must be positive")
        self.layer_of = layer_of if layer_of is not None else (lambda module: module.layer_idx)
        self.num_layers = num_layers
        self.num_q_heads = num_q_heads
        self.context_len = context_len
        self.max_steps = max_steps
        self.keep_rows = keep_rows
        self._steps = [0] * num_layers  # calls seen per layer (layers may live on different devices)
        self._max_weight: dict[int, torch.Tensor] = {}  # layer -> [max_steps, Hq] on the layer's device
        self._argmax: dict[int, torch.Tensor] = {}
        self._rows: dict[int, list[torch.Tensor]] = {}

    def record(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None,
        value: torch.Tensor | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Record the last query of a call.  query ``[1, Hq, q, d]``, key/value ``[1, Hkv, T, d]``
        (the keys of positions ``p - T + 1 .. p``, ``p`` the last query's position: all of them
        but on a sliding-window layer); ``softcap``: the layer's logit soft-cap, if any; ``sinks [Hq]``:
        its learned attention sinks, if any (their ``e^s`` joins every weight's normaliser).

        With ``value`` given (single-query calls), also return that query's attention output
        ``[1, 1, Hq, d]`` computed from the same float32 logits (matmul-softmax-matmul), so
        the logits are computed once per step instead of once here and once in ``sdpa``.
        """
        batch, num_q_heads, _, head_dim = query.shape
        num_kv_heads, total = key.shape[1], key.shape[2]
        if batch != 1:
            raise ValueError(f"decode-attention capture runs one probe at a time (batch 1), got batch {batch}")
        if num_q_heads != self.num_q_heads or num_q_heads % num_kv_heads:
            raise ValueError(
                f"layer {layer}: {num_q_heads} query heads / {num_kv_heads} KV heads do not match "
                f"the recorder's {self.num_q_heads} query heads"
            )
        step = self._steps[layer]
        if step >= self.max_steps:
            raise RuntimeError(f"more than max_steps={self.max_steps} generation steps recorded")
        first_key = self.context_len + step - total  # position of key 0: the prefill's last query is at C - 1
        if first_key < 0:
            raise ValueError(
                f"layer {layer} sees {total} keys at step {step}, more than the {self.context_len + step} "
                "positions so far (the capture starts with the probe's prefill)"
            )
        visible = max(0, self.context_len - first_key)  # context positions among the keys: first_key .. C - 1
        self._steps[layer] = step + 1
        scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
        group = num_q_heads // num_kv_heads

        last_query = query[0, :, -1, :].float().reshape(num_kv_heads, group, head_dim)  # [Hkv, G, d]
        keys = key[0].float()  # [Hkv, T, d]
        logits = torch.matmul(last_query, keys.transpose(1, 2)).reshape(num_q_heads, total) * scale  # [Hq, T]
        logits = soft_cap(logits, softcap)
        if attention_mask is not None:
            logits = masked(logits, attention_mask[0, :, -1, :total])  # mask row [1 or Hq, T]
        log_norm = torch.logsumexp(logits, dim=-1)  # [Hq]
        if sinks is not None:  # the sink's logit takes part in the softmax (runtime.math.sinks)
            log_norm = torch.logaddexp(log_norm, sinks.float().to(log_norm.device))
        if visible:
            context_max, context_argmax = logits[:, :visible].max(dim=-1)  # [Hq], [Hq]
            context_weight = torch.exp(context_max - log_norm)
            context_argmax = context_argmax + first_key  # key index -> context position
        else:  # the window has moved past the context: no context token is attended
            context_weight = torch.zeros(num_q_heads, device=query.device)
            context_argmax = torch.zeros(num_q_heads, dtype=torch.long, device=query.device)

        if layer not in self._max_weight:
            self._max_weight[layer] = torch.zeros(self.max_steps, num_q_heads, device=query.device)
            self._argmax[layer] = torch.zeros(self.max_steps, num_q_heads, dtype=torch.long, device=query.device)
            self._rows[layer] = []
        self._max_weight[layer][step] = context_weight
        self._argmax[layer][step] = context_argmax
        if self.keep_rows:
            row = torch.zeros(num_q_heads, self.context_len)  # [Hq, C]: 0 outside the keys
            row[:, first_key : first_key + visible] = torch.exp(logits[:, :visible] - log_norm[:, None]).cpu()
            self._rows[layer].append(row)
        if value is None:
            return None
        weights = torch.exp(logits - log_norm[:, None]).reshape(num_kv_heads, group, total)  # [Hkv, G, T]
        output = torch.matmul(weights, value[0].float())  # [Hkv, G, d]
        return output.reshape(1, 1, num_q_heads, -1).to(query.dtype)  # [B, q, Hq, dv]

    @property
    def steps(self) -> int:
        """Steps recorded (equal across layers once a forward pass has completed)."""
        return min(self._steps) if self._steps else 0

    def results(self) -> dict[str, torch.Tensor]:
        if len(set(self._steps)) != 1:
            raise RuntimeError(f"layers recorded different numbers of steps: {self._steps}")
        steps = self._steps[0]
        layers = range(self.num_layers)
        out = {
            "max_weight": torch.stack([self._max_weight[layer][:steps].cpu() for layer in layers], dim=1)
            if steps
            else torch.zeros(0, self.num_layers, self.num_q_heads),
            "argmax": torch.stack([self._argmax[layer][:steps].cpu() for layer in layers], dim=1)
            if steps
            else torch.zeros(0, self.num_layers, self.num_q_heads, dtype=torch.long),
        }
        if self.keep_rows:
            out["rows"] = (
                torch.stack([torch.stack(self._rows[layer]) for layer in layers], dim=1)
                if steps
                else torch.zeros(0, self.num_layers, self.num_q_heads, self.context_len)
            )
        return out


def capture_attention_forward(recorder: DecodeAttentionRecorder):
    """The ``AttentionInterface`` function that records into ``recorder``.

    Prefill (several queries) and non-float32 models: the fused ``sdpa`` kernel (the reference
    attention on a soft-capping layer), plus the record.  Float32 decode steps: one
    matmul-softmax-matmul that yields the record and the output together (the same attention up
    to float rounding).
    """

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
        layer = recorder.layer_of(module)  # None: a layer held apart, never measured (Gemma 4's sliding ones)
        with torch.no_grad():
            if layer is not None and query.shape[2] == 1 and query.dtype == torch.float32 and not dropout:
                output = recorder.record(layer, query, key, attention_mask, scaling, value, softcap, sinks)
                return output, None
            output, _ = attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
            if layer is not None:
                recorder.record(layer, query, key, attention_mask, scaling, softcap=softcap, sinks=sinks)
        return output, None

    return forward


def capture_attention_implementation(model, recorder: DecodeAttentionRecorder | None = None):
    """``with capture_attention_implementation(model, recorder):`` record every forward pass of
    ``model`` into ``recorder`` inside the block, restore the previous attention after.

    Without a recorder the capture implementation is plain ``sdpa`` (the reference attention on a
    soft-capping layer; a scope around several probes, each of which records in a nested scope of
    its own).
    """
    forward = attention_forward if recorder is None else capture_attention_forward(recorder)
    return attention_implementation(model, CAPTURE_IMPLEMENTATION, forward)
