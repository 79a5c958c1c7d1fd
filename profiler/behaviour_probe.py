"""One behaviour probe: greedy-decode it, record the dominant context tokens, accumulate REAL's matrix.

For each probe (batch 1): prefill the whole prompt with the fused ``sdpa`` kernel, decode
greedily with ``generate()`` while :mod:`profiler.attention_capture` records, for every
generated token and every (layer, query head), the dominant context token and its weight;
:func:`profiler.behaviour_scores.dominant_totals` turns those into the probe's contribution
to ``W_W, W_R, W_B, W_D``.  The generated text is checked against the probe's answer.

:class:`BehaviourState` holds the running sums (float64, added in probe order) and the
per-probe table; it round-trips through the resume work file and reduces across processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from needles import answer_is_correct
from needles.probe import Probe
from profiler.attention_capture import DecodeAttentionRecorder, capture_attention_implementation
from profiler.behaviour_scores import NUM_LABELS, behaviour_scores, dominant_totals
from profiler.greedy import greedy_generate
from runtime.geometry import ModelGeometry


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
    recorder = DecodeAttentionRecorder(geometry.num_layers, geometry.num_q_heads, context, max_new_tokens)
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
