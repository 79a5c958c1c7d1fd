"""The ``behaviour`` stage's method: REAL's attention-behaviour sums and scores, one probe at a time.

REAL ("REtrieval-reAsoning and Logic-constructed Attention Behaviors for Long-Context KV Cache
Compression", Eq. 1-3; docs/design.md section 3).  At every decode step, for every (layer,
query head), the query's attention distribution over the context (the prompt tokens) has one
*dominant* token, its argmax.  The label of that token (``W``, ``R``, ``B`` or ``D``, see
:mod:`needles.probe`) is the step's dominant behaviour for the head, and the maximum weight is
added to that head's accumulator ``W_<label>``:

    W[l, h, label(argmax_i a_i)] += max_i a_i          (one step, one head)

Scores per query head, with a tiny floor on the denominators so that a head that never
pointed at an ``R``/``B``/``D`` token scores 0 rather than NaN:

    RAsc  = W_R / (W_R + W_D)        LCsc = W_R / (W_R + W_B)
    INFsc = 2 RAsc LCsc / (RAsc + LCsc)

One probe (:func:`run_probe`, batch 1): prefill the whole prompt with the fused ``sdpa``
kernel, decode greedily with ``generate()`` while :mod:`profiler.attention_capture` records,
for every generated token and every (layer, query head), the dominant context token and its
weight (``(max weight, argmax position)`` per step and head); :func:`dominant_totals` turns
those into the probe's contribution to ``W_W, W_R, W_B, W_D``.  The generated text is checked
against the probe's answer.

:class:`BehaviourState` holds the running sums (float64, added in probe order) and the
per-probe table; it round-trips through the resume work file and reduces across processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.formulas import behaviour_scores
from needles import answer_is_correct
from needles.probe import LABELS, Probe
from profiler.attention_capture import DecodeAttentionRecorder, capture_attention_implementation
from profiler.greedy import greedy_generate
from runtime.math.geometry import ModelGeometry

NUM_LABELS = len(LABELS)  # W, R, B, D: the last axis of an accumulator, in this order
LABEL_W, LABEL_R, LABEL_B, LABEL_D = (LABELS.index(name) for name in ("W", "R", "B", "D"))


def dominant_totals(
    max_weight: torch.Tensor | np.ndarray, argmax_pos: torch.Tensor | np.ndarray, labels: np.ndarray
) -> np.ndarray:
    """Sum the dominant-behaviour weights of a set of steps.

    ``max_weight``: ``[S, L, Hq]`` float, the largest attention weight over the context.
    ``argmax_pos``: ``[S, L, Hq]`` int, the context position holding it.
    ``labels``: ``[C]`` uint8 behaviour codes of the context positions.
    Returns float64 ``[L, Hq, 4]``: per head, the weight summed per dominant label
    (axis order ``W, R, B, D``).
    """
    weights = np.asarray(torch.as_tensor(max_weight).double().cpu())
    positions = np.asarray(torch.as_tensor(argmax_pos).cpu()).astype(np.int64)
    labels = np.asarray(labels)
    if weights.shape != positions.shape or weights.ndim != 3:
        raise ValueError(f"max_weight {weights.shape} and argmax_pos {positions.shape} must both be [S, L, Hq]")
    if positions.size and (positions.min() < 0 or positions.max() >= labels.shape[0]):
        raise ValueError(f"argmax positions outside the context of {labels.shape[0]} labelled tokens")
    steps, layers, heads = weights.shape
    codes = labels[positions]  # [S, L, Hq] label of each dominant token
    totals = np.zeros((layers, heads, NUM_LABELS), dtype=np.float64)
    for code in range(NUM_LABELS):
        # Sum over steps in step order (axis 0) so the result does not depend on batching.
        totals[:, :, code] = np.where(codes == code, weights, 0.0).sum(axis=0)
    return totals


def dominant_totals_from_attention(attention: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Reference form: ``attention [S, L, Hq, C]`` distributions over the context -> ``[L, Hq, 4]``."""
    attention = np.asarray(attention, dtype=np.float64)
    if attention.ndim != 4 or attention.shape[-1] != len(labels):
        raise ValueError(f"attention must be [S, L, Hq, C] with C = {len(labels)}, got {attention.shape}")
    return dominant_totals(attention.max(axis=-1), attention.argmax(axis=-1), labels)


# -- one probe --------------------------------------------------------------------------------
@dataclass
class ProbeResult:
    totals: np.ndarray  # [L, Hq, 4] float64, dominant weight per label (W, R, B, D)
    steps: int  # generated tokens = recorded steps
    success: bool
    text: str


def run_probe(model, tokenizer, geometry: ModelGeometry, probe: Probe, max_new_tokens: int) -> ProbeResult:
    """Greedy-decode one probe with decode-attention capture: the model runs the capture
    attention function, recording into this probe's recorder, for the probe's ``generate()``
    (inside an outer ``capture_attention_implementation(model)`` scope, if any, that then
    comes back)."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([probe.input_ids], dtype=torch.long, device=device)  # [1, C]
    context = ids.shape[1]
    recorder = DecodeAttentionRecorder(
        geometry.num_layers, geometry.num_q_heads, context, max_new_tokens, layer_of=geometry.layer_of
    )
    with torch.no_grad(), capture_attention_implementation(model, recorder):
        out = greedy_generate(model, tokenizer, ids, max_new_tokens)
    generated = out[0, context:]
    records = recorder.results()
    steps = int(records["max_weight"].shape[0])
    if steps != generated.shape[0]:
        raise RuntimeError(f"recorded {steps} steps for {generated.shape[0]} generated tokens")
    totals = dominant_totals(records["max_weight"], records["argmax"], probe.labels())
    text = tokenizer.decode(generated, skip_special_tokens=True)
    return ProbeResult(totals, steps, answer_is_correct(text, probe), text)


class BehaviourState:
    """Running sums over probes and the per-probe table (probe index -> success, steps)."""

    def __init__(self, num_layers: int, num_q_heads: int):
        self.totals = np.zeros((num_layers, num_q_heads, NUM_LABELS), dtype=np.float64)  # W, R, B, D
        self.steps = np.zeros((num_layers, num_q_heads), dtype=np.int64)
        self.done: dict[int, tuple[bool, int]] = {}  # probe index -> (success, steps)

    def add(self, index: int, result: ProbeResult) -> None:
        self.totals += result.totals
        self.steps += result.steps
        self.done[index] = (bool(result.success), int(result.steps))

    # -- checkpoint round trip ------------------------------------------------------------
    def arrays(self) -> dict[str, np.ndarray]:
        indices = np.array(sorted(self.done), dtype=np.int64)
        return {
            "behaviour_totals": self.totals,
            "behaviour_steps": self.steps,
            "behaviour_index": indices,
            "behaviour_success": np.array([self.done[i][0] for i in indices], dtype=np.uint8),
            "behaviour_probe_steps": np.array([self.done[i][1] for i in indices], dtype=np.int64),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> BehaviourState:
        state = cls(*arrays["behaviour_totals"].shape[:2])
        state.totals[...] = arrays["behaviour_totals"]
        state.steps[...] = arrays["behaviour_steps"]
        for index, success, steps in zip(
            arrays["behaviour_index"], arrays["behaviour_success"], arrays["behaviour_probe_steps"], strict=True
        ):
            state.done[int(index)] = (bool(success), int(steps))
        return state

    # -- the artifact section -------------------------------------------------------------
    def section_arrays(self, probe_table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The ``behaviour`` section's arrays; ``probe_table`` holds ``probe_length``,
        ``probe_depth``, ``probe_family``, ``probe_seed`` ``[P]``; every probe must be done."""
        count = len(probe_table["probe_length"])
        missing = [i for i in range(count) if i not in self.done]
        if missing:
            raise RuntimeError(f"{len(missing)} probes were not run (first: {missing[0]})")
        w_w, w_r, w_b, w_d = (self.totals[..., code] for code in range(NUM_LABELS))
        rasc, lcsc, infsc = behaviour_scores(w_r, w_b, w_d)
        return {
            "W_R": w_r.copy(),
            "W_B": w_b.copy(),
            "W_D": w_d.copy(),
            "W_W": w_w.copy(),
            "steps": self.steps.copy(),
            "RAsc": rasc,
            "LCsc": lcsc,
            "INFsc": infsc,
            **{name: np.asarray(values).copy() for name, values in probe_table.items()},
            "probe_success": np.array([self.done[i][0] for i in range(count)], dtype=np.uint8),
            "probe_steps": np.array([self.done[i][1] for i in range(count)], dtype=np.int64),
        }

    def success_rate(self) -> float:
        return float(np.mean([s for s, _ in self.done.values()])) if self.done else 0.0
