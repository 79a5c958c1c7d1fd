"""The ``query-stats`` stage: pre-RoPE query mean and covariance per (layer, query head).

Expected Attention ("Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00636) models future queries as a Gaussian; this
stage measures its mean and covariance on calibration text (:mod:`runtime.compression.prompt_statistics`:
forward hooks on the pre-RoPE query module, float64 sums ``n, sum q, sum q q^T``, the first
``n_sink`` positions of every window left out).  Units are batches of calibration windows.
"""

from __future__ import annotations

import numpy as np

from artifacts import Section
from common.command_line import MAX_COUNT
from common.options import Integer, Option

from .base import RopeRead, ShardedStage


class QueryStatsStage(ShardedStage):
    name = "query-stats"
    section = "query_stats"
    unit, units = "batch", "batches"
    summary = (
        "run calibration text and accumulate the mean and covariance of the pre-RoPE queries of every "
        "(layer, query head) (Expected Attention statistics)."
    )
    options = (
        Option(
            "--batch-size",
            "batch_size",
            Integer(1, MAX_COUNT),
            lambda preset: preset.batch_size,
            "calibration windows per forward pass (default: the preset's)",
        ),
    )

    @classmethod
    def rope_reads(cls, settings) -> tuple[RopeRead, ...]:
        # Expected Attention rotates these statistics with RoPE averaged over its horizon
        return (RopeRead("pre-RoPE query statistics for Expected Attention", keys=True, queries=True),)

    def __init__(self, context):
        from runtime.compression.prompt_statistics import QueryMoments  # torch: not for the parser

        super().__init__(context)
        self.batch_size = context.settings["batch_size"]
        geometry = context.geometry
        self.totals = QueryMoments(geometry.num_layers, geometry.num_q_heads, geometry.head_dim)
        # The hooks fill a per-batch accumulator, folded into the totals once the forward pass
        # is complete: an interruption mid-pass leaves the totals untouched.  Each layer sees
        # one addition per batch either way, so the sums are bit-identical to direct hooking.
        self.batch_sums = QueryMoments(*self.totals.shape)
        self.done = 0

    def config(self) -> dict:
        context = self.context
        return {
            **context.calibration_config(),
            "batch_size": self.batch_size,
            "n_sink": context.settings["n_sink"],
            "windows_sha256": context.windows_digest(),
        }

    # -- work: one batch of calibration windows per unit ---------------------------------------------
    def work(self) -> list[list[int]]:
        shard = self.context.info.shard(self.context.windows.shape[0])
        return [shard[i : i + self.batch_size] for i in range(0, len(shard), self.batch_size)]

    def running(self):
        from contextlib import ExitStack

        import torch

        stack = ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(self.batch_sums.collect(self.context.geometry, n_sink=self.settings["n_sink"]))
        return stack

    def compute(self, batch: list[int]) -> None:
        context = self.context
        device = context.model.get_input_embeddings().weight.device
        self.batch_sums.reset()
        context.model.model(input_ids=context.windows[batch].to(device), use_cache=False)  # [b, T]

    def commit(self, batch: list[int], result) -> None:
        self.totals.merge(self.batch_sums)
        self.done += 1

    def state(self) -> dict[str, np.ndarray]:
        # [L, Hq, d, d] sums are big (0.7 GB at 70B): saved only once something was added
        return self.totals.state() if self.done else {}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        from runtime.compression.prompt_statistics import QueryMoments

        if arrays:
            self.totals = QueryMoments.from_state(arrays)
            self.done = 1

    # -- after the work ----------------------------------------------------------------------------
    def reduce(self) -> None:
        from profiler import distributed
        from runtime.compression.prompt_statistics import QueryMoments

        self.totals = QueryMoments.from_state(distributed.all_reduce_sum(self.context.info, self.totals.state()))

    def build(self, sections, config) -> Section:
        settings = self.settings
        stats = self.totals.finalize()
        trace = np.trace(stats["cov"].astype(np.float64), axis1=-2, axis2=-1)
        self.say(
            f"query-stats: {settings['calib_samples']} windows x {settings['calib_tokens']} tokens, "
            f"{int(stats['n'][0, 0])} queries per head (n_sink={settings['n_sink']}), "
            f"mean trace(cov) {trace.mean():.3g}; {self.seconds:.1f} s this run"
        )
        return Section(arrays=stats, attrs={"n_sink": int(settings["n_sink"])})
