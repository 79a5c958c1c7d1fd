"""Held-out needle tasks: what the recommendation stage and ``evaluate-artifact`` measure policies on.

Tasks come from every needle family (``needles.FAMILIES``) on both built-in haystacks (short
simple sentences and prose), at the lengths of the preset, with seeds the profiler never used:
the profiled probes' seed + :data:`EVALUATION_SEED_OFFSET` for the first haystack, + 1 for the
next, and so on (each haystack its own seed, so that no two tasks share a needle or an id).  A
model that cannot answer some of them uncompressed (the embedded 135M model fails most prose
and reasoning tasks, docs/results.md R-embedded-model-2026-11-22) still gives paired evidence:
a task both policies fail is a tie, one only a compressed policy answers is a win.

Imports no torch (``--help`` and the stage's configuration read it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .evaluation_results import EVALUATION_SEED_OFFSET

HAYSTACKS = ("simple", "prose")  # the built-in haystacks (needles.haystacks)
CONTEXT_SHARE = 0.9  # task lengths beyond this share of the model's context are dropped


@dataclass(frozen=True)
class HeldOutTasks:
    """``needles.ProbeSpec`` s, each haystack's with its own seed (one per length when the depths
    differ by length); the tasks are all of theirs."""

    specs: tuple  # of needles.ProbeSpec

    @property
    def seed(self) -> int:
        """The first haystack's seed (the others follow it, one each)."""
        return self.specs[0].seed

    @property
    def families(self) -> tuple[str, ...]:
        return self.specs[0].families

    @property
    def haystacks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(spec.haystack for spec in self.specs))

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(sorted({n for spec in self.specs for n in spec.lengths}))

    @property
    def size(self) -> int:
        return sum(spec.size for spec in self.specs)

    def to_dict(self) -> dict:
        return {"specs": [spec.to_dict() for spec in self.specs]}

    def describe(self) -> str:
        cells = "; ".join(
            dict.fromkeys(
                f"{','.join(str(n) for n in spec.lengths)} tokens at depths {','.join(f'{d:g}' for d in spec.depths)}"
                for spec in self.specs
            )
        )
        return (
            f"{self.size} tasks: {len(self.families)} families x {len(self.haystacks)} haystacks "
            f"({', '.join(self.haystacks)}) x ({cells}) x {self.specs[0].count}; "
            f"seeds {', '.join(str(seed) for seed in dict.fromkeys(spec.seed for spec in self.specs))}"
        )

    def ids(self) -> list[str]:
        """Every task's probe id, in the order of :meth:`probes`, without a tokenizer (an id is its
        family, length, depth, seed and replicate: ``common.probe_ids.probe_id``)."""
        from common.probe_ids import probe_id

        return [probe_id(*cell[:3], spec.seed, cell[3]) for spec in self.specs for cell in spec.cells()]

    def probes(self, tokenizer) -> list:
        """Every task's ``needles.Probe``, haystack by haystack in grid order."""
        from needles import generate_probes

        return [probe for spec in self.specs for probe in generate_probes(spec, tokenizer)]


def held_out_tasks(
    base,
    *,
    families,
    count: int,
    profiler_seed: int | None,
    model_context: int,
    haystacks=HAYSTACKS,
    depths=None,
    seed: int | None = None,
) -> HeldOutTasks:
    """Needle tasks the profiler never saw: ``base`` (a ``needles.ProbeSpec``: lengths, depths,
    tolerance) with ``families``, ``count`` tasks per (family, length, depth) cell, ``depths`` when
    given (a mapping: the depths of each length, lengths it does not name left out), lengths beyond 90%
    of the model's context dropped (ValueError when none is left), the specs of each haystack in
    ``haystacks`` seeded ``seed``, ``seed + 1``, ... where ``seed`` defaults to
    ``profiler_seed + EVALUATION_SEED_OFFSET`` (ValueError when any of them is the profiler's)."""
    lengths = tuple(n for n in base.lengths if n <= CONTEXT_SHARE * model_context)
    if not lengths:
        raise ValueError(
            f"the model's context of {model_context} tokens is too short for these tasks: the shortest task "
            f"length {min(base.lengths)} needs at least {min(base.lengths) / CONTEXT_SHARE:.0f} (90% rule); use "
            "a preset with shorter tasks (e.g. --preset smoke)"
        )
    haystacks = tuple(haystacks)
    if not haystacks or len(set(haystacks)) != len(haystacks):
        raise ValueError(f"held-out tasks need one or more distinct haystacks, got {haystacks}")
    if seed is None:
        seed = (profiler_seed or 0) + EVALUATION_SEED_OFFSET
    seeds = [seed + index for index in range(len(haystacks))]
    if profiler_seed is not None and profiler_seed in seeds:
        raise ValueError(
            f"task seeds {seeds} include the profiler's probe seed {profiler_seed}; evaluation tasks must be unseen"
        )
    if isinstance(depths, dict):  # depths per length: one spec per (haystack, length)
        groups = [((n,), tuple(depths[n])) for n in lengths if n in depths]
        if not groups:
            raise ValueError(f"no task depths given for the lengths {lengths}")
    else:
        groups = [(lengths, None if depths is None else tuple(depths))]
    specs = []
    for haystack, task_seed in zip(haystacks, seeds, strict=True):
        for group_lengths, group_depths in groups:
            changes = {"families": tuple(families), "lengths": group_lengths, "count": count}
            if group_depths is not None:
                changes["depths"] = group_depths
            specs.append(base.replace(**changes, haystack=haystack, seed=task_seed))
    return HeldOutTasks(tuple(specs))
