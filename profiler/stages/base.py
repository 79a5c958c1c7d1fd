"""What a calibration stage is, and what the job does for every stage.

A stage turns model runs into one artifact section.  It declares

* ``name`` (as ``--stages`` spells it), ``section`` (the artifact section it writes),
  ``summary`` (one paragraph for ``profile-model --help``), ``unit`` / ``units`` (what its
  progress bar counts) and ``add_arguments`` (its own command-line options);
* ``config()``: the JSON-able settings recorded in the artifact's config under ``section``
  (and part of the resume fingerprint, so a work file of other settings is refused);

and implements the parts it needs of one life cycle, which :class:`profiler.job.ProfileJob`
runs the same way for every stage:

1. ``prepare()`` after the model is loaded (read probes, check settings against the model);
   ``check(existing)`` before any work, with the section names of the artifact already at the
   output path (a stage that needs another section refuses here, not after an hour);
2. sharded, resumable work (a :class:`ShardedStage`): ``work()`` returns this process's
   units, in order.
   Inside ``running()`` (a context manager around the whole loop, e.g. an attention capture)
   the job calls ``compute(unit)`` (may be interrupted: must not touch the stage's totals)
   and then ``commit(unit, result)`` with Ctrl-C / SIGTERM held off, so the totals and the
   progress counter always move together.  Every ``checkpoint_every`` units the job saves
   ``state()`` (numpy arrays) into the work file; ``--resume`` hands them to ``restore()``;
3. ``reduce()`` of a sharded stage on every process: add up the shards (``profiler.distributed``);
4. ``build(sections)`` on the main process only: the section, given the sections built so far
   in this run merged over those of the existing artifact (the budgets stage reads INFsc from
   there).  Unsharded work (the moments stage) happens here.

Adding a stage: a module in this package with a :class:`Stage` (or :class:`ShardedStage`)
subclass, its entry in ``profiler.stages.STAGES``, a schema entry in ``artifacts/schema.py`` and its description in
``docs/artifact-format.md`` (and a ``runtime.Calibration`` field when the runtime serves it).
The job, ``profile-model``'s parser and help, resume, multi-process reduction, and
``inspect-artifact`` (a generic summary of any section) need no change; a dedicated summary in
``artifacts/summary.py`` or a heatmap in ``artifacts/report.py`` is optional.

``profile-model``'s parser imports every stage module for its ``name``, ``summary`` and
``add_arguments``, and ``--help`` must not wait for torch: a stage module imports torch, and
the method modules that import it, inside the methods that use them
(``tests/test_cli_conventions.py`` checks).
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from artifacts import Section

if TYPE_CHECKING:
    from profiler.job import ProfileJob


class Stage(ABC):
    """A stage without sharded work (budgets, moments); see the module docstring."""

    name: ClassVar[str]
    section: ClassVar[str]
    summary: ClassVar[str]
    unit: ClassVar[str] = "item"  # what its progress (sharded work) counts
    units: ClassVar[str] = "items"  # the plural

    def __init__(self, job: ProfileJob):
        self.job = job

    @classmethod
    def on_by_default(cls, preset) -> bool:
        """Whether a job with this preset (``profiler.presets.ProfilePreset``) and no ``--stages`` runs it."""
        return True

    @classmethod  # noqa: B027 - an optional hook
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this stage's options (an argument group) to ``profile-model``'s parser."""

    def prepare(self) -> None:  # noqa: B027 - optional hook
        """Called once the model is loaded."""

    def check(self, existing: set[str]) -> None:  # noqa: B027 - optional hook
        """Refuse (ValueError) before any work when something this stage needs is missing."""

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The JSON-able settings recorded in the artifact's config under ``section``."""

    @abstractmethod
    def build(self, sections: dict[str, Section]) -> Section:
        """The artifact section (main process only)."""

    def say(self, message: str) -> None:
        self.job.say(message)


class ShardedStage(Stage):
    """A stage with sharded, resumable work (behaviour, query-stats, learned-scorer)."""

    def __init__(self, job: ProfileJob):
        super().__init__(job)
        self.seconds = 0.0  # time spent in this stage's sharded work in this run

    @abstractmethod
    def work(self) -> list:
        """This process's work units, in order."""

    def running(self):
        """Context manager around the whole work loop."""
        return nullcontext()

    @abstractmethod
    def compute(self, unit):
        """One unit's result; may be interrupted, so it must not change the stage's totals."""

    @abstractmethod
    def commit(self, unit, result) -> None:
        """Fold ``result`` into the totals (Ctrl-C / SIGTERM held off meanwhile)."""

    def progress_note(self) -> dict[str, str]:
        """Shown after the progress bar (e.g. the success rate so far)."""
        return {}

    @abstractmethod
    def state(self) -> dict[str, np.ndarray]:
        """The totals to checkpoint."""

    @abstractmethod
    def restore(self, arrays: dict[str, np.ndarray]) -> None:
        """Continue from checkpointed totals (``state()``'s arrays; empty when nothing was saved)."""

    @abstractmethod
    def reduce(self) -> None:
        """Add up every process's totals (called on every process)."""
