"""Named job sizes: which needles probe preset, how many decode steps, how much calibration text.

``smoke`` is a seconds-long check that everything runs; ``quick`` is a useful first profile
of a small model on a laptop CPU (minutes; a trimmed needles ``quick`` grid); ``standard`` is the recommended profile;
``paper`` follows REAL's grid (30 lengths x 33 depths) and is meant for GPUs.
Individual numbers can be overridden on the command line.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ProfilePreset:
    probes: str  # name of the needles probe preset
    max_new_tokens: int  # greedy decode steps per probe (fewer when EOS comes first)
    calib_samples: int  # calibration windows for the query statistics
    calib_tokens: int  # tokens per window
    batch_size: int  # windows per forward pass
    n_sink: int = 4  # leading positions of each window left out of the statistics
    # held-out tasks per (family, haystack, length, depth) cell of the recommendation stage; 0: the stage
    # is off unless --stages names it (then 1)
    recommendation_count: int = 0
    # the recommendation stage's held-out task depths per length (empty: the probes' lengths x 10/50/90)
    recommendation_depths: tuple[tuple[int, tuple[float, ...]], ...] = ()
    # its candidate policies (empty: profiler.evaluation_results.RECOMMENDATION_CANDIDATES)
    recommendation_candidates: tuple[str, ...] = ()
    # stages a job with this preset and no --stages leaves out (--stages names them to run them)
    stages_off: tuple[str, ...] = ()
    probe_overrides: tuple[tuple[str, object], ...] = ()  # ProbeSpec fields replaced in the needles preset

    def to_dict(self) -> dict:
        return asdict(self)


RECOMMENDATION_COUNT_QUICK = 1
# 7 families x 2 haystacks x (1K at 4 depths + 2K at 1): 70 tasks, the flagship alone under them, at
# other depths than the profiled probes' 25/75. Each candidate costs 5 more decoded rows per task (a
# task with every candidate: 24-37 s on two cores; the flagship alone: 8-13 s, a 2K task 1.6x a 1K
# one); at n = 70 a cheaper candidate replaces the flagship only by winning 4+ tasks without a loss
# (docs/results.md R-recommendation-cost-2026-11-25, R-quick-profile-2026-11-25).
RECOMMENDATION_DEPTHS_QUICK = ((1024, (10.0, 40.0, 60.0, 90.0)), (2048, (50.0,)))

PRESETS: dict[str, ProfilePreset] = {
    "smoke": ProfilePreset("smoke", max_new_tokens=6, calib_samples=2, calib_tokens=64, batch_size=2),
    # needles' quick grid (7 families x 1K/2K/4K x 3 depths) takes far longer (docs/results.md
    # R-quick-grid-2026-11-21); this keeps every family at 1K and 2K tokens and two depths (28 probes, a few minutes).
    "quick": ProfilePreset(
        "quick",
        max_new_tokens=24,
        calib_samples=16,
        calib_tokens=512,
        batch_size=4,
        probe_overrides=(("lengths", (1024, 2048)), ("depths", (25.0, 75.0))),
        recommendation_count=RECOMMENDATION_COUNT_QUICK,
        recommendation_depths=RECOMMENDATION_DEPTHS_QUICK,
        recommendation_candidates=("flagship",),
        # what serves no policy the quick recommendation measures, left out for make profile's time
        # (docs/results.md R-quick-profile-2026-11-25): curve and learned policies need --stages
        stages_off=("budget-curves", "learned-scorer"),
    ),
    "standard": ProfilePreset(
        "standard", max_new_tokens=32, calib_samples=128, calib_tokens=1024, batch_size=4, recommendation_count=1
    ),
    "paper": ProfilePreset(
        "paper", max_new_tokens=48, calib_samples=512, calib_tokens=2048, batch_size=2, recommendation_count=1
    ),
}
