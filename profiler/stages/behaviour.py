"""The ``behaviour`` stage: REAL's attention-behaviour scores from needle probes.

REAL ("REtrieval-reAsoning and Logic-constructed Attention Behaviors for Long-Context KV Cache
Compression", Eq. 1-3): every probe is greedy-decoded while, at each generated token, each
(layer, query head)'s dominant context token is recorded (:mod:`profiler.attention_capture`,
inside :func:`profiler.behaviour_probe.run_probe`);
its label (retrieval R, bias B, distraction D, widespread W) adds the dominant weight to
``W_R, W_B, W_D, W_W`` (:mod:`profiler.behaviour_scores`), from which RAsc, LCsc and INFsc
follow.  Units are probes, sharded over processes; the section also keeps a per-probe table.
"""

from __future__ import annotations

import argparse

import numpy as np

from artifacts import Section
from profiler.arguments import positive_int

from .base import ShardedStage


class BehaviourStage(ShardedStage):
    name = "behaviour"
    section = "behaviour"
    unit, units = "probe", "probes"
    summary = (
        "run REAL needle probes; greedy-decode each; at every generated token record, per (layer, "
        "query head), which labelled context token (retrieval R, bias B, distraction D, widespread W) "
        "dominates that query's attention; accumulate W_R, W_B, W_D, W_W and derive RAsc, LCsc, INFsc."
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("behaviour stage")
        group.add_argument(
            "--probes",
            dest="probes_file",
            default=None,
            help="JSON-lines probe file (from generate-probes) instead of the preset's needles probes",
        )
        group.add_argument(
            "--max-new-tokens",
            type=positive_int,
            default=None,
            help="greedy decode steps per probe (default: the preset's)",
        )

    def __init__(self, job):
        super().__init__(job)
        self.max_new_tokens = job.setting("max_new_tokens", job.preset.max_new_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def prepare(self) -> None:
        from profiler.behaviour_probe import BehaviourState  # torch: not for the parser

        job = self.job
        self.probes = job.probes()
        longest = self.probes.max_tokens() + self.max_new_tokens
        if longest > job.identity.max_position_embeddings:
            self.say(
                f"warning: the longest probe plus {self.max_new_tokens} new tokens is {longest} tokens, beyond "
                f"the model's {job.identity.max_position_embeddings}-token context"
            )
        self.totals = BehaviourState(job.geometry.num_layers, job.geometry.num_q_heads)

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
        return self.job.info.shard(len(self.probes))

    def compute(self, index: int):
        from profiler.behaviour_probe import run_probe

        job = self.job
        return run_probe(job.model, job.tokenizer, job.geometry, self.probes[index], self.max_new_tokens)

    def commit(self, index: int, result) -> None:
        self.totals.add(index, result)

    def progress_note(self) -> dict[str, str]:
        return {"success": f"{self.totals.success_rate():.0%}"}

    def state(self) -> dict[str, np.ndarray]:
        return self.totals.arrays()

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        from profiler.behaviour_probe import BehaviourState

        self.totals = BehaviourState.from_arrays(arrays)

    # -- after the work --------------------------------------------------------------------------
    def reduce(self) -> None:
        from profiler import distributed

        info, totals = self.job.info, self.totals
        reduced = distributed.all_reduce_sum(info, {"totals": totals.totals, "steps": totals.steps})
        totals.totals, totals.steps = reduced["totals"], reduced["steps"]
        for done in distributed.gather_objects(info, totals.done):
            totals.done.update(done)

    def build(self, sections: dict[str, Section]) -> Section:
        arrays = self.totals.section_arrays(self.probes.table)
        heads = self.job.geometry.num_q_heads
        successes, count = int(arrays["probe_success"].sum()), len(self.probes)
        infsc = arrays["INFsc"].ravel()
        top = ", ".join(f"L{i // heads}H{i % heads}={infsc[i]:.2f}" for i in np.argsort(infsc)[::-1][:3])
        self.say(
            f"behaviour: {count} probes, {int(arrays['probe_steps'].sum())} decode steps, "
            f"success {successes}/{count} ({successes / count:.0%}), top INFsc {top}; "
            f"{self.seconds:.1f} s this run"
        )
        return Section(arrays=arrays)
