"""The calibration job: load the model, run the stages, checkpoint, reduce, write the artifact.

The stages (:mod:`profiler.stages`; ``--stages`` selects a subset, run in canonical order)
each write one section.  The job does for all of them what none should do on its own:

* loads the model once (and the calibration text when a stage uses it);
* runs every stage's sharded work in one loop: progress bar, Ctrl-C / SIGTERM handling
  (the last checkpoint is kept, ``--resume`` continues), a work-file checkpoint every
  ``checkpoint_every`` units (:mod:`profiler.checkpoint`);
* reduces across processes, builds the sections on the main process, and writes the artifact
  atomically, keeping the other sections of an existing artifact at the output path when it
  belongs to the same model (same weights, architecture and tokenizer fingerprints).

The stages never see the job: each gets one frozen :class:`profiler.stages.StageContext`
(model, tokenizer, resolved settings, calibration text, probes, the kept sections, the process's
place in the run) and is made only once it exists.

What is at the output path is protected: every setting is checked when the job is made (each
against its declared option, e.g. ``--probes`` and ``--calib-dataset`` read, then the stages'
``check_settings``), and before the model loads the output path (a directory, a device, an
unwritable directory, an input of the run, or a file that is not a kvcal artifact, e.g. the
weights, is refused; an artifact that does not validate, every dataset read, or of another
architecture only with ``force``), the windows against the model's positions (its config),
a ``--resume``'s load options against its work file's, and the sections the stages read
(``requires``: built earlier in the run, or in the artifact at the output path).  Once the
model is loaded and before any stage runs, an artifact of another model of the same
architecture (told by the weights) is replaced only with ``force``; the sections are checked
again against what is then kept.  The run holds an
exclusive lock on ``<out>.lock`` (each process of a multi-process run its own,
``common.atomic.output_lock``), so a second run on the same output is refused instead of
discarding the first one's work file.

The work file's fingerprint covers what its checkpointed sums depend on: the model, the dtype
and attention implementation it was loaded with (``--dtype``, ``--attn-implementation``; also
recorded in the artifact's ``config["profiler"]``), the process count and rank, and the configs
of the sharded stages.  Options of the other stages
(budgets, budget-curves, moments, recommendation: rebuilt from the sums at the end) can change on
``--resume``.

Under ``accelerate launch`` (or ``torchrun``) each process takes every ``world_size``-th unit
of work, keeps its own work file, and at the end the sums are all-reduced
(:mod:`profiler.distributed`); the main process alone writes the artifact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from artifacts import Artifact, ArtifactError, Section, open_artifact, write_artifact
from artifacts.reader import is_artifact_file
from artifacts.schema import canonical_json
from common.atomic import OutputError, check_output_path, lock_file_path, output_lock
from common.log import logger, output
from common.models import CPU_DEFAULT_LOAD, DTYPE_CHOICES, loaded_as, model_files
from profiler import distributed
from profiler.checkpoint import (
    WorkFileMismatch,
    interrupts_deferred,
    load_work,
    remove_work,
    save_work,
    work_file_path,
    work_load,
)
from profiler.model_config import model_config, model_positions, other_architecture
from profiler.presets import PRESETS
from profiler.stages import (
    STAGE_NAMES,
    STAGES,
    Stage,
    StageContext,
    check_requirements,
    default_stages,
    resolve_settings,
)
from profiler.stages.base import ShardedStage
from profiler.stages.context import digest
from runtime.math.geometry import ModelGeometry, check_config
from runtime.plan.calibration import default_artifact_path


class JobInterrupted(Exception):
    """Ctrl-C: progress was saved to ``work_path``; rerun with ``--resume``."""

    def __init__(self, work_path: Path):
        super().__init__(f"interrupted; progress saved in {work_path}")
        self.work_path = work_path


NOTE = logger("profiler")  # notes that something is discarded or replaced: warnings, on stderr even with -q


@dataclass
class JobOptions:
    model: str | None = None  # local dir, hub id, or None for the embedded model
    out: Path | None = None  # default: <model dir>/kv_calibration.h5 when writable, else kvcal's cache
    preset: str = "quick"
    stages: tuple[str, ...] | None = None  # None: the preset's default stages (profiler.stages.default_stages)
    resume: bool = False
    force: bool = False  # replace an artifact of another model, or one that does not validate, at ``out``
    checkpoint_every: int = 4  # units of work (probes, batches) between work-file writes
    device_map: str | None = None
    dtype: str | None = None  # common.models.DTYPE_CHOICES; None: float32 on a CPU, the checkpoint's on a GPU
    attn_implementation: str | None = "auto"  # common.models.load_model's: sdpa, eager where the model soft-caps
    progress: bool = True
    # The settings of the stages and of their shared inputs by name (an Option's ``dest``, e.g.
    # "max_new_tokens", "calib_samples"; profiler.stages.settings_options()); a missing or None
    # value means the default (often the preset's).  An unknown name is refused.
    settings: dict[str, Any] = field(default_factory=dict)
    # a stage summary, what was written: a line of the command's output (kvcal.profiler at INFO)
    log: object = field(default=output("profiler"), repr=False)


def default_output(model_source: str) -> Path:
    """``kv_calibration.h5`` in the model directory when writable, else in kvcal's cache
    (``$XDG_CACHE_HOME/kvcal/artifacts/<org>--<name>/`` for a hub id), where ``load_calibration``
    looks for it too (``runtime.plan.calibration.default_artifact_path``)."""
    return default_artifact_path(model_source)


class ProfileJob:
    """One run of ``profile-model`` (one process of it under ``accelerate``)."""

    def __init__(self, options: JobOptions):
        if options.preset not in PRESETS:
            raise ValueError(f"unknown preset {options.preset!r}; choose from {', '.join(PRESETS)}")
        chosen = default_stages(PRESETS[options.preset]) if options.stages is None else options.stages
        unknown = [s for s in chosen if s not in STAGE_NAMES]
        if unknown or not chosen:
            raise ValueError(f"unknown stage(s) {unknown}; choose from {', '.join(STAGE_NAMES)}")
        if options.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        if options.dtype is not None and options.dtype not in DTYPE_CHOICES:
            raise ValueError(f"unknown dtype {options.dtype!r}; choose from {', '.join(DTYPE_CHOICES)}")
        self.options = options
        self.preset = PRESETS[options.preset]
        self.log = options.log
        self.stage_names = tuple(s for s in STAGE_NAMES if s in chosen)  # canonical order
        self.settings = resolve_settings(options.settings, self.preset, self.stage_names)
        self.stage_classes: list[type[Stage]] = [stage for stage in STAGES if stage.name in self.stage_names]
        self.info = distributed.process_info()

    def say(self, message: str) -> None:
        if self.info.is_main:
            self.log(message)

    # -- inputs shared by stages -------------------------------------------------------------------
    def load(self) -> None:
        from artifacts.fingerprint import model_identity
        from common.models import load_model, load_tokenizer

        options = self.options
        device_map = options.device_map
        if device_map is None and torch.cuda.is_available():
            device_map = "auto" if not self.info.distributed else {"": str(self.info.device)}
        started = time.perf_counter()
        self.tokenizer = load_tokenizer(options.model)
        self.model = load_model(
            options.model, device_map=device_map, dtype=options.dtype, attn_implementation=options.attn_implementation
        )
        self.geometry = ModelGeometry.of(self.model)
        self._check_rope()
        # what the model was loaded as: recorded in the artifact, and part of the work file's fingerprint
        self.loaded = loaded_as(self.model)
        self.identity = model_identity(self.model, self.tokenizer, options.model or "embedded")
        self.say(
            f"model {self.identity.name} ({self.identity.model_type}, {self.geometry.num_layers} "
            f"{'layers' if self.geometry.layer_indices[-1] + 1 == self.geometry.num_layers else 'attention layers'}, "
            f"{self.geometry.num_q_heads} query / {self.geometry.num_kv_heads} KV heads, "
            f"d={self.geometry.head_dim}; {self.loaded['dtype']}, {self.loaded['attn_implementation']} attention) "
            f"loaded in {time.perf_counter() - started:.1f} s; output: {self.out}"
        )

    def _check_rope(self) -> None:
        """Refuse (``UnsupportedModelError``, one line) the chosen stages that calibrate a scorer reading
        RoPE (:meth:`profiler.stages.base.Stage.rope_reads`) on a model that rotates its queries and keys
        otherwise than runtime.math.rope (:mod:`runtime.plan.rope_check`, one short forward pass): the calibration
        would un-rotate them wrongly, and the runtime refuses those scorers there.  Names the model's
        RoPE, the stages, and the stages (and options) that do run."""
        from runtime.math.geometry import UnsupportedModelError
        from runtime.plan.rope_check import rope_problems

        reads = {stage.name: stage.rope_reads(self.settings) for stage in self.stage_classes}
        reads = {name: found for name, found in reads.items() if found}
        if not reads:
            return
        problems = rope_problems(
            self.model,
            keys=any(read.keys for found in reads.values() for read in found),
            queries=any(read.queries for found in reads.values() for read in found),
        )
        if problems is None:
            return
        refused = ", ".join(f"{name} ({', '.join(read.what for read in found)})" for name, found in reads.items())
        instead = {name: found[0].instead for name, found in reads.items() if all(read.instead for read in found)}
        running = [name for name in self.stage_names if name not in reads or name in instead]
        options = " ".join(dict.fromkeys(instead.values()))
        remedy = f"--stages {','.join(running or ('behaviour', 'budgets'))}" + (f" {options}" if options else "")
        stages, verb = ("the stages", "") if len(reads) > 1 else ("the stage", "s")
        raise UnsupportedModelError(
            f"{type(self.model).__name__}: {stages} {refused} calibrate{verb} scorers that need RoPE applied as "
            f"x cos + P(x) sin (P: rotate_half, its inverse or the interleaved pairs' turn; or no RoPE) to the "
            f"pre-RoPE projections, but {problems}; the runtime refuses those scorers on this model. Profile what "
            f"reads no RoPE: {remedy}"
        )

    def context(self, kept: set[str]) -> StageContext:
        """What the stages read (the model loaded; ``kept``: the sections kept from the artifact at the output)."""
        return StageContext(
            preset_name=self.options.preset,
            preset=self.preset,
            settings=self.settings,
            stage_names=self.stage_names,
            model=self.model,
            tokenizer=self.tokenizer,
            geometry=self.geometry,
            identity=self.identity,
            out=self.out,
            existing_sections=frozenset(kept),
            info=self.info,
            progress=self.options.progress,
            log=self.log,
        )

    def config(self) -> dict:
        """The JSON-able job configuration recorded in the artifact (one entry per section)."""
        config = {
            "profiler": {
                "preset": self.options.preset,
                "stages": list(self.stage_names),
                "processes": self.info.world_size,
                "seed": self.settings["seed"],
                **self.loaded,
            }
        }
        for stage in self.stages:
            config[stage.section] = stage.config()
        return config

    # -- run -------------------------------------------------------------------------------------
    def run(self) -> Path:
        from common.models import resolve_model

        options = self.options
        self.model_path = resolve_model(options.model)
        self.out = Path(options.out) if options.out else default_output(self.model_path)
        self._check_before_loading()
        with output_lock(self.out, "profile-model", self.info.rank):
            return self._run_locked()

    def _check_before_loading(self) -> None:
        """What can be checked before the model loads, is (``ValueError`` / ``OutputError``): the output
        (not a directory, not an input, not a file that is not a kvcal artifact, not an artifact that
        does not validate or is of another architecture unless ``force``: every dataset is read) and
        the windows against the model's positions (its config.json).  Another model of the same
        architecture is told only by its weights: refused once they are loaded, before any stage runs."""
        settings = self.settings
        inputs = [settings["probes_file"], *(settings["calib_dataset"] or "").split(",")]
        inputs = [path.strip() for path in inputs if path and path.strip()] + model_files(self.model_path)
        check_output_path(self.out, "artifact", inputs=inputs)
        # and the files written beside it: the work file (through a temporary file) and the lock
        work = work_file_path(self.out, self.info.rank, self.info.world_size)
        check_output_path(work, "work file", inputs=inputs, try_writing=False)
        check_output_path(lock_file_path(self.out, self.info.rank), "lock file", inputs=inputs, atomic=False)
        if self.out.exists() and not is_artifact_file(self.out):
            raise ValueError(
                f"{self.out} exists and is not a kvcal artifact; it is never replaced: choose another --out "
                "(or delete the file yourself)"
            )
        config = self._config = model_config(self.model_path)
        if config is not None:
            check_config(config)  # MLA, Gemma 3n, Gemma 4, Beam: refused by name before the weights load
        if self.out.exists() and not self.options.force:
            try:
                with open_artifact(self.out) as reader:
                    reader.validate()
                    other, stored = reader.model.name, reader.model.arch_fingerprint
                    sections = sorted(reader.sections)
            except ArtifactError as exc:
                raise ValueError(
                    f"{self.out} is a kvcal artifact that does not validate ({exc}); --force replaces it"
                ) from None
            if config is not None and other_architecture(config, stored):
                raise ValueError(
                    f"{self.out} is the artifact of another model ({other}), of another architecture, with section(s) "
                    f"{', '.join(sections)}; --force replaces it, or choose another --out"
                )
        if self.options.resume:
            self._check_resumed_load(config)
        positions = None if config is None else model_positions(config)
        if positions is not None and settings["calib_tokens"] > positions:
            raise ValueError(
                f"calib_tokens (--calib-tokens) is {settings['calib_tokens']}, beyond the model's {positions} "
                "positions (max_position_embeddings, or the attention chunk of a model with chunked attention)"
            )

    def requested_load(self, config) -> dict:
        """How this run asks for its model to be loaded, with the defaults spelt out as they resolve
        (``common.models.load_model``): no --dtype is float32 on a CPU, auto on a GPU; attention auto
        is sdpa, or eager for a model that soft-caps its attention logits."""
        options = self.options
        dtype = options.dtype
        if dtype is None:
            on_cpu = options.device_map in (None, "cpu") and not torch.cuda.is_available()
            dtype = "float32" if on_cpu else "auto"
        attention = options.attn_implementation
        if attention == "auto" and config is not None:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            attention = "eager" if getattr(text, "attn_logit_softcapping", None) else "sdpa"
        return {"dtype": dtype, "attn_implementation": attention}

    def _check_resumed_load(self, config) -> None:
        """``--resume`` with another --dtype or --attn-implementation than the work file's run: refused
        before the model loads (a work file of a version that did not record it: once it is loaded)."""
        work_path = work_file_path(self.out, self.info.rank, self.info.world_size)
        recorded = work_load(work_path)
        if recorded is None:
            return
        self._load_request = self.requested_load(config)
        differs = [
            f"{name} {recorded.get(name)!r} there, {value!r} now"
            for name, value in self._load_request.items()
            if recorded.get(name) != value
        ]
        if differs:
            raise WorkFileMismatch(
                f"--resume: the work file {work_path} was written by a run whose model was loaded otherwise "
                f"({'; '.join(differs)}); rerun with its --dtype / --attn-implementation, or drop --resume to "
                "start over"
            )

    def _run_locked(self) -> Path:
        check_requirements(self.stage_names, self.settings, self._sections_at_output(), self.out)
        self.load()
        kept = self._replaceable_sections()
        check_requirements(self.stage_names, self.settings, kept, self.out)  # --force may have dropped some
        context = self.context(kept)
        self.stages: list[Stage] = [stage(context) for stage in self.stage_classes]
        self.sharded: list[ShardedStage] = [stage for stage in self.stages if isinstance(stage, ShardedStage)]
        config = self.config()
        self._fingerprint = digest(  # the checkpointed work only: see the module docstring
            canonical_json({stage.section: config[stage.section] for stage in self.sharded}),
            self.identity.weights_fingerprint,
            self.identity.arch_fingerprint,
            self.identity.tokenizer_fingerprint,
            self.info.world_size,
            self.info.rank,
            # a load other than the CPU default's (a work file of which keeps the fingerprint it had)
            *((canonical_json(self.loaded),) if self.loaded != CPU_DEFAULT_LOAD else ()),
        )
        self.work_path = work_file_path(self.out, self.info.rank, self.info.world_size)
        self._load_request = self.requested_load(self._config)
        self.progress = {stage.name: 0 for stage in self.sharded}
        self._resume()

        try:
            for stage in self.sharded:
                self._run_work(stage)
        except KeyboardInterrupt:
            self._checkpoint()
            raise JobInterrupted(self.work_path) from None
        for stage in self.sharded:
            stage.reduce()

        path = self.out
        if self.info.is_main:
            try:
                path = self._build_and_write(config)
            except OutputError as exc:
                if self.sharded:
                    raise OutputError(
                        f"{exc}; the finished work is kept in {self.work_path}: rerun with --resume"
                    ) from exc
                raise
        distributed.barrier(self.info)
        remove_work(self.work_path)
        return path

    def _resume(self) -> None:
        saved = load_work(self.work_path, self._fingerprint) if self.options.resume else None
        if saved is not None:
            progress, arrays = saved
            for stage in self.sharded:
                prefix = stage.section + "."
                stage.restore({key[len(prefix) :]: value for key, value in arrays.items() if key.startswith(prefix)})
                self.progress[stage.name] = int(progress.get(stage.name, 0))
            done = ", ".join(f"{stage.name} {self.progress[stage.name]} {stage.units}" for stage in self.sharded)
            self.log(f"[rank {self.info.rank}] resuming from {self.work_path}: {done or 'nothing'} done")
        elif self.options.resume:
            if self.info.is_main:
                NOTE.warning(f"profile-model: --resume: no work file at {self.work_path}; starting from the beginning")
        elif self.work_path.exists():
            NOTE.warning(
                f"profile-model: note: discarding the work file {self.work_path} of an earlier run "
                "(use --resume to continue it)"
            )
            remove_work(self.work_path)

    def _checkpoint(self) -> None:
        arrays = {f"{stage.section}.{key}": value for stage in self.sharded for key, value in stage.state().items()}
        save_work(self.work_path, self._fingerprint, self.progress, arrays, load=self._load_request)

    def _run_work(self, stage: ShardedStage) -> None:
        units = stage.work()
        if not units:
            return
        start, started = self.progress[stage.name], time.perf_counter()
        since_checkpoint = 0
        with (
            tqdm(
                total=len(units),
                initial=start,
                desc=stage.name,
                unit=stage.unit,
                dynamic_ncols=True,
                disable=not (self.options.progress and self.info.is_main),
            ) as bar,
            stage.running(),
        ):
            for position in range(start, len(units)):
                result = stage.compute(units[position])
                with interrupts_deferred():  # totals and progress move together
                    stage.commit(units[position], result)
                    self.progress[stage.name] = position + 1
                    since_checkpoint += 1
                    if since_checkpoint >= self.options.checkpoint_every:
                        self._checkpoint()
                        since_checkpoint = 0
                bar.set_postfix(stage.progress_note(), refresh=False)
                bar.update(1)
        self._checkpoint()
        stage.seconds = time.perf_counter() - started

    # -- the artifact ----------------------------------------------------------------------------
    def _sections_at_output(self) -> set[str]:
        """The sections of the artifact at the output path, whatever its model (before the model loads:
        which are kept is known only once it is, :meth:`_replaceable_sections`)."""
        if not self.out.exists():
            return set()
        try:
            with open_artifact(self.out) as reader:
                return set(reader.sections)
        except ArtifactError:
            return set()

    def _same_model(self, reader) -> bool:
        model, identity = reader.model, self.identity
        return (
            model.weights_fingerprint == identity.weights_fingerprint
            and model.arch_fingerprint == identity.arch_fingerprint
            and model.tokenizer_fingerprint == identity.tokenizer_fingerprint
        )

    def _replaceable_sections(self) -> set[str]:
        """Sections of the artifact already at the output path, when it is for this model (they are
        kept).  An artifact of another model, or one that does not validate, is refused here, before
        any stage runs, unless ``force``: the result would not keep its sections."""
        if not self.out.exists():
            return set()
        try:
            with open_artifact(self.out) as reader:
                if self._same_model(reader):
                    return set(reader.sections)
                other, sections = reader.model.name, sorted(reader.sections)
        except ArtifactError as exc:
            if not self.options.force:
                raise ValueError(
                    f"{self.out} is a kvcal artifact that does not validate ({exc}); --force replaces it"
                ) from None
            return set()
        if not self.options.force:
            raise ValueError(
                f"{self.out} is the artifact of another model ({other}), with section(s) {', '.join(sections)}; "
                "--force replaces it, or choose another --out"
            )
        return set()

    def _existing(self) -> tuple[dict[str, Section], dict]:
        """Sections and config of an artifact already at the output path for the same model, else empty."""
        if not self.out.exists():
            return {}, {}
        try:
            with open_artifact(self.out) as reader:
                if not self._same_model(reader):
                    NOTE.warning(f"profile-model: note: {self.out} belongs to another model; it will be replaced")
                    return {}, {}
                known = {stage.section for stage in STAGES}
                return {name: reader.section(name) for name in known if reader.has(name)}, dict(reader.config)
        except ArtifactError as exc:
            NOTE.warning(
                f"profile-model: note: the existing {self.out} is not a valid artifact ({exc}); it will be replaced"
            )
            return {}, {}

    def _build_and_write(self, config: dict) -> Path:
        existing, old_config = self._existing()
        available, built = dict(existing), {}
        for stage in self.stages:
            built[stage.section] = available[stage.section] = stage.build(available, config)
        kept = {name: section for name, section in existing.items() if name not in built}
        if kept:
            self.log(f"keeping section(s) {', '.join(sorted(kept))} of the existing {self.out}")
        merged_config = {**old_config, **config} if existing else config
        artifact = Artifact(model=self.identity, config=merged_config, sections={**kept, **built})
        path = write_artifact(self.out, artifact)
        self.log(f"wrote {path} (sections: {', '.join(sorted(artifact.sections))})")
        return path


def run_job(options: JobOptions) -> Path:
    return ProfileJob(options).run()
