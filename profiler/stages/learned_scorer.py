"""The ``learned-scorer`` stage: a per-head token scorer distilled from KVzip's reconstruction importance.

:mod:`profiler.scorer_fitting` has the method (teacher, features, ridge regression).  Units
are calibration windows: each adds one layer-by-layer reconstruction pass to float64 sums
(sharded, resumable).  The last ``max(1, N // 5)`` windows are held out: after the sums are
reduced, the main process records them, picks each head's ridge strength by the held-out rank
correlation between prediction and teacher, and writes that correlation and the R^2.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from artifacts import Section
from profiler.scorer_fitting import (
    RECONSTRUCTION_INSTRUCTION,
    RIDGE_GRID,
    RidgeSums,
    predict,
    r_squared,
    record_window,
    spearman,
)

from .base import Stage


class LearnedScorerStage(Stage):
    name = "learned-scorer"
    section = "learned_scorer"
    unit, units = "window", "windows"
    summary = (
        "fit, per KV head, a linear map from a token's pre-RoPE key and value to the log of its KVzip "
        "reconstruction importance (how much attention the model pays it while repeating the "
        "context), on calibration text; the runtime's 'learned' scorer evaluates it."
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """No options of its own: it uses the calibration text."""

    def prepare(self) -> None:
        job = self.job
        count = job.calib_samples
        if count < 2:
            raise ValueError("the learned-scorer stage needs at least 2 calibration windows (one is held out)")
        self.held_out = max(1, count // 5)
        self.fit_windows = count - self.held_out
        geometry = job.geometry
        features = 2 * geometry.head_dim
        self.sums = [RidgeSums(geometry.num_kv_heads, features, 1) for _ in range(geometry.num_layers)]
        ids = job.tokenizer(RECONSTRUCTION_INSTRUCTION, add_special_tokens=False)["input_ids"]
        self.instruction = torch.tensor(ids, dtype=torch.long)
        self.fit_tokens = 0

    def config(self) -> dict:
        job = self.job
        return {
            **job.calibration_config(),
            "windows_sha256": job.windows_digest(),
            "teacher": "kvzip",
            "instruction": RECONSTRUCTION_INSTRUCTION,
            "features": "kv",
            "held_out_windows": self.held_out,
            "ridge_grid": list(RIDGE_GRID),
        }

    # -- work: one calibration window per unit ---------------------------------------------------------
    def work(self) -> list[int]:
        return [index for index in self.job.info.shard(self.job.calib_samples) if index < self.fit_windows]

    def compute(self, index: int):
        return record_window(self.job.model, self.job.windows[index], self.instruction)

    def commit(self, index: int, records) -> None:
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

        reduced = distributed.all_reduce_sum(self.job.info, self.state())
        self.restore(reduced)

    def build(self, sections: dict[str, Section]) -> Section:
        job, geometry = self.job, self.job.geometry
        layers, heads = geometry.num_layers, geometry.num_kv_heads
        held_out = [
            record_window(job.model, job.windows[index], self.instruction)
            for index in range(self.fit_windows, job.calib_samples)
        ]
        best = {name: np.zeros((layers, heads)) for name in ("ridge", "r2", "rank_correlation", "bias")}
        best["rank_correlation"][:] = -2.0
        weights = np.zeros((layers, heads, 2 * geometry.head_dim))
        for layer in range(layers):
            teacher = torch.cat([w[layer].teacher for w in held_out], dim=1).double().numpy()  # [Hkv, n]
            features = torch.cat([w[layer].kv for w in held_out], dim=1).double().numpy()  # [Hkv, n, F]
            for ridge in RIDGE_GRID:
                solution = self.sums[layer].solve(ridge)  # [Hkv, F+1, 1]
                prediction = predict(solution, features)[:, :, 0]  # [Hkv, n]
                for head in range(heads):
                    rho = spearman(prediction[head], teacher[head])
                    if rho > best["rank_correlation"][layer, head]:
                        best["rank_correlation"][layer, head] = rho
                        best["r2"][layer, head] = r_squared(prediction[head], teacher[head])
                        best["ridge"][layer, head] = ridge
                        weights[layer, head] = solution[head, :-1, 0]
                        best["bias"][layer, head] = solution[head, -1, 0]
        fit_tokens = int(round(self.sums[0].zz[0, -1, -1]))
        held_out_tokens = int(sum(w[0].teacher.shape[1] for w in held_out))
        rho = best["rank_correlation"]
        self.say(
            f"learned-scorer: fitted on {self.fit_windows} windows ({fit_tokens} tokens), held out "
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
