"""The ``learned-scorer`` stage: a per-head token scorer distilled from KVzip's reconstruction importance.

:mod:`profiler.learned_scorer` has the method (teacher, features, ridge regression).  Units
are calibration windows (and, with ``--scorer-probes N``, the contexts of needle probes whose
retrieval-span tokens are raised to the top of the teacher's scores: REAL's labels as
positives): each adds one reconstruction pass to float64 sums (sharded, resumable).  The
last ``max(1, N // 5)`` windows are held out: after the sums are reduced, the main process
records them, picks each head's ridge strength by the held-out rank correlation between
prediction and teacher, and writes that correlation and the R^2.
"""

from __future__ import annotations

import numpy as np

from artifacts import Section
from common.command_line import MAX_COUNT
from common.options import Integer, Option
from needles.probe import LABEL_CODE

from .base import RopeRead, ShardedStage

# torch and profiler.learned_scorer (torch) are imported where they are used: building
# profile-model's parser imports this module, and --help must not wait for torch.


class LearnedScorerStage(ShardedStage):
    name = "learned-scorer"
    section = "learned_scorer"
    unit, units = "window", "windows"
    summary = (
        "fit, per KV head, a linear map from a token's pre-RoPE key and value to the log of its KVzip "
        "reconstruction importance (how much attention the model pays it while repeating the "
        "context), on calibration text; the runtime's 'learned' scorer evaluates it. Off by default on the "
        "quick preset (make profile's time; --stages runs it)."
    )
    options = (
        Option(
            "--scorer-probes",
            "scorer_probes",
            Integer(0, MAX_COUNT),
            0,
            "also fit on the contexts of the N shortest needle probes, their R spans raised to the top "
            "(default 0: calibration text only)",
        ),
    )

    @classmethod
    def check_settings(cls, settings) -> None:
        if settings["calib_samples"] < 2:
            raise ValueError("the learned-scorer stage needs at least 2 calibration windows (one is held out)")

    @classmethod
    def rope_reads(cls, settings) -> tuple[RopeRead, ...]:
        # fitted on pre-RoPE keys; the learned scorer un-rotates the cached keys to evaluate it
        return (RopeRead("the learned scorer of pre-RoPE keys"),)

    def __init__(self, context):
        import torch

        from profiler.learned_scorer import RECONSTRUCTION_INSTRUCTION, RidgeSums

        super().__init__(context)
        count = context.settings["calib_samples"]
        self.held_out = max(1, count // 5)
        self.fit_windows = count - self.held_out
        geometry = context.geometry
        features = geometry.head_dim + geometry.value_head_dim  # [pre-RoPE key, value]
        self.sums = [RidgeSums(geometry.num_kv_heads, features, 1) for _ in range(geometry.num_layers)]
        ids = context.tokenizer(RECONSTRUCTION_INSTRUCTION, add_special_tokens=False)["input_ids"]
        self.instruction = torch.tensor(ids, dtype=torch.long)
        self.probes = []
        count = int(context.settings["scorer_probes"])
        if count:
            probe_set = context.probes()  # the behaviour stage's probes
            order = np.argsort(probe_set.table["probe_length"], kind="stable")[:count]
            self.probes = [probe_set[int(i)] for i in sorted(order)]

    def config(self) -> dict:
        from profiler.learned_scorer import RECONSTRUCTION_INSTRUCTION, RIDGE_GRID

        context = self.context
        config = {
            **context.calibration_config(),
            "windows_sha256": context.windows_digest(),
            "teacher": "kvzip",
            "instruction": RECONSTRUCTION_INSTRUCTION,
            "features": "kv",
            "held_out_windows": self.held_out,
            "ridge_grid": list(RIDGE_GRID),
        }
        if self.probes:
            config["probes"] = {
                "preset": context.preset.probes,
                "ids": [probe.id for probe in self.probes],
                "positives": "R-span tokens raised to each head's maximum teacher score",
            }
        return config

    # -- work: one calibration window or probe context per unit ------------------------------------------
    def work(self) -> list[int]:
        """Units: fit windows ``0 .. fit_windows-1``, then probe ``j`` as ``-1 - j``."""
        units = list(range(self.fit_windows)) + [-1 - j for j in range(len(self.probes))]
        return [units[i] for i in self.context.info.shard(len(units))]

    def compute(self, unit: int):
        import torch

        from profiler.learned_scorer import record_window

        if unit >= 0:
            return record_window(self.context.model, self.context.windows[unit], self.instruction)
        probe = self.probes[-1 - unit]
        records = record_window(
            self.context.model, torch.tensor(probe.context_ids(), dtype=torch.long), self.instruction
        )
        positive = torch.from_numpy(probe.labels()[: probe.context_end] == LABEL_CODE["R"])  # [C]
        for record in records:  # REAL's retrieval tokens must be kept: the top of every head
            top = record.teacher.max(dim=1, keepdim=True).values  # [Hkv, 1]
            record.teacher = torch.where(positive.unsqueeze(0), top.expand_as(record.teacher), record.teacher)
        return records

    def commit(self, unit: int, records) -> None:
        for layer, record in enumerate(records):
            self.sums[layer].add(record.kv, record.teacher.unsqueeze(-1))

    def state(self) -> dict[str, np.ndarray]:
        return {"zz": np.stack([s.zz for s in self.sums]), "zy": np.stack([s.zy for s in self.sums])}

    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        if arrays:
            for layer, sums in enumerate(self.sums):
                sums.restore({"zz": arrays["zz"][layer], "zy": arrays["zy"][layer]})

    # -- after the work ----------------------------------------------------------------------------
    def reduce(self) -> None:
        from profiler import distributed

        reduced = distributed.all_reduce_sum(self.context.info, self.state())
        self.restore(reduced)

    def build(self, sections, config) -> Section:
        from profiler.learned_scorer import held_out_choice, record_window

        context = self.context
        held_out = (  # recorded one window at a time: held_out_choice keeps no window's features
            record_window(context.model, context.windows[index], self.instruction)
            for index in range(self.fit_windows, self.settings["calib_samples"])
        )
        best = held_out_choice(self.sums, held_out)
        weights = best["weights"]
        fit_tokens = int(round(self.sums[0].zz[0, -1, -1]))
        held_out_tokens = int(best["tokens"])
        rho = best["rank_correlation"]
        self.say(
            f"learned-scorer: fitted on {self.fit_windows} windows and {len(self.probes)} probes "
            f"({fit_tokens} tokens), held out "
            f"{self.held_out} ({held_out_tokens} tokens): rank correlation with the KVzip teacher mean "
            f"{rho.mean():.3f} (min {rho.min():.3f}), R^2 mean {best['r2'].mean():.3f}; "
            f"{self.seconds:.1f} s this run"
        )
        return Section(
            arrays={
                "weights": weights,
                "bias": best["bias"],
                "ridge": best["ridge"],
                "r2": best["r2"],
                "rank_correlation": rho,
            },
            attrs={"features": "kv", "teacher": "kvzip", "fit_tokens": fit_tokens, "held_out_tokens": held_out_tokens},
        )
