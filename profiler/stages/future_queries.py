"""The ``future-queries`` stage: statistics of the queries that read a cache after compression.

Expected Attention ("Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00636) needs the distribution of the queries that will
read the cache.  Under question-agnostic compression those are the question's and the answer's,
not calibration prose (the ``query-stats`` stage).  This stage greedy-decodes the behaviour
stage's needle probes (the same probe set, ``--probes`` / the preset's, and ``--max-new-tokens``)
and records the pre-RoPE queries at positions after each probe's context
(:func:`profiler.future_queries.probe_future_queries`): their mean and covariance per (layer,
query head), and ``--query-centres`` k-means centres with weights
(:func:`profiler.future_queries.kmeans_centres`) for the ``prototype_attention`` scorer.

Units are probes, sharded over processes.  The moments are float64 sums (they add up exactly
across shards); the centres are fitted once, on the main process, on at most
``--future-sample`` queries per head: every process keeps the queries of its probes in probe
order until it holds that many, and the main process takes the first that many in probe order.
"""

from __future__ import annotations

import numpy as np

from artifacts import Section
from artifacts.schema import FREE_DIM_LIMITS
from common.command_line import MAX_TOKENS
from common.options import Integer, Option

from .base import RopeRead, ShardedStage

# Centres per head: 1, 4 and 8 measured within the noise of 18 probes of each other; 4 is the
# smaller of the best (docs/results.md R-future-centres-2026-11-22).
DEFAULT_CENTRES = 4
DEFAULT_SAMPLE = 4096


class FutureQueriesStage(ShardedStage):
    name = "future-queries"
    section = "future_queries"
    unit, units = "probe", "probes"
    summary = (
        "greedy-decode the needle probes and accumulate, per (layer, query head), the mean and covariance of "
        "the pre-RoPE queries after each probe's context (its question and answer: the queries that read a "
        "cache compressed before the question), and k-means centres of them (expected_attention:future, "
        "prototype_attention)."
    )

    @classmethod
    def on_by_default(cls, preset) -> bool:
        # Off unless --stages names it: it greedy-decodes every probe a second time (docs/results.md
        # R-quick-profile-2026-11-22), and no policy it serves is the measured best
        # (R-prototypes-heldout-2026-11-22; docs/design.md section 1, "Query prototypes").
        return False

    options_title = "future-queries stage (with --probes and --max-new-tokens)"
    options = (
        Option(
            "--query-centres",
            "query_centres",
            Integer(1, FREE_DIM_LIMITS["K"]),
            DEFAULT_CENTRES,
            f"k-means centres of the future queries per query head, at most {FREE_DIM_LIMITS['K']} "
            f"(default {DEFAULT_CENTRES})",
        ),
        Option(
            "--future-sample",
            "future_sample",
            Integer(1, MAX_TOKENS),
            DEFAULT_SAMPLE,
            f"future queries per head the centres are fitted on, at most (default {DEFAULT_SAMPLE})",
        ),
    )

    @classmethod
    def rope_reads(cls, settings) -> tuple[RopeRead, ...]:
        # Expected Attention (future statistics) and the prototypes rotate these with averaged RoPE
        return (RopeRead("pre-RoPE query statistics and centres", keys=True, queries=True),)

    def __init__(self, context):
        from runtime.compression.prompt_statistics import QueryMoments  # torch: not for the parser

        super().__init__(context)
        self.max_new_tokens = context.settings["max_new_tokens"]
        self.centres = context.settings["query_centres"]
        self.sample = context.settings["future_sample"]
        self.probes = context.probes()
        geometry = context.geometry
        self.totals = QueryMoments(geometry.num_layers, geometry.num_q_heads, geometry.head_dim)
        self.kept: dict[int, np.ndarray] = {}  # probe index -> [T, L, Hq, d] float32, in probe order
        self.kept_tokens = 0

    def config(self) -> dict:
        return {
            **self.probes.config,
            "num_probes": len(self.probes),
            "probes_sha256": self.probes.digest,
            "max_new_tokens": self.max_new_tokens,
            "tokens": "after context_end: question, template tail, greedy answer fed back",
            "centres": self.centres,
            "sample": self.sample,
            "kmeans": {"seeding": "k-means++", "seed": 0, "iterations": 50},
        }

    # -- work: one probe per unit -----------------------------------------------------------------
    def work(self) -> list[int]:
        return self.context.info.shard(len(self.probes))

    def compute(self, index: int):
        from profiler.future_queries import probe_future_queries

        context = self.context
        return probe_future_queries(
            context.model, context.tokenizer, context.geometry, self.probes[index], self.max_new_tokens
        )

    def commit(self, index: int, queries: np.ndarray) -> None:
        for layer in range(queries.shape[1]):
            self.totals.add(layer, queries[:, layer])
        if self.kept_tokens < self.sample and queries.shape[0]:
            self.kept[index] = queries[: self.sample - self.kept_tokens]
            self.kept_tokens += self.kept[index].shape[0]

    def state(self) -> dict[str, np.ndarray]:
        if not self.kept and not self.totals.n.any():
            return {}
        indices = np.array(sorted(self.kept), dtype=np.int64)
        return {
            **self.totals.state(),
            "kept_index": indices,
            "kept_length": np.array([self.kept[i].shape[0] for i in indices], dtype=np.int64),
            "kept": np.concatenate([self.kept[i] for i in indices]) if len(indices) else np.zeros((0,), np.float32),
        }

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        from runtime.compression.prompt_statistics import QueryMoments

        if not arrays:
            return
        self.totals = QueryMoments.from_state({key: arrays[key] for key in ("n", "total", "outer")})
        self.kept, offset = {}, 0
        for index, length in zip(arrays["kept_index"], arrays["kept_length"], strict=True):
            self.kept[int(index)] = arrays["kept"][offset : offset + int(length)]
            offset += int(length)
        self.kept_tokens = offset

    # -- after the work --------------------------------------------------------------------------
    def reduce(self) -> None:
        from profiler import distributed
        from runtime.compression.prompt_statistics import QueryMoments

        info = self.context.info
        self.totals = QueryMoments.from_state(distributed.all_reduce_sum(info, self.totals.state()))
        merged: dict[int, np.ndarray] = {}
        for kept in distributed.gather_objects(info, self.kept):
            merged.update(kept)
        self.kept = merged

    def build(self, sections, config) -> Section:
        from profiler.future_queries import kmeans_centres

        stats = self.totals.finalize()  # n, mean, cov; refuses heads without a query
        ordered = [self.kept[i] for i in sorted(self.kept)]
        sample = np.concatenate(ordered)[: self.sample]  # [N, L, Hq, d]
        layers, heads, dim = sample.shape[1:]
        per_head = sample.reshape(sample.shape[0], layers * heads, dim).transpose(1, 0, 2)  # [L*Hq, N, d]
        centres, weights = kmeans_centres(per_head, self.centres, seed=0, iterations=50)
        # fraction of the sample's squared spread the centres leave unexplained (1 = one mean query)
        spread = ((per_head - per_head.mean(1, keepdims=True)) ** 2).sum((1, 2))
        nearest = ((per_head[:, :, None] - centres[:, None]) ** 2).sum(-1).min(-1).sum(-1)
        unexplained = float(np.mean(nearest / np.maximum(spread, 1e-30)))
        self.say(
            f"future-queries: {len(self.probes)} probes, {int(stats['n'][0, 0])} future queries per head, "
            f"{self.centres} centres fitted on {sample.shape[0]} (k-means leaves {unexplained:.0%} of the "
            f"spread); {self.seconds:.1f} s this run"
        )
        return Section(
            arrays={
                **stats,
                "centres": centres.reshape(layers, heads, self.centres, dim).astype(np.float32),
                "centre_weights": weights.reshape(layers, heads, self.centres),
            }
        )
