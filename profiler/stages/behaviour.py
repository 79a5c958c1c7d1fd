"""The ``behaviour`` stage: REAL's attention-behaviour scores from needle probes.

REAL ("REtrieval-reAsoning and Logic-constructed Attention Behaviors for Long-Context KV Cache
Compression", Eq. 1-3): every probe is greedy-decoded while, at each generated token, each
(layer, query head)'s dominant context token is recorded (:mod:`profiler.attention_capture`,
inside :func:`profiler.behaviour.run_probe`);
its label (retrieval R, bias B, distraction D, widespread W) adds the dominant weight to
``W_R, W_B, W_D, W_W`` (:mod:`profiler.behaviour`), from which RAsc, LCsc and INFsc
follow.  Units are probes, sharded over processes; the section also keeps a per-probe table.
"""

from __future__ import annotations

import numpy as np

from artifacts import Section

from .base import ShardedStage


class BehaviourStage(ShardedStage):
    """Options: the shared ``--probes`` and ``--max-new-tokens`` (:mod:`profiler.stages.context`)."""

    name = "behaviour"
    section = "behaviour"
    unit, units = "probe", "probes"
    summary = (
        "run REAL needle probes; greedy-decode each; at every generated token record, per (layer, "
        "query head), which labelled context token (retrieval R, bias B, distraction D, widespread W) "
        "dominates that query's attention; accumulate W_R, W_B, W_D, W_W and derive RAsc, LCsc, INFsc."
    )

    def __init__(self, context):
        from profiler.behaviour import BehaviourState  # torch: not for the parser

        super().__init__(context)
        self.max_new_tokens = context.settings["max_new_tokens"]
        self.probes = context.probes()
        longest = self.probes.max_tokens() + self.max_new_tokens
        if longest > context.identity.max_position_embeddings:
            self.say(
                f"warning: the longest probe plus {self.max_new_tokens} new tokens is {longest} tokens, beyond "
                f"the model's {context.identity.max_position_embeddings}-token context"
            )
        self.totals = BehaviourState(context.geometry.num_layers, context.geometry.num_q_heads)

    def config(self) -> dict:
        return {
            **self.probes.config,
            "num_probes": len(self.probes),
            "probes_sha256": self.probes.digest,
            "max_new_tokens": self.max_new_tokens,
            "decoding": "greedy",
            "context": "prompt tokens",
            "prefill": "sdpa",
        }

    # -- work: one probe per unit -----------------------------------------------------------------
    def work(self) -> list[int]:
        return self.context.info.shard(len(self.probes))

    def compute(self, index: int):
        from profiler.behaviour import run_probe

        context = self.context
        return run_probe(context.model, context.tokenizer, context.geometry, self.probes[index], self.max_new_tokens)

    def commit(self, index: int, result) -> None:
        self.totals.add(index, result)

    def progress_note(self) -> dict[str, str]:
        return {"success": f"{self.totals.success_rate():.0%}"}

    def state(self) -> dict[str, np.ndarray]:
        return self.totals.arrays()

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        from profiler.behaviour import BehaviourState

        self.totals = BehaviourState.from_arrays(arrays)

    # -- after the work --------------------------------------------------------------------------
    def reduce(self) -> None:
        from profiler import distributed

        info, totals = self.context.info, self.totals
        reduced = distributed.all_reduce_sum(info, {"totals": totals.totals, "steps": totals.steps})
        totals.totals, totals.steps = reduced["totals"], reduced["steps"]
        for done in distributed.gather_objects(info, totals.done):
            totals.done.update(done)

    def build(self, sections, config) -> Section:
        arrays = self.totals.section_arrays(self.probes.table)
        heads = self.context.geometry.num_q_heads
        successes, count = int(arrays["probe_success"].sum()), len(self.probes)
        infsc = arrays["INFsc"].ravel()
        top = ", ".join(f"L{i // heads}H{i % heads}={infsc[i]:.2f}" for i in np.argsort(infsc)[::-1][:3])
        self.say(
            f"behaviour: {count} probes, {int(arrays['probe_steps'].sum())} decode steps, "
            f"success {successes}/{count} ({successes / count:.0%}), top INFsc {top}; "
            f"{self.seconds:.1f} s this run"
        )
        return Section(arrays=arrays)
