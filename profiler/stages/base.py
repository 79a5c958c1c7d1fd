"""What a calibration stage is, and what the job does for every stage.

A stage turns model runs into one artifact section.  It declares, as class attributes read
without torch (``profile-model --help`` builds its parser from them):

* ``name`` (as ``--stages`` spells it), ``section`` (the artifact section it writes),
  ``summary`` (one paragraph for ``--help``), ``unit`` / ``units`` (what its progress bar counts);
* ``options``: its settings, each an :class:`common.options.Option` (flag, ``dest``, kind,
  default, help), from which come both its ``argparse`` group and the check of a value given
  in code; ``check_settings(settings)`` for what its settings must satisfy together;
* ``requires(settings)``: the sections it reads that another stage writes
  (:class:`Requirement`), checked for every stage alike before the model loads (built earlier in
  this run, or kept from the artifact at the output path) by ``profiler.stages.check_requirements``;
* ``config()``: the JSON-able settings recorded in the artifact's config under ``section``
  (and part of the resume fingerprint, so a work file of other settings is refused);
* ``rope_reads(settings)``: what of its work calibrates a scorer that reads RoPE (:class:`RopeRead`),
  refused by the job, once the model is loaded and before any stage runs, on a model that rotates
  its queries and keys otherwise (:mod:`runtime.plan.rope_check`);

and implements the parts it needs of one life cycle, which :class:`profiler.job.ProfileJob`
runs the same way for every stage:

1. ``__init__(context)`` once the model is loaded: a frozen
   :class:`profiler.stages.context.StageContext` holds everything a stage may read (model,
   tokenizer, resolved settings, calibration text, probes, the sections kept from the
   artifact at the output path, the process's place in a multi-process run);
2. sharded, resumable work (a :class:`ShardedStage`): ``work()`` returns this process's
   units, in order.
   Inside ``running()`` (a context manager around the whole loop, e.g. an attention capture)
   the job calls ``compute(unit)`` (may be interrupted: must not touch the stage's totals)
   and then ``commit(unit, result)`` with Ctrl-C / SIGTERM held off, so the totals and the
   progress counter always move together.  Every ``checkpoint_every`` units the job saves
   ``state()`` (numpy arrays) into the work file; ``--resume`` hands them to ``restore()``;
3. ``reduce()`` of a sharded stage on every process: add up the shards (``profiler.distributed``);
4. ``build(sections, config)`` on the main process only: the section, given the sections built
   so far in this run merged over those of the existing artifact (the budgets stage reads INFsc
   from there) and the job's configuration.  Unsharded work (the moments stage) happens here.

Adding a stage ``my-stage``: a module ``profiler/stages/my_stage.py`` with a :class:`Stage`
(or :class:`ShardedStage`) subclass, its method in ``profiler/my_stage.py``, its entry in
``profiler.stages.STAGES``, a schema entry in ``artifacts/schema.py`` and its description in
``docs/artifact-format.md`` (and a ``runtime.plan.calibration.Calibration`` field when the runtime serves it).
The job, ``profile-model``'s parser and help, the settings' checks, the required-section check,
resume, multi-process reduction, and ``inspect-artifact`` (a generic summary of any section)
need no change; a dedicated summary in ``artifacts/summary.py`` or a heatmap in
``artifacts/report.py`` is optional.

A stage module imports torch, and the method modules that import it, inside the methods that
use them (``tests/test_cli_conventions.py`` checks), and never imports the job
(``tests/test_profiler_imports.py`` checks that ``profiler/`` has no import cycle).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from artifacts import Section
from common.options import Option, Renamed
from profiler.stages.context import StageContext


@dataclass(frozen=True)
class RopeRead:
    """What of a stage's work calibrates a scorer that reads RoPE (:func:`runtime.plan.rope_check.rope_needs`):
    ``what`` (``"the leverage selection"``), whether it needs the rotation of the ``keys`` and of the
    ``queries``, and ``instead``: the option that runs the stage without it, if one does."""

    what: str
    keys: bool = True
    queries: bool = False
    instead: str | None = None


@dataclass(frozen=True)
class Requirement:
    """Sections a stage reads: ``alternatives`` are sets of section names, any one of which serves
    (``(frozenset({"behaviour"}),)``: the behaviour section); ``what`` says what is read there."""

    what: str
    alternatives: tuple[frozenset[str], ...]

    @classmethod
    def section(cls, name: str, what: str) -> Requirement:
        return cls(what, (frozenset({name}),))

    def met_by(self, available: set[str] | frozenset[str]) -> bool:
        return any(sections <= available for sections in self.alternatives)


class Stage(ABC):
    """A stage without sharded work (budgets, budget-curves, moments, recommendation); see the module docstring."""

    name: ClassVar[str]
    section: ClassVar[str]
    summary: ClassVar[str]
    unit: ClassVar[str] = "item"  # what its progress (sharded work) counts
    units: ClassVar[str] = "items"  # the plural
    options: ClassVar[tuple[Option | Renamed, ...]] = ()  # its own settings (its --help group)
    options_title: ClassVar[str | None] = None  # the --help group's title; default "<name> stage"

    @classmethod
    def rope_reads(cls, settings: Mapping[str, Any]) -> tuple[RopeRead, ...]:
        """What of this stage's work (with these settings) calibrates a scorer that reads RoPE: on a
        model that rotates otherwise (runtime.plan.rope_check) the job refuses it before any stage runs."""
        return ()

    def __init__(self, context: StageContext):
        self.context = context
        self.settings = context.settings

    @classmethod
    def on_by_default(cls, preset) -> bool:
        """Whether a job with this preset (``profiler.presets.ProfilePreset``) and no ``--stages`` runs it:
        unless the preset leaves it out (``stages_off``)."""
        return cls.name not in preset.stages_off

    @classmethod  # noqa: B027 - an optional hook
    def check_settings(cls, settings: Mapping[str, Any]) -> None:
        """Refuse (ValueError) settings that are each valid but not together (before the model loads)."""

    @classmethod
    def requires(cls, settings: Mapping[str, Any]) -> tuple[Requirement, ...]:
        """The sections this stage reads that other stages write (with these settings)."""
        return ()

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The JSON-able settings recorded in the artifact's config under ``section``."""

    @abstractmethod
    def build(self, sections: Mapping[str, Section], config: Mapping[str, Any]) -> Section:
        """The artifact section (main process only), given the sections available so far and the
        job's configuration (``ProfileJob.config()``)."""

    def say(self, message: str) -> None:
        self.context.say(message)


class ShardedStage(Stage):
    """A stage with sharded, resumable work (behaviour, query-stats, future-queries, learned-scorer)."""

    def __init__(self, context: StageContext):
        super().__init__(context)
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
